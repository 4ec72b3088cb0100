"""What an idle fleet costs in Temporal actions, and how fast a crash is seen: issue 10, goals 1 and 2.

One dev server (its metrics port exports the `action` counter Temporal Cloud bills
by), workers in this process, and in the same run:

1. **before**: N agents at the old setting (10 s heartbeat), in their own namespace,
   so the server's per-namespace counter separates them (the code from before the
   30 min resync and the backend's `pod_gone` is measured from a worktree of it);
2. **after**: N agents at the defaults (`DEFAULT_HEARTBEAT_INTERVAL_S`, snapshot
   resync every 30 min folded into a liveness check), in the default namespace.

Each phase registers its agents, has them heartbeat as the agent runtime does (one
`heartbeat` signal per agent per interval, spread over the interval), waits a
warm-up, then counts actions over a window. The benchmark's own `status` queries
(every 10 s) are billed actions too; they are shown but left out of the per-agent
figure (an idle fleet sends none).

The defaults' rhythm is slow (liveness window 12 min, resync 30 min), so an honest
count needs a window of an hour. `--time-scale K` (default 12) runs the after
phase K times faster (heartbeat 240/K s, resync 1800/K s, set in this process,
which runs the worker) and scales the count back to real hours: the actions per
liveness cycle do not depend on its length. `--time-scale 1` measures the real
defaults (use `--after-window 3600`).

3. **crash detection**: a real local agent (`examples.math_agent`, LocalBackend)
   killed with SIGKILL: seconds until its workflow is Terminated, before (10 s
   heartbeat, no backend report: `heartbeat_lost`) and after (default heartbeat,
   the backend's `pod_gone`: `process_exited`).

`--fleet 1000` (goal 2) instead registers that many agents at the default interval
on one worker process and one dev server and reports: time until all are routable, the
pool's `status` latency while they heartbeat (asked from a process of its own, as an
operator's CLI or dashboard asks: `status_probe.py`), and the CPU of the server and of the
worker process (this process, which simulates the agents' heartbeats, is not counted).

Exits non-zero when the after figure is over 60 actions per agent-hour.

Run: ``python benchmarks/bench_cost.py [--agents 100] [--time-scale 12]`` and
``python benchmarks/bench_cost.py --fleet 1000``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from datetime import timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from temporalio.api.enums.v1 import EventType, TimeoutType  # noqa: E402
from temporalio.client import Client  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402

import agentroster.core.lifecycle as lifecycle  # noqa: E402
from agentroster.activities.backend import NoneBackend  # noqa: E402
from agentroster.activities.fleet import DeploymentSpec, Fleet, FleetDefaults  # noqa: E402
from agentroster.activities.local_backend import LocalBackend  # noqa: E402
from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.errors import AgentNotFoundError
from agentroster.models import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    MISSED_HEARTBEATS,
    AgentRegistration,
    AgentState,
    Capability,
)  # noqa: E402
from agentroster.vocabulary.shards import ShardLayout  # noqa: E402
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES, pool_workflow_id  # noqa: E402
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path  # noqa: E402
from agentroster.ops.ports import free_port  # noqa: E402
from agentroster.workers.worker import create_worker  # noqa: E402
from benchmarks.chaos_checks import PoolTasks, fetch_history, history_counts, run_ids  # noqa: E402
from benchmarks.chaos_procs import WorkerProcess, child_env, cpu_seconds, dev_server_pids, rss_mib  # noqa: E402
from benchmarks.record import Record  # noqa: E402
from benchmarks.status_probe import routable  # noqa: E402

DOLLARS_PER_MILLION_ACTIONS = 50.0
TARGET_PER_AGENT_HOUR = 60.0
OLD_HEARTBEAT_S = 10.0
LEGACY_NAMESPACE = "legacy"
REPO_ROOT = Path(__file__).resolve().parent.parent
RESYNC_SLOW_DEFAULT_S = lifecycle.RESYNC_S


def worker_full_collections(metrics_port: int) -> dict[str, float]:
    """The worker's full (generation 2) garbage collections so far, from its /metrics
    (`agentroster_worker_gc_pause_seconds`): how many, their seconds, how many took over 1 s and 2 s;
    and what it keeps out of them (`ops.heap`): the objects frozen now and its sweeps so far."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
    found = {
        (sample.name, sample.labels.get("le")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("agentroster_worker_gc_")
        for sample in family.samples if sample.labels.get("generation") in ("2", None)
    }
    every = found[("agentroster_worker_gc_pause_seconds_bucket", "+Inf")]
    return {
        "count": found[("agentroster_worker_gc_pause_seconds_count", None)],
        "seconds": found[("agentroster_worker_gc_pause_seconds_sum", None)],
        "over_1s": every - found[("agentroster_worker_gc_pause_seconds_bucket", "1.0")],
        "over_2s": every - found[("agentroster_worker_gc_pause_seconds_bucket", "2.0")],
        "frozen": found[("agentroster_worker_gc_frozen_objects", None)],
        "sweeps": found[("agentroster_worker_gc_sweeps_total", None)],
    }


def actions(metrics_port: int, namespace: str) -> dict[str, float]:
    """The server's `action` counter for `namespace`, by action type."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("action{") or f'namespace="{namespace}"' not in line:
            continue
        labels, value = line.rsplit(" ", 1)
        kind = labels.split('action_type="', 1)[1].split('"', 1)[0] if 'action_type="' in labels else "action"
        out[kind] = out.get(kind, 0.0) + float(value)
    return out


def registration(prefix: str, i: int, interval: float, endpoint: str = "") -> AgentRegistration:
    """Agent `i` of a simulated fleet; its endpoint under `endpoint` (a server answering /healthz), else one nobody answers."""
    return AgentRegistration(
        agent_id=f"{prefix}-{i:05d}",
        deployment=f"cost-{i % 5}",
        endpoint=f"{endpoint}/a{i}" if endpoint else f"http://10.2.{i // 250}.{i % 250}:8080",
        capabilities=[Capability(name=f"cost.skill{i % 5}", version="1.0.0", max_concurrency=2)],
        heartbeat_interval_s=interval,
    )


class Fleet_:
    """N simulated agents, each heartbeating from the moment it is registered, as the runtime
    does: its first beat's phase spread over the interval (independent agents do not beat in
    step), then every interval with the runtime's +/-10% jitter."""

    def __init__(self, roster: AgentRoster, prefix: str, agents: int, interval: float, endpoint: str = "") -> None:
        self.roster, self.prefix, self.agents, self.interval, self.endpoint = roster, prefix, agents, interval, endpoint
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.heartbeats = 0
        self.failures = 0
        self.register_retries = 0
        self.latencies: list[float] = []  # seconds per registration (the last attempt's)
        self.registered: set[int] = set()

    async def register(self, concurrency: int) -> float:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                # As the runtime, it beats from the moment it registers: a slow acknowledgement
                # must not outlast its liveness window.
                self.tasks.append(asyncio.create_task(self._beat(i)))
                for attempt in range(3):
                    try:
                        began = time.monotonic()
                        await self.roster.register(registration(self.prefix, i, self.interval, self.endpoint), timeout=120)
                        self.latencies.append(time.monotonic() - began)
                        break
                    except Exception as exc:  # noqa: BLE001 - a loaded machine: counted, tried again
                        self.register_retries += 1
                        print(f"    register {self.prefix}-{i} (attempt {attempt + 1}): {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                        if attempt == 2:
                            raise
            self.registered.add(i)

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(self.agents)))
        return time.monotonic() - started

    async def _beat(self, i: int) -> None:
        agent_id = registration(self.prefix, i, self.interval).agent_id
        pause = self.interval * ((i * 0.618) % 1.0)  # spread over the interval
        while True:
            try:
                await asyncio.wait_for(self.stop.wait(), pause)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self.roster.heartbeat(agent_id)
                self.heartbeats += 1
            except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not stop
                if i not in self.registered:
                    pause = self.interval  # not started yet, or the server is busy: next time (the runtime's rule)
                    continue
                self.failures += 1
                if self.failures <= 5:
                    print(f"    heartbeat {agent_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
            pause = self.interval * random.uniform(0.9, 1.1)  # the agent runtime's jitter, +/-10%

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def cost_phase(
    client: Client,
    *,
    namespace: str,
    metrics_port: int,
    agents: int,
    interval: float,
    warmup_s: float,
    window_s: float,
    time_scale: float,
    legacy: bool,
    register_concurrency: int,
) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:6]
    pool, queue = f"cost-{suffix}", f"cost-{suffix}"
    worker = create_worker(client, task_queue=queue, backend=NoneBackend())
    worker_task = asyncio.create_task(worker.run())
    roster = AgentRoster(client, pool=pool, task_queue=queue)
    fleet = Fleet_(roster, f"cost-{'old' if legacy else 'new'}", agents, interval)
    try:
        await roster.ensure_pool()
        registered_s = await fleet.register(register_concurrency)
        print(f"  [{namespace}] {agents} agents registered in {registered_s:.1f}s; warm-up {warmup_s:g}s, then counting for {window_s:g}s", flush=True)
        await asyncio.sleep(warmup_s)
        before = actions(metrics_port, namespace)
        started = time.monotonic()
        queries = 0
        latencies = []
        while time.monotonic() - started < window_s:
            t = time.monotonic()
            status = await roster.status()
            queries += 1
            latencies.append(time.monotonic() - t)
            await asyncio.sleep(max(0.0, min(10.0, window_s - (time.monotonic() - started))))
        window = time.monotonic() - started
        after = actions(metrics_port, namespace)
        routable = sum(1 for a in status.agents if a.state.value in ("Ready", "Busy"))
    finally:
        await fleet.close()
        await worker.shutdown()
        await worker_task
    by_type = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    real_hours = window * time_scale / 3600
    own = sum(v for k, v in by_type.items() if "query" in k.lower())
    total = sum(by_type.values())
    return {
        "agents": agents,
        "interval": interval,
        "registered_s": registered_s,
        "routable": routable,
        "window_s": window,
        "time_scale": time_scale,
        "per_agent_hour": (total - own) / agents / real_hours,
        "with_queries": total / agents / real_hours,
        "queries": queries,
        "by_type": {k: v / agents / real_hours for k, v in sorted(by_type.items()) if v},
        "status_p50_ms": statistics.median(latencies) * 1000,
        "heartbeat_failures": fleet.failures,
        "register_retries": fleet.register_retries,
    }


