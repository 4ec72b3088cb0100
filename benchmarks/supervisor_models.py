"""The inputs and results of the benchmark's workflows (`supervisor_workflows.py`), passed through the sandbox."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from agentroster.models import TaskInput

FLOOR_INVOKE = "bench_floor_invoke"


class FloorInvoke(BaseModel):
    """What the floor's one activity POSTs, and to which agent (no pool, no lease)."""

    pool: str
    agent_id: str
    deployment: str
    endpoint: str
    capability: str
    version: str
    payload: Any = None
    timeout_s: float = 30.0


class SupervisorRun(BaseModel):
    """One measured segment: `concurrency` lanes start children one after another for `seconds`."""

    # served: the pool path with `record_agents_served`; signal / noprefetch: see bench_supervisor
    kind: Literal["floor", "pool", "served", "signal", "noprefetch"]
    seconds: float
    concurrency: int = Field(ge=1)
    task_queue: str
    task: TaskInput  # the pool path's child input
    floor: FloorInvoke  # the floor's child input


class SupervisorFigures(BaseModel):
    latencies_ms: list[float] = Field(default_factory=list)
    elapsed_s: float = 0.0
    errors: list[str] = Field(default_factory=list)
    child_ids: list[str] = Field(default_factory=list)
