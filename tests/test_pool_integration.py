"""Leases through a real pool workflow on the dev server."""

from __future__ import annotations

import asyncio

import pytest

from agentroster import AgentState, PoolExhaustedError
from agentroster.errors import AgentRosterError
from tests.conftest import eventually, make_registration


async def test_register_find_acquire_release(stack) -> None:
    roster = stack.roster
    status = await roster.register(make_registration("a1", [("rag.search", "2.1.0", 1, "B")]))
    assert status.state == AgentState.READY
    assert [t.to_state for t in status.transitions] == [AgentState.SPAWNING, AgentState.REGISTERING, AgentState.READY]
    assert await roster.find("rag.search@>=2,<3") == ["a1"]
    lease = await roster.acquire("rag.search@>=2,<3", timeout=2)
    assert (lease.agent_id, lease.capability, lease.version) == ("a1", "rag.search", "2.1.0")
    assert len(lease.lease_id) >= 32 and lease.deadline > lease.granted_at
    assert await roster.find("rag.search@>=2,<3") == []  # saturated: backpressure
    await roster.release(lease)
    await roster.release(lease)  # idempotent
    async with roster.borrow("rag.search", timeout=2) as again:
        assert again.agent_id == "a1"
    pool = await roster.status()
    assert pool.active_leases == 0 and pool.leases_granted == 2 and pool.leases_released == 2


async def test_saturated_agent_turns_busy_and_back_ready(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("solo", [("math.eval", "1.0.0", 2, "A")]))
    first = await roster.acquire("math.eval", timeout=2)
    assert (await roster.describe("solo")).state == AgentState.READY  # one free slot: still routable
    assert await roster.find("math.eval") == ["solo"]
    second = await roster.acquire("math.eval", timeout=2)
    busy = await eventually(lambda: _state_is(roster, "solo", AgentState.BUSY))
    assert busy.in_flight == 2
    await roster.release(first)
    ready = await eventually(lambda: _state_is(roster, "solo", AgentState.READY))
    assert ready.in_flight == 1
    await roster.release(second)
    reasons = [(t.from_state, t.to_state) for t in (await roster.describe("solo")).recent_load_flips]
    assert (AgentState.READY, AgentState.BUSY) in reasons and (AgentState.BUSY, AgentState.READY) in reasons


async def _state_is(roster, agent_id, state):
    status = await roster.describe(agent_id)
    return status if status.state == state else None


async def test_cheapest_then_least_loaded_then_version_range(stack) -> None:
    roster = stack.roster
    await asyncio.gather(
        roster.register(make_registration("pricey", [("rag.search", "2.0.0", 4, "C")])),
        roster.register(make_registration("cheap-1", [("rag.search", "2.3.0", 2, "A")])),
        roster.register(make_registration("cheap-2", [("rag.search", "2.2.0", 2, "A")])),
        roster.register(make_registration("old", [("rag.search", "1.9.0", 4, "A")])),
        roster.register(make_registration("next", [("rag.search", "3.0.0", 4, "A")])),
    )
    assert await roster.find("rag.search@>=2,<3") == ["cheap-1", "cheap-2", "pricey"]
    a = await roster.acquire("rag.search@>=2,<3")
    b = await roster.acquire("rag.search@>=2,<3")
    assert (a.agent_id, b.agent_id) == ("cheap-1", "cheap-2")  # cost first, then fewest in flight
    c = await roster.acquire("rag.search@>=2,<3")
    d = await roster.acquire("rag.search@>=2,<3")
    assert {c.agent_id, d.agent_id} == {"cheap-1", "cheap-2"}
    e = await roster.acquire("rag.search@>=2,<3")
    assert e.agent_id == "pricey"  # the cheap ones are full: spill to the expensive class
    assert (await roster.acquire("rag.search@<2")).agent_id == "old"
    assert (await roster.acquire("rag.search@>=3")).agent_id == "next"
    status = await roster.status()
    assert any("capability drift: rag.search" in w for w in status.warnings)


async def test_pool_exhausted_error_reports_counts(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("one", [("code.exec", "1.0.0", 1, "C")]))
    await roster.register(make_registration("two", [("code.exec", "1.0.0", 1, "C")]))
    held = [await roster.acquire("code.exec"), await roster.acquire("code.exec")]
    await roster.drain("two", wait=False)
    with pytest.raises(PoolExhaustedError) as caught:
        await roster.acquire("code.exec@>=1", timeout=0.5)
    err = caught.value
    assert err.matching == 2 and err.busy == 1 and err.draining == 1
    assert err.waited_s >= 0.5
    text = str(err)
    assert "code.exec@>=1" in text and "2 agent(s) match" in text and "1 busy" in text and "1 draining" in text
    with pytest.raises(PoolExhaustedError) as none:
        await roster.acquire("nothing.here", timeout=0)
    assert none.value.matching == 0
    for lease in held:
        await roster.release(lease)


async def test_waiters_are_served_first_come_first_served(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("narrow", [("rag.search", "2.1.0", 1, "B")]))
    held = await roster.acquire("rag.search")
    order: list[int] = []

    async def waiter(i: int) -> None:
        lease = await roster.acquire("rag.search", timeout=20)
        order.append(i)
        await asyncio.sleep(0.05)
        await roster.release(lease)

    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(waiter(i)))
        await eventually(lambda: _waiting(roster, i + 1))
    await roster.release(held)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3]


async def _waiting(roster, n):
    return (await roster.status()).waiting >= n


async def test_many_concurrent_acquirers_beyond_update_limit(stack) -> None:
    """40 callers (the server allows 10 in-flight updates per workflow) on 4 slots: all served."""
    roster = stack.roster
    await roster.register(make_registration("w1", [("rag.search", "2.1.0", 2, "B")]))
    await roster.register(make_registration("w2", [("rag.search", "2.1.0", 2, "B")]))
    served: list[str] = []

    async def one() -> None:
        async with roster.borrow("rag.search@>=2", timeout=60) as lease:
            served.append(lease.agent_id)
            await asyncio.sleep(0.02)

    await asyncio.gather(*(one() for _ in range(40)))
    assert len(served) == 40
    status = await roster.status()
    assert status.active_leases == 0 and status.waiting == 0
    assert all(a.in_flight == 0 for a in status.agents)


async def test_lease_expires_and_frees_the_slot(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("ttl", [("rag.search", "2.1.0", 1, "B")]))
    lease = await roster.acquire("rag.search", lease_ttl_s=1.0)
    assert (await roster.status()).active_leases == 1
    await eventually(lambda: _found(roster, "rag.search", ["ttl"]), timeout=10)
    status = await roster.status()
    assert status.leases_expired == 1 and status.active_leases == 0
    await roster.release(lease)  # late release of an expired lease: harmless


async def _found(roster, ref, expected):
    return await roster.find(ref) == expected


async def test_acquire_timeout_validation(stack) -> None:
    with pytest.raises(ValueError, match="timeout"):
        await stack.roster.acquire("rag.search", timeout=-1)
    with pytest.raises(ValueError, match="specifier"):
        await stack.roster.acquire("rag.search@>>2")
    with pytest.raises(AgentRosterError):
        await stack.roster.register(make_registration("x", [("rag.search", "2.1.0", 1, "B")]), timeout=0.001)
