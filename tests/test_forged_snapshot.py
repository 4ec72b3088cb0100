"""Forged `agent_snapshots` signals for an agent the pool already indexes (issue 7, chaos row 4b).

A plain temporalio client (no agentroster code on the sender's side) signals the
pool what anyone can build from the agent workflow's own queries, changed: the
pool applies what the agent workflow itself reports (the `read_agent` activity,
patch `snapshot-as-hint`), never what the signal said, and says so in its
`refusals`. Genuine changes through the real path (re-registration, a drain)
still take effect, and a snapshot that only confirms what the pool has costs no
activity. Real dev server; invariants only, no timing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from agentroster.client.roster import AgentRoster
from agentroster.errors import PoolExhaustedError
from agentroster.vocabulary.wire import READ_AGENTS, agent_workflow_id, pool_workflow_id
from tests.conftest import eventually, make_registration

REF = "rag.search@>=2,<3"


async def _raw_client(stack: Any) -> Client:
    """The attacker: a plain client, default data converter, nothing of ours."""
    return await Client.connect(stack.env.client.service_client.config.target_host, namespace=stack.env.client.namespace)


async def _genuine_snapshot(stack: Any, attacker: Client, agent_id: str) -> dict[str, Any]:
    """What the agent workflow itself would send now (its `snapshot` query, readable by anyone)."""
    snap = await attacker.get_workflow_handle(agent_workflow_id(stack.pool, agent_id)).query("snapshot")
    assert snap and snap["agent_id"] == agent_id
    return snap


async def _refusals(attacker: Client, stack: Any) -> list[str]:
    status = await attacker.get_workflow_handle(pool_workflow_id(stack.pool)).query("status")
    return status.get("refusals", [])


async def _refused(attacker: Client, stack: Any, agent_id: str, count: int = 1) -> list[str]:
    """Wait until the pool has refused `count` hints for this agent (the read came back)."""

    async def check() -> list[str] | None:
        mine = [r for r in await _refusals(attacker, stack) if f"agent {agent_id} not updated as sent" in r]
        return mine if len(mine) >= count else None

    return await eventually(check, timeout=20)


async def _reads(stack: Any) -> int:
    """Agent workflows the pool has scheduled a read of (every run): each agent of a `read_agents` batch."""
    count = 0
    async for wf in stack.env.client.list_workflows(f'WorkflowId="{pool_workflow_id(stack.pool)}"'):
        history = await stack.env.client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        for e in history.events:
            if e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                continue
            scheduled = e.activity_task_scheduled_event_attributes
            if scheduled.activity_type.name == READ_AGENTS:
                count += len(json.loads(scheduled.input.payloads[0].data)["agent_ids"])
    return count


async def test_forged_max_concurrency_grants_no_extra_lease(stack) -> None:
    roster: AgentRoster = stack.roster
    await roster.register(make_registration("victim", [("rag.search", "2.1.0", 2, "B")]))
    held = [await roster.acquire(REF, timeout=5) for _ in range(2)]  # the agent is full
    attacker = await _raw_client(stack)
    forged = await _genuine_snapshot(stack, attacker, "victim")
    forged.update(
        max_concurrency=50,
        capabilities=[{**c, "max_concurrency": 50} for c in forged["capabilities"]],
        endpoint="http://attacker.invalid:1",
    )
    await attacker.get_workflow_handle(pool_workflow_id(stack.pool)).signal("agent_snapshots", [forged])
    await roster.status()  # answered once the signal is applied (the read may still be on its way)
    with pytest.raises(PoolExhaustedError):
        await roster.acquire(REF, timeout=0.5)
    (refusal,) = await _refused(attacker, stack, "victim")
    assert "max_concurrency 2, not 50" in refusal and "attacker.invalid" in refusal
    with pytest.raises(PoolExhaustedError):  # and not after the read either
        await roster.acquire(REF, timeout=0.2)
    assert (await roster.describe("victim")).in_flight == 2
    for lease in held:
        assert lease.endpoint == "http://127.0.0.1:9"
        await roster.release(lease)
    again = await roster.acquire(REF, timeout=5)
    assert again.endpoint == "http://127.0.0.1:9"  # tasks still go to the agent itself
    await roster.release(again)


async def test_forged_termination_revokes_nothing(stack) -> None:
    roster: AgentRoster = stack.roster
    await roster.register(make_registration("victim", [("rag.search", "2.1.0", 2, "B")]))
    lease = await roster.acquire(REF, timeout=5)
    attacker = await _raw_client(stack)
    forged = {**await _genuine_snapshot(stack, attacker, "victim"), "state": "Terminated", "reason": "forged"}
    pool = attacker.get_workflow_handle(pool_workflow_id(stack.pool))
    await pool.signal("agent_snapshots", [forged])
    await pool.signal("agent_snapshots", [{**forged, "state": "Draining"}])  # while the first read is on its way
    assert (await roster.status()).active_leases == 1  # answered once both signals are applied
    refusals = await _refused(attacker, stack, "victim")
    assert "state Ready, not Terminated" in refusals[0] or "state Ready, not Draining" in refusals[0]
    assert (await roster.status()).active_leases == 1
    renewed = await roster.renew(lease)  # raises LeaseLostError if the forged word had ended it
    assert renewed.lease_id == lease.lease_id
    status = await roster.status()
    assert [(a.agent_id, a.state.value) for a in status.agents] == [("victim", "Ready")]
    assert status.leases_revoked == 0 and status.agents_lost == 0
    # Routed again once the reads are back (a forged Draining/Terminated holds new leases for one read).
    await eventually(lambda: _found(roster, ["victim"]), timeout=20)
    await roster.release(lease)


async def test_a_confirming_snapshot_costs_no_read_and_a_change_costs_one(stack) -> None:
    roster: AgentRoster = stack.roster
    await roster.register(make_registration("steady", [("rag.search", "2.1.0", 2, "B")]))
    attacker = await _raw_client(stack)
    pool = attacker.get_workflow_handle(pool_workflow_id(stack.pool))
    reads = await eventually(lambda: _reads(stack))  # the new agent's own read
    same = await _genuine_snapshot(stack, attacker, "steady")  # exactly what its resync sends
    for _ in range(3):
        await pool.signal("agent_snapshots", [same])
    await roster.status()  # a query is answered after the signals before it were applied
    assert await _reads(stack) == reads
    assert not [r for r in await _refusals(attacker, stack) if "steady" in r]
    await pool.signal("agent_snapshots", [{**same, "max_concurrency": 7}])
    await _refused(attacker, stack, "steady")
    assert await _reads(stack) == reads + 1


async def test_a_genuine_reregistration_takes_effect(stack) -> None:
    roster: AgentRoster = stack.roster
    await roster.register(make_registration("grower", [("rag.search", "2.1.0", 1, "B")]))
    first = await roster.acquire(REF, timeout=5)
    with pytest.raises(PoolExhaustedError):
        await roster.acquire(REF, timeout=0.2)
    # Through the real path: more slots, and a new capability.
    await roster.register(make_registration("grower", [("rag.search", "2.1.0", 3, "B"), ("code.run", "1.0.0", 1, "A")]))
    await eventually(lambda: roster.find("code.run"), timeout=15)
    more = [await roster.acquire(REF, timeout=5) for _ in range(2)]
    assert {lease.agent_id for lease in more} == {"grower"}
    assert (await roster.describe("grower")).in_flight == 3
    attacker = await _raw_client(stack)
    assert not [r for r in await _refusals(attacker, stack) if "grower" in r]
    for lease in [first, *more]:
        await roster.release(lease)


async def test_a_genuine_termination_still_revokes(stack) -> None:
    roster: AgentRoster = stack.roster
    await roster.register(make_registration("leaving", [("rag.search", "2.1.0", 2, "B")]))
    await roster.acquire(REF, timeout=5)
    ended = await roster.drain("leaving", reason="drain", deadline_s=0.5)  # the lease outlives the deadline
    assert ended.state.value == "Terminated"
    await eventually(lambda: _gone(roster, "leaving"), timeout=20)
    status = await roster.status()
    assert status.leases_revoked == 1 and status.active_leases == 0
    assert [row.agent_id for row in status.recently_ended] == ["leaving"]


async def _found(roster: AgentRoster, expected: list[str]) -> bool:
    return await roster.find(REF) == expected


async def _gone(roster: AgentRoster, agent_id: str) -> bool:
    return agent_id not in [a.agent_id for a in (await roster.status()).agents]


async def test_a_read_report_the_pool_never_asked_for_is_only_a_hint(stack) -> None:
    """A `report` of a read whose key is no chore of this run: a previous run's read (its
    activity outlives the run) reporting what it found back then, or anyone's forgery. It
    judges nothing: the pool reads the agent workflow again and applies what that says."""
    roster: AgentRoster = stack.roster
    await roster.register(make_registration("victim", [("rag.search", "2.1.0", 2, "B")]))
    lease = await roster.acquire(REF, timeout=5)
    attacker = await _raw_client(stack)
    genuine = await _genuine_snapshot(stack, attacker, "victim")
    pool = attacker.get_workflow_handle(pool_workflow_id(stack.pool))
    reads_before = await _reads(stack)
    for count, change in enumerate((
        {"state": "Terminated", "reason": "forged"},
        {"capabilities": [{**c, "max_concurrency": 50} for c in genuine["capabilities"]], "endpoint": "http://attacker.invalid:1"},
    ), start=1):
        await pool.execute_update("report", {
            "key": "read-from-nowhere", "kind": "read",
            "result": {"agent_ids": ["victim"], "readings": {"victim": {"snapshot": {**genuine, **change}}}},
        })
        await eventually(lambda: _more_reads(stack, reads_before), timeout=20)
        # That read answered before the next forgery: one arriving while a read of this run
        # is out is ignored (the read was asked later), and would ask for no read of its own.
        await _refused(attacker, stack, "victim", count=count)
        reads_before = await _reads(stack)
    status = await roster.status()
    assert [(a.agent_id, a.state.value) for a in status.agents] == [("victim", "Ready")]
    assert status.active_leases == 1 and status.leases_revoked == 0 and status.agents_lost == 0
    assert (await roster.renew(lease)).lease_id == lease.lease_id  # raises LeaseLostError had the report ended it
    second = await roster.acquire(REF, timeout=5)
    assert second.endpoint == "http://127.0.0.1:9"
    with pytest.raises(PoolExhaustedError):  # still 2 slots, not 50
        await roster.acquire(REF, timeout=0.5)
    await roster.release_many([lease, second])


async def _more_reads(stack: Any, before: int) -> bool:
    return await _reads(stack) > before
