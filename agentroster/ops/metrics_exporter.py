"""The worker's Prometheus endpoint: `GET /metrics` on AGENTROSTER_METRICS_PORT (9464 with `on`).

What one scrape returns, in the Prometheus text format (0.0.4):

1. **Pool metrics**, read from each pool's `status` query, at most once per
   `max_age_s` (5 s) per pool however often it is scraped: the pool workflow is
   the only source of truth, this process keeps no count of its own for them.
   Gauges (agents by state, slots, utilization, active leases, waiters, breaker
   and self-preservation state, uses) are the pool's state at the query; the
   counters are the pool's own monotonically increasing counters, carried
   across continue-as-new (they restart from zero only when a pool's workflow
   is started afresh, which Prometheus' rate() treats as a counter reset).
2. **This process's metrics** (prometheus_client's default registry): the
   activities' scale requests, pod deletions, health checks and task
   invocations, any AgentRoster client's acquire waits, and the standard
   `process_*`/`python_*` collectors. See `agentroster.vocabulary.metrics`.
   Beside them `agentroster_worker_gc_pause_seconds`, a histogram per generation of
   how long Python's garbage collector stopped the process (`GcPauses`): nothing is
   served during a pause, and a worker caching thousands of runs pauses for seconds.
   Beside it `agentroster_worker_gc_frozen_objects` and `agentroster_worker_gc_sweeps_total`:
   what the worker keeps out of those collections and how often it swept it (`ops.heap`).
3. **The Temporal SDK's own metrics** (`temporal_*`: workflow and activity task
   latencies, poll counts, sticky cache, ...), when the worker's client runs on
   a Runtime with the SDK's Prometheus exporter bound to a loopback port: that
   page is fetched and appended (the "bridge"), so one scrape target carries all.

Which pools: the worker's own pool(s) (AGENTROSTER_POOL and AGENTROSTER_METRICS_POOLS),
plus the running `PoolWorkflow`s on the worker's task queue, found by one
visibility list query at most once a minute. Every worker replica with an
endpoint exports the same pool metrics: aggregate them with `max by (pool, ...)`
(the alert rules and dashboard in deploy/ do), or give one replica the port.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from temporalio.client import Client

from agentroster.errors import AgentRosterError
from agentroster.models import PoolStatus
from agentroster.client.settings import DEFAULT_METRICS_PORT
from agentroster.client.transport import query_workflow
from agentroster.ops.heap import long_lived_freezer
from agentroster.vocabulary.wire import POOL_WORKFLOW_PREFIX, pool_workflow_id

logger = logging.getLogger("agentroster.vocabulary.metrics")

# A pool's agents in these states are always reported (0 when none), so a dashboard's series never vanish.
REPORTED_STATES = ("ready", "busy", "draining")
BREAKER_STATES = ("closed", "open", "half_open")
# (PoolStatus counter field, CapabilityStatus counter key, metric family name, help)
LEASE_COUNTERS: tuple[tuple[str | None, str, str, str], ...] = (
    ("leases_granted", "granted", "agentroster_leases_granted", "Leases the pool granted"),
    ("leases_released", "released", "agentroster_leases_released", "Leases returned by their holders"),
    ("leases_expired", "expired", "agentroster_leases_expired", "Leases that reached their deadline unrenewed"),
    ("leases_revoked", "revoked", "agentroster_leases_revoked", "Leases revoked (their agent terminated, or the capability withdrawn)"),
    ("leases_renewed", "renewed", "agentroster_leases_renewed", "Lease renewals"),
    ("exhausted", "exhausted", "agentroster_pool_exhausted",
     "Acquires that got no lease: waited out (PoolExhaustedError), unknown capability, or breaker open (fail_fast)"),
    (None, "queued", "agentroster_acquires_queued", "Acquires that had to queue for a slot"),
)
# Counts from before a pool kept them per capability, and acquires for names no agent ever offered.
OTHER_CAPABILITY = "(other)"
MAX_DISCOVERED_POOLS = 100


OUTCOME_PREFIX = "outcome."  # the pool counts each task outcome per capability as `outcome.<name>`

def pool_families(statuses: Mapping[str, PoolStatus | None], *, per_agent: bool = False) -> list[Metric]:
    """The pool metrics of these status snapshots (None: the pool's query failed). Pure."""
    up = GaugeMetricFamily("agentroster_pool_up", "1 when the pool's status query answered at the last refresh, else 0", labels=["pool"])
    agents = GaugeMetricFamily(
        "agentroster_agents", "Agents offering the capability, by lifecycle state as the pool sees it", labels=["pool", "capability", "state"]
    )
    pool_agents = GaugeMetricFamily("agentroster_pool_agents", "Agents in the pool, by lifecycle state", labels=["pool", "state"])
    slots = GaugeMetricFamily(
        "agentroster_slots", "Lease slots of routable agents offering the capability (in use or free)", labels=["pool", "capability"]
    )
    available = GaugeMetricFamily(
        "agentroster_slots_available", "Of those, slots free right now: leases grantable without waiting", labels=["pool", "capability"]
    )
    utilization = GaugeMetricFamily(
        "agentroster_utilization_ratio", "Share of the capability's slots in use, 0-1 (0 when it has no slot)", labels=["pool", "capability"]
    )
    active = GaugeMetricFamily("agentroster_leases_active", "Leases held now", labels=["pool", "capability"])
    waiters = GaugeMetricFamily("agentroster_waiters", "Callers queued for a lease", labels=["pool", "capability"])
    breaker = GaugeMetricFamily(
        "agentroster_breaker_state", "The capability's circuit breaker: 1 for its current state", labels=["pool", "capability", "state"]
    )
    counters = {
        key: CounterMetricFamily(name, f"{doc} (the pool's own counter)", labels=["pool", "capability"])
        for _, key, name, doc in LEASE_COUNTERS
    }
    terminated = CounterMetricFamily(
        "agentroster_agents_terminated",
        "Agents that left the pool: cause=drained (after a drain) or lost (heartbeat lost, workflow gone)",
        labels=["pool", "cause"],
    )
    retiring = GaugeMetricFamily(
        "agentroster_agents_retiring", "Agents the pool stopped routing to, by reason (worn, unhealthy, recycled, scale-down)", labels=["pool", "reason"]
    )
    failing = GaugeMetricFamily(
        "agentroster_agents_failing_health", "Agents whose last health check(s) failed", labels=["pool", "deployment"]
    )
    ejected = GaugeMetricFamily(
        "agentroster_agents_ejected",
        "Agents out of routing for their tasks' outcomes (outlier ejection; alive, back after a trial task)",
        labels=["pool", "deployment"],
    )
    outcomes = CounterMetricFamily(
        "agentroster_task_outcomes",
        "Tasks by how they went, as their releases told the pool (succeeded, failed_*, refused_*)",
        labels=["pool", "capability", "outcome"],
    )
    deployment_agents = GaugeMetricFamily("agentroster_deployment_agents", "Agents of the deployment in the pool", labels=["pool", "deployment"])
    uses_mean = GaugeMetricFamily(
        "agentroster_agent_uses_mean", "Leases granted per agent of the deployment, averaged over its current agents", labels=["pool", "deployment"]
    )
    uses_max = GaugeMetricFamily("agentroster_agent_uses_max", "The most leases granted to one current agent of the deployment", labels=["pool", "deployment"])
    policy_replicas = GaugeMetricFamily(
        "agentroster_policy_replicas", "A sizing policy's replica bounds (bound=min or max)", labels=["pool", "deployment", "bound"]
    )
    self_preservation = GaugeMetricFamily(
        "agentroster_pool_self_preservation", "1 while the pool holds back terminations of silent agents (self-preservation)", labels=["pool"]
    )
    silent = GaugeMetricFamily("agentroster_pool_silent_agents", "Agents that stopped heartbeating and whose termination is held", labels=["pool"])
    per_agent_families: list[GaugeMetricFamily] = []
    if per_agent:
        agent_uses = GaugeMetricFamily("agentroster_agent_uses", "Leases granted to the agent", labels=["pool", "deployment", "agent"])
        agent_in_flight = GaugeMetricFamily("agentroster_agent_in_flight", "The agent's active leases", labels=["pool", "deployment", "agent"])
        agent_health = GaugeMetricFamily(
            "agentroster_agent_health_failures", "The agent's consecutive failed health checks", labels=["pool", "deployment", "agent"]
        )
        agent_ejected = GaugeMetricFamily(
            "agentroster_agent_ejected_until",
            "When the agent's outlier ejection ends (Unix time); 0 while it waits for its trial task",
            labels=["pool", "deployment", "agent"],
        )
        per_agent_families = [agent_uses, agent_in_flight, agent_health, agent_ejected]

    for pool, status in sorted(statuses.items()):
        up.add_metric([pool], 0.0 if status is None else 1.0)
        if status is None:
            continue
        # -- per capability
        breakers = dict(status.breakers)
        for name, cap in sorted(status.capabilities.items()):
            states = {state.lower(): count for state, count in cap.agents.items()}
            for state in sorted(set(REPORTED_STATES) | set(states)):
                agents.add_metric([pool, name, state], states.get(state, 0))
            slots.add_metric([pool, name], cap.slots)
            available.add_metric([pool, name], cap.idle_slots)
            utilization.add_metric([pool, name], (cap.slots - cap.idle_slots) / cap.slots if cap.slots else 0.0)
            active.add_metric([pool, name], cap.in_flight)
            waiters.add_metric([pool, name], cap.waiting)
            current = breakers.pop(name, "closed")
            for state in BREAKER_STATES:
                breaker.add_metric([pool, name, state], 1.0 if current == state else 0.0)
        for name, current in sorted(breakers.items()):  # a breaker for a name no longer in the catalog
            for state in BREAKER_STATES:
                breaker.add_metric([pool, name, state], 1.0 if current == state else 0.0)
        for field, key, _, _ in LEASE_COUNTERS:
            per_name = {name: cap.counters.get(key, 0) for name, cap in status.capabilities.items()}
            for name, value in sorted(per_name.items()):
                counters[key].add_metric([pool, name], value)
            if field is not None:
                other = getattr(status, field) - sum(per_name.values())
                if other > 0:
                    counters[key].add_metric([pool, OTHER_CAPABILITY], other)
        for name, cap in sorted(status.capabilities.items()):
            for counted, value in sorted(cap.counters.items()):
                if counted.startswith(OUTCOME_PREFIX):  # bounded: capabilities x the 7 outcomes
                    outcomes.add_metric([pool, name, counted[len(OUTCOME_PREFIX):]], value)
        terminated.add_metric([pool, "drained"], status.agents_drained)
        terminated.add_metric([pool, "lost"], status.agents_lost)
        # -- per pool and deployment, from the agent rows
        by_state: dict[str, int] = {state: 0 for state in REPORTED_STATES}
        by_reason: dict[str, int] = {}
        by_deployment: dict[str, list[int]] = {}
        failing_by_deployment: dict[str, int] = {}
        ejected_by_deployment: dict[str, int] = {}
        for row in status.agents:
            if row.ejected:
                ejected_by_deployment[row.deployment] = ejected_by_deployment.get(row.deployment, 0) + 1
                if per_agent:
                    until = row.ejected_until.timestamp() if row.ejected_until else 0.0
                    agent_ejected.add_metric([pool, row.deployment, row.agent_id], until)
            by_state[row.state.value.lower()] = by_state.get(row.state.value.lower(), 0) + 1
            if row.retiring:
                reason = row.retiring.split(":")[0].strip() or "other"
                by_reason[reason] = by_reason.get(reason, 0) + 1
            by_deployment.setdefault(row.deployment, []).append(row.uses)
            failing_by_deployment[row.deployment] = failing_by_deployment.get(row.deployment, 0) + (1 if row.health_failures > 0 else 0)
            if per_agent:
                agent_uses.add_metric([pool, row.deployment, row.agent_id], row.uses)
                agent_in_flight.add_metric([pool, row.deployment, row.agent_id], row.in_flight)
                agent_health.add_metric([pool, row.deployment, row.agent_id], row.health_failures)
        for state, count in sorted(by_state.items()):
            pool_agents.add_metric([pool, state], count)
        for reason, count in sorted(by_reason.items()):
            retiring.add_metric([pool, reason], count)
        for deployment in sorted(set(by_deployment) | set(status.policies)):
            uses = by_deployment.get(deployment, [])
            deployment_agents.add_metric([pool, deployment], len(uses))
            uses_mean.add_metric([pool, deployment], sum(uses) / len(uses) if uses else 0.0)
            uses_max.add_metric([pool, deployment], max(uses, default=0))
            failing.add_metric([pool, deployment], failing_by_deployment.get(deployment, 0))
            ejected.add_metric([pool, deployment], ejected_by_deployment.get(deployment, 0))
        for deployment, policy in sorted(status.policies.items()):
            if policy.max_replicas is None:
                continue  # a policy that sizes nothing has no bounds
            policy_replicas.add_metric([pool, deployment, "min"], policy.min_replicas)
            policy_replicas.add_metric([pool, deployment, "max"], policy.max_replicas)
        on, held = eviction_state(status)
        self_preservation.add_metric([pool], 1.0 if on else 0.0)
        silent.add_metric([pool], held)

    return [
        up, pool_agents, agents, slots, available, utilization, active, waiters, breaker, *counters.values(),
        terminated, retiring, failing, ejected, outcomes, deployment_agents, uses_mean, uses_max, policy_replicas, self_preservation, silent,
        *per_agent_families,
    ]


def eviction_state(status: PoolStatus) -> tuple[bool, int]:
    """(self-preservation on, silent agents held) from a status; (False, 0) for a pool without eviction safety.

    Read defensively: the fields belong to eviction safety (`status.eviction`), which
    a pool of an older version does not report, and such a pool never holds
    terminations back.
    """
    eviction = getattr(status, "eviction", None)
    on = getattr(eviction, "self_preservation", None)
    if on is None:
        on = getattr(status, "self_preservation", False)
    held = getattr(eviction, "silent", None)
    if held is None:
        held = [row for row in status.agents if getattr(row, "silent", False)]
    return bool(on), len(held) if isinstance(held, (list, tuple, set, dict)) else int(held or 0)


class PoolCollector(Collector):
    """Yields `pool_families` of the latest snapshots (set by MetricsExporter.refresh)."""

    def __init__(self, *, per_agent: bool = False) -> None:
        self.statuses: dict[str, PoolStatus | None] = {}
        self.per_agent = per_agent

    def collect(self) -> Iterable[Metric]:
        return pool_families(self.statuses, per_agent=self.per_agent)


class GcPauses(Collector):
    """How long each garbage collection stopped this process, per generation, as a histogram.

    A full (generation 2) collection walks every object the collector tracks with every
    thread stopped: in a worker caching 10,000 agent runs, about two million objects
    and about 2 s, during which no workflow task, activity or query is served (a pool's next
    task misses its sticky timeout, an activation in progress can trip the SDK's 2 s
    deadlock detector). A running worker keeps its long-lived objects out of them
    (`ops.heap`), so only its sweeps take that long. The callback runs inside each collection, so it only adds to
    plain counters; `collect` reads them at scrape time."""

    BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)

    def __init__(self) -> None:
        self._counts = [[0] * (len(self.BUCKETS) + 1) for _ in range(3)]
        self._sums = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info.get("generation", 0)
        if 0 <= generation < 3:
            pause = time.perf_counter() - self._started
            self._counts[generation][bisect.bisect_left(self.BUCKETS, pause)] += 1
            self._sums[generation] += pause

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(
            "agentroster_worker_gc_pause_seconds",
            "How long each garbage collection stopped this process (generation 2: a full collection)",
            labels=["generation"],
        )
        for generation in range(3):
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, self.BUCKETS), "+Inf"), self._counts[generation]):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family


