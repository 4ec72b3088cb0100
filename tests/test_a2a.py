"""A2A, from the outside: real A2A agents built with a2a-sdk (Starlette served by uvicorn),
a real dev server and the stack's worker, the a2a-sdk client against our own runtime.

- An a2a-sdk agent joins by its card (`agentroster a2a add`), serves tasks through the pool
  (`roster.invoke` and `CapabilityTaskWorkflow`, a long task followed to its end, the
  lease token as its bearer credential), and ends Terminated (`a2a_unreachable`) once its
  card stops answering; the liveness check's Temporal actions are counted from the history.
- As for HTTP agents: a failed or rejected A2A task fails over to another agent of the skill
  (the first left out); a card's schema extension is checked both ways (a bad payload never
  reaches `message/send`, a bad output fails the attempt); a task longer than its lease's TTL
  completes on a renewed lease, every `GetTask` carrying an unexpired token.
- Bad cards are refused naming the field; nothing is registered.
- Our runtime publishes its card and answers `message/send` to the a2a-sdk client with a
  valid lease token, and refuses it without one.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
import pytest_asyncio
import uvicorn
from a2a.client import A2ACardResolver, A2AClientError, ClientCallContext, ClientConfig, create_client
from a2a.helpers.proto_helpers import new_data_part, new_task_from_user_message, new_text_message
from a2a.server.agent_execution import AgentExecutor
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentExtension, AgentInterface, AgentSkill, Message, Part, Role, SendMessageRequest, TaskState
from google.protobuf import json_format, struct_pb2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from agentroster.client.a2a import A2ACardError, add_a2a_agent, output_of, payload_part
from agentroster.agent.runtime import AgentRuntime
from agentroster.errors import (
    AgentNotFoundError,
    AgentTaskFailedError,
    AgentTimeoutError,
    InvalidAgentOutputError,
    InvalidTaskInputError,
    TaskFailedError,
)
from agentroster.models import AgentState, TaskInput, TaskResult
from agentroster.client.lease_tokens import LeaseClaims, LeaseKeys, LeaseTokenError
from agentroster.vocabulary.a2a import SCHEMAS_EXTENSION
from agentroster.vocabulary.wire import INVALID_TASK_INPUT, agent_workflow_id
from tests.conftest import TEST_LEASE_KEY, eventually

KEYS = LeaseKeys.parse(TEST_LEASE_KEY)


class EchoExecutor(AgentExecutor):
    """Echoes the input as `{"echo": ...}`; `{"slow": true}` runs as a task with an artifact,
    `{"seconds": S}` makes that task last S seconds (default 1), `{"fail": true}` ends its task failed, `{"auth": true}` asks for auth. Records each call's Authorization header."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []

    async def execute(self, context: Any, event_queue: Any) -> None:
        self.authorizations.append(context.call_context.state.get("headers", {}).get("authorization"))
        payload = output_of([context.message.parts])
        if isinstance(payload, dict) and (payload.get("slow") or payload.get("fail") or payload.get("auth")):
            task = context.current_task or new_task_from_user_message(context.message)
            await event_queue.enqueue_event(task)
            updater = TaskUpdater(event_queue, task.id, task.context_id)
            await updater.start_work()
            if payload.get("auth"):
                await updater.requires_auth(new_text_message("who are you?", context_id=task.context_id, task_id=task.id))
                return
            if payload.get("fail"):
                await updater.failed(new_text_message("no luck", context_id=task.context_id, task_id=task.id))
                return
            await asyncio.sleep(float(payload.get("seconds", 1.0)))
            await updater.add_artifact([new_data_part({"echo": payload.get("text")})])
            await updater.complete()
            return
        echo = payload.get("text") if isinstance(payload, dict) else payload
        await event_queue.enqueue_event(Message(message_id=uuid.uuid4().hex, role=Role.ROLE_AGENT, parts=[new_data_part({"echo": echo})]))

    async def cancel(self, context: Any, event_queue: Any) -> None:
        return None


@pytest.fixture(autouse=True)
def no_active_task_left_open() -> Iterator[None]:
    """After each test (its servers and runtimes stopped), no a2a-sdk `ActiveTask` coroutine is left unfinished.

    A task left open is finalized later by the garbage collector in whatever thread allocates, a workflow's
    included; the finalizer takes culsans' threading mutex and can block that thread for good.
    """
    yield
    gc.collect()
    left = [c.__qualname__ for c in gc.get_objects()
            if inspect.iscoroutine(c) and c.__qualname__.startswith("ActiveTask.") and c.cr_frame is not None]
    assert left == [], f"a2a-sdk active tasks left open: {left}"


