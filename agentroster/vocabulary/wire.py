"""The shared vocabulary of the wire: workflow ids, search attributes, workflow
inputs, error type names, activity names and retry policies.

Workflows, activities, the client and the workers all import from here, so no
room reaches into another for a name. It sits under the core: it imports only
`temporalio.common`, pydantic and the shard layout (`agentroster.vocabulary.shards`),
so it is safe inside the workflow sandbox.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field
from temporalio.common import Priority, RetryPolicy, SearchAttributeKey

from agentroster.vocabulary.shards import DEFAULT_SHARD_KEY, MAX_SHARDS, SHARD_KEYS, ShardLayout, shard_suffix

# ---------------------------------------------------------------- search attributes
AGENT_STATE = SearchAttributeKey.for_keyword("AgentState")
AGENT_CAPABILITIES = SearchAttributeKey.for_keyword_list("AgentCapabilities")
AGENT_DEPLOYMENT = SearchAttributeKey.for_keyword("AgentDeployment")
AGENT_POOL = SearchAttributeKey.for_keyword("AgentPool")
# Why an agent ended (heartbeat_lost, drain, ...): a dead agent and a drained one both
# complete, and this is what `temporal workflow list --query` filters them by.
AGENT_END_REASON = SearchAttributeKey.for_keyword("AgentEndReason")
# The agents a CapabilityTaskWorkflow's attempts ran on (the one that served it and those it
# failed over from), for a task whose input asks for it (`record_agents_served`):
# `temporal workflow list --query "AgentsServed='a1'"` finds every such task an agent touched.
AGENTS_SERVED = SearchAttributeKey.for_keyword_list("AgentsServed")
SEARCH_ATTRIBUTES = (AGENT_STATE, AGENT_CAPABILITIES, AGENT_DEPLOYMENT, AGENT_POOL, AGENT_END_REASON, AGENTS_SERVED)

# The server terminates a workflow whose keyword-list search attribute is over
# 2,048 bytes; keep well under it whatever the registration holds.
CAPABILITY_ATTRIBUTE_MAX_BYTES = 1800


def capability_search_values(capabilities: list[tuple[str, str]]) -> list[str]:
    """`AgentCapabilities` values: every bare name (to filter across versions), then
    `name@version`, as many as fit in CAPABILITY_ATTRIBUTE_MAX_BYTES (as a JSON list)."""
    names = sorted({name for name, _ in capabilities})
    keyed = sorted({f"{name}@{version}" for name, version in capabilities})
    values: list[str] = []
    size = 2  # the brackets of the JSON list
    for value in (*names, *keyed):
        cost = len(value.encode()) + 3  # quotes and a comma
        if size + cost > CAPABILITY_ATTRIBUTE_MAX_BYTES:
            break
        values.append(value)
        size += cost
    return values


def agent_search_attributes(pool: str, state: str, registration: Any | None) -> list[tuple[SearchAttributeKey[Any], Any]]:
    """An agent workflow's search attributes (but AgentEndReason) in `state`: what it upserts, and what
    `register` starts it with (so the workflow's first task has nothing to upsert)."""
    pairs: list[tuple[SearchAttributeKey[Any], Any]] = [(AGENT_STATE, state), (AGENT_POOL, pool)]
    if registration is not None:
        caps = capability_search_values([(c.name, c.version) for c in registration.capabilities])
        pairs += [(AGENT_CAPABILITIES, caps), (AGENT_DEPLOYMENT, registration.deployment)]
    return pairs

# ---------------------------------------------------------------- workflow ids
AGENT_WORKFLOW_PREFIX = "agent/"
POOL_WORKFLOW_PREFIX = "pool/"


def agent_workflow_id(pool: str, agent_id: str) -> str:
    """`agent/{pool}/{agent_id}`: an agent's identity is per pool (pools never share agents)."""
    return f"{AGENT_WORKFLOW_PREFIX}{pool}/{agent_id}"


def pool_workflow_id(pool: str, shard: int = 0) -> str:
    """`pool/{pool}` (an unsharded pool, or shard 0 of a sharded one); `pool/{pool}/shard-{k}` for shard k > 0."""
    return f"{POOL_WORKFLOW_PREFIX}{pool}{shard_suffix(shard)}"


# ---------------------------------------------------------------- workflow task timeouts
# A workflow task in flight on a worker that dies is given to another worker only
# when this timeout passes (the server's default is 10 s): it bounds how long a pool
# stays unanswered after a worker is killed (`benchmarks/chaos.py` measures
# recovery). A task must also fit a full replay of the run's history (a worker
# that lost its cache): pool runs are kept short for that (PoolInput). Agent
# workflows keep the server's default: their runs are long and nobody waits on them.
# Benchmarks (b) and (f) and the saturation test with both cores kept busy count
# the pool's timed-out tasks at 2 s: none.
WORKFLOW_TASK_TIMEOUT = timedelta(seconds=2)
# A big pool's first task after continue-as-new rebuilds its index from the carried
# state (~0.7 s for 10,000 agents with 10,000 leases here); its runs get more time,
# so a loaded machine does not time the rebuild out again and again.
POOL_TASK_TIMEOUT_MAX = timedelta(seconds=10)
AGENTS_PER_EXTRA_TASK_SECOND = 2_000


# Pool workflows (and the activities they start, which inherit it) go ahead of agent
# and task workflows on a shared task queue (Temporal's task queue priority: 1 is the
# highest, the default is 3): while a fleet registers or a burst of tasks starts, the
# worker's backlog is mostly agent workflows' tasks, and callers wait on the pool's.
# A continue-as-new keeps it.
POOL_PRIORITY = Priority(priority_key=1)


def pool_task_timeout(agents: int, leases: int) -> timedelta:
    """The workflow task timeout for a pool run that starts with `agents` agents and `leases` leases."""
    extra = (agents + leases) // (2 * AGENTS_PER_EXTRA_TASK_SECOND)
    return min(WORKFLOW_TASK_TIMEOUT + timedelta(seconds=extra), POOL_TASK_TIMEOUT_MAX)


# A workflow's next task, or a query, waits this long on the sticky queue of the
# worker that last ran it before the server hands it to the normal queue (the
# workers' `sticky_queue_schedule_to_start_timeout`; the SDK's default is 10 s):
# recovery after a worker dies is bounded by it.
STICKY_TIMEOUT = timedelta(seconds=2)
# Every query our code sends gives up (its gRPC deadline) before STICKY_TIMEOUT and
# is asked again: a query that outlives the sticky wait reaches another worker with
# events no workflow task has handled yet (temporalio/sdk-python#1591; see
# `transport.query_workflow`, tests/test_query_rule.py).
QUERY_RPC_TIMEOUT = timedelta(seconds=1.5)


# ---------------------------------------------------------------- error types
# ApplicationError types that cross from workflows and activities to callers;
# callers tell failures apart by these strings, so each is defined once.
CONTINUING_AS_NEW = "PoolContinuingAsNew"
AGENT_UNREACHABLE = "AgentUnreachable"
AGENT_FAILED = "AgentTaskFailed"
INVALID_TASK_INPUT = "InvalidTaskInput"
INVALID_AGENT_OUTPUT = "InvalidAgentOutput"
POOL_EXHAUSTED = "PoolExhaustedError"
CAPABILITY_UNKNOWN = "CapabilityUnknownError"
SCALE_UP_REFUSED = "ScaleUpRefused"
CIRCUIT_OPEN = "CircuitOpenError"
CAPABILITY_TASK_FAILED = "CapabilityTaskFailed"
UNKNOWN_TASK_TYPE = "UnknownTaskTypeError"
# The pool is shutting down (or has): an acquire refused, a queued place ended.
POOL_SHUT_DOWN = "PoolShutdownError"
KUBERNETES_REJECTED = "KubernetesRequestRejected"
KUBERNETES_UNAVAILABLE = "KubernetesUnavailable"
FAILOVER_ERRORS = frozenset({AGENT_UNREACHABLE, AGENT_FAILED, INVALID_AGENT_OUTPUT})
# The pool ended a lease while its task ran (revoked: its agent was declared gone; or
# expired): `lease_and_invoke` learns it when it renews, and the task fails over.
LEASE_LOST = "LeaseLost"
# `lease_and_invoke` could not reach the pool for its lease (after the client's own
# retries): the attempt fails over (a place or lease the pool did grant is recovered).
ACQUIRE_FAILED = "AcquireFailed"

# ---------------------------------------------------------------- activity names
# Workflows call activities by name: importing the activity modules into the
# sandbox would pull in aiohttp and the kubernetes client.
NOTIFY_POOL = "notify_pool"
# The lease, the invoke and the release in one activity (one per CapabilityTaskWorkflow
# attempt), and what gives back a lease that activity took but could not report.
LEASE_AND_INVOKE = "lease_and_invoke"
RECOVER_LEASE = "recover_lease"
REQUEST_HOLDS = "request_holds"
VERIFY_AGENT = "verify_agent"
# Agent workflows' own snapshots (their `snapshot` query), one activity per batch of
# agents: what the pool applies for a hint.
READ_AGENTS = "read_agents"
# The agent workflows of a pool that run now (a visibility query): what a pool run that
# starts without state reads to relearn its fleet.
FIND_AGENTS = "find_agents"
# The pool's index notices to the agent workflows waiting on them.
TELL_INDEXED = "tell_indexed"
SCALE_DEPLOYMENT = "scale_deployment"
DELETE_POD = "delete_pod"
# Signals the pool sends (load notices, revocations, drains), sent together by one activity.
DELIVER_SIGNALS = "deliver_signals"
# The pool's next deadline: an activity that waits until then and reports (`report`).
POOL_ALARM = "pool_alarm"
CHECK_HEALTH = "check_health"
REQUEST_EVICTION = "request_eviction"

# The pool's update by which its chores (the activities it starts and never waits for)
# report what they found (`messages.ChoreReport`).
REPORT_UPDATE = "report"

# ---------------------------------------------------------------- signal names
# Signals sent with a workflow start (`start_signal` takes a name, not a definition).
AGENT_SNAPSHOTS_SIGNAL = "agent_snapshots"
REGISTER_SIGNAL = "register"
# The pool nudges held agents to ask again (after an operator's confirmation).
RETRY_EVICTION_SIGNAL = "retry_eviction"
# The worker's backend tells an agent workflow its process exited or its pod went
# (`contracts.PodGone`): the agent is Terminated at once, not after 3 missed heartbeats.
POD_GONE_SIGNAL = "pod_gone"
# The pool tells an agent workflow it indexed a registration (`contracts.IndexNotice`):
# the agent's `wait_routable` update (what `register` waits on) answers then.
INDEX_NOTICE_SIGNAL = "pool_indexed"

# ---------------------------------------------------------------- batching
# The most requests (or lease ids, tickets, renewals) one pool update may carry;
# clients batch at most this many.

# ---------------------------------------------------------------- retry policies
# Side effects on a cluster: keep trying with backoff; the activity marks
# errors no retry can fix (403, 422) non-retryable itself.
BACKEND_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=60),
    maximum_attempts=0,
    non_retryable_error_types=[KUBERNETES_REJECTED, "ValueError"],
)
# The pool's scaling chores stop retrying after this many attempts (~5 min with the backoff
# above): the last attempt reports its error to the pool, which the pool never waits for.
BACKEND_ATTEMPTS = 10
BACKEND_CHORE_RETRY = RetryPolicy(
    initial_interval=BACKEND_RETRY.initial_interval,
    backoff_coefficient=BACKEND_RETRY.backoff_coefficient,
    maximum_interval=BACKEND_RETRY.maximum_interval,
    maximum_attempts=BACKEND_ATTEMPTS,
    non_retryable_error_types=BACKEND_RETRY.non_retryable_error_types,
)
MESSAGE_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=100),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=0,
)


