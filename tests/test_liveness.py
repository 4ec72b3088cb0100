"""Event-driven liveness and the cheap idle agent (issue 10, goal 1).

* Core properties (`AgentLifecycle`, pure): an agent that heartbeats has no timer
  fire (every second heartbeat arms the next wake-up in its own task) and none for its
  resync, re-sends its snapshot every 30 min (at most 1.5 heartbeats early), and a
  silent one is still declared lost exactly 3 intervals after its last heartbeat. `pod_gone` ends any live agent at once.
* Through a real dev server: `pod_gone` sent with a raw temporalio client, malformed
  in every way, is refused with a reason and leaves the agent healthy; a real one
  ends it Terminated (`process_exited`), tells the pool and deletes the pod; a
  Draining agent whose process exits ends its drain.
"""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.service import RPCError, RPCStatusCode

from agentroster.messages import PodGone
from agentroster.models import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    MISSED_HEARTBEATS,
    POD_GONE_REASONS,
    AgentRegistration,
    AgentState,
    Capability,
)
from agentroster.core.lifecycle import RESYNC_S, AgentLifecycle, TransitionRefused
from agentroster.vocabulary.wire import POD_GONE_SIGNAL, agent_workflow_id
from tests.conftest import eventually, make_registration

S = AgentState
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ready(interval: float, *, metadata: dict[str, Any] | None = None, phase: float = 0.0) -> AgentLifecycle:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    life.spawn(at(0))
    reg = AgentRegistration(
        agent_id="agent-1",
        deployment="search-agent",
        endpoint="http://127.0.0.1:9000",
        heartbeat_interval_s=interval,
        capabilities=[Capability(name="rag.search", version="2.1.0", max_concurrency=2)],
        metadata=metadata or {},
    )
    life.register(reg, at(0))
    life.told_pool(at(0), phase)  # the workflow tells the pool on registration
    life.indexed(at(0))
    return life


def drive(life: AgentLifecycle, beats: list[float], until: float) -> dict[str, Any]:
    """Run the workflow loop's decisions: heartbeats at `beats` (the handler wakes the loop
    when `wake_wanted`), a timer armed at `next_wakeup()` after every wake, a resync when
    wanted. `timers`: every timer started; `fired`: the wakes a timer made (each a workflow
    task of its own, where a heartbeat's wake rides on the heartbeat's task)."""
    timers: list[datetime] = []
    fired: list[datetime] = []
    resyncs: list[datetime] = []
    lost_at: datetime | None = None
    armed = life.next_wakeup()
    timers.append(armed)  # type: ignore[arg-type]
    pending = sorted(beats)
    while armed is not None and armed <= at(until):
        if pending and at(pending[0]) < armed:
            now = at(pending.pop(0))
            life.heartbeat(now)
            if not life.wake_wanted(armed, now):
                continue
        else:
            now = armed
            fired.append(now)
        if life.is_lost(now):
            lost_at = now
            break
        if life.resync_wanted(now):
            resyncs.append(now)
            life.told_pool(now)
        armed = life.next_wakeup()
        if armed is not None:
            timers.append(armed)
    return {"timers": timers, "fired": fired, "resyncs": resyncs, "lost_at": lost_at}


