"""The internal wire messages: what the client, the workflows, the activities and
the agents send each other. Not part of the public API; a malformed message is
rejected here, with the field and the reason, before it can reach any state.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from agentroster.errors import PoolReport, _Model
from agentroster.models import (
    AgentRegistration,
    AgentState,
    CapabilityRef,
    CostClass,
    ENDPOINT_MAX,
    EvictionPolicy,
    Lease,
    MAX_CAPABILITIES_PER_AGENT,
    MAX_CONCURRENCY_MAX,
    PoolPolicy,
    REF_MAX,
    REPLICAS_MAX,
    TASK_TIMEOUT_MAX_S,
    WAIT_MAX_S,
    _omitted_when_unset,
    check_capability_name,
    check_semver,
)


LEASE_TTL_MAX_S = 7 * 24 * 3600
ID_MAX = 253
SEQ_MAX = 2**53  # the largest integer JSON carries exactly
READ_BATCH_MAX = 1000  # agents one `read_agents` (or `tell_indexed`) activity handles


# --------------------------------------------------------------------------
# Messages between the client, the workflows and the activities.
# --------------------------------------------------------------------------


class AcquireRequest(_Model):
    """Ask the pool for a lease on `ref`."""

    ref: str = Field(max_length=REF_MAX)
    lease_ttl_s: float = Field(default=300.0, gt=0, le=LEASE_TTL_MAX_S)
    wait_s: float = Field(default=5.0, ge=0, le=WAIT_MAX_S, description="How long the caller will wait in the queue")
    holder: str | None = Field(default=None, max_length=512, description="Who holds the lease; a workflow id is told on revocation")
    holder_is_workflow: bool = False
    exclude_agents: list[Annotated[str, Field(max_length=ID_MAX)]] = Field(default_factory=list, max_length=100)
    max_cost_class: CostClass | None = Field(
        default=None,
        description="The dearest cost class the caller accepts (A < B < C): agents of a dearer one are never "
        "offered, even when they alone are free; the caller waits, and its PoolExhaustedError counts them",
    )
    request_id: str = Field(
        min_length=16,
        max_length=128,
        description="A secret only the caller knows (e.g. 32 random hex digits): the idempotency key, and what the "
        "ticket and lease ids are derived from, so nobody without it can guess them",
    )
    recover_only: bool = Field(
        default=False,
        description="Only what an earlier request with this request_id got (its lease, or its place in the queue), "
        "never a new lease: how a task workflow finds a lease its activity took but could not report",
    )
    prefetch: bool = Field(
        default=False,
        description="A lease for a task that has not come yet (a worker's prefetch): granted only when a slot is "
        "free and nobody waits for the capability; never queued, never counted as unmet demand",
    )

    @field_validator("ref")
    @classmethod
    def _check_ref(cls, value: str) -> str:
        CapabilityRef.parse(value)
        return value

    _serialize = _omitted_when_unset("recover_only", "prefetch", "max_cost_class")


class PoolAcquireRequest(AcquireRequest):
    """An acquire made on a task workflow's behalf by the `lease_and_invoke` activity."""

    pool: str
    # Workflow code cannot make a secret (its randomness is seeded from the run id):
    # the activity derives one.
    request_id: str | None = Field(default=None, min_length=16, max_length=128)  # type: ignore[assignment]


class AcquireReply(_Model):
    """Either a lease at once, or a ticket for a place in the queue."""

    lease: Lease | None = None
    ticket: str | None = None
    report: PoolReport | None = None
    unknown_capability: bool = Field(
        default=False, description="No agent in the pool has ever offered the capability: waiting cannot help"
    )
    circuit_open: str | None = Field(default=None, description="The capability's breaker is open (fail_fast): why")


# The most requests, lease ids or tickets one pool message carries; clients batch at most this many.
MAX_BATCH = 256  # requests, lease ids or tickets in one batched pool message
LEASE_ID_MAX = 128
LeaseId = Annotated[str, Field(min_length=1, max_length=LEASE_ID_MAX)]


