"""The pool's decisions: index, leases, the wait queue, drift, scale demand and sizing policies.

`PoolCore` is everything `PoolWorkflow` decides, with no Temporal in it. The
workflow feeds it messages with `now` (seconds since the epoch) and carries
out the effects it queues: load notices to agent workflows, revocation notices
to lease holders, scale requests to the backend.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, Field

from agentroster.errors import PoolReport
from agentroster.messages import (
    AcquireReply,
    AcquireRequest,
    AgentSnapshot,
    CapabilityDigest,
    HealthResult,
    HealthTarget,
    EvictionAsk,
    EvictionVerdict,
    LeaseRevoked,
    IndexNotice,
    LoadNotice,
    RenewRequest,
    ScaleRequest,
)
from agentroster.models import (
    AgentState,
    CapabilityRef,
    CapabilityStatus,
    EndedAgentRow,
    EvictionPolicy,
    Lease,
    OutlierPolicy,
    PoolAgentRow,
    PoolPolicy,
    PoolStatus,
    ROUTABLE_STATES,
    TicketStatus,
    effective_total_concurrency,
)
from agentroster.core.autoscaler import Autoscaler, DeploymentLoad, ScaleDown
from agentroster.core.drift import DriftDetector
from agentroster.core.health import CLOSED, HEALTH_BATCH_MAX, OPEN, HealthTracker
from agentroster.core.outliers import OutlierTracker
from agentroster.core.eviction import EvictionGuard
from agentroster.core.index import CapabilityIndex, IndexedAgent
from agentroster.core.leases import LeaseBook, LeaseRecord
from agentroster.core.scaling import ScaleCoalescer
from agentroster.vocabulary.shards import ShardLayout, tag_id
from agentroster.core.shutdown import DRAINING_AGENTS, ShutdownEffects, ShutdownPlan
from agentroster.core.waitqueue import Waiter, WaitQueue

# A waiter the client stopped polling (and never cancelled) is dropped this
# long after its own wait ended.
WAITER_GRACE_S = 5.0
RECENT_WARNINGS_KEPT = 20
# Agents that left the pool, kept for `status` (a bounded ring carried across continue-as-new).
RECENTLY_ENDED_KEPT = 50
ENDED_CAPABILITIES_SHOWN = 8
STALE_RESYNCS = 3
# Load changes re-evaluate sizing policies at most this often (each evaluation counts every agent).
AUTOSCALE_EVERY_S = 1.0
DROPPED_REPORTS_KEPT = 1000
DROPPED_REPORTS_CARRIED = 200  # of them, carried to the next run (~0.2 KB each before compression)

# The health checks, breaker and outlier settings of a deployment without a policy: the
# defaults. Idle agents are checked every 5 minutes: busy agents prove themselves by their
# tasks' outcomes (outlier ejection, at no cost), and one pool-wide round costs 5 actions
# (its alarm and the check, each with its report), so a pool pays 60 actions an hour for it,
# whatever its size (docs/concepts/outliers.md).
DEFAULT_PROTECTION = PoolPolicy()


def _lease_id(random_part: str, request_id: str | None) -> str:
    """An unguessable lease id: the workflow's random id mixed with the caller's secret request id.

    The workflow's ids come from a generator seeded with the run id, which anyone
    who can describe the workflow reads; only the caller's secret makes an id
    that nobody else can predict.
    """
    if not request_id:
        return random_part
    return hashlib.sha256(f"{request_id}:{random_part}".encode()).hexdigest()[:32]


def _ticket(request_id: str) -> str:
    """A caller's place in the queue, derived from its secret: knowing the ticket is the proof of holding it."""
    return hashlib.sha256(f"ticket:{request_id}".encode()).hexdigest()[:32]


def _state_kind(state: AgentState) -> str:
    """How a reported state routes: Registering, Ready and Busy alike (a free slot decides)."""
    if state in (AgentState.REGISTERING, AgentState.READY, AgentState.BUSY):
        return "serving"
    return {AgentState.DRAINING: "draining", AgentState.TERMINATED: "terminated"}.get(state, "spawning")


def _differences(hint: AgentSnapshot, truth: AgentSnapshot) -> str:
    """What a snapshot signal said that the agent workflow itself does not ('' when they agree on routing)."""
    out: list[str] = []
    if _state_kind(hint.state) != _state_kind(truth.state):
        out.append(f"state {truth.state.value}, not {hint.state.value}")
    for name in ("deployment", "endpoint"):
        if getattr(hint, name) != getattr(truth, name):
            out.append(f"{name} {getattr(truth, name)!r}, not {getattr(hint, name)!r}")
    hint_cap = effective_total_concurrency(hint.max_concurrency, hint.capabilities)
    truth_cap = effective_total_concurrency(truth.max_concurrency, truth.capabilities)
    if hint_cap != truth_cap:
        out.append(f"max_concurrency {truth_cap}, not {hint_cap}")
    hint_caps = {c.name: c for c in hint.capabilities}
    truth_caps = {c.name: c for c in truth.capabilities}
    if hint.capabilities and hint_caps != truth_caps:
        shown = ", ".join(f"{c.name}@{c.version} x{c.max_concurrency} {c.cost_class}" for c in truth.capabilities[:8])
        out.append(f"capabilities [{shown}]")
    # An ended agent's reading has none (it resyncs no more): nothing to compare.
    if hint.resync_interval_s is not None and truth.resync_interval_s is not None and hint.resync_interval_s != truth.resync_interval_s:
        out.append(f"resync_interval_s {truth.resync_interval_s}, not {hint.resync_interval_s}")
    return "; ".join(out)[:600]


_DIGEST_FIELDS = tuple(CapabilityDigest.model_fields)
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _digest_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """A carried capability row's identity, to build one CapabilityDigest per distinct row."""
    values = tuple(row.values())
    if all(type(v) in _SCALARS for v in values):
        return (tuple(row), values)
    return ("~", tuple(sorted((k, repr(v)) for k, v in row.items())))  # an odd row (a list for a value)