async def _terminated(roster: AgentRoster, agent_id: str) -> Any:
    try:
        status = await roster.describe(agent_id)
    except AgentNotFoundError:
        return None
    return status if status.state == AgentState.TERMINATED else None


async def crash_phase(client: Client, *, legacy: bool, interval: float, logs: Path) -> dict[str, Any]:
    """One real local agent, SIGKILLed: seconds until its workflow is Terminated, and why."""
    suffix = uuid.uuid4().hex[:6]
    pool, queue = f"crash-{suffix}", f"crash-{suffix}"
    roster = AgentRoster(client, pool=pool, task_queue=queue)
    fleet = Fleet(
        defaults=FleetDefaults(heartbeat_interval_s=interval),
        deployments=[DeploymentSpec(name="math-agent", command=["{python}", "-m", "examples.math_agent"], replicas=1, min=1, max=1)],
        base_dir=REPO_ROOT,
    )
    backend = LocalBackend(fleet=fleet, roster=roster, reconcile_interval_s=0.5, stop_grace_s=10, log_dir=logs / suffix)
    worker = create_worker(
        client,
        task_queue=queue,
        backend=backend,
        report_agents_gone=not legacy,
    )
    worker_task = asyncio.create_task(worker.run())
    try:
        await roster.ensure_pool()
        deadline = time.monotonic() + 60
        while not (found := await roster.find("math.eval")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local agent did not register: see {logs / suffix}")
            await asyncio.sleep(0.2)
        agent_id = found[0]
        pid = next(p.pid for p in backend.pods() if p.agent_id == agent_id)
        assert pid is not None
        killed = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        limit = killed + MISSED_HEARTBEATS * interval + 60
        while not (status := await _terminated(roster, agent_id)):
            if time.monotonic() > limit:
                raise RuntimeError(f"agent {agent_id} was not declared gone within {limit - killed:.0f}s")
            await asyncio.sleep(0.05)
        return {"seconds": time.monotonic() - killed, "reason": status.terminated_reason, "interval": interval}
    finally:
        await worker.shutdown()
        await worker_task


def show(label: str, r: dict[str, Any]) -> None:
    saved = RESYNC_SLOW_DEFAULT_S
    scale = f", time compressed {r['time_scale']:g}x (heartbeat {r['interval']:g}s, resync {saved / r['time_scale']:g}s) and scaled back to real hours" if r["time_scale"] != 1 else ""
    dollars = r["per_agent_hour"] * 1000 * 24 * DOLLARS_PER_MILLION_ACTIONS / 1e6
    print(f"{label}: {r['agents']} agents, measured over {r['window_s']:.0f}s{scale}")
    print(f"  actions per agent-hour while idle: {r['per_agent_hour']:.1f} (~${dollars:,.2f} a day for 1,000 agents at ${DOLLARS_PER_MILLION_ACTIONS:g}/M); "
          f"{r['with_queries']:.1f} with this benchmark's {r['queries']} status queries")
    for kind, value in r["by_type"].items():
        print(f"    {kind:<45} {value:8.1f}")
    print(f"  registration: {r['agents']} routable in {r['registered_s']:.1f}s; routable at the end: {r['routable']}; "
          f"status p50 {r['status_p50_ms']:.0f} ms; failed heartbeats: {r['heartbeat_failures']}; registrations retried: {r['register_retries']}")


async def run_cost(args: argparse.Namespace, rec: Record) -> int:
    """Goal 1: both phases and both crashes on one dev server; the figures and targets go into `rec`."""
    rec.load = (
        f"{args.agents} idle agents per phase on one dev server; after phase time-compressed {args.time_scale:g}x"
        + ("; no before phase" if args.skip_before else f"; before phase {args.before_window:g} s at a {OLD_HEARTBEAT_S:g} s heartbeat")
    )
    os.environ.setdefault("AGENTROSTER_LEASE_KEY", "base64:" + base64.b64encode(secrets.token_bytes(32)).decode())
    metrics_port = free_port()
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--metrics-port", str(metrics_port), "--namespace", LEGACY_NAMESPACE],
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    address = env.client.service_client.config.target_host
    legacy_client = await Client.connect(address, namespace=LEGACY_NAMESPACE, data_converter=pydantic_data_converter)
    k = args.time_scale
    saved = lifecycle.RESYNC_S
    logs = Path(tempfile.mkdtemp(prefix="bench-cost-"))
    load_before = os.getloadavg()
    try:
        old = None if args.skip_before else await cost_phase(
            legacy_client, namespace=LEGACY_NAMESPACE, metrics_port=metrics_port, agents=args.agents, interval=OLD_HEARTBEAT_S,
            warmup_s=OLD_HEARTBEAT_S, window_s=args.before_window, time_scale=1.0, legacy=True,
            register_concurrency=args.register_concurrency,
        )
        if old is not None:
            show(f"before: {OLD_HEARTBEAT_S:g}s heartbeat, old heartbeat", old)
        lifecycle.RESYNC_S = saved / k  # read by the workflows this process runs (core is passed through)
        interval = DEFAULT_HEARTBEAT_INTERVAL_S / k
        new = await cost_phase(
            env.client, namespace="default", metrics_port=metrics_port, agents=args.agents, interval=interval,
            warmup_s=MISSED_HEARTBEATS * interval + interval, window_s=args.after_window or 2 * saved / k, time_scale=k, legacy=False,
            register_concurrency=args.register_concurrency,
        )
        lifecycle.RESYNC_S = saved
        show(f"after: defaults ({DEFAULT_HEARTBEAT_INTERVAL_S:g}s heartbeat, resync {saved:g}s)", new)
        crash_new = await crash_phase(env.client, legacy=False, interval=DEFAULT_HEARTBEAT_INTERVAL_S, logs=logs)
        crash_old = None if args.skip_old_crash else await crash_phase(legacy_client, legacy=True, interval=OLD_HEARTBEAT_S, logs=logs)
    finally:
        lifecycle.RESYNC_S = saved
        await env.shutdown()
    load_after = os.getloadavg()

    print(f"== goal 1: actions per idle agent-hour, one dev server, same run ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}) ==")
    if old is not None:
        show(f"before: {OLD_HEARTBEAT_S:g}s heartbeat, old heartbeat", old)
    show(f"after: defaults ({DEFAULT_HEARTBEAT_INTERVAL_S:g}s heartbeat, resync {saved:g}s)", new)
    if old is not None:
        ratio = old["per_agent_hour"] / new["per_agent_hour"] if new["per_agent_hour"] else float("inf")
        print(f"  after/before: {new['per_agent_hour']:.1f} / {old['per_agent_hour']:.1f} actions per agent-hour ({ratio:.1f}x fewer)")
    print(f"  target: <= {TARGET_PER_AGENT_HOUR:g} actions per agent-hour at the defaults")
    print("== crash detection: a local agent killed with SIGKILL ==")
    print(f"  after: Terminated in {crash_new['seconds']:.2f}s ({crash_new['reason']}; heartbeat {crash_new['interval']:g}s, window {MISSED_HEARTBEATS * crash_new['interval']:g}s)")
    if crash_old:
        print(f"  before: Terminated in {crash_old['seconds']:.2f}s ({crash_old['reason']}; heartbeat {crash_old['interval']:g}s, window {MISSED_HEARTBEATS * crash_old['interval']:g}s)")
    print(f"  load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs (a shared machine)")
    for phase, r in (("before", old), ("after", new)):
        if r is None:
            continue
        rec.figure(f"{phase}_actions_per_agent_hour", round(r["per_agent_hour"], 1))
        for kind, value in r["by_type"].items():
            rec.figure(f"{phase}_{'_'.join(''.join(c if c.isalnum() else ' ' for c in kind).split())}", round(value, 1))
    rec.figure("after_crash_to_terminated_s", round(crash_new["seconds"], 2), unit="s")
    if crash_old:
        rec.figure("before_crash_to_terminated_s", round(crash_old["seconds"], 2), unit="s")
        rec.target("crash_to_terminated_s_vs_before", value=round(crash_new["seconds"], 2), goal=round(crash_old["seconds"], 2), op="<=", unit="s")
    rec.target("actions_per_idle_agent_hour", value=round(new["per_agent_hour"], 1), goal=TARGET_PER_AGENT_HOUR, op="<=")
    ok = rec.met
    if not ok:
        print("TARGET MISSED")
    return 0 if ok else 1


# The fleet's targets (issue 30, item 3): what `report_fleet` judges.
FLEET_ROUTABLE_WITHIN_S = 600.0
FLEET_STATUS_MAX_S = 1.0
FLEET_CPU_MAX = 1.0  # worker + server, in cores
FLEET_ACTIONS_MAX = 30.0  # per idle agent-hour
FLEET_REGISTER_CONCURRENCY = 128
FLEET_STATUS_EVERY_S = 15.0
FLEET_ACQUIRES = 300


FLEET_AGENTS_PER_SHARD = 2500


def fleet_layout(agents: int) -> str:
    """The shard layout docs/concepts/shards.md recommends for a pool of `agents` agents: one
    shard per 2,500 agents (rounded up), placed by agent."""
    shards = -(-agents // FLEET_AGENTS_PER_SHARD)
    return "1" if shards <= 1 else f"{shards}:agent"


def fleet_workflow_cache(agents: int) -> int:
    """The worker's workflow cache docs/configuration.md recommends: every agent workflow it serves, and its pool's."""
    return max(2000, agents + 100)


@contextlib.asynccontextmanager
async def healthz_server() -> Any:
    """One HTTP server that answers `GET .../healthz` 200 for every simulated agent (the pool
    checks idle agents every 5 minutes, and recycles those that fail); yields its base URL."""
    from aiohttp import web

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{agent}/healthz", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _routable(roster: AgentRoster) -> int:
    """Routable agents in the pool's status over every shard (`status_probe.routable`)."""
    return routable(await roster.status())


async def fleet_benchmark(
    agents: int,
    *,
    shards: str,
    register_concurrency: int = FLEET_REGISTER_CONCURRENCY,
    warmup_s: float = MISSED_HEARTBEATS * DEFAULT_HEARTBEAT_INTERVAL_S,
    window_s: float = MISSED_HEARTBEATS * DEFAULT_HEARTBEAT_INTERVAL_S,
    acquires: int = FLEET_ACQUIRES,
    workflow_cache: int = 0,
    logs: Path,
) -> dict[str, Any]:
    """`agents` agents at the default interval, one worker process, one dev server; the figures.

    The worker runs as its own process (`agentroster worker`), so its CPU is measured apart
    from this process, which registers the agents and sends their heartbeats."""
    layout = ShardLayout.parse(shards)
    metrics_port = free_port()
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--metrics-port", str(metrics_port)],
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    address = env.client.service_client.config.target_host
    extra = {
        "AGENTROSTER_POOL_SHARDS": shards,
        "AGENTROSTER_LEASE_KEY": "insecure-no-auth",  # the agents are never called
        # Compiled bytecode cached, as a deployed worker has it: the sandbox imports each
        # workflow's module again for every run it creates.
        "PYTHONDONTWRITEBYTECODE": "",
        "PYTHONPYCACHEPREFIX": str(Path(tempfile.gettempdir()) / "agentroster-bench-pycache"),
    }
    if workflow_cache:
        extra["AGENTROSTER_WORKFLOW_CACHE"] = str(workflow_cache)
    # The worker's /metrics, read at the idle window's edges and at the end for its garbage
    # collection pauses (each read also queries the pool's status once).
    worker_metrics_port = free_port()
    extra.update(AGENTROSTER_METRICS_PORT=str(worker_metrics_port), AGENTROSTER_SDK_METRICS="off")
    worker = WorkerProcess(address, "fleet", "fleet", logs / "worker.log", **extra)
    roster = AgentRoster(env.client, pool="fleet", task_queue="fleet", shards=layout)
    interval = DEFAULT_HEARTBEAT_INTERVAL_S
    stack = contextlib.AsyncExitStack()
    fleet = Fleet_(roster, "fleet", agents, interval, endpoint=await stack.enter_async_context(healthz_server()))
    out: dict[str, Any] = {
        "agents": agents, "interval": interval, "shards": shards, "register_concurrency": register_concurrency,
        "warmup_s": warmup_s, "window_s": window_s, "load_before": os.getloadavg()[0], "failed_queries": [],
        "latencies": [], "status_split": [], "registered_s": None, "all_routable_s": None, "routable": None, "workflow_cache": workflow_cache,
    }

    async def routable_now() -> int | None:
        try:
            return await _routable(roster)
        except Exception as exc:  # noqa: BLE001 - a failed query is a figure (e.g. the 2 s deadlock detector)
            out["failed_queries"].append(f"{type(exc).__name__}: {str(exc)[:160]}")
            return None

    try:
        await worker.start()
        await roster.ensure_pool()
        server = dev_server_pids()
        cpu0, srv0 = cpu_seconds(worker.process.pid), sum(cpu_seconds(p) for p in server)
        t0 = time.monotonic()
        phases = out["phases"] = [("registration", time.time())]  # wall-clock starts: which phase a timed-out task fell in
        try:
            out["registered_s"] = await fleet.register(register_concurrency)
        except Exception as exc:  # noqa: BLE001 - reported as a missed target, not a traceback
            out["register_error"] = f"after {time.monotonic() - t0:.0f}s: {type(exc).__name__}: {exc}"
            return out
        finally:
            out["register_retries"] = fleet.register_retries
            out["register_latencies"] = list(fleet.latencies)
        registered_s = out["registered_s"]
        out["reg_cpu"] = (cpu_seconds(worker.process.pid) - cpu0) / registered_s
        out["reg_srv"] = (sum(cpu_seconds(p) for p in server) - srv0) / registered_s
        print(f"  {agents} agents registered in {registered_s:.1f}s ({fleet.register_retries} retried); "
              f"waiting until the pool's status shows all routable", flush=True)
        # All routable as a user sees it: the pool's status (over every shard) counts them.
        give_up = max(t0 + FLEET_ROUTABLE_WITHIN_S * 1.5, time.monotonic() + 300.0)
        while True:
            out["routable_after_register"] = routable = await routable_now()
            if routable == agents:
                out["all_routable_s"] = time.monotonic() - t0
                break
            if time.monotonic() > give_up:
                break
            await asyncio.sleep(5.0)
        print(f"  all routable after {out['all_routable_s'] or float('nan'):.1f}s; warm-up {warmup_s:g}s, "
              f"then {window_s:g}s idle with a status query every {FLEET_STATUS_EVERY_S:g}s", flush=True)
        phases.append(("warm-up", time.time()))
        await asyncio.sleep(warmup_s)
        phases.append(("idle window", time.time()))
        gc_before = await asyncio.to_thread(worker_full_collections, worker_metrics_port)
        before = actions(metrics_port, "default")
        cpu1, srv1, started = cpu_seconds(worker.process.pid), sum(cpu_seconds(p) for p in server), time.monotonic()
        # The status calls come from a process of their own, as an operator's would (status_probe.py).
        probe = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).with_name("status_probe.py")), address, "fleet", shards,
            str(FLEET_STATUS_EVERY_S), str(window_s), stdout=asyncio.subprocess.PIPE, env=child_env(),
        )
        probe_out, _ = await probe.communicate()
        window = out["window_s"] = time.monotonic() - started
        out["worker_cpu"] = (cpu_seconds(worker.process.pid) - cpu1) / window
        out["server_cpu"] = (sum(cpu_seconds(p) for p in server) - srv1) / window
        after = actions(metrics_port, "default")
        for line in probe_out.decode().splitlines():
            try:
                reading = json.loads(line)
            except ValueError:
                reading = {"error": f"the status probe said: {line[:160]}"}
            if "error" in reading:
                out["failed_queries"].append(reading["error"])
            else:
                out["routable"] = reading["routable"]
                out["latencies"].append(reading["s"])
                out["status_split"].append((reading["queries_s"], reading["decode_merge_s"]))
        if probe.returncode:
            out["failed_queries"].append(f"the status probe exited {probe.returncode}")
        gc_after = await asyncio.to_thread(worker_full_collections, worker_metrics_port)
        out["gc_window"] = {k: gc_after[k] - gc_before[k] for k in gc_after}
        by_type = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        hours = window / 3600
        out["status_queries"] = len(out["latencies"]) + len(out["failed_queries"])
        queries = sum(v for k, v in by_type.items() if "query" in k.lower())
        out["per_agent_hour"] = (sum(by_type.values()) - queries) / agents / hours
        out["by_type"] = {k: v / agents / hours for k, v in sorted(by_type.items()) if v and "query" not in k.lower()}
        out["rss_mib"], out["server_rss_mib"] = rss_mib(worker.process.pid), sum(rss_mib(p) for p in server)
        # Acquire (+ release) while the fleet idles: one caller, one lease at a time.
        phases.append(("acquires", time.time()))
        acquire_s, cycle_s, out["acquire_errors"] = [], [], []
        for k in range(acquires):
            t = time.monotonic()
            try:
                lease = await roster.acquire(f"cost.skill{k % 5}", timeout=30)
                acquire_s.append(time.monotonic() - t)
                await roster.release(lease)
                cycle_s.append(time.monotonic() - t)
            except Exception as exc:  # noqa: BLE001 - a failed acquire is a figure
                out["acquire_errors"].append(f"after {time.monotonic() - t:.1f}s: {type(exc).__name__}: {str(exc)[:200]}")
                print(f"    acquire {k}: {out['acquire_errors'][-1]}", file=sys.stderr, flush=True)
                if len(out["acquire_errors"]) >= 3:
                    break  # a pool that does not answer: said, not waited out 300 times
        out["acquire_s"], out["cycle_s"] = acquire_s or [float("nan")], cycle_s or [float("nan")]
        out["routable_end"] = await routable_now()
        out["gc_run"] = await asyncio.to_thread(worker_full_collections, worker_metrics_port)
        out["heartbeat_failures"] = fleet.failures
        out["pool_tasks"] = [
            PoolTasks.of(await history_counts(env.client, pool_workflow_id("fleet", shard=k))) for k in range(layout.shards)
        ]
        timeouts = [
            t for k in range(layout.shards) for t in await pool_task_timeouts(env.client, pool_workflow_id("fleet", shard=k), logs, phases)
        ]
        out["timeouts"] = [line for _, line in timeouts]
        out["timeouts_by_phase"] = {name: sum(1 for phase, _ in timeouts if phase == name) for name, _ in phases}
    finally:
        await fleet.close()
        await worker.terminate()
        await roster.close()
        await env.shutdown()
        await stack.aclose()
        out["load_after"] = os.getloadavg()[0]
    return out


