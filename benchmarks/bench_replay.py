"""How long a cold replay of one pool run takes, by the run's length.

A worker that lost its cache (restarted, or evicted the run) replays the pool's
whole current run inside one workflow task, which must finish within the pool's
workflow task timeout (`wire.pool_task_timeout`, 2 s) on a loaded worker; every
continue-as-new costs callers a stall. This benchmark measures what bounds a run:

- on the tuned dev server with the worker in its own process (`bench_pool.dev_stack`),
  one pool started with its run limits raised (1,950 updates, under the server's 2,000
  per run; a run then ends at the pool's 4 MiB history cap, about 9,000 events and 940
  updates with this traffic) carries acquire+release traffic from 8 clients of the real `AgentRoster` over
  8 agents with 2 slots each (the 4 cheaper ones are full most of the time: the pool
  tells them about their load);
- the same with 1,000 idle agents registered first (the bigger pool);
- every finished run's history, and prefixes of it ending at a workflow task (a run
  that continued as new at that length), is replayed with `temporalio.worker.Replayer`
  as the worker runs workflows (`workflow_classes()`, the worker's runner with the
  sandbox, the pydantic converter), several times each: median and maximum ms, ms per
  event and per workflow task;
- for each pool, from the medians and from the maxima (a straight line through ms
  against events), the run length whose cold replay takes a third of the pool's task
  timeout; the target: a run cut where the default limits (`PoolInput`) end it replays
  within that third.

Run: ``python benchmarks/bench_replay.py`` (about 10 min on a busy 2-core machine);
``--agents 0`` skips the bigger pool. ``--replay FILE`` replays one saved history (``--save DIR`` keeps them)
in a loop, for a profiler: ``py-spy record -f raw -o out.txt -- python
benchmarks/bench_replay.py --replay DIR/big-run2.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_pool import TASK_QUEUE, dev_stack  # noqa: E402
from benchmarks.record import Record  # noqa: E402

# Raised run limits: a run ends at the server's update limit (2,000 per run) or earlier.
RAISED_UPDATES = 1_950
RAISED_SIGNALS = 9_000
RAISED_EVENTS = 50_000
PREFIXES = (1_500, 3_000, 6_000, 9_000, 12_000)
CLIENTS = 8
SLOTS = 2
REPEATS = 5
LONG = 4_000  # histories longer than this are replayed half as often (each takes seconds)

_TASK_DONE = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
_UPDATE = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
_SIGNAL = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED


class _Healthy(http.server.BaseHTTPRequestHandler):
    """Every agent's `GET /healthz` answers 200 (the pool checks idle agents every 5 minutes)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def health_server() -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def registration(pool: str, prefix: str, i: int, port: int, cost_class: str) -> Any:
    from agentroster.models import AgentRegistration, Capability

    return AgentRegistration(
        agent_id=f"{prefix}-{i}",
        deployment=f"{pool}-{prefix}",
        endpoint=f"http://127.0.0.1:{port}/{prefix}-{i}",
        heartbeat_interval_s=3600,
        capabilities=[Capability(name="rag.search", version="2.1.0", max_concurrency=SLOTS, cost_class=cost_class)],  # type: ignore[arg-type]
    )


async def start_pool(client: Client, pool: str) -> None:
    """The pool's workflow as `AgentRoster.ensure_pool` starts it, with the run limits raised."""
    from agentroster.client.roster import pool_start_options
    from agentroster.vocabulary.shards import ShardLayout
    from agentroster.vocabulary.wire import PoolInput
    from agentroster.workflows.pool import PoolWorkflow

    options = pool_start_options(pool, 0, ShardLayout())
    options["arg"] = PoolInput(
        pool=pool, max_updates_per_run=RAISED_UPDATES, max_signals_per_run=RAISED_SIGNALS, max_history_events=RAISED_EVENTS
    )
    await client.start_workflow(PoolWorkflow.run, task_queue=TASK_QUEUE, **options)