def _digest_row(cap: CapabilityDigest, dumped: dict[tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
    """`cap.model_dump()`, once per distinct capability (the rows are only read, by the JSON encoder)."""
    key = tuple(getattr(cap, k) for k in _DIGEST_FIELDS)
    row = dumped.get(key)
    if row is None:
        row = dumped[key] = cap.model_dump()
    return row


def to_datetime(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


class PoolCoreState(BaseModel):
    """What continue-as-new carries: compact, no schemas."""

    pool: str
    agents: list[dict[str, Any]] = Field(default_factory=list)
    leases: list[dict[str, Any]] = Field(default_factory=list)
    waiters: list[dict[str, Any]] = Field(default_factory=list)
    granted_tickets: dict[str, str] = Field(default_factory=dict)
    counters: dict[str, int] = Field(default_factory=dict)
    drift: dict[str, list[str]] = Field(default_factory=dict)
    scale: dict[str, list[float]] = Field(default_factory=dict)
    catalog: dict[str, dict[str, list[str]]] = Field(default_factory=dict)
    sent_load: dict[str, list[int]] = Field(default_factory=dict)
    notice_seq: int = 0
    pending_notices: list[list[Any]] = Field(default_factory=list)
    pending_revocations: list[list[Any]] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    scale_window_s: float = 5.0
    epoch: str = ""
    last_seen: dict[str, list[float]] = Field(default_factory=dict)
    unverified: list[dict[str, Any]] = Field(default_factory=list)
    autoscaler: dict[str, dict[str, Any]] = Field(default_factory=dict)
    uses: dict[str, int] = Field(default_factory=dict)
    retiring: dict[str, str] = Field(default_factory=dict)
    pending_scale_downs: list[dict[str, Any]] = Field(default_factory=list)
    health: dict[str, Any] = Field(default_factory=dict)
    next_health_round: float | None = None
    shutdown: dict[str, Any] | None = None
    capability_counters: dict[str, dict[str, int]] = Field(default_factory=dict)
    eviction: dict[str, Any] = Field(default_factory=dict)
    recently_ended: list[dict[str, Any]] = Field(default_factory=list)
    drain_reasons: dict[str, str] = Field(default_factory=dict)
    index_notices: dict[str, int] = Field(default_factory=dict)
    dropped_reports: dict[str, dict[str, Any]] = Field(default_factory=dict)
    relearning: bool = False
    outliers: dict[str, list[Any]] = Field(default_factory=dict)


class PoolCore:
    """The pool's state and rules. Every method is deterministic given `now`."""

    def __init__(self, pool: str, *, scale_window_s: float = 5.0, epoch: str = "") -> None:
        self.pool = pool
        self.epoch = epoch  # stamped on load notices: agents restart their seq for a new pool
        # An agent workflow re-sends its snapshot every resync interval; a pool that
        # hears nothing for 3 of them drops the agent (its final message was lost).
        self._last_seen: dict[str, tuple[float, float]] = {}  # agent -> (seen at, stale after s)
        self._stale_heap: list[tuple[float, str]] = []
        self.index = CapabilityIndex()
        self.leases = LeaseBook()
        self.waiters = WaitQueue()
        self.granted_tickets: dict[str, str] = {}  # ticket -> lease id, until the lease ends
        self._requests: dict[str, str] = {}  # request id -> lease id or ticket
        self.drift = DriftDetector()
        self.scaler = ScaleCoalescer(window_s=scale_window_s)
        # capability name -> version -> deployments ever seen serving it
        self.catalog: dict[str, dict[str, set[str]]] = {}
        self.counters: dict[str, int] = {
            "granted": 0,
            "released": 0,
            "expired": 0,
            "revoked": 0,
            "exhausted": 0,
            "queued": 0,
            "renewed": 0,
            "lost": 0,
            "drained": 0,
        }
        # The same counts per capability name, for names agents offered (the catalog, which
        # never shrinks, so the set is bounded and each count only grows): what metrics read.
        self.capability_counters: dict[str, dict[str, int]] = {}
        self.warnings: deque[str] = deque(maxlen=RECENT_WARNINGS_KEPT)
        # agents that left (oldest first) and why agents now draining were drained: for `status`
        self.recently_ended: deque[dict[str, Any]] = deque(maxlen=RECENTLY_ENDED_KEPT)
        self._drain_reasons: dict[str, str] = {}
        # effects for the workflow to carry out
        self._notices: dict[str, tuple[str, LoadNotice]] = {}
        self._revocations: list[tuple[str, LeaseRevoked]] = []
        self._new_warnings: list[str] = []
        self._sent_load: dict[str, tuple[int, int]] = {}  # agent -> (saturated, in_flight) last told
        self._notice_seq = 0
        # First snapshots of agents not yet checked (agent id -> latest snapshot). Off:
        # a new agent's snapshot is indexed as sent (callers feeding the core directly).
        self.verify_new_agents = True
        self._unverified: dict[str, AgentSnapshot] = {}
        self._verifications: list[str] = []
        # Snapshots as hints (see `agent_snapshot`): set by the workflow. Off by default
        # here, so that callers feeding snapshots straight in (tests, benchmarks) see them
        # applied at once.
        self.verify_known_agents = False
        self._rechecks: set[str] = set()  # agents with a hint newer than the read in flight
        # Tell an agent workflow when a registration it waits on is indexed (`take_index_notices`):
        # only a snapshot that says one waits (`awaits_index`) asks for a notice.
        self._index_notices: dict[str, int] = {}  # agent -> registration number, not yet handed out
        self._index_notices_out: dict[str, int] = {}  # handed out, not yet confirmed delivered
        self._refusals: list[str] = []  # hints not applied as sent, for the workflow's `refusals`
        # Sizing policies (deployments without one keep the demand-driven scaler above).
        self.autoscaler = Autoscaler()
        self._uses: dict[str, int] = {}  # agent -> leases granted on it
        # agent -> why the pool stopped routing to it: "worn" (reached max_uses, its
        # replacement on the way), "recycled" or "scale-down" (being retired)
        self._retiring: dict[str, str] = {}
        self._scale_downs: list[ScaleDown] = []
        self._autoscale_dirty = False
        self._last_autoscale = float("-inf")
        self.health = HealthTracker()
        self._next_health_round: float = float("-inf")  # the next round of checks of idle agents (every deployment)
        self.outliers = OutlierTracker()  # what task outcomes say of each agent (see `core.outliers`)
        self._serve_soon: set[str] = set()
        self._dropped_reports: dict[str, PoolReport] = {}  # ticket -> figures when its waiter was dropped (recent ones)
        self._unknown_tickets: set[str] = set()  # of those, waiters for a name the relearnt fleet does not offer
        # A run that starts without state relearns its fleet (`begin_relearn`): until the
        # agent workflows found running are read, an unknown capability waits, not fails.
        self._asked_scale_ups: list[ScaleRequest] = []  # `scale_up` and on_demand breakers, not yet carried out
        self.relearning = False
        self._relearn_listed = False
        self._relearn_reads: set[str] = set()
        # Set by the `shutdown` update; see `core.shutdown`.
        self.shutdown: ShutdownPlan | None = None
        # Silent agents ask before they are terminated (`may_evict`): self-preservation and a cap.
        self.eviction = EvictionGuard()
        # Sharded pools (`core.shards`): this core is shard `shard` of `layout`; the
        # ids it makes carry the shard, and it holds only the agents whose home it is.
        self.shard = 0
        self.layout = ShardLayout()

    def set_shard(self, shard: int, layout: ShardLayout) -> None:
        if not 0 <= shard < layout.shards:
            raise ValueError(f"shard {shard} is not one of the {layout.shards} shard(s)")
        self.shard, self.layout = shard, layout

    def home_of(self, agent_id: str, deployment: str) -> int:
        return self.layout.home_shard(agent_id, deployment)

    # ------------------------------------------------------------------ agents
    def agent_snapshot(self, snap: AgentSnapshot, now: float, new_id: Callable[[], str]) -> None:
        """Apply what an agent workflow says about itself.

        Anyone can signal the pool, so an agent the pool does not know yet is held
        back until the workflow queues a check that its agent workflow runs
        (`take_verifications`, answered by `agent_verified`): a forged snapshot
        never becomes routable.

        With `verify_known_agents` (the workflow's `snapshot-as-hint` patch) every
        snapshot is a hint: one that only confirms what the pool has for an indexed
        agent (a resync) is applied at once; any other, and every snapshot of an
        agent not indexed yet, waits for a read of the agent workflow's own
        snapshot (`take_verifications`, answered by `agent_read`), and the pool
        applies what the agent workflow reports, not what the signal said.
        """
        if self.verify_known_agents:
            self._hint(snap, now, new_id)
            return
        if snap.state == AgentState.TERMINATED:
            self._unverified.pop(snap.agent_id, None)
            self.agent_gone(snap.agent_id, snap.reason or "terminated", now, new_id)
            return
        if snap.agent_id not in self.index and self._belongs_elsewhere(snap.agent_id, snap.deployment):
            return
        if self.shutdown is not None and snap.agent_id not in self.index:
            self.shutdown.heard_of(snap.agent_id, snap.deployment, now)  # never indexed now: drained
            return
        if self.verify_new_agents and snap.agent_id not in self.index:
            if snap.agent_id not in self._unverified:
                self._verifications.append(snap.agent_id)
            self._unverified[snap.agent_id] = snap  # the latest word wins once verified
            return
        self._apply_snapshot(snap, now, new_id)

    def _belongs_elsewhere(self, agent_id: str, deployment: str) -> bool:
        """Whether a sharded pool's layout homes this agent in another shard (then warned and refused).

        Never index an agent another shard holds: its cap would be handed out twice."""
        if not self.layout.sharded:
            return False
        home = self.home_of(agent_id, deployment)
        if home == self.shard:
            return False
        warning = (
            f"snapshot for agent {agent_id} refused: in pool {self.pool}'s layout of {self.layout.shards} "
            f"shard(s) by {self.layout.by} it belongs to shard {home}, not {self.shard} "
            "(the sender's AGENTROSTER_POOL_SHARDS differs from the pool's)"
        )
        self.warnings.append(warning)
        self._new_warnings.append(warning)
        return True

    def agent_verified(self, agent_id: str, running: bool, now: float, new_id: Callable[[], str]) -> None:
        """The check of an agent the pool first heard of: index its snapshot if its workflow runs."""
        if self.verify_known_agents:  # (tests) a running workflow says what the hint said
            hint = self._unverified.get(agent_id)
            self.agent_read(agent_id, hint if running else None, "" if running else "not running", now, new_id)
            return
        snap = self._unverified.pop(agent_id, None)
        if snap is None:
            return  # terminated meanwhile
        if not running:
            warning = f"snapshot for agent {agent_id} refused: no running agent workflow sent it"
            self.warnings.append(warning)
            self._new_warnings.append(warning)
            return
        self._apply_snapshot(snap, now, new_id)

    # -------------------------------------------------- snapshots as hints
    def _hint(self, snap: AgentSnapshot, now: float, new_id: Callable[[], str]) -> None:
        """A snapshot signal under `verify_known_agents`: applied at once only when it changes nothing that grants or revokes."""
        agent_id = snap.agent_id
        known = self.index.get(agent_id)
        if known is not None and self._confirms(snap, known):
            self._apply_snapshot(snap, now, new_id)  # the resync path: no activity
            self._index_notice(agent_id, snap.awaits_index)  # a re-registration that changed nothing
            return
        if known is not None and _state_kind(snap.state) != "serving":
            # It says it stops serving: no new lease on it until its workflow is read (its
            # leases stay; a forged word costs the agent one read's time, never a lease).
            self.index.set_held(agent_id, True)
        if agent_id in self._unverified or agent_id in self._relearn_reads:  # a read is on its way: it may predate this hint
            self._unverified[agent_id] = snap
            self._rechecks.add(agent_id)
            return
        if known is None:
            if snap.state == AgentState.TERMINATED:
                self.agent_gone(agent_id, snap.reason or "terminated", now, new_id)  # never indexed: nothing to revoke
                return
            if self._belongs_elsewhere(agent_id, snap.deployment):
                return  # not worth a read: this shard would never index it
            if self.shutdown is not None:
                self.shutdown.heard_of(agent_id, snap.deployment, now)  # never indexed now: drained
                return
        self._unverified[agent_id] = snap
        self._verifications.append(agent_id)

    def _confirms(self, snap: AgentSnapshot, agent: IndexedAgent) -> bool:
        """Whether applying `snap` to this indexed agent would change nothing that grants or revokes.

        Routing facts equal (deployment, endpoint, capabilities, agent-wide cap, the
        resync interval that decides when a silent agent is dropped), the same
        serving class of state (Registering, Ready and Busy route alike; an agent the
        pool retires stays Draining whatever it says), and not silent (a word from
        its workflow would make it routable again).
        """
        agent_id = agent.agent_id
        if agent.silent or agent.held or self.eviction.concerns(agent_id):
            return False
        if snap.deployment != agent.deployment or snap.endpoint != agent.endpoint:
            return False
        if not snap.capabilities or {c.name: c for c in snap.capabilities} != agent.capabilities:
            return False
        if effective_total_concurrency(snap.max_concurrency, snap.capabilities) != agent.max_concurrency:
            return False
        if snap.resync_interval_s is not None:
            seen = self._last_seen.get(agent_id)
            if seen is None or seen[1] != STALE_RESYNCS * snap.resync_interval_s:
                return False
        kind = _state_kind(snap.state)
        if kind == "serving":
            return agent.state in ROUTABLE_STATES or (agent.state == AgentState.DRAINING and agent_id in self._retiring)
        return kind == "draining" and agent.state == AgentState.DRAINING

    def agent_read(
        self, agent_id: str, reading: AgentSnapshot | None, detail: str, now: float, new_id: Callable[[], str]
    ) -> None:
        """The agent workflow's own snapshot, read for a hint: the pool applies this, whatever the hint said.

        `reading` None: no agent workflow speaks for the agent (none ran, it ended
        without a word, or a new run has not registered): never indexed, and an
        indexed agent leaves the pool.
        """
        hint = self._unverified.pop(agent_id, None)
        again = agent_id in self._rechecks
        self._rechecks.discard(agent_id)
        if agent_id in self._relearn_reads:
            self._relearn_reads.discard(agent_id)
            if hint is None:
                if reading is None:
                    return  # ended since the listing: nothing to learn
                hint = reading  # found by the listing, not sent: its workflow's word is the only one
        if hint is None:
            return  # dropped meanwhile (a shutdown began)
        self.index.set_held(agent_id, False)
        if reading is not None and reading.agent_id != agent_id:
            reading, detail = None, f"its workflow speaks for {reading.agent_id!r}"
        known = self.index.get(agent_id)
        if reading is None:
            if known is None:
                self._warn(f"snapshot for agent {agent_id} refused: no running agent workflow sent it")
                self._refusals.append(f"agent {agent_id} not indexed: no agent workflow speaks for it ({detail or 'none found'})")
            else:
                if hint.state != AgentState.TERMINATED:
                    self._refusals.append(
                        f"agent {agent_id} not updated as sent: no agent workflow speaks for it ({detail or 'none found'}); "
                        "removed from the pool"
                    )
                self.agent_gone(agent_id, "its workflow is gone", now, new_id)
            return
        differences = _differences(hint, reading)
        if differences and not again:
            self._refusals.append(
                f"agent {agent_id} not updated as sent: its workflow reports {differences} "
                "(forged, or changed again before it was read); applied the workflow's own snapshot"
            )
        if reading.state == AgentState.TERMINATED:
            self.agent_gone(agent_id, reading.reason or "terminated", now, new_id)
            return
        if known is None and self.shutdown is not None:
            self.shutdown.heard_of(agent_id, reading.deployment, now)
            return
        if known is None and self._belongs_elsewhere(agent_id, reading.deployment):
            return  # the hint named another deployment than its workflow reports
        self._apply_snapshot(reading, now, new_id)
        self._index_notice(agent_id, reading.awaits_index)
        agent = self.index.get(agent_id)
        if again and differences and (agent is None or not self._confirms(hint, agent)):
            # The latest hint came after the read was asked for: read once more (at most one read per
            # hint, so a flood of forged ones cannot loop); that read's answer judges the hint.
            self._unverified[agent_id] = hint
            self._verifications.append(agent_id)
            if _state_kind(hint.state) != "serving":
                self.index.set_held(agent_id, True)

    def agent_read_late(self, agent_id: str, reading: AgentSnapshot | None, now: float, new_id: Callable[[], str]) -> None:
        """A reading no read of this run waits for: a previous run's read (activities outlive the
        run that started them, and their reports reach the next), or one this run gave up on.

        It is the agent workflow's word, but maybe an old one: while a read of this run is out
        (asked later, so at least as new) it is ignored, and so is a late failure or a late "no
        agent workflow". Otherwise it is taken as a hint: applied at once when it changes
        nothing that grants or revokes, else the agent is read again (one read per late reading)."""
        if reading is None or reading.agent_id != agent_id:
            return
        if agent_id in self._unverified or agent_id in self._relearn_reads:
            return
        self._hint(reading, now, new_id)

    def agent_read_failed(self, agent_id: str, detail: str) -> None:
        """The read could not be done (its retries ran out): the hint is not applied; the pool keeps what it has."""
        hint = self._unverified.pop(agent_id, None)
        self._rechecks.discard(agent_id)
        self._relearn_reads.discard(agent_id)
        if hint is None:
            return
        self.index.set_held(agent_id, False)
        if agent_id not in self.index:
            self._warn(f"snapshot for agent {agent_id} refused: its agent workflow could not be read")
        self._refusals.append(f"agent {agent_id} not updated: its agent workflow could not be read ({detail[:300]})")

    def _index_notice(self, agent_id: str, registration: int | None) -> None:
        """Queue the notice that tells an agent workflow its registration is indexed (only when one waits)."""
        if registration is None or agent_id not in self.index:
            return
        self._index_notices[agent_id] = max(registration, self._index_notices.get(agent_id, 0))

    def take_index_notices(self) -> list[IndexNotice]:
        """Notices to deliver now (agent id order); they stay owed until `index_notices_delivered`."""
        out = [
            IndexNotice(agent_id=agent_id, registration=n, epoch=self.epoch)
            for agent_id, n in sorted(self._index_notices.items())
        ]
        self._index_notices_out.update(self._index_notices)
        self._index_notices.clear()
        return out

    def index_notices_delivered(self, notices: Iterable[IndexNotice]) -> None:
        """The delivery of these notices is over (delivered, or given up): no longer owed."""
        for notice in notices:
            if self._index_notices_out.get(notice.agent_id) == notice.registration:
                del self._index_notices_out[notice.agent_id]

    def take_refusals(self) -> list[str]:
        """Snapshot hints the pool did not apply as sent (for the workflow's `refusals`)."""
        out, self._refusals = self._refusals, []
        return out

    def take_verifications(self) -> list[str]:
        """Agents to check (their workflow runs?) before their first snapshot is indexed."""
        out, self._verifications = self._verifications, []
        return out

    def is_indexed(self, agent_id: str) -> bool:
        return agent_id in self.index

    def is_being_read(self, agent_id: str) -> bool:
        """Whether a snapshot for this agent waits for the read of its workflow (`agent_read`)."""
        return agent_id in self._unverified or agent_id in self._relearn_reads

    def _apply_snapshot(self, snap: AgentSnapshot, now: float, new_id: Callable[[], str]) -> None:
        self._heard_from(snap.agent_id, now)
        if snap.resync_interval_s:
            stale_after = STALE_RESYNCS * snap.resync_interval_s
            self._last_seen[snap.agent_id] = (now, stale_after)
            heapq.heappush(self._stale_heap, (now + stale_after, snap.agent_id))
        known = self.index.get(snap.agent_id)
        if snap.state in (AgentState.SPAWNING, AgentState.REGISTERING) and known is None and not snap.capabilities:
            return
        if snap.capabilities:
            first_time = known is None
            agent = self.index.upsert(
                snap.agent_id, snap.deployment, snap.endpoint, snap.state, snap.capabilities, snap.max_concurrency
            )
            for cap in snap.capabilities:
                self.catalog.setdefault(cap.name, {}).setdefault(cap.version, set()).add(snap.deployment)
            if first_time:
                self.scaler.registered(snap.deployment)
                self.autoscaler.registered(snap.deployment, now)
            names = {c.name for c in snap.capabilities}
            if known:
                names |= set(known.capabilities)
            self._check_drift(names)
            if not first_time:
                self._revoke_orphans(agent, "capability withdrawn by re-registration", new_id)
        elif known is not None:
            self.index.set_state(snap.agent_id, snap.state)
            agent = known
            self._check_drift(set(agent.capabilities))
        else:
            return
        if snap.state == AgentState.DRAINING and snap.reason:
            self._drain_reasons[snap.agent_id] = snap.reason[:256]
        if agent.state == AgentState.REGISTERING:
            # Registering in the pool's eyes means the snapshot is what makes it Ready.
            self.index.set_state(agent.agent_id, AgentState.READY)
        if agent.agent_id in self._retiring and agent.routable and not self._routed_anyway(agent):
            self.index.set_state(agent.agent_id, AgentState.DRAINING)  # its own word predates the pool's decision
        self._autoscale_dirty = True
        self._queue_notice(agent, force=agent.state == AgentState.DRAINING)
        self._serve_waiters(now, new_id, names=agent.capabilities)

    def agent_gone(self, agent_id: str, reason: str, now: float, new_id: Callable[[], str]) -> list[LeaseRecord]:
        """Remove a terminated agent everywhere and revoke its leases."""
        agent = self.index.remove(agent_id)
        self._index_notices.pop(agent_id, None)
        if self.shutdown is not None:
            self.shutdown.ended(agent_id)
        if not self.eviction.idle:
            self.eviction.forget(agent_id, now, len(self.index))
            self._eviction_warnings()
        drain_reason = self._drain_reasons.pop(agent_id, None) or self._retiring.get(agent_id)
        if agent is not None:  # an agent the pool never indexed (or already removed) leaves no row
            caps = [f"{c.name}@{c.version}" for c in agent.capabilities.values()]
            self.recently_ended.append(
                {
                    "agent_id": agent_id,
                    "deployment": agent.deployment,
                    "capabilities": caps[:ENDED_CAPABILITIES_SHOWN],
                    "reason": reason[:256],
                    "drain_reason": drain_reason,
                    "at": now,
                }
            )
        self._last_seen.pop(agent_id, None)
        self._uses.pop(agent_id, None)
        self._retiring.pop(agent_id, None)
        self.autoscaler.forget_agent(agent_id)
        self.health.forget(agent_id)
        self.outliers.forget(agent_id)
        self._autoscale_dirty = True
        self._notices.pop(agent_id, None)
        self._sent_load.pop(agent_id, None)
        revoked = self.leases.revoke_agent(agent_id)
        for record in revoked:
            self._end_lease(record, "revoked", f"agent {agent_id} terminated: {reason}")
        if agent:
            self._check_drift(set(agent.capabilities))
            # An agent workflow that drained ends with the reason "drain"; every other end
            # (heartbeat lost, its workflow gone, no word from it) lost the agent.
            self.counters["drained" if reason == "drain" else "lost"] += 1
        return revoked

    def _count(self, key: str, name: str) -> None:
        """Count one event for the pool and, when agents ever offered it, for capability `name`."""
        self.counters[key] += 1
        if name in self.catalog:
            per_name = self.capability_counters.setdefault(name, {})
            per_name[key] = per_name.get(key, 0) + 1

    def _revoke_orphans(self, agent: IndexedAgent, reason: str, new_id: Callable[[], str]) -> None:
        for record in self.leases.of_agent(agent.agent_id):
            if record.capability not in agent.capabilities:
                self.leases.release(record.lease_id)
                self._end_lease(record, "revoked", reason)

    def _check_drift(self, names: set[str]) -> None:
        for name in sorted(names):
            warning = self.drift.observe(name, self.index.versions_served(name))
            if warning:
                self.warnings.append(warning)
                self._new_warnings.append(warning)

    # ------------------------------------------------------------------ leases
    def acquire(self, request: AcquireRequest, now: float, new_id: Callable[[], str]) -> AcquireReply:
        """Grant a lease at once, or queue the caller (FIFO) and hand back a ticket."""
        if request.request_id and request.request_id in self._requests:
            return self._replay_request(request.request_id)
        if request.recover_only:
            # Nothing to give back: the request never reached the pool, or its lease or place has ended.
            return AcquireReply()
        ref = CapabilityRef.parse(request.ref)
        if request.prefetch:
            return self._prefetch(ref, request, now, new_id)
        if self.shutdown is not None:  # refused by the update's validator first; never granted
            self.counters["exhausted"] += 1
            return AcquireReply(report=self.report(ref))
        if self.health.open_mode(ref.name) == "fail_fast":
            self._count("exhausted", ref.name)
            return AcquireReply(report=self.report(ref), circuit_open=self._breaker_reason(ref.name))
        if not self.ever_offered(ref.name) and not self.relearning:
            # Waiting cannot help: nobody serves this name, nor ever did here.
            self._count("exhausted", ref.name)
            return AcquireReply(report=self.report(ref), unknown_capability=True)
        exclude = frozenset(request.exclude_agents)
        picked = self.index.pick(ref, exclude, request.max_cost_class)
        queued_ahead = self.waiters.waits_on(ref.name)
        if picked is not None and not queued_ahead:
            record = self._grant(picked[0], ref.name, request.lease_ttl_s, request.holder, request.holder_is_workflow, now, new_id, request_id=request.request_id)
            return AcquireReply(lease=self.lease_of(record))
        # Nothing free, or earlier callers for this capability are queued: take a
        # place at the back of the line, then let the line move.
        ticket = tag_id(self.shard, _ticket(request.request_id) if request.request_id else new_id())
        self.waiters.push(Waiter(
            ticket=ticket,
            ref=str(ref),
            enqueued_at=now,
            expires_at=now + request.wait_s + WAITER_GRACE_S,
            lease_ttl_s=request.lease_ttl_s,
            holder=request.holder,
            holder_is_workflow=request.holder_is_workflow,
            exclude=tuple(sorted(exclude)),
            request_id=request.request_id,
            max_cost=request.max_cost_class,
        ))
        if request.request_id:
            self._requests[request.request_id] = ticket
        self._autoscale_dirty = True
        if picked is not None:
            # Something is free for this caller: let the line (it included) move.
            self._serve_waiters(now, new_id, names=(ref.name,))
            granted = self.ticket_status(ticket)
            if granted.lease is not None:
                return AcquireReply(lease=granted.lease)
        self._record_miss(ref, now)
        if request.wait_s <= 0:
            return AcquireReply(report=self.cancel_ticket(ticket, now).report)
        self._count("queued", ref.name)
        return AcquireReply(ticket=ticket)

    def _prefetch(self, ref: CapabilityRef, request: AcquireRequest, now: float, new_id: Callable[[], str]) -> AcquireReply:
        """A lease for a task a worker expects next: only a slot free now that nobody waits for.

        Speculative, so it takes nothing from anyone: no place in the queue, no scale
        demand, no `exhausted` count, nothing while the capability's breaker is not
        closed (a probe is a real task's) or the pool shuts down. Granted, it is a lease
        like any other (counted, used up, revoked with its agent).
        """
        breaker = self.health.breakers.get(ref.name)
        if self.shutdown is not None or (breaker is not None and breaker.state != CLOSED) or self.waiters.waits_on(ref.name):
            return AcquireReply()
        picked = self.index.pick(ref, frozenset(request.exclude_agents), request.max_cost_class)
        if picked is None:
            return AcquireReply()
        record = self._grant(picked[0], ref.name, request.lease_ttl_s, request.holder, False, now, new_id, request_id=request.request_id)
        return AcquireReply(lease=self.lease_of(record))

    def _replay_request(self, request_id: str) -> AcquireReply:
        target = self._requests[request_id]
        if target in self.waiters:
            return AcquireReply(ticket=target)
        lease_id = self.granted_tickets.get(target, target)
        record = self.leases.get(lease_id)
        if record is not None:
            return AcquireReply(lease=self.lease_of(record))
        return AcquireReply(ticket=target)

    def ever_offered(self, name: str) -> bool:
        """Whether an agent in this pool offers `name` now or ever did (its deployment may be scaled to zero)."""
        return (
            name in self.catalog
            or self.index.offers(name)
            or any(c.name == name for snap in self._unverified.values() for c in snap.capabilities)
        )

    def _grant(
        self,
        agent: IndexedAgent,
        capability: str,
        ttl_s: float,
        holder: str | None,
        holder_is_workflow: bool,
        now: float,
        new_id: Callable[[], str],
        ticket: str | None = None,
        request_id: str | None = None,
    ) -> LeaseRecord:
        cap = agent.capabilities[capability]
        record = self.leases.grant(
            LeaseRecord(
                lease_id=tag_id(self.shard, _lease_id(new_id(), request_id)),
                agent_id=agent.agent_id,
                deployment=agent.deployment,
                capability=capability,
                version=cap.version,
                endpoint=agent.endpoint,
                granted_at=now,
                deadline=now + ttl_s,
                holder=holder,
                holder_is_workflow=holder_is_workflow,
                ticket=ticket,
                request_id=request_id,
            )
        )
        if request_id:
            self._requests[request_id] = record.lease_id
        self.index.add_load(agent.agent_id, capability, +1)
        if self.outliers.probe_granted(agent.agent_id, record.lease_id):
            self.index.set_ejected(agent.agent_id, True)  # one trial task at a time
        self._count("granted", capability)
        uses = self._uses[agent.agent_id] = self._uses.get(agent.agent_id, 0) + 1
        policy = self.autoscaler.policies.get(agent.deployment)
        if policy is not None and policy.max_uses is not None and uses >= policy.max_uses:  # max_uses comes only with max_replicas
            self._retire(agent.agent_id, "worn")
        self._autoscale_dirty = True
        self._queue_notice(agent)
        return record

    def release(self, lease_id: str, now: float, new_id: Callable[[], str], outcome: str | None = None) -> bool:
        """Return a lease's slot, learning from its task's `outcome` when it has one (see
        `_task_outcome`). Idempotent: an unknown or ended lease is a no-op (False)."""
        record = self.leases.release(lease_id)
        if record is None:
            return False
        self._task_outcome(record, outcome, now)  # (first: a trial task's lease is judged, not just ended)
        self._end_lease(record, "released", "")
        self._serve_waiters(now, new_id, names=self._freed_names([record]))
        return True

    def _freed_names(self, records: Iterable[LeaseRecord]) -> set[str]:
        """Capabilities that may have a slot again: every capability of the agents whose
        leases ended (the agent-wide cap frees them all), not just the leased one."""
        names: set[str] = set()
        for record in records:
            agent = self.index.get(record.agent_id)
            names.update(agent.capabilities if agent is not None else (record.capability,))
        return names

    def renew(self, request: RenewRequest, now: float) -> Lease | None:
        """Move an active lease's deadline to now + ttl; None when it has ended (the holder lost it)."""
        record = self.leases.renew(request.lease_id, now + request.ttl_s)
        if record is None:
            return None
        if request.adopt_by and not record.holder_is_workflow:
            # A prefetched lease now serves a task workflow: revocation notices go to it, and
            # its recovery finds the lease by the task's own request id.
            record.holder, record.holder_is_workflow = request.adopt_by, True
            if request.adopt_request_id and request.adopt_request_id not in self._requests:
                if record.request_id:
                    self._requests.pop(record.request_id, None)
                record.request_id = request.adopt_request_id
                self._requests[request.adopt_request_id] = record.lease_id
        self._count("renewed", record.capability)
        return self.lease_of(record)

    def _end_lease(self, record: LeaseRecord, outcome: str, reason: str) -> None:
        self._count(outcome, record.capability)
        self._autoscale_dirty = True
        if record.ticket:
            self.granted_tickets.pop(record.ticket, None)
        if record.request_id:
            self._requests.pop(record.request_id, None)
        if self.outliers.probe_ended(record.agent_id, record.lease_id):
            self.index.set_ejected(record.agent_id, False)  # a trial that told nothing: another one
        agent = self.index.get(record.agent_id)
        if agent is not None:
            self.index.add_load(record.agent_id, record.capability, -1)
            self._queue_notice(agent)
        if outcome in ("revoked", "expired") and record.holder and record.holder_is_workflow:
            self._revocations.append(
                (record.holder, LeaseRevoked(lease_id=record.lease_id, agent_id=record.agent_id, reason=reason or outcome))
            )

    def ticket_status(self, ticket: str) -> TicketStatus:
        """Where a queued caller stands: still waiting, granted (with the lease), or gone."""
        if ticket in self.waiters:
            return TicketStatus(ticket=ticket, pending=True)
        lease_id = self.granted_tickets.get(ticket)
        record = self.leases.get(lease_id) if lease_id else None
        if record is not None:
            return TicketStatus(ticket=ticket, pending=False, lease=self.lease_of(record))
        return TicketStatus(
            ticket=ticket,
            pending=False,
            report=self._dropped_reports.get(ticket),
            shutdown=self.shutdown.reason if self.shutdown else None,
            unknown_capability=ticket in self._unknown_tickets,
        )

    def cancel_ticket(self, ticket: str, now: float) -> TicketStatus:
        """The caller gave up. A lease granted in the meantime is handed over, not lost."""
        waiter = self.waiters.remove(ticket)
        if waiter is not None:
            if waiter.request_id:
                self._requests.pop(waiter.request_id, None)
            self._count("exhausted", waiter.name)
            return TicketStatus(ticket=ticket, pending=False, report=self._remember_report(ticket, waiter))
        return self.ticket_status(ticket)

    def _serve_waiters(self, now: float, new_id: Callable[[], str], names: Iterable[str] | None = None) -> None:
        """Hand free slots to waiters, oldest first, for `names` (default: every name waited on)."""
        for name in sorted(self.waiters.names() if names is None else set(names)):
            blocked: set[tuple[str, tuple[str, ...], str | None]] = set()
            for ticket in self.waiters.line(name):
                if not self.index.has_free_slot_for(name):
                    break  # nothing left to hand out for this name: the rest keep their place
                waiter = self.waiters.get(ticket)
                if waiter is None:
                    continue
                if waiter.expires_at <= now:
                    self._drop_waiter(ticket)
                    continue
                key = (waiter.ref, waiter.exclude, waiter.max_cost)
                if key in blocked:
                    continue
                ref = CapabilityRef.parse(waiter.ref)
                picked = self.index.pick(ref, frozenset(waiter.exclude), waiter.max_cost)
                if picked is None:
                    blocked.add(key)
                    continue
                self.waiters.remove(ticket)
                record = self._grant(picked[0], ref.name, waiter.lease_ttl_s, waiter.holder, waiter.holder_is_workflow, now, new_id, ticket=ticket, request_id=waiter.request_id)
                self.granted_tickets[ticket] = record.lease_id

    def _drop_waiter(self, ticket: str) -> None:
        waiter = self.waiters.remove(ticket)
        if waiter is not None:
            self._count("exhausted", waiter.name)
            if waiter.request_id:
                self._requests.pop(waiter.request_id, None)
            self._remember_report(ticket, waiter)

    def _remember_report(self, ticket: str, waiter: Waiter) -> PoolReport:
        """The pool's figures for a waiter it no longer holds, kept for its ticket: its caller may
        cancel (or ask) after the pool gave up on it, or cancel again when the answer to its
        first cancel was lost (the client's retry is a new update), and still gets them, not
        an empty report (PoolExhaustedError names them)."""
        report = self.report(CapabilityRef.parse(waiter.ref), frozenset(waiter.exclude), waiter.max_cost)
        report.waiting = len(self.waiters)
        self._dropped_reports[ticket] = report
        while len(self._dropped_reports) > DROPPED_REPORTS_KEPT:
            self._unknown_tickets.discard(next(iter(self._dropped_reports)))
            self._dropped_reports.pop(next(iter(self._dropped_reports)))
        return report

    def tick(self, now: float, new_id: Callable[[], str]) -> list[LeaseRecord]:
        """Expire leases and abandoned waiters due by `now`."""
        expired = self.leases.expire(now)
        for record in expired:
            self._end_lease(record, "expired", f"lease deadline passed at {to_datetime(record.deadline).isoformat()}")
        while self._stale_heap and self._stale_heap[0][0] <= now:
            _, agent_id = heapq.heappop(self._stale_heap)
            seen = self._last_seen.get(agent_id)
            agent = self.index.get(agent_id)
            if seen is None or agent is None or seen[0] + seen[1] > now or agent.state == AgentState.DRAINING:
                continue  # heard from since, already gone, or draining (its workflow ends it)
            self.agent_gone(agent_id, f"no word from its workflow for {seen[1]:g}s", now, new_id)
            self.warnings.append(f"agent {agent_id} dropped: no snapshot from its workflow for {seen[1]:g}s")
        for ticket in self.waiters.expired(now):
            self._drop_waiter(ticket)  # no-op when it was served or cancelled meanwhile
        self._end_ejections(now)
        if self._serve_soon:
            names, self._serve_soon = self._serve_soon, set()
            self._serve_waiters(now, new_id, names=names)
        if expired:
            self._serve_waiters(now, new_id, names=self._freed_names(expired))
        if self.shutdown is not None:
            self._shutdown_tick(now)
        return expired

    def next_wakeup(self) -> float | None:
        """The earliest moment the pool must act without a message."""
        if self.shutdown is not None:
            return self._shutdown_wakeup()
        moments = [self.leases.next_deadline(), self.scaler.next_due(), self.outliers.next_end()]
        if self.autoscaler.sizing:
            moments.append(self.autoscaler.next_due())
            if self._autoscale_dirty:
                moments.append(self._last_autoscale + AUTOSCALE_EVERY_S)
        if len(self.index):  # every deployment's agents are checked and guarded, policy or none
            moments.append(self._next_health_round)
            moments.append(self.health.next_breaker_due(self._breaker_cooldowns()))
        while self._stale_heap and self._stale_heap[0][1] not in self._last_seen:
            heapq.heappop(self._stale_heap)
        if self._stale_heap:
            moments.append(self._stale_heap[0][0])
        moments.append(self.waiters.next_expiry())
        present = [m for m in moments if m is not None]
        return min(present) if present else None

    # --------------------------------------------------------------- scaling
    def _record_miss(self, ref: CapabilityRef, now: float) -> None:
        """Scale demand goes to deployments that serve a version in the ref's range."""
        deployments = self.index.deployments_serving(ref)
        if not deployments:  # none registered now: those that served a matching version before
            versions = self.catalog.get(ref.name, {})
            deployments = {d for v, ds in versions.items() if self.index.version_matches(ref, v) for d in ds}
        for deployment in sorted(deployments):
            if not self.autoscaler.sizes(deployment):  # those follow their policy instead
                self.scaler.record_miss(deployment, now)

    def take_scale_requests(self, now: float) -> list[ScaleRequest]:
        if self.shutdown is not None:
            return []  # no sizing while shutting down: the shutdown scales every deployment to zero
        requests, self._asked_scale_ups = self._asked_scale_ups, []
        if self.autoscaler.sizing:
            requests += self._take_policy_decisions(now)
        due = self.scaler.next_due()
        if due is None or now < due:
            return requests  # the common case, on every pool wake-up: no count of every agent
        registered: dict[str, int] = {}
        for agent in self.index.agents():
            if agent.state != AgentState.DRAINING:
                registered[agent.deployment] = registered.get(agent.deployment, 0) + 1
        return requests + self.scaler.due(now, registered)

    # --------------------------------------------------------------- policies
    def set_policy(self, deployment: str, policy: PoolPolicy | None) -> None:
        """Give `deployment` a policy (None: back to the defaults and demand-driven scale-ups only);
        one without max_replicas sets its protection and leaves its sizing demand-driven."""
        self.autoscaler.set_policy(deployment, policy)
        self._autoscale_dirty = True
        self._next_health_round = float("-inf")  # the next round at the next chance, at the new intervals
        if not self.autoscaler.sizes(deployment):
            # Agents its sizing was replacing (worn out, unhealthy) are recycled instead: no sizing
            # policy starts their replacements any more.
            for agent in list(self.index.agents()):
                why = self._retiring.get(agent.agent_id)
                if agent.deployment == deployment and why in ("worn", "unhealthy"):
                    self._recycle(agent, "reached max_uses" if why == "worn" else "unhealthy")

    def scale_up(self, deployment: str, extra: int, reason: str, now: float) -> ScaleRequest:
        """A caller asks for `extra` more agents of `deployment` now (the `set_policy` update's
        `scale_up`, so it is in the pool's history): within its policy's max_replicas when it
        has one, else over the agents it has registered. Raises ValueError when nothing can
        be added (shutting down, at max_replicas, or a deployment the pool never saw)."""
        if self.shutdown is not None:
            raise ValueError(f"pool {self.pool} is shutting down: no scale-up")
        if self.autoscaler.sizes(deployment):
            request = self.autoscaler.ask(deployment, self.deployment_loads()[deployment], extra, now, reason)
            if request is None:
                policy = self.autoscaler.policies[deployment]
                raise ValueError(
                    f"deployment {deployment} is at its policy's max_replicas {policy.max_replicas} "
                    "(agents registered and asked for): raise max_replicas first"
                )
        else:
            if deployment not in self._known_deployments():
                raise ValueError(f"deployment {deployment} has never served in pool {self.pool}: no replicas to scale")
            registered = sum(
                1 for agent in self.index.agents() if agent.deployment == deployment and agent.state != AgentState.DRAINING
            )
            request = ScaleRequest(deployment=deployment, replicas=registered + extra, at_least=True, reason=reason)
        self._asked_scale_ups.append(request)
        self._warn(f"scale-up of {deployment} to {request.replicas} asked: {reason}")
        return request

    def _on_demand(self, name: str, offering: list[str], now: float) -> None:
        """A breaker opened in `on_demand` mode: fresh agents for the unhealthy ones, per deployment
        with a policy, within its max_replicas; the callers queue meanwhile and get them."""
        sick: dict[str, int] = {}
        for agent_id in offering:
            agent = self.index.get(agent_id)
            if agent is not None and self.autoscaler.sizes(agent.deployment) and self.health.is_unhealthy(agent_id):
                sick[agent.deployment] = sick.get(agent.deployment, 0) + 1
        loads = self.deployment_loads() if sick else {}
        for deployment, count in sorted(sick.items()):
            reason = f"breaker for {name} open (on_demand): {count} fresh agent(s) for the unhealthy ones"
            request = self.autoscaler.ask(deployment, loads[deployment], count, now, reason)
            if request is None:
                self._warn(f"breaker for {name} open (on_demand): {deployment} is at its max_replicas, no fresh agent")
                continue
            self._asked_scale_ups.append(request)
            self._warn(f"{reason}: {deployment} scaled to {request.replicas}")

    def _retire(self, agent_id: str, reason: str) -> None:
        """Route nothing more to the agent: it is worn out or chosen to go."""
        self._retiring[agent_id] = reason
        agent = self.index.get(agent_id)
        if agent is not None and agent.routable:
            self.index.set_state(agent_id, AgentState.DRAINING)
        self._warn(f"agent {agent_id} retired from routing: {reason}")

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        self._new_warnings.append(text)

    def _autoscale_due(self, now: float) -> bool:
        due = self.autoscaler.next_due()
        return (self._autoscale_dirty and now >= self._last_autoscale + AUTOSCALE_EVERY_S) or (
            due is not None and now >= due
        )

    def _take_policy_decisions(self, now: float) -> list[ScaleRequest]:
        if not self._autoscale_due(now):
            return []
        self._autoscale_dirty = False
        self._last_autoscale = now
        ups, downs = self.autoscaler.evaluate(now, self.deployment_loads())
        for down in downs:
            for victim in down.victims:
                self._retire(victim, "recycled" if down.reason.startswith("recycled") else "scale-down")
            self._scale_downs.append(down)
        return ups

    def deployment_loads(self) -> dict[str, DeploymentLoad]:
        """Every sized deployment's load now: what its policy sizes it by."""
        policies = self.autoscaler.sizing
        loads = {d: DeploymentLoad() for d in policies}
        for agent in self.index.agents():
            load = loads.get(agent.deployment)
            if load is None:
                continue
            reason = self._retiring.get(agent.agent_id)
            if reason in ("scale-down", "recycled") or (reason is None and agent.state == AgentState.DRAINING):
                continue  # already on its way out
            load.registered += 1
            if reason in ("worn", "unhealthy"):
                load.worn.append(agent.agent_id)  # replaced first, then retired
                continue
            load.serving += 1
            load.in_flight += agent.total_in_flight
            if agent.total_in_flight == 0 and agent.routable:
                load.idle.append((self._uses.get(agent.agent_id, 0), agent.agent_id))
        for load in loads.values():
            load.worn.sort()
        serving_by_ref: dict[str, set[str]] = {}
        for waiter in self.waiters.values():
            if waiter.ref not in serving_by_ref:
                ref = CapabilityRef.parse(waiter.ref)
                deployments = set(self.index.deployments_serving(ref))
                versions = self.catalog.get(ref.name, {})
                deployments |= {d for v, ds in versions.items() if self.index.version_matches(ref, v) for d in ds}
                serving_by_ref[waiter.ref] = {d for d in deployments if d in policies}
            for deployment in serving_by_ref[waiter.ref]:
                loads[deployment].waiting += 1
        return loads

    # ------------------------------------------------------------- relearning
    # A pool run that starts without state (its workflow terminated by mistake, reset, a new
    # namespace) while agent workflows run: the workflow lists them (a visibility query on
    # `AgentPool` and the execution status) and reads each one's own snapshot, as it reads
    # a hint. Meanwhile an acquire for a name not learned yet waits in the queue; once every
    # agent found is read, waiters for a name nobody offers learn that (CapabilityUnknownError).
    def begin_relearn(self) -> None:
        self.relearning, self._relearn_listed = True, False
        self._relearn_reads.clear()

    def relearn_found(self, found: dict[str, str], now: float) -> None:
        """The agent workflows the listing found running (agent id -> deployment, "" when unknown):
        each not known yet, and at home in this shard, is read (`take_verifications`)."""
        if not self.relearning:
            return
        for agent_id, deployment in sorted(found.items()):
            if agent_id in self.index or agent_id in self._unverified or agent_id in self._relearn_reads:
                continue
            if self.layout.sharded and deployment and self.home_of(agent_id, deployment) != self.shard:
                continue  # another shard's: that shard's own run reads it
            self._relearn_reads.add(agent_id)
            self._verifications.append(agent_id)
        self._relearn_listed = True
        self.relearn_progress(now)

    def relearn_progress(self, now: float) -> None:
        """End the relearning once the listing is in and every agent it found is read."""
        if not self.relearning or not self._relearn_listed or self._relearn_reads:
            return
        self.relearning = False
        self._warn(f"relearnt its fleet: {len(self.index)} agent(s) found running")
        for waiter in list(self.waiters.values()):
            if not self.ever_offered(waiter.name):
                self._drop_waiter(waiter.ticket)
                self._unknown_tickets.add(waiter.ticket)

    # --------------------------------------------------------------- outliers
    def outlier_policy(self, deployment: str) -> OutlierPolicy:
        """The deployment's outlier settings: its `PoolPolicy`'s, else the defaults (every deployment is protected)."""
        return self.protection(deployment).outliers

    def _task_outcome(self, record: LeaseRecord, outcome: str | None, now: float) -> None:
        """Count a released task's outcome (per capability: `capability_counters[name]["outcome.<o>"]`,
        bounded by the catalog x 7 outcomes) and let outlier detection judge its agent."""
        if outcome is None:
            return
        if record.capability in self.catalog:
            per_name = self.capability_counters.setdefault(record.capability, {})
            key = f"outcome.{outcome}"
            per_name[key] = per_name.get(key, 0) + 1
        agent = self.index.get(record.agent_id)
        if agent is None:
            return
        policy = self.outlier_policy(agent.deployment)
        verdict = self.outliers.record(agent.agent_id, outcome, record.lease_id)
        if verdict == "restore":
            self.outliers.restore(agent.agent_id, now)
            self.index.set_ejected(agent.agent_id, False)
            self._serve_soon.update(agent.capabilities)
            self._warn(f"agent {agent.agent_id} back in rotation: its trial task succeeded")
            return
        if not policy.enabled:
            return
        if verdict == "eject":
            self._eject(agent, self.outliers.agents[agent.agent_id].reason, policy, now, probe_failed=True)
        elif verdict == "judge_rate":
            reason = self.outliers.trips(agent.agent_id, policy) or self.outliers.rate_trips(
                agent.agent_id, lambda: self.index.agents_offering(record.capability), record.capability, policy, now
            )
            if reason is not None:
                self._eject(agent, reason, policy, now)

    def _eject(self, agent: IndexedAgent, reason: str, policy: OutlierPolicy, now: float, probe_failed: bool = False) -> None:
        """Take `agent` out of routing, unless that would eject more than `max_ejection_percent`
        of the agents of one of its capabilities (an agent whose trial failed stays out: it is counted already)."""
        if not probe_failed:
            for name in agent.capabilities:
                offering = self.index.agents_offering(name)
                out = sum(1 for a in offering if self.outliers.is_ejected(a))
                allowed = max(1, int(len(offering) * policy.max_ejection_percent / 100)) if len(offering) > 1 else 0
                if out + 1 > allowed:
                    self._warn(
                        f"agent {agent.agent_id} not ejected ({reason}): {out} of {len(offering)} agent(s) offering {name} "
                        f"are out already (max_ejection_percent {policy.max_ejection_percent:g})"
                    )
                    return
        until = self.outliers.eject(agent.agent_id, reason, policy, now)
        self.index.set_ejected(agent.agent_id, True)
        self.counters["ejected"] = self.counters.get("ejected", 0) + 1
        self._warn(f"agent {agent.agent_id} ejected until {to_datetime(until).isoformat()}: {reason}")

    def _end_ejections(self, now: float) -> None:
        """Agents whose ejection is over become routable for one trial task."""
        for agent_id in self.outliers.ejection_over(now):
            agent = self.index.get(agent_id)
            if agent is not None:
                self.index.set_ejected(agent_id, False)
                self._serve_soon.update(agent.capabilities)

    def ejection_row(self, agent_id: str) -> dict[str, Any]:
        """The ejection fields of the agent's `status` row."""
        record = self.outliers.agents.get(agent_id)
        if record is None:
            return {}
        row: dict[str, Any] = {"consecutive_failures": record.consecutive}
        if record.ejected:
            row["ejected"] = record.reason
            row["ejected_until"] = to_datetime(record.until)  # type: ignore[arg-type]
        elif record.probing:
            row["ejected"] = f"probing: {record.reason}" if record.probe_lease is None else f"probing (trial task under way): {record.reason}"
        return row

    # ----------------------------------------------------------------- health
    def take_health_checks(self, now: float) -> list[list[HealthTarget]]:
        """Batches of idle agents to check (`GET /healthz`), once a round is due; breakers move on time."""
        self._move_breakers(now, names=[n for n, b in self.health.breakers.items() if b.state == OPEN])
        if not len(self.index) or now < self._next_health_round:
            return []
        candidates: list[tuple[str, float]] = []
        intervals = {DEFAULT_PROTECTION.health_interval_s}
        for agent in self.index.agents():
            policy = self.protection(agent.deployment)
            intervals.add(policy.health_interval_s)
            if agent.total_in_flight and not self.health.is_unhealthy(agent.agent_id):
                continue  # busy healthy agents are proving themselves (their tasks' outcomes); sick ones routed anyway are probed
            reason = self._retiring.get(agent.agent_id)
            if reason not in (None, "unhealthy") or (reason is None and not agent.routable and not agent.ejected):
                continue
            candidates.append((agent.agent_id, policy.health_interval_s))
        due = self.health.due(now, candidates)
        self._next_health_round = now + min(intervals)
        targets = [HealthTarget(agent_id=a, endpoint=self.index.get(a).endpoint) for a in due]  # type: ignore[union-attr]
        return [targets[i : i + HEALTH_BATCH_MAX] for i in range(0, len(targets), HEALTH_BATCH_MAX)]

    def health_results(self, results: list[HealthResult], now: float) -> None:
        """What the checks found: unhealthy agents stop being routed to (and are replaced); recovered ones return."""
        touched: set[str] = set()
        for result in results:
            agent = self.index.get(result.agent_id)
            if agent is None:
                self.health.forget(result.agent_id)
                continue
            policy = self.protection(agent.deployment)
            flip = self.health.record(result.agent_id, result.ok, result.detail, now, policy.unhealthy_after)
            if flip == "unhealthy" and result.agent_id not in self._retiring:
                self._warn(f"agent {result.agent_id} unhealthy after {policy.unhealthy_after} failed check(s): {result.detail}")
                if self.autoscaler.sizes(agent.deployment):
                    self._retire(result.agent_id, "unhealthy")  # its policy starts a replacement, then retires it
                else:
                    self._recycle(agent, f"unhealthy: {result.detail}")
            elif flip == "recovered" and self._retiring.get(result.agent_id) == "unhealthy":
                del self._retiring[result.agent_id]
                if agent.state == AgentState.DRAINING:
                    self.index.set_state(result.agent_id, AgentState.READY)
                self._warn(f"agent {result.agent_id} healthy again")
            touched.update(agent.capabilities)
            self._autoscale_dirty = True
        self._move_breakers(now, names=touched)

    def health_checks_lost(self, agent_ids: list[str]) -> None:
        """A round's activity failed: those agents are checked again next round."""
        for agent_id in agent_ids:
            self.health.checking.discard(agent_id)

    def _move_breakers(self, now: float, names: Iterable[str]) -> None:
        for name in sorted(set(names)):
            offering: list[str] = []
            policy = None
            for agent_id in sorted(self.index.agents_offering(name)):
                agent = self.index.get(agent_id)
                reason = self._retiring.get(agent_id)
                if agent is None or reason not in (None, "unhealthy") or (reason is None and agent.state == AgentState.DRAINING):
                    continue
                offering.append(agent_id)
                policy = policy or self.protection(agent.deployment)
            if policy is None:
                continue
            change = self.health.evaluate_breaker(name, offering, policy, now)
            if change is None:
                continue
            state, why = change
            self._warn(f"breaker for {name} {state} ({policy.breaker_mode}): {why}")
            if policy.breaker_mode == "on_demand" and state == OPEN:
                self._on_demand(name, offering, now)
            if policy.breaker_mode == "route_anyway":
                for agent_id in offering:  # panic routing while open; unroutable again otherwise
                    if self._retiring.get(agent_id) == "unhealthy":
                        self.index.set_state(agent_id, AgentState.READY if state == OPEN else AgentState.DRAINING)
                if state == OPEN:
                    self._serve_soon.add(name)  # the next tick hands the now routable slots to waiters

    def _routed_anyway(self, agent: IndexedAgent) -> bool:
        return self._retiring.get(agent.agent_id) == "unhealthy" and any(
            self.health.open_mode(name) == "route_anyway" for name in agent.capabilities
        )

    def _breaker_reason(self, name: str) -> str:
        breaker = self.health.breakers[name]
        return f"breaker open since {to_datetime(breaker.since).isoformat()}: most agents offering {name} are unhealthy"

    def _breaker_cooldowns(self) -> dict[str, float]:
        """The open breakers' cooldowns (`next_breaker_due` reads no other; read on every wake, so
        a closed breaker costs no walk over the agents offering its capability)."""
        cooldowns: dict[str, float] = {}
        for name, breaker in self.health.breakers.items():
            if breaker.state != OPEN:
                continue
            for agent_id in sorted(self.index.agents_offering(name)):
                agent = self.index.get(agent_id)
                if agent is not None:
                    cooldowns[name] = self.protection(agent.deployment).breaker_cooldown_s
                    break
        return cooldowns

    def protection(self, deployment: str) -> PoolPolicy:
        """The deployment's health checks, breaker and outlier settings: its policy's, else DEFAULT_PROTECTION."""
        return self.autoscaler.policies.get(deployment) or DEFAULT_PROTECTION

    def _recycle(self, agent: IndexedAgent, why: str) -> None:
        """An agent to replace in a deployment no policy sizes: drained at the deployment's size,
        so its backend (the Deployment, the local backend) starts a fresh one in its place."""
        replicas = sum(
            1 for a in self.index.agents()
            if a.deployment == agent.deployment and (a.state != AgentState.DRAINING or a.agent_id == agent.agent_id)
        )
        self._retire(agent.agent_id, "recycled")
        self._scale_downs.append(ScaleDown(agent.deployment, replicas, [agent.agent_id], f"recycled: {agent.agent_id} {why}"[:256]))

    def take_scale_downs(self) -> list[ScaleDown]:
        """Retirements to carry out: deletion cost on each victim, patch replicas, drain the victims."""
        out, self._scale_downs = self._scale_downs, []
        return out

    # --------------------------------------------------------- eviction safety
    def may_evict(self, ask: EvictionAsk, now: float) -> EvictionVerdict:
        """An agent that stopped heartbeating asks to be terminated: yes, or stay and ask again later.

        Either way it is routed nothing more (until a snapshot says it is back).
        """
        verdict = self.eviction.ask(ask.agent_id, ask.window_s, now, len(self.index), ask.agent_id in self.index)
        if ask.agent_id in self.index:
            self.index.set_silent(ask.agent_id, True)
            seen = self._last_seen.get(ask.agent_id)
            if seen is not None:  # its workflow is running: not one to drop as stale
                self._last_seen[ask.agent_id] = (now, seen[1])
                heapq.heappush(self._stale_heap, (now + seen[1], ask.agent_id))
        self._eviction_warnings()
        return verdict

    def confirm_evictions(self, agent_ids: list[str] | None, now: float) -> list[str]:
        """An operator's word that these silent agents (None: all) are gone: they are let go when they ask."""
        confirmed = self.eviction.confirm(agent_ids, now, len(self.index))
        self._eviction_warnings()
        return confirmed

    def set_eviction_policy(self, policy: EvictionPolicy, now: float) -> None:
        self.eviction.set_policy(policy, now, len(self.index))
        self._eviction_warnings()

    def _heard_from(self, agent_id: str, now: float) -> None:
        """A snapshot from the agent's workflow: it is not silent (any more)."""
        self.eviction.heard_from(agent_id, now, len(self.index))
        agent = self.index.get(agent_id)
        if agent is not None and agent.silent:
            self.index.set_silent(agent_id, False)
        self._eviction_warnings()

    def _eviction_warnings(self) -> None:
        for warning in self.eviction.take_warnings():
            self._warn(warning)

    # --------------------------------------------------------------- effects
    def _queue_notice(self, agent: IndexedAgent, force: bool = False) -> None:
        """Tell the agent workflow about its load, only when it changes something there.

        Saturation flips Ready <-> Busy; a draining agent needs every count so it
        can finish at zero. Anything else is not worth a workflow-to-workflow hop.
        """
        total = agent.total_in_flight
        saturated = int(agent.saturated)
        sent = self._sent_load.get(agent.agent_id, (0, 0))
        draining = agent.state == AgentState.DRAINING
        if not force and sent[0] == saturated and not (draining and sent[1] != total):
            return
        self._sent_load[agent.agent_id] = (saturated, total)
        self._notice_seq += 1
        signal = "acquire" if total > sent[1] else "release"
        self._notices[agent.agent_id] = (
            signal,
            LoadNotice(in_flight=total, saturated=bool(saturated), seq=self._notice_seq, draining=draining, epoch=self.epoch)
        )

    def resend_notice(self, agent_id: str) -> None:
        """A notice failed to reach a workflow that still runs: tell it the load as it is now (if still indexed)."""
        agent = self.index.get(agent_id)
        if agent is not None:
            self._queue_notice(agent, force=True)

    def has_effects(self) -> bool:
        """Whether a message left something to carry out: reads, notices, revocations, index notices."""
        return bool(self._verifications or self._notices or self._revocations or self._index_notices)

    def has_notices(self) -> bool:
        return bool(self._notices)

    def take_notices(self) -> list[tuple[str, str, LoadNotice]]:
        """(agent id, signal name, notice) for every agent whose load changed meaningfully."""
        out = [(agent_id, signal, notice) for agent_id, (signal, notice) in sorted(self._notices.items())]
        self._notices.clear()
        return out

    def take_revocations(self) -> list[tuple[str, LeaseRevoked]]:
        out, self._revocations = self._revocations, []
        return out

    def take_warnings(self) -> list[str]:
        out, self._new_warnings = self._new_warnings, []
        return out

    # --------------------------------------------------------------- reading
    def lease_of(self, record: LeaseRecord) -> Lease:
        return Lease(
            lease_id=record.lease_id,
            pool=self.pool,
            agent_id=record.agent_id,
            deployment=record.deployment,
            capability=record.capability,
            version=record.version,
            endpoint=record.endpoint,
            granted_at=to_datetime(record.granted_at),
            deadline=to_datetime(record.deadline),
            holder=record.holder,
        )

    def find(self, ref: str | CapabilityRef, exclude: frozenset[str] = frozenset()) -> list[str]:
        return list(self.index.ranked(CapabilityRef.parse(ref), exclude))

    def report(self, ref: CapabilityRef, exclude: frozenset[str] = frozenset(), max_cost: str | None = None) -> PoolReport:
        report = self.index.report(ref, exclude, max_cost)
        report.waiting = len(self.waiters)
        report.active_leases = len(self.leases)
        return report

    def lease_ids_of(self, agent_id: str) -> list[str]:
        return [r.lease_id for r in self.leases.of_agent(agent_id)]

    def status(self) -> PoolStatus:
        return PoolStatus(
            pool=self.pool,
            agents=[
                PoolAgentRow(
                    agent_id=a.agent_id,
                    deployment=a.deployment,
                    state=a.state,
                    in_flight=a.total_in_flight,
                    capabilities=[f"{c.name}@{c.version}" for c in a.capabilities.values()],
                    uses=self._uses.get(a.agent_id, 0),
                    retiring=self._retiring.get(a.agent_id),
                    health_failures=self.health.agents[a.agent_id].failures if a.agent_id in self.health.agents else 0,
                    silent=a.silent,
                    drain_reason=self._drain_reasons.get(a.agent_id),
                    **self.ejection_row(a.agent_id),
                )
                for a in sorted(self.index.agents(), key=lambda a: a.agent_id)
            ],
            active_leases=len(self.leases),
            waiting=len(self.waiters),
            leases_granted=self.counters["granted"],
            leases_released=self.counters["released"],
            leases_expired=self.counters["expired"],
            leases_revoked=self.counters["revoked"],
            leases_renewed=self.counters["renewed"],
            exhausted=self.counters["exhausted"],
            agents_lost=self.counters["lost"],
            agents_drained=self.counters["drained"],
            capabilities=self.capability_status(),
            warnings=list(self.warnings),
            policies=dict(sorted(self.autoscaler.policies.items())),
            breakers={n: b.state for n, b in sorted(self.health.breakers.items()) if b.state != CLOSED},
            shutdown=self.shutdown.report(to_datetime) if self.shutdown is not None else None,
            eviction=self.eviction.status(),
            recently_ended=[
                EndedAgentRow(
                    agent_id=row["agent_id"],
                    deployment=row["deployment"],
                    capabilities=row["capabilities"],
                    reason=row["reason"],
                    drain_reason=row["drain_reason"],
                    ended_at=to_datetime(row["at"]),
                )
                for row in self.recently_ended
            ],
            relearning=self.relearning,
        )

    # --------------------------------------------------------------- shutdown
    def begin_shutdown(self, reason: str, deadline_s: float, now: float) -> bool:
        """Stop granting and start the shutdown (see `core.shutdown`). False if one is already under way.

        Every queued caller is told now (its ticket ends with the reason); leases
        in flight run on until `now + deadline_s`.
        """
        if self.shutdown is not None:
            return False
        plan = self.shutdown = ShutdownPlan(reason=reason, requested_at=now, deadline=now + deadline_s, leases_at_start=len(self.leases))
        for waiter in self.waiters.values():
            self.waiters.remove(waiter.ticket)
            if waiter.request_id:
                self._requests.pop(waiter.request_id, None)
            plan.waiters_ended += 1
        # Agents not checked yet are never indexed now: drained with the others.
        for agent_id, snap in sorted(self._unverified.items()):
            if agent_id not in self.index:  # indexed ones are drained with every other
                plan.heard_of(agent_id, snap.deployment, now)
            else:
                self.index.set_held(agent_id, False)
        self._unverified.clear()
        self._verifications.clear()
        self._rechecks.clear()
        self._scale_downs.clear()  # not started yet: the shutdown scales every deployment to zero
        self._warn(
            f"pool shutting down ({reason}): {plan.waiters_ended} waiter(s) told, "
            f"{plan.leases_at_start} lease(s) in flight may run for {deadline_s:g}s"
        )
        self._shutdown_tick(now)
        return True

    def _shutdown_tick(self, now: float) -> None:
        plan = self.shutdown
        assert plan is not None
        if not plan.leases_finished(now, len(self.leases)):
            return
        for record in self.leases.all():
            self.leases.release(record.lease_id)
            self._end_lease(record, "revoked", f"pool {self.pool} shut down ({plan.reason}): the shutdown deadline passed")
            plan.leases_revoked += 1
        if plan.leases_revoked:
            self._warn(f"pool shutdown: {plan.leases_revoked} lease(s) still held at the deadline revoked")
        agents = sorted((a.agent_id, a.deployment) for a in self.index.agents())
        plan.drain_all(now, agents, self._known_deployments())

    def _known_deployments(self) -> set[str]:
        """Every deployment this pool has heard of: its agents', the catalog's, the policies' and the scaler's."""
        known = {a.deployment for a in self.index.agents()}
        for versions in self.catalog.values():
            for deployments in versions.values():
                known.update(deployments)
        known.update(self.autoscaler.policies)
        known.update(self.scaler.state())
        return known

    def _shutdown_wakeup(self) -> float | None:
        assert self.shutdown is not None
        moments = [self.leases.next_deadline(), self.shutdown.next_wakeup()]
        present = [m for m in moments if m is not None]
        return min(present) if present else None

    def take_shutdown_effects(self, now: float) -> ShutdownEffects:
        """Tickets to end, agents to drain, deployments to scale to zero, agents to check."""
        return self.shutdown.take_effects(now) if self.shutdown is not None else ShutdownEffects()

    def shutdown_scaled(self, deployment: str, error: str | None) -> None:
        """The backend answered a scale-to-zero (`error` None: done)."""
        if self.shutdown is not None:
            self.shutdown.scale_answered(deployment, error)
            if error is not None:
                self._warn(f"pool shutdown: scaling {deployment} to zero failed: {error}")

    def shutdown_checked(self, agent_id: str, running: bool, now: float, new_id: Callable[[], str]) -> None:
        """A check of an agent that outlived its drain: gone (forget it) or still running (drain it again)."""
        if self.shutdown is None:
            return
        if running:
            self.shutdown.still_running(agent_id, now)
        else:
            self.agent_gone(agent_id, "its workflow has ended", now, new_id)
            self.shutdown.ended(agent_id)

    def shutdown_complete(self, now: float) -> bool:
        """Whether the shutdown is over: every agent workflow ended, every scale answered."""
        plan = self.shutdown
        if plan is None:
            return False
        if plan.phase == DRAINING_AGENTS and not plan.waiting and len(self.index):
            for agent in sorted(self.index.agents(), key=lambda a: a.agent_id):  # indexed, never told: tell them
                plan.heard_of(agent.agent_id, agent.deployment, now)
        return plan.complete(now, len(self.index))

    def capability_status(self) -> dict[str, CapabilityStatus]:
        """Per capability name: agents by state, slots, leases, waiters, counters. O(agents x capabilities)."""
        names = set(self.catalog) | set(self.capability_counters) | set(self.waiters.names())
        # Plain counts per name first (a status of thousands of agents builds each model once).
        states: dict[str, dict[str, int]] = {}
        sums: dict[str, list[int]] = {}  # name -> [in_flight, slots, idle_slots]
        for agent in self.index.agents():
            state = agent.state.value
            routable = agent.routable
            total = agent.total_in_flight
            for name, cap in agent.capabilities.items():
                by_state = states.setdefault(name, {})
                by_state[state] = by_state.get(state, 0) + 1
                row = sums.setdefault(name, [0, 0, 0])
                in_flight = agent.in_flight.get(name, 0)
                row[0] += in_flight
                if routable:
                    row[1] += min(cap.max_concurrency, agent.max_concurrency)
                    row[2] += max(0, min(cap.max_concurrency - in_flight, agent.max_concurrency - total))
        names.update(states)
        out: dict[str, CapabilityStatus] = {}
        for name in sorted(names):
            in_flight, slots, idle_slots = sums.get(name, (0, 0, 0))
            out[name] = CapabilityStatus(
                agents=states.get(name, {}),
                slots=slots,
                idle_slots=idle_slots,
                in_flight=in_flight,
                waiting=self.waiters.count(name),
                counters=dict(sorted(self.capability_counters.get(name, {}).items())),
                free=self.index.free_of(name),
            )
        return out

    # ------------------------------------------------------- continue-as-new
    def to_state(self) -> PoolCoreState:
        dumped: dict[tuple[Any, ...], dict[str, Any]] = {}  # agents share a few capability sets
        return PoolCoreState(
            pool=self.pool,
            agents=[
                {
                    "agent_id": a.agent_id,
                    "deployment": a.deployment,
                    "endpoint": a.endpoint,
                    "state": a.state.value,
                    "capabilities": [_digest_row(c, dumped) for c in a.capabilities.values()],
                    "max_concurrency": a.max_concurrency,
                }
                for a in self.index.agents()
            ],
            leases=[r.to_row() for r in self.leases.all()],
            waiters=[w.to_row() for w in self.waiters.values()],
            granted_tickets=dict(self.granted_tickets),
            counters=dict(self.counters),
            capability_counters={k: dict(sorted(v.items())) for k, v in sorted(self.capability_counters.items())},
            drift=self.drift.state(),
            scale=self.scaler.state(),
            catalog={k: {v: sorted(ds) for v, ds in vs.items()} for k, vs in self.catalog.items()},
            sent_load={k: list(v) for k, v in self._sent_load.items()},
            notice_seq=self._notice_seq,
            pending_notices=[[a, sig, n.model_dump()] for a, (sig, n) in sorted(self._notices.items())],
            pending_revocations=[[h, r.model_dump()] for h, r in self._revocations],
            warnings=list(self.warnings),
            scale_window_s=self.scaler.window_s,
            epoch=self.epoch,
            last_seen={a: list(v) for a, v in sorted(self._last_seen.items())},
            unverified=[s.model_dump(mode="json") for _, s in sorted(self._unverified.items())],
            autoscaler=self.autoscaler.state(),
            uses=dict(sorted(self._uses.items())),
            retiring=dict(sorted(self._retiring.items())),
            pending_scale_downs=[vars(d) for d in self._scale_downs],
            health=self.health.state(),
            next_health_round=None if self._next_health_round == float("-inf") else self._next_health_round,
            shutdown=self.shutdown.to_row() if self.shutdown is not None else None,
            eviction=self.eviction.state(),
            recently_ended=list(self.recently_ended),
            drain_reasons=dict(sorted(self._drain_reasons.items())),
            # Owed notices, handed out or not: a run's activities do not outlive it, so the next run sends them.
            index_notices=dict(sorted({**self._index_notices_out, **self._index_notices}.items())),
            # The newest figures of waiters the pool gave up on: their callers may cancel or
            # ask in the next run and still get them (a PoolExhaustedError names them).
            dropped_reports={t: r.model_dump(mode="json") for t, r in list(self._dropped_reports.items())[-DROPPED_REPORTS_CARRIED:]},
            relearning=self.relearning,  # the next run lists the fleet again
            outliers=self.outliers.state(),
        )

    @classmethod
    def from_state(cls, state: PoolCoreState) -> PoolCore:
        core = cls(state.pool, scale_window_s=state.scale_window_s, epoch=state.epoch)
        for agent_id, (seen, stale_after) in state.last_seen.items():
            core._last_seen[agent_id] = (seen, stale_after)
            heapq.heappush(core._stale_heap, (seen + stale_after, agent_id))
        # Loads first, so each agent is listed once (not once per lease): 10,000 agents
        # with 10,000 leases must rebuild well inside one workflow task.
        loads: dict[str, dict[str, int]] = {}
        for row in state.leases:
            per_agent = loads.setdefault(row["agent_id"], {})
            per_agent[row["capability"]] = per_agent.get(row["capability"], 0) + 1
        digests: dict[tuple[Any, ...], CapabilityDigest] = {}  # agents share a few capability sets
        core.index.begin_bulk()
        for row in state.agents:
            caps = []
            for c in row["capabilities"]:
                key = _digest_key(c)
                if key not in digests:
                    digests[key] = CapabilityDigest.model_validate(c)
                caps.append(digests[key])
            core.index.upsert(
                row["agent_id"],
                row["deployment"],
                row["endpoint"],
                AgentState(row["state"]),
                caps,
                row.get("max_concurrency"),
                in_flight=loads.get(row["agent_id"]),
            )
        core.index.end_bulk()
        for row in state.leases:
            record = core.leases.grant(LeaseRecord(**row))
            if record.request_id:
                core._requests[record.request_id] = record.lease_id
        for row in state.waiters:
            waiter = Waiter.from_row(row)
            core.waiters.push(waiter)
            if waiter.request_id:
                core._requests[waiter.request_id] = waiter.ticket
        core.granted_tickets = dict(state.granted_tickets)
        core.counters.update(state.counters)
        core.capability_counters = {k: dict(v) for k, v in state.capability_counters.items()}
        core.drift = DriftDetector.from_state(state.drift)
        core.scaler.load_state(state.scale)
        core.catalog = {k: {v: set(ds) for v, ds in vs.items()} for k, vs in state.catalog.items()}
        core._sent_load = {k: (v[0], v[1]) for k, v in state.sent_load.items()}
        core._notice_seq = state.notice_seq
        core._notices = {a: (sig, LoadNotice.model_validate(n)) for a, sig, n in state.pending_notices}
        core._revocations = [(h, LeaseRevoked.model_validate(r)) for h, r in state.pending_revocations]
        core.warnings.extend(state.warnings)
        core.autoscaler = Autoscaler.from_state(state.autoscaler)
        core._uses = dict(state.uses)
        core._retiring = dict(state.retiring)
        core._scale_downs = [ScaleDown(**row) for row in state.pending_scale_downs]
        core._autoscale_dirty = bool(core.autoscaler.sizing)
        core.health = HealthTracker.from_state(state.health)
        # Checks in flight when the run ended are asked again at once.
        core._next_health_round = state.next_health_round if state.next_health_round is not None else float("-inf")
        if state.shutdown is not None:
            core.shutdown = ShutdownPlan.from_row(state.shutdown)
        if state.eviction:
            core.eviction = EvictionGuard.from_state(state.eviction)
            for agent_id in core.eviction.unroutable():
                if agent_id in core.index:
                    core.index.set_silent(agent_id, True)
        core.recently_ended.extend(state.recently_ended)
        core._dropped_reports = {t: PoolReport.model_validate(r) for t, r in state.dropped_reports.items()}  # (likewise)
        core._drain_reasons = dict(state.drain_reasons)
        core.relearning = state.relearning
        core._index_notices = dict(state.index_notices)
        core.outliers = OutlierTracker.from_state(state.outliers)
        for agent_id in core.outliers.agents:
            if core.outliers.is_out(agent_id):
                core.index.set_ejected(agent_id, True)
        for raw in state.unverified:  # checks in flight when the run ended: ask again
            snap = AgentSnapshot.model_validate(raw)
            core._unverified[snap.agent_id] = snap
            core._verifications.append(snap.agent_id)
            if snap.agent_id in core.index and _state_kind(snap.state) != "serving":
                core.index.set_held(snap.agent_id, True)  # (only snapshot-as-hint runs carry such)
        # The previous run's reads may still report: they come as late readings (`agent_read_late`),
        # which judge no hint, so the reads asked here start with no recheck.
        return core
