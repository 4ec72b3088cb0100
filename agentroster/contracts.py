"""The public data of agentroster: pydantic v2 models and error types.

Everything that crosses a boundary (client -> workflow, workflow -> workflow,
workflow -> activity, agent -> worker over HTTP) is one of these models, so a
malformed message is rejected here, with the field and the reason, before it
can reach any state.
"""

from __future__ import annotations

import difflib
import enum
import json
import logging
import re
from datetime import datetime
from collections.abc import Callable
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from agentroster.versions import matches as version_matches
from agentroster.versions import parse_range
from agentroster.versions import parse_semver as parse_semver  # re-exported: registrations validate with it
from agentroster.wire import MAX_BATCH

logger = logging.getLogger("agentroster")

CostClass = Literal["A", "B", "C"]
COST_RANK: dict[str, int] = {"A": 0, "B": 1, "C": 2}

METADATA_MAX_BYTES = 16 * 1024
SHORT_HEARTBEAT_WARNING_S = 5.0
# Heartbeats only have to catch hangs and partitions: a process that exits or a pod
# that is deleted is reported at once by the backend (`pod_gone`), so the default
# is slow (a window of 3 x 120 s = 6 min for a hung agent) and cheap (~30 signals
# per agent-hour). Set 10 for the old 30 s window when no backend watches the agents.
DEFAULT_HEARTBEAT_INTERVAL_S = 120.0
MISSED_HEARTBEATS = 3

_CAPABILITY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")
# Kubernetes object names (pods, deployments) are DNS-1123 subdomains; we also
# accept underscores and capitals so local agents can use friendly ids.
_OBJECT_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
# scheme://host[:port][/path], no whitespace or control characters anywhere.
_ENDPOINT = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?")

# Bounds users can read in the README: every duration and count has one, so no
# message can push a workflow past what it can represent (dates, payload sizes).
HEARTBEAT_MIN_S, HEARTBEAT_MAX_S = 1.0, 3600.0
MAX_CAPABILITIES_PER_AGENT = 64
CAPABILITY_NAME_MAX = 128
VERSION_MAX = 64
ENDPOINT_MAX = 512
MAX_CONCURRENCY_MAX = 10_000
LEASE_TTL_MAX_S = 7 * 24 * 3600
WAIT_MAX_S = 24 * 3600
SCHEMA_MAX_BYTES = 64 * 1024
REGISTRATION_MAX_BYTES = 256 * 1024
REF_MAX = 256
ID_MAX = 253
SEQ_MAX = 2**53  # the largest integer JSON carries exactly
READ_BATCH_MAX = 1000  # agents one `read_agents` (or `tell_indexed`) activity handles
TASK_TIMEOUT_MAX_S = 24 * 3600
REPLICAS_MAX = 10_000
TASK_PAYLOAD_MAX_BYTES = 1024 * 1024
# A pool name is part of workflow ids (`pool/{pool}`, `agent/{pool}/{agent_id}`):
# no '/', so an id always splits one way.
_POOL_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")


def check_pool_name(pool: str) -> str:
    """`pool` if it is a valid pool name; raises ValueError naming the rule otherwise."""
    if not isinstance(pool, str) or not _POOL_NAME.fullmatch(pool):
        raise ValueError(f"pool {pool!r}: must be 1-128 letters, digits, '.', '_' or '-', starting and ending alphanumeric")
    return pool


# Task types name routes in a routing table (`summarize`, `docs.translate`); the
# table travels in `TaskInput`, so it is bounded too.
TASK_TYPE_MAX = 128
ROUTES_MAX = 1000
_TASK_TYPE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")


