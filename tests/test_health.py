"""Active health checks and the circuit breaker (issue 8, items 3 and 5).

Core: a breaker's state machine under random health results and time; a pool
that stops routing to unhealthy agents, replaces them, and answers per breaker
mode. Real server: in-process agent runtimes that heartbeat while their
`/healthz` fails; the pool's check activity calls it over HTTP.
"""

from __future__ import annotations

import itertools
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentroster import CircuitOpenError
from agentroster.agent.runtime import AgentRuntime
from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest, HealthResult
from agentroster.models import AgentState, PoolPolicy
from agentroster.core.health import CLOSED, HALF_OPEN, OPEN, HealthTracker
from agentroster.core.pool import PoolCore, PoolCoreState
from tests.conftest import eventually

# ------------------------------------------------------------------ core


@settings(max_examples=300, deadline=None)
@given(
    threshold=st.sampled_from([0.25, 0.5, 0.75]),
    cooldown=st.sampled_from([1.0, 10.0]),
    script=st.lists(st.tuples(st.floats(0.0, 20.0), st.integers(0, 3), st.booleans()), min_size=1, max_size=60),
)
def test_breaker_opens_only_over_threshold_and_closes_only_after_probes(threshold: float, cooldown: float, script: list) -> None:
    policy = PoolPolicy(breaker_threshold=threshold, breaker_cooldown_s=cooldown, unhealthy_after=1)
    tracker = HealthTracker()
    agents = ["a0", "a1", "a2", "a3"]
    now = 0.0
    state, since = CLOSED, 0.0
    for advance, which, ok in script:
        now += advance
        tracker.record(agents[which], ok, "", now, policy.unhealthy_after)
        sick = sum(tracker.is_unhealthy(a) for a in agents)
        change = tracker.evaluate_breaker("cap", agents, policy, now)
        if change is not None:
            new, _ = change
            if new == OPEN:
                assert sick / len(agents) > threshold
                assert state in (CLOSED, HALF_OPEN)
            elif new == HALF_OPEN:
                assert state == OPEN and now >= since + cooldown
            else:
                assert sick / len(agents) <= threshold
            state, since = new, now
        assert tracker.breaker_state("cap") == state
        if state == CLOSED:
            assert change is not None or sick / len(agents) <= threshold


def _digest() -> list[CapabilityDigest]:
    return [CapabilityDigest(name="cap", version="1.0.0", max_concurrency=1, cost_class="A")]


def _pool(n: int, policy: PoolPolicy) -> PoolCore:
    core = PoolCore("p")
    ids = itertools.count()
    core.new_id = lambda: f"{next(ids):032x}"  # type: ignore[attr-defined]
    core.set_policy("d", policy)
    for i in range(n):
        core.agent_snapshot(
            AgentSnapshot(agent_id=f"a{i}", deployment="d", endpoint=f"http://10.0.0.{i}:80", state=AgentState.READY, capabilities=_digest()),
            0.0, core.new_id,  # type: ignore[attr-defined]
        )
        for pending in core.take_verifications():
            core.agent_verified(pending, True, 0.0, core.new_id)  # type: ignore[attr-defined]
    return core


def _round(core: PoolCore, now: float, failing: set[str]) -> list[str]:
    checked = [t.agent_id for batch in core.take_health_checks(now) for t in batch]
    core.health_results([HealthResult(agent_id=a, ok=a not in failing, detail="HTTP 503") for a in checked], now)
    core.tick(now, core.new_id)  # type: ignore[attr-defined]
    return checked


def _acquire(core: PoolCore, now: float) -> object:
    return core.acquire(AcquireRequest(ref="cap", wait_s=0, request_id=uuid.uuid4().hex), now, core.new_id)  # type: ignore[attr-defined]


def test_an_unhealthy_agent_is_unroutable_replaced_and_routable_again_when_it_recovers() -> None:
    core = _pool(4, PoolPolicy(min_replicas=4, max_replicas=4, health_interval_s=10, unhealthy_after=2))
    assert sorted(_round(core, 1.0, {"a0"})) == ["a0", "a1", "a2", "a3"]
    assert _round(core, 5.0, {"a0"}) == []  # not due yet
    _round(core, 11.0, {"a0"})
    rows = {r.agent_id: r for r in core.status().agents}
    assert rows["a0"].retiring == "unhealthy" and rows["a0"].health_failures == 2
    assert "a0" not in core.find("cap")
    core._autoscale_dirty = True
    (up,) = core.take_scale_requests(12.0)
    assert up.replicas == 5 and "replacing a0" in up.reason
    _round(core, 21.0, set())  # it answers again before its replacement came
    assert core.status().agents[0].retiring is None and "a0" in core.find("cap")
    restored = PoolCore.from_state(PoolCoreState.model_validate_json(core.to_state().model_dump_json()))
    assert restored.to_state() == core.to_state()


