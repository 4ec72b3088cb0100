"""A pool workflow that lost its state relearns its fleet at once (a visibility query and a
read of each agent workflow found running), and acquires issued meanwhile wait, then succeed."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.api.enums.v1 import EventType

from agentroster import CapabilityUnknownError
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import eventually, make_registration

AGENTS = ("re-1", "re-2", "re-3")


async def _fleet(stack) -> None:
    for agent_id in AGENTS:
        await stack.roster.register(make_registration(agent_id, [("rag.search", "2.1.0", 2, "A")]))


async def _scheduled(stack, activity: str) -> int:
    events = (await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()).events
    return sum(
        e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity
        for e in events
    )


async def test_a_terminated_pool_relearns_its_fleet_and_a_waiting_acquire_gets_a_lease(stack) -> None:
    await _fleet(stack)
    lease = await stack.roster.acquire("rag.search@>=2", timeout=5)
    await stack.roster.release(lease)
    await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).terminate("by mistake")

    async def heartbeats() -> None:  # the agents keep heartbeating, as live agents do
        while True:
            await asyncio.gather(*(stack.roster.heartbeat(a) for a in AGENTS))
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(heartbeats())
    try:
        # Issued while no pool runs: it starts a fresh run, which knows no capability yet.
        lease = await stack.roster.acquire("rag.search@>=2", timeout=30)
        assert lease.agent_id in AGENTS
        status = await eventually(lambda: _relearnt(stack), timeout=30)
        assert sorted(a.agent_id for a in status.agents) == sorted(AGENTS)
        assert await _scheduled(stack, "find_agents") == 1  # one listing, however many agents
        await stack.roster.release(lease)
        # Once relearnt, a name no agent offers fails as unknown again, at once.
        with pytest.raises(CapabilityUnknownError):
            await stack.roster.acquire("text.lower@>=1", timeout=30)
    finally:
        beating.cancel()


async def _relearnt(stack):
    status = await stack.roster.status()
    return status if not status.relearning and len(status.agents) == len(AGENTS) else None


async def test_a_waiter_for_a_name_the_relearnt_fleet_lacks_learns_it_is_unknown(stack) -> None:
    await _fleet(stack)
    await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).terminate("reset by hand")
    with pytest.raises(CapabilityUnknownError) as caught:
        await stack.roster.acquire("text.lower@>=1", timeout=30)
    assert "text.lower" in str(caught.value)
    status = await stack.roster.status()
    assert not status.relearning and sorted(a.agent_id for a in status.agents) == sorted(AGENTS)


# ------------------------------------------------------------------ core


def _snapshot(agent_id: str, name: str = "rag.search"):
    from agentroster.messages import AgentSnapshot, CapabilityDigest
    from agentroster.models import AgentState

    return AgentSnapshot(
        agent_id=agent_id, deployment="d", endpoint=f"http://{agent_id}:80", state=AgentState.READY,
        capabilities=[CapabilityDigest(name=name, version="2.1.0", max_concurrency=1, cost_class="A")], resync_interval_s=30.0,
    )


def test_core_relearning_holds_acquires_for_unlearnt_names_then_serves_or_refuses_them() -> None:
    from agentroster.core.pool import PoolCore, PoolCoreState
    from agentroster.messages import AcquireRequest

    core = PoolCore("p")
    core.verify_known_agents = True
    ids = iter(range(10_000))
    new_id = lambda: f"{next(ids):032x}"  # noqa: E731
    core.begin_relearn()
    known = core.acquire(AcquireRequest(ref="rag.search", wait_s=30, request_id="r" * 32), 0.0, new_id)
    unknown = core.acquire(AcquireRequest(ref="text.lower", wait_s=30, request_id="u" * 32), 0.0, new_id)
    assert known.ticket and unknown.ticket and not known.unknown_capability  # both wait
    assert core.status().relearning
    # A continue-as-new meanwhile carries the relearning on: the next run lists again.
    assert PoolCore.from_state(PoolCoreState.model_validate_json(core.to_state().model_dump_json())).relearning
    core.relearn_found({"a1": "d", "a2": "d"}, 1.0)
    assert sorted(core.take_verifications()) == ["a1", "a2"] and core.relearning
    core.agent_read("a1", _snapshot("a1"), "", 1.5, new_id)
    assert core.ticket_status(known.ticket).lease.agent_id == "a1"  # served by the first agent learnt
    assert core.ticket_status(unknown.ticket).pending
    core.agent_read("a2", None, "not running", 2.0, new_id)  # ended since the listing: nothing learnt, no refusal
    core.relearn_progress(2.0)
    assert not core.relearning and core.take_refusals() == []
    ended = core.ticket_status(unknown.ticket)
    assert not ended.pending and ended.unknown_capability
    assert core.acquire(AcquireRequest(ref="text.lower", wait_s=30, request_id="v" * 32), 3.0, new_id).unknown_capability  # at once again