def check_task_type(value: str) -> str:
    """`value` if it is a task type name (like `summarize` or `docs.translate`); raises ValueError otherwise."""
    if not isinstance(value, str) or len(value) > TASK_TYPE_MAX or not _TASK_TYPE.fullmatch(value):
        raise ValueError(
            f"task type {value!r}: must be at most {TASK_TYPE_MAX} letters, digits, '_', '-' and '.', "
            "starting with a letter (e.g. summarize or docs.translate)"
        )
    return value


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON; raises ValueError for what JSON cannot hold (NaN, objects)."""
    try:
        return len(json.dumps(value, separators=(",", ":"), allow_nan=False).encode())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"must be plain JSON (no NaN or infinities): {exc}") from exc


def check_semver(value: str) -> str:
    """`value` if it is a semantic version; raises ValueError with the reason otherwise."""
    if isinstance(value, str) and len(value) > VERSION_MAX:
        raise ValueError(f"a version is at most {VERSION_MAX} characters, got {len(value)}")
    parse_semver(value)
    return value


def check_capability_name(value: str) -> str:
    """A dotted capability name such as `rag.search`; raises ValueError otherwise."""
    if not isinstance(value, str) or len(value) > CAPABILITY_NAME_MAX or not _CAPABILITY_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a dotted capability name (e.g. rag.search) of at most {CAPABILITY_NAME_MAX} characters"
        )
    return value


class _Model(BaseModel):
    # NaN and infinities are refused everywhere: they break date arithmetic and
    # serialise as null, which the next run would refuse to read.
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


def _omitted_when_unset(*fields: str) -> Any:
    """A serializer that leaves `fields` out while they hold their default (None, False or []):
    smaller messages and histories for fields most messages do not use."""

    @model_serializer(mode="wrap")
    def serialize(self: BaseModel, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in fields:
                if data.get(name) in (None, False) or data.get(name) == []:
                    data.pop(name, None)
        return data

    return serialize


class AgentState(str, enum.Enum):
    """The six lifecycle states of an agent."""

    SPAWNING = "Spawning"
    REGISTERING = "Registering"
    READY = "Ready"
    BUSY = "Busy"
    DRAINING = "Draining"
    TERMINATED = "Terminated"

    def __str__(self) -> str:
        return self.value


ROUTABLE_STATES = frozenset({AgentState.READY, AgentState.BUSY})


class Capability(_Model):
    """A named, versioned contract an agent serves."""

    name: str = Field(description="Dotted capability name, e.g. rag.search")
    version: str = Field(description="Semantic version, e.g. 2.1.0")
    input_schema: dict[str, Any] = Field(default_factory=dict)
    output_schema: dict[str, Any] = Field(default_factory=dict)
    max_concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY_MAX, description="Tasks this agent runs at once for it")
    cost_class: CostClass = "B"

    _check_name = field_validator("name")(classmethod(lambda cls, value: check_capability_name(value)))
    _check_version = field_validator("version")(classmethod(lambda cls, value: check_semver(value)))

    @field_validator("input_schema", "output_schema")
    @classmethod
    def _check_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        size = json_size(value)
        if size > SCHEMA_MAX_BYTES:
            raise ValueError(f"the schema is {size} bytes as JSON, over the {SCHEMA_MAX_BYTES}-byte limit")
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from exc
        return value

    @property
    def key(self) -> str:
        """`name@version`, the form used in search attributes and logs."""
        return f"{self.name}@{self.version}"


def effective_total_concurrency(max_concurrency: int | None, capabilities: list[Any]) -> int:
    """An agent's cap on tasks at once across capabilities: the explicit one, else the largest capability's."""
    if max_concurrency is not None:
        return max_concurrency
    return max((c.max_concurrency for c in capabilities), default=1)


class AgentRegistration(_Model):
    """The join-time self-description of an agent."""

    agent_id: str = Field(description="Unique id, e.g. the pod name")
    deployment: str = Field(description="The Deployment (or local fleet entry) the agent belongs to")
    endpoint: str = Field(description="Base URL the invoke activity POSTs tasks to")
    capabilities: list[Capability]
    heartbeat_interval_s: float = Field(default=DEFAULT_HEARTBEAT_INTERVAL_S, ge=HEARTBEAT_MIN_S, le=HEARTBEAT_MAX_S)
    max_concurrency: int | None = Field(
        default=None,
        ge=1,
        le=MAX_CONCURRENCY_MAX,
        description="Tasks this agent runs at once across all its capabilities (default: the largest capability's)",
    )
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("agent_id", "deployment")
    @classmethod
    def _check_object_name(cls, value: str) -> str:
        if not isinstance(value, str) or not _OBJECT_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r} must be 1-253 letters, digits, '.', '_' or '-', starting and ending alphanumeric"
            )
        return value

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        if not isinstance(value, str) or len(value) > ENDPOINT_MAX or not _ENDPOINT.fullmatch(value):
            raise ValueError(f"{value!r} is not an http(s) URL of at most {ENDPOINT_MAX} characters (no query, no spaces)")
        return value.rstrip("/")

    @field_validator("capabilities")
    @classmethod
    def _check_capabilities(cls, value: list[Capability]) -> list[Capability]:
        if not value:
            raise ValueError("an agent must advertise at least one capability")
        if len(value) > MAX_CAPABILITIES_PER_AGENT:
            raise ValueError(f"{len(value)} capabilities: an agent may advertise at most {MAX_CAPABILITIES_PER_AGENT}")
        seen: set[str] = set()
        for cap in value:
            if cap.name in seen:
                raise ValueError(f"capability {cap.name!r} is listed more than once")
            seen.add(cap.name)
        return value

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(json.dumps(value, separators=(",", ":")).encode())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata must be JSON-serialisable: {exc}") from exc
        if size > METADATA_MAX_BYTES:
            raise ValueError(f"metadata is {size} bytes as JSON, over the {METADATA_MAX_BYTES}-byte limit")
        return value

    @model_validator(mode="after")
    def _check_size(self) -> AgentRegistration:
        size = json_size(self.model_dump(mode="json"))
        if size > REGISTRATION_MAX_BYTES:
            raise ValueError(
                f"the registration is {size} bytes as JSON, over the {REGISTRATION_MAX_BYTES}-byte limit "
                "(it travels in signals and is carried across continue-as-new): trim schemas or metadata"
            )
        return self

    def short_heartbeat_warning(self) -> str | None:
        """A warning when the interval is short enough for a GC pause to kill the agent."""
        if self.heartbeat_interval_s >= SHORT_HEARTBEAT_WARNING_S:
            return None
        return (
            f"agent {self.agent_id}: heartbeat_interval_s={self.heartbeat_interval_s:g} is under "
            f"{SHORT_HEARTBEAT_WARNING_S:g}s; a pause of {MISSED_HEARTBEATS * self.heartbeat_interval_s:g}s "
            "(GC, CPU starvation) would declare it dead"
        )

    @property
    def total_concurrency(self) -> int:
        """The agent-wide cap: `max_concurrency`, or the largest capability's when unset."""
        return effective_total_concurrency(self.max_concurrency, self.capabilities)

    def capability(self, name: str) -> Capability | None:
        """The advertised capability called `name`, if any."""
        return next((c for c in self.capabilities if c.name == name), None)

    @property
    def capability_keys(self) -> list[str]:
        return [c.key for c in self.capabilities]


