"""The README's "Your first agent", as a new user runs it: the agent file as written,
started by its fleet-file entry (the local backend, as `agentroster dev --fleet` does)
and a second copy by hand with no AGENT_* settings at all; then the README's call
script (`roster.invoke` and a standalone `CapabilityTaskWorkflow`) in a process of
its own. A real dev server and the stack's worker serve them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentroster.activities.local_backend import LocalBackend
from tests.conftest import eventually

REPO = Path(__file__).resolve().parents[1]


def readme_block(marker: str, language: str) -> str:
    """The first ```language block after `<!-- snippet: marker -->` in the README."""
    text = (REPO / "README.md").read_text()
    tag = f"<!-- snippet: {marker} -->"
    assert tag in text, f"the README lost its {marker} snippet"
    match = re.search(rf"```{language}\n(.*?)```", text[text.index(tag) :], re.S)
    assert match, f"no {language} block after {tag}"
    return match.group(1)


def user_env(stack: Any) -> dict[str, str]:
    """What a user's shell would hold beside a running stack: where the roster is, and its lease key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_", "KUBERNETES_"))}
    env.update(
        TEMPORAL_ADDRESS=stack.env.client.service_client.config.target_host,
        AGENTROSTER_POOL=stack.pool,
        AGENTROSTER_TASK_QUEUE=stack.task_queue,
        AGENTROSTER_LEASE_KEY=os.environ["AGENTROSTER_LEASE_KEY"],
        PYTHONPATH=str(REPO),  # the package, as `pip install -e .` would give it
    )
    return env


async def test_the_readme_agent_runs_as_written_from_its_fleet_entry_and_by_hand(
    stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "echo_agent.py").write_text(readme_block("first-agent", "python"))
    (tmp_path / "my-fleet.toml").write_text(readme_block("first-agent-fleet", "toml"))
    (tmp_path / "call.py").write_text(readme_block("first-agent-call", "python"))
    env = user_env(stack)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    backend = LocalBackend(tmp_path / "my-fleet.toml", roster=stack.roster, log_dir=tmp_path / "logs")
    await backend.start()
    by_hand = await asyncio.create_subprocess_exec(
        sys.executable, "echo_agent.py", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        # Two copies on one machine, neither told its id or port: both register, apart.
        ids = await eventually(lambda: _two(stack.roster.find("text.echo@^1")), timeout=90, interval=0.5)
        assert all(re.fullmatch(r"echo-agent-[a-z0-9]{5}", agent_id) for agent_id in ids), ids
        endpoints = {(await stack.roster.describe(agent_id)).registration.endpoint for agent_id in ids}  # type: ignore[union-attr]
        assert len(endpoints) == 2 and all(e.startswith("http://127.0.0.1:") for e in endpoints), endpoints

        call = await asyncio.to_thread(
            subprocess.run, [sys.executable, "call.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        # `async with AgentRoster.connect()` closes the roster: the script exits 0.
        assert call.returncode == 0, (call.stdout + call.stderr)[-4000:]
        invoked, workflow = call.stdout.splitlines()[:2]
        assert invoked == "{'echo': 'hello'}"
        agent_id, output = workflow.split(" ", 1)
        assert agent_id in ids and output == "{'echo': 'hello'} 1"

        # The workflow's lease goes back just after its result (it waits up to 100 ms to ride on an acquire).
        async def all_returned() -> bool:
            status = await stack.roster.status()
            return status.active_leases == 0 and status.leases_granted == status.leases_released == 2

        assert await eventually(all_returned, timeout=10)
    finally:
        if by_hand.returncode is None:
            by_hand.send_signal(signal.SIGTERM)
        log, _ = await asyncio.wait_for(by_hand.communicate(), timeout=90)
        await backend.stop()
    # Ctrl-C / SIGTERM drains the agent and the process ends cleanly.
    assert by_hand.returncode == 0, log.decode()[-4000:]
    assert '"drained": true' in log.decode()


async def _two(found: Any) -> list[str] | None:
    ids = await found
    return ids if len(ids) == 2 else None