async def pool_task_timeouts(
    client: Client, workflow_id: str, logs: Path, phases: list[tuple[str, float]]
) -> list[tuple[str, str]]:
    """Every WorkflowTaskTimedOut of a pool's runs, each with what led to it: its timeout type,
    the run's history length then, how long the task waited to start and ran, and the events
    it carried (since the previous task completed), as (the phase of the run it fell in, the line).
    Each run's history is kept under `logs`."""
    found: list[tuple[str, str]] = []
    histories = [await fetch_history(client, workflow_id, run_id) for run_id in await run_ids(client, workflow_id)]
    histories.sort(key=lambda h: h.events[0].event_time.ToDatetime())
    for n, history in enumerate(histories, start=1):
        (logs / f"{workflow_id.replace('/', '_')}-run{n}.json").write_text(history.to_json())
        events = history.events
        carried: dict[str, int] = {}
        scheduled = started = None
        for event in events:
            kind = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")
            at = event.event_time.ToDatetime(tzinfo=timezone.utc).timestamp()
            if kind == "WORKFLOW_TASK_SCHEDULED":
                scheduled, started = at, None
            elif kind == "WORKFLOW_TASK_STARTED":
                started = at
            elif kind == "WORKFLOW_TASK_COMPLETED":
                carried = {}
            elif kind == "WORKFLOW_TASK_TIMED_OUT":
                timeout = TimeoutType.Name(event.workflow_task_timed_out_event_attributes.timeout_type).removeprefix("TIMEOUT_TYPE_")
                if started is None:
                    when = f"not started {at - scheduled:.2f} s after it was scheduled" if scheduled is not None else "not started"
                else:
                    when = f"started {started - scheduled:.2f} s after it was scheduled, ran {at - started:.2f} s" if scheduled is not None else ""
                what = ", ".join(f"{v} {k.lower()}" for k, v in sorted(carried.items(), key=lambda kv: -kv[1]))
                phase = next((name for name, start in reversed(phases) if at >= start), "before the registration")
                found.append((phase, f"{workflow_id} run {n} event {event.event_id}/{len(events)} ({phase}): {timeout}, {when}; "
                                     f"carried {what or 'nothing new'}"))
            elif not kind.startswith("WORKFLOW_TASK_"):
                carried[kind] = carried.get(kind, 0) + 1
    return found


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]


