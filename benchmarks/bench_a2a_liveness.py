"""What keeping an A2A agent alive costs in Temporal actions: issue 29, item 2.

An A2A agent (registered from its Agent Card) runs no code of ours, so its agent
workflow reads its card every heartbeat interval: one timer and one activity per
interval, plus the snapshot resync to its pool every 30 min. This benchmark counts
the dev server's `action` counter (what Temporal Cloud bills) for N such agents,
all alive (one a2a-sdk server on uvicorn answers every card), over a window.

The default rhythm (120 s interval, 30 min resync) is slow, so the run is
time-compressed `--time-scale K` times (interval 120/K s, resync 1800/K s, set in
this process, which runs the worker) and the count scaled back to real hours: the
actions per interval do not depend on its length.

Run: ``python benchmarks/bench_a2a_liveness.py [--agents 10] [--time-scale 60] [--window 60]``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import socket
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvicorn  # noqa: E402
from a2a.server.agent_execution import AgentExecutor  # noqa: E402
from a2a.server.request_handlers import DefaultRequestHandler  # noqa: E402
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes  # noqa: E402
from a2a.server.tasks import InMemoryTaskStore  # noqa: E402
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402

import agentroster.core.lifecycle as lifecycle  # noqa: E402
from agentroster.client.a2a import add_a2a_agent  # noqa: E402
from agentroster.activities.backend import NoneBackend  # noqa: E402
from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.models import DEFAULT_HEARTBEAT_INTERVAL_S, MISSED_HEARTBEATS  # noqa: E402
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES  # noqa: E402
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path  # noqa: E402
from agentroster.ops.ports import free_port  # noqa: E402
from agentroster.workers.worker import create_worker  # noqa: E402
from benchmarks.bench_cost import actions  # noqa: E402
from benchmarks.record import Record  # noqa: E402

TARGET_PER_AGENT_HOUR = 70.0


class Idle(AgentExecutor):
    async def execute(self, context, event_queue):  # type: ignore[no-untyped-def]
        return None

    async def cancel(self, context, event_queue):  # type: ignore[no-untyped-def]
        return None


async def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("AGENTROSTER_LEASE_KEY", "base64:" + base64.b64encode(secrets.token_bytes(32)).decode())
    k = args.time_scale
    interval = DEFAULT_HEARTBEAT_INTERVAL_S / k
    rec = Record("a2a_liveness", load=f"{args.agents} idle A2A agents, one dev server, time-compressed {k:g}x (interval {interval:g} s)")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    card = AgentCard(
        name="idle", description="answers its card", version="1.0.0",
        supported_interfaces=[AgentInterface(url=url + "/", protocol_binding="JSONRPC", protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=False), default_input_modes=["text/plain"], default_output_modes=["text/plain"],
        skills=[AgentSkill(id="idle.wait", name="wait", description="-", tags=["idle"])],
    )
    handler = DefaultRequestHandler(agent_executor=Idle(), task_store=InMemoryTaskStore(), agent_card=card)
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")]),
                                           log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    metrics_port = free_port()
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--metrics-port", str(metrics_port)],
        data_converter=pydantic_data_converter, search_attributes=SEARCH_ATTRIBUTES,
    )
    saved = lifecycle.RESYNC_S
    lifecycle.RESYNC_S = saved / k  # read by the workflows this process runs (core is passed through)
    suffix = uuid.uuid4().hex[:6]
    worker = create_worker(env.client, task_queue=f"a2a-{suffix}", backend=NoneBackend())
    working = asyncio.create_task(worker.run())
    try:
        roster = AgentRoster(env.client, pool=f"a2a-{suffix}", task_queue=f"a2a-{suffix}")
        await roster.ensure_pool()
        for i in range(args.agents):
            await add_a2a_agent(roster, url, agent_id=f"idle-{i}", heartbeat_interval_s=interval)
        await asyncio.sleep(MISSED_HEARTBEATS * interval)
        before = actions(metrics_port, "default")
        started = time.monotonic()
        await asyncio.sleep(args.window)
        window = time.monotonic() - started
        after = actions(metrics_port, "default")
        status = await roster.status()
    finally:
        lifecycle.RESYNC_S = saved
        await worker.shutdown()
        await working
        await env.shutdown()
        server.should_exit = True
        await serving
        await handler.aclose()
    by_type = {kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in after}
    real_hours = window * k / 3600
    per_hour = sum(by_type.values()) / args.agents / real_hours
    routable = sum(1 for a in status.agents if a.state.value in ("Ready", "Busy"))
    print(f"{args.agents} A2A agents, interval {interval:g}s ({k:g}x compressed), window {window:.0f}s, {routable} routable at the end")
    print(f"  actions per A2A agent-hour at the default {DEFAULT_HEARTBEAT_INTERVAL_S:g}s interval: {per_hour:.1f}")
    for kind, value in sorted(by_type.items()):
        if value:
            print(f"    {kind}: {value / args.agents / real_hours:.1f}")
    rec.figure("actions_per_a2a_agent_hour", round(per_hour, 1), unit="actions")
    rec.figure("routable_at_end", routable)
    rec.target("actions_per_a2a_agent_hour", value=round(per_hour, 1), goal=TARGET_PER_AGENT_HOUR, op="<=")
    rec.write()
    return 0 if per_hour <= TARGET_PER_AGENT_HOUR and routable == args.agents else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--time-scale", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=60.0, help="seconds of counting (compressed time)")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
