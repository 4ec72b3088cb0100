"""A pool continuing as new under load does not stall its callers.

A release signal arriving while the pool's continue-as-new task runs fails that
task (UnhandledCommand): the worker evicts the run and replays it whole, and
every caller waits (1-2 s under load before 2026-12-03). Near the end of a run
the pool now tells clients in its acquire replies to release by the
`release_leases` update, which the server hands to the next run instead.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowUpdateFailedError

from agentroster.client import AgentRoster
from agentroster.wire import RELEASE_LEASES_UPDATE, PoolInput, pool_workflow_id
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


async def test_a_pool_continues_as_new_under_load_without_a_failed_task(stack) -> None:
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

    async def cycles(roster: AgentRoster) -> None:  # a client of its own: its releases are not batched with others'
        for _ in range(40):
            lease = await roster.acquire("rag.search", timeout=30)
            await roster.release(lease)

    await asyncio.gather(*(cycles(r) for r in rosters))
    runs = await _histories(client, pool_workflow_id(pool))
    assert len(runs) >= 3, f"expected several runs, saw {len(runs)}"
    failed = [
        (n, e.workflow_task_failed_event_attributes.cause)
        for n, events in enumerate(runs)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]
    assert failed == [], f"workflow tasks failed (cause 1 = UnhandledCommand: a signal met the continue-as-new): {failed}"
    # Releases near each run's end went by update; most went as signals (no in-flight update budget used).
    by_update = sum(_updates_named(events, RELEASE_LEASES_UPDATE) for events in runs)
    signals = sum(1 for events in runs for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    assert by_update > 0 and signals > by_update
    status = await roster.status()
    assert status.leases_granted == status.leases_released == 320
    assert status.active_leases == 0


async def test_acquire_replies_say_when_to_release_by_update(stack) -> None:
    pool = f"hint-{uuid.uuid4().hex[:6]}"
    client = stack.env.client
    await client.start_workflow(
        "PoolWorkflow", PoolInput(pool=pool, max_updates_per_run=10), id=pool_workflow_id(pool), task_queue=stack.task_queue
    )
    roster = AgentRoster(client, pool=pool, task_queue=stack.task_queue)
    roster._pool_started = True
    await roster.register(make_registration("hint-agent", [("rag.search", "2.1.0", 1, "B")], heartbeat_interval_s=3600))
    link = roster._links[0]
    seen = []
    for _ in range(12):
        lease = await roster.acquire("rag.search", timeout=30)  # one acquire update, then one release
        seen.append(link.release_by_update)
        await roster.release(lease)
    # Updates 1-7 of a run: signals; from the 8th (80 % of 10), by update; a new run starts over.
    assert seen[:3] == [False, False, False]
    assert any(seen), f"no acquire reply of the run's last fifth asked for releases by update: {seen}"
    first_hint = seen.index(True)
    assert False in seen[first_hint:], f"the hint never cleared after the run continued as new: {seen}"
    handle = client.get_workflow_handle(pool_workflow_id(pool))
    assert await handle.query("runs", result_type=int) >= 1
    status = await roster.status()
    assert status.leases_granted == status.leases_released == 12


async def test_release_leases_update_is_idempotent_and_checks_its_argument(stack) -> None:
    await stack.roster.register(make_registration("upd-agent", [("rag.search", "2.1.0", 2, "B")]))
    lease = await stack.roster.acquire("rag.search", timeout=10)
    handle = stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool))
    assert await handle.execute_update(RELEASE_LEASES_UPDATE, [lease.lease_id, "no-such-lease"], result_type=int) == 1
    assert await handle.execute_update(RELEASE_LEASES_UPDATE, [lease.lease_id], result_type=int) == 0
    for bad in ([], None, "a-lease-id", [None], [1], ["x" * 129], ["x"] * 257, {"lease_ids": ["x"]}):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(RELEASE_LEASES_UPDATE, bad)
        assert "release_leases" in str(refused.value.cause), bad
    with pytest.raises(WorkflowUpdateFailedError):
        await handle.execute_update(RELEASE_LEASES_UPDATE, args=[])  # no argument at all
    status = await stack.roster.status()
    assert status.active_leases == 0 and status.leases_released == 1


