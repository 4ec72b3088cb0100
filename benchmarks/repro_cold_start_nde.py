"""Repro: after the worker is killed with SIGKILL, the pool workflow's history can stop replaying.

    python benchmarks/repro_cold_start_nde.py [--kills 8]

Starts a dev server (state in a temporary SQLite file) and the worker CLI in its own
process, registers three agents with one slot each, and runs eight clients that acquire
(an update) and release (a signal) in a loop. It then kills the worker with SIGKILL,
starts it again, lets the clients run two seconds, and replays the pool's history with
agentroster's own workflows and sandbox (`temporalio.worker.Replayer`). It repeats until
a replay fails or `--kills` kills have passed; exit code 1 and the history's path when one
failed.

What fails (within the first three kills in each of our tries, temporalio 1.35.0):

    [TMPRL1100] Nondeterminism error: Update machine does not handle this event:
    HistoryEvent(id: N, SignalExternalWorkflowExecutionInitiated)

The workflow task the restarted (cold) worker ran held both new signals (`release`) and
updates (`acquire_many`). Tracing activations on that worker shows it was handed the
signal jobs in one activation and the update jobs in a second one, so the pool's reaction
to the signals (a load notice: SignalExternalWorkflowExecutionInitiated) was recorded
*before* the updates' acceptance. On replay the same task arrives as one activation with
both, the update handlers run first, and their acceptance comes first: the history no
longer matches. The next time a worker rebuilds the pool (another restart, a cache
eviction, a task timeout) every workflow task fails the same way and the pool is wedged.
This looks like temporalio/sdk-python#1591 (open: "Non-deterministic history generated
after update handled on cold-start").
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from temporalio.client import Client  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.worker import Replayer  # noqa: E402

from agentroster.client import AgentRoster  # noqa: E402
from agentroster.contracts import AgentRegistration, Capability  # noqa: E402
from agentroster.lease_tokens import KEY_VAR, generate_key  # noqa: E402
from agentroster.workers.worker import WORKFLOWS, workflow_runner  # noqa: E402
from benchmarks.chaos_procs import DevServer, WorkerProcess  # noqa: E402

POOL, QUEUE, REF = "repro", "repro", "rag.search"


async def main(kills: int) -> int:
    import os

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

    async def client_loop() -> None:
        mine = AgentRoster(await Client.connect(server.address, data_converter=pydantic_data_converter), pool=POOL, task_queue=QUEUE)
        while not stop.is_set():
            try:
                lease = await mine.acquire(REF, timeout=30, lease_ttl_s=600)
                await asyncio.sleep(random.uniform(0.01, 0.05))
                await mine.release(lease)
            except Exception:  # the wedged pool stops answering; the replay below says why
                await asyncio.sleep(1)

    clients = [asyncio.create_task(client_loop()) for _ in range(8)]
    replayer = Replayer(workflows=WORKFLOWS, workflow_runner=workflow_runner(), data_converter=pydantic_data_converter)
    try:
        for kill in range(1, kills + 1):
            await asyncio.sleep(random.uniform(1.0, 2.0))
            await worker.kill9()
            await asyncio.sleep(random.uniform(0.2, 1.0))
            await worker.start()
            await asyncio.sleep(2.0)
            history = await client.get_workflow_handle(f"pool/{POOL}").fetch_history()
            result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
            if result.replay_failure is None:
                print(f"kill {kill}: {len(history.events)} events, the history replays")
                continue
            saved = workdir / "pool-history.json"
            saved.write_text(history.to_json())
            print(f"kill {kill}: THE HISTORY DOES NOT REPLAY: {result.replay_failure}\nhistory: {saved}\nworker log: {worker.log_path}")
            return 1
        print(f"no replay failure in {kills} kills")
        return 0
    finally:
        stop.set()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await worker.kill9()
        server.stop()


if __name__ == "__main__":
    from agentroster.agent import exit_now

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=8)
    exit_now(asyncio.run(main(parser.parse_args().kills)))
