"""The command line: `agentroster dev --once` end to end, `status` and `drain`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from temporalio.client import Client

from agentroster import AgentState
from agentroster.workers.dev import DevServer
from tests.conftest import make_registration, free_port

REPO = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    return subprocess.run(
        [sys.executable, "-m", "agentroster.workers.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


async def test_dev_once_runs_the_demo_and_keeps_history(tmp_path: Path) -> None:
    port, ui_port = free_port(), free_port()
    db = tmp_path / "state" / "temporal.db"
    result = await asyncio.to_thread(_cli, "dev", "--once", "--port", str(port), "--ui-port", str(ui_port), "--db", str(db))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "plan ok" in output and f"http://localhost:{ui_port}" in output
    for agent in ("math-agent", "search-agent", "code-agent"):
        assert agent in output
    assert "stopped." in output
    logs = list((tmp_path / "state" / "logs").glob("*.log"))
    assert len(logs) >= 4  # one per agent process of the fleet
    # The server's state is in the file: a new server on it still has the plan's history. It
    # listens on ports free now (those above were free minutes ago; any process may hold them since).
    server = DevServer(free_port(), free_port(), db)
    assert await server.start()
    try:
        client = await Client.connect(server.address)
        plans = [wf async for wf in client.list_workflows("WorkflowType='ExamplePlanWorkflow'")]
        assert len(plans) == 1 and plans[0].status is not None
        agents = [wf async for wf in client.list_workflows('AgentState="Terminated"')]
        assert len(agents) >= 4  # Ctrl-C / --once drained every agent
        # ... and every agent workflow ran to its end before the worker stopped: none is
        # left open to finish only when the next stack starts.
        open_agents = [wf.id async for wf in client.list_workflows('WorkflowType="AgentWorkflow" AND ExecutionStatus="Running"')]
        assert open_agents == []
    finally:
        server.stop()


async def test_status_and_drain_commands(stack) -> None:
    await stack.roster.register(make_registration("cli-agent", [("rag.search", "2.1.0", 2, "A")]))
    lease = await stack.roster.acquire("rag.search")
    address = stack.env.client.service_client.config.target_host
    common = ["--address", address, "--pool", stack.pool, "--task-queue", stack.task_queue]
    status = await asyncio.to_thread(_cli, "status", *common, timeout=60)
    assert status.returncode == 0, status.stderr
    header, row = status.stdout.splitlines()[:2]
    assert header.split() == ["AGENT", "DEPLOYMENT", "CAPABILITIES", "STATE", "IN-FLIGHT", "LAST", "HEARTBEAT", "NOTE"]
    assert row.split()[:5] == ["cli-agent", "search-agent", "rag.search@2.1.0", "Ready", "1"]
    assert "1 active lease(s)" in status.stdout
    await stack.roster.release(lease)
    drained = await asyncio.to_thread(_cli, "drain", "cli-agent", *common, "--reason", "cli", timeout=60)
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.strip() == "cli-agent: Terminated (drain)"
    assert (await stack.roster.describe("cli-agent")).state == AgentState.TERMINATED
    missing = await asyncio.to_thread(_cli, "drain", "nobody", *common, timeout=60)
    assert missing.returncode == 1 and "nobody" in missing.stderr
