"""The agentroster worker: every workflow and activity, on one task queue.

    from agentroster.workers.worker import create_worker
    worker = create_worker(roster.client, task_queue="agentroster", backend="none")
    await worker.run()

Before polling, the worker checks that the custom search attributes exist,
registers them where the server allows it (the dev server does), and
otherwise stops with a message naming the missing ones.

With `metrics_port`, it serves Prometheus metrics on `/metrics` while it runs
(see `agentroster.ops.metrics_exporter`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from temporalio.client import Client
from temporalio.converter import DataConverter
from temporalio.worker import PollerBehaviorAutoscaling, Worker, WorkflowRunner

from agentroster.activities.a2a import check_a2a_agent
from agentroster.activities.backend import Backend, BackendActivities, make_backend
from agentroster.activities.liveness import AgentGoneNotifier
from agentroster.activities.roster import RosterActivities
from agentroster.client.lease_tokens import LeaseKeys
from agentroster.client.search_attributes import MissingSearchAttributesError, ensure_search_attributes
from agentroster.client.settings import lease_prefetch_from_env
from agentroster.models import DEFAULT_HEARTBEAT_INTERVAL_S, MISSED_HEARTBEATS
from agentroster.vocabulary.wire import QUERY_RPC_TIMEOUT, STICKY_TIMEOUT
from agentroster.workers.context_free import ContextFreeRunner, converter_ignores_context
from agentroster.ops.heap import LongLivedFreezer, long_lived_freezer
from agentroster.ops.metrics_exporter import MetricsExporter
from agentroster.workflows import workflow_classes, workflow_runner

logger = logging.getLogger("agentroster.worker")

# Workflow runs a worker keeps in memory between their tasks (see create_worker).
WORKFLOW_CACHE = 2000
# Workflow tasks a worker holds at once (see create_worker).
WORKFLOW_TASK_SLOTS = 20


def worker_workflow_runner(data_converter: DataConverter) -> WorkflowRunner:
    """What a worker runs workflows with: the sandbox (`workflows.workflow_runner()`, as every
    replayer), answering serialization contexts outside it when `data_converter` ignores
    them (`context_free`)."""
    runner: WorkflowRunner = workflow_runner()
    if converter_ignores_context(data_converter):
        runner = ContextFreeRunner(runner)
    return runner


class AgentRosterWorker(Worker):
    """A temporalio Worker that checks the search attributes before it polls."""

    def __init__(
        self,
        client: Client,
        *,
        roster_activities: RosterActivities,
        backend: Backend,
        check_search_attributes: bool = True,
        metrics: MetricsExporter | None = None,
        report_agents_gone: bool = True,
        freezer: LongLivedFreezer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, **kwargs)
        self.backend = backend
        self.freezer = freezer  # keeps the cached runs' objects out of full collections while it runs
        # Event-driven liveness: a backend that watches its agents (local processes,
        # Kubernetes pods) tells an agent workflow at once when its process or pod is gone.
        self.agent_gone: AgentGoneNotifier | None = None
        watch = getattr(backend, "on_agent_gone", None)
        if report_agents_gone and watch is not None:
            self.agent_gone = AgentGoneNotifier(client)
            watch(self.agent_gone)
        else:
            logger.info(
                "backend %s reports no agent that goes: a crashed agent is declared lost after 3 heartbeat intervals "
                "(%g min at the default %g s; set HEARTBEAT_INTERVAL_S on the agents for less)",
                getattr(backend, "name", type(backend).__name__),
                MISSED_HEARTBEATS * DEFAULT_HEARTBEAT_INTERVAL_S / 60,
                DEFAULT_HEARTBEAT_INTERVAL_S,
            )
        self.metrics = metrics  # the /metrics endpoint, served while the worker runs
        self._roster_client = client
        self._roster_activities = roster_activities
        self._check_search_attributes = check_search_attributes

    async def _ensure_search_attributes(self) -> None:
        if self._check_search_attributes:
            await ensure_search_attributes(self._roster_client)
            self._check_search_attributes = False  # once is enough

    async def __aenter__(self) -> AgentRosterWorker:
        await self._ensure_search_attributes()
        if self.metrics is not None:
            await self.metrics.start()  # listening before the block runs (run() finds it started)
        await super().__aenter__()
        return self

    async def run(self) -> None:
        await self._ensure_search_attributes()
        if self.metrics is not None:
            await self.metrics.start()
        # A backend that manages processes (local) runs as long as its worker.
        start = getattr(self.backend, "start", None)
        if start is not None:
            await start()
        if self.freezer is not None:
            self.freezer.start()
        try:
            await super().run()
        finally:
            if self.freezer is not None:
                self.freezer.stop()
            await self._stop_backend()
            await self._roster_activities.close()
            if self.metrics is not None:
                await self.metrics.stop()

    async def _stop_backend(self) -> None:
        stop = getattr(self.backend, "stop", None)
        if stop is not None:
            await stop()

    async def shutdown(self) -> None:
        """Stop the backend's agents first: they drain through workflows this worker runs.
        Then the leases this worker's activities hold back (prefetched, or releases waiting
        to ride on an acquire) go to their pools while this worker still runs the pool's
        workflow: once it stops polling, a pool it alone served answers nothing, and those
        leases would be held until their TTL."""
        await self._stop_backend()
        await self._roster_activities.return_leases()
        await super().shutdown()


def create_worker(
    client: Client,
    task_queue: str = "agentroster",
    backend: str | Backend = "none",
    *,
    backend_options: dict[str, Any] | None = None,
    check_search_attributes: bool = True,
    extra_workflows: Sequence[type] = (),
    extra_activities: Sequence[Callable[..., Any]] = (),
    lease_key: LeaseKeys | str | bytes | None = None,
    metrics_port: int | None = None,
    metrics_pools: Sequence[str] = (),
    metrics_options: dict[str, Any] | None = None,
    pool_shards: dict[str, Any] | Any = None,
    report_agents_gone: bool = True,
    lease_prefetch_s: float | None = None,
    freeze_long_lived: bool = True,
    **worker_options: Any,
) -> AgentRosterWorker:
    """A worker running the agent, pool and supervisor workflows and all activities.

    `backend` is `none`, `local`, `kubernetes`, or a Backend instance; `extra_workflows`
    and `extra_activities` are served beside ours (a supervisor's, a benchmark's). `lease_key`
    (default: AGENTROSTER_LEASE_KEY) signs the lease tokens agents check.
    With `metrics_port` (0: any free port; `worker.metrics.port` says which) it
    serves `/metrics` for `metrics_pools` and the pools running on `task_queue`;
    `metrics_options` go to `MetricsExporter` (host, per_agent, max_age_s,
    sdk_metrics_url, discover, ...). `pool_shards` is each pool's shard layout (a
    layout for every pool, or pool -> layout; default AGENTROSTER_POOL_SHARDS): the
    activities route to the shard that holds an agent or granted a lease.
    `report_agents_gone` (the default): a backend that
    watches its agents (`on_agent_gone`: local, kubernetes) signals `pod_gone` to an agent
    workflow as soon as its process exits or its pod goes.
    `lease_prefetch_s` (default AGENTROSTER_LEASE_PREFETCH_S, else 0.25; 0: off): a stream of
    supervisor tasks for one capability ref gets each next lease ahead of time, kept this long
    for the next task (docs/concepts/leases.md: the supervisor's path).
    `freeze_long_lived` (the default): while the worker runs, the objects of its cached runs
    are kept out of the garbage collector's full collections (`ops.heap`: a worker caching
    10,000 agents otherwise stops for ~2 s at each); it acts on the whole process, so an
    application that embeds a worker and manages its collector itself turns it off.
    """
    chosen = make_backend(backend, **(backend_options or {})) if isinstance(backend, str) else backend
    if lease_prefetch_s is None:
        lease_prefetch_s = lease_prefetch_from_env()
    roster_activities = RosterActivities(client, task_queue, lease_key, pool_shards=pool_shards, lease_prefetch_s=lease_prefetch_s)
    backend_activities = BackendActivities(chosen, report=roster_activities.report)
    worker_options.setdefault("max_concurrent_activities", 200)
    # Workflow tasks held at once (the SDK's default: 100). Their activations share one
    # interpreter lock: 100 at once interleave, and each takes that many times its own time
    # on the clock. While a fleet registers, a pool's task among them ran past its 2 s
    # timeout; held by the server instead, the pool's go first (`wire.POOL_PRIORITY`).
    worker_options.setdefault("max_concurrent_workflow_tasks", WORKFLOW_TASK_SLOTS)
    # Pollers follow the backlog (the SDK's default is a fixed 5 per queue, one of them on the
    # normal workflow queue): a burst of registrations starts a workflow per agent, and
    # each first task comes from the normal queue.
    worker_options.setdefault("workflow_task_poller_behavior", PollerBehaviorAutoscaling())
    worker_options.setdefault("activity_task_poller_behavior", PollerBehaviorAutoscaling())
    # A refused update's reply carries its request again (the SDK echoes it in the
    # Rejection): for an argument over the server's 2 MiB blob limit the SDK's own check
    # would fail the pool's workflow task again and again, holding every caller up. Left to
    # the server, that reply alone is refused at once, the update aborted, the pool unharmed.
    worker_options.setdefault("disable_payload_error_limit", True)
    # Every agent is a long-running workflow that wakes at each heartbeat. A worker holding
    # more runs than its cache (the SDK's default: 1,000) evicts the one whose heartbeat is
    # due next and replays it from its history when it comes: with 1,000 agents and a pool on
    # one worker that was every heartbeat (measured with bench_cost.py --fleet 1000: the
    # worker's idle CPU about halved with a cache of 2,500). A cached agent run holds ~130 KiB.
    worker_options.setdefault("max_cached_workflows", WORKFLOW_CACHE)
    # A workflow's next task waits this long on a dead worker's sticky queue before
    # any worker may take it (the SDK's default is 10 s): recovery after a worker
    # dies, or restarts, is bounded by it. Every query of ours gives up before it
    # (wire.QUERY_RPC_TIMEOUT): see `transport.query_workflow` for why.
    sticky = worker_options.setdefault("sticky_queue_schedule_to_start_timeout", STICKY_TIMEOUT)
    if sticky <= QUERY_RPC_TIMEOUT:
        raise ValueError(
            f"sticky_queue_schedule_to_start_timeout: {sticky.total_seconds():g} s must be longer than the queries' "
            f"deadline ({QUERY_RPC_TIMEOUT.total_seconds():g} s, wire.QUERY_RPC_TIMEOUT), or a query sent while a worker "
            "is dead reaches the next one with unhandled events (transport.query_workflow)"
        )
    metrics = None
    if metrics_port is not None:
        metrics = MetricsExporter(client, port=metrics_port, pools=metrics_pools, task_queue=task_queue, **(metrics_options or {}))
    return AgentRosterWorker(
        client,
        roster_activities=roster_activities,
        backend=chosen,
        check_search_attributes=check_search_attributes,
        metrics=metrics,
        report_agents_gone=report_agents_gone,
        freezer=long_lived_freezer() if freeze_long_lived else None,
        task_queue=task_queue,
        workflows=[*workflow_classes(), *extra_workflows],
        workflow_runner=worker_workflow_runner(client.data_converter),
        activities=[
            roster_activities.notify_pool,
            roster_activities.verify_agent,
            roster_activities.read_agents,
            roster_activities.find_agents,
            roster_activities.tell_indexed,
            roster_activities.check_health,
            roster_activities.deliver_signals,
            roster_activities.pool_alarm,
            roster_activities.request_eviction,
            roster_activities.lease_and_invoke,
            roster_activities.recover_lease,
            roster_activities.request_holds,
            backend_activities.scale_deployment,
            backend_activities.delete_pod,
            check_a2a_agent,
            *extra_activities,
        ],
        **worker_options,
    )


__all__ = ["AgentRosterWorker", "MissingSearchAttributesError", "create_worker", "ensure_search_attributes", "worker_workflow_runner"]
