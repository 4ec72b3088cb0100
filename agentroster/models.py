"""The public data of agentroster: the pydantic v2 models users build or receive, and
the bounds they are checked against.

A malformed model is rejected here, with the field and the reason, before it can
reach any state.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from datetime import datetime
from collections.abc import Callable
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import AfterValidator, BaseModel, Field, field_validator, model_serializer, model_validator

from agentroster.vocabulary.versions import matches as version_matches
from agentroster.vocabulary.versions import parse_range
from agentroster.vocabulary.versions import parse_semver as parse_semver
from agentroster.errors import PoolReport, UnknownTaskTypeError, _Model


logger = logging.getLogger("agentroster")

CostClass = Literal["A", "B", "C"]
COST_RANK: dict[str, int] = {"A": 0, "B": 1, "C": 2}

METADATA_MAX_BYTES = 16 * 1024
SHORT_HEARTBEAT_WARNING_S = 5.0
# Heartbeats only have to catch hangs and partitions: a process that exits or a pod
# that is deleted is reported at once by the backend (`pod_gone`), so the default
# is slow (a window of 3 x 240 s = 12 min for a hung agent) and cheap (15 signals
# and about 6 liveness timers per agent-hour, under 30 actions with the resync).
# Set 10 for a 30 s window when no backend watches the agents.
DEFAULT_HEARTBEAT_INTERVAL_S = 240.0
MISSED_HEARTBEATS = 3

_CAPABILITY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")
# Kubernetes object names (pods, deployments) are DNS-1123 subdomains; we also
# accept underscores and capitals so local agents can use friendly ids.
_OBJECT_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
# scheme://host[:port][/path], no whitespace or control characters anywhere.
_ENDPOINT = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?")

# Bounds users can read in docs/limits.md: every duration and count has one, so no
# message can push a workflow past what it can represent (dates, payload sizes).
HEARTBEAT_MIN_S, HEARTBEAT_MAX_S = 1.0, 3600.0
MAX_CAPABILITIES_PER_AGENT = 64
CAPABILITY_NAME_MAX = 128
VERSION_MAX = 64
ENDPOINT_MAX = 512
MAX_CONCURRENCY_MAX = 10_000
WAIT_MAX_S = 24 * 3600
SCHEMA_MAX_BYTES = 64 * 1024
REGISTRATION_MAX_BYTES = 256 * 1024
REF_MAX = 256
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
    """What a plan pins: a capability name and a version range (see `agentroster.vocabulary.versions`).

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
    ejected: str | None = Field(
        default=None, description="Out of its pool's routing for its tasks' outcomes (as the pool's status says): why"
    )
    ejected_until: datetime | None = Field(default=None, description="When that ejection ends (a trial task follows)")

    _serialize = _omitted_when_unset("ejected", "ejected_until")


class TicketStatus(_Model):
    ticket: str
    lease: Lease | None = None
    pending: bool = True
    report: PoolReport | None = None
    shutdown: str | None = Field(default=None, description="The place ended because the pool is shutting down: why")
    unknown_capability: bool = Field(
        default=False, description="The place ended because the fleet the pool relearnt offers no such capability"
    )

    _serialize = _omitted_when_unset("shutdown", "unknown_capability")


# The reason every agent is drained with when its pool shuts down.
POOL_SHUTDOWN_REASON = "pool-shutdown"


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
    agents_drained: int = Field(default=0, description="Agent workflows told to drain (reason pool-shutdown), each counted once")
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
    relearning: bool = Field(
        default=False, description="The run started without state and is still reading the agent workflows it found running"
    )

    _serialize = _omitted_when_unset("shutdown", "recently_ended", "agents_omitted", "refusals", "relearning")

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
    ejected: str | None = Field(
        default=None, description="Out of routing for its tasks' outcomes (alive, not replaced): why; `probing` once a trial task decides"
    )
    ejected_until: datetime | None = Field(default=None, description="When its ejection ends and a trial task is routed to it")
    consecutive_failures: int = Field(default=0, description="Its tasks that failed in a row")

    # Most rows hold the defaults here: left out, a 10,000-agent status is a quarter smaller.
    _serialize = _omitted_when_unset(
        "uses", "retiring", "health_failures", "silent", "drain_reason", "ejected", "ejected_until", "consecutive_failures"
    )


class EndedAgentRow(_Model):
    """An agent that left the pool: what `status` keeps showing for a while."""

    agent_id: str
    deployment: str
    capabilities: list[str] = Field(default_factory=list)
    reason: str = Field(description="Why it ended: heartbeat_lost, drain, ... (as its workflow told the pool)")
    drain_reason: str | None = Field(default=None, description="The reason the drain request gave, if it was drained")
    ended_at: datetime


BreakerMode = Literal["fail_fast", "on_demand", "route_anyway"]
POLICY_DELAY_MAX_S = 24 * 3600