async def register_all(roster: Any, regs: list[Any], concurrency: int = 40) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(reg: Any) -> None:
        async with gate:
            for attempt in range(3):
                try:
                    await roster.register(reg, timeout=300)
                    return
                except Exception as exc:  # noqa: BLE001 - a loaded machine: tried again
                    print(f"  register {reg.agent_id} (attempt {attempt + 1}): {type(exc).__name__}: {exc}", file=sys.stderr)
            raise RuntimeError(f"could not register {reg.agent_id}")

    started = time.monotonic()
    await asyncio.gather(*(one(r) for r in regs))
    return time.monotonic() - started


async def runs_of(client: Client, workflow_id: str) -> list[tuple[str, str]]:
    """(run id, status name) of every run of `workflow_id`, oldest first."""
    found = [(w.run_id, w.status.name if w.status else "?", w.start_time) async for w in client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    found.sort(key=lambda r: r[2])
    return [(run_id, status) for run_id, status, _ in found]


async def traffic(client: Client, roster: Any, pool: str, runs_wanted: int, seconds_max: float) -> dict[str, Any]:
    """Acquire+release from CLIENTS callers until `runs_wanted` runs continued as new since it began."""
    from agentroster.vocabulary.wire import pool_workflow_id

    before = sum(1 for _, s in await runs_of(client, pool_workflow_id(pool)) if s == "CONTINUED_AS_NEW")
    done = asyncio.Event()
    leases = errors = 0

    async def caller() -> None:
        nonlocal leases, errors
        while not done.is_set():
            try:
                lease = await roster.acquire("rag.search@>=2,<3", timeout=30)
                await roster.release(lease)
                leases += 1
            except Exception as exc:  # noqa: BLE001 - counted
                errors += 1
                print(f"  error: {type(exc).__name__}: {exc}", file=sys.stderr)

    started = time.monotonic()
    tasks = [asyncio.create_task(caller()) for _ in range(CLIENTS)]
    try:
        while time.monotonic() - started < seconds_max:
            await asyncio.sleep(2)
            closed = sum(1 for _, s in await runs_of(client, pool_workflow_id(pool)) if s == "CONTINUED_AS_NEW")
            if closed - before >= runs_wanted:
                break
    finally:
        done.set()
        await asyncio.gather(*tasks)
    took = time.monotonic() - started
    return {"leases": leases, "errors": errors, "seconds": round(took, 1), "leases_per_s": round(leases / took, 1)}


# ---------------------------------------------------------------------- replay
def make_replayer() -> Any:
    """The worker's settings: its workflows, its runner (the sandbox), the pydantic converter."""
    from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
    from temporalio.worker import Replayer

    from agentroster.workers.worker import worker_workflow_runner
    from agentroster.workflows import workflow_classes

    quiet = Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))))
    return Replayer(
        workflows=workflow_classes(),
        workflow_runner=worker_workflow_runner(pydantic_data_converter),
        data_converter=pydantic_data_converter,
        runtime=quiet,
    )


@dataclass
class Replayed:
    pool: str
    run: int
    events: int
    updates: int
    signals: int
    tasks: int
    whole: bool  # the run's whole history (else a prefix ending at a workflow task)
    at_defaults: bool = False  # the prefix where the default limits (PoolInput) would end the run
    ms: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    @property
    def max(self) -> float:
        return max(self.ms)


def prefix_at(history: WorkflowHistory, events: int) -> WorkflowHistory:
    """The history up to the last workflow task completed within its first `events` events."""
    kept = list(history.events)[:events]
    while kept and kept[-1].event_type != _TASK_DONE:
        kept.pop()
    return WorkflowHistory(history.workflow_id, kept)


