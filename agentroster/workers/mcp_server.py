"""The fleet as MCP tools: `agentroster mcp --pool P` (stdio) or `--http PORT` (streamable HTTP).

Built on the low-level `Server` of the official `mcp` SDK:

- `tools/list` lists the capabilities the pool's live agents offer (states
  Registering, Ready, Busy; Draining and Terminated agents are left out). Tool
  name = capability name: our names (`[A-Za-z][A-Za-z0-9_-]*` dotted, at most
  128 characters) always satisfy MCP's tool-name rule (`[A-Za-z0-9._-]{1,128}`),
  so no name is mapped. Where agents offer several versions of one name, the
  highest release is listed and calls go to its major (`name@>=M,<M+1`); a name
  offered only in pre-releases is listed at the highest, and calls pin it.
- `inputSchema` is the capability's `input_schema` when that is an object
  schema (MCP requires `type: object` at the root). Any other input schema is
  wrapped as `{"input": <schema>}`, and the call's `input` argument is the
  payload. `outputSchema` follows the same rule with `result`: the structured
  content is the output itself for an object schema, else `{"result": output}`.
- The list comes from the pool's `status` (through `AgentRoster.status`), the
  schemas from one agent per `name@version` (`AgentRoster.describe`: its
  registration; a version is a contract, so they are kept). The list is kept
  `refresh_s` seconds; once a client has asked something it is read again
  every `refresh_s` (one `status` query), and when the set of tools changes
  `notifications/tools/list_changed` goes to the handshake-era sessions
  (protocol versions up to 2025-11-25) and to every `subscriptions/listen`
  stream (2026-07-28).
- `tools/call` runs one task with `AgentRoster.invoke`: lease, schema checks,
  POST with the lease token, failover to another agent, release: the rules of
  `CapabilityTaskWorkflow`. The output comes back as structured content and as
  JSON text. Our errors (unknown capability, exhausted pool, refused input,
  every attempt failed, pool shut down) come back as a tool error (`isError`)
  carrying our message, so the model that called the tool can read it.

This process signs lease tokens itself: it needs `AGENTROSTER_LEASE_KEY`, as any
caller of `AgentRoster.invoke` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from agentroster.client.roster import AgentRoster
from agentroster.errors import AgentRosterError
from agentroster.models import AgentState, Capability
from agentroster.vocabulary.versions import parse_semver

logger = logging.getLogger("agentroster.mcp")

# Agents whose capabilities are listed: those the pool may route to now or soon.
LISTED_STATES = frozenset({AgentState.REGISTERING, AgentState.READY, AgentState.BUSY})
INPUT_KEY = "input"
RESULT_KEY = "result"
MAX_SESSIONS = 64


def is_object_schema(schema: dict[str, Any]) -> bool:
    """Whether `schema` is an object schema at its root, as MCP's inputSchema must be."""
    return schema.get("type") == "object"


def listed_version(name: str, versions: dict[str, list[str]]) -> tuple[str, str, int]:
    """(the version listed, the ref calls go to, how many agents serve that ref) for `name`,
    offered in `versions` (version -> agent ids): the highest release and its major, else
    (only pre-releases offered) the highest pre-release, pinned, as ranges leave them out."""
    releases = [v for v in versions if not parse_semver(v).is_prerelease]
    version = max(releases or versions, key=parse_semver)
    if not releases:
        return version, f"{name}@=={version}", len(versions[version])
    major = parse_semver(version).major
    agents = sum(len(ids) for v, ids in versions.items() if v in releases and parse_semver(v).major == major)
    return version, f"{name}@>={major},<{major + 1}", agents


@dataclass(frozen=True)
class FleetTool:
    """One capability as an MCP tool: what `tools/list` shows and how `tools/call` reaches it."""

    capability: Capability
    agents: int
    ref: str

    @property
    def wraps_input(self) -> bool:
        return not is_object_schema(self.capability.input_schema)

    @property
    def wraps_output(self) -> bool:
        return not is_object_schema(self.capability.output_schema)

    def tool(self, pool: str) -> types.Tool:
        cap = self.capability
        input_schema = cap.input_schema
        if self.wraps_input:
            input_schema = {"type": "object", "properties": {INPUT_KEY: input_schema}, "required": [INPUT_KEY]}
        output_schema = cap.output_schema
        if self.wraps_output:
            output_schema = {"type": "object", "properties": {RESULT_KEY: output_schema}, "required": [RESULT_KEY]}
        about = cap.input_schema.get("description")
        description = (
            f"Capability {cap.key} of agentroster pool {pool!r} (cost class {cap.cost_class}, "
            f"{self.agents} agent(s) offer it); calls go to {self.ref}, leased, checked and failed over by the pool."
        )
        return types.Tool(
            name=cap.name,
            title=cap.key,
            description=f"{about}\n\n{description}" if isinstance(about, str) and about else description,
            input_schema=input_schema,
            output_schema=output_schema,
        )

    def payload(self, arguments: dict[str, Any]) -> Any:
        """The task's payload from the call's arguments."""
        if self.wraps_input:
            if INPUT_KEY not in arguments:
                raise ValueError(f"arguments: {self.capability.name} takes its payload as the {INPUT_KEY!r} argument")
            return arguments[INPUT_KEY]
        return arguments

    def structured(self, output: Any) -> Any:
        return {RESULT_KEY: output} if self.wraps_output else output