@pytest.mark.parametrize("mode", ["fail_fast", "on_demand", "route_anyway"])
def test_breaker_modes_when_most_agents_are_unhealthy(mode: str) -> None:
    core = _pool(4, PoolPolicy(min_replicas=4, max_replicas=4, health_interval_s=10, unhealthy_after=1, breaker_mode=mode, breaker_cooldown_s=30))
    _round(core, 1.0, {"a0", "a1", "a2"})
    assert core.status().breakers == {"cap": OPEN}
    reply = _acquire(core, 2.0)
    if mode == "fail_fast":
        assert reply.circuit_open and "unhealthy" in reply.circuit_open and reply.lease is None
    elif mode == "on_demand":
        assert reply.lease is not None and reply.lease.agent_id == "a3"  # healthy ones still serve; the rest queue
        assert _acquire(core, 2.5).lease is None
    else:
        assert reply.lease is not None  # panic routing: unhealthy agents take leases too
        leased = {reply.lease.agent_id} | {_acquire(core, 2.0 + i / 10).lease.agent_id for i in range(3)}
        assert leased == {"a0", "a1", "a2", "a3"}
    # Cool-down over: half-open, the sick ones are checked at once; they answer: closed.
    assert core.next_wakeup() <= 31.0
    checked = _round(core, 31.0, set())
    assert {"a0", "a1", "a2"} <= set(checked)
    assert core.status().breakers == {}
    warnings = core.status().warnings
    assert any(f"breaker for cap {HALF_OPEN}" in w for w in warnings)
    assert any("breaker for cap closed" in w for w in warnings)
    if mode == "fail_fast":
        assert _acquire(core, 32.0).lease is not None  # closed: acquires are served again


# ------------------------------------------------------------------ real server


class Agent:
    def __init__(self, stack, agent_id: str) -> None:  # noqa: ANN001
        self.healthy = True
        self.runtime = AgentRuntime(
            agent_id=agent_id, deployment="checked", roster=stack.roster, port=0, host="127.0.0.1", heartbeat_interval_s=2.0
        )

        @self.runtime.capability("test.work", "1.0.0", max_concurrency=1)
        async def work(payload: object) -> object:
            return payload

        @self.runtime.on_health
        def model_client_works() -> bool:
            return self.healthy


@pytest.mark.slow
async def test_a_heartbeating_agent_whose_healthz_fails_is_replaced(stack) -> None:  # noqa: ANN001
    agents = [Agent(stack, f"checked-{i}") for i in range(2)]
    for agent in agents:
        await agent.runtime.start()
    try:
        await stack.roster.set_policy(
            "checked", PoolPolicy(min_replicas=2, max_replicas=2, health_interval_s=1, unhealthy_after=2, breaker_mode="fail_fast")
        )
        agents[0].healthy = False  # its heartbeats go on
        pool = await eventually(lambda: _retired(stack, "checked-0", "unhealthy"), timeout=30, interval=0.3)
        assert any("checked-0 unhealthy after 2 failed check(s): HTTP 503" in w for w in pool.warnings)
        assert (await stack.roster.describe("checked-0")).state == AgentState.READY  # alive by its heartbeats
        for _ in range(3):  # only the healthy one serves
            async with stack.roster.borrow("test.work", timeout=10) as lease:
                assert lease.agent_id == "checked-1"
        # A replacement was asked for (a surge over max); it comes up; the sick one is retired.
        await eventually(lambda: ("scale", "checked", 3) in stack.backend.calls, timeout=15)
        replacement = Agent(stack, "checked-2")
        agents.append(replacement)
        await replacement.runtime.start()
        await eventually(lambda: _terminated(stack, "checked-0"), timeout=30, interval=0.3)
        assert ("mark_for_removal", "checked", "checked-0") in stack.backend.calls
        # Most agents unhealthy: fail_fast answers at once.
        agents[1].healthy = replacement.healthy = False
        await eventually(lambda: _breaker_open(stack), timeout=30, interval=0.3)
        with pytest.raises(CircuitOpenError, match="circuit open for 'test.work'"):
            await stack.roster.acquire("test.work", timeout=10)
    finally:
        for agent in agents:
            await agent.runtime.stop(drain=False)


