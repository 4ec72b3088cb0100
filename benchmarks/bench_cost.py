"""What an idle fleet costs in Temporal actions, and what it loads: issue 10's first measurement.

Starts a dev server (its metrics port exports the `action` counter Temporal Cloud
bills by), a worker in this process, registers N agents (timing until all are
routable), then lets them heartbeat at the default interval, as the agent runtime
does (one `heartbeat` signal per agent per interval), for a measuring window. It
prints, from the same run: actions per agent-hour (total and by action type, and
the dollars that means at $50 per million actions), the registration rate, the
pool's `status` latency, and the CPU the server and the worker used.

Run: ``python benchmarks/bench_cost.py [--agents 200] [--seconds 60]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402

from agentroster.activities.backend import NoneBackend  # noqa: E402
from agentroster.client import AgentRoster  # noqa: E402
from agentroster.contracts import DEFAULT_HEARTBEAT_INTERVAL_S, AgentRegistration, Capability  # noqa: E402
from agentroster.wire import SEARCH_ATTRIBUTES  # noqa: E402
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path  # noqa: E402
from agentroster.workers.worker import create_worker  # noqa: E402

DOLLARS_PER_MILLION_ACTIONS = 50.0
TICKS = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def actions(metrics_port: int, namespace: str = "default") -> dict[str, float]:
    """The server's `action` counter for `namespace`, by action type."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("action{") or f'namespace="{namespace}"' not in line:
            continue
        labels, value = line.rsplit(" ", 1)
        kind = labels.split('action_type="', 1)[1].split('"', 1)[0]
        out[kind] = out.get(kind, 0.0) + float(value)
    return out


def server_cpu_seconds() -> float:
    """CPU time of the dev server processes (children of this one running `temporal ... start-dev`)."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"start-dev" not in cmd:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS
        except OSError:
            continue
    return total


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def registration(i: int) -> AgentRegistration:
    return AgentRegistration(
        agent_id=f"cost-agent-{i:05d}",
        deployment=f"cost-{i % 5}",
        endpoint=f"http://10.2.{i // 250}.{i % 250}:8080",
        capabilities=[Capability(name=f"cost.skill{i % 5}", version="1.0.0", max_concurrency=2)],
        heartbeat_interval_s=DEFAULT_HEARTBEAT_INTERVAL_S,
    )


async def run(agents: int, seconds: float, register_concurrency: int) -> dict[str, float]:
    metrics_port = _free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--metrics-port", str(metrics_port)],
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    worker = create_worker(env.client, task_queue="cost", backend=NoneBackend())
    worker_task = asyncio.create_task(worker.run())
    roster = AgentRoster(env.client, pool="cost", task_queue="cost")
    try:
        await roster.ensure_pool()
        gate = asyncio.Semaphore(register_concurrency)

        async def register(i: int) -> None:
            async with gate:
                await roster.register(registration(i), timeout=120)

        started = time.monotonic()
        await asyncio.gather(*(register(i) for i in range(agents)))
        registered_s = time.monotonic() - started

        stop = asyncio.Event()

        async def heartbeats(i: int) -> None:
            # Spread over the interval, as independent agents would be.
            await asyncio.sleep(DEFAULT_HEARTBEAT_INTERVAL_S * i / agents)
            while not stop.is_set():
                await roster.heartbeat(registration(i).agent_id)
                try:
                    await asyncio.wait_for(stop.wait(), DEFAULT_HEARTBEAT_INTERVAL_S)
                except asyncio.TimeoutError:
                    pass

        beaters = [asyncio.create_task(heartbeats(i)) for i in range(agents)]
        await asyncio.sleep(DEFAULT_HEARTBEAT_INTERVAL_S)  # every agent in its rhythm
        before, server_before, own_before = actions(metrics_port), server_cpu_seconds(), own_cpu_seconds()
        window_started = time.monotonic()
        latencies = []
        while time.monotonic() - window_started < seconds:
            t = time.monotonic()
            status = await roster.status()
            latencies.append(time.monotonic() - t)
            await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - t)))
        window = time.monotonic() - window_started
        after, server_after, own_after = actions(metrics_port), server_cpu_seconds(), own_cpu_seconds()
        stop.set()
        await asyncio.gather(*beaters)
        routable = sum(1 for a in status.agents if a.state.value in ("Ready", "Busy"))
        by_type = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        total = sum(by_type.values())
        per_agent_hour = total / agents / (window / 3600)
        return {
            "agents": agents,
            "registered_s": registered_s,
            "routable": routable,
            "window_s": window,
            "actions": total,
            "per_agent_hour": per_agent_hour,
            "by_type": {k: v / agents / (window / 3600) for k, v in sorted(by_type.items()) if v},  # type: ignore[dict-item]
            "status_p50_ms": statistics.median(latencies) * 1000,
            "status_max_ms": max(latencies) * 1000,
            "server_cpu": (server_after - server_before) / window,
            "worker_cpu": (own_after - own_before) / window,
        }
    finally:
        await worker.shutdown()
        await worker_task
        await env.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--register-concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    r = asyncio.run(run(args.agents, args.seconds, args.register_concurrency))
    dollars_day_1000 = r["per_agent_hour"] * 1000 * 24 * DOLLARS_PER_MILLION_ACTIONS / 1e6
    print(f"{r['agents']} agents, heartbeat every {DEFAULT_HEARTBEAT_INTERVAL_S:g}s, measured over {r['window_s']:.0f}s")
    print(f"  registration: all {r['agents']} routable in {r['registered_s']:.1f}s ({r['agents'] / r['registered_s']:.1f}/s); routable at the end: {r['routable']}")
    print(f"  actions per agent-hour while idle: {r['per_agent_hour']:.0f} (~${dollars_day_1000:,.0f} a day for 1,000 agents at ${DOLLARS_PER_MILLION_ACTIONS:g}/M)")
    for kind, value in r["by_type"].items():  # type: ignore[union-attr]
        print(f"    {kind:<45} {value:8.1f}")
    print(f"  pool status query: p50 {r['status_p50_ms']:.0f} ms, max {r['status_max_ms']:.0f} ms")
    print(f"  CPU: dev server {r['server_cpu']:.0%} of a core, worker {r['worker_cpu']:.0%} of a core (this process also sends the heartbeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
