"""A pool continuing as new under load does not stall its callers.

A signal arriving while the pool's continue-as-new task runs would fail that task
(UnhandledCommand): the worker would evict the run and replay it whole, and every
caller would wait. Clients send the pool updates only (`acquire`, `release`,
`cancel`, `renew`): one admitted while the run continues as new is refused with a
retryable reason and answered by the next run.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowUpdateFailedError

from agentroster.client import transport
from agentroster.client.roster import AgentRoster
from agentroster.vocabulary.wire import PoolInput, pool_workflow_id
from tests.conftest import make_registration


async def _histories(client: Client, workflow_id: str) -> list[list[Any]]:
    runs = []
    async for execution in client.list_workflows(f'WorkflowId="{workflow_id}"'):
        history = await client.get_workflow_handle(workflow_id, run_id=execution.run_id).fetch_history()
        runs.append(list(history.events))
    return runs


def _updates_named(events: list[Any], name: str) -> int:
    return sum(
        1
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
        and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name == name
    )


@pytest.mark.parametrize("resend", ["hedged", "every update sent three times"])
async def test_a_pool_continues_as_new_under_load_without_a_failed_task(stack, monkeypatch, resend) -> None:
    """Acquires and releases unanswered for a moment go again under their update ids
    (`transport.Hedge`); sent three times each, at once, across continue-as-new, every
    count still holds: a resend in the same run joins its update, one in the next run
    gets the lease its request id already holds, or releases nothing twice."""
    if resend != "hedged":
        monkeypatch.setattr(transport, "HEDGE_MIN_S", 0.0)
        monkeypatch.setattr(transport, "HEDGE_MAX_S", 0.0)
    pool = f"stall-{uuid.uuid4().hex[:6]}"
    client = stack.env.client
    await client.start_workflow(
        "PoolWorkflow", PoolInput(pool=pool, max_updates_per_run=60), id=pool_workflow_id(pool), task_queue=stack.task_queue
    )
    rosters = [AgentRoster(client, pool=pool, task_queue=stack.task_queue) for _ in range(8)]
    for roster in rosters:
        roster._pool_started = True
    roster = rosters[0]
    for i in range(4):
        await roster.register(make_registration(f"stall-agent-{i}", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))

    granted: list[str] = []

    async def cycles(roster: AgentRoster) -> None:  # a client of its own: its releases are not batched with others'
        for _ in range(40):
            lease = await roster.acquire("rag.search", timeout=30)
            granted.append(lease.lease_id)
            await roster.release(lease)

    await asyncio.gather(*(cycles(r) for r in rosters))
    assert len(set(granted)) == len(granted) == 320
    runs = await _histories(client, pool_workflow_id(pool))
    assert len(runs) >= 3, f"expected several runs, saw {len(runs)}"
    failed = [
        (n, e.workflow_task_failed_event_attributes.cause)
        for n, events in enumerate(runs)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]
    assert failed == [], f"workflow tasks failed (cause 1 = UnhandledCommand: a signal met the continue-as-new): {failed}"
    # Releases went by update (or rode on acquires); no client sent the pool a signal.
    assert sum(_updates_named(events, "release") for events in runs) > 0
    signals = [e for events in runs for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]
    assert all(e.workflow_execution_signaled_event_attributes.signal_name == "agent_snapshots" for e in signals)
    status = await roster.status()
    assert status.leases_granted == status.leases_released == 320
    assert status.active_leases == 0


async def test_the_release_update_is_idempotent_and_checks_its_argument(stack) -> None:
    await stack.roster.register(make_registration("upd-agent", [("rag.search", "2.1.0", 2, "B")]))
    lease = await stack.roster.acquire("rag.search", timeout=10)
    handle = stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool))
    assert await handle.execute_update("release", [lease.lease_id, "no-such-lease"], result_type=int) == 1
    assert await handle.execute_update("release", [lease.lease_id], result_type=int) == 0
    for bad in ([], None, "a-lease-id", [None], [1], ["x" * 129], ["x"] * 257, {"lease_ids": ["x"]}):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("release", bad)
        assert "release" in str(refused.value.cause), bad
    with pytest.raises(WorkflowUpdateFailedError):
        await handle.execute_update("release", args=[])  # no argument at all
    status = await stack.roster.status()
    assert status.active_leases == 0 and status.leases_released == 1




def _activities_named(events: list[Any], name: str) -> int:
    return sum(
        1
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == name
    )


async def test_a_run_continued_as_new_sends_again_only_what_had_not_gone(stack) -> None:
    """Index notices and load notices are chores that never report: a run carries them across a
    continue-as-new only while their activity has not succeeded. Runs shorter than the carry time
    (CARRY_S) used to send every agent its index notice again in each run, and start each run
    cold, sending load notices at every wake; the run after a hot one is hot too."""
    pool = f"carry-{uuid.uuid4().hex[:6]}"
    client = stack.env.client
    await client.start_workflow(
        # 160 leases by 4 callers: 80 updates at the fewest (callers in step share each acquire
        # and each release update), so 4 runs or more.
        "PoolWorkflow", PoolInput(pool=pool, max_updates_per_run=20), id=pool_workflow_id(pool), task_queue=stack.task_queue
    )
    roster = AgentRoster(client, pool=pool, task_queue=stack.task_queue)
    roster._pool_started = True
    for i in range(4):
        await roster.register(make_registration(f"carry-agent-{i}", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))

    async def cycles() -> None:
        for _ in range(40):
            lease = await roster.acquire("rag.search", timeout=30)
            await roster.release(lease)

    await asyncio.gather(*(cycles() for _ in range(4)))
    runs = await _histories(client, pool_workflow_id(pool))  # newest first
    assert len(runs) >= 4, f"expected several runs, saw {len(runs)}"
    told = [_activities_named(events, "tell_indexed") for events in reversed(runs)]
    assert sum(told) <= 4, f"index notices per run, oldest first: {told}"  # one per registration at most
    # Each run after the first starts with its predecessor's latest wakes.
    starts = [events[0].workflow_execution_started_event_attributes.input.payloads[0].data for events in reversed(runs)]
    carried = [json.loads(data).get("wakes", []) for data in starts[1:]]
    assert all(carried), carried