@settings(max_examples=200, deadline=None)
@given(
    interval=st.floats(min_value=1.0, max_value=3600.0),
    jitter=st.lists(st.floats(min_value=0.9, max_value=1.1), min_size=5, max_size=120),
    phase=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_no_timer_fires_while_heartbeats_come_and_silence_is_still_caught(interval: float, jitter: list[float], phase: float) -> None:
    life = ready(interval, phase=phase)
    window = MISSED_HEARTBEATS * interval
    resync = max(RESYNC_S, 6 * interval)
    assert life.resync_interval_s == resync
    beats, t = [], 0.0
    for factor in jitter:  # the runtime's +/-10% jitter
        t += interval * factor
        beats.append(t)
    last = beats[-1]
    out = drive(life, beats, until=last + 2 * window + 2 * resync)

    # Silence after the last heartbeat is caught exactly one window later.
    assert out["lost_at"] is not None and abs((out["lost_at"] - at(last + window)).total_seconds()) < 1e-5
    # While it heartbeats no timer fires: every wake rides on a heartbeat's task, and the
    # resync needs none of its own. After the last one, at most two (the one armed, then
    # the deadline it re-arms for).
    assert all(moment > at(last) for moment in out["fired"]) and len(out["fired"]) <= 2
    # A timer started at most every second heartbeat, and at each resync: ~7.5 an hour
    # at the 240 s default (the first, and two once it is silent, besides).
    assert len(out["timers"]) <= len(beats) / 2 + len(out["resyncs"]) + 3
    # Resyncs: never more often than every (resync - 1.5 intervals), never later than due;
    # the first due where the registration's phase put it.
    told = [at(0), *out["resyncs"]]
    for n, (before, after) in enumerate(zip(told, told[1:])):
        gap = (after - before).total_seconds()
        due = (1.0 - 0.5 * phase) * resync if n == 0 else resync
        assert due - 1.5 * interval - 1e-5 <= gap <= due + 1e-5


def test_agents_registered_together_resync_in_smaller_waves() -> None:
    """A burst registered at one moment, heartbeating in step: the phase each agent drew
    puts its first resync due between half an interval and one after the notice, so at
    the defaults the burst's resyncs go at several heartbeats, a heartbeat apart, never
    later than one interval; every later resync is an interval on (less up to 1.5 heartbeats)."""
    interval = DEFAULT_HEARTBEAT_INTERVAL_S
    beats = [interval * k for k in range(1, 40)]
    firsts: dict[float, datetime] = {}
    for phase in [k / 20 for k in range(20)]:
        life = ready(interval, phase=phase)
        assert (life.resync_due() - at(0)).total_seconds() == pytest.approx((1.0 - 0.5 * phase) * RESYNC_S)  # type: ignore[operator]
        out = drive(life, beats, until=beats[-1])
        assert not out["fired"]
        firsts[phase] = out["resyncs"][0]
        assert (firsts[phase] - at(0)).total_seconds() <= RESYNC_S
        for before, after in zip(out["resyncs"], out["resyncs"][1:]):
            assert RESYNC_S - 1.5 * interval - 1e-5 <= (after - before).total_seconds() <= RESYNC_S + 1e-5
    waves = sorted(set(firsts.values()))
    assert len(waves) >= 3, waves
    assert all((b - a).total_seconds() == interval for a, b in zip(waves, waves[1:]))
    assert firsts[0.0] > firsts[0.95]  # a later phase resyncs sooner
    # Draining or ended agents are not resynced, whatever was due.
    life = ready(interval)
    life.drain("scale-down", 60.0, at(1))
    assert life.resync_due() is None


def test_default_interval_is_slow_and_resync_rare() -> None:
    life = ready(DEFAULT_HEARTBEAT_INTERVAL_S)
    assert life.heartbeat_window_s == 720.0
    assert life.resync_interval_s == 1800.0


LIVE_STATES = [S.SPAWNING, S.REGISTERING, S.READY, S.BUSY, S.DRAINING]


@pytest.mark.parametrize("state", LIVE_STATES)
@pytest.mark.parametrize("reason", POD_GONE_REASONS)
def test_pod_gone_ends_any_live_agent_at_once(state: AgentState, reason: str) -> None:
    life = ready(120.0)
    if state == S.SPAWNING:
        life = AgentLifecycle(agent_id="agent-1", pool="prod")
        life.spawn(at(0))
    elif state == S.REGISTERING:
        life.register(life.registration, at(1))  # type: ignore[arg-type]
    elif state == S.BUSY:
        from agentroster.messages import LoadNotice

        life.apply_load(LoadNotice(in_flight=2, saturated=True, seq=1), at(1))
    elif state == S.DRAINING:
        life.drain("scale-down", 300, at(1))
    assert life.state == state
    # Long before its liveness window: the process is gone, no eviction permission is asked.
    life.eviction_held_until = at(100) if state in (S.READY, S.BUSY) else None
    steps = life.pod_gone(PodGone(agent_id="agent-1", reason=reason, detail="exit code -9"), at(2))  # type: ignore[arg-type]
    assert life.state == S.TERMINATED and steps and steps[-1].to_state == S.TERMINATED
    if state == S.DRAINING:
        assert life.terminated_reason == "drain"  # its drain ended: counted as drained, the exit in the detail
        assert steps[-1].reason == f"drain: {reason}: exit code -9 before the drain finished"
    else:
        assert life.terminated_reason == reason
        assert steps[-1].reason == f"{reason}: exit code -9"
    assert life.eviction_held_until is None and life.next_wakeup() is None
    # Final: another report changes nothing.
    assert life.pod_gone(PodGone(agent_id="agent-1", reason="pod_deleted"), at(3)) == []
    assert life.terminated_reason in (reason, "drain")


def test_pod_gone_for_another_agent_or_another_pod_is_refused() -> None:
    life = ready(120.0, metadata={"pod_uid": "uid-now"})
    with pytest.raises(TransitionRefused, match="sent to agent"):
        life.pod_gone(PodGone(agent_id="agent-2", reason="pod_deleted"), at(2))
    with pytest.raises(TransitionRefused, match="recreated under the same name"):
        life.pod_gone(PodGone(agent_id="agent-1", reason="pod_deleted", pod_uid="uid-before"), at(2))
    assert life.state == S.READY
    # The same uid, or a report without one (the local backend), ends it.
    assert life.pod_gone(PodGone(agent_id="agent-1", reason="pod_deleted", pod_uid="uid-now"), at(3))
    assert life.terminated_reason == "pod_deleted"


@settings(max_examples=100, deadline=None)
@given(detail=st.text(max_size=600), uid=st.one_of(st.none(), st.text(max_size=200)), reason=st.text(max_size=40))
def test_pod_gone_payloads_are_validated(detail: str, uid: str | None, reason: str) -> None:
    raw = {"agent_id": "agent-1", "reason": reason, "detail": detail, "pod_uid": uid}
    try:
        message = PodGone.model_validate(raw)
    except ValueError:
        return
    assert message.reason in POD_GONE_REASONS
    assert len(message.detail) <= 512 and (message.pod_uid is None or 1 <= len(message.pod_uid) <= 128)


# ------------------------------------------------------------------ a real server
HUGE = "x" * (600 * 1024)
BAD_POD_GONE: list[tuple[str, list[Any]]] = [
    ("no argument", []),
    ("null", [None]),
    ("two arguments", [{"agent_id": "target", "reason": "process_exited"}, {"agent_id": "target", "reason": "pod_deleted"}]),
    ("huge", [{"agent_id": "target", "reason": "process_exited", "detail": HUGE}]),
    ("NaN", [math.nan]),
    ("NaN inside", [{"agent_id": "target", "reason": "process_exited", "detail": math.nan}]),
    ("a string", ["process_exited"]),
    ("a list", [["target", "process_exited"]]),
    ("a protobuf", [WorkflowExecution(workflow_id="proto")]),
    ("an unknown reason", [{"agent_id": "target", "reason": "heartbeat_lost"}]),
    ("another agent", [{"agent_id": "someone-else", "reason": "process_exited"}]),
    ("an extra field", [{"agent_id": "target", "reason": "process_exited", "kill": True}]),
    ("a long detail", [{"agent_id": "target", "reason": "process_exited", "detail": "d" * 600}]),
]


async def _task_failures(stack: Any, agent_id: str) -> int:
    history = await stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, agent_id)).fetch_history()
    return sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)