class A2AServer:
    """A Starlette app on uvicorn, on a free loopback port (bound first, so the card can name it)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._handler: DefaultRequestHandler | None = None

    async def start(self, app: Any, handler: DefaultRequestHandler | None = None) -> A2AServer:
        self._handler = handler  # closed on stop: an open active task is finalized later in any thread, under a lock
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        await eventually(lambda: self._server is not None and self._server.started, timeout=10)
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = None
        if self._handler is not None:
            await self._handler.aclose()
            self._handler = None
        self.sock.close()


def echo_card(url: str, *, skills: list[str] | None = None, name: str = "Echo Agent") -> AgentCard:
    return AgentCard(
        name=name,
        description="echoes what it is sent",
        version="1.2.0",
        supported_interfaces=[AgentInterface(url=url + "/", protocol_binding="JSONRPC", protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=False),
        default_input_modes=["application/json"],
        default_output_modes=["application/json"],
        skills=[AgentSkill(id=s, name=s, description="echo", tags=["echo"]) for s in (skills or ["text.echo"])],
    )


@pytest_asyncio.fixture
async def echo_agent() -> AsyncIterator[tuple[A2AServer, EchoExecutor]]:
    server = A2AServer()
    executor = EchoExecutor()
    card = echo_card(server.url)
    handler = DefaultRequestHandler(agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=card)
    await server.start(Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")]), handler)
    try:
        yield server, executor
    finally:
        await server.stop()


class RefusingExecutor(AgentExecutor):
    """Ends every task it is sent failed, or rejected when the payload says `{"reject": true}`; counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def execute(self, context: Any, event_queue: Any) -> None:
        self.calls += 1
        payload = output_of([context.message.parts])
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        said = new_text_message("not today", context_id=task.context_id, task_id=task.id)
        if isinstance(payload, dict) and payload.get("reject"):
            await updater.reject(said)
        else:
            await updater.failed(said)

    async def cancel(self, context: Any, event_queue: Any) -> None:
        return None


