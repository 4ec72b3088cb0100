"""Sizing decisions (core/autoscaler.py and PoolCore's policies), property-tested with time passed in.

A simulated deployment follows random load (in flight, waiting) and time; the
autoscaler's requests are carried out (replicas register after a delay, victims
leave). Whatever happens: requests stay within [min, max] (+1 for a recycling
surge), a scale-down never takes a busy agent nor goes below the desired count,
and it only comes after load stayed low for the whole downscale window. With
load held steady, the fleet settles at the desired size.
"""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import AgentState, PoolPolicy
from agentroster.core.autoscaler import Autoscaler, DeploymentLoad, desired_replicas
from agentroster.core.pool import PoolCore, PoolCoreState

policies = st.builds(
    lambda lo, span, target, up, down: PoolPolicy(
        min_replicas=lo, max_replicas=max(1, lo + span), target_in_flight_per_agent=target, upscale_delay_s=up, downscale_delay_s=down
    ),
    st.integers(0, 3),
    st.integers(0, 5),
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    st.sampled_from([0.0, 2.0, 5.0]),
    st.sampled_from([0.0, 10.0, 60.0]),
)
steps = st.lists(
    st.tuples(st.floats(0.1, 30.0), st.integers(0, 20), st.integers(0, 20), st.integers(0, 3)),
    min_size=1,
    max_size=40,
)


class Fleet:
    """One simulated deployment: agents with load, replicas on their way."""

    def __init__(self) -> None:
        self.agents: dict[str, int] = {}  # agent -> in flight
        self.booting: list[float] = []  # when each requested replica registers
        self.ids = itertools.count()

    def spread(self, in_flight: int) -> None:
        """Put `in_flight` tasks on the agents, at most 4 each, filling in id order."""
        left = in_flight
        for agent in sorted(self.agents):
            self.agents[agent] = min(4, left)
            left -= self.agents[agent]

    def load(self, waiting: int) -> DeploymentLoad:
        return DeploymentLoad(
            registered=len(self.agents),
            serving=len(self.agents),
            in_flight=sum(self.agents.values()),
            waiting=waiting,
            idle=[(0, a) for a, n in sorted(self.agents.items()) if n == 0],
        )


@settings(max_examples=200, deadline=None)
@given(policy=policies, script=steps, boot_s=st.sampled_from([0.5, 5.0, 200.0]))
def test_requests_stay_in_bounds_and_downscale_only_idle_agents_after_the_window(
    policy: PoolPolicy, script: list[tuple[float, int, int, int]], boot_s: float
) -> None:
    scaler = Autoscaler()
    scaler.set_policy("d", policy)
    fleet = Fleet()
    now = 1_000.0
    low_since: float | None = None  # since when every evaluation saw less demand than serving agents
    for advance, in_flight, waiting, _ in script:
        now += advance
        for t in [t for t in fleet.booting if t <= now]:
            fleet.booting.remove(t)
            fleet.agents[f"a{next(fleet.ids)}"] = 0
            scaler.registered("d", now)
        fleet.spread(in_flight)
        load = fleet.load(waiting)
        target = desired_replicas(policy, load.in_flight, load.waiting)
        if target < load.serving:
            low_since = now if low_since is None else low_since
        else:
            low_since = None
        ups, downs = scaler.evaluate(now, {"d": load})
        for up in ups:
            assert up.at_least and up.deployment == "d"
            assert up.replicas <= policy.max_replicas, (up, policy)
            # Replicas asked for within the pending TTL are counted; older ones are asked for again
            # (a no-op for the backend when they exist: requests only ever raise the count).
            recent = [t for t in fleet.booting if now - (t - boot_s) < 120]
            assert up.replicas > len(fleet.agents) + len(recent), (up, len(fleet.agents), fleet.booting)
            fleet.booting.extend([now + boot_s] * max(0, up.replicas - len(fleet.agents) - len(fleet.booting)))
        for down in downs:
            assert all(now - (t - boot_s) >= 120 for t in fleet.booting), "scale-down while replicas pending"
            assert low_since is not None and now - low_since >= policy.downscale_delay_s, (now, low_since, policy)
            for victim in down.victims:
                assert fleet.agents[victim] == 0, "a busy agent was chosen"
                del fleet.agents[victim]
            assert len(fleet.agents) >= max(policy.min_replicas, target)
            assert down.replicas == len(fleet.agents)
            low_since = None


@settings(max_examples=100, deadline=None)
@given(policy=policies, in_flight=st.integers(0, 30), waiting=st.integers(0, 30), start=st.integers(0, 8))
def test_steady_load_settles_at_the_desired_size(policy: PoolPolicy, in_flight: int, waiting: int, start: int) -> None:
    scaler = Autoscaler()
    scaler.set_policy("d", policy)
    fleet = Fleet()
    for _ in range(start):
        fleet.agents[f"a{next(fleet.ids)}"] = 0
    now = 0.0
    for _ in range(400):
        now += 1.0
        for t in [t for t in fleet.booting if t <= now]:
            fleet.booting.remove(t)
            fleet.agents[f"a{next(fleet.ids)}"] = 0
            scaler.registered("d", now)
        # The load sits on the agents there are (at most 4 each); the rest waits.
        placed = min(in_flight, 4 * len(fleet.agents))
        fleet.spread(placed)
        ups, downs = scaler.evaluate(now, {"d": fleet.load(waiting + in_flight - placed)})
        for up in ups:
            fleet.booting.extend([now + 3.0] * (up.replicas - len(fleet.agents) - len(fleet.booting)))
        for down in downs:
            for victim in down.victims:
                del fleet.agents[victim]
    expected = desired_replicas(policy, in_flight, waiting)
    busy = sum(1 for n in fleet.agents.values() if n > 0)
    # Down to the desired size, except that busy agents are never taken.
    assert len(fleet.agents) == max(expected, busy), (len(fleet.agents), expected, busy)