class CapabilityRef(_Model):
    """What a plan pins: a capability name and a version range (see `agentroster.versions`).

    `rag.search@>=2,<3` and `rag.search@^2.0` match any 2.x release, but no
    pre-release unless the range names one; a bare `rag.search` matches all.
    """

    name: str
    specifier: str = ""

    _check_name = field_validator("name")(classmethod(lambda cls, value: check_capability_name(value)))

    @field_validator("specifier")
    @classmethod
    def _check_specifier(cls, value: str) -> str:
        parse_range(value)  # raises ValueError with the reason
        return value  # kept as written so str(ref) round-trips

    @classmethod
    def parse(cls, ref: str | CapabilityRef) -> CapabilityRef:
        """Parse `name@specifier` (or a bare name). Raises ValueError with the reason."""
        if isinstance(ref, CapabilityRef):
            return ref
        if not isinstance(ref, str) or not ref.strip():
            raise ValueError(f"capability ref {ref!r} must be a non-empty string like 'rag.search@>=2,<3'")
        name, _, spec = ref.strip().partition("@")
        return cls(name=name.strip(), specifier=spec.strip())

    def matches(self, version: str) -> bool:
        """Whether `version` lies in this ref's range."""
        return version_matches(self.specifier, version)

    def __str__(self) -> str:
        return f"{self.name}@{self.specifier}" if self.specifier else self.name


class Lease(_Model):
    """The right to send one task to one agent for one capability."""

    lease_id: str
    pool: str
    agent_id: str
    deployment: str
    capability: str
    version: str
    endpoint: str
    granted_at: datetime
    deadline: datetime
    holder: str | None = None


class Transition(_Model):
    """One lifecycle step of an agent, as appended to its transition list."""

    from_state: AgentState | None
    to_state: AgentState
    reason: str
    at: datetime


class AgentStatus(_Model):
    """What `AgentRoster.describe` reports about one agent: its workflow's `status` query,
    and the run's result once it has ended.

    `transitions` is the log the agent workflow keeps of how the agent came and went
    (never pushed out by load), carried across continue-as-new; Ready <-> Busy flips
    caused by load are counted apart.
    """

    agent_id: str
    pool: str
    state: AgentState
    in_flight: int = 0
    last_heartbeat: datetime | None = None
    registration: AgentRegistration | None = None
    transitions: list[Transition] = Field(
        default_factory=list, description="Lifecycle transitions, not load flips: the first few and the most recent"
    )
    transitions_dropped: int = Field(
        default=0, ge=0, description="Lifecycle transitions left out between the first few and the most recent"
    )
    terminated_reason: str | None = None
    busy_flips: int = Field(default=0, ge=0, description="How often load turned the agent Busy (Ready -> Busy)")
    last_busy_at: datetime | None = Field(default=None, description="When load last turned the agent Busy")
    recent_load_flips: list[Transition] = Field(
        default_factory=list, description="The most recent Ready <-> Busy flips caused by load, oldest first"
    )
    eviction_held: str | None = Field(
        default=None, description="Silent, but its pool holds back its termination (why); None when not held"
    )
    eviction_denials: int = Field(default=0, ge=0, description="How often its pool refused to let it be terminated")
    indexed_by_pool: bool = Field(default=False, description="Whether its pool has said it indexed the latest registration")


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

    _serialize = _omitted_when_unset("recover_only", "prefetch")


class PoolAcquireRequest(AcquireRequest):
    """An acquire made on a task workflow's behalf by the `lease_and_invoke` activity."""

    pool: str
    # Workflow code cannot make a secret (its randomness is seeded from the run id):
    # the activity derives one.
    request_id: str | None = Field(default=None, min_length=16, max_length=128)  # type: ignore[assignment]


class PoolReport(_Model):
    """Counts behind a PoolExhaustedError, as the pool saw them."""

    ref: str
    matching: int = 0
    busy: int = 0
    draining: int = 0
    routable: int = 0
    excluded: int = Field(default=0, description="Matching agents the caller asked not to get (failed before)")
    waiting: int = 0
    total_agents: int = 0
    active_leases: int = 0
    # HikariCP-style slot figures for the ref (routable, not excluded agents): a slot is
    # one more lease an agent could take, within its capability's and its own cap.
    slots: int = Field(default=0, ge=0, description="Slots of routable matching agents (in use or idle)")
    idle_slots: int = Field(default=0, ge=0, description="Of those, slots free right now")


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
BATCH_MAX = MAX_BATCH
# The largest argument of one signal or update (its JSON), far below the server's 2 MiB per
# payload: a refused update's reply carries its request again (the SDK echoes it), and no
# accepted message may make a reply or a history event too big.
MESSAGE_MAX_BYTES = 512 * 1024
LEASE_ID_MAX = 128
LeaseId = Annotated[str, Field(min_length=1, max_length=LEASE_ID_MAX)]


class AcquireBatch(_Model):
    """The pool's `acquire` update: acquires answered in order, after `releases` (lease ids) are
    returned, so a slot they free serves the queue (FIFO) before these acquires. A client's
    releases ride on its next acquire this way: one message instead of two."""

    requests: list[AcquireRequest] = Field(min_length=1, max_length=BATCH_MAX)
    releases: list[LeaseId] = Field(default_factory=list, max_length=BATCH_MAX)

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


