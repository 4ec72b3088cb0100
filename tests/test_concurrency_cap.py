"""An agent's total concurrency is capped across its capabilities, by the pool and by the runtime."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from agentroster import AgentRegistration, AgentState, Capability, PoolExhaustedError
from agentroster.agent.runtime import AgentRuntime
from tests.conftest import eventually, make_registration

TWO_CAPS = [("rag.search", "2.1.0", 2, "A"), ("code.exec", "1.0.0", 2, "A")]


async def test_two_capabilities_of_two_slots_take_two_leases_by_default(stack) -> None:
    await stack.roster.register(make_registration("duo", TWO_CAPS))
    first = await stack.roster.acquire("rag.search", timeout=1)
    second = await stack.roster.acquire("code.exec", timeout=1)
    with pytest.raises(PoolExhaustedError) as refused:  # was: a 3rd and a 4th lease
        await stack.roster.acquire("code.exec", timeout=0.5)
    assert refused.value.busy == 1 and refused.value.report.routable == 0
    # Busy means no free slot at all, though code.exec alone has one.
    assert await eventually(lambda: _state(stack, "duo", AgentState.BUSY))
    await stack.roster.release(first)
    third = await stack.roster.acquire("code.exec", timeout=2)  # the agent-wide slot serves either
    assert third.agent_id == "duo"
    for lease in (second, third):
        await stack.roster.release(lease)


async def test_an_explicit_agent_cap_and_a_queued_waiter_on_another_capability(stack) -> None:
    reg = make_registration("trio", TWO_CAPS).model_copy(update={"max_concurrency": 3})
    await stack.roster.register(reg)
    leases = [await stack.roster.acquire(ref, timeout=1) for ref in ("rag.search", "rag.search", "code.exec")]
    waiter = asyncio.create_task(stack.roster.acquire("code.exec", timeout=10))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    await stack.roster.release(leases[0])  # a rag.search slot frees the agent-wide one: code.exec's waiter gets it
    served = await asyncio.wait_for(waiter, timeout=10)
    assert served.capability == "code.exec"
    for lease in (*leases[1:], served):
        await stack.roster.release(lease)


async def _state(stack, agent_id: str, state: AgentState) -> bool:
    return (await stack.roster.describe(agent_id)).state == state


def test_registration_cap_must_be_positive() -> None:
    reg = make_registration("bad", TWO_CAPS).model_dump()
    with pytest.raises(ValueError, match="max_concurrency"):
        AgentRegistration.model_validate({**reg, "max_concurrency": 0})
    assert make_registration("ok", TWO_CAPS).total_concurrency == 2
    assert AgentRegistration.model_validate({**reg, "max_concurrency": 5}).total_concurrency == 5


async def test_the_runtime_answers_429_past_the_agent_cap() -> None:
    # Lease checks off on purpose: this test is about the caps (tests/test_lease_tokens.py covers the checks).
    agent = AgentRuntime(
        "capped", "cap-agent", "http://127.0.0.1:1", port=0, host="127.0.0.1", roster=None, max_concurrency=1, lease_key="insecure-no-auth"
    )
    release = asyncio.Event()

    async def slow(payload: Any) -> dict[str, Any]:
        await release.wait()
        return {}

    agent.add_capability(Capability(name="a.one", version="1.0.0", max_concurrency=2), slow)
    agent.add_capability(Capability(name="b.two", version="1.0.0", max_concurrency=2), slow)
    assert agent.registration().max_concurrency == 1
    # Serve the HTTP side only: no roster is needed to check the task endpoint.
    agent._state = AgentState.READY  # noqa: SLF001 - past start-up, as after registration
    from aiohttp import web

    app = web.Application()
    app.add_routes([web.post("/tasks/{capability}", agent._tasks.handle_task)])  # noqa: SLF001
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            body = {"lease_id": "l1", "capability": "a.one", "version": "1.0.0", "input": {}}
            first = asyncio.create_task(http.post(f"http://127.0.0.1:{port}/tasks/a.one", json=body))
            await eventually(lambda: agent._tasks.in_flight == 1)  # noqa: SLF001
            async with http.post(
                f"http://127.0.0.1:{port}/tasks/b.two", json={**body, "lease_id": "l2", "capability": "b.two"}
            ) as second:
                assert second.status == 429
                assert "max_concurrency across capabilities" in (await second.json())["error"]
            release.set()
            async with await first as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()