async def serve(executor: AgentExecutor, card_of: Any) -> A2AServer:
    """An a2a-sdk agent on its own port: `card_of(url)` is its card, `executor` answers `message/send`."""
    server = A2AServer()
    card = card_of(server.url)
    handler = DefaultRequestHandler(agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=card)
    return await server.start(Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")]), handler)


def task_input(stack: Any, payload: Any, **options: Any) -> TaskInput:
    return TaskInput(ref="text.echo@>=1", payload=payload, pool=stack.pool, acquire_timeout_s=5, **options)


async def run_task(stack: Any, payload: Any, **options: Any) -> TaskResult:
    return await stack.env.client.execute_workflow(
        "CapabilityTaskWorkflow", task_input(stack, payload, **options),
        id=f"task-{uuid.uuid4().hex[:8]}", task_queue=stack.task_queue, result_type=TaskResult,
    )


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=dict(os.environ),
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


def stack_flags(stack: Any) -> list[str]:
    return ["--address", stack.env.client.service_client.config.target_host, "--pool", stack.pool, "--task-queue", stack.task_queue]


async def test_a2a_agent_joins_by_card_serves_tasks_and_ends_when_it_stops_answering(stack: Any, echo_agent: Any) -> None:
    server, executor = echo_agent
    code, out, err = await cli("a2a", "add", server.url, *stack_flags(stack), "--max-concurrency", "2",
                               "--cost-class", "A", "--heartbeat-interval", "1", "--agent-id", "echo-a2a")
    assert code == 0, err
    assert "registered A2A agent echo-a2a" in out and "capability text.echo@1.2.0" in out and "cost_class A" in out

    status = await stack.roster.describe("echo-a2a")
    assert status.state == AgentState.READY
    reg = status.registration
    assert reg is not None and reg.metadata["protocol"] == "a2a" and reg.capabilities[0].max_concurrency == 2

    # Through the pool from plain code: a data part in, the first data part out; then a string as a text part.
    assert await stack.roster.invoke("text.echo@>=1,<2", {"text": "hi"}) == {"echo": "hi"}
    assert await stack.roster.invoke("text.echo", "plain words") == {"echo": "plain words"}
    # Through CapabilityTaskWorkflow: a long task followed with GetTask until its artifact comes.
    result = await stack.env.client.execute_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="text.echo@>=1", payload={"text": "later", "slow": True}, pool=stack.pool, acquire_timeout_s=5),
        id=f"task-{uuid.uuid4().hex[:8]}", task_queue=stack.task_queue, result_type=TaskResult,
    )
    assert result.output == {"echo": "later"} and result.agent_id == "echo-a2a"
    # A task still working when task_timeout_s passes: no answer in time, and cancelled; its
    # release tells the pool it timed out (a failure: a hung A2A agent is ejected as an HTTP one).
    # The 2 s leave the agent's first answer (the task, working) time to come on a loaded machine;
    # the task's 5 s outlast them.
    with pytest.raises(TaskFailedError) as late:
        await stack.roster.invoke("text.echo", {"text": "late", "slow": True, "seconds": 5}, task_timeout_s=2, max_attempts=1)
    assert "TASK_STATE_WORKING" in str(late.value) and isinstance(late.value.failures[0], AgentTimeoutError)
    counters = await eventually(lambda: _outcomes(stack, "text.echo"), timeout=10)
    assert counters.get("outcome.failed_timeout") == 1 and "outcome.failed_unreachable" not in counters
    # A failed A2A task is the agent's failure: failed over, and with no other agent the task fails.
    with pytest.raises(TaskFailedError) as failed:
        await stack.roster.invoke("text.echo", {"fail": True}, max_attempts=1)
    assert "TASK_STATE_FAILED" in str(failed.value) and isinstance(failed.value.failures[0], AgentTaskFailedError)

    # auth-required is the agent refusing the lease token, as an HTTP agent's 401.
    with pytest.raises(TaskFailedError) as refused:
        await stack.roster.invoke("text.echo", {"auth": True}, max_attempts=1)
    assert isinstance(refused.value.failures[0], AgentTaskFailedError) and refused.value.failures[0].status == 401

    # Each call carried a lease token for this agent as its bearer credential.
    assert len(executor.authorizations) == 6
    for header in executor.authorizations:
        assert header is not None and header.startswith("Bearer ")
        claims = KEYS.verify(header.removeprefix("Bearer "), audience="echo-a2a")
        assert claims.capability == "text.echo" and claims.pool == stack.pool

    # The agent stops answering: its workflow ends it after 3 intervals (1 s each here).
    checks_before = await count_checks(stack)
    await server.stop()

    async def terminated() -> bool:
        s = await stack.roster.describe("echo-a2a")
        return s.state == AgentState.TERMINATED and s.terminated_reason == "a2a_unreachable"

    await eventually(terminated, timeout=30, interval=0.2)
    with pytest.raises(Exception):
        await stack.roster.invoke("text.echo", {"text": "gone"}, timeout=1, max_attempts=1)

    # The cost of the check: per interval one timer and one activity, whatever else happens.
    timers, checks = await count_checks(stack, whole=True)
    assert checks >= checks_before[1] + 3
    assert timers <= checks + 4, (timers, checks)  # the liveness timer is the check's timer
    print(json.dumps({"a2a_liveness_checks": checks, "timers": timers}))


async def _outcomes(stack: Any, capability: str) -> dict[str, int]:
    """The pool's outcome counters of `capability` once one has arrived ({} before)."""
    counters = (await stack.roster.status()).capabilities[capability].counters
    return {k: v for k, v in counters.items() if k.startswith("outcome.") and k != "outcome.succeeded"}


