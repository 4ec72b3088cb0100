"""Why the reset `agentroster replay` prints reapplies signals and not updates
(`replay.reset_command`: `--reapply-exclude Update`).

A reset reapplies the signals and updates that came after its reset point. Updates come
back as `WorkflowExecutionUpdateAdmitted` events, and temporalio 1.35's core hands those
to the workflow in a different order live and in replay (sdk-core
`workflow_machines.rs`: live, the admitted update is delivered in history order among
the signals; in replay it is held until its `UpdateAccepted` event, after every signal
of that task). A workflow whose handlers depend on the order of signals and updates,
as the pool's do (a release before or after an acquire grants a different slot), then
writes a run that does not replay: the wedge the reset was meant to end, again.

These tests build that on the real dev server with a workflow of a few lines: the
default reapply writes a run that does not replay; reapplying signals only (what the
printed command asks for) writes one that does.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyExcludeType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from agentroster.ops.replay import ReplayReport, reset_command
from tests.conftest import eventually


@workflow.defn(name="ReapplyOrder", sandboxed=False)
class ReapplyOrder:
    """Records signals and updates in the order its handlers run; an update that comes
    right after a signal starts a timer (a command that depends on that order)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.signal
    def note(self, name: str) -> None:
        self.seen.append(f"signal {name}")

    @workflow.update
    async def mark(self, name: str) -> list[str]:
        after_signal = bool(self.seen) and self.seen[-1].startswith("signal")
        self.seen.append(f"update {name}")
        seen = list(self.seen)
        if after_signal:
            await workflow.sleep(timedelta(milliseconds=1))
        return seen

    @workflow.query
    def order(self) -> list[str]:
        return self.seen


async def reset_with(client: Client, exclude: list[int]) -> tuple[list[str], Any]:
    """A run sent update a, signal x, update b (each handled in a task of its own), reset to
    its first task; the new run's order of handlers (live) and its history."""
    queue = f"reapply-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[ReapplyOrder]):  # queries read the live instance
        handle = await client.start_workflow(ReapplyOrder.run, id=f"reapply-{uuid.uuid4().hex[:6]}", task_queue=queue)
        assert await handle.execute_update(ReapplyOrder.mark, "a") == ["update a"]
        await handle.signal(ReapplyOrder.note, "x")
        assert await eventually(lambda: handle.query(ReapplyOrder.order)) == ["update a", "signal x"]
        assert await handle.execute_update(ReapplyOrder.mark, "b") == ["update a", "signal x", "update b"]
        first_task = next(
            e.event_id for e in (await handle.fetch_history()).events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
        )
        response = await client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=handle.first_execution_run_id or ""),
                reason="test",
                workflow_task_finish_event_id=first_task,
                request_id=uuid.uuid4().hex,
                reset_reapply_exclude_types=exclude,
            )
        )
        new = client.get_workflow_handle(handle.id, run_id=response.run_id)
        expected = 1 if exclude else 3  # the signal; and the updates when they are reapplied

        async def handled() -> list[str] | None:
            order = await new.query(ReapplyOrder.order)
            return order if len(order) == expected else None

        order = await eventually(handled)
        history = await new.fetch_history()
        await new.terminate("test over")
    return order, history


async def test_reapplied_updates_write_a_run_that_does_not_replay(dev_env: WorkflowEnvironment) -> None:
    order, history = await reset_with(dev_env.client, [])
    # Live, the reapplied updates ran in history order around the signal...
    assert order == ["update a", "signal x", "update b"]
    # ...in replay core hands the signal over first: `b` no longer follows a signal, gives no
    # timer, and the history does not replay. When a temporalio release replays this, the
    # printed reset may reapply updates again.
    result = await Replayer(workflows=[ReapplyOrder]).replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is not None
    assert "Nondeterminism" in str(result.replay_failure)


async def test_the_reset_agentroster_replay_prints_writes_a_run_that_replays(dev_env: WorkflowEnvironment) -> None:
    report = ReplayReport("w", "PoolWorkflow", 40, ok=False, event_id=30, task_event_id=28)
    assert "--reapply-exclude Update" in (reset_command(report, "run") or "")
    order, history = await reset_with(dev_env.client, [ResetReapplyExcludeType.RESET_REAPPLY_EXCLUDE_TYPE_UPDATE])
    assert order == ["signal x"]
    assert not any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ADMITTED for e in history.events)
    result = await Replayer(workflows=[ReapplyOrder]).replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None