class TicketStatus(_Model):
    ticket: str
    lease: Lease | None = None
    pending: bool = True
    report: PoolReport | None = None
    shutdown: str | None = Field(default=None, description="The place ended because the pool is shutting down: why")

    _serialize = _omitted_when_unset("shutdown")


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


# The reason every agent is drained with when its pool shuts down.
POOL_SHUTDOWN_REASON = "pool-shutdown"
SHUTDOWN_DEADLINE_MAX_S = 7 * 24 * 3600


class ShutdownRequest(_Model):
    """The pool's `shutdown` update: stop granting, let leases finish, drain, scale to zero, end."""

    deadline_s: float = Field(
        default=60.0, ge=0, le=SHUTDOWN_DEADLINE_MAX_S, description="How long in-flight leases may still run; then they are revoked"
    )
    reason: str = Field(default="shutdown requested", min_length=1, max_length=256, description="Why, shown to callers and in status")


ShutdownPhase = Literal["finishing-leases", "draining-agents", "done"]


class PoolShutdown(_Model):
    """Where a pool's shutdown stands (`PoolStatus.shutdown`)."""

    reason: str
    phase: ShutdownPhase
    requested_at: datetime
    deadline: datetime = Field(description="In-flight leases still held then are revoked")
    finished_at: datetime | None = None
    leases_at_start: int = Field(default=0, description="Leases in flight when the shutdown began")
    leases_revoked: int = Field(default=0, description="Of those, revoked at the deadline")
    waiters_ended: int = Field(default=0, description="Queued callers told the pool is shutting down")
    agents_drained: int = Field(default=0, description="Agent workflows told to drain (reason pool-shutdown)")
    agents_left: int = Field(default=0, description="Agent workflows the pool still waits for to end")
    deployments_scaled: list[str] = Field(default_factory=list, description="Deployments the backend scaled to zero")
    scale_failures: dict[str, str] = Field(default_factory=dict, description="Deployments the backend could not scale to zero: why")


class CapabilityStatus(_Model):
    """One capability name in a pool's status, every version together: what the metrics exporter reads.

    Slots count like `PoolReport`'s (HikariCP's figures): a slot is one more lease
    a routable agent could take for the name, within the capability's and the
    agent's own cap; an agent-wide cap shared by several names counts for each.
    """

    agents: dict[str, int] = Field(default_factory=dict, description="Lifecycle state -> agents offering the name, as the pool sees them")
    slots: int = Field(default=0, ge=0, description="Slots of routable agents offering it (in use or idle)")
    idle_slots: int = Field(default=0, ge=0, description="Of those, slots free right now")
    in_flight: int = Field(default=0, ge=0, description="Active leases on it")
    waiting: int = Field(default=0, ge=0, description="Callers queued for it")
    counters: dict[str, int] = Field(
        default_factory=dict,
        description="Monotonic counts for it (granted, released, expired, revoked, renewed, exhausted, queued), "
        "carried across continue-as-new",
    )
    free: list[str] = Field(
        default_factory=list,
        description="`agent_id@version` of every agent that could take a lease for it now, best first "
        "(cheapest cost class, then fewest in flight): what `AgentRoster.find` filters by a ref's range",
    )

    _serialize = _omitted_when_unset("free")


# The largest `status` reply a pool sends (JSON bytes): the server refuses any gRPC message
# over 2 MiB, and a query's answer is one. An agent row is 180-250 bytes: 6,000-8,000 rows fit.
STATUS_REPLY_MAX_BYTES = 1_500_000


def fit_status(status: PoolStatus, size: int, size_of: Callable[[PoolStatus], int], max_bytes: int = STATUS_REPLY_MAX_BYTES) -> PoolStatus:
    """`status` (encoded in `size` bytes) with agent rows left out, the last first, until `size_of` it is at most `max_bytes`."""
    fitted = status
    keep = len(status.agents)
    while size > max_bytes and keep > 0:
        keep = min(keep - 1, int(keep * max_bytes / size * 0.95))
        fitted = status.model_copy(update={"agents": status.agents[:max(keep, 0)], "agents_omitted": status.agents_omitted + len(status.agents) - max(keep, 0)})
        size = size_of(fitted)
    return fitted