async def test_a2a_failover_leaves_out_the_agent_whose_task_failed(stack: Any, echo_agent: Any) -> None:
    """Two A2A agents serve text.echo@1.2.0; the cheaper one (cost class A) ends every task failed
    or rejected: each task goes to it first, fails over, and is served by the other on attempt 2."""
    server, executor = echo_agent
    refusing = RefusingExecutor()
    cheap = await serve(refusing, lambda url: echo_card(url, name="Refusing Agent"))
    try:
        await add_a2a_agent(stack.roster, cheap.url, agent_id="cheap-a", cost_class="A", heartbeat_interval_s=5)
        await add_a2a_agent(stack.roster, server.url, agent_id="echo-b", cost_class="B", heartbeat_interval_s=5)

        served = await stack.roster.invoke("text.echo@==1.2.0", {"text": "one"}, max_attempts=2, full=True)
        assert served.output == {"echo": "one"} and served.agent_id == "echo-b" and served.attempts == 2
        assert [f.agent_id for f in served.failures] == ["cheap-a"] and "TASK_STATE_FAILED" in served.failures[0].error

        result = await run_task(stack, {"text": "two", "reject": True}, max_attempts=2)
        assert result.output == {"echo": "two"} and result.agent_id == "echo-b" and result.attempts == 2
        assert [f.agent_id for f in result.failures] == ["cheap-a"] and "TASK_STATE_REJECTED" in result.failures[0].error

        # Each task reached the cheap agent once (left out after its failure) and the other once.
        assert refusing.calls == 2 and len(executor.authorizations) == 2
        status = await stack.roster.status()
        assert status.leases_granted == 4 and status.leases_revoked == 0
        assert (await stack.roster.describe("cheap-a")).state == AgentState.READY  # a failed task is no ejection
    finally:
        await cheap.stop()


def schema_card(url: str) -> AgentCard:
    """echo_card with the schema extension: `text` required in, `echo` a string out."""
    card = echo_card(url, name="Strict Echo")
    params = struct_pb2.Struct()
    json_format.ParseDict({"text.echo": {
        "version": "1.2.0",
        "input_schema": {"type": "object", "required": ["text"]},
        "output_schema": {"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]},
    }}, params)
    card.capabilities.extensions.append(AgentExtension(uri=SCHEMAS_EXTENSION, params=params))
    return card


async def test_a2a_agent_schemas_from_its_card_are_checked_both_ways(stack: Any) -> None:
    """A payload that breaks the card's input schema is refused before any `message/send`; an
    output that breaks its output schema fails the attempt as bad output."""
    executor = EchoExecutor()
    server = await serve(executor, schema_card)
    try:
        reg = await add_a2a_agent(stack.roster, server.url, agent_id="strict-echo", heartbeat_interval_s=5)
        assert reg.capabilities[0].input_schema == {"type": "object", "required": ["text"]}

        assert await stack.roster.invoke("text.echo", {"text": "fine"}) == {"echo": "fine"}
        assert len(executor.authorizations) == 1

        with pytest.raises(InvalidTaskInputError, match="input_schema") as refused:
            await stack.roster.invoke("text.echo", {"words": "no text"})
        assert "'text' is a required property" in str(refused.value)
        with pytest.raises(WorkflowFailureError) as failed:
            await run_task(stack, {"words": "no text"})
        assert isinstance(failed.value.cause, ApplicationError) and failed.value.cause.type == INVALID_TASK_INPUT
        assert len(executor.authorizations) == 1  # neither reached the agent

        # {"text": 5} fits the input schema; the echo of it, 5, breaks the output schema.
        with pytest.raises(TaskFailedError) as bad:
            await stack.roster.invoke("text.echo", {"text": 5}, max_attempts=1)
        assert isinstance(bad.value.failures[0], InvalidAgentOutputError) and "output_schema at echo" in str(bad.value.failures[0])
        with pytest.raises(WorkflowFailureError) as bad_run:
            await run_task(stack, {"text": 5}, max_attempts=1)
        assert "output_schema" in str(bad_run.value.cause)
        assert len(executor.authorizations) == 3
    finally:
        await server.stop()


async def test_a2a_task_longer_than_its_lease_completes_on_a_renewed_lease(stack: Any) -> None:
    """lease_ttl_s=3 and A2A tasks of 5 s, followed with GetTask: the leases are renewed, none
    revoked or expired, both released at the end (one through roster.invoke, one through the workflow).

    The agent checks the lease token of every JSON-RPC call, `message/send` and each `GetTask`,
    with no clock-skew allowance (PyJWT's default), as a strict A2A agent does: a poll after the
    first TTL still carries an unexpired token."""
    executor = EchoExecutor()
    checked: list[str] = []  # the JSON-RPC method of each call whose token was checked
    server = A2AServer()
    card = echo_card(server.url)
    handler = DefaultRequestHandler(agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=card)

    async def strict_tokens(request: Any, call_next: Any) -> Any:
        if request.method == "POST":
            method = json.loads(await request.body()).get("method", "?")
            try:
                KEYS.verify(request.headers.get("authorization", "").removeprefix("Bearer "), audience="slow-echo", clock_skew_s=0)
            except LeaseTokenError as exc:
                return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {"code": -32001, "message": str(exc)}}, status_code=401)
            checked.append(method)
        return await call_next(request)

    await server.start(Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")],
                                 middleware=[Middleware(BaseHTTPMiddleware, dispatch=strict_tokens)]), handler)
    try:
        await add_a2a_agent(stack.roster, server.url, agent_id="slow-echo", max_concurrency=2, heartbeat_interval_s=5)
        slow = {"text": "patient", "slow": True, "seconds": 5}
        by_code, by_workflow = await asyncio.gather(
            stack.roster.invoke("text.echo", slow, lease_ttl_s=3, task_timeout_s=30, max_attempts=1),
            run_task(stack, slow, lease_ttl_s=3, task_timeout_s=30, max_attempts=1),
        )
        assert by_code == {"echo": "patient"}
        assert by_workflow.output == {"echo": "patient"} and by_workflow.attempts == 1
        assert len(executor.authorizations) == 2
        assert checked.count("SendMessage") == 2 and checked.count("GetTask") >= 10, checked

        async def released() -> Any:
            s = await stack.roster.status()
            return s if s.active_leases == 0 and s.leases_released == 2 else None

        status = await eventually(released, timeout=10, interval=0.2)
        assert status.leases_granted == 2 and status.leases_revoked == 0 and status.leases_expired == 0
        assert status.leases_renewed >= 2, status.leases_renewed  # each lease at least once (its TTL is 3 s, its task 5 s)
    finally:
        await server.stop()