# ---------------------------------------------------------------- workflow inputs
class AgentWorkflowInput(BaseModel):
    agent_id: str
    pool: str = "default"
    # Continue-as-new once this many signals were received in one run (the
    # server's hard limit is 10,000 and signals do not count toward its hint).
    max_signals_per_run: int = Field(default=5000, ge=2)
    carried: dict[str, Any] | None = None
    refused: list[str] = Field(default_factory=list)
    # The pool's shard layout (see `agentroster.vocabulary.shards`): the agent tells its home shard.
    pool_shards: int = Field(default=1, ge=1, le=MAX_SHARDS)
    pool_shard_by: str = DEFAULT_SHARD_KEY

    def layout(self) -> ShardLayout:
        return ShardLayout(self.pool_shards, self.pool_shard_by if self.pool_shard_by in SHARD_KEYS else DEFAULT_SHARD_KEY)


class PoolInput(BaseModel):
    pool: str = "default"
    # Short runs: a worker that lost its cache replays the pool's whole current run inside
    # one workflow task, which must end within the pool's task timeout (2 s, pool_task_timeout)
    # on a loaded worker. A cold replay costs 0.45-0.8 ms per event here (1,000 agents, both
    # cores busy: benchmarks/bench_replay.py), most of it the SDK's work per activation, so a
    # run of 1,000 events replays in about a third of the timeout (median 0.5 s, at most 0.75 s).
    # 400 updates (two events each, plus the workflow tasks they share) make about as long a
    # run; the server allows 2,000.
    max_updates_per_run: int = Field(default=400, ge=2)
    max_signals_per_run: int = Field(default=800, ge=2)
    max_history_events: int = Field(default=1000, ge=100)
    scale_window_s: float = Field(default=5.0, gt=0)
    state: dict[str, Any] | None = None
    # The previous run's chores whose reports had not come (see `workflows.pool`): reads and
    # scaling are started again (both are idempotent), the others handled as not done.
    chores: list[dict[str, Any]] = Field(default_factory=list)
    refused: list[str] = Field(default_factory=list)
    runs: int = 0
    # Sharded pools (see `agentroster.vocabulary.shards`): this run is shard `shard` of `shards`, agents
    # placed by `shard_by`. Recorded so a client or worker configured otherwise is told.
    shard: int = Field(default=0, ge=0, lt=MAX_SHARDS)
    shards: int = Field(default=1, ge=1, le=MAX_SHARDS)
    shard_by: str = DEFAULT_SHARD_KEY
    # The previous run's latest wakes and when its load notices last left (epoch seconds): a run
    # continued as new under load stays hot, and holds its notices back as the run before did.
    wakes: list[float] = Field(default_factory=list, max_length=100)
    notices_sent_at: float | None = None

    def layout(self) -> ShardLayout:
        return ShardLayout(self.shards, self.shard_by if self.shard_by in SHARD_KEYS else DEFAULT_SHARD_KEY)


def refusal_reason(exc: Exception) -> str:
    """A one-line reason from a validation error, naming the fields."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            parts = [f"{'.'.join(str(p) for p in e.get('loc', ())) or 'message'}: {e.get('msg')}" for e in errors()]
            return "; ".join(parts)
        except Exception:  # pragma: no cover - fall back to str below
            pass
    return str(exc)
