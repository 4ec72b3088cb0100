"""The agent lifecycle state machine: which transitions exist, and one agent's life.

Pure and deterministic: `now` is always passed in. `AgentLifecycle` is what
`AgentWorkflow` holds; the workflow turns its decisions into effects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from agentroster.contracts import (
    MISSED_HEARTBEATS,
    AgentRegistration,
    AgentState,
    AgentStatus,
    LoadNotice,
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

RECENT_TRANSITIONS_KEPT = 50
RESYNC_HEARTBEATS = 6
RESYNC_MIN_S = 30.0


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
    # When the pool was last told this agent's snapshot (re-sent periodically so a
    # pool that lost its state, or missed a message, learns it again).
    last_told_pool: datetime | None = None
    drain_deadline: datetime | None = None
    drain_reason: str | None = None
    # Only a count the pool sent after it saw the agent Draining can end a drain:
    # earlier counts may miss a lease granted just before the pool heard.
    drain_count_confirmed: bool = False
    terminated_reason: str | None = None
    transitions: list[Transition] = field(default_factory=list)
    started_at: datetime | None = None

    # -- transitions -------------------------------------------------------
    def transition(self, to_state: AgentState, reason: str, now: datetime) -> Transition:
        """Apply one transition, or raise TransitionRefused without changing anything."""
        why = refusal(self.state, to_state)
        if why:
            raise TransitionRefused(why)
        step = Transition(from_state=self.state, to_state=to_state, reason=reason, at=now)
        self.state = to_state
        self.transitions.append(step)
        del self.transitions[:-RECENT_TRANSITIONS_KEPT]
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
        return [self.transition(S.REGISTERING, reason, now)]

    def indexed(self, now: datetime) -> list[Transition]:
        """Registering -> Ready (or Busy) once the pool has indexed the agent."""
        if self.state != S.REGISTERING:
            return []
        steps = [self.transition(S.READY, "indexed by pool", now)]
        if self.saturated:
            steps.append(self.transition(S.BUSY, f"saturated ({self.in_flight} in flight)", now))
        return steps

    def heartbeat(self, now: datetime) -> None:
        self.last_heartbeat = now

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
            return [self.transition(S.BUSY, f"saturated ({notice.in_flight} in flight)", now)]
        if self.state == S.BUSY and not notice.saturated:
            return [self.transition(S.READY, f"slot freed ({notice.in_flight} in flight)", now)]
        return []

    def drain(self, reason: str, deadline_s: float, now: datetime) -> list[Transition]:
        """Stop new leases at once; finish when in-flight reaches zero or the deadline passes."""
        if self.state == S.DRAINING:
            return []
        if self.state == S.TERMINATED:
            raise TransitionRefused("agent is already Terminated")
        self.drain_reason = reason
        self.drain_deadline = now + timedelta(seconds=deadline_s)
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
        return [self.transition(S.TERMINATED, f"{reason}: {detail}" if detail else reason, now)]

    # -- liveness ------------------------------------------------------------
    @property
    def heartbeat_interval_s(self) -> float:
        from agentroster.contracts import DEFAULT_HEARTBEAT_INTERVAL_S

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
    def resync_interval_s(self) -> float:
        """How often the pool is told this agent's snapshot again: 6 heartbeats, at least 30 s."""
        return max(RESYNC_MIN_S, RESYNC_HEARTBEATS * self.heartbeat_interval_s)

    def resync_due(self) -> datetime | None:
        if self.state not in (S.READY, S.BUSY) or self.last_told_pool is None:
            return None
        return self.last_told_pool + timedelta(seconds=self.resync_interval_s)

    def next_wakeup(self) -> datetime | None:
        """The earliest moment something must be decided without a message."""
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
            terminated_reason=self.terminated_reason,
        )