async def count_checks(stack: Any, whole: bool = False) -> tuple[int, int]:
    """(timers started, check activities scheduled) in the agent workflow's history."""
    handle = stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, "echo-a2a"))
    timers = checks = 0
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
            timers += 1
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if event.activity_task_scheduled_event_attributes.activity_type.name == "check_a2a_agent":
                checks += 1
    return timers, checks


async def test_bad_cards_are_refused_naming_the_field(stack: Any) -> None:
    server = A2AServer()

    async def not_a_card(request: Any) -> JSONResponse:
        return JSONResponse({"hello": "world"})

    bad_skill = echo_card(server.url, skills=["text.echo", "Not A Name!"])
    bad_version = echo_card(server.url)
    bad_version.version = "banana"
    await server.start(Starlette(routes=[
        Route("/plain/.well-known/agent-card.json", not_a_card),
        *create_agent_card_routes(bad_skill),
        *create_agent_card_routes(bad_version, card_url="/v/.well-known/agent-card.json"),
    ]))
    try:
        code, out, err = await cli("a2a", "add", server.url, *stack_flags(stack))
        assert code == 2 and "skills[1].id" in err and "Not A Name!" in err, err
        code, out, err = await cli("a2a", "add", server.url + "/plain", *stack_flags(stack))
        assert code == 2 and "name" in err and "refused" in err, err
        code, out, err = await cli("a2a", "add", server.url + "/v", *stack_flags(stack))
        assert code == 2 and "version: 'banana' is not a semantic version" in err, err
        with pytest.raises(A2ACardError) as refused:
            await add_a2a_agent(stack.roster, server.url + "/plain")
        assert refused.value.field == "name"
    finally:
        await server.stop()
    code, out, err = await cli("a2a", "add", server.url, *stack_flags(stack))  # nothing listens now
    assert code == 2 and "card_url" in err, err
    code, out, err = await cli("a2a", "add", "ftp://example.org/card", *stack_flags(stack))
    assert code == 2 and "card_url" in err, err
    assert (await stack.roster.status()).agent_count == 0