# How a task went on its agent, told to the pool with the lease's release (no message of its own).
# Plain strings on the wire: "succeeded"; the agent's fault ("failed_*": it could not be reached, answered
# 5xx, gave no answer within the task's timeout, answered an output that breaks its schema); or it
# turned the task away ("refused_*": 429 too busy or throttled, 503 draining, starting or broken).
Outcome = Literal[
    "succeeded", "failed_unreachable", "failed_5xx", "failed_timeout", "failed_bad_output", "refused_429", "refused_503"
]
OUTCOMES: tuple[str, ...] = Outcome.__args__  # type: ignore[attr-defined]


class Released(_Model):
    """A released lease with how its task went: what the pool's outlier detection learns from."""

    lease_id: LeaseId
    outcome: Outcome


# One item of a release: a lease id alone (no task ran, or its fate is not the agent's), or with its outcome.
Release = LeaseId | Released


def released_id(item: str | Released) -> str:
    """The lease id of a release item."""
    return item if isinstance(item, str) else item.lease_id


def released_outcome(item: str | Released) -> str | None:
    """The outcome a release item carries, if any."""
    return None if isinstance(item, str) else item.outcome


class AcquireBatch(_Model):
    """The pool's `acquire` update: acquires answered in order, after `releases` (lease ids, each
    with its task's outcome when it has one) are returned, so a slot they free serves the queue
    (FIFO) before these acquires. A client's releases ride on its next acquire this way: one
    message instead of two."""

    requests: list[AcquireRequest] = Field(min_length=1, max_length=MAX_BATCH)
    releases: list[Release] = Field(default_factory=list, max_length=MAX_BATCH)

    _serialize = _omitted_when_unset("releases")


class RenewRequest(_Model):
    """Move a lease's deadline to now + `ttl_s`."""

    lease_id: str = Field(min_length=1, max_length=128)
    ttl_s: float = Field(gt=0, le=7 * 24 * 3600)
    adopt_by: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="A workflow that takes over a worker's prefetched lease: the pool tells it, from now on, when "
        "the lease is revoked. Ignored for a lease a workflow holds already",
    )
    adopt_request_id: str | None = Field(
        default=None,
        min_length=16,
        max_length=128,
        description="With adopt_by: the adopting task's secret request id, by which it finds the lease again "
        "(`recover_only`) if its activity ends without a word",
    )

    _serialize = _omitted_when_unset("adopt_by", "adopt_request_id")


class AgentSnapshot(_Model):
    """What an agent workflow tells its pool: its routing facts, no schemas."""

    agent_id: str
    deployment: str
    endpoint: str
    state: AgentState
    capabilities: list[CapabilityDigest] = Field(default_factory=list, max_length=MAX_CAPABILITIES_PER_AGENT)
    max_concurrency: int | None = Field(
        default=None, ge=1, le=MAX_CONCURRENCY_MAX, description="Agent-wide cap; None: the largest capability's"
    )
    reason: str = Field(default="", max_length=1024)
    resync_interval_s: float | None = Field(
        default=None,
        ge=1,
        le=24 * 3600,
        description="The agent re-sends its snapshot this often; silence for 3x means it is gone",
    )
    awaits_index: int | None = Field(
        default=None,
        ge=1,
        le=SEQ_MAX,
        description="The registration (its number in the agent workflow) waiting to hear that the pool indexed it",
    )

    # The same rules as a registration: the pool must never index what a pick
    # could choke on.
    _check_ids = field_validator("agent_id", "deployment")(classmethod(lambda cls, v: AgentRegistration._check_object_name(v)))
    _check_endpoint = field_validator("endpoint")(classmethod(lambda cls, v: AgentRegistration._check_endpoint(v)))

    @field_validator("capabilities")
    @classmethod
    def _check_capabilities(cls, value: list[CapabilityDigest]) -> list[CapabilityDigest]:
        names = [c.name for c in value]
        if len(names) != len(set(names)):
            raise ValueError("a capability is listed more than once")
        return value


class CapabilityDigest(_Model):
    """A capability without its schemas: what the pool's index needs."""

    name: str
    version: str
    max_concurrency: int = Field(ge=1, le=MAX_CONCURRENCY_MAX)
    cost_class: CostClass = "B"

    _check_name = field_validator("name")(classmethod(lambda cls, value: check_capability_name(value)))
    _check_version = field_validator("version")(classmethod(lambda cls, value: check_semver(value)))


