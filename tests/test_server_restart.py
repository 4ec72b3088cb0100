"""An agent process outlives a Temporal server that lost its state, and registers again on its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from agentroster import AgentState
from agentroster.client.roster import AgentRoster
from agentroster.errors import AgentNotFoundError
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path
from agentroster.workers.worker import create_worker
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES
from tests.conftest import eventually, free_port

REPO = Path(__file__).resolve().parent.parent


async def _server(port: int) -> WorkflowEnvironment:
    return await WorkflowEnvironment.start_local(
        port=port,
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=list(DEV_SERVER_DYNAMIC_CONFIG),
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )


async def _found(roster: AgentRoster, agent_id: str) -> bool:
    return await roster.find("math.eval") == [agent_id]


async def _ready(roster: AgentRoster, agent_id: str) -> bool:
    try:
        return (await roster.describe(agent_id)).state == AgentState.READY
    except AgentNotFoundError:
        return False


async def test_agent_registers_again_after_the_server_lost_its_state(tmp_path: Path) -> None:
    port = free_port()
    agent_id = "survives-restart"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    env.update(
        TEMPORAL_ADDRESS=f"127.0.0.1:{port}",
        AGENTROSTER_POOL="restart",
        AGENTROSTER_TASK_QUEUE="restart",
        AGENTROSTER_LEASE_KEY=os.environ["AGENTROSTER_LEASE_KEY"],  # the session's (tests/conftest.py)
        AGENT_ID=agent_id,
        AGENT_DEPLOYMENT="math-agent",
        AGENT_PORT="0",
        AGENT_HOST="127.0.0.1",
        HEARTBEAT_INTERVAL_S="1",
        DRAIN_TIMEOUT_S="10",
        PYTHONPATH=str(REPO),
    )
    first = await _server(port)
    log = open(tmp_path / "agent.log", "wb")
    agent = subprocess.Popen([sys.executable, "-m", "examples.math_agent"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    second: WorkflowEnvironment | None = None
    try:
        async with create_worker(first.client, task_queue="restart"):
            roster = AgentRoster(first.client, pool="restart", task_queue="restart")
            await roster.ensure_pool()
            await eventually(lambda: _ready(roster, agent_id), timeout=30)
        await first.shutdown()  # in-memory: every workflow, the agent's included, is gone

        second = await _server(port)
        async with create_worker(second.client, task_queue="restart"):
            roster = AgentRoster(second.client, pool="restart", task_queue="restart")
            await roster.ensure_pool()
            await eventually(lambda: _ready(roster, agent_id), timeout=40)
            # Routable again: the pool of the new server lists it (eventually: on a loaded
            # machine a stall past the agent's heartbeat window ends it, and it registers again).
            await eventually(lambda: _found(roster, agent_id), timeout=40)
            agent.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(agent.wait, 30) == 0
            assert (await roster.describe(agent_id)).terminated_reason == "drain"
    finally:
        if agent.poll() is None:
            agent.kill()
        if second is not None:
            await second.shutdown()
    assert b"regist" in (tmp_path / "agent.log").read_bytes()