class _FleetServer(Server[Any]):
    """The SDK's low-level server, telling handshake-era clients (`initialize`, on stdio and on
    HTTP alike) that its tool list changes and that it says so."""

    def create_initialization_options(self, notification_options: NotificationOptions | None = None, *args: Any, **kwargs: Any) -> Any:
        return super().create_initialization_options(notification_options or NotificationOptions(tools_changed=True), *args, **kwargs)


class FleetTools:
    """The pool's capabilities as MCP tools, read through one `AgentRoster`, and the calls to them."""

    def __init__(
        self,
        roster: AgentRoster,
        *,
        refresh_s: float = 5.0,
        wait_s: float = 30.0,
        task_timeout_s: float = 60.0,
        max_attempts: int = 3,
    ) -> None:
        if not refresh_s > 0:
            raise ValueError(f"refresh_s: must be > 0, got {refresh_s}")
        if not wait_s >= 0:
            raise ValueError(f"wait_s: must be >= 0, got {wait_s}")
        self.roster = roster
        self.refresh_s = refresh_s
        self.wait_s = wait_s
        self.task_timeout_s = task_timeout_s
        self.max_attempts = max_attempts
        self._tools: dict[str, FleetTool] = {}
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()
        self._capabilities: dict[str, Capability] = {}  # by name@version: a version is a contract
        # One request's ServerSession per connection that spoke to us (its notifications go on the
        # connection's own channel), by the identity of the connection's `initialize` params; the
        # last MAX_SESSIONS connections are kept (a notification to one that closed is dropped).
        self.sessions: OrderedDict[int, Any] = OrderedDict()
        self.bus = InMemorySubscriptionBus()  # what `subscriptions/listen` streams hear
        self.used = False  # a client has asked something: from then on the pool is watched

    def seen(self, session: Any) -> None:
        """Remember the connection `session` belongs to, to tell it when the tools change."""
        self.used = True
        if session.client_params is None or session.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return  # the 2026-07-28 era hears of changes on `subscriptions/listen` streams (`self.bus`)
        key = id(session.client_params)  # stays unique: the kept session holds its connection
        self.sessions[key] = session
        self.sessions.move_to_end(key)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    async def tools(self, *, fresh: bool = False) -> dict[str, FleetTool]:
        """The tools by name, read again when older than `refresh_s` (or `fresh`); a read that finds
        another set of tools than the one before tells the clients (`tell_changed`)."""
        changed = False
        async with self._lock:
            if fresh or time.monotonic() - self._read_at >= self.refresh_s:
                before = self._keys()
                self._tools = await self._read()
                self._read_at = time.monotonic()
                changed = before is not None and before != self._keys()
            tools = self._tools
        if changed:
            await self.tell_changed()
        return tools

    def _keys(self) -> list[str] | None:
        return None if self._read_at == -float("inf") else sorted(t.capability.key for t in self._tools.values())

    async def _read(self) -> dict[str, FleetTool]:
        status = await self.roster.status()
        offered: dict[str, dict[str, list[str]]] = {}  # name -> version -> agent ids
        for row in status.agents:
            if row.state not in LISTED_STATES or row.silent or row.retiring:
                continue
            for key in row.capabilities:
                name, _, version = key.partition("@")
                offered.setdefault(name, {}).setdefault(version, []).append(row.agent_id)
        tools: dict[str, FleetTool] = {}
        for name, versions in sorted(offered.items()):
            version, ref, agents = listed_version(name, versions)
            cap = await self._capability(name, version, versions[version])
            if cap is not None:
                tools[name] = FleetTool(cap, agents, ref)
        return tools

    async def _capability(self, name: str, version: str, agent_ids: list[str]) -> Capability | None:
        """`name@version`'s contract, from the registration of one agent offering it."""
        key = f"{name}@{version}"
        if key in self._capabilities:
            return self._capabilities[key]
        for agent_id in agent_ids:
            try:
                reg = (await self.roster.describe(agent_id)).registration
            except AgentRosterError as exc:
                logger.warning("describing %s for %s: %s", agent_id, key, exc)
                continue
            cap = reg.capability(name) if reg is not None else None
            if cap is not None and cap.version == version:
                self._capabilities[key] = cap
                return cap
        return None

    async def list_tools(self) -> list[types.Tool]:
        return [t.tool(self.roster.pool) for t in (await self.tools()).values()]

    async def call_tool(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        """Run one task on the capability `name`; our errors come back as a tool error with our message."""
        arguments = arguments or {}
        tool = (await self.tools()).get(name) or (await self.tools(fresh=True)).get(name)
        try:
            if tool is None:
                # Not offered by a live agent now: the pool says why (unknown, or no agent free in time).
                ref, payload = name, arguments
            else:
                ref, payload = tool.ref, tool.payload(arguments)
            output = await self.roster.invoke(
                ref, payload, timeout=self.wait_s, task_timeout_s=self.task_timeout_s, max_attempts=self.max_attempts
            )
        except (AgentRosterError, ValueError) as exc:
            return types.CallToolResult(content=[types.TextContent(text=f"{type(exc).__name__}: {exc}")], is_error=True)
        structured = tool.structured(output) if tool is not None else (output if isinstance(output, dict) else {RESULT_KEY: output})
        return types.CallToolResult(
            content=[types.TextContent(text=json.dumps(output, ensure_ascii=False))], structured_content=structured
        )

    async def watch(self) -> None:
        """Once a client has asked something, read the tools every `refresh_s`; when the set changes,
        send `notifications/tools/list_changed` to handshake-era sessions and to `subscriptions/listen` streams."""
        while True:
            await asyncio.sleep(self.refresh_s)
            if not self.used:
                continue
            try:
                await self.tools(fresh=True)
            except Exception as exc:  # the server is briefly unreachable: try again next time
                logger.warning("watching the pool's tools: %s: %s", type(exc).__name__, exc)

    async def tell_changed(self) -> None:
        """`notifications/tools/list_changed` to every session and listen stream (best effort)."""
        logger.info("the tools of pool %s changed", self.roster.pool)
        await self.bus.publish(ToolsListChanged())
        for session in list(self.sessions.values()):
            with contextlib.suppress(Exception):  # a session that went away meanwhile
                await session.send_tool_list_changed()

    def server(self) -> Server[Any]:
        """The MCP server: `tools/list` and `tools/call` over this pool."""

        async def on_list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
            self.seen(ctx.session)
            return types.ListToolsResult(tools=await self.list_tools())

        async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
            self.seen(ctx.session)
            return await self.call_tool(params.name, params.arguments)

        return _FleetServer(
            "agentroster",
            title=f"agentroster pool {self.roster.pool}",
            instructions=f"Each tool is a capability of the agentroster pool {self.roster.pool!r}; a call runs one task on one of its agents.",
            on_list_tools=on_list_tools,
            on_call_tool=on_call_tool,
            on_subscriptions_listen=ListenHandler(self.bus),
        )


async def serve_stdio(fleet: FleetTools) -> None:
    """Serve MCP on this process's stdin and stdout until the client closes them."""
    from mcp.server.stdio import stdio_server

    server = fleet.server()
    watcher = asyncio.create_task(fleet.watch())
    try:
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def serve_http(fleet: FleetTools, port: int, host: str = "127.0.0.1", *, on_ready: Callable[[], None] | None = None) -> None:
    """Serve MCP over streamable HTTP at `http://{host}:{port}/mcp` until cancelled or interrupted;
    `on_ready` is called once the port accepts connections."""
    import uvicorn

    app = fleet.server().streamable_http_app(host=host)
    web = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    watcher = asyncio.create_task(fleet.watch())
    serving = asyncio.create_task(web.serve())
    try:
        while not web.started and not serving.done():
            await asyncio.sleep(0.05)
        if web.started and on_ready is not None:
            on_ready()
        await serving
    finally:
        serving.cancel()
        watcher.cancel()
        for task in (serving, watcher):
            with contextlib.suppress(asyncio.CancelledError):
                await task


__all__ = ["FleetTool", "FleetTools", "is_object_schema", "serve_http", "serve_stdio"]
