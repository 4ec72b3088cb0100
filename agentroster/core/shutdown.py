"""A pool's shutdown as pure decisions: what to do next, and when it is over.

The `shutdown` update starts a `ShutdownPlan`; `PoolCore` feeds it what happens
(leases ending, agents heard of or gone, scale requests answered) with `now`, and
the pool workflow carries out the effects it queues. Three phases:

1. `finishing-leases`: from the update on the pool grants nothing (acquires are
   refused, every queued caller is told at once: its ticket ends with the
   reason, which its next poll reads). Leases already granted run on until released or
   expired; those still held at the deadline are revoked (holder workflows get
   `lease_revoked`, as when an agent dies). Agents keep serving meanwhile: a
   holder is never cut off before the deadline.
2. `draining-agents`: every agent the pool knows is told to drain (reason
   `pool-shutdown`), then every deployment it knows of (agents, the catalog,
   policies, scale demand) is scaled to zero. Drained first, so no agent is
   stopped by its backend under a task; scaled right after, so a drained agent's
   deleted pod is not replaced for long (a replacement that does register is a
   straggler, below).
3. `done`: no agent workflow left and every scale request answered. The pool
   workflow returns its final `PoolStatus` and its run completes.

Why the pool waits for every agent workflow to end, and what stops a straggler
from starting a new pool run. An agent workflow tells its pool about itself by
signal-with-start (`notify_pool`), so that a pool that is not running yet is
started rather than the message lost. After a shutdown that would bring the
pool back: a drained agent's last word (Terminated), its periodic resync, or a
replacement pod registering late would each start a fresh run. Three rules
close that race:

- The pool ends only once every agent workflow it knows of has sent its last
  word (Terminated; after it an agent workflow only deletes its pod and ends,
  it never speaks to the pool again), so no agent it drained can still be
  talking to it. Agents it first hears of while
  shutting down (a replacement pod that registered late) are never indexed:
  they are drained (`STRAGGLER_DRAIN_DEADLINE_S`, nothing was ever routed to
  them) and waited for as well. An agent that does not end in time is checked
  (does its workflow still run?) every `CHECK_GRACE_S`, so a lost word cannot
  hold the pool open forever.
- A pool run ends by completing only through a shutdown (it otherwise runs
  forever or continues as new). `notify_pool` and the client start the pool
  with the id-reuse policy `ALLOW_DUPLICATE_FAILED_ONLY`: the server itself, in
  the same call, refuses to start a run after one that completed, so there is
  no window between a check and the start. `notify_pool`, refused, drains the
  agent that spoke (unless it is already draining or ended) instead of
  resurrecting the pool; the client raises `PoolShutdownError`. A pool
  terminated or failed by other means may still be started again, and an
  operator restarts a shut-down pool explicitly (`ensure_pool(restart=True)`,
  `agentroster worker --restart-pool`, `agentroster dev`).
- A signal that reaches the pool after the run decided to complete fails that
  completion (the server does not complete a run with unhandled signals): the
  workflow runs again with the signal, and a straggler's snapshot puts the plan
  back to `draining-agents`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agentroster.messages import DrainRequest, ScaleRequest
from agentroster.models import POOL_SHUTDOWN_REASON, PoolShutdown

FINISHING_LEASES = "finishing-leases"
DRAINING_AGENTS = "draining-agents"
DONE = "done"
# Agents the pool knew: every lease has ended (released, expired or revoked) by the
# time they are drained, so they end as soon as the pool confirms their count of zero;
# the deadline only bounds a lost confirmation.
AGENT_DRAIN_DEADLINE_S = 30.0
# Agents first heard of while shutting down: the pool never routed anything to them
# and never confirms their count (it does not index them), so their deadline ends them.
STRAGGLER_DRAIN_DEADLINE_S = 5.0
# An agent told to drain that has not ended this long after its drain deadline is
# checked (does its workflow still run?), and again every CHECK_GRACE_S.
CHECK_GRACE_S = 15.0


@dataclass
class ShutdownEffects:
    """What the pool workflow carries out for the shutdown after a message or a tick."""

    drains: list[tuple[str, DrainRequest]] = field(default_factory=list)  # (agent id, request)
    scales: list[ScaleRequest] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # agents to check: does their workflow still run?

    def __bool__(self) -> bool:
        return bool(self.drains or self.scales or self.checks)


@dataclass
class ShutdownPlan:
    """One pool's shutdown: its phase, what it waits for and the effects still to carry out."""

    reason: str
    requested_at: float
    deadline: float
    phase: str = FINISHING_LEASES
    leases_at_start: int = 0
    leases_revoked: int = 0
    waiters_ended: int = 0
    drained: set[str] = field(default_factory=set)  # every agent told to drain, each counted once
    finished_at: float | None = None
    deployments: set[str] = field(default_factory=set)  # every deployment to scale to zero
    scaled: list[str] = field(default_factory=list)
    scale_failures: dict[str, str] = field(default_factory=dict)
    scaling: set[str] = field(default_factory=set)  # asked, not answered yet
    to_scale: list[str] = field(default_factory=list)  # not asked yet
    waiting: dict[str, float] = field(default_factory=dict)  # agent told to drain -> when to check on it
    pending: dict[str, str] = field(default_factory=dict)  # agent heard of while leases finish -> its deployment
    to_drain: list[tuple[str, float]] = field(default_factory=list)  # (agent, drain deadline_s) to signal

    # ------------------------------------------------------------ decisions
    def leases_finished(self, now: float, active_leases: int) -> bool:
        """Whether phase 1 is over: no lease in flight, or the deadline has come."""
        return self.phase == FINISHING_LEASES and (active_leases == 0 or now >= self.deadline)

    def drain_all(self, now: float, agents: Iterable[tuple[str, str]], deployments: Iterable[str]) -> None:
        """Phase 2: drain `agents` ((agent id, deployment)) and every straggler, scale every deployment to zero."""
        self.phase = DRAINING_AGENTS
        for agent_id, deployment in agents:
            self._drain(agent_id, AGENT_DRAIN_DEADLINE_S, now)
            self.deployments.add(deployment)
        for agent_id, deployment in sorted(self.pending.items()):
            if agent_id not in self.waiting:
                self._drain(agent_id, STRAGGLER_DRAIN_DEADLINE_S, now)
            self.deployments.add(deployment)
        self.pending.clear()
        self.deployments.update(deployments)
        self.to_scale = sorted(self.deployments - self.scaling - set(self.scaled) - set(self.scale_failures))

    def heard_of(self, agent_id: str, deployment: str, now: float) -> None:
        """A running agent the pool does not route to spoke while shutting down: drain it too (or soon)."""
        if self.phase == FINISHING_LEASES:
            self.pending[agent_id] = deployment  # drained with the others once the leases are done
            return
        if self.phase == DONE:  # a word that came in as the run was about to end: not over after all
            self.phase, self.finished_at = DRAINING_AGENTS, None
        if agent_id not in self.waiting:
            self._drain(agent_id, STRAGGLER_DRAIN_DEADLINE_S, now)
        if deployment not in self.deployments:
            self.deployments.add(deployment)
            self.to_scale.append(deployment)

    def _drain(self, agent_id: str, deadline_s: float, now: float) -> None:
        self.waiting[agent_id] = now + deadline_s + CHECK_GRACE_S
        self.to_drain.append((agent_id, deadline_s))
        self.drained.add(agent_id)

    def ended(self, agent_id: str) -> None:
        """The agent's workflow has ended (its Terminated word, or it was found gone)."""
        self.waiting.pop(agent_id, None)
        self.pending.pop(agent_id, None)

    def still_running(self, agent_id: str, now: float) -> None:
        """A check found the agent's workflow running past its drain: tell it again, check again later."""
        if agent_id in self.waiting:
            self.waiting[agent_id] = now + STRAGGLER_DRAIN_DEADLINE_S + CHECK_GRACE_S
            self.to_drain.append((agent_id, STRAGGLER_DRAIN_DEADLINE_S))

    def scale_answered(self, deployment: str, error: str | None) -> None:
        self.scaling.discard(deployment)
        if error is None:
            if deployment not in self.scaled:
                self.scaled.append(deployment)
            self.scale_failures.pop(deployment, None)
        else:
            self.scale_failures[deployment] = error

    def complete(self, now: float, agents_indexed: int) -> bool:
        """Whether the shutdown is over (it then records when): phase 2 with nothing left to wait for."""
        if self.phase == DONE:
            return True
        if self.phase != DRAINING_AGENTS or agents_indexed or self.waiting or self.pending:
            return False
        if self.to_drain or self.to_scale or self.scaling:
            return False
        self.phase, self.finished_at = DONE, now
        return True

    def next_wakeup(self) -> float | None:
        """The next moment the plan must act without a message: the deadline, then the next check."""
        if self.phase == FINISHING_LEASES:
            return self.deadline
        if self.phase == DRAINING_AGENTS and self.waiting:
            return min(self.waiting.values())
        return None

    # --------------------------------------------------------------- effects
    def take_effects(self, now: float) -> ShutdownEffects:
        effects = ShutdownEffects(
            drains=[(agent_id, DrainRequest(reason=POOL_SHUTDOWN_REASON, deadline_s=s)) for agent_id, s in self.to_drain],
            scales=[
                ScaleRequest(deployment=d, replicas=0, reason=f"{POOL_SHUTDOWN_REASON}: {self.reason}", shutdown=True)
                for d in self.to_scale
            ],
        )
        self.to_drain = []
        self.scaling.update(self.to_scale)
        self.to_scale = []
        if self.phase == DRAINING_AGENTS:
            for agent_id, at in sorted(self.waiting.items()):
                if at <= now:
                    effects.checks.append(agent_id)
                    self.waiting[agent_id] = now + CHECK_GRACE_S  # checked again later if still there
        return effects

    # ---------------------------------------------------------------- report
    def report(self, to_datetime: Callable[[float], datetime]) -> PoolShutdown:
        return PoolShutdown(
            reason=self.reason,
            phase=self.phase,  # type: ignore[arg-type]
            requested_at=to_datetime(self.requested_at),
            deadline=to_datetime(self.deadline),
            finished_at=to_datetime(self.finished_at) if self.finished_at is not None else None,
            leases_at_start=self.leases_at_start,
            leases_revoked=self.leases_revoked,
            waiters_ended=self.waiters_ended,
            agents_drained=len(self.drained),
            agents_left=len(self.waiting) + len(self.pending),
            deployments_scaled=list(self.scaled),
            scale_failures=dict(sorted(self.scale_failures.items())),
        )

    # ------------------------------------------------------- continue-as-new
    def to_row(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "requested_at": self.requested_at,
            "deadline": self.deadline,
            "phase": self.phase,
            "counts": [self.leases_at_start, self.leases_revoked, self.waiters_ended],
            "drained": sorted(self.drained),
            "finished_at": self.finished_at,
            "deployments": sorted(self.deployments),
            "scaled": list(self.scaled),
            "scale_failures": dict(sorted(self.scale_failures.items())),
            # Asked but not answered: the next run asks again (scaling to zero is idempotent).
            "to_scale": sorted(set(self.to_scale) | self.scaling),
            "waiting": dict(sorted(self.waiting.items())),
            "pending": dict(sorted(self.pending.items())),
            "to_drain": [list(d) for d in self.to_drain],
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ShutdownPlan:
        leases_at_start, leases_revoked, waiters_ended = row["counts"]
        return cls(
            reason=row["reason"],
            requested_at=row["requested_at"],
            deadline=row["deadline"],
            phase=row["phase"],
            leases_at_start=leases_at_start,
            leases_revoked=leases_revoked,
            waiters_ended=waiters_ended,
            drained=set(row["drained"]),
            finished_at=row["finished_at"],
            deployments=set(row["deployments"]),
            scaled=list(row["scaled"]),
            scale_failures=dict(row["scale_failures"]),
            to_scale=list(row["to_scale"]),
            waiting=dict(row["waiting"]),
            pending=dict(row["pending"]),
            to_drain=[(a, s) for a, s in row["to_drain"]],
        )
