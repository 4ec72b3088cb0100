"""Outlier ejection in the pool's pure core (issue 28, item 1): the rules, by example and by property.

Failures in a row eject an agent; a success rate far below its peers' ejects it; the
ejection lasts base x times (capped); no more than the max share of a capability's
agents is out at once; one trial task after the ejection decides whether it comes back;
refusals neither count nor reset; the state survives continue-as-new. No sizing policy
is needed for any of it.
"""

from __future__ import annotations

import itertools
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from agentroster.core.outliers import OutlierTracker
from agentroster.core.pool import PoolCore, PoolCoreState
from agentroster.messages import OUTCOMES, AcquireRequest, AgentSnapshot, CapabilityDigest, HealthResult
from agentroster.models import AgentState, OutlierPolicy, PoolPolicy


def _pool(n: int, policy: PoolPolicy | None = None, max_concurrency: int = 4) -> PoolCore:
    core = PoolCore("p")
    ids = itertools.count()
    core.new_id = lambda: f"{next(ids):032x}"  # type: ignore[attr-defined]
    if policy is not None:
        core.set_policy("d", policy)
    for i in range(n):
        core.agent_snapshot(
            AgentSnapshot(
                agent_id=f"a{i}", deployment="d", endpoint=f"http://10.0.0.{i}:80", state=AgentState.READY,
                capabilities=[CapabilityDigest(name="cap", version="1.0.0", max_concurrency=max_concurrency, cost_class="A")],
            ),
            0.0, core.new_id,  # type: ignore[attr-defined]
        )
        for pending in core.take_verifications():
            core.agent_verified(pending, True, 0.0, core.new_id)  # type: ignore[attr-defined]
    # The first round of health checks (every deployment has them): all pass.
    checked = [t.agent_id for batch in core.take_health_checks(0.0) for t in batch]
    core.health_results([HealthResult(agent_id=a, ok=True, detail="") for a in checked], 0.0)
    return core


def _task(core: PoolCore, now: float, outcome_of: dict[str, str], default: str = "succeeded") -> str:
    """One task: a lease on the agent the pool picks, released with the agent's outcome. Returns the agent."""
    reply = core.acquire(AcquireRequest(ref="cap", wait_s=0, request_id=uuid.uuid4().hex), now, core.new_id)  # type: ignore[attr-defined]
    assert reply.lease is not None, reply
    agent = reply.lease.agent_id
    core.release(reply.lease.lease_id, now, core.new_id, outcome_of.get(agent, default))  # type: ignore[attr-defined]
    core.tick(now, core.new_id)  # type: ignore[attr-defined]
    return agent


def _row(core: PoolCore, agent_id: str):  # noqa: ANN202
    return next(r for r in core.status().agents if r.agent_id == agent_id)


def test_an_agent_failing_every_task_is_ejected_after_the_threshold_without_any_sizing_policy() -> None:
    core = _pool(4)
    served = [_task(core, t / 10, {"a0": "failed_5xx"}) for t in range(60)]
    # It fails at once, so it is idle and picked first until the threshold ejects it.
    assert served.count("a0") == OutlierPolicy().consecutive_failures
    row = _row(core, "a0")
    assert row.ejected == "3 failed tasks in a row" and row.ejected_until is not None
    assert row.state == AgentState.READY  # alive: not drained, not replaced
    assert "a0" not in core.find("cap")
    assert core.capability_status()["cap"].counters["outcome.failed_5xx"] == 3
    assert any("a0 ejected until" in w for w in core.status().warnings)


def test_the_trial_task_brings_a_recovered_agent_back_and_a_failing_one_out_for_longer() -> None:
    core = _pool(4)
    for t in range(3):
        _task(core, float(t), {"a0": "failed_timeout"})
    first_until = _row(core, "a0").ejected_until
    assert core.next_wakeup() == 2.0 + 30.0  # its ejection's end wakes the pool
    core.tick(40.0, core.new_id)  # type: ignore[attr-defined]
    assert _row(core, "a0").ejected.startswith("probing")
    assert _task(core, 40.0, {"a0": "failed_timeout"}) == "a0"  # the trial (it is idle: picked first) fails
    second = _row(core, "a0")
    assert second.ejected.startswith("its trial task failed") and second.ejected_until > first_until
    assert (second.ejected_until.timestamp() - 40.0) == 60.0  # base x 2
    core.tick(101.0, core.new_id)  # type: ignore[attr-defined]
    # One trial at a time: while it runs, nothing else is routed to the agent.
    trial = core.acquire(AcquireRequest(ref="cap", wait_s=0, request_id=uuid.uuid4().hex), 101.0, core.new_id)  # type: ignore[attr-defined]
    assert trial.lease.agent_id == "a0"
    assert "a0" not in core.find("cap")
    core.release(trial.lease.lease_id, 101.0, core.new_id, "succeeded")  # type: ignore[attr-defined]
    assert _row(core, "a0").ejected is None and "a0" in core.find("cap")


