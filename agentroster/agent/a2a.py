"""Our agents are A2A agents too: an Agent Card and `message/send` beside `POST /tasks/{capability}`.

The agent runtime (`agentroster.agent.runtime`) adds two routes to its aiohttp server when
a2a-sdk is installed (the `a2a` extra):

- `GET /.well-known/agent-card.json`: the Agent Card. Skills are the capabilities
  (skill id = capability name), the card's `version` is the first capability's, and
  each skill's version and JSON Schemas ride in the `urn:agentroster:skill-schemas`
  extension (so `agentroster a2a add` imports the exact contracts). The security
  scheme `lease_token` is HTTP bearer with a JWT: the lease token.
- `POST /a2a`: A2A JSON-RPC (`SendMessage`; the client sends `A2A-Version: 1.0`).

Both are served by a2a-sdk's own Starlette routes (`create_agent_card_routes`,
`create_jsonrpc_routes` with `DefaultRequestHandler`), called in process through
httpx's ASGI transport: one port, the official JSON-RPC implementation. A request
without a valid lease token is refused with HTTP 401 before the SDK sees it; a valid
one runs the task through `TaskServer.invoke`, the same checks and caps as
`POST /tasks/{capability}`. The capability is the message's `metadata.capability`,
else the token's. Outcomes: the output as the reply message (a data part, or a text
part for a string); a refused token is `auth-required`, a refused input (400, 404,
409, 422) `rejected`, any other failure `failed`, with our message as the status text.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from agentroster.client.a2a import output_of, payload_part
from agentroster.vocabulary.a2a import CARD_PATH, JSONRPC, SCHEMAS_EXTENSION
from agentroster.agent.task_server import TaskServer
from agentroster.messages import InvokeRequest
from agentroster.client.lease_tokens import AUTH_HEADER, AUTH_SCHEME, LeaseClaims, LeaseTokenError

logger = logging.getLogger("agentroster.agent.runtime")

A2A_PATH = "/a2a"
SECURITY_SCHEME = "lease_token"
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}


def available() -> bool:
    """Whether a2a-sdk (with its Starlette server) is installed."""
    try:
        import a2a.server.routes  # noqa: F401
        import httpx  # noqa: F401
    except ImportError:
        return False
    return True


def agent_card(tasks: TaskServer, *, name: str, endpoint: str, description: str = "") -> Any:
    """The Agent Card of an agent that serves `tasks`' capabilities at `endpoint`."""
    from google.protobuf import json_format, struct_pb2
    from a2a.types import (
        AgentCapabilities,
        AgentCard,
        AgentExtension,
        AgentInterface,
        AgentSkill,
        HTTPAuthSecurityScheme,
        SecurityRequirement,
        SecurityScheme,
        StringList,
    )

    caps = tasks.capabilities
    schemas = struct_pb2.Struct()
    json_format.ParseDict(
        {c.name: {"version": c.version, "input_schema": c.input_schema, "output_schema": c.output_schema} for c in caps}, schemas
    )
    card = AgentCard(
        name=name,
        description=description or f"agentroster agent {tasks.agent_id}: " + ", ".join(c.key for c in caps),
        version=caps[0].version,
        supported_interfaces=[AgentInterface(url=endpoint + A2A_PATH, protocol_binding=JSONRPC, protocol_version="1.0")],
        capabilities=AgentCapabilities(
            streaming=False,
            extensions=[AgentExtension(uri=SCHEMAS_EXTENSION, description="each skill's version and JSON Schemas", params=schemas)],
        ),
        default_input_modes=["application/json", "text/plain"],
        default_output_modes=["application/json", "text/plain"],
        skills=[
            AgentSkill(id=c.name, name=c.name, description=f"{c.key} (cost class {c.cost_class})", tags=[c.name.split(".")[0]])
            for c in caps
        ],
    )
    card.security_schemes[SECURITY_SCHEME].CopyFrom(
        SecurityScheme(http_auth_security_scheme=HTTPAuthSecurityScheme(scheme="bearer", bearer_format="JWT",
                                                                        description="the roster's lease token for this agent"))
    )
    card.security_requirements.append(SecurityRequirement(schemes={SECURITY_SCHEME: StringList()}))
    return card