class LoadNotice(_Model):
    """The pool telling an agent workflow its current load (coalesced)."""

    in_flight: int = Field(ge=0, le=MAX_CONCURRENCY_MAX)
    saturated: bool
    seq: int = Field(ge=0, le=SEQ_MAX)
    draining: bool = Field(default=False, description="The pool has seen the agent Draining: a count it can finish on")
    epoch: str = Field(default="", max_length=128, description="The pool's identity: a new pool starts its seq again")


class LeaseRevoked(_Model):
    lease_id: str = Field(min_length=1, max_length=128)
    agent_id: str = Field(min_length=1, max_length=ID_MAX)
    reason: str = Field(max_length=1024)


class DrainRequest(_Model):
    reason: str = Field(default="drain", max_length=256)
    deadline_s: float = Field(default=300.0, gt=0, le=7 * 24 * 3600)
SHUTDOWN_DEADLINE_MAX_S = 7 * 24 * 3600


class ShutdownRequest(_Model):
    """The pool's `shutdown` update: stop granting, let leases finish, drain, scale to zero, end."""

    deadline_s: float = Field(
        default=60.0, ge=0, le=SHUTDOWN_DEADLINE_MAX_S, description="How long in-flight leases may still run; then they are revoked"
    )
    reason: str = Field(default="shutdown requested", min_length=1, max_length=256, description="Why, shown to callers and in status")


class ScaleRequest(_Model):
    """Ask the backend to set a deployment's replica count."""

    deployment: str
    replicas: int = Field(ge=0, le=REPLICAS_MAX)
    reason: str = ""
    at_least: bool = Field(default=False, description="Never lower the count: demand-driven scale-ups only add")
    shutdown: bool = Field(default=False, description="The pool is shutting down: zero, even below a backend's own minimum")
    victims: list[Annotated[str, Field(max_length=ID_MAX)]] = Field(
        default_factory=list, max_length=REPLICAS_MAX,
        description="A scale-down's retirees: their pods are marked to go first, before the count is lowered",
    )

    _serialize = _omitted_when_unset("shutdown", "victims")


class HealthTarget(_Model):
    agent_id: str = Field(max_length=ID_MAX)
    endpoint: str = Field(max_length=ENDPOINT_MAX)


class HealthCheckBatch(_Model):
    """Input of the `check_health` activity: agents whose `/healthz` to call."""

    pool: str
    targets: list[HealthTarget]
    timeout_s: float = Field(default=3.0, gt=0, le=60)


class HealthResult(_Model):
    agent_id: str
    ok: bool
    detail: str = Field(default="", max_length=512)


class SetPolicy(_Model):
    """The `set_policy` update's argument: a deployment's policy (`policy` None removes
    it), or, with `eviction` and no deployment, the pool's eviction safety, or, with
    `scale_up`, a caller's ask for more agents of a deployment now (its policy unchanged)."""

    deployment: str | None = None
    policy: PoolPolicy | None = None
    eviction: EvictionPolicy | None = None
    scale_up: int | None = Field(
        default=None, ge=1, le=REPLICAS_MAX,
        description="Start this many more agents of `deployment` now (within its policy's max_replicas)",
    )
    reason: str | None = Field(default=None, max_length=256, description="Why (with `scale_up`): kept in the pool's history")

    _serialize = _omitted_when_unset("scale_up", "reason")

    @field_validator("deployment")
    @classmethod
    def _check_deployment(cls, value: str | None) -> str | None:
        return None if value is None else AgentRegistration._check_object_name(value)

    @model_validator(mode="after")
    def _one_policy(self) -> SetPolicy:
        if self.eviction is not None and (self.deployment is not None or self.policy is not None):
            raise ValueError("give `eviction` alone, or a `deployment` with its `policy`, not both")
        if self.scale_up is not None and (self.deployment is None or self.policy is not None or self.eviction is not None):
            raise ValueError("give `scale_up` with a `deployment` alone (no `policy`, no `eviction`)")
        if self.eviction is None and self.deployment is None:
            raise ValueError("give a `deployment` (with its `policy`, or none to remove it), or `eviction`")
        return self


class InvokeRequest(_Model):
    """What the invoke activity POSTs to `{endpoint}/tasks/{capability}`."""

    lease_id: str
    capability: str
    version: str
    input: Any = None
PodGoneReason = Literal["process_exited", "pod_deleted", "pod_failed", "container_crashloop"]
POD_GONE_DETAIL_MAX = 512
POD_UID_MAX = 128