_gc_pauses: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """The process's one `GcPauses`, its callback in `gc.callbacks` from the first call on."""
    global _gc_pauses
    if _gc_pauses is None:
        _gc_pauses = GcPauses()
        gc.callbacks.append(_gc_pauses)
    return _gc_pauses


class MetricsExporter:
    """Serves `GET /metrics` on `host:port` from the worker's event loop (aiohttp).

    `pools` are always exported; with `discover`, so are the running pools on
    `task_queue`. `max_age_s` bounds how often each pool is queried, however
    often the endpoint is scraped (0: on every scrape). `sdk_metrics_url` is the
    Temporal SDK's Prometheus page to append (see `sdk_runtime`).
    """

    def __init__(
        self,
        client: Client,
        *,
        port: int = DEFAULT_METRICS_PORT,
        host: str = "0.0.0.0",
        pools: Sequence[str] = (),
        task_queue: str | None = None,
        discover: bool = True,
        registry: CollectorRegistry = REGISTRY,
        max_age_s: float = 5.0,
        discover_every_s: float = 60.0,
        query_timeout_s: float = 5.0,
        per_agent: bool = False,
        sdk_metrics_url: str | None = None,
    ) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.pools = list(dict.fromkeys(pools))
        self.task_queue = task_queue
        self.discover = discover
        self.registry = registry
        self.max_age_s = max_age_s
        self.discover_every_s = discover_every_s
        self.query_timeout_s = query_timeout_s
        self.sdk_metrics_url = sdk_metrics_url
        self.collector = PoolCollector(per_agent=per_agent)
        self._pool_registry = CollectorRegistry(auto_describe=False)
        self._pool_registry.register(self.collector)
        self._pool_registry.register(gc_pauses())
        self._pool_registry.register(long_lived_freezer())
        self._refreshed_at = float("-inf")
        self._discovered: list[str] = []
        self._layouts: dict[str, Any] = {}  # pool -> its shard layout (read once, from shard 0's memo)
        self._discovered_at = float("-inf")
        self._refresh_lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._http: ClientSession | None = None
        self._warned: set[str] = set()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    async def start(self) -> None:
        """Listen (idempotent). A port in use raises AgentRosterError naming it."""
        async with self._start_lock:
            if self._runner is not None:
                return
            app = web.Application()
            app.router.add_get("/metrics", self._handle)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
            try:
                await site.start()
            except OSError as exc:
                await runner.cleanup()
                raise AgentRosterError(
                    f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc} (set AGENTROSTER_METRICS_PORT to a free port)"
                ) from exc
            server = getattr(site, "_server", None)
            if self.port == 0 and server is not None and server.sockets:
                self.port = server.sockets[0].getsockname()[1]
            self._runner = runner
            logger.info("metrics: serving %s (pools: %s%s)", self.url, ", ".join(self.pools) or "-", ", + discovered" if self.discover else "")

    async def stop(self) -> None:
        async with self._start_lock:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            if self._http is not None:
                await self._http.close()
                self._http = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await self.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def render(self) -> bytes:
        """One scrape: this process's registry, the pool metrics (refreshed when older than max_age_s), the SDK's."""
        await self.refresh()
        parts = [generate_latest(self.registry), generate_latest(self._pool_registry)]
        if self.sdk_metrics_url:
            parts.append(await self._sdk_text())
        return b"".join(parts)

    async def refresh(self, *, force: bool = False) -> dict[str, PoolStatus | None]:
        """Query every pool's status once, unless the last refresh is younger than max_age_s."""
        async with self._refresh_lock:
            if force or time.monotonic() - self._refreshed_at >= self.max_age_s:
                pools = await self.watched_pools()
                results = await asyncio.gather(*(self._status(pool) for pool in pools))
                self.collector.statuses = dict(zip(pools, results))
                self._refreshed_at = time.monotonic()
            return self.collector.statuses

    async def watched_pools(self) -> list[str]:
        """The configured pools, then the discovered ones (refreshed at most every discover_every_s)."""
        if self.discover and time.monotonic() - self._discovered_at >= self.discover_every_s:
            self._discovered_at = time.monotonic()
            try:
                self._discovered = await self._discover()
            except Exception as exc:  # visibility is optional: keep the configured pools
                self._warn_once("discover", "metrics: listing pool workflows failed (only configured pools exported): %s", exc)
        return list(dict.fromkeys([*self.pools, *self._discovered]))

    async def _discover(self) -> list[str]:
        query = "WorkflowType = 'PoolWorkflow' AND ExecutionStatus = 'Running'"
        if self.task_queue and "'" not in self.task_queue:
            query += f" AND TaskQueue = '{self.task_queue}'"
        found: list[str] = []
        async for execution in self.client.list_workflows(
            query, limit=MAX_DISCOVERED_POOLS, rpc_timeout=timedelta(seconds=self.query_timeout_s)
        ):
            if execution.id.startswith(POOL_WORKFLOW_PREFIX):
                # `pool/{pool}/shard-{k}` is a shard of `pool/{pool}` (pool names hold no '/')
                found.append(execution.id.removeprefix(POOL_WORKFLOW_PREFIX).split("/")[0])
        return sorted(set(found))

    async def _status(self, pool: str) -> PoolStatus | None:
        """The pool's status, added up over its shards (the layout is read once, from shard 0's memo)."""
        from agentroster.client.roster import pool_layout
        from agentroster.client.shard_status import merge_statuses
        from agentroster.workflows.pool import PoolWorkflow

        try:
            layouts = self._layouts
            if pool not in layouts:
                layouts[pool] = await asyncio.wait_for(pool_layout(self.client, pool), timeout=self.query_timeout_s + 1.0)
            shards = layouts[pool].shards if layouts[pool] is not None else 1
            deadline = time.monotonic() + self.query_timeout_s
            statuses = await asyncio.gather(*(
                query_workflow(self.client.get_workflow_handle(pool_workflow_id(pool, shard)), PoolWorkflow.status, deadline=deadline)
                for shard in range(shards)
            ))
            if layouts[pool] is None:
                layouts.pop(pool)  # not started when first asked: read the layout again next time
            return merge_statuses(statuses)
        except Exception as exc:
            self._warn_once(f"status/{pool}", "metrics: status query of pool %s failed (agentroster_pool_up 0): %s", pool, exc)
            return None

    async def _sdk_text(self) -> bytes:
        try:
            if self._http is None or self._http.closed:
                self._http = ClientSession(timeout=ClientTimeout(total=2.0))
            async with self._http.get(self.sdk_metrics_url) as response:  # type: ignore[arg-type]
                text = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")
        except Exception as exc:
            self._warn_once("sdk", "metrics: the Temporal SDK's metrics at %s did not answer: %s", self.sdk_metrics_url, exc)
            return b""
        return text if text.endswith(b"\n") or not text else text + b"\n"

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key in self._warned:
            logger.debug(message, *args)
        else:
            self._warned.add(key)
            logger.warning(message, *args)


def sdk_runtime(bind_address: str) -> Any:
    """A temporalio Runtime whose SDK metrics are served in Prometheus format at `bind_address`.

    Give it to the worker's client (`Client.connect(..., runtime=...)`); every
    client on it reports there.
    """
    from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

    try:
        return Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=bind_address)))
    except Exception as exc:
        raise AgentRosterError(f"cannot serve the Temporal SDK's metrics on {bind_address}: {exc}") from exc


__all__ = ["MetricsExporter", "PoolCollector", "eviction_state", "pool_families", "sdk_runtime"]