async def test_our_runtime_is_an_a2a_agent(stack: Any) -> None:
    agent = AgentRuntime(agent_id=f"ours-{uuid.uuid4().hex[:6]}", deployment="echo-ours", roster=stack.roster, port=0, host="127.0.0.1",
                         heartbeat_interval_s=5)
    schema_in = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    @agent.capability("text.shout", "2.0.0", input_schema=schema_in, output_schema={"type": "object"}, cost_class="A")
    async def shout(payload: dict[str, Any]) -> dict[str, Any]:
        return {"shout": payload["text"].upper()}

    async with agent:
        await agent.wait_ready(timeout=30)
        assert agent.endpoint is not None
        async with httpx.AsyncClient() as http:
            card = await A2ACardResolver(http, agent.endpoint).get_agent_card()
        assert [s.id for s in card.skills] == ["text.shout"] and card.version == "2.0.0"
        scheme = card.security_schemes["lease_token"].http_auth_security_scheme
        assert scheme.scheme == "bearer" and scheme.bearer_format == "JWT"

        client = await create_client(card, ClientConfig(streaming=False))
        request = SendMessageRequest(message=Message(message_id=uuid.uuid4().hex, role=Role.ROLE_USER, parts=[payload_part({"text": "hey"})]))
        claims = LeaseClaims(pool=stack.pool, lease_id=uuid.uuid4().hex, agent_id=agent.agent_id, capability="text.shout",
                             version="2.0.0", expires_at=datetime.now(timezone.utc) + timedelta(seconds=60))
        replies = [r async for r in client.send_message(request, context=ClientCallContext(service_parameters=KEYS.headers(claims)))]
        assert output_of([replies[-1].message.parts]) == {"shout": "HEY"}

        with pytest.raises(A2AClientError):  # no lease token: refused (HTTP 401) before anything runs
            [r async for r in client.send_message(request)]
        other = LeaseClaims(pool=stack.pool, lease_id="x", agent_id="someone-else", capability="text.shout", version="2.0.0",
                            expires_at=datetime.now(timezone.utc) + timedelta(seconds=60))
        with pytest.raises(A2AClientError):  # a token for another agent: refused too
            [r async for r in client.send_message(request, context=ClientCallContext(service_parameters=KEYS.headers(other)))]
        bad = SendMessageRequest(message=Message(message_id=uuid.uuid4().hex, role=Role.ROLE_USER, parts=[Part(text="not an object")]))
        replies = [r async for r in client.send_message(bad, context=ClientCallContext(service_parameters=KEYS.headers(claims)))]
        assert replies[-1].task.status.state == TaskState.TASK_STATE_REJECTED  # the input breaks the schema
        await client.close()

        # Imported by its card, one of our agents also serves through the pool over A2A.
        reg = await add_a2a_agent(stack.roster, agent.endpoint, agent_id="ours-by-card", heartbeat_interval_s=5)
        assert reg.capabilities[0].input_schema == schema_in and reg.capabilities[0].version == "2.0.0"




async def test_fleet_file_a2a_entries_join_when_the_worker_starts_and_drain_as_any_agent(stack: Any, echo_agent: Any, tmp_path: Any) -> None:
    from agentroster.activities.fleet import FleetError, load_fleet
    from agentroster.workers.a2a_cli import join_fleet_a2a

    server, _ = echo_agent
    path = tmp_path / "fleet.toml"
    path.write_text(
        f'[defaults]\nheartbeat_interval_s = 5\n\n[[a2a]]\ncard_url = "{server.url}"\nagent_id = "fleet-echo"\ncost_class = "C"\n\n'
        '[[a2a]]\ncard_url = "http://127.0.0.1:9/"\nagent_id = "nobody"\n'
    )
    fleet = load_fleet(path)
    assert await join_fleet_a2a(stack.roster, fleet) == 1  # the second card does not answer: left out
    status = await stack.roster.describe("fleet-echo")
    assert status.registration is not None and status.registration.heartbeat_interval_s == 5
    assert status.registration.capabilities[0].cost_class == "C"
    with pytest.raises(AgentNotFoundError):
        await stack.roster.describe("nobody")
    # Drained as any agent: Terminated once idle.
    drained = await stack.roster.drain("fleet-echo", reason="operator", deadline_s=10)
    assert drained.state == AgentState.TERMINATED and drained.terminated_reason == "drain"

    path.write_text('[[a2a]]\ncard_url = "http://x"\ncost_class = "D"\n')
    with pytest.raises(FleetError, match=r"a2a\[0\]\.cost_class"):
        load_fleet(path)


def test_without_the_a2a_extra_the_client_and_runtime_still_run() -> None:
    """A base install has no a2a-sdk: the client, invoke and the agent runtime import, and the
    runtime serves its HTTP contract without the A2A routes."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = """
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("a2a", "httpx", "starlette", "uvicorn"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
import agentroster.client.roster, agentroster.client.invoke, agentroster.workflows.agent
from agentroster.agent import a2a as agent_a2a
from agentroster.agent.runtime import AgentRuntime
AgentRuntime(agent_id='a', deployment='d', lease_key='insecure-no-auth')
print(agent_a2a.available())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"
