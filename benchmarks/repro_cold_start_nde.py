"""Repro: after the worker is killed with SIGKILL, the pool workflow's history can stop replaying.

    python benchmarks/repro_cold_start_nde.py [--kills 8]

Starts a dev server (state in a temporary SQLite file) and the worker CLI in its own
process, registers three agents with one slot each, and runs eight clients that acquire
(an update) and release (a signal) in a loop. It then kills the worker with SIGKILL,
starts it again, lets the clients run two seconds, and replays the pool's history with
agentroster's own workflows and sandbox (`temporalio.worker.Replayer`). It repeats until
a replay fails or `--kills` kills have passed; exit code 1 and the history's path when one
failed.

What failed before the worker refused partial workflow tasks (within the first four kills
in each of our tries, temporalio 1.35.0):

    [TMPRL1100] Nondeterminism error: Update machine does not handle this event:
    HistoryEvent(id: N, SignalExternalWorkflowExecutionInitiated)

(or `TimerStarted`). Traced activation by activation on the restarted worker: a client's
query, sent while the pool had no workflow task pending, waited 2 s on the dead worker's
sticky queue and reached the new worker as a query task whose history already held a new
`release` signal (or a fired timer). The SDK's core ran those events for the query as a
live activation of their own; the pool's reaction (a load notice to an agent, or its next
timer) was held and sent ahead of the next real workflow task's update acceptances. On
replay the same events arrive in one activation with that task, the update handlers run
first, and the history no longer matches; the next worker that rebuilt the pool was
wedged. Like temporalio/sdk-python#1591. The fix: `agentroster.workers.partial_task_guard`
(the worker answers such an activation with a failure before any workflow code runs: the
query fails and is asked again, the run is rebuilt by its next workflow task). This script
now exits 0; `tests/test_partial_task.py` builds the same sequence deterministically.
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
            print(f"kill {kill}: THE HISTORY DOES NOT REPLAY: {result.replay_failure}\nhistory: {saved}\nworker log: {worker.log_path}"
                  f"\nthe worker refused {_refusals(worker)} partial workflow task(s)")
            return 1
        print(f"no replay failure in {kills} kills; the worker refused {_refusals(worker)} partial workflow task(s)")
        return 0
    finally:
        stop.set()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await worker.kill9()
        server.stop()


def _refusals(worker: WorkerProcess) -> int:
    """Partial workflow tasks the worker refused (its log says so each time)."""
    return worker.log_path.read_text(errors="replace").count("refused a partial workflow task (history")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=8)
    sys.exit(asyncio.run(main(parser.parse_args().kills)))
