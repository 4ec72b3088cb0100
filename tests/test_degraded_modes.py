"""The breaker's degraded modes, end to end: agent runtimes on real HTTP that keep
heartbeating while their `/healthz` fails; the pool's checks find them unhealthy and the
capability's breaker opens. `on_demand` starts fresh agents (a scale-up of the deployment
within its policy: the stack's backend records it, and the test starts the agent the
backend would) and a caller waiting meanwhile gets one; `route_anyway` routes to the sick."""

from __future__ import annotations

import asyncio

import pytest

from agentroster.agent.runtime import AgentRuntime
from agentroster.core.health import OPEN
from agentroster.models import PoolPolicy
from tests.conftest import eventually


class Agent:
    def __init__(self, stack, agent_id: str, deployment: str) -> None:  # noqa: ANN001
        self.healthy = True
        self.runtime = AgentRuntime(
            agent_id=agent_id, deployment=deployment, roster=stack.roster, port=0, host="127.0.0.1", heartbeat_interval_s=2.0
        )

        @self.runtime.capability("test.work", "1.0.0", max_concurrency=1)
        async def work(payload: object) -> object:
            return payload

        @self.runtime.on_health
        def model_client_works() -> bool:
            return self.healthy


async def _breaker_open(stack) -> bool:  # noqa: ANN001
    return (await stack.roster.status()).breakers.get("test.work") == OPEN


async def _ready_in_pool(stack, ids: set[str]) -> bool:  # noqa: ANN001
    rows = (await stack.roster.status()).agents
    return ids <= {row.agent_id for row in rows if row.state == "Ready"}


async def _fleet(stack, deployment: str, mode: str) -> list[Agent]:  # noqa: ANN001
    agents = [Agent(stack, f"{deployment}-{i}", deployment) for i in range(2)]
    for agent in agents:
        await agent.runtime.start()
    await stack.roster.set_policy(
        deployment,
        PoolPolicy(min_replicas=2, max_replicas=4, health_interval_s=1, unhealthy_after=1, breaker_mode=mode, breaker_cooldown_s=600),
    )
    # Both in the pool's index first: a check that finds one sick before the other has
    # registered opens the breaker on 1 of 1, and it asks for one fresh agent, not two.
    await eventually(lambda: _ready_in_pool(stack, {a.runtime.agent_id for a in agents}), timeout=30, interval=0.2)
    for agent in agents:
        agent.healthy = False  # their heartbeats go on
    await eventually(lambda: _breaker_open(stack), timeout=30, interval=0.3)
    return agents


@pytest.mark.slow
async def test_on_demand_starts_fresh_agents_and_the_waiter_gets_one(stack) -> None:  # noqa: ANN001
    agents = await _fleet(stack, "od", "on_demand")
    try:
        # The breaker asked for two fresh agents (one per unhealthy one) as it opened, within
        # max_replicas 4. Read at once: `warnings` keeps the latest 20, and the failing health
        # checks (one a second) add theirs.
        status = await stack.roster.status()
        assert any("breaker for test.work open (on_demand): 2 fresh agent(s)" in w for w in status.warnings), status.warnings
        waiter = asyncio.create_task(stack.roster.acquire("test.work", timeout=60))
        await eventually(lambda: ("scale", "od", 4) in stack.backend.calls, timeout=15)
        assert not waiter.done()  # the sick ones are not routed to: it waits
        fresh = Agent(stack, "od-fresh", "od")
        agents.append(fresh)
        await fresh.runtime.start()
        lease = await waiter
        assert lease.agent_id == "od-fresh"
        await stack.roster.release(lease)
    finally:
        for agent in agents:
            await agent.runtime.stop(drain=False)


@pytest.mark.slow
async def test_route_anyway_routes_to_unhealthy_agents_while_the_breaker_is_open(stack) -> None:  # noqa: ANN001
    agents = await _fleet(stack, "ra", "route_anyway")
    try:
        first = await stack.roster.acquire("test.work", timeout=10)
        second = await stack.roster.acquire("test.work", timeout=10)
        assert {first.agent_id, second.agent_id} == {"ra-0", "ra-1"}  # both sick ones serve
        assert all(row.retiring == "unhealthy" for row in (await stack.roster.status()).agents)
        await stack.roster.release_many([first, second])
        # A task reaches a sick agent over HTTP (its /healthz fails; its tasks need not).
        result = await stack.roster.invoke("test.work", {"n": 1}, timeout=10, full=True)
        assert result.output == {"n": 1} and result.agent_id in ("ra-0", "ra-1")
    finally:
        for agent in agents:
            await agent.runtime.stop(drain=False)