def report_fleet(r: dict[str, Any], rec: Record | None = None) -> bool:
    """Print the fleet's figures beside its targets; True when every target is met."""
    agents = r["agents"]
    print(f"== {agents:,} agents, {r['interval']:g}s heartbeat, shards {r['shards']}, one worker process, one dev server "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs, load average "
          f"{r['load_before']:.2f} before, {r['load_after']:.2f} after: a shared machine) ==")
    if r.get("register_error"):
        print(f"  registration ({r['register_concurrency']} at a time) failed {r['register_error']} "
              f"({r.get('register_retries', 0)} registrations retried)")
        print("TARGET MISSED")
        if rec is not None:
            rec.target("registration_completed", value=0, goal=1, op="==")
        return False
    mark = {True: "met", False: "MISSED"}
    lat = sorted(r["register_latencies"]) or [0.0]
    routable_s = r["all_routable_s"]
    tasks = r["pool_tasks"]
    cpu = r["worker_cpu"] + r["server_cpu"]
    checks = {
        "routable in time": routable_s is not None and routable_s <= FLEET_ROUTABLE_WITHIN_S,
        "all routable": r["routable"] == agents and r["routable_end"] == agents,
        "status max": bool(r["latencies"]) and max(r["latencies"]) < FLEET_STATUS_MAX_S and not r["failed_queries"],
        "cpu": cpu < FLEET_CPU_MAX,
        "actions": r["per_agent_hour"] <= FLEET_ACTIONS_MAX,
        # The pool's short workflow task timeout (wire.WORKFLOW_TASK_TIMEOUT) must hold under this load.
        "pool tasks": all(t.ok for t in tasks),
    }
    print(f"  {'measure':<50} {'figure':<36} target")
    figure = f"{routable_s:.1f} s" if routable_s is not None else "never"
    print(f"  {'all routable (status) after the first register call':<50} {figure:<36} "
          f"<= {FLEET_ROUTABLE_WITHIN_S:g} s: {mark[checks['routable in time']]}")
    print(f"    (registered in {r['registered_s']:.1f} s, {agents / r['registered_s']:.1f}/s, {r['register_concurrency']} at a time; "
          f"each took p50 {statistics.median(lat):.2f} s, max {lat[-1]:.2f} s; {r['register_retries']} retried; "
          f"CPU meanwhile: server {r['reg_srv']:.0%}, worker {r['reg_cpu']:.0%} of a core)")
    routable = f"{r['routable']} / {r['routable_end']}"
    print(f"  {'routable after the idle window / at the end':<50} {routable:<36} all {agents}: {mark[checks['all routable']]}")
    window = f"{r['window_s']:.0f} s idle after {r['warmup_s']:.0f} s of warm-up"
    figure = f"{r['server_cpu']:.1%} + {r['worker_cpu']:.1%} = {cpu:.1%}"
    print(f"  {'idle CPU, server + worker (' + window + ')':<50} {figure:<36} < {FLEET_CPU_MAX:.0%} of a core: {mark[checks['cpu']]}")
    print(f"  {'actions per idle agent-hour (server `action` counter)':<50} {r['per_agent_hour']:<36.1f} "
          f"<= {FLEET_ACTIONS_MAX:g}: {mark[checks['actions']]}")
    for kind, value in r["by_type"].items():
        print(f"    {kind:<48} {value:.1f}")
    ahead_s = lifecycle.WAKE_AHEAD_HEARTBEATS * r["interval"]
    print(f"    (floor at the defaults: {3600 / r['interval']:.0f} heartbeat signals, {3600 / (2 * r['interval']):.1f} liveness timers "
          f"(one armed at every second heartbeat), and the 30-min resync's activity and signal-with-start, each about "
          f"{3600 / (lifecycle.resync_interval(r['interval']) - ahead_s / 2):.1f} an hour once the registrations' first resyncs "
          f"are past: a heartbeat up to {ahead_s:g} s before it is due takes it)")
    if r["latencies"]:
        figure = f"max {max(r['latencies']) * 1000:.0f} ms (p50 {statistics.median(r['latencies']) * 1000:.0f})"
        what = f"status over the shards, {len(r['latencies'])} while idle"
        print(f"  {what:<50} {figure:<36} "
              f"max < {FLEET_STATUS_MAX_S * 1000:.0f} ms: {mark[checks['status max']]}")
        if r.get("status_split"):
            print(f"    (just after each: the shards' queries alone p50 {statistics.median(q for q, _ in r['status_split']) * 1000:.0f} ms, "
                  f"decoding and merging their replies p50 {statistics.median(d for _, d in r['status_split']) * 1000:.0f} ms)")
    if r["failed_queries"]:
        print(f"    status queries that failed: {len(r['failed_queries'])}, e.g. {r['failed_queries'][0]}")
    acq, cyc = r["acquire_s"], r["cycle_s"]
    checks["acquires"] = not r["acquire_errors"]
    if r["acquire_errors"]:
        print(f"  acquires that failed: {len(r['acquire_errors'])} of {len(acq) + len(r['acquire_errors'])}, e.g. {r['acquire_errors'][0]}: MISSED")
    what = f"acquire / acquire + release, {len(acq)} one at a time"
    print(f"  {what:<50} "
          f"p50 {statistics.median(acq) * 1000:.0f} / {statistics.median(cyc) * 1000:.0f} ms, "
          f"p99 {_pct(acq, 0.99) * 1000:.0f} / {_pct(cyc, 0.99) * 1000:.0f} ms")
    print(f"  {'memory (RSS): worker / server':<50} {r['rss_mib']:.0f} / {r['server_rss_mib']:.0f} MiB "
          f"(workflow cache {r['workflow_cache'] or 'default'}; {r['heartbeat_failures']} heartbeats failed)")
    if "gc_window" in r:
        w, whole = r["gc_window"], r["gc_run"]
        print(f"  {'worker full garbage collections (generation 2)':<50} "
              f"{w['count']:.0f} in the idle window, {w['seconds']:.1f} s in all, {w['over_1s']:.0f} over 1 s, {w['over_2s']:.0f} over 2 s; "
              f"whole run: {whole['count']:.0f}, {whole['over_2s']:.0f} over 2 s")
        print(f"  {'objects kept out of them (frozen) / sweeps':<50} {whole['frozen']:,.0f} at the end; "
              f"{w['sweeps']:.0f} sweeps in the idle window, {whole['sweeps']:.0f} in the whole run")
    figure = " ".join(f"{t.timed_out}/{t.failed}" for t in tasks) + f" over {sum(t.runs for t in tasks)} run(s)"
    print(f"  {'pool workflow tasks timed out / failed (per shard)':<50} {figure:<36} 0 / 0: {mark[checks['pool tasks']]}")
    by_phase = r.get("timeouts_by_phase", {})
    if any(by_phase.values()):
        print("    timed out by phase: " + ", ".join(f"{phase} {n}" for phase, n in by_phase.items()))
    for line in r.get("timeouts", [])[:40]:
        print(f"    {line}")
    if rec is not None:
        rec.load = (f"{agents:,} idle agents, heartbeat {r['interval']:g} s, shards {r['shards']}, one worker process, one dev server; "
                    f"{r['register_concurrency']} registrations at a time; {r['window_s']:.0f} s idle window after {r['warmup_s']:.0f} s")
        rec.figure("agents", agents)
        rec.figure("shards", r["shards"])
        rec.figure("registered_s", round(r["registered_s"], 1), unit="s")
        rec.target("all_routable_s", value=round(routable_s, 1) if routable_s is not None else -1,
                   goal=FLEET_ROUTABLE_WITHIN_S, op="<=", unit="s")
        if routable_s is None:
            rec.targets["all_routable_s"]["met"] = False
        rec.target("agents_routable_at_end", value=r["routable_end"] or 0, goal=agents, op="==")
        rec.figure("idle_cpu_server", round(r["server_cpu"], 3), unit="cores")
        rec.figure("idle_cpu_worker", round(r["worker_cpu"], 3), unit="cores")
        rec.target("idle_cpu_server_plus_worker", value=round(cpu, 3), goal=FLEET_CPU_MAX, op="<=", unit="cores")
        rec.target("actions_per_idle_agent_hour", value=round(r["per_agent_hour"], 1), goal=FLEET_ACTIONS_MAX, op="<=")
        for kind, value in r["by_type"].items():
            rec.figure(f"actions_{'_'.join(''.join(c if c.isalnum() else ' ' for c in kind).split())}", round(value, 1))
        if r["latencies"]:
            rec.figure("status_p50_ms", round(statistics.median(r["latencies"]) * 1000), unit="ms")
        if r.get("status_split"):
            rec.figure("status_queries_alone_p50_ms", round(statistics.median(q for q, _ in r["status_split"]) * 1000), unit="ms")
            rec.figure("status_decode_merge_p50_ms", round(statistics.median(d for _, d in r["status_split"]) * 1000), unit="ms")
        rec.target("status_max_ms", value=round(max(r["latencies"]) * 1000) if r["latencies"] else -1,
                   goal=FLEET_STATUS_MAX_S * 1000, op="<=", unit="ms")
        rec.target("status_queries_failed", value=len(r["failed_queries"]), goal=0, op="==")
        rec.target("acquires_failed", value=len(r["acquire_errors"]), goal=0, op="==")
        for error in r["acquire_errors"][:3]:
            rec.notes.append(f"acquire failed {error}")
        rec.figure("acquire_p50_ms", round(statistics.median(acq) * 1000, 1), unit="ms")
        rec.figure("acquire_p99_ms", round(_pct(acq, 0.99) * 1000, 1), unit="ms")
        rec.figure("acquire_release_p50_ms", round(statistics.median(cyc) * 1000, 1), unit="ms")
        rec.figure("acquire_release_p99_ms", round(_pct(cyc, 0.99) * 1000, 1), unit="ms")
        rec.figure("worker_rss_mib", round(r["rss_mib"]), unit="MiB")
        rec.figure("server_rss_mib", round(r["server_rss_mib"]), unit="MiB")
        rec.figure("heartbeat_failures", r["heartbeat_failures"])
        if "gc_window" in r:
            rec.figure("worker_gc_full_in_window", int(r["gc_window"]["count"]))
            rec.figure("worker_gc_full_seconds_in_window", round(r["gc_window"]["seconds"], 2), unit="s")
            rec.figure("worker_gc_full_over_2s_in_window", int(r["gc_window"]["over_2s"]))
            rec.figure("worker_gc_full_whole_run", int(r["gc_run"]["count"]))
            rec.figure("worker_gc_full_over_2s_whole_run", int(r["gc_run"]["over_2s"]))
            rec.figure("worker_gc_frozen_objects", int(r["gc_run"]["frozen"]))
            rec.figure("worker_gc_sweeps_in_window", int(r["gc_window"]["sweeps"]))
            rec.figure("worker_gc_sweeps_whole_run", int(r["gc_run"]["sweeps"]))
        rec.target("pool_workflow_tasks_timed_out_or_failed", value=sum(t.timed_out + t.failed for t in tasks), goal=0, op="==")
        for phase, n in by_phase.items():
            rec.figure(f"pool_tasks_timed_out_{phase.replace(' ', '_').replace('-', '_')}", n)
        for line in r.get("timeouts", [])[:10]:
            rec.notes.append(f"pool workflow task timed out: {line}")
    ok = all(checks.values())
    if not ok:
        print("TARGET MISSED")
    return ok