class PoolStatus(_Model):
    """A snapshot of the pool for `status` tables and metrics."""

    pool: str
    agents: list[PoolAgentRow] = Field(default_factory=list)
    active_leases: int = 0
    waiting: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_revoked: int = 0
    leases_renewed: int = 0
    exhausted: int = 0
    agents_lost: int = Field(default=0, description="Agents that left the pool without draining (heartbeat lost, workflow gone)")
    agents_drained: int = Field(default=0, description="Agents that left the pool after draining")
    capabilities: dict[str, CapabilityStatus] = Field(
        default_factory=dict, description="Per capability name: agents by state, slots, leases, waiters, counters"
    )
    warnings: list[str] = Field(default_factory=list)
    policies: dict[str, PoolPolicy] = Field(default_factory=dict, description="Sizing policies by deployment")
    breakers: dict[str, str] = Field(default_factory=dict, description="Capability -> breaker state, where not closed")
    shutdown: PoolShutdown | None = Field(default=None, description="Set once a shutdown was asked for")
    recently_ended: list[EndedAgentRow] = Field(
        default_factory=list, description="The last agents that left the pool (Terminated), oldest first"
    )
    agents_omitted: int = Field(
        default=0,
        description=f"Agent rows left out so the reply stays under {STATUS_REPLY_MAX_BYTES:,} bytes "
        "(the server refuses messages over 2 MiB); every count above still covers them",
    )
    shard: int = Field(default=0, ge=0, description="This pool workflow's shard (shard 0's in a status added up over shards)")
    shards: int = Field(default=1, ge=1, description="How many shards the pool runs as")
    shard_by: str = Field(default="deployment", description="What places agents in shards: deployment or agent")
    runs: int = Field(default=0, ge=0, description="How many times this pool workflow has continued as new")
    refusals: list[str] = Field(default_factory=list, description="The last malformed messages the pool refused, with the reason")

    _serialize = _omitted_when_unset("shutdown", "recently_ended", "agents_omitted", "refusals")

    @property
    def agent_count(self) -> int:
        """Agents in the pool, listed or not."""
        return len(self.agents) + self.agents_omitted

    @property
    def shutting_down(self) -> bool:
        """A shutdown was asked for and the pool has not ended yet."""
        return self.shutdown is not None and self.shutdown.phase != "done"
    eviction: EvictionStatus = Field(
        default_factory=lambda: EvictionStatus(), description="Eviction safety: self-preservation, silent agents, counters"
    )


class PoolAgentRow(_Model):
    agent_id: str
    deployment: str
    state: AgentState
    in_flight: int
    capabilities: list[str]
    uses: int = Field(default=0, description="Leases granted on this agent")
    retiring: str | None = Field(default=None, description="Why the pool stopped routing to it (worn, unhealthy, recycled, scale-down)")
    health_failures: int = Field(default=0, description="Consecutive failed health checks")
    silent: bool = Field(default=False, description="Stopped heartbeating: unroutable until it recovers or is terminated")
    drain_reason: str | None = Field(default=None, description="Why it is draining, as the drain request said")

    _serialize = _omitted_when_unset("drain_reason")


class EndedAgentRow(_Model):
    """An agent that left the pool: what `status` keeps showing for a while."""

    agent_id: str
    deployment: str
    capabilities: list[str] = Field(default_factory=list)
    reason: str = Field(description="Why it ended: heartbeat_lost, drain, ... (as its workflow told the pool)")
    drain_reason: str | None = Field(default=None, description="The reason the drain request gave, if it was drained")
    ended_at: datetime


class ScaleRequest(_Model):
    """Ask the backend to set a deployment's replica count."""

    deployment: str
    replicas: int = Field(ge=0, le=REPLICAS_MAX)
    reason: str = ""
    at_least: bool = Field(default=False, description="Never lower the count: demand-driven scale-ups only add")
    shutdown: bool = Field(default=False, description="The pool is shutting down: zero, even below a backend's own minimum")

    _serialize = _omitted_when_unset("shutdown")


BreakerMode = Literal["fail_fast", "on_demand", "route_anyway"]
POLICY_DELAY_MAX_S = 24 * 3600


class PoolPolicy(_Model):
    """How the pool sizes, recycles and checks one deployment. Changed by `set_policy` (in the pool's history).

    Defaults follow the reference document and Kubernetes' HPA: scale up fast and
    coalesced, scale down only after load stayed low for 5 minutes. Size with
    min_replicas ~ average load x 1.2 and max_replicas ~ peak x 1.5.
    """

    min_replicas: int = Field(default=0, ge=0, le=REPLICAS_MAX, description="Never fewer (0: may scale to zero)")
    max_replicas: int = Field(default=10, ge=1, le=REPLICAS_MAX, description="Never more (a recycling surge may add one)")
    target_in_flight_per_agent: float = Field(
        default=2.0, gt=0, le=MAX_CONCURRENCY_MAX, description="The load each agent should carry (Ray Serve's target_ongoing_requests)"
    )
    upscale_delay_s: float = Field(default=5.0, ge=0, le=POLICY_DELAY_MAX_S, description="Demand must last this long: a burst makes one request")
    downscale_delay_s: float = Field(
        default=300.0, ge=0, le=POLICY_DELAY_MAX_S, description="Load must stay low this long (HPA's stabilisation window)"
    )
    max_uses: int | None = Field(default=None, ge=1, le=10**9, description="Leases an agent serves before it is replaced (none: never)")
    health_interval_s: float = Field(default=30.0, ge=1, le=POLICY_DELAY_MAX_S)
    unhealthy_after: int = Field(default=3, ge=1, le=100, description="Consecutive failed health checks that make an agent unhealthy")
    breaker_threshold: float = Field(default=0.5, gt=0, le=1, description="Share of a capability's agents unhealthy that opens its breaker")
    breaker_mode: BreakerMode = "on_demand"
    breaker_cooldown_s: float = Field(default=30.0, ge=1, le=POLICY_DELAY_MAX_S)

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is greater than max_replicas {self.max_replicas}")
        return self


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
    """The `set_policy` update's argument: a deployment's sizing policy (`policy` None removes
    it), or, with `eviction` and no deployment, the pool's eviction safety."""

    deployment: str | None = None
    policy: PoolPolicy | None = None
    eviction: EvictionPolicy | None = None

    @field_validator("deployment")
    @classmethod
    def _check_deployment(cls, value: str | None) -> str | None:
        return None if value is None else AgentRegistration._check_object_name(value)

    @model_validator(mode="after")
    def _one_policy(self) -> SetPolicy:
        if self.eviction is not None and (self.deployment is not None or self.policy is not None):
            raise ValueError("give `eviction` alone, or a `deployment` with its `policy`, not both")
        if self.eviction is None and self.deployment is None:
            raise ValueError("give a `deployment` (with its `policy`, or none to remove it), or `eviction`")
        return self


