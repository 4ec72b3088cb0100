"""Agent lifecycle through real agent workflows: heartbeats, loss, drain, re-registration."""

from __future__ import annotations

import asyncio

import pytest

from agentroster import AgentState, AgentStatus
from agentroster.errors import AgentNotFoundError
from tests.conftest import eventually, make_registration


async def test_missed_heartbeats_terminate_delete_pod_and_revoke(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("flaky", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=1.0))
    await roster.register(make_registration("steady", [("rag.search", "2.1.0", 2, "C")], heartbeat_interval_s=30))
    lease = await roster.acquire("rag.search")
    assert lease.agent_id == "flaky"
    for _ in range(4):  # alive while it heartbeats
        await roster.heartbeat("flaky")
        await asyncio.sleep(0.4)
    assert (await roster.describe("flaky")).state in (AgentState.READY, AgentState.BUSY)
    handle = stack.env.client.get_workflow_handle(f"agent/{stack.pool}/flaky", result_type=AgentStatus)
    final = await asyncio.wait_for(handle.result(), timeout=15)
    assert final.state == AgentState.TERMINATED and final.terminated_reason == "heartbeat_lost"
    assert final.transitions[-1].reason == "heartbeat_lost"
    assert ("delete_pod", "search-agent", "flaky") in stack.backend.calls
    await eventually(lambda: _found(roster, "rag.search", ["steady"]))
    # Unrouted as soon as its Terminated snapshot arrives; the lease ends once the pool has read
    # the agent workflow's own word (snapshot-as-hint): one activity later.
    await eventually(lambda: _no_active_lease(roster))
    assert (await roster.status()).leases_revoked == 1
    assert "flaky" not in [a.agent_id for a in (await roster.status()).agents]
    with pytest.raises(AgentNotFoundError):
        await roster.heartbeat("flaky")
    # Coming back means registering again: a fresh run.
    again = await roster.register(make_registration("flaky", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=30))
    assert again.state == AgentState.READY
    assert [t.to_state for t in again.transitions][0] == AgentState.SPAWNING
    assert await roster.find("rag.search") == ["flaky", "steady"]


async def _no_active_lease(roster):
    return (await roster.status()).active_leases == 0


async def _found(roster, ref, expected):
    return await roster.find(ref) == expected


async def test_drain_stops_new_leases_and_finishes_at_zero_in_flight(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("old-pod", [("rag.search", "2.1.0", 4, "A")]))
    await roster.register(make_registration("new-pod", [("rag.search", "2.1.0", 4, "B")]))
    lease = await roster.acquire("rag.search")
    assert lease.agent_id == "old-pod"
    draining = asyncio.create_task(roster.drain("old-pod", reason="rollout"))
    await eventually(lambda: _state_is(roster, "old-pod", AgentState.DRAINING))
    assert await roster.find("rag.search") == ["new-pod"]
    assert (await roster.acquire("rag.search")).agent_id == "new-pod"
    await asyncio.sleep(0.3)
    assert not draining.done()  # waits for the in-flight task
    await roster.release(lease)
    final = await asyncio.wait_for(draining, timeout=10)
    assert final.state == AgentState.TERMINATED and final.terminated_reason == "drain"
    steps = [(t.from_state, t.to_state, t.reason) for t in final.transitions]
    assert (AgentState.READY, AgentState.DRAINING, "rollout") in steps or (AgentState.BUSY, AgentState.DRAINING, "rollout") in steps
    assert ("delete_pod", "search-agent", "old-pod") in stack.backend.calls
    assert (await roster.describe("old-pod")).state == AgentState.TERMINATED
    # draining an agent that already ended just reports it
    assert (await roster.drain("old-pod")).state == AgentState.TERMINATED


async def _state_is(roster, agent_id, state):
    return (await roster.describe(agent_id)).state == state


async def test_drain_deadline_ends_a_stuck_drain(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("stuck", [("rag.search", "2.1.0", 1, "A")]))
    await roster.acquire("rag.search")
    final = await asyncio.wait_for(roster.drain("stuck", deadline_s=1.0), timeout=10)
    assert final.terminated_reason == "drain"
    assert final.transitions[-1].reason == "drain: deadline passed with 1 task(s) in flight"


async def test_re_register_updates_capabilities(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("morph", [("rag.search", "2.1.0", 1, "A")]))
    status = await roster.register(make_registration("morph", [("rag.search", "2.2.0", 1, "A"), ("math.eval", "1.0.0", 1, "A")]))
    assert status.state == AgentState.READY
    assert [t.reason for t in status.transitions][-2:] == ["re-registered", "indexed by pool"]
    assert await roster.find("math.eval") == ["morph"]
    lease = await roster.acquire("rag.search@>=2.2")
    assert lease.version == "2.2.0"


async def test_search_attributes_follow_transitions(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("visible", [("rag.search", "2.1.0", 1, "A")], deployment="search-v2"))
    query = f'AgentPool="{stack.pool}" AND AgentState="Ready" AND AgentDeployment="search-v2" AND AgentCapabilities="rag.search@2.1.0"'

    async def listed() -> list[str]:
        return [wf.id async for wf in stack.env.client.list_workflows(query)]

    assert await eventually(listed, timeout=15) == [f"agent/{stack.pool}/visible"]
    await roster.drain("visible")
    done = f'AgentPool="{stack.pool}" AND AgentState="Terminated"'
    assert await eventually(lambda: _ids(stack, done), timeout=15) == [f"agent/{stack.pool}/visible"]


async def _ids(stack, query):
    return [wf.id async for wf in stack.env.client.list_workflows(query)]