def run_fleet(args: argparse.Namespace, rec: Record | None = None) -> bool:
    """The fleet, for `main` and `benchmarks/run.py`: run it, print its figures beside the targets, True when all are met."""
    logs = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    print(f"  the worker's log: {logs / 'worker.log'}", flush=True)
    figures = asyncio.run(fleet_benchmark(
        args.fleet, shards=args.shards or fleet_layout(args.fleet),
        register_concurrency=args.register_concurrency or FLEET_REGISTER_CONCURRENCY,
        warmup_s=args.fleet_warmup, window_s=args.fleet_window, acquires=args.acquires,
        workflow_cache=args.workflow_cache or fleet_workflow_cache(args.fleet), logs=logs,
    ))
    return report_fleet(figures, rec)


def main(argv: list[str] | None = None, rec: Record | None = None) -> int:
    """Goal 1, or goal 2 with --fleet; writes the run's record (or fills `rec`, which the caller writes)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--time-scale", type=float, default=12.0, help="run the after phase this many times faster (1: real time)")
    parser.add_argument("--before-window", type=float, default=120.0, help="seconds counted in the before phase")
    parser.add_argument("--after-window", type=float, default=0.0, help="seconds counted in the after phase (default: two resync intervals)")
    parser.add_argument("--skip-before", action="store_true", help="skip the before phase (e.g. beside a real-time after run)")
    parser.add_argument("--skip-old-crash", action="store_true", help="skip the before crash (it waits out a 30 s window)")
    parser.add_argument("--register-concurrency", type=int, default=None,
                        help=f"registrations at a time (default: 16; with --fleet {FLEET_REGISTER_CONCURRENCY})")
    parser.add_argument("--fleet", type=int, default=0, help="the fleet instead: this many agents at the default interval")
    parser.add_argument("--shards", default="", help="the --fleet pool's shard layout (default: docs/concepts/shards.md's for its size)")
    parser.add_argument("--workflow-cache", type=int, default=0, help="the --fleet worker's AGENTROSTER_WORKFLOW_CACHE (default: every agent's run)")
    parser.add_argument("--fleet-warmup", type=float, default=MISSED_HEARTBEATS * DEFAULT_HEARTBEAT_INTERVAL_S,
                        help="seconds between all routable and the idle window (default: one liveness window)")
    parser.add_argument("--fleet-window", type=float, default=MISSED_HEARTBEATS * DEFAULT_HEARTBEAT_INTERVAL_S,
                        help="seconds of the idle window (default: one liveness window)")
    parser.add_argument("--acquires", type=int, default=FLEET_ACQUIRES, help="acquires (+ releases) timed after the idle window")
    args = parser.parse_args(argv)
    own = rec is None
    rec = rec if rec is not None else Record("fleet" if args.fleet else "cost")
    if args.fleet:
        code = 0 if run_fleet(args, rec) else 1
    else:
        args.register_concurrency = args.register_concurrency or 16
        code = asyncio.run(run_cost(args, rec))
    if own:
        rec.write()
    return code


if __name__ == "__main__":
    sys.exit(main())
