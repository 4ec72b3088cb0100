"""What a new user does first: a plain `temporal server start-dev` (no search attributes
registered), then the README's Python snippet as written, in its own process."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client

from agentroster.workers.dev import DevServer
from tests.conftest import eventually, free_port

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- snippet: python-api -->"


def readme_snippet() -> str:
    """The README's Python example: the first ```python block after the marker."""
    text = (REPO / "README.md").read_text()
    after = text[text.index(MARKER) :]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match, "the README lost its Python snippet"
    return match.group(1)


async def test_the_readme_snippet_runs_as_written_against_a_plain_dev_server(tmp_path: Path) -> None:
    server = DevServer(free_port(), free_port(), tmp_path / "temporal.db")
    assert await server.start()  # `temporal server start-dev`: no --search-attribute flags
    try:
        client = await Client.connect(server.address)
        listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace="default"))
        assert "AgentPool" not in dict(listed.custom_attributes)  # the world a new user meets

        script = tmp_path / "snippet.py"
        script.write_text(readme_snippet().replace("localhost:7233", server.address))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
        result = await asyncio.to_thread(
            subprocess.run, [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        output = result.stdout + result.stderr
        # `async with AgentRoster.connect(...)` closes the roster: the script exits 0.
        assert result.returncode == 0, output[-4000:]
        assert "['search-7']" in result.stdout  # find
        assert "search-7 http://10.0.0.7:8080" in result.stdout  # borrow
        assert "has ever offered 'text.lower'" in result.stdout  # the unknown capability, at once
        assert "Terminated" in result.stdout and "Registering" in result.stdout  # drain, then describe

        listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace="default"))
        assert {"AgentState", "AgentCapabilities", "AgentDeployment", "AgentPool"} <= set(listed.custom_attributes)

        async def ended() -> list[str]:
            query = 'WorkflowType="AgentWorkflow" AND AgentState="Terminated"'
            return [wf.id async for wf in client.list_workflows(query)]

        assert await eventually(ended) == ["agent/default/search-7"]
    finally:
        server.stop()
