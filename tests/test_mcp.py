"""The fleet as MCP tools, tested with the `mcp` SDK's own client against `agentroster mcp`
started as a subprocess: a real dev server, real HTTP agents (the example math and code
agents), the stdio transport and streamable HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.client import Client as MCPClient
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from agentroster.agent.runtime import AgentRuntime
from examples import code_agent, math_agent
from examples.math_agent import INPUT_SCHEMA as MATH_INPUT
from tests.conftest import eventually, free_port

REPO = Path(__file__).resolve().parent.parent


def _mcp_args(stack: Any, *extra: str) -> list[str]:
    address = stack.env.client.service_client.config.target_host
    return ["-m", "agentroster.workers.cli", "mcp", "--address", address, "--pool", stack.pool, "--task-queue", stack.task_queue, *extra]


@asynccontextmanager
async def _stdio_session(stack: Any, *extra: str, **session_options: Any) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=_mcp_args(stack, *extra), env=dict(os.environ), cwd=REPO)
    async with stdio_client(params) as (read, write), ClientSession(read, write, **session_options) as session:
        initialized = await session.initialize()
        assert initialized.capabilities.tools is not None and initialized.capabilities.tools.list_changed
        yield session


async def _agent(module: Any, stack: Any) -> AgentRuntime:
    env = {"AGENT_PORT": "0", "AGENT_HOST": "127.0.0.1", "HEARTBEAT_INTERVAL_S": "5"}
    agent = module.build_agent(env, agent_id=f"{module.__name__.split('.')[-1].replace('_', '-')}-{uuid.uuid4().hex[:6]}", roster=stack.roster)
    await agent.start()
    await agent.wait_ready(20)
    return agent


def _text(result: types.CallToolResult) -> str:
    return " ".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def test_mcp_stdio_lists_calls_and_refuses(stack) -> None:
    math = await _agent(math_agent, stack)
    changes: list[Any] = []

    async def on_message(message: Any) -> None:
        changes.append(message)

    try:
        async with _stdio_session(stack, "--wait", "0.5", "--refresh", "0.5", message_handler=on_message) as session:
            listed = (await session.list_tools()).tools
            assert [t.name for t in listed] == ["math.eval"]
            tool = listed[0]
            assert tool.input_schema == MATH_INPUT
            assert tool.output_schema == math_agent.OUTPUT_SCHEMA
            assert "math.eval@1.0.0" in (tool.description or "")

            served = await session.call_tool("math.eval", {"expression": "sqrt(16) + 2**10"})
            assert not served.is_error, _text(served)
            assert served.structured_content == {"value": 1028.0}
            assert '"value": 1028.0' in _text(served)

            refused = await session.call_tool("math.eval", {"expression": "x + 1"})
            assert refused.is_error and "unknown name 'x'" in _text(refused)

            unknown = await session.call_tool("no.such.capability", {})
            assert unknown.is_error and "CapabilityUnknownError" in _text(unknown) and "no.such.capability" in _text(unknown)
            not_a_name = await session.call_tool("rm -rf /", {})
            assert not_a_name.is_error and "'rm -rf /' is not a dotted capability name" in _text(not_a_name), _text(not_a_name)

            # Every slot of the only agent held: the call waits --wait seconds, then the pool's refusal.
            held = [await stack.roster.acquire("math.eval") for _ in range(4)]
            try:
                exhausted = await session.call_tool("math.eval", {"expression": "1 + 1"})
            finally:
                await stack.roster.release_many(held)
            assert exhausted.is_error and "PoolExhaustedError" in _text(exhausted), _text(exhausted)

            # An agent joins with another capability: the list follows, and the client is told.
            code = await _agent(code_agent, stack)
            try:
                names = await eventually(
                    lambda: _names(session, {"math.eval", "code.python.exec"}), timeout=30, interval=0.5
                )
                assert names == {"math.eval", "code.python.exec"}
                await eventually(lambda: any("list_changed" in repr(m) for m in changes), timeout=30, interval=0.5)
            finally:
                await code.stop(drain=False)
    finally:
        await math.stop(drain=False)


async def _names(session: ClientSession, want: set[str]) -> set[str] | None:
    names = {t.name for t in (await session.list_tools()).tools}
    return names if names == want else None


async def test_mcp_streamable_http(stack) -> None:
    math = await _agent(math_agent, stack)
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, *_mcp_args(stack, "--http", str(port), "--refresh", "0.5"), cwd=REPO, env=dict(os.environ),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,  # -v: its log shows the watcher
    )
    try:
        assert process.stderr is not None
        while f"http://127.0.0.1:{port}/mcp" not in (line := (await asyncio.wait_for(process.stderr.readline(), 60)).decode()):
            assert line, "agentroster mcp --http ended before it served"

        url = f"http://127.0.0.1:{port}/mcp"
        # The SDK's high-level client (it negotiates the newest protocol era the server speaks) ...
        async with MCPClient(url) as client:
            assert [t.name for t in (await client.list_tools()).tools] == ["math.eval"]
            served = await client.call_tool("math.eval", {"expression": "6 * 7"})
            assert not served.is_error, _text(served)
            assert served.structured_content == {"value": 42}
            unknown = await client.call_tool("no.such.capability", {})
            assert unknown.is_error and "no.such.capability" in _text(unknown)
            # A listen stream hears that the tools changed when another agent joins.
            async with client.listen(tools_list_changed=True) as changes:
                code = await _agent(code_agent, stack)
                try:
                    event = await asyncio.wait_for(anext(aiter(changes)), 60)
                    assert type(event).__name__ == "ToolsListChanged"
                    assert {t.name for t in (await client.list_tools()).tools} == {"math.eval", "code.python.exec"}
                finally:
                    await code.stop(drain=False)
        # ... and a handshake-era session over the same transport.
        async with streamable_http_client(url) as (read, write), ClientSession(read, write) as session:
            initialized = await session.initialize()
            assert initialized.capabilities.tools is not None and initialized.capabilities.tools.list_changed
            served = await session.call_tool("math.eval", {"expression": "2 ** 5"})
            assert served.structured_content == {"value": 32}, _text(served)
    finally:
        process.terminate()
        await process.wait()
        await math.stop(drain=False)


async def test_mcp_wraps_schemas_that_are_not_objects(stack) -> None:
    """MCP wants object schemas at the root: a string-in, string-out capability takes its payload
    as the `input` argument and answers `{"result": ...}` as structured content."""
    agent = AgentRuntime(f"upper-{uuid.uuid4().hex[:6]}", "upper-agent", roster=stack.roster, host="127.0.0.1", heartbeat_interval_s=5)

    @agent.capability("text.upper", "2.0.0", input_schema={"type": "string", "maxLength": 20}, output_schema={"type": "string"})
    def upper(payload: str) -> str:
        return payload.upper()

    await agent.start()
    try:
        await agent.wait_ready(20)
        # The SDK's high-level client over stdio, as docs/mcp.md shows it (the newest era the server speaks).
        params = StdioServerParameters(command=sys.executable, args=_mcp_args(stack), env=dict(os.environ), cwd=REPO)
        async with MCPClient(params) as session:
            (tool,) = (await session.list_tools()).tools
            assert tool.name == "text.upper"
            assert tool.input_schema == {
                "type": "object", "properties": {"input": {"type": "string", "maxLength": 20}}, "required": ["input"]
            }
            assert tool.output_schema == {"type": "object", "properties": {"result": {"type": "string"}}, "required": ["result"]}
            served = await session.call_tool("text.upper", {"input": "roster"})
            assert not served.is_error, _text(served)
            assert served.structured_content == {"result": "ROSTER"} and _text(served) == '"ROSTER"'
            too_long = await session.call_tool("text.upper", {"input": "x" * 21})
            assert too_long.is_error and "InvalidTaskInputError" in _text(too_long) and "input_schema" in _text(too_long)
            missing = await session.call_tool("text.upper", {"text": "roster"})
            assert missing.is_error and "'input' argument" in _text(missing)
    finally:
        await agent.stop(drain=False)


def test_mcp_refuses_bad_flags_before_connecting() -> None:
    for flag, value in (("--wait", "-1"), ("--refresh", "0"), ("--task-timeout", "nan")):
        result = subprocess.run(
            [sys.executable, "-m", "agentroster.workers.cli", "mcp", "--address", "localhost:1", flag, value],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2 and f"agentroster mcp: {flag} must be" in result.stderr, result.stderr
        assert result.stdout == ""


def test_mcp_without_the_extra_names_it() -> None:
    """A base install has no MCP SDK: the command says which extra brings it."""
    absent = (
        "import importlib.abc, sys\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('mcp', 'mcp_types'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "from agentroster.workers.cli import main\n"
        "main(['mcp', '--address', 'localhost:1'])\n"
    )
    result = subprocess.run([sys.executable, "-c", absent], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "pip install 'agentroster[mcp]'" in result.stderr and result.stdout == ""


def test_the_listed_version_is_the_highest_release_and_calls_go_to_its_major() -> None:
    from agentroster.workers.mcp_server import listed_version

    offered = {"1.0.0": ["a"], "1.2.0": ["b", "c"], "0.9.0": ["d"], "2.0.0-beta.1": ["e"]}
    assert listed_version("rag.search", offered) == ("1.2.0", "rag.search@>=1,<2", 3)
    # Only pre-releases: the highest one, pinned (a range would leave it out).
    assert listed_version("rag.search", {"2.0.0-beta.1": ["e"], "2.0.0-alpha.3": ["f", "g"]}) == (
        "2.0.0-beta.1", "rag.search@==2.0.0-beta.1", 1,
    )
