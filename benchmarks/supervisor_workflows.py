"""The workflows of `bench_supervisor.py`: a supervisor that runs child tasks for a while, and the floor's child.

Kept apart from the benchmark driver so the workflow sandbox imports only this
(temporalio and the models), never aiohttp.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    # Models live in a module passed through the sandbox, as agentroster's contracts
    # do: a workflow run then does not rebuild pydantic classes (a fair floor).
    from benchmarks.supervisor_models import FLOOR_INVOKE, FloorInvoke, SupervisorFigures, SupervisorRun


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
        prefix = f"{me}/{segment.kind}-"  # the worker tells a `signal` or `noprefetch` child by its id
        counter = 0
        last = started

        async def lane() -> None:
            nonlocal counter, last
            while workflow.now() < stop_at:
                counter += 1
                child_id = f"{prefix}{counter}"
                t0 = workflow.now()
                try:
                    if segment.kind == "floor":
                        await workflow.execute_child_workflow(
                            BenchFloorTaskWorkflow.run, segment.floor, id=child_id, task_queue=segment.task_queue
                        )
                    else:
                        task = segment.task.model_copy(update={"record_agents_served": segment.kind == "served"})
                        await workflow.execute_child_workflow("CapabilityTaskWorkflow", task, id=child_id, task_queue=segment.task_queue)
                except ChildWorkflowError as exc:
                    figures.errors.append(f"{child_id}: {exc.cause or exc}")
                    continue
                last = workflow.now()
                figures.latencies_ms.append((last - t0).total_seconds() * 1000)
                figures.child_ids.append(child_id)

        await asyncio.gather(*(lane() for _ in range(segment.concurrency)))
        figures.elapsed_s = (last - started).total_seconds()
        return figures