class TaskRoute(_Model):
    """Where one task type goes: a pool and a capability ref in it."""

    pool: str = Field(description="The pool that serves the task type (pools never share agents)")
    ref: str = Field(max_length=REF_MAX, description="The capability ref to lease there, e.g. text.summarize@^2.1")

    _check_pool = field_validator("pool")(classmethod(lambda cls, value: check_pool_name(value)))

    @field_validator("ref")
    @classmethod
    def _check_ref(cls, value: str) -> str:
        return str(CapabilityRef.parse(value))  # `name@range`, spaces around it dropped


TaskType = Annotated[str, AfterValidator(check_task_type)]


class RoutingTable(_Model):
    """Task types to (pool, capability ref): data, from a file or built in code.

    `RoutingTable(routes={"summarize": TaskRoute(pool="prod", ref="text.summarize@^2")})`,
    or `agentroster.router.load_routing_table(path)` for a TOML or JSON file. It is
    small and plain, so it can travel in a `TaskInput` and be resolved inside a workflow.
    """

    routes: dict[TaskType, TaskRoute] = Field(description="Task type -> where it goes")

    @field_validator("routes")
    @classmethod
    def _check_routes(cls, value: dict[str, TaskRoute]) -> dict[str, TaskRoute]:
        if not value:
            raise ValueError("a routing table needs at least one route")
        if len(value) > ROUTES_MAX:
            raise ValueError(f"{len(value)} routes: a routing table holds at most {ROUTES_MAX}")
        return value

    @property
    def task_types(self) -> list[str]:
        """The task types this table routes, sorted."""
        return sorted(self.routes)

    @property
    def pools(self) -> list[str]:
        """The pools its routes lead to, sorted."""
        return sorted({route.pool for route in self.routes.values()})

    def resolve(self, task_type: str) -> TaskRoute:
        """The route of `task_type`; raises UnknownTaskTypeError (listing the known types) otherwise."""
        route = self.routes.get(task_type) if isinstance(task_type, str) else None
        if route is None:
            raise UnknownTaskTypeError(task_type, self.task_types)
        return route

    def only(self, *task_types: str) -> RoutingTable:
        """A table with just these task types' routes (to carry in a child's input); unknown ones raise."""
        return RoutingTable(routes={t: self.resolve(t) for t in task_types})


class TaskInput(_Model):
    """Input of the supervisor child workflow `CapabilityTaskWorkflow`.

    Either `ref` (with `pool`), or `task_type` with a `routing_table` that routes
    it: the workflow resolves the type from the table it was given (never from a
    file), so the route is in its input and replays the same. With `task_type`,
    the route's pool is used and `pool` is ignored.
    """

    ref: str | None = Field(default=None, max_length=REF_MAX)
    payload: Any = None
    pool: str = "default"
    acquire_timeout_s: float = Field(default=30.0, ge=0, le=WAIT_MAX_S)
    task_timeout_s: float = Field(default=60.0, gt=0, le=TASK_TIMEOUT_MAX_S)
    lease_ttl_s: float = Field(
        default=60.0, ge=3, le=24 * 3600, description="The lease is renewed every third of this while the task runs"
    )
    max_attempts: int = Field(default=3, ge=1, le=20)
    task_type: str | None = Field(default=None, description="Instead of `ref`: a task type `routing_table` routes")
    routing_table: RoutingTable | None = Field(default=None, description="Where task types go; needed with `task_type`")
    @field_validator("ref")
    @classmethod
    def _check_ref(cls, value: str | None) -> str | None:
        if value is not None:
            CapabilityRef.parse(value)
        return value

    _check_pool = field_validator("pool")(classmethod(lambda cls, value: check_pool_name(value)))

    @field_validator("task_type")
    @classmethod
    def _check_task_type(cls, value: str | None) -> str | None:
        return None if value is None else check_task_type(value)

    @model_validator(mode="after")
    def _ref_or_task_type(self) -> TaskInput:
        # Whether the table knows the type is the workflow's to say (a clear,
        # non-retryable failure), not the decoder's: a refusal here would leave
        # the workflow retrying its first task forever.
        if self.ref is None and self.task_type is None:
            raise ValueError("give a capability `ref` (e.g. rag.search@>=2,<3) or a `task_type` with a `routing_table`")
        if self.ref is not None and self.task_type is not None:
            raise ValueError(f"give `ref` or `task_type`, not both (ref={self.ref!r}, task_type={self.task_type!r})")
        if self.task_type is not None and self.routing_table is None:
            raise ValueError(f"task_type {self.task_type!r} needs a `routing_table` to resolve it")
        return self

    def routed(self) -> TaskInput:
        """This input with `ref` and `pool` set from the routing table (itself when it has a ref).

        Raises UnknownTaskTypeError when the table does not route `task_type`.
        """
        if self.task_type is None:
            return self
        assert self.routing_table is not None  # the validator saw to it
        route = self.routing_table.resolve(self.task_type)
        return self.model_copy(update={"ref": route.ref, "pool": route.pool, "task_type": None, "routing_table": None})

    @field_validator("payload")
    @classmethod
    def _check_payload(cls, value: Any) -> Any:
        size = json_size(value)
        if size > TASK_PAYLOAD_MAX_BYTES:
            raise ValueError(f"the payload is {size} bytes as JSON, over the {TASK_PAYLOAD_MAX_BYTES}-byte limit")
        return value


