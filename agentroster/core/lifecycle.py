"""The agent lifecycle state machine: which transitions exist, and one agent's life.

Pure and deterministic: `now` is always passed in. `AgentLifecycle` is what
`AgentWorkflow` holds; the workflow turns its decisions into effects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import TypeAdapter

from agentroster.messages import LoadNotice, PodGone
from agentroster.models import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    MISSED_HEARTBEATS,
    AgentRegistration,
    AgentState,
    AgentStatus,
    Transition,
)

S = AgentState

# The only transitions that exist. Re-registering (new capabilities, a restarted
# process with the same id) passes through Registering again.
ALLOWED_TRANSITIONS: dict[AgentState | None, frozenset[AgentState]] = {
    None: frozenset({S.SPAWNING}),
    S.SPAWNING: frozenset({S.REGISTERING, S.TERMINATED}),
    S.REGISTERING: frozenset({S.READY, S.TERMINATED}),
    S.READY: frozenset({S.BUSY, S.REGISTERING, S.DRAINING, S.TERMINATED}),
    S.BUSY: frozenset({S.READY, S.REGISTERING, S.DRAINING, S.TERMINATED}),
    S.DRAINING: frozenset({S.TERMINATED}),
    S.TERMINATED: frozenset(),
}

# Lifecycle transitions kept: the first FIRST_TRANSITIONS_KEPT (how the agent
# came up: Spawning, Registering, Ready) and the most recent rest. Load flips
# never count against this. It is still bounded because an agent that
# re-registers in a loop (a crash-looping process reusing its id) would
# otherwise grow the workflow's state, and every continue-as-new payload,
# without end.
RECENT_TRANSITIONS_KEPT = 50
# The pool numbers all its notices in one sequence (every agent's), so one agent
# sees gaps. A billion is more than a busy pool (~2,000 notices/s) sends to others
# in the days between two notices to one idle agent; a forged 2**53 is refused.
# (A forger who knows the rule can still stall a drain until its deadline: the
# deadline is what bounds a drain, whoever signals.)
MAX_NOTICE_SEQ_JUMP = 1_000_000_000
FIRST_TRANSITIONS_KEPT = 3
# Ready <-> Busy flips caused by load: a short ring, plus counters. A
# capacity-1 agent flips on every lease, so these must not share the list above.
LOAD_FLIPS_KEPT = 10
# Snapshots are sent to the pool when the agent changes (registered, drained,
# recovered, terminated) and re-sent every RESYNC_S, or every RESYNC_HEARTBEATS
# heartbeat intervals if longer, at a wake-up up to WAKE_AHEAD_HEARTBEATS intervals
# before it is due (so it needs no timer of its own). The pool drops an agent silent
# for 3 of them.
RESYNC_HEARTBEATS = 6
RESYNC_S = 1800.0
# A heartbeat wakes the workflow when its armed wake-up is due within this many
# intervals: the wake-up is decided (and the next one armed) in the heartbeat's own
# workflow task, so while heartbeats come no timer fires. A timer firing is a workflow
# task of its own (about as much server work as the heartbeat's); arming one in a task
# that runs anyway costs only its commands. At 1.5 a wake-up is armed at every second
# heartbeat, and heartbeats up to half an interval late still come before it.
WAKE_AHEAD_HEARTBEATS = 1.5


def resync_interval(heartbeat_interval_s: float) -> float:
    """How often an agent heartbeating every `heartbeat_interval_s` re-sends its snapshot."""
    return max(RESYNC_S, RESYNC_HEARTBEATS * heartbeat_interval_s)


class TransitionRefused(ValueError):
    """An illegal transition was asked for; nothing was applied."""


def refusal(from_state: AgentState | None, to_state: AgentState) -> str | None:
    """Why `from_state -> to_state` is illegal, or None when it is allowed."""
    if to_state in ALLOWED_TRANSITIONS.get(from_state, frozenset()):
        return None
    allowed = ", ".join(sorted(s.value for s in ALLOWED_TRANSITIONS.get(from_state, frozenset()))) or "nothing"
    return f"{from_state.value if from_state else 'start'} -> {to_state.value} is not a lifecycle transition (allowed: {allowed})"


@dataclass
class AgentLifecycle:
    """One agent's lifecycle, liveness and load, as its workflow owns them."""

    agent_id: str
    pool: str
    state: AgentState | None = None
    registration: AgentRegistration | None = None
    last_heartbeat: datetime | None = None
    in_flight: int = 0
    saturated: bool = False
    load_seq: int = -1
    load_epoch: str = ""
    # When the pool is next re-sent this agent's snapshot (a resync, so a pool that lost
    # its state, or missed a message, learns it again); see `told_pool`.
    resync_at: datetime | None = None
    drain_deadline: datetime | None = None
    drain_reason: str | None = None
    # Only a count the pool sent after it saw the agent Draining can end a drain:
    # earlier counts may miss a lease granted just before the pool heard.
    drain_count_confirmed: bool = False
    terminated_reason: str | None = None
    # Lifecycle transitions only (see RECENT_TRANSITIONS_KEPT); load flips live below.
    transitions: list[Transition] = field(default_factory=list)
    started_at: datetime | None = None
    transitions_dropped: int = 0
    recent_load_flips: list[Transition] = field(default_factory=list)
    busy_flips: int = 0
    last_busy_at: datetime | None = None
    # Silent, but the pool refused its termination (self-preservation or the cap):
    # it asks again at this moment, unless a heartbeat comes first.
    eviction_held_until: datetime | None = None
    eviction_held: str | None = None
    eviction_denials: int = 0
    # Registrations this agent workflow has applied, and the one that waits to hear
    # from the pool that it was indexed (`pool_indexed`): `wait_routable` answers
    # only then. None: nothing waits.
    registrations: int = 0
    awaits_index: int | None = None

    # -- transitions -------------------------------------------------------
    def transition(self, to_state: AgentState, reason: str, now: datetime) -> Transition:
        """Apply one lifecycle transition and keep it in `transitions`.

        Raises TransitionRefused without changing anything. Load flips go
        through `_load_flip` instead, so they never push this history out.
        """
        step = self._step(to_state, reason, now)
        self.transitions.append(step)
        while len(self.transitions) > RECENT_TRANSITIONS_KEPT:
            # Drop from just after the first ones: how the agent came up stays visible.
            del self.transitions[FIRST_TRANSITIONS_KEPT]
            self.transitions_dropped += 1
        return step

    def _load_flip(self, to_state: AgentState, reason: str, now: datetime) -> Transition:
        """Ready <-> Busy because of load: counted and kept in a short ring of its own."""
        step = self._step(to_state, reason, now)
        self.recent_load_flips.append(step)
        del self.recent_load_flips[:-LOAD_FLIPS_KEPT]
        if to_state == S.BUSY:
            self.busy_flips += 1
            self.last_busy_at = now
        return step

    def _step(self, to_state: AgentState, reason: str, now: datetime) -> Transition:
        why = refusal(self.state, to_state)
        if why:
            raise TransitionRefused(why)
        step = Transition(from_state=self.state, to_state=to_state, reason=reason, at=now)
        self.state = to_state
        return step

    def spawn(self, now: datetime) -> list[Transition]:
        self.started_at = now
        return [self.transition(S.SPAWNING, "workflow started", now)]

    def register(self, reg: AgentRegistration, now: datetime) -> list[Transition]:
        """Spawning/Ready/Busy -> Registering. Refused while Draining or Terminated."""
        if reg.agent_id != self.agent_id:
            raise TransitionRefused(f"registration for {reg.agent_id!r} sent to agent {self.agent_id!r}")
        if self.state in (S.DRAINING, S.TERMINATED):
            raise TransitionRefused(f"agent is {self.state.value}; it must start a new run to register again")
        reason = "registered" if self.registration is None else "re-registered"
        self.registration = reg
        self.last_heartbeat = now
        self.release_eviction_hold()  # the registration tells the pool it is back
        step = self.transition(S.REGISTERING, reason, now)
        self.registrations += 1
        self.awaits_index = self.registrations
        return [step]

    def pool_indexed(self, registration: int) -> bool:
        """The pool says it indexed registration number `registration`: True when that is the one waiting.

        An older number (a registration since replaced) or none waiting changes nothing."""
        if self.awaits_index is None or registration < self.awaits_index or registration > self.registrations:
            return False
        self.awaits_index = None
        return True

    @property
    def routable_for_caller(self) -> bool:
        """What `wait_routable` waits for: Ready or Busy and indexed by its pool, or ended.

        Draining and Terminated answer too: the caller then learns it will not be routed to."""
        if self.state in (S.DRAINING, S.TERMINATED):
            return True
        return self.state in (S.READY, S.BUSY) and self.awaits_index is None

    def indexed(self, now: datetime) -> list[Transition]:
        """Registering -> Ready (or Busy) once the pool has indexed the agent."""
        if self.state != S.REGISTERING:
            return []
        steps = [self.transition(S.READY, "indexed by pool", now)]
        if self.saturated:
            steps.append(self._load_flip(S.BUSY, f"saturated ({self.in_flight} in flight)", now))
        return steps

    def heartbeat(self, now: datetime) -> None:
        self.last_heartbeat = now

    def implausible(self, notice: LoadNotice) -> str | None:
        """Why a load notice cannot be the pool's, or None.

        Anyone may signal a workflow: a forged count above the agent's capacity,
        or a sequence number far ahead of the pool's (which would make every real
        notice look stale and hold a drain until its deadline), is refused.
        """
        if self.registration is not None and notice.in_flight > self.registration.total_concurrency:
            return (
                f"in_flight {notice.in_flight} exceeds the agent's max_concurrency "
                f"{self.registration.total_concurrency}"
            )
        # A new pool (another epoch) counts from 1 again.
        base = self.load_seq if notice.epoch == self.load_epoch and self.load_seq >= 0 else 0
        if notice.seq > base + MAX_NOTICE_SEQ_JUMP:
            return f"seq {notice.seq} is implausibly far ahead of the last notice ({base})"
        return None

    def apply_load(self, notice: LoadNotice, now: datetime) -> list[Transition]:
        """Take the pool's load notice; Ready <-> Busy follows saturation. Stale notices are ignored."""
        if notice.epoch != self.load_epoch:
            self.load_epoch, self.load_seq = notice.epoch, -1  # a new pool counts from the start
        if notice.seq <= self.load_seq:
            return []
        self.load_seq = notice.seq
        self.in_flight = notice.in_flight
        self.saturated = notice.saturated
        if notice.draining and self.state == S.DRAINING:
            self.drain_count_confirmed = True
        if self.state == S.READY and notice.saturated:
            return [self._load_flip(S.BUSY, f"saturated ({notice.in_flight} in flight)", now)]
        if self.state == S.BUSY and not notice.saturated:
            return [self._load_flip(S.READY, f"slot freed ({notice.in_flight} in flight)", now)]
        return []

    def drain(self, reason: str, deadline_s: float, now: datetime) -> list[Transition]:
        """Stop new leases at once; finish when in-flight reaches zero or the deadline passes."""
        if self.state == S.DRAINING:
            return []
        if self.state == S.TERMINATED:
            raise TransitionRefused("agent is already Terminated")
        self.drain_reason = reason
        self.drain_deadline = now + timedelta(seconds=deadline_s)
        self.release_eviction_hold()  # no liveness while draining: the drain decides its end
        if self.state in (S.SPAWNING, S.REGISTERING):
            return self.terminate("drain", now)
        return [self.transition(S.DRAINING, reason, now)]

    def drain_finished(self, now: datetime) -> bool:
        return self.state == S.DRAINING and (
            (self.drain_count_confirmed and self.in_flight == 0)
            or (self.drain_deadline is not None and now >= self.drain_deadline)
        )

    def terminate(self, reason: str, now: datetime, detail: str | None = None) -> list[Transition]:
        """Final. `reason` is what operators filter on; `detail` only annotates the transition."""
        if self.state == S.TERMINATED:
            return []
        self.terminated_reason = reason
        self.release_eviction_hold()
        return [self.transition(S.TERMINATED, f"{reason}: {detail}" if detail else reason, now)]

    def pod_gone(self, message: PodGone, now: datetime) -> list[Transition]:
        """The backend saw the agent's process exit or its pod go: Terminated at once.

        No eviction permission is asked (the process is gone, not silent). A Draining
        agent ends its drain (reason `drain`, the exit in the detail). Refused (nothing
        changes) for another agent, or for another pod of the same name (`pod_uid`).
        """
        if message.agent_id != self.agent_id:
            raise TransitionRefused(f"pod_gone for {message.agent_id!r} sent to agent {self.agent_id!r}")
        registered_uid = (self.registration.metadata or {}).get("pod_uid") if self.registration else None
        if message.pod_uid and isinstance(registered_uid, str) and registered_uid and registered_uid != message.pod_uid:
            raise TransitionRefused(
                f"pod_gone for pod uid {message.pod_uid!r}, but the agent registered from pod uid {registered_uid!r} "
                "(a pod recreated under the same name)"
            )
        if self.state == S.TERMINATED:
            return []
        what = f"{message.reason}: {message.detail}" if message.detail else message.reason
        if self.state == S.DRAINING:
            return self.terminate("drain", now, f"{what} before the drain finished")
        return self.terminate(message.reason, now, message.detail or None)

    # -- liveness ------------------------------------------------------------
    @property
    def heartbeat_interval_s(self) -> float:
        return self.registration.heartbeat_interval_s if self.registration else DEFAULT_HEARTBEAT_INTERVAL_S

    def liveness_deadline(self) -> datetime | None:
        """When the agent is declared dead without another heartbeat."""
        if self.state in (None, S.TERMINATED, S.DRAINING):
            return None
        seen = self.last_heartbeat or self.started_at
        if seen is None:
            return None
        return seen + timedelta(seconds=MISSED_HEARTBEATS * self.heartbeat_interval_s)

    def is_lost(self, now: datetime) -> bool:
        deadline = self.liveness_deadline()
        return deadline is not None and now >= deadline

    @property
    def heartbeat_window_s(self) -> float:
        """How long without a heartbeat makes the agent lost: 3 x heartbeat_interval_s."""
        return MISSED_HEARTBEATS * self.heartbeat_interval_s

    def hold_eviction(self, reason: str, retry_after_s: float, now: datetime) -> None:
        """The pool refused this silent agent's termination: stay, ask again after `retry_after_s`."""
        self.eviction_held_until = now + timedelta(seconds=retry_after_s)
        self.eviction_held = reason
        self.eviction_denials += 1

    def release_eviction_hold(self) -> bool:
        """Not held any more (a heartbeat came back, a drain, a registration). Whether it was."""
        was = self.eviction_held_until is not None
        self.eviction_held_until = None
        self.eviction_held = None
        return was

    def eviction_retry_due(self, now: datetime) -> bool:
        return self.eviction_held_until is not None and now >= self.eviction_held_until

    @property
    def resync_interval_s(self) -> float:
        """How often the pool is told this agent's snapshot again (`resync_interval`)."""
        return resync_interval(self.heartbeat_interval_s)

    def told_pool(self, now: datetime, phase: float | None = None) -> None:
        """The pool was sent this agent's snapshot at `now`: when the next resync is due.

        One resync interval after a resync (no `phase`). After any other notice (a
        registration, a drain, a recovery) somewhere between half an interval and one,
        placed by `phase` in [0, 1) (`workflow.random()`). A heartbeat takes a resync
        up to 1.5 heartbeat intervals before it is due (`resync_wanted`), so a burst of
        registrations heartbeating in step resyncs in several smaller waves, one a
        heartbeat apart, instead of one, and no agent later than one interval after
        the pool last heard from it.
        """
        factor = 1.0 if phase is None else 1.0 - 0.5 * phase
        self.resync_at = now + timedelta(seconds=factor * self.resync_interval_s)

    def resync_due(self) -> datetime | None:
        if self.state not in (S.READY, S.BUSY):
            return None
        return self.resync_at

    def resync_wanted(self, now: datetime) -> bool:
        """Whether to re-send the snapshot now: up to WAKE_AHEAD_HEARTBEATS intervals
        early. The resync is a wake-up like the liveness deadline, so the first heartbeat
        within that much of it wakes the workflow (`wake_wanted`) and the resync goes in
        that heartbeat's task: it costs no timer of its own.
        """
        due = self.resync_due()
        return due is not None and now >= due - self._wake_ahead

    def wake_wanted(self, armed: datetime | None, now: datetime) -> bool:
        """Whether a heartbeat at `now` wakes the workflow: the wake-up it armed for this
        lifecycle (`armed`, from `next_wakeup`; None when its timer waits for something
        else) is due within WAKE_AHEAD_HEARTBEATS intervals. The wake decides what was due
        (a resync), and arms the next wake-up from this heartbeat, so a heartbeating agent
        never has a timer fire; one that falls silent is still declared lost exactly one
        window after its last heartbeat (the timer armed last fires, and re-arms for it).
        """
        return armed is not None and armed - now < self._wake_ahead

    @property
    def _wake_ahead(self) -> timedelta:
        return timedelta(seconds=WAKE_AHEAD_HEARTBEATS * self.heartbeat_interval_s)

    def next_wakeup(self) -> datetime | None:
        """The earliest moment something must be decided without a message."""
        if self.eviction_held_until is not None:
            # Lost and held (Ready or Busy): only the next ask is due; a heartbeat wakes it sooner.
            return self.eviction_held_until
        candidates = (self.liveness_deadline(), self.drain_deadline if self.state == S.DRAINING else None, self.resync_due())
        moments = [m for m in candidates if m]
        return min(moments) if moments else None

    def status(self) -> AgentStatus:
        return AgentStatus(
            agent_id=self.agent_id,
            pool=self.pool,
            state=self.state or S.SPAWNING,
            in_flight=self.in_flight,
            last_heartbeat=self.last_heartbeat,
            registration=self.registration,
            transitions=list(self.transitions),
            transitions_dropped=self.transitions_dropped,
            terminated_reason=self.terminated_reason,
            busy_flips=self.busy_flips,
            last_busy_at=self.last_busy_at,
            recent_load_flips=list(self.recent_load_flips),
            eviction_held=self.eviction_held,
            eviction_denials=self.eviction_denials,
            indexed_by_pool=self.awaits_index is None,
        )

    # -- continue-as-new -----------------------------------------------------
    def to_carried(self) -> dict[str, Any]:
        """This lifecycle as JSON-safe data for continue-as-new; `from_carried` reads it back."""
        return _CARRIED.dump_python(self, mode="json")

    @classmethod
    def from_carried(cls, carried: Mapping[str, Any]) -> AgentLifecycle:
        """The lifecycle `to_carried` wrote."""
        return _CARRIED.validate_python(carried)


_CARRIED: TypeAdapter[AgentLifecycle] = TypeAdapter(AgentLifecycle)