def test_refusals_and_bare_releases_neither_count_nor_reset() -> None:
    tracker = OutlierTracker()
    policy = OutlierPolicy()
    for outcome in ["failed_5xx", "refused_429", "failed_5xx", "refused_503"]:
        tracker.record("a", outcome, "l")
    assert tracker.agents["a"].consecutive == 2 and tracker.trips("a", policy) is None
    tracker.record("a", "failed_unreachable", "l")
    assert tracker.trips("a", policy) == "3 failed tasks in a row"


def test_the_max_ejection_share_holds() -> None:
    core = _pool(4)  # default 50%: two of four at most
    for t in range(40):
        _task(core, t / 10, {"a0": "failed_5xx", "a1": "failed_5xx", "a2": "failed_5xx"})
    out = [r.agent_id for r in core.status().agents if r.ejected]
    assert len(out) == 2
    assert any("not ejected" in w and "max_ejection_percent 50" in w for w in core.status().warnings)


def test_the_only_agent_is_never_ejected() -> None:
    core = _pool(1)
    for t in range(10):
        _task(core, float(t), {"a0": "failed_5xx"})
    assert _row(core, "a0").ejected is None


def test_a_success_rate_far_below_its_peers_ejects_an_agent_that_never_fails_three_in_a_row() -> None:
    core = _pool(4, max_concurrency=1)
    flaky = itertools.cycle(["failed_5xx", "succeeded"])  # 50%: never three failures in a row
    for t in range(50):  # four tasks at once: one on each agent
        leases = [
            core.acquire(AcquireRequest(ref="cap", wait_s=0, request_id=uuid.uuid4().hex), t, core.new_id).lease  # type: ignore[attr-defined]
            for _ in range(4)
        ]
        for lease in leases:
            if lease is not None:
                outcome = next(flaky) if lease.agent_id == "a0" else "succeeded"
                core.release(lease.lease_id, t, core.new_id, outcome)  # type: ignore[attr-defined]
    row = _row(core, "a0")
    assert row.ejected is not None and row.ejected.startswith("success rate"), row


def test_per_deployment_settings_come_from_its_policy() -> None:
    core = _pool(4, PoolPolicy(outliers=OutlierPolicy(consecutive_failures=6)))
    served = [_task(core, t / 10, {"a0": "failed_5xx"}) for t in range(40)]
    assert served.count("a0") == 6
    off = _pool(4, PoolPolicy(outliers=OutlierPolicy(enabled=False)))
    for t in range(40):
        _task(off, t / 10, {"a0": "failed_5xx"})
    assert _row(off, "a0").ejected is None


def test_ejections_survive_continue_as_new() -> None:
    core = _pool(4)
    for t in range(3):
        _task(core, float(t), {"a0": "failed_bad_output"})
    carried = PoolCoreState.model_validate_json(core.to_state().model_dump_json())
    restored = PoolCore.from_state(carried)
    assert restored.to_state() == core.to_state()
    assert _row(restored, "a0").ejected and "a0" not in restored.find("cap")
    assert restored.next_wakeup() == core.next_wakeup()


@settings(max_examples=150, deadline=None)
@given(
    script=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from(OUTCOMES), st.floats(0.0, 50.0)), min_size=1, max_size=120
    ),
    pct=st.sampled_from([0.0, 25.0, 50.0, 100.0]),
)
def test_property_share_cap_routing_and_state(script: list[tuple[int, str, float]], pct: float) -> None:
    """Whatever the outcomes: no more than the share is out, an ejected agent is never
    picked, ejections never outlast max_ejection_s, and the state round-trips."""
    policy = OutlierPolicy(max_ejection_percent=pct)
    core = _pool(5, PoolPolicy(outliers=policy))
    now = 0.0
    for agent_index, outcome, dt in script:
        now += dt
        core.tick(now, core.new_id)  # type: ignore[attr-defined]
        reply = core.acquire(AcquireRequest(ref="cap", wait_s=0, request_id=uuid.uuid4().hex), now, core.new_id)  # type: ignore[attr-defined]
        if reply.lease is None:
            continue
        assert not core.outliers.agents.get(reply.lease.agent_id) or not core.outliers.agents[reply.lease.agent_id].ejected
        core.release(reply.lease.lease_id, now, core.new_id, outcome if agent_index else "succeeded")  # type: ignore[attr-defined]
        out = [a for a in core.outliers.agents if core.outliers.is_ejected(a)]
        assert len(out) <= max(1, int(5 * pct / 100))
        for agent_id in out:
            record = core.outliers.agents[agent_id]
            assert record.until is None or record.until - now <= policy.max_ejection_s
            assert agent_id not in core.find("cap") or not record.ejected
    restored = PoolCore.from_state(PoolCoreState.model_validate_json(core.to_state().model_dump_json()))
    assert restored.to_state() == core.to_state()
    assert restored.find("cap") == core.find("cap")