class TaskResult(_Model):
    ref: str
    agent_id: str
    capability: str
    version: str
    output: Any = None
    attempts: int = 1
    pool: str | None = Field(default=None, description="The pool the task ran in")
    task_type: str | None = Field(default=None, description="The task type it was routed by, if any")


class InvokeRequest(_Model):
    """What the invoke activity POSTs to `{endpoint}/tasks/{capability}`."""

    lease_id: str
    capability: str
    version: str
    input: Any = None


POD_GONE_REASONS = ("process_exited", "pod_deleted", "pod_failed", "container_crashloop")
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

    The pool applies this, never the `agent_snapshot` signal that made it look
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
    """Input of `recover_lease`: the pool and ref of a `lease_and_invoke` request, and its key."""

    pool: str
    ref: str = Field(max_length=REF_MAX)
    key: str = Field(min_length=1, max_length=64)


# --------------------------------------------------------------------------
# Eviction safety: an agent that stopped heartbeating asks its pool before it
# is terminated; the pool holds mass terminations back (self-preservation).
# --------------------------------------------------------------------------
HEARTBEAT_WINDOW_MAX_S = 3 * 3600.0  # MISSED_HEARTBEATS x the longest heartbeat_interval_s
CONFIRM_MAX_AGENTS = 256


class EvictionPolicy(_Model):
    """How a pool guards against mass terminations. Changed by the `set_policy` update (in the pool's history).

    Eureka's self-preservation (stop evicting when too many instances go quiet
    at once) with etcd's cap on lease revocations per interval.
    """

    enabled: bool = Field(default=True, description="Off: every silent agent is terminated at once, as before")
    threshold: float = Field(
        default=0.5, gt=0, le=1, description="Self-preservation when more than this share of the pool's agents went silent"
    )
    cap_fraction: float = Field(
        default=0.1, gt=0, le=1, description="Terminations allowed per heartbeat window: max(1, this share of the agents)"
    )


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


class EvictionRecord(_Model):
    agent_id: str
    at: datetime
    confirmed: bool = Field(default=False, description="Confirmed by an operator: outside the cap")


class EvictionStatus(_Model):
    """Eviction safety in a pool's status: what a metrics exporter reads."""

    policy: EvictionPolicy = Field(default_factory=EvictionPolicy)
    self_preservation: bool = False
    since: datetime | None = Field(default=None, description="When self-preservation last came on")
    warning: str | None = Field(default=None, description="Why terminations are held, while self-preservation is on")
    silent: list[str] = Field(default_factory=list, description="Agents that stopped heartbeating and are held (unroutable)")
    confirmed: list[str] = Field(default_factory=list, description="Silent agents an operator confirmed: terminated when they ask")
    recent: list[EvictionRecord] = Field(default_factory=list, description="The most recent terminations allowed")
    evictions_allowed: int = 0
    evictions_denied: int = Field(default=0, description="Refusals (one per request of a held agent)")
    evictions_confirmed: int = 0
    self_preservation_activations: int = 0


AgentSnapshot.model_rebuild()
PoolNotification.model_rebuild()
PoolStatus.model_rebuild()


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class AgentRosterError(Exception):
    """Base class of agentroster's own errors."""


class PoolExhaustedError(AgentRosterError):
    """No agent could serve a capability ref within the caller's timeout."""

    def __init__(self, ref: str, *, waited_s: float, report: PoolReport | None = None, pool: str = "") -> None:
        self.ref = ref
        self.waited_s = waited_s
        self.report = report or PoolReport(ref=ref)
        self.pool = pool
        r = self.report
        super().__init__(
            f"no agent free for {ref!r} in pool {pool!r} after waiting {waited_s:.2f}s: "
            f"{r.matching} agent(s) match, {r.busy} busy, {r.draining} draining, "
            f"{r.routable} routable"
            + (f", {r.excluded} excluded by the caller" if r.excluded else "")
            + f"; {r.waiting} waiter(s) queued, "
            f"{r.active_leases} active lease(s), {r.total_agents} agent(s) in the pool"
            # HikariCP's figures, counted in slots of the agents that could serve the ref.
            f" (slots for it: total={r.slots}, active={r.slots - r.idle_slots}, idle={r.idle_slots}, waiting={r.waiting})"
        )

    @property
    def matching(self) -> int:
        return self.report.matching

    @property
    def busy(self) -> int:
        return self.report.busy

    @property
    def draining(self) -> int:
        return self.report.draining

    @property
    def waiting(self) -> int:
        """Callers queued in the pool when it gave up."""
        return self.report.waiting

    @property
    def total_slots(self) -> int:
        """Slots of the routable agents that match the ref (HikariCP's `total`)."""
        return self.report.slots

    @property
    def idle_slots(self) -> int:
        """Of those, slots free when the pool answered (HikariCP's `idle`)."""
        return self.report.idle_slots

    @property
    def active_slots(self) -> int:
        """Of those, slots held by leases (HikariCP's `active`)."""
        return self.report.slots - self.report.idle_slots


