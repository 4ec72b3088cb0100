"""CapabilityTaskWorkflow end to end against real HTTP agent endpoints started here."""

from __future__ import annotations

import asyncio
import socket
import uuid
from typing import Any

import pytest
from aiohttp import web
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from agentroster import AgentRegistration, Capability
from agentroster.models import TaskInput, TaskResult
from tests.conftest import eventually

INPUT_SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"], "additionalProperties": False}
OUTPUT_SCHEMA = {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}


class FakeAgentEndpoint:
    """A real HTTP server answering `POST /tasks/{capability}` like an agent would."""

    def __init__(self, behaviour: str = "ok") -> None:
        self.behaviour = behaviour
        self.requests: list[dict[str, Any]] = []
        self.received = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/tasks/{capability}", self._task)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def _task(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"capability": request.match_info["capability"], **body})
        self.received.set()
        if self.behaviour == "hang":
            await asyncio.sleep(60)
        if self.behaviour == "bad-output":
            return web.json_response({"output": {"value": "not a number"}})
        expression = body["input"]["expression"]
        return web.json_response({"output": {"value": float(sum(int(x) for x in expression.split("+")))}})


def _registration(agent_id: str, endpoint: str, cost: str, heartbeat_interval_s: float = 30.0) -> AgentRegistration:
    return AgentRegistration(
        agent_id=agent_id,
        deployment="math-agent",
        endpoint=endpoint,
        heartbeat_interval_s=heartbeat_interval_s,
        capabilities=[
            Capability(name="math.eval", version="1.2.0", max_concurrency=2, cost_class=cost, input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA)  # type: ignore[arg-type]
        ],
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _run(stack, payload: Any, **options: Any) -> TaskResult:
    return await stack.env.client.execute_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="math.eval@>=1,<2", payload=payload, pool=stack.pool, **{"acquire_timeout_s": 5, **options}),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
        result_type=TaskResult,
    )


@pytest.fixture
async def endpoints():
    started: list[FakeAgentEndpoint] = []

    async def make(behaviour: str = "ok") -> tuple[FakeAgentEndpoint, str]:
        endpoint = FakeAgentEndpoint(behaviour)
        started.append(endpoint)
        return endpoint, await endpoint.start()

    yield make
    for endpoint in started:
        await endpoint.stop()


async def test_task_runs_on_the_agent_and_the_lease_is_released(stack, endpoints) -> None:
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-1", url, "A"))
    result = await _run(stack, {"expression": "2+3+4"})
    assert result.output == {"value": 9.0}
    assert (result.agent_id, result.version, result.attempts) == ("math-1", "1.2.0", 1)
    sent = agent.requests[0]
    assert sent["capability"] == "math.eval" and sent["version"] == "1.2.0" and sent["input"] == {"expression": "2+3+4"}
    assert len(sent["lease_id"]) >= 32
    await eventually(lambda: _no_leases(stack))  # (the release follows the activity, within 100 ms)
    assert (await stack.roster.status()).leases_released == 1


async def test_payload_failing_the_input_schema_is_refused_before_any_http(stack, endpoints) -> None:
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-2", url, "A"))
    with pytest.raises(WorkflowFailureError) as caught:
        await _run(stack, {"expr": "1+1"})
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidTaskInput"
    assert "input_schema" in cause.message and "expression" in cause.message
    assert agent.requests == []
    await eventually(lambda: _no_leases(stack))  # released by the activity, after it failed


async def test_fails_over_when_the_cheapest_agent_is_unreachable(stack, endpoints) -> None:
    _, url = await endpoints()
    await stack.roster.register(_registration("math-dead", f"http://127.0.0.1:{_closed_port()}", "A"))
    await stack.roster.register(_registration("math-alive", url, "C"))
    result = await _run(stack, {"expression": "1+1"})
    assert (result.agent_id, result.attempts, result.output) == ("math-alive", 2, {"value": 2.0})
    # Both leases come back; lease_and_invoke releases within 100 ms of its activity (on its next acquire, or alone).
    await eventually(lambda: _no_leases(stack))


