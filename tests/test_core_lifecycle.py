"""The agent lifecycle state machine (agentroster.core.lifecycle): pure, no Temporal."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from agentroster.messages import LoadNotice
from agentroster.models import DEFAULT_HEARTBEAT_INTERVAL_S, AgentRegistration, AgentState, Capability
from agentroster.core.lifecycle import (
    ALLOWED_TRANSITIONS,
    RECENT_TRANSITIONS_KEPT,
    AgentLifecycle,
    TransitionRefused,
    refusal,
)

S = AgentState
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
FROM_STATES: list[AgentState | None] = [None, *AgentState]

EXPECTED_TABLE: dict[AgentState | None, set[AgentState]] = {
    None: {S.SPAWNING},
    S.SPAWNING: {S.REGISTERING, S.TERMINATED},
    S.REGISTERING: {S.READY, S.TERMINATED},
    S.READY: {S.BUSY, S.REGISTERING, S.DRAINING, S.TERMINATED},
    S.BUSY: {S.READY, S.REGISTERING, S.DRAINING, S.TERMINATED},
    S.DRAINING: {S.TERMINATED},
    S.TERMINATED: set(),
}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def registration(agent_id: str = "agent-1", interval: float = 10.0, max_concurrency: int = 2) -> AgentRegistration:
    return AgentRegistration(
        agent_id=agent_id,
        deployment="search-agent",
        endpoint="http://127.0.0.1:9000",
        heartbeat_interval_s=interval,
        capabilities=[Capability(name="rag.search", version="2.1.0", max_concurrency=max_concurrency)],
    )


def ready_agent(interval: float = 10.0) -> AgentLifecycle:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    life.spawn(at(0))
    life.register(registration(interval=interval), at(1))
    life.indexed(at(2))
    assert life.state == S.READY
    return life


# --------------------------------------------------------------- the table


def test_table_is_the_documented_one() -> None:
    assert {k: set(v) for k, v in ALLOWED_TRANSITIONS.items()} == EXPECTED_TABLE


ALL_PAIRS = [(f, t) for f in FROM_STATES for t in AgentState]


@pytest.mark.parametrize(("from_state", "to_state"), ALL_PAIRS, ids=[f"{f}->{t}" for f, t in ALL_PAIRS])
def test_every_pair(from_state: AgentState | None, to_state: AgentState) -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod", state=from_state)
    before = list(life.transitions)
    if to_state in EXPECTED_TABLE[from_state]:
        assert refusal(from_state, to_state) is None
        step = life.transition(to_state, "test", at(5))
        assert life.state == to_state
        assert (step.from_state, step.to_state, step.reason, step.at) == (from_state, to_state, "test", at(5))
        assert life.transitions == [*before, step]
    else:
        why = refusal(from_state, to_state)
        assert why is not None and to_state.value in why and "not a lifecycle transition" in why
        with pytest.raises(TransitionRefused) as exc:
            life.transition(to_state, "test", at(5))
        assert str(exc.value) == why
        assert life.state == from_state
        assert life.transitions == before


def test_pairs_cover_every_state() -> None:
    assert len(ALL_PAIRS) == 7 * 6
    allowed = sum(len(v) for v in EXPECTED_TABLE.values())
    assert allowed == 14


def test_transition_list_is_bounded() -> None:
    life = ready_agent()
    for i in range(RECENT_TRANSITIONS_KEPT * 2):
        life.transition(S.BUSY if life.state == S.READY else S.READY, f"flip {i}", at(10 + i))
    assert len(life.transitions) == RECENT_TRANSITIONS_KEPT
    assert life.transitions[-1].reason == f"flip {RECENT_TRANSITIONS_KEPT * 2 - 1}"


# --------------------------------------------------------------- spawn / register / indexed


def test_spawn_register_indexed() -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    assert [t.to_state for t in life.spawn(at(0))] == [S.SPAWNING]
    assert life.started_at == at(0)
    steps = life.register(registration(), at(1))
    assert [(t.from_state, t.to_state, t.reason) for t in steps] == [(S.SPAWNING, S.REGISTERING, "registered")]
    assert life.last_heartbeat == at(1)
    assert life.registration is not None
    steps = life.indexed(at(2))
    assert [(t.from_state, t.to_state) for t in steps] == [(S.REGISTERING, S.READY)]
    # indexed again is a no-op, not an error
    assert life.indexed(at(3)) == []
    assert life.state == S.READY


def test_register_for_another_agent_is_refused() -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    life.spawn(at(0))
    with pytest.raises(TransitionRefused, match="agent-2"):
        life.register(registration(agent_id="agent-2"), at(1))
    assert life.state == S.SPAWNING and life.registration is None


def test_reregister_from_ready_and_busy() -> None:
    life = ready_agent()
    steps = life.register(registration(), at(5))
    assert [(t.from_state, t.to_state, t.reason) for t in steps] == [(S.READY, S.REGISTERING, "re-registered")]
    life.indexed(at(6))
    life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=1), at(7))
    assert life.state == S.BUSY
    life.register(registration(), at(8))
    assert life.state == S.REGISTERING
    # still saturated: indexing ends in Busy, through Ready (Registering -> Busy is no transition)
    assert [(t.from_state, t.to_state) for t in life.indexed(at(9))] == [(S.REGISTERING, S.READY), (S.READY, S.BUSY)]
    assert life.state == S.BUSY


@pytest.mark.parametrize("state", [S.DRAINING, S.TERMINATED])
def test_register_refused_while_draining_or_terminated(state: AgentState) -> None:
    life = ready_agent()
    if state == S.DRAINING:
        life.drain("rollout", 60, at(5))
    else:
        life.terminate("heartbeat_lost", at(5))
    before = list(life.transitions)
    with pytest.raises(TransitionRefused, match="new run"):
        life.register(registration(), at(6))
    assert life.state == state and life.transitions == before


# --------------------------------------------------------------- load


def test_apply_load_follows_saturation() -> None:
    life = ready_agent()
    assert life.apply_load(LoadNotice(in_flight=1, saturated=False, seq=1), at(3)) == []
    assert life.state == S.READY and life.in_flight == 1
    steps = life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=2), at(4))
    assert [(t.from_state, t.to_state) for t in steps] == [(S.READY, S.BUSY)]
    assert life.in_flight == 2 and life.saturated
    # still saturated: no transition
    assert life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=3), at(5)) == []
    steps = life.apply_load(LoadNotice(in_flight=1, saturated=False, seq=4), at(6))
    assert [(t.from_state, t.to_state) for t in steps] == [(S.BUSY, S.READY)]
    assert life.in_flight == 1


def test_apply_load_ignores_stale_and_duplicate_notices() -> None:
    life = ready_agent()
    life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=5), at(3))
    assert life.state == S.BUSY
    # an older notice, overtaken on the way, changes nothing
    assert life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=4), at(4)) == []
    assert life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=5), at(4)) == []
    assert life.state == S.BUSY and life.in_flight == 2 and life.load_seq == 5
    assert [t.to_state for t in life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=6), at(5))] == [S.READY]


def test_a_new_pools_notices_count_from_one_again() -> None:
    """A pool that lost its state starts a new epoch: its seq 1 is not stale beside the old pool's 40."""
    life = ready_agent()
    life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=40, epoch="old"), at(3))
    assert [t.to_state for t in life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=1, epoch="new"), at(4))] == [S.BUSY]
    assert (life.load_epoch, life.load_seq, life.in_flight) == ("new", 1, 2)
    assert life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=1, epoch="new"), at(5)) == []  # a duplicate: stale