@pytest.mark.slow
async def test_a_policy_that_sizes_nothing_sets_the_health_checks_and_a_sick_agent_is_recycled_at_the_deployments_size(stack) -> None:  # noqa: ANN001
    agents = [Agent(stack, f"checked-{i}") for i in range(2)]
    for agent in agents:
        await agent.runtime.start()
    try:
        # Checks every second instead of every 300 s, for a deployment nothing sizes.
        policy = await stack.roster.set_policy("checked", {"health_interval_s": 1, "unhealthy_after": 2})
        assert policy is not None and not policy.sizes
        agents[0].healthy = False  # its heartbeats go on
        pool = await eventually(lambda: _retired(stack, "checked-0", "recycled"), timeout=30, interval=0.3)
        assert any("checked-0 unhealthy after 2 failed check(s): HTTP 503" in w for w in pool.warnings)
        for _ in range(3):  # only the healthy one serves
            async with stack.roster.borrow("test.work", timeout=10) as lease:
                assert lease.agent_id == "checked-1"
        # Drained at the deployment's size (no surge): its backend starts a fresh one in its place.
        await eventually(lambda: ("mark_for_removal", "checked", "checked-0") in stack.backend.calls, timeout=15)
        assert ("scale", "checked", 2) in stack.backend.calls and ("scale", "checked", 3) not in stack.backend.calls
        await eventually(lambda: _terminated(stack, "checked-0"), timeout=30, interval=0.3)
    finally:
        for agent in agents:
            await agent.runtime.stop(drain=False)


async def _retired(stack, agent_id: str, reason: str):  # noqa: ANN001, ANN202
    """The status once the pool has retired the agent for `reason`: its row says so, or, for an
    agent drained and gone between two polls (a recycled one), the pool's warning does."""
    status = await stack.roster.status()
    retired = any(a.agent_id == agent_id and a.retiring == reason for a in status.agents)
    warned = f"agent {agent_id} retired from routing: {reason}" in status.warnings
    return status if retired or warned else None


async def _terminated(stack, agent_id: str) -> bool:  # noqa: ANN001
    return (await stack.roster.describe(agent_id)).state == AgentState.TERMINATED


async def _breaker_open(stack) -> bool:  # noqa: ANN001
    return (await stack.roster.status()).breakers.get("test.work") == OPEN


@pytest.mark.slow
async def test_a_failed_reset_refuses_tasks_and_the_agent_is_replaced(stack) -> None:  # noqa: ANN001
    import aiohttp

    agent = Agent(stack, "resetting-0")

    @agent.runtime.on_reset
    def clear_scratch() -> None:
        raise RuntimeError("could not clear the scratch directory")

    await agent.runtime.start()
    try:
        await stack.roster.set_policy("checked", PoolPolicy(min_replicas=1, max_replicas=1, health_interval_s=1, unhealthy_after=1))
        await eventually(lambda: stack.roster.find("test.work"), timeout=30, interval=0.3)  # indexed (checked first)
        async with stack.roster.borrow("test.work", timeout=10) as lease, aiohttp.ClientSession() as http:
            body = {"lease_id": lease.lease_id, "capability": "test.work", "version": lease.version, "input": {"n": 1}}
            async with http.post(f"{lease.endpoint}/tasks/test.work", json=body, headers=stack.roster.lease_headers(lease)) as response:
                assert response.status == 200  # the task itself succeeded; the reset after it did not
            async with http.get(f"{lease.endpoint}/healthz") as response:
                assert response.status == 503 and "clear_scratch" in (await response.json())["reason"]
            async with http.post(f"{lease.endpoint}/tasks/test.work", json=body, headers=stack.roster.lease_headers(lease)) as response:
                assert response.status == 503  # no new task on a dirty agent: it fails over
        # It drains itself; its policy (min_replicas 1) starts its replacement.
        await eventually(lambda: _terminated(stack, "resetting-0"), timeout=30, interval=0.3)
        await eventually(lambda: ("scale", "checked", 1) in stack.backend.calls, timeout=15)
    finally:
        await agent.runtime.stop(drain=False)
