"""An example supervisor: a plan that names capabilities, never agents.

`ExamplePlanWorkflow` searches the bundled documents and evaluates an
expression in parallel (each a `CapabilityTaskWorkflow` child that leases an
agent by capability ref, invokes it and releases the lease), then runs a
Python snippet built from both answers, and returns a summary.

    python -m examples.supervisor      # runs the plan once against a running pool

The workflow must be registered on a worker: the dev stack adds
`EXAMPLE_WORKFLOWS` to its worker on the roster's task queue; `_main()` below
runs a small worker of its own on a separate queue instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from agentroster.models import TaskInput, TaskResult
    from agentroster.workflows.task import CapabilityTaskWorkflow

if TYPE_CHECKING:
    from agentroster.client.roster import AgentRoster

SEARCH_REF = "rag.search@>=2,<3"
MATH_REF = "math.eval@>=1,<2"
CODE_REF = "code.python.exec@>=1"


@dataclass
class PlanInput:
    """What the example plan works on."""

    pool: str = "default"
    task_queue: str | None = None  # where the CapabilityTaskWorkflow children run; None: this workflow's queue
    query: str = "heartbeat"
    expression: str = "sqrt(16) + 2**10"
    acquire_timeout_s: float = 30.0


@dataclass
class PlanSummary:
    """What the example plan returns."""

    top_document: str | None
    hits: int
    value: float
    code_stdout: str
    agents: dict[str, str] = field(default_factory=dict)
    attempts: int = 0


@workflow.defn(name="ExamplePlanWorkflow")
class ExamplePlanWorkflow:
    """Search and compute in parallel, then run a snippet with both results."""

    @workflow.run
    async def run(self, plan: PlanInput) -> PlanSummary:
        search, calc = await asyncio.gather(
            self._task("search", SEARCH_REF, {"query": plan.query, "k": 3}, plan),
            self._task("math", MATH_REF, {"expression": plan.expression}, plan),
        )
        hits = search.output["hits"]
        value = calc.output["value"]
        top = hits[0]["title"] if hits else None
        snippet = f"titles = {[h['title'] for h in hits]!r}\nprint(len(titles), {value!r} * 2)"
        code = await self._task("code", CODE_REF, {"code": snippet, "timeout_s": 10}, plan)
        results = {"search": search, "math": calc, "code": code}
        return PlanSummary(
            top_document=top,
            hits=len(hits),
            value=value,
            code_stdout=code.output["stdout"].strip(),
            agents={f"{r.capability}@{r.version}": r.agent_id for r in results.values()},
            attempts=sum(r.attempts for r in results.values()),
        )

    async def _task(self, step: str, ref: str, payload: dict[str, Any], plan: PlanInput) -> TaskResult:
        return await workflow.execute_child_workflow(
            CapabilityTaskWorkflow.run,
            TaskInput(ref=ref, payload=payload, pool=plan.pool, acquire_timeout_s=plan.acquire_timeout_s),
            id=f"{workflow.info().workflow_id}/{step}",
            task_queue=plan.task_queue or workflow.info().task_queue,
            execution_timeout=timedelta(minutes=10),
        )


EXAMPLE_WORKFLOWS = [ExamplePlanWorkflow]


async def run_plan(
    roster: AgentRoster,
    *,
    query: str = "heartbeat",
    expression: str = "sqrt(16) + 2**10",
    workflow_id: str | None = None,
    acquire_timeout_s: float = 30.0,
    task_queue: str | None = None,
) -> PlanSummary:
    """Run `ExamplePlanWorkflow` in the roster's pool and return its summary.

    It starts on the roster's task queue, or on `task_queue` when a separate
    worker serves the plan there; its children always run on the roster's queue.
    """
    return await roster.client.execute_workflow(
        "ExamplePlanWorkflow",
        PlanInput(
            pool=roster.pool,
            task_queue=roster.task_queue,
            query=query,
            expression=expression,
            acquire_timeout_s=acquire_timeout_s,
        ),
        id=workflow_id or f"example-plan/{uuid.uuid4().hex[:12]}",
        task_queue=task_queue or roster.task_queue,
        result_type=PlanSummary,
        execution_timeout=timedelta(minutes=15),
    )


async def _main() -> None:
    from temporalio.worker import Worker

    from agentroster.client.roster import AgentRoster
    from agentroster.workflows import workflow_runner

    async with AgentRoster.connect() as roster:
        # The plan gets a queue of its own; its CapabilityTaskWorkflow children run on the roster's
        # queue, served by the agentroster worker (which need not know ExamplePlanWorkflow).
        plan_queue = f"{roster.task_queue}-example-plans"
        worker = Worker(roster.client, task_queue=plan_queue, workflows=EXAMPLE_WORKFLOWS, workflow_runner=workflow_runner())
        async with worker:
            summary = await run_plan(roster, task_queue=plan_queue)
    print(json.dumps(dataclasses.asdict(summary), indent=2))


if __name__ == "__main__":
    asyncio.run(_main())