def test_idle_agents_of_a_deployment_without_a_policy_are_checked_and_a_sick_one_recycled() -> None:
    core = _pool(2)
    assert core.next_wakeup() == 300.0  # DEFAULT_PROTECTION's round
    for now in (300.0, 600.0, 900.0):
        checked = [t.agent_id for batch in core.take_health_checks(now) for t in batch]
        assert sorted(checked) == ["a0", "a1"]
        core.health_results([HealthResult(agent_id=a, ok=a != "a1", detail="HTTP 503") for a in checked], now)
    (down,) = core.take_scale_downs()
    # Drained at the deployment's size: its backend starts a fresh agent in its place.
    assert down.victims == ["a1"] and down.replicas == 2 and down.reason.startswith("recycled: a1 unhealthy")
    assert "a1" not in core.find("cap")


def test_a_policy_without_max_replicas_sets_protection_and_sizes_nothing() -> None:
    core = _pool(2, PoolPolicy(health_interval_s=60, outliers=OutlierPolicy(consecutive_failures=4)))
    assert not core.autoscaler.sizing and core.status().policies["d"].max_replicas is None
    from agentroster.ops.metrics_exporter import pool_families

    bounds = next(f for f in pool_families({"p": core.status()}) if f.name == "agentroster_policy_replicas")
    assert bounds.samples == []  # no replica bounds: it sizes nothing
    assert core.next_wakeup() == 60.0  # its own health round, not the default 300 s
    served = [_task(core, 1 + t / 10, {"a0": "failed_5xx"}) for t in range(20)]
    assert served.count("a0") == 4 and _row(core, "a0").ejected == "4 failed tasks in a row"
    # An unhealthy agent is recycled at the deployment's size, as without a policy.
    for now in (60.0, 120.0, 180.0):
        checked = [t.agent_id for batch in core.take_health_checks(now) for t in batch]
        assert "a1" in checked
        core.health_results([HealthResult(agent_id="a1", ok=False, detail="HTTP 503")], now)
    assert [d.victims for d in core.take_scale_downs()] == [["a1"]]
    # Nothing is sized by the policy: misses make the demand-driven scale-up, as without a policy.
    for _ in range(6):
        core.acquire(AcquireRequest(ref="cap", wait_s=0, request_id=uuid.uuid4().hex), 200.0, core.new_id)  # type: ignore[attr-defined]
    (up,) = core.take_scale_requests(210.0)
    assert "miss(es)" in up.reason and core.deployment_loads() == {}
    restored = PoolCore.from_state(PoolCoreState.model_validate_json(core.to_state().model_dump_json()))
    assert restored.to_state() == core.to_state() and not restored.autoscaler.sizing
    assert restored.status().policies == core.status().policies


def test_agents_a_sizing_policy_was_replacing_are_recycled_when_the_deployment_stops_being_sized() -> None:
    core = _pool(2, PoolPolicy(min_replicas=2, max_replicas=2, max_uses=1, upscale_delay_s=0))
    reply = core.acquire(AcquireRequest(ref="cap", wait_s=0, request_id=uuid.uuid4().hex), 1.0, core.new_id)  # type: ignore[attr-defined]
    assert reply.lease is not None
    worn = reply.lease.agent_id
    assert _row(core, worn).retiring == "worn"  # its replacement would come from the policy
    core.set_policy("d", PoolPolicy(outliers=OutlierPolicy(consecutive_failures=5)))  # sizes nothing now
    (down,) = core.take_scale_downs()
    assert down.victims == [worn] and down.replicas == 2 and down.reason == f"recycled: {worn} reached max_uses"
    assert _row(core, worn).retiring == "recycled" and worn not in core.find("cap")
