"""Pool shutdown decisions in `PoolCore` / `core.shutdown`, pure: `now` passed in, no Temporal.

What the pool workflow carries out comes from `take_*` (notices, revocations,
shutdown effects), so every rule is checked on those queues: no grant after the
shutdown began, queued callers told at once, leases allowed to finish until the
deadline and revoked then, every agent drained with `pool-shutdown`, every
known deployment scaled to zero, completion only once every agent has ended and
every scale was answered, stragglers never indexed. A property test drives
random interleavings to the end.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import POOL_SHUTDOWN_REASON, AgentState, PoolPolicy
from agentroster.core.pool import PoolCore
from agentroster.core.shutdown import (
    AGENT_DRAIN_DEADLINE_S,
    CHECK_GRACE_S,
    DONE,
    DRAINING_AGENTS,
    FINISHING_LEASES,
    STRAGGLER_DRAIN_DEADLINE_S,
)
from agentroster.core.state_codec import decode_state, encode_state

S = AgentState
T0 = 1_000_000.0


def ids():
    counter = itertools.count()
    return lambda: f"id{next(counter):06d}"


NEW_ID = ids()


def snap(agent_id: str, deployment: str = "search", state: AgentState = S.READY, cap: str = "rag.search", slots: int = 2) -> AgentSnapshot:
    return AgentSnapshot(
        agent_id=agent_id,
        deployment=deployment,
        endpoint="http://127.0.0.1:9",
        state=state,
        capabilities=[CapabilityDigest(name=cap, version="2.1.0", max_concurrency=slots, cost_class="A")],
        resync_interval_s=30,
    )


def request(ref: str = "rag.search", *, wait_s: float = 30.0, holder: str | None = None, workflow: bool = False, n: int = 0) -> AcquireRequest:
    return AcquireRequest(
        ref=ref, wait_s=wait_s, lease_ttl_s=300, holder=holder, holder_is_workflow=workflow, request_id=f"secret-request-{n:08d}"
    )


def pool(*agents: AgentSnapshot) -> PoolCore:
    core = PoolCore("p", epoch="e")
    core.verify_new_agents = False
    for a in agents:
        core.agent_snapshot(a, T0, NEW_ID)
    core.take_notices()
    return core


def drains(effects) -> dict[str, tuple[str, float]]:
    return {agent_id: (r.reason, r.deadline_s) for agent_id, r in effects.drains}


def test_begin_ends_every_waiter_refuses_acquires_and_is_idempotent() -> None:
    core = pool(snap("a1", slots=1))
    held = core.acquire(request(n=1), T0, NEW_ID).lease
    assert held is not None
    queued = core.acquire(request(n=2), T0, NEW_ID).ticket
    queued_workflow = core.acquire(request(holder="task-wf", workflow=True, n=3), T0, NEW_ID).ticket
    assert queued and queued_workflow and len(core.waiters) == 2

    assert core.begin_shutdown("maintenance", 60, T0 + 1)
    assert not core.begin_shutdown("again", 1, T0 + 2)  # the first call's deadline stands
    assert core.shutdown.reason == "maintenance" and core.shutdown.deadline == T0 + 61
    assert len(core.waiters) == 0
    for ticket in (queued, queued_workflow):
        status = core.ticket_status(ticket)
        assert not status.pending and status.lease is None and status.shutdown == "maintenance"
    effects = core.take_shutdown_effects(T0 + 1)
    # Finishing leases: nothing drained or scaled yet, and nothing granted whatever happens.
    assert not effects.drains and not effects.scales
    granted = core.counters["granted"]
    reply = core.acquire(request(n=4), T0 + 2, NEW_ID)
    assert reply.lease is None and reply.ticket is None
    core.release(held.lease_id, T0 + 3, NEW_ID)
    assert core.counters["granted"] == granted
    status = core.status()
    assert status.shutting_down and status.shutdown.waiters_ended == 2 and status.shutdown.leases_at_start == 1


def test_leases_finish_then_every_agent_is_drained_and_every_known_deployment_scaled_to_zero() -> None:
    core = pool(snap("a1"), snap("c1", deployment="code", cap="code.exec"), snap("gone", deployment="old"))
    core.agent_snapshot(snap("gone", deployment="old", state=S.TERMINATED), T0, NEW_ID)  # its deployment is in the catalog
    core.set_policy("policy-only", PoolPolicy(min_replicas=0, max_replicas=2))
    lease = core.acquire(request(n=1), T0, NEW_ID).lease
    core.begin_shutdown("stop", 60, T0 + 1)
    core.tick(T0 + 2, NEW_ID)
    assert core.shutdown.phase == FINISHING_LEASES and not core.take_shutdown_effects(T0 + 2).drains
    assert core.next_wakeup() == T0 + 61  # the deadline (the lease's own is later)

    core.release(lease.lease_id, T0 + 5, NEW_ID)
    core.tick(T0 + 5, NEW_ID)
    assert core.shutdown.phase == DRAINING_AGENTS
    effects = core.take_shutdown_effects(T0 + 5)
    assert drains(effects) == {"a1": (POOL_SHUTDOWN_REASON, AGENT_DRAIN_DEADLINE_S), "c1": (POOL_SHUTDOWN_REASON, AGENT_DRAIN_DEADLINE_S)}
    assert {(r.deployment, r.replicas, r.shutdown) for r in effects.scales} == {
        ("search", 0, True), ("code", 0, True), ("old", 0, True), ("policy-only", 0, True)
    }
    assert core.shutdown.leases_revoked == 0
    assert not core.shutdown_complete(T0 + 5)

    core.agent_snapshot(snap("a1", state=S.DRAINING), T0 + 6, NEW_ID)  # the pool confirms its zero
    assert [(a, n.draining, n.in_flight) for a, _, n in core.take_notices()] == [("a1", True, 0)]
    core.agent_snapshot(snap("a1", state=S.TERMINATED), T0 + 7, NEW_ID)
    core.agent_snapshot(snap("c1", deployment="code", cap="code.exec", state=S.TERMINATED), T0 + 7, NEW_ID)
    assert not core.shutdown_complete(T0 + 7)  # scale requests not answered yet
    for d in ("search", "code", "old"):
        core.shutdown_scaled(d, None)
    assert not core.shutdown_complete(T0 + 8)
    core.shutdown_scaled("policy-only", "unknown deployment")
    assert core.shutdown_complete(T0 + 9)
    report = core.status().shutdown
    assert report.phase == DONE and report.agents_left == 0 and report.agents_drained == 2
    assert sorted(report.deployments_scaled) == ["code", "old", "search"] and report.scale_failures == {"policy-only": "unknown deployment"}
    assert core.status().agents == [] and not core.status().shutting_down


def test_a_lease_held_at_the_deadline_is_revoked_and_its_workflow_holder_told() -> None:
    core = pool(snap("a1"))
    lease = core.acquire(request(holder="task-wf", workflow=True, n=1), T0, NEW_ID).lease
    other = core.acquire(request(n=2), T0, NEW_ID).lease
    core.take_notices()
    core.begin_shutdown("stop", 10, T0)
    core.tick(T0 + 9.9, NEW_ID)
    assert len(core.leases) == 2 and not core.take_revocations()
    core.tick(T0 + 10, NEW_ID)
    assert len(core.leases) == 0 and core.shutdown.leases_revoked == 2
    assert [(h, r.lease_id) for h, r in core.take_revocations()] == [("task-wf", lease.lease_id)]
    core.take_notices()
    assert list(drains(core.take_shutdown_effects(T0 + 10))) == ["a1"]
    # Draining, the agent is told its true count (zero): what lets it end at once.
    core.agent_snapshot(snap("a1", state=S.DRAINING), T0 + 11, NEW_ID)
    assert [(a, n.in_flight, n.draining) for a, _, n in core.take_notices()] == [("a1", 0, True)]
    assert other.lease_id not in core.leases and core.counters["revoked"] == 2


def test_stragglers_are_never_indexed_but_drained_waited_for_and_their_deployment_scaled() -> None:
    core = pool(snap("a1"))
    core.verify_new_agents = True
    core.begin_shutdown("stop", 60, T0)
    core.tick(T0, NEW_ID)  # no lease: straight to draining
    assert list(drains(core.take_shutdown_effects(T0))) == ["a1"]
    late = snap("late", deployment="late-deploy")
    core.agent_snapshot(late, T0 + 1, NEW_ID)
    assert not core.is_indexed("late") and not core.take_verifications()
    effects = core.take_shutdown_effects(T0 + 1)
    assert drains(effects) == {"late": (POOL_SHUTDOWN_REASON, STRAGGLER_DRAIN_DEADLINE_S)}
    assert [r.deployment for r in effects.scales] == ["late-deploy"]
    core.agent_snapshot(late, T0 + 2, NEW_ID)  # its resync: told once is enough
    assert not core.take_shutdown_effects(T0 + 2).drains
    core.agent_snapshot(snap("a1", state=S.TERMINATED), T0 + 3, NEW_ID)
    for d in ("search", "late-deploy"):
        core.shutdown_scaled(d, None)
    assert not core.shutdown_complete(T0 + 3)  # still waiting for the straggler
    core.agent_snapshot(snap("late", deployment="late-deploy", state=S.TERMINATED), T0 + 4, NEW_ID)
    assert core.shutdown_complete(T0 + 4)
    # A word that comes in as the run is about to end: not over after all.
    core.agent_snapshot(snap("later", deployment="search"), T0 + 5, NEW_ID)
    assert core.shutdown.phase == DRAINING_AGENTS and not core.shutdown_complete(T0 + 5)


def test_stragglers_heard_while_leases_finish_are_drained_with_the_others() -> None:
    core = pool(snap("a1"))
    lease = core.acquire(request(n=1), T0, NEW_ID).lease
    core.verify_new_agents = True
    core.agent_snapshot(snap("unchecked"), T0, NEW_ID)  # waiting for its check when the shutdown begins
    core.begin_shutdown("stop", 60, T0)
    core.agent_snapshot(snap("late", deployment="late-deploy"), T0 + 1, NEW_ID)
    assert not core.take_shutdown_effects(T0 + 1).drains and not core.take_verifications()
    core.agent_verified("unchecked", True, T0 + 1, NEW_ID)  # the check answers after: still never indexed
    assert not core.is_indexed("unchecked")
    core.release(lease.lease_id, T0 + 2, NEW_ID)
    core.tick(T0 + 2, NEW_ID)
    effects = core.take_shutdown_effects(T0 + 2)
    assert drains(effects) == {
        "a1": (POOL_SHUTDOWN_REASON, AGENT_DRAIN_DEADLINE_S),
        "late": (POOL_SHUTDOWN_REASON, STRAGGLER_DRAIN_DEADLINE_S),
        "unchecked": (POOL_SHUTDOWN_REASON, STRAGGLER_DRAIN_DEADLINE_S),
    }
    assert sorted(r.deployment for r in effects.scales) == ["late-deploy", "search"]


def test_an_agent_heard_of_again_after_it_ended_is_told_again_and_counted_once() -> None:
    core = pool(snap("a1"))
    core.begin_shutdown("stop", 60, T0)
    core.tick(T0, NEW_ID)
    assert list(drains(core.take_shutdown_effects(T0))) == ["a1"]
    core.shutdown_scaled("search", None)
    core.agent_snapshot(snap("a1", state=S.TERMINATED), T0 + 1, NEW_ID)
    assert core.shutdown_complete(T0 + 1)
    # A word from it that was on its way (or a reading taken before it ended): told again, once more one agent.
    core.agent_snapshot(snap("a1"), T0 + 2, NEW_ID)
    assert list(drains(core.take_shutdown_effects(T0 + 2))) == ["a1"]
    core.agent_snapshot(snap("a1", state=S.TERMINATED), T0 + 3, NEW_ID)
    assert core.shutdown_complete(T0 + 3)
    report = core.status().shutdown
    assert report is not None and report.agents_drained == 1
    carried = decode_state(encode_state(core.to_state()))
    assert PoolCore.from_state(carried).status().shutdown.agents_drained == 1  # type: ignore[union-attr]


def test_an_agent_that_outlives_its_drain_is_checked_forgotten_if_gone_drained_again_if_not() -> None:
    core = pool(snap("a1"), snap("a2"))
    core.begin_shutdown("stop", 0, T0)
    core.tick(T0, NEW_ID)
    core.take_shutdown_effects(T0)
    core.shutdown_scaled("search", None)
    due = T0 + AGENT_DRAIN_DEADLINE_S + CHECK_GRACE_S
    assert core.next_wakeup() == due
    assert core.take_shutdown_effects(due - 1).checks == []
    assert core.take_shutdown_effects(due).checks == ["a1", "a2"]
    assert core.take_shutdown_effects(due).checks == []  # not asked twice meanwhile
    core.shutdown_checked("a1", False, due + 1, NEW_ID)
    core.shutdown_checked("a2", True, due + 1, NEW_ID)
    assert not core.is_indexed("a1") and core.is_indexed("a2")
    assert drains(core.take_shutdown_effects(due + 1)) == {"a2": (POOL_SHUTDOWN_REASON, STRAGGLER_DRAIN_DEADLINE_S)}
    assert not core.shutdown_complete(due + 1)
    core.shutdown_checked("a2", False, due + 30, NEW_ID)
    assert core.shutdown_complete(due + 30)


def test_no_sizing_while_shutting_down_and_no_wake_up_in_the_past() -> None:
    core = pool(snap("a1"))
    core.set_policy("search", PoolPolicy(min_replicas=3, max_replicas=5, upscale_delay_s=0))
    core.acquire(request("rag.search", wait_s=0, n=9), T0, NEW_ID)
    core.begin_shutdown("stop", 60, T0)
    for t in (T0, T0 + 1, T0 + 30, T0 + 400):
        core.tick(t, NEW_ID)
        assert core.take_scale_requests(t) == [] and core.take_scale_downs() == []
        wake = core.next_wakeup()
        assert wake is None or wake > t
        core.take_shutdown_effects(t)


def test_a_shutdown_is_carried_across_continue_as_new() -> None:
    core = pool(snap("a1"), snap("c1", deployment="code", cap="code.exec"))
    core.begin_shutdown("stop", 60, T0)
    core.tick(T0, NEW_ID)
    effects = core.take_shutdown_effects(T0)  # scale requests asked, not answered when the run ends
    assert len(effects.scales) == 2
    core.shutdown_scaled("code", None)
    core.agent_snapshot(snap("a1", state=S.TERMINATED), T0 + 1, NEW_ID)

    carried = PoolCore.from_state(decode_state(encode_state(core.to_state())))
    assert carried.shutdown.phase == DRAINING_AGENTS and carried.shutdown.reason == "stop"
    assert carried.status().shutdown == core.status().shutdown
    again = carried.take_shutdown_effects(T0 + 2)
    assert [r.deployment for r in again.scales] == ["search"]  # asked again: its answer was lost with the run
    assert carried.acquire(request(n=5), T0 + 2, NEW_ID).lease is None
    carried.shutdown_scaled("search", None)
    carried.agent_snapshot(snap("c1", deployment="code", cap="code.exec", state=S.TERMINATED), T0 + 3, NEW_ID)
    assert carried.shutdown_complete(T0 + 3)
    assert PoolCore.from_state(decode_state(encode_state(carried.to_state()))).shutdown_complete(T0 + 4)


# ---------------------------------------------------------------- property
AGENTS = ["a", "b", "c", "d"]
DEPLOYMENTS = ["d1", "d2"]

operation = st.one_of(
    st.tuples(st.just("register"), st.sampled_from(AGENTS), st.sampled_from(DEPLOYMENTS)),
    st.tuples(st.just("acquire"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("terminate"), st.sampled_from(AGENTS)),
    st.tuples(st.just("drain"), st.sampled_from(AGENTS)),
    st.tuples(st.just("advance"), st.floats(0.1, 40)),
    st.tuples(st.just("shutdown"), st.floats(0, 60)),
    st.tuples(st.just("answer_scale"), st.booleans()),
    st.tuples(st.just("carry"),),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, max_size=40))
def test_any_interleaving_grants_nothing_after_the_shutdown_and_ends_once_every_agent_has(ops: list[tuple]) -> None:
    core = pool()
    now = T0
    leases: list[str] = []
    deployment_of: dict[str, str] = {}
    scales_out: set[str] = set()
    counter = itertools.count()
    granted_at_shutdown: int | None = None

    def carry_out() -> None:
        """What the workflow does after each message: take the effects."""
        core.take_notices()
        core.take_revocations()
        effects = core.take_shutdown_effects(now)
        for agent_id, req in effects.drains:
            assert req.reason == POOL_SHUTDOWN_REASON
        for r in effects.scales:
            assert r.replicas == 0 and r.shutdown
            scales_out.add(r.deployment)
        for agent_id in effects.checks:
            core.shutdown_checked(agent_id, agent_id in deployment_of, now, NEW_ID)

    for op in ops:
        kind = op[0]
        if kind == "register":
            _, agent_id, deployment = op
            deployment = deployment_of.setdefault(agent_id, deployment)
            core.agent_snapshot(snap(agent_id, deployment=deployment), now, NEW_ID)
        elif kind == "acquire":
            reply = core.acquire(request(wait_s=5 if op[2] else 0, n=next(counter)), now, NEW_ID)
            if reply.lease is not None:
                leases.append(reply.lease.lease_id)
        elif kind == "release" and leases:
            core.release(leases.pop(op[1] % len(leases)), now, NEW_ID)
        elif kind == "terminate" and op[1] in deployment_of:
            agent_id = op[1]
            core.agent_snapshot(snap(agent_id, deployment=deployment_of.pop(agent_id), state=S.TERMINATED), now, NEW_ID)
        elif kind == "drain" and op[1] in deployment_of:
            core.agent_snapshot(snap(op[1], deployment=deployment_of[op[1]], state=S.DRAINING), now, NEW_ID)
        elif kind == "advance":
            now += op[1]
        elif kind == "shutdown":
            if core.begin_shutdown("prop", op[1], now):
                granted_at_shutdown = core.counters["granted"]
                assert len(core.waiters) == 0
        elif kind == "answer_scale" and scales_out:
            core.shutdown_scaled(sorted(scales_out)[0], None if op[1] else "refused")
            scales_out.discard(sorted(scales_out)[0])
        elif kind == "carry":
            core = PoolCore.from_state(decode_state(encode_state(core.to_state())))
            core.verify_new_agents = False
            scales_out.clear() if core.shutdown is None else None
        core.tick(now, NEW_ID)
        carry_out()
        if granted_at_shutdown is not None:
            assert core.counters["granted"] == granted_at_shutdown  # never a grant once shutting down
            assert len(core.waiters) == 0
            wake = core.next_wakeup()
            assert wake is None or wake > now or core.shutdown.phase != FINISHING_LEASES

    # Drive it to its end: shut down, let time pass, every agent ends, every scale is answered.
    core.begin_shutdown("prop", 0, now)
    for _ in range(20):
        now += 50
        core.tick(now, NEW_ID)
        carry_out()
        if core.shutdown.phase == DRAINING_AGENTS:
            for agent_id, deployment in sorted(deployment_of.items()):
                core.agent_snapshot(snap(agent_id, deployment=deployment, state=S.TERMINATED), now, NEW_ID)
            deployment_of.clear()
            carry_out()
            for d in sorted(scales_out):
                core.shutdown_scaled(d, None)
            scales_out.clear()
        if core.shutdown_complete(now):
            break
    assert core.shutdown_complete(now), core.shutdown.to_row()
    assert len(core.leases) == 0 and len(core.index) == 0
    assert core.status().shutdown.phase == DONE


@pytest.mark.parametrize("deadline", [0, 5])
def test_an_empty_pool_shuts_down_at_once(deadline: float) -> None:
    core = pool()
    core.begin_shutdown("stop", deadline, T0)
    effects = core.take_shutdown_effects(T0)
    assert not effects.drains and not effects.scales
    assert core.shutdown_complete(T0)