def _executor(tasks: TaskServer) -> Any:
    from a2a.helpers.proto_helpers import new_task_from_user_message, new_text_message
    from a2a.server.agent_execution import AgentExecutor
    from a2a.server.tasks import TaskUpdater
    from a2a.types import Message, Role

    class RuntimeExecutor(AgentExecutor):
        """`message/send` as one task of `TaskServer.invoke`."""

        async def execute(self, context: Any, event_queue: Any) -> None:
            message = context.message
            headers = context.call_context.state.get("headers", {})
            claims: LeaseClaims | None = None
            problem: tuple[int, str] | None = None
            if tasks.lease_keys is None or tasks.lease_keys.enabled:
                try:
                    claims = tasks.verified_header(headers.get(AUTH_HEADER.lower()))
                except LeaseTokenError as exc:
                    problem = (401, f"agent {tasks.agent_id}: {exc}")
            meta = dict(message.metadata) if message.HasField("metadata") else {}
            name = str(meta.get("capability") or (claims.capability if claims else "") or next(iter(tasks.served), ""))
            served = tasks.served.get(name)
            if problem is None:
                body = InvokeRequest(
                    lease_id=claims.lease_id if claims else str(meta.get("lease_id") or "a2a"),
                    capability=name,
                    version=claims.version if claims else str(meta.get("version") or (served.capability.version if served else "0.0.0")),
                    input=output_of([message.parts]),
                )
                response = await tasks.invoke(name, body, claims)
                text = response.text or ""
                if response.status == 200:
                    output = json.loads(text).get("output")
                    await event_queue.enqueue_event(
                        Message(message_id=f"{context.task_id}-reply", context_id=context.context_id, task_id="",
                                role=Role.ROLE_AGENT, parts=[payload_part(output)])
                    )
                    return
                try:
                    said = json.loads(text).get("error", text)
                except ValueError:
                    said = text
                problem = (response.status, str(said))
            status, said = problem
            task = context.current_task or new_task_from_user_message(message)
            await event_queue.enqueue_event(task)
            updater = TaskUpdater(event_queue, task.id, task.context_id)
            reply = new_text_message(f"{status}: {said}", context_id=task.context_id, task_id=task.id)
            if status == 401:
                await updater.requires_auth(reply)
            elif status in (400, 404, 409, 422):
                await updater.reject(reply)
            else:
                await updater.failed(reply)

        async def cancel(self, context: Any, event_queue: Any) -> None:
            return None  # a task runs to its end; the lease bounds it

    return RuntimeExecutor()


class A2AEndpoint:
    """The aiohttp routes that hand the card and A2A JSON-RPC to a2a-sdk's Starlette app."""

    def __init__(self, tasks: TaskServer, *, name: str, endpoint: Any, description: str = "") -> None:
        self.tasks = tasks
        self.name = name
        self.endpoint = endpoint  # () -> the agent's base URL, known once it is bound
        self.description = description
        self._http: Any = None
        self._handler: Any = None  # a2a-sdk's request handler; its active tasks are closed with the endpoint

    def routes(self) -> list[web.RouteDef]:
        return [web.get(CARD_PATH, self._forward), web.post(A2A_PATH, self._forward), web.post(A2A_PATH + "/", self._forward)]

    def _client(self) -> Any:
        if self._http is None:
            import httpx
            from a2a.server.request_handlers import DefaultRequestHandler
            from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
            from a2a.server.tasks import InMemoryTaskStore
            from starlette.applications import Starlette

            card = agent_card(self.tasks, name=self.name, endpoint=self.endpoint(), description=self.description)
            self._handler = DefaultRequestHandler(agent_executor=_executor(self.tasks), task_store=InMemoryTaskStore(), agent_card=card)
            app = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(self._handler, rpc_url="/")])
            self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")
        return self._http

    async def _forward(self, request: web.Request) -> web.Response:
        if request.method == "POST" and (self.tasks.lease_keys is None or self.tasks.lease_keys.enabled):
            try:
                self.tasks.verified_header(request.headers.get(AUTH_HEADER))
            except LeaseTokenError as exc:
                self.tasks.lease_refusals[exc.reason] = self.tasks.lease_refusals.get(exc.reason, 0) + 1
                response = web.json_response(
                    {"jsonrpc": "2.0", "id": None, "error": {"code": -32001, "message": f"agent {self.tasks.agent_id}: {exc}"}},
                    status=exc.status,
                )
                if exc.status == 401:
                    response.headers["WWW-Authenticate"] = AUTH_SCHEME
                return response
        path = "/" if request.method == "POST" else CARD_PATH
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        answer = await self._client().request(request.method, path, headers=headers, content=await request.read())
        out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS | {"content-encoding"}}
        return web.Response(status=answer.status_code, body=answer.content, headers=out_headers)

    async def close(self) -> None:
        """Closes the handler's active tasks, then the in-process client.

        An active task left open is a pair of pending coroutines; once the loop is gone the garbage collector
        finalizes them in whatever thread allocates next, and their finalizer takes a threading lock
        (culsans' queue mutex), which can block that thread for good.
        """
        handler, self._handler = self._handler, None
        http, self._http = self._http, None
        if handler is not None:
            await handler.aclose()
        if http is not None:
            await http.aclose()


__all__ = ["A2AEndpoint", "A2A_PATH", "SECURITY_SCHEME", "agent_card", "available"]