class PodGone(_Model):
    """The `pod_gone` signal's argument: the backend saw the agent's process exit or its pod go.

    Sent by the worker's backend (the local backend's process watch, the Kubernetes
    backend's pod watch) so the agent workflow ends at once instead of after 3 missed
    heartbeats. `pod_uid`, when both it and the registration's `metadata.pod_uid` are
    set, must match: a pod recreated under the same name is not ended by its predecessor's event.
    """

    agent_id: str
    reason: PodGoneReason
    detail: str = Field(default="", max_length=POD_GONE_DETAIL_MAX)
    pod_uid: str | None = Field(default=None, min_length=1, max_length=POD_UID_MAX)

    _check_ids = field_validator("agent_id")(classmethod(lambda cls, v: AgentRegistration._check_object_name(v)))


class PodRef(_Model):
    """One agent's pod: which deployment it belongs to and its name (agent_id)."""

    deployment: str
    agent_id: str
    reason: str = ""


class AgentRef(_Model):
    """One agent of one pool: what the pool asks the `verify_agent` activity about."""

    pool: str
    agent_id: str


class AgentReading(_Model):
    """What the `read_agent` activity found: the agent workflow's own snapshot, read from it.

    The pool applies this, never the `agent_snapshots` signal that made it look
    (anyone can send that signal). `snapshot` None: no agent workflow speaks for
    the agent (none ran, or it ended without a registration); an ended workflow
    that had registered reads as its last snapshot with state Terminated.
    """

    snapshot: AgentSnapshot | None = None
    detail: str = Field(default="", max_length=512, description="What was found, for the refusal when nothing speaks for it")


class AgentRefs(_Model):
    """Agents of one pool: what the pool asks the `read_agents` activity about (one batch)."""

    pool: str
    agent_ids: list[Annotated[str, Field(max_length=ID_MAX)]] = Field(min_length=1, max_length=READ_BATCH_MAX)


class AgentReadings(_Model):
    """What the `read_agents` activity found, by agent id. An agent in `failed` could not be
    read (its retries ran out): the pool keeps what it has for it, as after a failed `read_agent`."""

    agent_ids: list[Annotated[str, Field(max_length=ID_MAX)]] = Field(default_factory=list, max_length=READ_BATCH_MAX, description="The agents asked about")
    readings: dict[str, AgentReading] = Field(default_factory=dict)
    failed: dict[str, str] = Field(default_factory=dict, description="Agent id -> why its workflow could not be read")


class IndexNotice(_Model):
    """The pool telling an agent workflow that it indexed one of its registrations."""

    agent_id: str = Field(max_length=ID_MAX)
    registration: int = Field(ge=1, le=SEQ_MAX)
    epoch: str = Field(default="", max_length=128, description="The pool's identity")


class IndexNotices(_Model):
    """A batch of index notices for the `tell_indexed` activity to deliver."""

    pool: str
    notices: list[IndexNotice] = Field(min_length=1, max_length=READ_BATCH_MAX)


class PoolNotification(_Model):
    """An agent workflow's snapshot on its way to the pool (through an activity)."""

    pool: str
    snapshot: AgentSnapshot
    shard: int = Field(default=0, ge=0, lt=64, description="The agent's home shard in a sharded pool (0: unsharded)")
    shards: int = Field(default=1, ge=1, le=64, description="How many shards the agent's registration said the pool has")
    shard_by: str = Field(default="deployment", max_length=32, description="How the agent's registration said the pool places agents")


class LeaseAndInvoke(_Model):
    """Input of the `lease_and_invoke` activity: ask for a lease, invoke the agent, release.

    `key` names the request within its workflow run (one per attempt): the activity
    derives the request's secret id from it, and so can `recover_lease` when this
    activity ends without saying which lease it took."""

    request: PoolAcquireRequest
    payload: Any = None
    timeout_s: float = Field(default=60.0, gt=0, le=TASK_TIMEOUT_MAX_S)
    key: str = Field(min_length=1, max_length=64)


class LeaseInvokeOutcome(_Model):
    """Result of `lease_and_invoke`: the lease (released by the activity) and the checked
    output; or, when no lease came within the task's wait, the pool's figures and why."""

    lease: Lease | None = None
    output: Any = None
    reply: AcquireReply | None = None