def cut_at_limits(history: WorkflowHistory, max_updates: int, max_events: int) -> WorkflowHistory:
    """The run as the pool's limits would end it: the first workflow task after which either limit is reached."""
    updates = 0
    for i, event in enumerate(history.events):
        updates += event.event_type == _UPDATE
        if event.event_type == _TASK_DONE and (updates >= max_updates or i + 1 >= max_events):
            return WorkflowHistory(history.workflow_id, list(history.events)[: i + 1])
    return history


async def replay_ms(replayer: Any, history: WorkflowHistory, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats if len(history.events) <= LONG else max(2, repeats // 2)):
        t0 = time.perf_counter()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        times.append((time.perf_counter() - t0) * 1000)
        if result.replay_failure is not None:
            raise RuntimeError(f"{history.workflow_id}: replay failed: {result.replay_failure}")
    return times


def counted(pool: str, run: int, history: WorkflowHistory, whole: bool) -> Replayed:
    events = list(history.events)
    return Replayed(
        pool=pool, run=run, events=len(events), whole=whole,
        updates=sum(e.event_type == _UPDATE for e in events),
        signals=sum(e.event_type == _SIGNAL for e in events),
        tasks=sum(e.event_type == _TASK_DONE for e in events),
    )


async def replay_runs(client: Client, label: str, pool: str, repeats: int, save: Path | None) -> list[Replayed]:
    """Every finished run of `pool` (whole), and prefixes of its longest run, each replayed `repeats` times."""
    from agentroster.vocabulary.wire import PoolInput, pool_workflow_id

    workflow_id = pool_workflow_id(pool)
    replayer = make_replayer()
    histories = []
    for n, (run_id, status) in enumerate(await runs_of(client, workflow_id), start=1):
        if status != "CONTINUED_AS_NEW":
            continue
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        histories.append((n, history))
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            (save / f"{label}-run{n}.json").write_text(history.to_json())
    await replay_ms(replayer, prefix_at(histories[0][1], 200), 2)  # warm: the sandbox's first imports
    out = []
    for n, history in histories:
        row = counted(label, n, history, whole=True)
        row.ms = await replay_ms(replayer, history, repeats)
        out.append(row)
        print(f"  {label} run {n}: {row.events:,} events, {row.updates:,} updates, {row.signals:,} signals, {row.tasks:,} tasks: "
              f"median {row.median:,.0f} ms, max {row.max:,.0f} ms", flush=True)
    # Prefixes of the longest run that was traffic only (not the first: it registered the agents).
    n, longest = max(histories[1:] or histories, key=lambda h: len(h[1].events))
    cuts = [prefix_at(longest, k) for k in (*PREFIXES, 400) if k < len(longest.events)]
    # The first workflow task alone: the fixed cost (a sandboxed instance, the carried state decoded, the first wake).
    cuts.append(WorkflowHistory(longest.workflow_id, list(longest.events)[: next(
        i + 1 for i, e in enumerate(longest.events) if e.event_type == _TASK_DONE)]))
    defaults = PoolInput(pool=pool)
    at_defaults = cut_at_limits(longest, defaults.max_updates_per_run, defaults.max_history_events)
    cuts.append(at_defaults)
    for cut in cuts:
        row = counted(label, n, cut, whole=False)
        row.at_defaults = cut is at_defaults
        row.ms = await replay_ms(replayer, cut, repeats)
        out.append(row)
        print(f"  {label} run {n} first {row.events:,} events ({row.updates:,} updates, {row.tasks:,} tasks"
              f"{', the defaults cut here' if cut is at_defaults else ''}): median {row.median:,.0f} ms, max {row.max:,.0f} ms", flush=True)
    return out


def fit(rows: list[Replayed], pick: str = "median") -> tuple[float, float]:
    """(fixed ms, ms per event): least squares of ms against events over `rows`."""
    xs = [r.events for r in rows]
    ys = [getattr(r, pick) for r in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


# ---------------------------------------------------------------------- the run
async def measure(agents: int, repeats: int, save: Path | None) -> tuple[list[Replayed], dict[str, Any]]:
    from agentroster.client.roster import AgentRoster

    facts: dict[str, Any] = {}
    rows: list[Replayed] = []
    health = health_server()
    port = health.server_address[1]
    try:
        async with dev_stack() as env:
            for label, idle in (("small", 0), ("big", agents)):
                if label == "big" and not agents:
                    continue
                pool = f"replay-{label}"
                await start_pool(env.client, pool)
                roster = AgentRoster(env.client, pool=pool, task_queue=TASK_QUEUE)
                await roster.ensure_pool()
                await register_all(roster, [registration(pool, "busy", i, port, "AB"[i % 2]) for i in range(8)])
                if idle:
                    took = await register_all(roster, [registration(pool, "idle", i, port, "C") for i in range(idle)])
                    facts[f"{label}_register_{idle}_idle_s"] = round(took, 1)
                    print(f"{label}: {idle:,} idle agents registered in {took:.0f} s", flush=True)
                facts[f"{label}_traffic"] = await traffic(env.client, roster, pool, runs_wanted=2, seconds_max=240)
                print(f"{label}: traffic {facts[f'{label}_traffic']}", flush=True)
                await roster.close()
                rows += await replay_runs(env.client, label, pool, repeats, save)
    finally:
        health.shutdown()
    return rows, facts


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def report(rows: list[Replayed], facts: dict[str, Any], rec: Record) -> bool:
    from agentroster.vocabulary.wire import WORKFLOW_TASK_TIMEOUT, PoolInput

    budget_ms = WORKFLOW_TASK_TIMEOUT.total_seconds() * 1000 / 3
    defaults = PoolInput()
    rec.figure("task_timeout_third_ms", round(budget_ms), unit="ms")
    rec.figure("default_max_updates_per_run", defaults.max_updates_per_run)
    rec.figure("default_max_history_events", defaults.max_history_events)
    for name, value in facts.items():
        rec.figure(name, value)
    for r in rows:
        what = "whole run" if r.whole else ("first task" if r.tasks == 1 else "first")
        rec.figure(
            f"{r.pool} run {r.run}: {what} {r.events:,} events",
            f"median {r.median:,.0f} ms, max {r.max:,.0f} ms ({len(r.ms)} replays); {r.updates:,} updates, {r.signals:,} signals, "
            f"{r.tasks:,} tasks; {r.median / r.events:.3f} ms/event, {r.median / max(1, r.tasks):.2f} ms/task"
            + ("; where the default limits end a run" if r.at_defaults else ""),
        )
    print(f"{'pool':<6} {'run':>3} {'events':>7} {'updates':>7} {'tasks':>6} {'median ms':>9} {'max ms':>7} {'ms/event':>8} {'ms/task':>7}")
    for r in rows:
        print(f"{r.pool:<6} {r.run:>3} {r.events:>7,} {r.updates:>7,} {r.tasks:>6,} {r.median:>9.0f} {r.max:>7.0f} "
              f"{r.median / r.events:>8.3f} {r.median / max(1, r.tasks):>7.2f}" + ("" if r.whole else "  (prefix)"))
    ok = True
    for label in sorted({r.pool for r in rows}):
        mine = [r for r in rows if r.pool == label]
        prefixed = next(r.run for r in mine if not r.whole)
        series = [r for r in mine if r.run == prefixed]  # the longest traffic run and its prefixes
        fixed, per_event = fit(series)
        fixed_max, per_event_max = fit(series, "max")
        rec.figure(f"{label}_ms_per_event", round(per_event, 4), unit="ms")
        rec.figure(f"{label}_fixed_ms", round(fixed, 1), unit="ms")
        rec.figure(f"{label}_ms_per_event_of_maxima", round(per_event_max, 4), unit="ms")
        rec.figure(f"{label}_fixed_ms_of_maxima", round(fixed_max, 1), unit="ms")
        rec.figure(f"{label}_ms_per_task", round(sum(r.median for r in series) / sum(r.tasks for r in series), 3), unit="ms")
        rec.figure(f"{label}_events_per_update", round(statistics.median(r.events / r.updates for r in series if r.updates), 2))
        longest = max(mine, key=lambda r: r.events)
        rec.figure(f"{label}_longest_run_events", longest.events)
        rec.figure(f"{label}_longest_run_updates", longest.updates)
        rec.figure(f"{label}_longest_run_median_ms", round(longest.median), unit="ms")
        rec.figure(f"{label}_longest_run_max_ms", round(longest.max), unit="ms")
        within = int((budget_ms - fixed) / per_event) if per_event > 0 else 0
        within_max = int((budget_ms - fixed_max) / per_event_max) if per_event_max > 0 else 0
        rec.figure(f"{label}_events_within_third_of_timeout", within)
        rec.figure(f"{label}_events_within_third_of_timeout_maxima", within_max)
        print(f"{label}: {per_event:.3f} ms per event + {fixed:.0f} ms (maxima: {per_event_max:.3f} ms per event + {fixed_max:.0f} ms); "
              f"a third of the task timeout ({budget_ms:.0f} ms) holds {within:,} events ({within_max:,} by the maxima)")
        first = next((r for r in series if r.tasks == 1), None)
        if first is not None:
            rec.figure(f"{label}_first_task_median_ms", round(first.median, 1), unit="ms")
            rec.figure(f"{label}_first_task_max_ms", round(first.max, 1), unit="ms")
        at_defaults = next((r for r in mine if r.at_defaults), None)
        if at_defaults is not None:
            rec.figure(f"{label}_default_run_events", at_defaults.events)
            rec.figure(f"{label}_default_run_updates", at_defaults.updates)
            ok &= rec.target(f"{label}_default_run_replay_median_ms", value=round(at_defaults.median), goal=round(budget_ms), op="<=", unit="ms")
            rec.figure(f"{label}_default_run_replay_max_ms", round(at_defaults.max), unit="ms")
    return ok


async def replay_loop(path: Path, seconds: float) -> None:
    """Replay one saved history again and again for `seconds` (for a profiler)."""
    history = WorkflowHistory.from_json("replayed", json.loads(path.read_text()))
    replayer = make_replayer()
    stop = time.monotonic() + seconds
    n = 0
    while time.monotonic() < stop:
        times = await replay_ms(replayer, history, 1)
        n += 1
        print(f"{path.name}: {len(history.events):,} events in {times[0]:,.0f} ms", flush=True)
    print(f"{n} replays")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=1000, help="idle agents of the bigger pool (0: the small pool only)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="replays of each history")
    parser.add_argument("--save", type=Path, help="keep every finished run's history here")
    parser.add_argument("--replay", type=Path, help="replay this saved history in a loop (for a profiler), nothing else")
    parser.add_argument("--seconds", type=float, default=30.0, help="with --replay: how long")
    args = parser.parse_args()
    if args.replay:
        asyncio.run(replay_loop(args.replay, args.seconds))
        return 0
    load = uptime()
    rec = Record(
        "replay",
        load=(f"cold replays (temporalio Replayer, the worker's sandbox and converter) of pool runs from the tuned dev server: "
              f"{CLIENTS} clients acquire+release over 8 agents x {SLOTS} slots, run limits raised to {RAISED_UPDATES:,} updates; "
              f"the bigger pool with {args.agents:,} idle agents registered first; each history replayed {args.repeats} times (those over {LONG:,} events half as often)"),
    )
    rec.notes.append(f"uptime before: {load}")
    rows, facts = asyncio.run(measure(args.agents, args.repeats, args.save))
    rec.notes.append(f"uptime after: {uptime()}")
    ok = report(rows, facts, rec)
    rec.write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
