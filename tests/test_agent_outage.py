"""Agent logs while the Temporal server is away: one line when calls start failing, one
when they go through again; no warning per heartbeat, no SDK retry warning per attempt.

The outside test runs an example agent process against a dev server of its own,
stops the server under it, and starts it again on the same state file."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentroster.client.outage import Outage, is_unreachable
from tests.conftest import eventually, free_port

REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_when_an_outage_begins_and_one_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    logger = logging.getLogger("test.outage")
    outage = Outage(logger, "agent a1", remind_every_s=600, clock=clock)
    caplog.set_level(logging.DEBUG, logger="test.outage")
    outage.ok("heartbeat")  # nothing to say
    for _ in range(50):
        clock.now += 2
        outage.failed("heartbeat", TimeoutError())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "agent a1: heartbeat failed, cannot reach the Temporal server (TimeoutError); retrying quietly, one line when it goes through again"
    ]
    clock.now += 600  # a long outage gets a reminder, not a line per attempt
    outage.failed("heartbeat", ConnectionRefusedError("refused"))
    clock.now += 5
    outage.failed("heartbeat", TimeoutError())
    outage.ok("heartbeat")
    outage.ok("heartbeat")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3, warnings
    assert warnings[1].startswith("agent a1: still failing after 11.6m (51 attempt(s))")
    assert warnings[2] == "agent a1: heartbeat went through again after 11.7m; 52 attempt(s) failed meanwhile"
    assert outage.outages == 1 and not outage.down


def test_a_refusal_is_told_apart_from_no_answer(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage(logging.getLogger("test.outage2"), "agent a2", clock=FakeClock())
    caplog.set_level(logging.WARNING, logger="test.outage2")
    outage.failed("registration", RuntimeError("Failed client connect: connection refused"))
    outage.failed("registration", ValueError("pool p has shut down"))  # another cause: said once
    outage.failed("registration", ValueError("pool p has shut down"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "cannot reach the Temporal server" in messages[0] and "refused (ValueError: pool p has shut down)" in messages[1]
    assert is_unreachable(TimeoutError()) and not is_unreachable(ValueError())


async def test_an_agent_process_logs_one_line_per_server_outage(tmp_path: Path) -> None:
    from agentroster.client.roster import AgentRoster
    from agentroster.client.outage import quiet_core_runtime
    from agentroster.workers.dev import DevServer
    from agentroster.workers.worker import create_worker

    server = DevServer(free_port(), free_port(), tmp_path / "temporal.db")
    assert await server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_", "KUBERNETES_"))}
    env.update(
        TEMPORAL_ADDRESS=server.address,
        AGENTROSTER_LEASE_KEY=os.environ["AGENTROSTER_LEASE_KEY"],
        AGENT_HOST="127.0.0.1",
        HEARTBEAT_INTERVAL_S="1",
        PYTHONUNBUFFERED="1",
    )
    log_file = tmp_path / "agent.log"
    agent: subprocess.Popen[bytes] | None = None
    try:
        roster = await AgentRoster.connect(server.address, runtime=quiet_core_runtime())
        async with create_worker(roster.client, task_queue=roster.task_queue, backend="none"), aiohttp.ClientSession() as http:
            with open(log_file, "wb") as log:
                agent = subprocess.Popen([sys.executable, "-m", "examples.math_agent"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            (agent_id,) = await eventually(lambda: roster.find("math.eval"), timeout=60, interval=0.3)
            endpoint = (await roster.describe(agent_id)).registration.endpoint  # type: ignore[union-attr]

            async def agent_status() -> dict[str, Any]:
                async with http.get(f"{endpoint}/status") as resp:
                    return await resp.json()

            server.stop()  # the server goes away under the agent
            await eventually(lambda: _at_least(agent_status(), "heartbeat_failures", 2), timeout=90, interval=0.5)
            assert await server.start() is True  # and comes back, on the same state
            await eventually(lambda: "went through again" in log_file.read_text(), timeout=90, interval=0.5)
            failures = (await agent_status())["heartbeat_failures"]
            agent.terminate()  # drains while the worker still runs
            await asyncio.to_thread(agent.wait, 60)
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            await asyncio.to_thread(agent.wait, 60)
        server.stop()
    text = log_file.read_text()
    assert failures >= 2
    assert text.count("cannot reach the Temporal server") == 1, text[-4000:]
    assert text.count("went through again") == 1, text[-4000:]
    assert "retried" not in text and "temporalio_client" not in text, text[-4000:]  # no SDK retry warning per attempt
    assert "heartbeat failed (" not in text  # the old warning per failed heartbeat


async def _at_least(value: Any, key: str, n: int) -> bool:
    return (await value)[key] >= n
