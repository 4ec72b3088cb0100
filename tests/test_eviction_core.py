"""Eviction safety in the pool's pure core: `EvictionGuard` and its hooks in `PoolCore`.

`GuardMachine` drives the guard with random sequences of silence reports (asks),
heartbeats coming back, agents leaving, operator confirmations, policy changes,
time and continue-as-new round trips, against its own model of the fleet, and
checks the properties the pool promises:

* never more than max(1, cap_fraction x agents) unconfirmed terminations in any
  one heartbeat window;
* a single loss in a healthy fleet (nothing else silent, nothing terminated in
  the window) is allowed at once;
* while more than `threshold` of the pool is silent (held agents and those
  terminated within the window; at least two), nothing more is allowed unless
  an operator confirmed it; the status says so;
* a refusal always carries a retry-after, and a refused agent is listed silent.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agentroster.messages import AgentSnapshot, CapabilityDigest, EvictionAsk
from agentroster.models import AgentState, EvictionPolicy
from agentroster.core.eviction import MIN_RETRY_S, EvictionGuard, cap_for
from agentroster.core.pool import PoolCore, PoolCoreState


class GuardMachine(RuleBasedStateMachine):
    @initialize(
        fleet=st.integers(1, 14),
        window=st.sampled_from([3.0, 10.0, 30.0]),
        threshold=st.sampled_from([0.3, 0.5, 0.75, 1.0]),
        cap_fraction=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    )
    def setup(self, fleet: int, window: float, threshold: float, cap_fraction: float) -> None:
        self.policy = EvictionPolicy(threshold=threshold, cap_fraction=cap_fraction)
        self.guard = EvictionGuard(self.policy)
        self.n = fleet
        self.window = window
        self.now = 1_000.0
        self.members = {f"a{i}" for i in range(fleet)}  # in the pool's index
        self.silent: set[str] = set()  # held (asked, refused)
        self.confirmed: set[str] = set()  # silent agents an operator confirmed
        self.allowed: list[tuple[str, float, bool]] = []  # (agent, at, confirmed)

    # ------------------------------------------------------------ the model
    def in_window(self) -> list[tuple[str, float, bool]]:
        return [(a, at, c) for a, at, c in self.allowed if self.now < at + self.window]

    def lost_and_population(self, extra: str | None = None) -> tuple[int, int]:
        """The definition, by sets: silent (held or terminated within the window) of the pool's agents
        plus those, leaving out what an operator confirmed."""
        recent = self.in_window()
        confirmed = (self.confirmed & self.silent) | {a for a, _, c in recent if c}
        lost = ((self.silent | ({extra} if extra else set())) - confirmed) | {a for a, _, c in recent if not c}
        everyone = self.members | {a for a, _, _ in recent}
        return len(lost), len(everyone - confirmed)

    def size(self) -> int:
        return len(self.members)

    def member(self, agent_id: str) -> bool:
        return agent_id in self.members

    # ---------------------------------------------------------------- rules
    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.0, 5.0, 12.0, 40.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.members)
    @rule(data=st.data())
    def ask(self, data: st.DataObject) -> None:
        agent = data.draw(st.sampled_from(sorted(self.members)))
        already = any(a == agent for a, _, _ in self.in_window())
        healthy = not self.silent and not [1 for _, _, c in self.in_window() if not c]
        lost, population = self.lost_and_population(extra=agent)
        was_confirmed = agent in self.confirmed
        verdict = self.guard.ask(agent, self.window, self.now, self.size(), self.member(agent))
        if already:
            assert verdict.allow  # a retried ask
            return
        if not self.policy.enabled:
            assert verdict.allow
        elif was_confirmed:
            assert verdict.allow, verdict
        elif healthy:
            assert verdict.allow, ("a single loss in a healthy fleet must be allowed", verdict)
        else:  # the guard's own count is the definition's
            engaged = lost >= 2 and lost > self.policy.threshold * population
            assert self.guard.status().self_preservation == engaged, (lost, population, self.guard.status())
        if self.policy.enabled and not was_confirmed and lost >= 2 and lost > self.policy.threshold * population:
            assert not verdict.allow, ("above the threshold nothing is allowed", lost, population, verdict)
            assert verdict.self_preservation and self.guard.status().self_preservation
            assert "self-preservation" in verdict.reason and self.guard.status().warning
        if verdict.allow:
            self.silent.discard(agent)
            self.allowed.append((agent, self.now, was_confirmed))
            self.confirmed.discard(agent)
            unconfirmed = [1 for _, _, c in self.in_window() if not c]
            if self.policy.enabled and not was_confirmed:  # (confirmed ones and safety off: outside the cap)
                assert len(unconfirmed) <= cap_for(self.policy, self.n), (len(unconfirmed), self.n, self.policy)
        else:
            assert verdict.retry_after_s >= MIN_RETRY_S
            self.silent.add(agent)
            assert agent in self.guard.status().silent

    @precondition(lambda self: self.silent or self.allowed)
    @rule(data=st.data())
    def heartbeat_returns(self, data: st.DataObject) -> None:
        pending = sorted(self.silent | {a for a, _, _ in self.allowed if a in self.members})
        if not pending:
            return
        agent = data.draw(st.sampled_from(pending))
        self.guard.heard_from(agent, self.now, self.size())
        self.silent.discard(agent)
        self.confirmed.discard(agent)
        self.allowed = [(a, at, c) for a, at, c in self.allowed if a != agent]

    @precondition(lambda self: any(a in self.members for a, _, _ in self.allowed))
    @rule(data=st.data())
    def allowed_agent_terminates(self, data: st.DataObject) -> None:
        agent = data.draw(st.sampled_from(sorted(a for a, _, _ in self.allowed if a in self.members)))
        self.members.discard(agent)
        self.silent.discard(agent)  # (allowed once, then held again after its window: it goes all the same)
        self.confirmed.discard(agent)
        self.guard.forget(agent, self.now, self.size())

    @precondition(lambda self: self.silent)
    @rule(data=st.data())
    def silent_agent_dropped(self, data: st.DataObject) -> None:
        """Drained, or dropped as stale: it leaves the pool without an eviction."""
        agent = data.draw(st.sampled_from(sorted(self.silent)))
        self.members.discard(agent)
        self.silent.discard(agent)
        self.confirmed.discard(agent)
        self.guard.forget(agent, self.now, self.size())

    @rule(data=st.data(), everyone=st.booleans())
    def operator_confirms(self, data: st.DataObject, everyone: bool) -> None:
        if everyone:
            wanted = None
            expected = sorted(self.silent)
        else:
            wanted = data.draw(st.lists(st.sampled_from(sorted(self.members | {"stranger"})), max_size=3))
            expected = sorted(set(wanted) & self.silent)
        confirmed = self.guard.confirm(wanted, self.now, self.size())
        assert sorted(confirmed) == expected
        self.confirmed |= set(confirmed)
        assert set(self.guard.releasable()) >= set(confirmed)

    @rule(enabled=st.booleans())
    def operator_toggles(self, enabled: bool) -> None:
        self.policy = self.policy.model_copy(update={"enabled": enabled})
        self.guard.set_policy(self.policy, self.now, self.size())
        if not enabled:
            assert not self.guard.active

    @rule()
    def continue_as_new(self) -> None:
        carried = json.loads(json.dumps(self.guard.state(), allow_nan=False))
        before = self.guard.status()
        self.guard = EvictionGuard.from_state(carried)
        assert self.guard.status() == before

    # ----------------------------------------------------------- invariants
    @invariant()
    def status_matches_the_model(self) -> None:
        if not hasattr(self, "guard"):
            return
        status = self.guard.status()
        assert set(status.silent) == self.silent - self.confirmed
        assert set(status.confirmed) == self.silent & self.confirmed
        if status.self_preservation:
            assert status.warning and self.policy.enabled


TestGuardProperties = GuardMachine.TestCase
TestGuardProperties.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --------------------------------------------------------------- examples
def _members(*ids: str):  # noqa: ANN202
    pool = set(ids)
    return pool, pool.__contains__


def test_three_of_four_silent_at_once() -> None:
    guard = EvictionGuard()
    members, member = _members("a", "b", "c", "live")
    first = guard.ask("a", 3.0, 100.0, len(members), member("a"))
    assert first.allow and not first.self_preservation
    members.discard("a")  # it terminated
    guard.forget("a", 100.1, len(members))
    second = guard.ask("b", 3.0, 100.2, len(members), member("b"))
    assert not second.allow and "cap" in second.reason and second.retry_after_s == pytest.approx(2.8)
    third = guard.ask("c", 3.0, 100.3, len(members), member("c"))
    assert not third.allow and third.self_preservation and third.retry_after_s == 3.0
    status = guard.status()
    assert status.self_preservation and status.silent == ["b", "c"] and "3 of 4" in (status.warning or "")
    assert status.evictions_allowed == 1 and status.evictions_denied == 2 and status.self_preservation_activations == 1
    assert any(w.startswith("self-preservation on") for w in guard.take_warnings())
    # Long after the first one's window: still held (2 of 3 silent).
    assert not guard.ask("b", 3.0, 200.0, len(members), member("b")).allow
    # b comes back: 1 of 3 silent, so c may go (nothing else in its window).
    assert guard.heard_from("b", 201.0, len(members))
    assert not guard.status().self_preservation
    assert any(w.startswith("self-preservation off") for w in guard.take_warnings())
    assert guard.ask("c", 3.0, 202.0, len(members), member("c")).allow


def test_an_operator_lets_held_agents_go() -> None:
    guard = EvictionGuard()
    members, member = _members("a", "b", "c", "live")
    for agent in ("a", "b", "c"):
        guard.ask(agent, 3.0, 100.0, len(members), member(agent))
    assert guard.status().silent == ["b", "c"]
    assert guard.confirm(["c", "nobody"], 101.0, len(members)) == ["c"]
    assert guard.releasable() == ["c"]
    verdict = guard.ask("c", 3.0, 101.5, len(members), member("c"))
    assert verdict.allow and verdict.reason == "confirmed by an operator"
    assert guard.confirm(None, 102.0, len(members)) == ["b"]
    assert guard.ask("b", 3.0, 102.0, len(members), member("b")).allow
    status = guard.status()
    assert status.evictions_confirmed == 2 and [(r.agent_id, r.confirmed) for r in status.recent] == [("a", False), ("c", True), ("b", True)]


def test_small_pools_one_agent_is_always_reaped_two_at_once_are_held() -> None:
    guard = EvictionGuard()
    members, member = _members("only")
    assert guard.ask("only", 30.0, 0.0, len(members), member("only")).allow
    guard = EvictionGuard()
    members, member = _members("x", "y")
    assert guard.ask("x", 30.0, 0.0, len(members), member("x")).allow
    assert not guard.ask("y", 30.0, 1.0, len(members), member("y")).allow  # 2 of 2 within the window


def test_unknown_agents_and_retried_asks_are_answered_without_counting() -> None:
    guard = EvictionGuard()
    members, member = _members("a", "b", "c", "d")
    assert guard.ask("a", 3.0, 0.0, len(members), member("a")).allow
    again = guard.ask("a", 3.0, 0.5, len(members), member("a"))  # the activity's retry
    assert again.allow and again.reason == "already allowed"
    stranger = guard.ask("not-here", 3.0, 0.5, len(members), member("not-here"))
    assert stranger.allow and guard.status().silent == []
    assert guard.status().evictions_allowed == 2


def test_eviction_safety_off_allows_everything() -> None:
    guard = EvictionGuard(EvictionPolicy(enabled=False))
    members, member = _members(*"abcd")
    assert all(guard.ask(a, 3.0, 0.0, len(members), member(a)).allow for a in "abcd")
    assert guard.status().silent == []


def test_the_cap_grows_with_the_fleet() -> None:
    assert [cap_for(EvictionPolicy(), n) for n in (1, 9, 10, 19, 20, 100)] == [1, 1, 1, 1, 2, 10]
    guard = EvictionGuard()
    members, member = _members(*(f"a{i}" for i in range(40)))
    verdicts = [guard.ask(f"a{i}", 30.0, float(i), len(members), member(f"a{i}")) for i in range(6)]
    assert [v.allow for v in verdicts] == [True, True, True, True, False, False]  # cap 4 of 40
    assert verdicts[4].retry_after_s == pytest.approx(30.0 - 4.0)


# ------------------------------------------------------------- PoolCore hooks
def _snapshot(agent_id: str, state: AgentState = AgentState.READY, cost: str = "A") -> AgentSnapshot:
    return AgentSnapshot(
        agent_id=agent_id,
        deployment="d",
        endpoint="http://127.0.0.1:9",
        state=state,
        capabilities=[CapabilityDigest(name="rag.search", version="2.1.0", max_concurrency=2, cost_class=cost)],
        resync_interval_s=30,
    )


def _core(*agents: tuple[str, str]) -> PoolCore:
    core = PoolCore("p")
    core.verify_new_agents = False
    ids = iter(f"id{i}" for i in range(10**6))
    for agent_id, cost in agents:
        core.agent_snapshot(_snapshot(agent_id, cost=cost), 0.0, lambda: next(ids))
    return core


def test_pool_core_routes_nothing_to_silent_agents_until_they_are_heard_from() -> None:
    core = _core(("s1", "A"), ("s2", "A"), ("s3", "A"), ("live", "C"))
    ids = iter(f"x{i}" for i in range(10**6))
    verdicts = [core.may_evict(EvictionAsk(agent_id=a, window_s=3.0), 10.0) for a in ("s1", "s2", "s3")]
    assert [v.allow for v in verdicts] == [True, False, False]
    assert core.find("rag.search") == ["live"]
    status = core.status()
    assert status.eviction.self_preservation and status.eviction.silent == ["s2", "s3"]
    assert [a.agent_id for a in status.agents if a.silent] == ["s1", "s2", "s3"]
    assert any("self-preservation on" in w for w in status.warnings)
    assert core.take_warnings()
    # The allowed one terminates; s2's heartbeat comes back (its workflow re-sends its snapshot).
    core.agent_snapshot(_snapshot("s1", AgentState.TERMINATED), 10.5, lambda: next(ids))
    core.agent_snapshot(_snapshot("s2"), 11.0, lambda: next(ids))
    assert core.find("rag.search") == ["s2", "live"]
    assert not core.status().eviction.self_preservation
    # Carried across continue-as-new: s3 stays unroutable and silent.
    carried = PoolCoreState.model_validate_json(core.to_state().model_dump_json())
    again = PoolCore.from_state(carried)
    assert again.find("rag.search") == ["s2", "live"]
    assert again.status().eviction.silent == ["s3"]
    assert again.may_evict(EvictionAsk(agent_id="s3", window_s=3.0), 20.0).allow  # 1 of 3, s1's window over


def test_pool_core_keeps_asking_agents_from_being_dropped_as_stale() -> None:
    core = _core(*((f"a{i}", "B") for i in range(4)))
    ids = iter(f"x{i}" for i in range(10**6))
    for agent in ("a0", "a1", "a2"):
        core.may_evict(EvictionAsk(agent_id=agent, window_s=3.0), 50.0)
    core.agent_snapshot(_snapshot("a0", AgentState.TERMINATED), 50.1, lambda: next(ids))  # the allowed one
    # 90 s (3 resync intervals) after their last snapshot, still asking every window: kept.
    for t in range(53, 200, 3):
        for agent in ("a1", "a2"):
            assert not core.may_evict(EvictionAsk(agent_id=agent, window_s=3.0), float(t)).allow
        core.tick(float(t), lambda: next(ids))
    assert {"a1", "a2"} <= {a.agent_id for a in core.status().agents}
    # a3 never asked nor resynced: dropped; a drained or dropped silent agent leaves the count.
    assert "a3" not in {a.agent_id for a in core.status().agents}
    core.agent_gone("a2", "drain", 201.0, lambda: next(ids))
    assert core.status().eviction.silent == ["a1"]


def test_confirm_and_policy_in_the_core() -> None:
    core = _core(*((f"a{i}", "B") for i in range(4)))
    for agent in ("a0", "a1", "a2"):
        core.may_evict(EvictionAsk(agent_id=agent, window_s=3.0), 0.0)
    assert core.confirm_evictions(None, 1.0) == ["a1", "a2"]
    assert core.eviction.releasable() == ["a1", "a2"]
    assert core.may_evict(EvictionAsk(agent_id="a1", window_s=3.0), 1.5).allow
    core.set_eviction_policy(EvictionPolicy(enabled=False), 2.0)
    assert core.status().eviction.policy.enabled is False
    assert math.isclose(core.status().eviction.policy.threshold, 0.5)
