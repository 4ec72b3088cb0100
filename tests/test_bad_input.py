"""Malformed messages are refused with a reason; no workflow is ever broken by one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.client import WorkflowUpdateFailedError

from agentroster import AgentRegistration, AgentState
from tests.conftest import eventually, make_registration

GOOD = make_registration("good", [("rag.search", "2.1.0", 1, "A")]).model_dump(mode="json")


def _variant(**changes):
    raw = {**GOOD, **changes}
    return raw


def _cap(**changes):
    return {**GOOD["capabilities"][0], **changes}


BAD_REGISTRATIONS = [
    ("capabilities.0.version", _variant(capabilities=[_cap(version="2.1")])),
    ("capabilities", _variant(capabilities=[])),
    ("capabilities", _variant(capabilities=[_cap(), _cap()])),
    ("capabilities.0.max_concurrency", _variant(capabilities=[_cap(max_concurrency=0)])),
    ("heartbeat_interval_s", _variant(heartbeat_interval_s=0)),
    ("heartbeat_interval_s", _variant(heartbeat_interval_s=-3)),
    ("metadata", _variant(metadata={"blob": "x" * (17 * 1024)})),
    ("capabilities.0.input_schema", _variant(capabilities=[_cap(input_schema={"type": "no-such-type"})])),
    ("capabilities.0.cost_class", _variant(capabilities=[_cap(cost_class="Z")])),
    ("endpoint", _variant(endpoint="not a url")),
]


@pytest.mark.parametrize("field,raw", BAD_REGISTRATIONS, ids=[f for f, _ in BAD_REGISTRATIONS])
async def test_client_rejects_bad_registration_naming_the_field(stack, field, raw) -> None:
    with pytest.raises(ValidationError) as caught:
        await stack.roster.register(raw)
    assert field in str(caught.value)


async def test_bad_signals_are_refused_and_the_agent_workflow_stays_healthy(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("good", [("rag.search", "2.1.0", 1, "A")]))
    handle = stack.env.client.get_workflow_handle(f"agent/{stack.pool}/good")
    for _, raw in BAD_REGISTRATIONS:
        await handle.signal("register", raw)
    await handle.signal("register", "not even an object")
    await handle.signal("register", {**GOOD, "agent_id": "someone-else"})
    await handle.signal("acquire", {"in_flight": -1, "saturated": True, "seq": 1})
    await handle.signal("release", [1, 2, 3])
    await handle.signal("drain", {"deadline_s": "soon"})
    await handle.signal("heartbeat", {"anything": "goes"})
    refusals = await handle.query("refusals", result_type=list[str])
    assert len(refusals) == len(BAD_REGISTRATIONS) + 5
    text = "\n".join(refusals)
    for field in ("capabilities.0.version", "heartbeat_interval_s", "metadata", "in_flight", "deadline_s", "someone-else"):
        assert field in text
    # Still healthy: it answers, routes, and takes a valid message.
    status = await roster.describe("good")
    assert status.state == AgentState.READY
    lease = await roster.acquire("rag.search")
    await roster.release(lease)
    # (the pool's Ready notice follows the Busy one after at most a second: notices are paced)
    await eventually(lambda: _state_is(roster, "good", AgentState.READY))
    assert (await roster.register(AgentRegistration.model_validate(GOOD))).state == AgentState.READY


async def _state_is(roster: Any, agent_id: str, state: AgentState) -> bool:
    return (await roster.describe(agent_id)).state == state


async def test_bad_messages_to_the_pool_are_refused_and_it_stays_healthy(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("p1", [("rag.search", "2.1.0", 1, "A")]))
    pool = stack.env.client.get_workflow_handle(f"pool/{stack.pool}")
    await pool.signal("agent_snapshots", [{"agent_id": "ghost"}])
    await pool.signal("agent_snapshots", ["garbage"])
    for bad in ({"nope": 1}, 42, [], [""], ["x" * 129]):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await pool.execute_update("release", bad)
        assert "release" in str(refused.value.cause), bad
    request_id = "r" * 32
    for bad in ({"ref": "rag.search@>>2"}, {"ref": "rag.search", "lease_ttl_s": -1}, {"ref": ""}, {"ref": "x", "surprise": 1}, "text"):
        with pytest.raises(WorkflowUpdateFailedError):
            await pool.execute_update("acquire", {"requests": [{"request_id": request_id, **bad} if isinstance(bad, dict) else bad]})
    for bad in ({"ref": "rag.search", "request_id": request_id}, {"requests": []}, {"requests": [], "releases": ["x"]}, "text"):
        with pytest.raises(WorkflowUpdateFailedError):
            await pool.execute_update("acquire", bad)
    with pytest.raises(WorkflowUpdateFailedError):
        await pool.execute_update("cancel", [""])
    refusals = (await roster.status()).refusals  # the signals' refusals (a refused update leaves no trace)
    assert len(refusals) == 2 and all(r.startswith("agent_snapshots refused") for r in refusals)
    assert await roster.find("rag.search") == ["p1"]
    lease = await roster.acquire("rag.search")
    assert lease.agent_id == "p1"
    await roster.release(lease)


async def test_semantically_invalid_snapshots_never_reach_the_index(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("solid", [("rag.search", "2.1.0", 1, "A")]))
    held = await roster.acquire("rag.search")
    waiting = asyncio.create_task(roster.acquire("rag.search", timeout=20))  # a queued waiter makes signals pick
    await eventually(lambda: _waiting(roster))
    pool = stack.env.client.get_workflow_handle(f"pool/{stack.pool}")
    cap = {"name": "rag.search", "max_concurrency": 1, "cost_class": "A"}
    snapshot = {"agent_id": "liar", "deployment": "d", "endpoint": "http://127.0.0.1:1", "state": "Ready"}
    await pool.signal("agent_snapshots", [{**snapshot, "capabilities": [{**cap, "version": "banana"}]}])
    await pool.signal("agent_snapshots", [{**snapshot, "capabilities": [{**cap, "name": "9 bad", "version": "1.0.0"}]}])
    await pool.signal("agent_snapshots", [{**snapshot, "agent_id": "has space", "capabilities": [{**cap, "version": "2.0.0"}]}])
    await pool.signal("agent_snapshots", [{**snapshot, "endpoint": "ftp://x", "capabilities": [{**cap, "version": "2.0.0"}]}])
    with pytest.raises(WorkflowUpdateFailedError) as refused:  # one bad id refuses the batch
        await pool.execute_update("release", ["", held.lease_id])
    assert "release: lease_id" in str(refused.value.cause)
    assert await pool.execute_update("release", [held.lease_id]) == 1
    lease = await asyncio.wait_for(waiting, timeout=20)
    assert lease.agent_id == "solid"
    refusals = (await roster.status()).refusals
    text = "\n".join(refusals)
    for needle in ("capabilities.0.version", "capabilities.0.name", "agent_id", "endpoint"):
        assert needle in text
    assert [a.agent_id for a in (await roster.status()).agents] == ["solid"]
    await roster.release(lease)


async def _waiting(roster) -> bool:
    return (await roster.status()).waiting == 1