class OutlierPolicy(_Model):
    """When the pool ejects an agent from routing for what its tasks' outcomes say (Envoy's outlier
    detection). Every deployment has it: its `PoolPolicy`'s, or these defaults. docs/concepts/outliers.md
    gives the reasoning behind each default."""

    enabled: bool = True
    consecutive_failures: int = Field(
        default=3, ge=1, le=1000, description="Failed tasks in a row (a timeout counts) that eject an agent"
    )
    base_ejection_s: float = Field(
        default=30.0, ge=1, le=POLICY_DELAY_MAX_S, description="First ejection's length; the n-th lasts n times this"
    )
    max_ejection_s: float = Field(default=300.0, ge=1, le=POLICY_DELAY_MAX_S, description="No ejection lasts longer")
    max_ejection_percent: float = Field(
        default=50.0, ge=0, le=100, description="Most of a capability's agents ejected at once (at least one, of two or more)"
    )
    success_rate_min_volume: int = Field(
        default=20, ge=1, le=100_000, description="Outcomes an agent (and each peer counted) needs before its rate is judged"
    )
    success_rate_min_peers: int = Field(default=2, ge=1, le=10_000, description="Peers with enough volume to compare with")
    success_rate_gap: float = Field(
        default=0.3, gt=0, le=1, description="Ejected when its success rate is this far below its peers' mean (or 1.9 stdev, if more)"
    )

    @model_validator(mode="after")
    def _check_ejection_times(self) -> OutlierPolicy:
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError(f"max_ejection_s {self.max_ejection_s:g} is less than base_ejection_s {self.base_ejection_s:g}")
        return self


class PoolPolicy(_Model):
    """How the pool sizes, recycles and checks one deployment. Changed by `set_policy` (in the pool's history).

    A policy sizes its deployment when it gives `max_replicas`; without it the policy
    sizes nothing (the deployment keeps the demand-driven scale-ups) and carries only
    its health checks, breaker and outlier settings. A deployment without a policy
    has `PoolPolicy()`'s settings.

    Sizing defaults follow the reference document and Kubernetes' HPA: scale up fast
    and coalesced, scale down only after load stayed low for 5 minutes. Size with
    min_replicas ~ average load x 1.2 and max_replicas ~ peak x 1.5.
    """

    min_replicas: int = Field(default=0, ge=0, le=REPLICAS_MAX, description="Never fewer (0: may scale to zero); needs max_replicas")
    max_replicas: int | None = Field(
        default=None, ge=1, le=REPLICAS_MAX,
        description="Never more (a recycling surge may add one); none: the policy sizes nothing",
    )
    target_in_flight_per_agent: float = Field(
        default=2.0, gt=0, le=MAX_CONCURRENCY_MAX, description="The load each agent should carry (Ray Serve's target_ongoing_requests)"
    )
    upscale_delay_s: float = Field(default=5.0, ge=0, le=POLICY_DELAY_MAX_S, description="Demand must last this long: a burst makes one request")
    downscale_delay_s: float = Field(
        default=300.0, ge=0, le=POLICY_DELAY_MAX_S, description="Load must stay low this long (HPA's stabilisation window)"
    )
    max_uses: int | None = Field(default=None, ge=1, le=10**9, description="Leases an agent serves before it is replaced (none: never)")
    health_interval_s: float = Field(default=300.0, ge=1, le=POLICY_DELAY_MAX_S, description="How often idle agents' /healthz is called")
    unhealthy_after: int = Field(default=3, ge=1, le=100, description="Consecutive failed health checks that make an agent unhealthy")
    breaker_threshold: float = Field(default=0.5, gt=0, le=1, description="Share of a capability's agents unhealthy that opens its breaker")
    breaker_mode: BreakerMode = "on_demand"
    breaker_cooldown_s: float = Field(default=30.0, ge=1, le=POLICY_DELAY_MAX_S)
    outliers: OutlierPolicy = Field(default_factory=lambda: OutlierPolicy(), description="Outlier ejection of its agents")

    @property
    def sizes(self) -> bool:
        """Whether the policy sizes its deployment (it gives max_replicas)."""
        return self.max_replicas is not None

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolPolicy:
        if self.max_replicas is None:
            # The sizing fields act only with a size: one set without max_replicas is a mistake, not a no-op.
            sizing = [name for name in _SIZING_FIELDS if getattr(self, name) != PoolPolicy.model_fields[name].default]
            if sizing:
                raise ValueError(f"{', '.join(sizing)}: sizing needs max_replicas (a policy without it sizes nothing)")
        elif self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is greater than max_replicas {self.max_replicas}")
        return self


# The fields that size a deployment: they act only in a policy with max_replicas.
_SIZING_FIELDS = ("min_replicas", "target_in_flight_per_agent", "upscale_delay_s", "downscale_delay_s", "max_uses")


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
    or `agentroster.client.router.load_routing_table(path)` for a TOML or JSON file. It is
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
    max_cost_class: CostClass | None = Field(
        default=None, description="The dearest cost class the task accepts: never a silent spill to a dearer agent"
    )
    task_type: str | None = Field(default=None, description="Instead of `ref`: a task type `routing_table` routes")
    routing_table: RoutingTable | None = Field(default=None, description="Where task types go; needed with `task_type`")
    record_agents_served: bool = Field(
        default=False,
        description="Name each agent an attempt ran on in the AgentsServed search attribute, so "
        "`temporal workflow list --query \"AgentsServed='a1'\"` finds the task: one upsert, a billed action, per agent",
    )

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


class AttemptFailure(_Model):
    """One attempt of a task that failed over: on which agent, and why."""

    attempt: int = Field(ge=1)
    agent_id: str | None = Field(default=None, description="None when the attempt failed before it had an agent")
    error: str


class TaskResult(_Model):
    ref: str
    agent_id: str
    capability: str
    version: str
    output: Any = None
    attempts: int = 1
    pool: str | None = Field(default=None, description="The pool the task ran in")
    task_type: str | None = Field(default=None, description="The task type it was routed by, if any")
    failures: list[AttemptFailure] = Field(default_factory=list, description="The attempts before the one that served it")

    _serialize = _omitted_when_unset("failures")


POD_GONE_REASONS = ("process_exited", "pod_deleted", "pod_failed", "container_crashloop")


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
PoolStatus.model_rebuild()