def test_apply_load_while_draining_counts_but_never_leaves_draining() -> None:
    life = ready_agent()
    life.drain("rollout", 60, at(3))
    assert life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=1), at(4)) == []
    assert life.apply_load(LoadNotice(in_flight=1, saturated=False, seq=2), at(5)) == []
    assert life.state == S.DRAINING and life.in_flight == 1


# --------------------------------------------------------------- drain


def test_drain_finishes_when_the_pool_confirms_zero_in_flight() -> None:
    life = ready_agent()
    life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=1), at(3))
    steps = life.drain("rollout", 60, at(4))
    assert [(t.from_state, t.to_state, t.reason) for t in steps] == [(S.BUSY, S.DRAINING, "rollout")]
    assert life.drain_deadline == at(64)
    assert not life.drain_finished(at(5))
    life.apply_load(LoadNotice(in_flight=1, saturated=False, seq=2, draining=True), at(6))
    assert not life.drain_finished(at(6))
    life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=3, draining=True), at(7))
    assert life.drain_finished(at(7))
    assert [t.to_state for t in life.terminate("drained", at(7))] == [S.TERMINATED]
    assert not life.drain_finished(at(8))


def test_drain_does_not_finish_on_a_count_sent_before_the_pool_saw_draining() -> None:
    life = ready_agent()
    life.drain("rollout", 60, at(3))
    # a notice the pool sent before it heard of the drain may miss a fresh lease
    life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=1, draining=False), at(4))
    assert not life.drain_finished(at(4))
    life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=2, draining=True), at(5))
    assert life.drain_finished(at(5))