class LeaseInvokeFailure(_Model):
    """The details of a `lease_and_invoke` failure after the lease was granted: which lease
    (the activity gives it back)."""

    lease: Lease


class RecoverLease(_Model):
    """Input of `recover_lease` and `request_holds`: the pool and ref of a `lease_and_invoke`
    request, and its key."""

    pool: str
    ref: str = Field(max_length=REF_MAX)
    key: str = Field(min_length=1, max_length=64)


class RequestHolds(_Model):
    """What a `lease_and_invoke` request holds in its pool now (`request_holds`)."""

    lease: Lease | None = None
    queued: bool = False


# --------------------------------------------------------------------------
# Eviction safety: an agent that stopped heartbeating asks its pool before it
# is terminated; the pool holds mass terminations back (self-preservation).
# --------------------------------------------------------------------------
HEARTBEAT_WINDOW_MAX_S = 3 * 3600.0  # MISSED_HEARTBEATS x the longest heartbeat_interval_s
CONFIRM_MAX_AGENTS = 256


class EvictionAsk(_Model):
    """The `may_evict` update's argument: an agent that stopped heartbeating asks to be terminated."""

    agent_id: str
    window_s: float = Field(ge=1, le=HEARTBEAT_WINDOW_MAX_S, description="Its heartbeat window: 3 x heartbeat_interval_s")

    _check_id = field_validator("agent_id")(classmethod(lambda cls, v: AgentRegistration._check_object_name(v)))


class PoolEvictionAsk(EvictionAsk):
    """An `EvictionAsk` on its way to a pool, through the `request_eviction` activity."""

    pool: str
    shard: int = Field(default=0, ge=0, lt=64, description="The agent's home shard in a sharded pool (0: unsharded)")


class EvictionVerdict(_Model):
    """The pool's answer: terminate now, or stay (unroutable) and ask again after `retry_after_s`."""

    allow: bool
    retry_after_s: float = Field(default=0.0, ge=0, le=HEARTBEAT_WINDOW_MAX_S)
    reason: str = Field(default="", max_length=1024)
    self_preservation: bool = False


class ConfirmEvictions(_Model):
    """An operator's word that silent agents are really gone: `agents` (None: every silent agent)."""

    agents: list[Annotated[str, Field(min_length=1, max_length=ID_MAX)]] | None = Field(
        default=None, max_length=CONFIRM_MAX_AGENTS
    )


AgentSnapshot.model_rebuild()
PoolNotification.model_rebuild()


# ---------------------------------------------------------------- the pool's chores
# The pool workflow wakes for updates only (see `workflows.pool`): what it needs done
# outside (signals to send, agents to read, health checks, scaling, an alarm) runs as an
# activity it does not wait for, and the activity reports back with the pool's `report`
# update. The activity id is the chore's key.
CHORE_KINDS = ("alarm", "read", "found", "health", "gone", "checked", "scaled")


class Delivery(_Model):
    """One signal the `deliver_signals` activity sends for the pool."""

    workflow_id: str = Field(max_length=ID_MAX * 2)
    signal: str = Field(max_length=64)
    arg: dict[str, Any] | None = None
    agent_id: str | None = Field(default=None, max_length=ID_MAX, description="Set for an agent workflow: one that has ended is reported gone")


class Deliveries(_Model):
    """Input of the `deliver_signals` activity: signals from one pool, sent together."""

    pool: str
    items: list[Delivery] = Field(min_length=1)
    report: bool = Field(default=False, description="Report once sent, even when no agent was found gone (the pool waits for it)")


class ChoreReport(_Model):
    """The pool's `report` update: what one of its chores (activities) found. `key` is the
    activity id the pool gave it; `result`'s shape depends on `kind`."""

    key: str = Field(min_length=1, max_length=128)
    kind: Literal["alarm", "read", "found", "health", "gone", "checked", "scaled"]
    result: Any = None


class ScaleDone(_Model):
    """A `scale_deployment` chore's report: the request as carried out, and the error if it failed."""

    request: ScaleRequest
    error: str | None = Field(default=None, max_length=1024)


class AgentChecked(_Model):
    """A `verify_agent` chore's report: whether the agent's workflow runs (None: could not be found out)."""

    agent_id: str = Field(max_length=ID_MAX)
    running: bool | None