async def test_malformed_pod_gone_is_refused_and_the_agent_stays_healthy(stack: Any) -> None:
    await stack.roster.register(make_registration("target", [("rag.search", "2.1.0", 2, "A")], heartbeat_interval_s=120))
    handle = stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, "target"))
    sent = 0
    for _what, args in BAD_POD_GONE:
        try:
            await handle.signal(POD_GONE_SIGNAL, args=args)
            sent += 1
        except RPCError as exc:  # the server may refuse a payload itself (never the workflow)
            assert exc.status in (RPCStatusCode.INVALID_ARGUMENT, RPCStatusCode.RESOURCE_EXHAUSTED), exc
    refusals = await eventually(lambda: _refusals_at_least(handle, sent), timeout=10)
    pod_gone_refusals = [r for r in refusals if r.startswith("pod_gone refused:")]
    assert len(pod_gone_refusals) == sent >= 10
    assert any("expected 1 argument, got 0" in r for r in pod_gone_refusals)
    assert any("expected 1 argument, got 2" in r for r in pod_gone_refusals)
    assert any("does not match this workflow's agent" in r for r in pod_gone_refusals)
    assert any("reason" in r for r in pod_gone_refusals)
    # Still healthy: Ready, routable, leases work.
    assert (await stack.roster.describe("target")).state == S.READY
    lease = await stack.roster.acquire("rag.search", timeout=5)
    await stack.roster.release(lease)
    assert await _task_failures(stack, "target") == 0
    # A well-formed report ends it at once (its window is 6 min): the pool drops it, the pod is deleted.
    await handle.signal(POD_GONE_SIGNAL, PodGone(agent_id="target", reason="process_exited", detail="killed by SIGKILL"))
    final = await stack.roster.wait_ended(handle.id.rsplit("/", 1)[1])
    assert final.state == S.TERMINATED and final.terminated_reason == "process_exited"
    assert final.transitions[-1].reason == "process_exited: killed by SIGKILL"
    assert ("delete_pod", "search-agent", "target") in stack.backend.calls
    assert await stack.roster.find("rag.search") == []
    assert await _task_failures(stack, "target") == 0