def test_policy_state_round_trips() -> None:
    scaler = Autoscaler()
    scaler.set_policy("d", PoolPolicy(min_replicas=1, max_replicas=3, downscale_delay_s=10))
    scaler.evaluate(5.0, {"d": DeploymentLoad(registered=3, serving=3, idle=[(0, "a"), (1, "b"), (2, "c")])})
    again = Autoscaler.from_state(scaler.state())
    assert again.state() == scaler.state()
    assert again.next_due() == scaler.next_due() == 15.0


# ------------------------------------------------------------------ through PoolCore

def _core_with(n: int, policy: PoolPolicy) -> tuple[PoolCore, list[str]]:
    core = PoolCore("p")
    core.set_policy("d", policy)
    ids = itertools.count()
    new_id = lambda: f"{next(ids):032x}"  # noqa: E731
    agents = []
    for i in range(n):
        agent_id = f"d-{i}"
        core.agent_snapshot(
            AgentSnapshot(
                agent_id=agent_id, deployment="d", endpoint="http://h:1", state=AgentState.READY,
                capabilities=[CapabilityDigest(name="cap", version="1.0.0", max_concurrency=2, cost_class="A")],
            ),
            0.0, new_id,
        )
        for pending in core.take_verifications():
            core.agent_verified(pending, True, 0.0, new_id)
        agents.append(agent_id)
    core.new_id = new_id  # type: ignore[attr-defined]
    return core, agents


def _acquire(core: PoolCore, now: float, n: int = 0) -> str | None:
    reply = core.acquire(AcquireRequest(ref="cap", wait_s=30, request_id=f"request-{now}-{n:08d}"), now, core.new_id)  # type: ignore[attr-defined]
    return reply.lease.lease_id if reply.lease else None


def test_pool_scales_down_idle_agents_after_the_window_keeping_busy_ones() -> None:
    core, agents = _core_with(4, PoolPolicy(min_replicas=1, max_replicas=4, target_in_flight_per_agent=1, downscale_delay_s=60))
    held = _acquire(core, 1.0)
    assert held is not None
    busy = core.leases.get(held).agent_id
    assert core.take_scale_requests(2.0) == [] and core.take_scale_downs() == []  # the window opens
    assert core.take_scale_requests(50.0) == [] and core.take_scale_downs() == []
    core._autoscale_dirty = True
    core.take_scale_requests(62.5)
    (down,) = core.take_scale_downs()
    assert busy not in down.victims and len(down.victims) == 3 and down.replicas == 1
    status = core.status()
    assert {r.agent_id: r.retiring for r in status.agents if r.retiring} == {v: "scale-down" for v in down.victims}
    # Retired agents get no lease, even when their own (older) snapshot says Ready.
    for victim in down.victims:
        core.agent_snapshot(
            AgentSnapshot(agent_id=victim, deployment="d", endpoint="http://h:1", state=AgentState.READY,
                          capabilities=[CapabilityDigest(name="cap", version="1.0.0", max_concurrency=2, cost_class="A")]),
            63.0, core.new_id,  # type: ignore[attr-defined]
        )
    second = _acquire(core, 64.0, 1)
    assert second is not None and core.leases.get(second).agent_id == busy
    restored = PoolCore.from_state(PoolCoreState.model_validate_json(core.to_state().model_dump_json()))
    assert restored.to_state() == core.to_state()


def test_pool_replaces_an_agent_that_reached_max_uses_before_retiring_it() -> None:
    core, agents = _core_with(2, PoolPolicy(min_replicas=2, max_replicas=2, target_in_flight_per_agent=1, max_uses=3))
    for i in range(3):
        lease = _acquire(core, 1.0 + i, i)
        assert lease is not None
        assert core.leases.get(lease).agent_id == "d-0"  # cost ties: by id, and d-0 is free again
        core.release(lease, 1.5 + i, core.new_id)  # type: ignore[attr-defined]
    assert [r.retiring for r in core.status().agents] == ["worn", None]
    core._autoscale_dirty = True
    (up,) = core.take_scale_requests(10.0)
    assert up.replicas == 3 and "replacing d-0" in up.reason  # a surge of one, over max
    assert core.take_scale_downs() == []
    # The replacement registers: then the worn agent goes.
    core.agent_snapshot(
        AgentSnapshot(agent_id="d-2", deployment="d", endpoint="http://h:1", state=AgentState.READY,
                      capabilities=[CapabilityDigest(name="cap", version="1.0.0", max_concurrency=2, cost_class="A")]),
        12.0, core.new_id,  # type: ignore[attr-defined]
    )
    for pending in core.take_verifications():
        core.agent_verified(pending, True, 12.0, core.new_id)  # type: ignore[attr-defined]
    core.take_scale_requests(14.0)
    (down,) = core.take_scale_downs()
    assert down.victims == ["d-0"] and down.replicas == 2 and down.reason.startswith("recycled")
    assert math.isclose(len([a for a in core.status().agents if a.retiring is None]), 2)
