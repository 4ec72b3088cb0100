"""The workflows of `bench_supervisor.py`: a supervisor that runs child tasks for a while, and the floor's child.

Kept apart from the benchmark driver so the workflow sandbox imports only this
(temporalio, pydantic and agentroster.contracts), never aiohttp.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from agentroster.contracts import TaskInput

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

    kind: Literal["floor", "pool"]
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


@workflow.defn(name="BenchFloorTaskWorkflow")
class BenchFloorTaskWorkflow:
    """The floor: a child that runs one HTTP activity to the agent, with no pool at all."""

    @workflow.run
    async def run(self, request: FloorInvoke) -> Any:
        return await workflow.execute_activity(
            FLOOR_INVOKE,
            request,
            start_to_close_timeout=timedelta(seconds=request.timeout_s + 10),
            heartbeat_timeout=timedelta(seconds=5),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )


@workflow.defn(name="BenchSupervisorWorkflow")
class BenchSupervisorWorkflow:
    """Runs `concurrency` lanes of children (floor or CapabilityTaskWorkflow) until `seconds` have passed.

    Latency is what the supervisor sees: from the workflow task that starts the child
    to the one that sees it complete (`workflow.now()` of each)."""

    @workflow.run
    async def run(self, segment: SupervisorRun) -> SupervisorFigures:
        figures = SupervisorFigures()
        started = workflow.now()
        stop_at = started + timedelta(seconds=segment.seconds)
        me = workflow.info().workflow_id
        counter = 0
        last = started

        async def lane() -> None:
            nonlocal counter, last
            while workflow.now() < stop_at:
                counter += 1
                child_id = f"{me}/{counter}"
                t0 = workflow.now()
                try:
                    if segment.kind == "floor":
                        await workflow.execute_child_workflow(
                            BenchFloorTaskWorkflow.run, segment.floor, id=child_id, task_queue=segment.task_queue
                        )
                    else:
                        await workflow.execute_child_workflow(
                            "CapabilityTaskWorkflow", segment.task, id=child_id, task_queue=segment.task_queue
                        )
                except ChildWorkflowError as exc:
                    figures.errors.append(f"{child_id}: {exc.cause or exc}")
                    continue
                last = workflow.now()
                figures.latencies_ms.append((last - t0).total_seconds() * 1000)
                figures.child_ids.append(child_id)

        await asyncio.gather(*(lane() for _ in range(segment.concurrency)))
        figures.elapsed_s = (last - started).total_seconds()
        return figures