def test_drain_finishes_at_the_deadline_not_before() -> None:
    life = ready_agent()
    life.apply_load(LoadNotice(in_flight=1, saturated=False, seq=1), at(3))
    life.drain("rollout", 30, at(10))
    assert life.next_wakeup() == at(40)
    assert not life.drain_finished(at(39.999))
    assert life.drain_finished(at(40))
    assert life.drain_finished(at(41))


def test_drain_is_idempotent_and_stops_liveness() -> None:
    life = ready_agent()
    life.drain("rollout", 30, at(10))
    assert life.drain("again", 5, at(11)) == []
    assert life.drain_deadline == at(40) and life.drain_reason == "rollout"
    # a draining agent is not reaped for missed heartbeats; its deadline rules
    assert life.liveness_deadline() is None
    assert not life.is_lost(at(10_000))


@pytest.mark.parametrize("setup", ["spawning", "registering"])
def test_drain_before_ready_terminates_at_once(setup: str) -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    life.spawn(at(0))
    if setup == "registering":
        life.register(registration(), at(1))
    steps = life.drain("scale-in", 30, at(2))
    assert [t.to_state for t in steps] == [S.TERMINATED]
    assert life.terminated_reason == "drain"


def test_drain_of_terminated_agent_refused() -> None:
    life = ready_agent()
    life.terminate("heartbeat_lost", at(3))
    with pytest.raises(TransitionRefused):
        life.drain("late", 30, at(4))
    assert life.state == S.TERMINATED


# --------------------------------------------------------------- liveness


@pytest.mark.parametrize("interval", [10.0, 2.5, 30.0])
def test_lost_at_exactly_three_intervals_after_last_heartbeat(interval: float) -> None:
    life = ready_agent(interval=interval)
    life.heartbeat(at(100))
    deadline = at(100 + 3 * interval)
    assert life.liveness_deadline() == deadline
    assert life.next_wakeup() == deadline
    assert not life.is_lost(deadline - timedelta(microseconds=1))
    assert not life.is_lost(at(100 + 2.9 * interval))
    assert life.is_lost(deadline)
    assert life.is_lost(deadline + timedelta(seconds=1))


def test_heartbeat_pushes_the_deadline() -> None:
    life = ready_agent()
    life.heartbeat(at(25))
    assert not life.is_lost(at(40))
    assert life.is_lost(at(55))
    life.heartbeat(at(54))
    assert not life.is_lost(at(55)) and life.liveness_deadline() == at(84)


def test_registration_counts_as_a_heartbeat() -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    life.spawn(at(0))
    life.register(registration(interval=10), at(7))
    assert life.liveness_deadline() == at(37)


def test_spawned_agent_that_never_registers_is_lost_after_default_interval() -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    assert life.liveness_deadline() is None and not life.is_lost(at(10_000))
    life.spawn(at(0))
    window = 3 * DEFAULT_HEARTBEAT_INTERVAL_S
    assert life.liveness_deadline() == at(window)
    assert not life.is_lost(at(window - 0.1)) and life.is_lost(at(window))


# --------------------------------------------------------------- terminate


def test_terminate_is_final() -> None:
    life = ready_agent()
    steps = life.terminate("heartbeat_lost", at(40))
    assert [(t.from_state, t.to_state, t.reason) for t in steps] == [(S.READY, S.TERMINATED, "heartbeat_lost")]
    assert life.terminated_reason == "heartbeat_lost"
    before = list(life.transitions)
    # terminate again is a no-op, keeping the first reason
    assert life.terminate("other", at(41)) == []
    assert life.terminated_reason == "heartbeat_lost"
    for state in AgentState:
        with pytest.raises(TransitionRefused):
            life.transition(state, "resurrect", at(42))
    with pytest.raises(TransitionRefused):
        life.register(registration(), at(42))
    assert life.indexed(at(42)) == []
    assert life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=99), at(42)) == []
    assert life.state == S.TERMINATED and life.transitions == before
    assert life.liveness_deadline() is None and life.next_wakeup() is None
    assert not life.is_lost(at(10_000))


def test_status_reports_the_life() -> None:
    life = ready_agent()
    life.apply_load(LoadNotice(in_flight=1, saturated=False, seq=1), at(3))
    status = life.status()
    assert status.agent_id == "agent-1" and status.pool == "prod"
    assert status.state == S.READY and status.in_flight == 1
    assert [t.to_state for t in status.transitions] == [S.SPAWNING, S.REGISTERING, S.READY]
    assert status.registration is not None and status.last_heartbeat == at(1)
