"""Repro of temporalio/sdk-python#1591 as it reaches a pool: queries during worker kills.

    python benchmarks/repro_cold_start_nde.py [--kills 8] [--query-rule]

What triggers it: a client queries a workflow while the worker that last ran it is dead and
no workflow task is pending. The query waits on the dead worker's sticky queue for the
sticky timeout (2 s, `wire.STICKY_TIMEOUT`), then goes to the normal queue and reaches the
restarted worker as a query task whose history already holds new events (a signal, a fired
timer, an activity's end). The SDK runs those events for the query as an activation of
their own, apart from the next real workflow task's updates; replay meets them in one
activation with that task. A workflow whose commands depend on that grouping writes a
history that fails to replay with

    [TMPRL1100] Nondeterminism error: Update machine does not handle this event: ...

and the next worker that rebuilds it is wedged. A worker that starts cold after a crash
groups a task's events the same way.

What we do: the pool workflow's commands do not depend on the grouping. It wakes for
messages only (an update, or the `agent_snapshots` signal's handler acting in its own turn);
a fired timer, an activity's end or a signal's delivery wakes nothing, because everything
it needs done outside is an activity it does not wait for, which reports with the pool's
`report` update (docs/messages.md). Every query our code sends also goes through
`transport.query_workflow`, whose deadline ends before the sticky timeout, which keeps such
query tasks rare for every workflow.

This script starts a dev server (state in a temporary SQLite file) and the worker CLI in
its own process, registers three agents with one slot each, runs eight clients that
acquire and release in a loop and four that query the pool's `status` in a loop, plainly
(`handle.query` with the SDK's default deadline) or, with `--query-rule`, through
`query_workflow`. It kills the worker with SIGKILL, starts it again, and replays every
run of the pool with our workflows and sandbox, until a replay fails (exit 1, with the
history's path) or `--kills` kills have passed (exit 0).

When to revisit: when sdk-python#1591 ("WFT chunking v2", sdk-rust PRs #1281/#1509)
ships in a temporalio release, upgrade, run this script, and drop the rule in
`query_workflow`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from temporalio.client import Client, WorkflowExecutionStatus  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.worker import Replayer  # noqa: E402

from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.models import AgentRegistration, Capability  # noqa: E402
from agentroster.client.lease_tokens import KEY_VAR, generate_key  # noqa: E402
from agentroster.client.transport import query_workflow  # noqa: E402
from agentroster.vocabulary.wire import pool_workflow_id  # noqa: E402
from agentroster.workflows import workflow_classes, workflow_runner  # noqa: E402
from benchmarks.chaos_checks import run_ids  # noqa: E402
from benchmarks.chaos_procs import DevServer, WorkerProcess  # noqa: E402

POOL, QUEUE, REF = "repro", "repro", "rag.search"


async def main(kills: int, query_rule: bool) -> int:
    from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

    os.environ.setdefault(KEY_VAR, generate_key())
    # Only errors from the SDK's core: the point is the replay result below.
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(
        filter=TelemetryFilter(core_level="ERROR", other_level="ERROR")))), error_if_already_set=False)
    workdir = Path(tempfile.mkdtemp(prefix="agentroster-nde-"))
    server = DevServer(workdir)
    server.start()
    await server.wait_ready()
    worker = WorkerProcess(server.address, POOL, QUEUE, workdir / "worker.log")
    await worker.start()
    client = await Client.connect(server.address, data_converter=pydantic_data_converter)
    roster = AgentRoster(client, pool=POOL, task_queue=QUEUE)
    await roster.ensure_pool()
    for i in range(3):
        await roster.register(AgentRegistration(
            agent_id=f"a{i}", deployment="d", endpoint="http://127.0.0.1:9", heartbeat_interval_s=3600,
            capabilities=[Capability(name=REF, version="2.1.0", max_concurrency=1, cost_class="A")]))
    stop = asyncio.Event()
    queries = {"answered": 0, "failed": 0}

    async def lease_loop() -> None:
        mine = AgentRoster(await Client.connect(server.address, data_converter=pydantic_data_converter), pool=POOL, task_queue=QUEUE)
        while not stop.is_set():
            try:
                lease = await mine.acquire(REF, timeout=30, lease_ttl_s=600)
                await asyncio.sleep(random.uniform(0.01, 0.05))
                await mine.release(lease)
            except Exception:  # the wedged pool stops answering; the replay below says why
                await asyncio.sleep(1)

    async def query_loop() -> None:
        handle = (await Client.connect(server.address, data_converter=pydantic_data_converter)).get_workflow_handle(pool_workflow_id(POOL))
        while not stop.is_set():
            try:
                if query_rule:
                    await query_workflow(handle, "status", result_type=dict)
                else:
                    await handle.query("status", result_type=dict)  # the SDK's default deadline
                queries["answered"] += 1
            except Exception:
                queries["failed"] += 1
            await asyncio.sleep(random.uniform(0.05, 0.2))

    tasks = [asyncio.create_task(lease_loop()) for _ in range(8)] + [asyncio.create_task(query_loop()) for _ in range(4)]
    replayer = Replayer(workflows=workflow_classes(), workflow_runner=workflow_runner(), data_converter=pydantic_data_converter)
    rule = "with the query rule" if query_rule else "plain queries (no query rule)"
    replayed: set[str] = set()
    try:
        for kill in range(1, kills + 1):
            await asyncio.sleep(random.uniform(1.0, 2.0))
            await worker.kill9()
            await asyncio.sleep(random.uniform(0.2, 1.0))
            await worker.start()
            await asyncio.sleep(3.0)
            # Every run of the pool (it continues as new every few hundred updates); a closed run is replayed once.
            runs = [r for r in await run_ids(client, pool_workflow_id(POOL)) if r not in replayed]
            for run_id in runs:
                handle = client.get_workflow_handle(pool_workflow_id(POOL), run_id=run_id)
                history = await handle.fetch_history()
                result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
                if result.replay_failure is not None:
                    saved = workdir / f"pool-history-{run_id}.json"
                    saved.write_text(history.to_json())
                    print(f"kill {kill} ({rule}): THE HISTORY DOES NOT REPLAY: {result.replay_failure}\n"
                          f"history: {saved}\nworker log: {worker.log_path}\nqueries: {queries}")
                    return 1
                if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                    replayed.add(run_id)
            print(f"kill {kill}: {len(replayed)} closed runs and the open one replay", flush=True)
        print(f"{rule}: no replay failure in {kills} kills; queries: {queries}")
        return 0
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await worker.kill9()
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--query-rule", action="store_true", help="query through transport.query_workflow, as our code does")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.kills, args.query_rule)))