class CapabilityUnknownError(PoolExhaustedError):
    """No agent in the pool has ever offered the capability (and no known deployment serves it).

    Raised at once instead of after the timeout: waiting cannot help. A subclass
    of PoolExhaustedError, so handlers of that still catch it.
    """

    def __init__(self, ref: str, *, pool: str = "", report: PoolReport | None = None) -> None:
        super().__init__(ref, waited_s=0.0, report=report, pool=pool)
        name = ref.partition("@")[0].strip()
        self.args = (
            f"no agent in pool {pool!r} has ever offered {name!r} (asked for {ref!r}): check the capability name "
            "and the pool, or register an agent that serves it",
        )


class CircuitOpenError(PoolExhaustedError):
    """The capability's circuit breaker is open in `fail_fast` mode: most of its agents are unhealthy.

    Raised at once. A subclass of PoolExhaustedError, so handlers of that still catch it.
    """

    def __init__(self, ref: str, reason: str, *, pool: str = "", report: PoolReport | None = None) -> None:
        super().__init__(ref, waited_s=0.0, report=report, pool=pool)
        self.reason = reason
        self.args = (f"circuit open for {ref!r} in pool {pool!r}: {reason}",)


class UnknownTaskTypeError(AgentRosterError):
    """The routing table has no route for a task type. Raised at once, before any network call."""

    KNOWN_SHOWN = 20

    def __init__(self, task_type: str, known: list[str]) -> None:
        self.task_type = task_type
        self.known = sorted(known)
        shown = ", ".join(repr(t) for t in self.known[: self.KNOWN_SHOWN])
        if len(self.known) > self.KNOWN_SHOWN:
            shown += f" and {len(self.known) - self.KNOWN_SHOWN} more"
        close = difflib.get_close_matches(str(task_type), self.known, n=1) if isinstance(task_type, str) else []
        super().__init__(
            f"unknown task type {task_type!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f": the routing table knows {shown or 'no task types'}"
        )


class MessageTooLargeError(AgentRosterError, ValueError):
    """An argument too big for one message to a workflow: refused before it is sent."""

    def __init__(self, message: str, size: int, limit: int = MESSAGE_MAX_BYTES) -> None:
        self.message, self.size, self.limit = message, size, limit
        super().__init__(
            f"{message}: the argument is {size:,} bytes encoded, over the {limit:,}-byte limit of one message; send fewer items at once"
        )


class LeaseLostError(AgentRosterError):
    """The lease has ended (released, expired or revoked): its slot may be someone else's."""


class PoolShutdownError(AgentRosterError):
    """The pool is shutting down, or has shut down: it grants no new leases.

    Raised at once (never retried): waiting cannot help. `finished` tells the two
    apart; `status` is the pool's final status when it is known.
    """

    def __init__(self, pool: str, reason: str = "", *, finished: bool = False, status: PoolStatus | None = None) -> None:
        self.pool = pool
        self.reason = reason
        self.finished = finished
        self.status = status
        why = f": {reason}" if reason else ""
        if finished:
            text = (
                f"pool {pool!r} has shut down{why}; it grants no leases. Start it again with "
                "`agentroster worker --restart-pool` or `roster.ensure_pool(restart=True)`"
            )
        else:
            text = f"pool {pool!r} is shutting down{why}; it grants no new leases"
        super().__init__(text)


class AgentNotFoundError(AgentRosterError):
    """The agent has no workflow (never registered, or its run ended)."""


# ---------------------------------------------------------------- tasks sent to agents
# Raised by `AgentRoster.invoke` (code outside workflows); the invoke activity turns the
# same errors into ApplicationErrors of the types in `agentroster.wire` (see
# `agentroster.invoke`), so both follow one set of rules.


class TaskError(AgentRosterError):
    """A task sent to an agent did not give a checked output. `agent_id` is the agent that was tried."""

    def __init__(self, message: str, *, agent_id: str | None = None, capability: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.agent_id = agent_id
        self.capability = capability
        self.status = status  # the agent's HTTP status, when it answered


class InvalidTaskInputError(TaskError):
    """The payload breaks the capability's input_schema, or the agent refused it (400/422): no other agent is tried."""


class InvalidAgentOutputError(TaskError):
    """The agent's answer is not JSON or breaks the capability's output_schema (another agent is tried)."""


class AgentUnreachableError(TaskError):
    """The agent could not be reached (connection refused, reset, timed out), or no longer offers the capability."""


class AgentTaskFailedError(TaskError):
    """The agent answered with a failure: 5xx, 404, 409 or 401 (lease token refused), 429, 503 (another agent is tried)."""


class LeaseKeyMissingError(AgentRosterError):
    """No lease key is configured (AGENTROSTER_LEASE_KEY): lease tokens can be neither signed nor checked."""


class TaskFailedError(TaskError):
    """No agent completed the task in the attempts allowed. `failures` holds each attempt's error, in order."""

    def __init__(self, ref: str, failures: list[TaskError], *, note: str = "") -> None:
        self.ref = ref
        self.failures = list(failures)
        lines = "; ".join(f"attempt {i} on {f.agent_id}: {f}" for i, f in enumerate(self.failures, 1))
        last = self.failures[-1] if self.failures else None
        super().__init__(
            f"{ref}: no agent completed the task in {len(self.failures)} attempt(s): {lines}{note}",
            agent_id=last.agent_id if last else None,
            capability=last.capability if last else None,
            status=last.status if last else None,
        )