async def test_fails_over_when_its_agent_dies_mid_task(stack, endpoints) -> None:
    dying, dying_url = await endpoints("hang")
    _, backup_url = await endpoints()
    await stack.roster.register(_registration("math-dying", dying_url, "A", heartbeat_interval_s=1.0))
    await stack.roster.register(_registration("math-backup", backup_url, "C"))

    async def heartbeat_until_the_task_arrives() -> None:
        while not dying.received.is_set():
            await stack.roster.heartbeat("math-dying")
            await asyncio.sleep(0.2)

    beating = asyncio.create_task(heartbeat_until_the_task_arrives())
    result = await asyncio.wait_for(_run(stack, {"expression": "40+2"}), timeout=30)
    await beating
    assert (result.agent_id, result.attempts, result.output) == ("math-backup", 2, {"value": 42.0})
    dead = await stack.roster.describe("math-dying")
    assert dead.terminated_reason == "heartbeat_lost"
    assert (await stack.roster.status()).leases_revoked == 1
    # The backup's lease goes back within 100 ms of the task's activity (releases ride on
    # the worker's next acquire), so the workflow's result can come before it.
    await eventually(lambda: _no_leases(stack))


async def test_output_failing_the_schema_exhausts_attempts(stack, endpoints) -> None:
    _, url_1 = await endpoints("bad-output")
    _, url_2 = await endpoints("bad-output")
    await stack.roster.register(_registration("math-liar-1", url_1, "A"))
    await stack.roster.register(_registration("math-liar-2", url_2, "B"))
    with pytest.raises(WorkflowFailureError) as caught:
        await _run(stack, {"expression": "1+1"}, max_attempts=2, acquire_timeout_s=1)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "CapabilityTaskFailed"
    # Each liar is excluded after its bad answer: both were tried, once each.
    assert "attempt 1 on math-liar-1" in cause.message and "attempt 2 on math-liar-2" in cause.message
    assert "output_schema" in cause.message
    await eventually(lambda: _no_leases(stack))


async def test_every_agent_excluded_means_pool_exhausted(stack, endpoints) -> None:
    _, url = await endpoints("bad-output")
    await stack.roster.register(_registration("math-only-liar", url, "A"))
    with pytest.raises(WorkflowFailureError) as caught:
        await _run(stack, {"expression": "1+1"}, max_attempts=2, acquire_timeout_s=1)
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "PoolExhaustedError"
    assert "math.eval@>=1,<2" in cause.message and "1 agent(s) match" in cause.message
    assert "0 routable, 1 excluded by the caller" in cause.message


async def _no_leases(stack):
    return (await stack.roster.status()).active_leases == 0


async def test_cancelled_task_still_releases_its_lease(stack, endpoints) -> None:
    slow, url = await endpoints("hang")
    await stack.roster.register(_registration("math-slow", url, "A"))
    handle = await stack.env.client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="math.eval", payload={"expression": "1+1"}, pool=stack.pool),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    await asyncio.wait_for(slow.received.wait(), timeout=15)
    assert (await stack.roster.status()).active_leases == 1
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await handle.result()
    await eventually(lambda: _no_leases(stack))
    assert (await stack.roster.status()).leases_released == 1


async def test_a_queued_supervisor_task_waits_in_its_one_activity(stack, endpoints) -> None:
    _, url = await endpoints()
    await stack.roster.register(_registration("math-busy", url, "A"))
    held = [await stack.roster.acquire("math.eval"), await stack.roster.acquire("math.eval")]  # both slots
    handle = await stack.env.client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="math.eval", payload={"expression": "20+22"}, pool=stack.pool, acquire_timeout_s=30),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
        result_type=TaskResult,
    )
    await eventually(lambda: _waiting(stack, 1))

    # Queued in the pool inside its `lease_and_invoke`, which heartbeats while it waits.
    assert len((await handle.describe()).raw_description.pending_activities) == 1
    await stack.roster.release(held[0])
    result = await asyncio.wait_for(handle.result(), timeout=20)
    assert (result.agent_id, result.output, result.attempts) == ("math-busy", {"value": 42.0}, 1)
    await stack.roster.release(held[1])
    await eventually(lambda: _no_leases(stack))


async def _waiting(stack, n: int) -> bool:
    return (await stack.roster.status()).waiting == n
