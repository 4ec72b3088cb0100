"""Metrics a process records about its own work, in prometheus_client's default registry.

Two kinds of agentroster metrics exist (docs/operations.md, "Metrics", has the list):

- **Pool metrics** (agents, slots, leases, waiters, breakers, the pool's own
  counters) describe a pool's state. The worker's exporter
  (`agentroster.ops.metrics_exporter`) reads them from the pool's `status` query
  when it is scraped: the pool workflow stays the only source of truth.
- **Process metrics**, here: what this process did and timed itself. The
  client's acquire waits (any process using `AgentRoster`), and the worker's
  activities (scale requests and their outcomes, pod deletions, health
  checks, task invocations). They count only this process's work, so summing
  them across worker replicas is right.

A process that uses `AgentRoster` but runs no worker can serve these with
`prometheus_client.start_http_server(port)`; the worker's `/metrics` serves
them with the pool metrics.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Seconds; the queue serves within milliseconds when a slot is free, and callers wait up to minutes.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INVOKE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)

ACQUIRE_WAIT = Histogram(
    "agentroster_acquire_wait_seconds",
    "How long AgentRoster.acquire (and borrow) waited for a lease, by outcome "
    "(granted, exhausted, unknown_capability, circuit_open, cancelled, error); recorded by the calling process",
    ["pool", "capability", "outcome"],
    buckets=WAIT_BUCKETS,
)
SCALE_REQUESTS = Counter(
    "agentroster_scale_requests",
    "Replica changes the scale_deployment activity carried out on this worker, by outcome "
    "(done; skipped: an at-least request already met; failed: one failed attempt, retried by its policy)",
    ["pool", "deployment", "outcome"],
)
SCALE_REPLICAS = Gauge(
    "agentroster_scale_replicas_requested",
    "The replica count last asked of a deployment by a scale_deployment activity on this worker",
    ["pool", "deployment"],
)
POD_DELETIONS = Counter(
    "agentroster_pod_deletions",
    "Pods (or local processes) of terminated agents the delete_pod activity removed on this worker, by outcome (done, failed)",
    ["pool", "deployment", "outcome"],
)
HEALTH_CHECKS = Counter(
    "agentroster_health_checks",
    "GET /healthz calls of the check_health activity on this worker, by outcome (ok, failed)",
    ["pool", "outcome"],
)
INVOKE_DURATION = Histogram(
    "agentroster_invoke_duration_seconds",
    "Tasks the invoke_agent activity sent to agents on this worker, from the POST to the checked answer, by outcome "
    "(ok, agent_failed, unreachable, invalid_input, invalid_output, lease_key_missing, error)",
    ["pool", "capability", "outcome"],
    buckets=INVOKE_BUCKETS,
)


PREFETCHED_LEASES = Counter(
    "agentroster_prefetched_leases",
    "Leases lease_and_invoke asked for ahead of a stream's next task on this worker, by outcome (used: a task "
    "took it with no round trip to the pool; unused: the stream ended, released; missed: the pool had none to spare)",
    ["pool", "capability", "outcome"],
)


def capability_of(ref: str) -> str:
    """The capability name of a ref (`rag.search@>=2,<3` -> `rag.search`): the label value."""
    return ref.partition("@")[0].strip()


def pool_of_workflow(workflow_id: str) -> str:
    """The pool of an activity's workflow: `pool/{pool}` or `agent/{pool}/{agent_id}`; '' for others."""
    kind, _, rest = workflow_id.partition("/")
    if kind == "pool":
        return rest
    if kind == "agent":
        return rest.partition("/")[0]
    return ""


__all__ = [
    "ACQUIRE_WAIT",
    "HEALTH_CHECKS",
    "INVOKE_DURATION",
    "POD_DELETIONS",
    "PREFETCHED_LEASES",
    "SCALE_REPLICAS",
    "SCALE_REQUESTS",
    "capability_of",
    "pool_of_workflow",
]
