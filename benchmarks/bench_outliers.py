"""Outlier ejection: one of four agents broken (HTTP 500), then hung, beside an all-healthy fleet.

Four in-process agents serve `work.run@1.0.0` (max_concurrency 4); each task works
0.3 s. 60 tasks go through `roster.invoke` from 4 concurrent callers, on one tuned dev
server, one fresh pool per fleet (the default outlier settings):

- healthy: four agents answering (the latency baseline: run before and after the
  others, after a warm-up run);
- broken: one answers HTTP 500 to every task at once;
- hung: one accepts tasks and never answers; every fleet's tasks have a task_timeout_s
  of 1 s, so each task the hung agent takes costs it 1 s before it fails over.

Figures: the share of tasks that reach the bad agent (goal: at most the ejection
threshold plus one trial task), failed tasks (goal 0), p50 task latency beside the
healthy fleet's (goal <= 1.2x), whether the bad agent was ejected, and the time to its
ejection in the pool's status, from the first task that reached it and from its first
failure (the broken agent fails at once; the hung agent's first failure is known only
when its first task times out, `task_timeout_s` after it started). The hung agent takes
its tasks one after another (a hung task holds one of its slots, and the pool prefers
less loaded agents), so it leaves about `consecutive_failures` x `task_timeout_s` after
its first task: the 60 tasks last about twice that.

    python benchmarks/bench_outliers.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.record import Record  # noqa: E402

REF = "work.run@==1.0.0"
TASKS = 60
CALLERS = 4
WORK_S = 0.3  # each task's work: 60 tasks last about twice as long as a hung agent's three timeouts
TASK_TIMEOUT_S = 1.0


class _Agent:
    def __init__(self, roster: Any, agent_id: str, mode: str) -> None:
        from agentroster.agent.runtime import AgentRuntime

        self.mode = mode
        self.calls = 0
        self.first_call: float | None = None
        self.never = asyncio.Event()
        self.runtime = AgentRuntime(agent_id=agent_id, deployment="workers", roster=roster, port=0, host="127.0.0.1", heartbeat_interval_s=30.0)

        @self.runtime.capability("work.run", "1.0.0", max_concurrency=4)
        async def work(payload: Any) -> Any:
            self.calls += 1
            if self.first_call is None:
                self.first_call = time.monotonic()
            if self.mode == "fail":
                raise RuntimeError("the model provider answered 500")
            if self.mode == "hang":
                await self.never.wait()
            await asyncio.sleep(WORK_S)
            return {"done": payload}


async def _fleet_run(client: Any, task_queue: str, bad: str | None) -> dict[str, Any]:
    from agentroster.client.roster import AgentRoster
    from agentroster.errors import AgentRosterError

    roster = AgentRoster(client, pool=f"bench-outliers-{uuid.uuid4().hex[:6]}", task_queue=task_queue)
    await roster.ensure_pool()
    agents = [_Agent(roster, f"agent-{i}", bad if (bad and i == 0) else "ok") for i in range(4)]
    for agent in agents:
        await agent.runtime.start()
    while len(await roster.find(REF)) < 4:
        await asyncio.sleep(0.1)
    ejected_at: list[float] = []

    async def watch() -> None:
        while True:
            status = await roster.status()
            if any(r.agent_id == "agent-0" and r.ejected for r in status.agents):
                ejected_at.append(time.monotonic())
                return
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch()) if bad else None
    latencies: list[float] = []
    failed = 0
    queue = list(range(TASKS))

    async def caller() -> None:
        nonlocal failed
        while queue:
            n = queue.pop(0)
            started = time.monotonic()
            try:
                await roster.invoke(REF, {"n": n}, timeout=30, task_timeout_s=TASK_TIMEOUT_S)
                latencies.append(time.monotonic() - started)
            except AgentRosterError:
                failed += 1

    started = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    elapsed = time.monotonic() - started
    if watcher is not None:
        try:
            await asyncio.wait_for(watcher, 5)
        except asyncio.TimeoutError:
            pass
    status = await roster.status()
    for agent in agents:
        agent.never.set()
        await agent.runtime.stop(drain=False)
    bad_agent = agents[0]
    first_failure = None
    if bad_agent.first_call is not None:
        first_failure = bad_agent.first_call + (TASK_TIMEOUT_S if bad == "hang" else 0.0)
    return {
        "p50_s": statistics.median(latencies) if latencies else float("nan"),
        "failed": failed,
        "bad_calls": bad_agent.calls if bad else 0,
        "elapsed_s": elapsed,
        "to_ejection_s": (ejected_at[0] - bad_agent.first_call) if ejected_at and bad_agent.first_call else None,
        "failure_to_ejection_s": (ejected_at[0] - first_failure) if ejected_at and first_failure else None,
        "ejected": next((r.ejected for r in status.agents if r.agent_id == "agent-0"), None),
    }


async def run(rec: Record) -> Record:
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    from agentroster.activities.backend import NoneBackend
    from agentroster.models import OutlierPolicy
    from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES
    from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path
    from agentroster.ops.ports import free_port
    from agentroster.workers.worker import create_worker

    import base64
    import os
    import secrets

    os.environ.setdefault("AGENTROSTER_LEASE_KEY", "base64:" + base64.b64encode(secrets.token_bytes(32)).decode())
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG],
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    task_queue = f"bench-outliers-{uuid.uuid4().hex[:6]}"
    worker = create_worker(env.client, task_queue=task_queue, backend=NoneBackend())
    running = asyncio.create_task(worker.run())
    try:
        await _fleet_run(env.client, task_queue, None)  # warm-up: imports, sandbox, connections
        healthy = await _fleet_run(env.client, task_queue, None)
        broken = await _fleet_run(env.client, task_queue, "fail")
        hung = await _fleet_run(env.client, task_queue, "hang")
        healthy_after = await _fleet_run(env.client, task_queue, None)
    finally:
        await worker.shutdown()
        await running
        await env.shutdown()
    threshold = OutlierPolicy().consecutive_failures
    # The baseline: the healthy fleets before and after the others (the machine is shared).
    baseline = statistics.mean([healthy["p50_s"], healthy_after["p50_s"]])
    rec.figure("healthy_p50_ms", round(baseline * 1000, 1), unit="ms")
    rec.figure("healthy_p50_ms_before_after", [round(healthy["p50_s"] * 1000, 1), round(healthy_after["p50_s"] * 1000, 1)], unit="ms")
    for name, run_ in (("broken_500", broken), ("hung", hung)):
        rec.figure(f"{name}_tasks_reaching_bad_agent", run_["bad_calls"])
        rec.figure(f"{name}_p50_ms", round(run_["p50_s"] * 1000, 1), unit="ms")
        rec.figure(f"{name}_elapsed_s", round(run_["elapsed_s"], 2), unit="s")
        rec.figure(f"{name}_ejected_for", run_["ejected"] or "")
        rec.target(f"{name}_ejected", value=int(run_["to_ejection_s"] is not None), goal=1, op="==")
        if run_["to_ejection_s"] is not None:
            rec.figure(f"{name}_first_bad_task_to_ejection_s", round(run_["to_ejection_s"], 3), unit="s")
            rec.figure(f"{name}_first_failure_to_ejection_s", round(run_["failure_to_ejection_s"], 3), unit="s")
        rec.target(f"{name}_share_reaching_bad_agent", value=run_["bad_calls"] / TASKS, goal=(threshold + 1) / TASKS, op="<=")
        rec.target(f"{name}_failed_tasks", value=run_["failed"], goal=0, op="==")
    rec.target("broken_500_p50_vs_healthy", value=broken["p50_s"] / baseline, goal=1.2, op="<=")
    rec.target("hung_p50_vs_healthy", value=hung["p50_s"] / baseline, goal=1.2, op="<=")
    return rec


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    rec = Record(
        "outliers",
        load=f"4 agents x work.run@1.0.0 (max_concurrency 4, {WORK_S:g} s of work per task), {TASKS} tasks by roster.invoke "
        f"from {CALLERS} callers per fleet, task_timeout_s {TASK_TIMEOUT_S:g}; default outlier settings",
    )
    asyncio.run(run(rec))
    path = rec.write()
    print(path)
    for line in path.read_text().splitlines():
        print(line)
    return 0 if rec.met else 1


if __name__ == "__main__":
    raise SystemExit(main())