async def _refusals_at_least(handle: Any, count: int) -> list[str] | None:
    refusals = await handle.query("refusals")
    return refusals if len(refusals) >= count else None


async def test_a_draining_agent_whose_process_exits_ends_its_drain(stack: Any) -> None:
    await stack.roster.register(make_registration("leaving", [("rag.search", "2.1.0", 2, "A")], heartbeat_interval_s=120))
    await stack.roster.acquire("rag.search", timeout=5)  # keeps the drain from finishing by itself
    await stack.roster.drain("leaving", deadline_s=600, wait=False)
    handle = stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, "leaving"))
    await eventually(lambda: _state_is(stack, "leaving", S.DRAINING), timeout=10)
    await handle.signal(POD_GONE_SIGNAL, PodGone(agent_id="leaving", reason="process_exited", detail="exit code 0"))
    final = await stack.roster.wait_ended(handle.id.rsplit("/", 1)[1])
    assert final.terminated_reason == "drain"
    assert final.transitions[-1].reason == "drain: process_exited: exit code 0 before the drain finished"
    # Its lease is revoked with it, once the pool has read its last word (the run may end first:
    # checked at once, this failed in 3 of 6 runs on main too).
    await eventually(lambda: _no_active_lease(stack), timeout=20)
    assert (await stack.roster.status()).agents_drained == 1


async def _no_active_lease(stack: Any) -> bool:
    return (await stack.roster.status()).active_leases == 0


async def _state_is(stack: Any, agent_id: str, state: AgentState) -> bool:
    return (await stack.roster.describe(agent_id)).state == state


async def test_no_timer_fires_while_a_raw_client_heartbeats_and_silence_ends_the_agent_one_window_later(stack: Any) -> None:
    """Heartbeats from a plain temporalio client, as an agent of any language sends them:
    the agent workflow arms its next liveness check in every second heartbeat's task, so no
    timer fires while they come (one may, after a heartbeat more than 1.4 intervals late on
    a loaded machine), and after the last one it is Terminated no sooner than 3 intervals on."""
    interval = 3.0
    await stack.roster.register(make_registration("beating", [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=interval))
    handle = stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, "beating"))
    for _ in range(8):
        await asyncio.sleep(interval)
        await handle.signal("heartbeat")
    final = await stack.roster.wait_ended("beating")
    assert final.state == S.TERMINATED and final.terminated_reason == "heartbeat_lost"
    events = (await handle.fetch_history()).events
    beats = [
        e.event_time.ToDatetime(tzinfo=timezone.utc)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED and e.workflow_execution_signaled_event_attributes.signal_name == "heartbeat"
    ]
    assert len(beats) == 8
    last = beats[-1]
    fired = [e.event_time.ToDatetime(tzinfo=timezone.utc) for e in events if e.event_type == EventType.EVENT_TYPE_TIMER_FIRED]
    started = [e.event_time.ToDatetime(tzinfo=timezone.utc) for e in events if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED]
    late = sum(1 for a, b in zip(beats, beats[1:]) if (b - a).total_seconds() > 1.4 * interval)
    assert len([f for f in fired if f < last]) <= late, (fired, beats)
    assert len([s for s in started if s <= last]) <= len(beats) / 2 + late + 2, (started, beats)
    assert (final.transitions[-1].at - last).total_seconds() >= MISSED_HEARTBEATS * interval - 0.5
