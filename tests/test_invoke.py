"""`roster.invoke` from plain code, against a real dev server and the stack's worker:
agents are an example agent process (`python -m examples.math_agent`, as a user runs
one) and raw HTTP servers that register like any agent and answer what the test
needs (a bad output, a refusal, nothing at all), as an agent not built with the
runtime might. Every outcome leaves no lease behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from agentroster import (
    AgentTaskFailedError,
    AgentUnreachableError,
    InvalidAgentOutputError,
    InvalidTaskInputError,
    TaskFailedError,
)
from agentroster.errors import AgentRosterError
from agentroster.models import AgentRegistration, Capability
from agentroster.client.lease_tokens import AUTH_HEADER
from tests.conftest import eventually

REPO = Path(__file__).resolve().parents[1]
ECHO_IN = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
ECHO_OUT = {"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]}

Answer = Callable[[dict[str, Any]], Awaitable[tuple[int, str]]]


class RawAgent:
    """An HTTP server registered as an agent: `answer(body)` gives (status, text) for each task."""

    def __init__(self, stack: Any, agent_id: str, answer: Answer, *, cost_class: str = "B", endpoint: str | None = None) -> None:
        self.stack = stack
        self.agent_id = agent_id
        self.answer = answer
        self.cost_class = cost_class
        self.endpoint = endpoint
        self.requests: list[tuple[dict[str, Any], str | None]] = []
        self._runner: web.AppRunner | None = None

    async def _task(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((body, request.headers.get(AUTH_HEADER)))
        status, text = await self.answer(body)
        return web.Response(status=status, text=text, content_type="application/json")

    async def start(self) -> RawAgent:
        if self.endpoint is None:
            app = web.Application()
            app.add_routes([web.post("/tasks/{capability}", self._task)])
            self._runner = web.AppRunner(app, shutdown_timeout=0.5)  # slow handlers are abandoned at the end
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.endpoint = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        cap = Capability(name="text.echo", version="1.0.0", max_concurrency=2, cost_class=self.cost_class,  # type: ignore[arg-type]
                         input_schema=ECHO_IN, output_schema=ECHO_OUT)
        await self.stack.roster.register(
            AgentRegistration(agent_id=self.agent_id, deployment="raw-agent", endpoint=self.endpoint, capabilities=[cap])
        )
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest_asyncio.fixture
async def raw_agents(stack: Any) -> AsyncIterator[Callable[..., Awaitable[RawAgent]]]:
    made: list[RawAgent] = []

    async def make(agent_id: str, answer: Answer, **options: Any) -> RawAgent:
        agent = await RawAgent(stack, agent_id, answer, **options).start()
        made.append(agent)
        return agent

    try:
        yield make
    finally:
        for agent in made:
            await agent.stop()


def answering(status: int, body: Any) -> Answer:
    async def answer(_: dict[str, Any]) -> tuple[int, str]:
        return status, body if isinstance(body, str) else json.dumps(body)

    return answer


async def leases(stack: Any) -> tuple[int, int, int]:
    status = await stack.roster.status()
    return status.leases_granted, status.leases_released, status.active_leases


async def all_released(stack: Any, granted: int) -> None:
    """Every lease the test took was given back (the release is a signal: wait for the pool to apply it)."""
    await eventually(lambda: _equals(leases(stack), (granted, granted, 0)), timeout=15)


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


# ------------------------------------------------------------------------ the happy path, with failover


async def test_invoke_fails_over_from_an_unreachable_agent_to_an_agent_process(stack: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_", "KUBERNETES_"))}
    env.update(
        TEMPORAL_ADDRESS=stack.env.client.service_client.config.target_host,
        AGENTROSTER_POOL=stack.pool,
        AGENTROSTER_TASK_QUEUE=stack.task_queue,
        AGENTROSTER_LEASE_KEY=os.environ["AGENTROSTER_LEASE_KEY"],
        AGENT_HOST="127.0.0.1",
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "examples.math_agent", cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        found = await eventually(lambda: stack.roster.find("math.eval@>=1,<2"), timeout=60, interval=0.3)
        # The cheapest agent (cost A like the math agent, and its id sorts first) has nothing listening.
        await stack.roster.register(
            AgentRegistration(
                agent_id="a-unreachable",
                deployment="raw-agent",
                endpoint="http://127.0.0.1:9",
                capabilities=[Capability(name="math.eval", version="1.0.0", max_concurrency=2, cost_class="A")],
            )
        )
        assert (await stack.roster.find("math.eval@>=1,<2"))[0] == "a-unreachable"
        output = await stack.roster.invoke("math.eval@>=1,<2", {"expression": "sqrt(16) + 2**10"}, timeout=10)
        assert output == {"value": 1028.0}
        await all_released(stack, granted=2)  # one lease on the dead agent, one on the live one
        assert found and found[0].startswith("math-agent-")
    finally:
        process.send_signal(signal.SIGTERM)
        log, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, log.decode()[-3000:]


async def test_invoke_gives_up_after_max_attempts_with_every_failure(stack: Any, raw_agents: Any) -> None:
    await raw_agents("gone-1", answering(200, {}), endpoint="http://127.0.0.1:9")
    failing = await raw_agents("fails-500", answering(500, {"error": "boom"}))
    with pytest.raises(TaskFailedError) as err:
        await stack.roster.invoke("text.echo@^1", {"text": "hi"}, timeout=5, max_attempts=2)
    kinds = sorted(type(f).__name__ for f in err.value.failures)
    assert kinds == ["AgentTaskFailedError", "AgentUnreachableError"], err.value.failures
    assert "no agent completed the task in 2 attempt(s)" in str(err.value)
    assert len(failing.requests) == 1 and failing.requests[0][1].startswith("Bearer ey")  # signed: a JWT
    await all_released(stack, granted=2)


# ------------------------------------------------------------------------ the schemas


async def test_invoke_refuses_an_input_that_breaks_the_schema_and_sends_nothing(stack: Any, raw_agents: Any) -> None:
    agent = await raw_agents("echo-raw", answering(200, {"output": {"echo": "x"}}))
    with pytest.raises(InvalidTaskInputError, match=r"payload does not match text.echo@1.0.0 input_schema at text: 5 is not of type 'string'"):
        await stack.roster.invoke("text.echo@^1", {"text": 5})
    assert agent.requests == []
    await all_released(stack, granted=1)


async def test_invoke_refuses_an_output_that_breaks_the_schema(stack: Any, raw_agents: Any) -> None:
    agent = await raw_agents("echo-raw", answering(200, {"output": {"echo": 5}}))
    with pytest.raises(TaskFailedError) as err:
        await stack.roster.invoke("text.echo@^1", {"text": "hi"}, max_attempts=1)
    (failure,) = err.value.failures
    assert isinstance(failure, InvalidAgentOutputError) and failure.agent_id == "echo-raw"
    assert "output does not match text.echo@1.0.0 output_schema at echo: 5 is not of type 'string'" in str(failure)
    assert len(agent.requests) == 1
    body, token = agent.requests[0]
    assert body["input"] == {"text": "hi"} and body["capability"] == "text.echo" and body["version"] == "1.0.0"
    await all_released(stack, granted=1)

    # Another attempt is allowed but no other agent serves it: the failure is still what is reported.
    agent.answer = answering(200, "not json")
    with pytest.raises(TaskFailedError) as err:
        await stack.roster.invoke("text.echo@^1", {"text": "hi"}, timeout=1, max_attempts=2)
    assert isinstance(err.value.failures[0], InvalidAgentOutputError) and "answered non-JSON" in str(err.value)
    assert "then no other agent" in str(err.value)
    await all_released(stack, granted=2)


async def test_an_agent_refusing_the_input_is_not_retried_elsewhere(stack: Any, raw_agents: Any) -> None:
    first = await raw_agents("refuses-a", answering(422, {"error": "no such text"}), cost_class="A")
    second = await raw_agents("refuses-b", answering(200, {"output": {"echo": "hi"}}))
    with pytest.raises(InvalidTaskInputError, match=r"refused the task \(422\)") as err:
        await stack.roster.invoke("text.echo@^1", {"text": "hi"})
    assert err.value.status == 422 and err.value.agent_id == "refuses-a"
    assert len(first.requests) == 1 and second.requests == []
    await all_released(stack, granted=1)


# ------------------------------------------------------------------------ the lease is always released


async def test_invoke_releases_the_lease_when_the_caller_gives_up(stack: Any, raw_agents: Any) -> None:
    started = asyncio.Event()

    async def slow(_: dict[str, Any]) -> tuple[int, str]:
        started.set()
        await asyncio.sleep(60)
        return 200, "{}"

    await raw_agents("slow-raw", slow)
    call = asyncio.create_task(stack.roster.invoke("text.echo@^1", {"text": "hi"}))
    await asyncio.wait_for(started.wait(), timeout=30)
    assert (await leases(stack))[2] == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await all_released(stack, granted=1)


async def test_invoke_times_out_a_silent_agent_and_releases(stack: Any, raw_agents: Any) -> None:
    async def silent(_: dict[str, Any]) -> tuple[int, str]:
        await asyncio.sleep(60)
        return 200, "{}"

    await raw_agents("silent-raw", silent)
    with pytest.raises(TaskFailedError) as err:
        await stack.roster.invoke("text.echo@^1", {"text": "hi"}, task_timeout_s=0.5, max_attempts=1)
    assert isinstance(err.value.failures[0], AgentUnreachableError) and "TimeoutError" in str(err.value)
    await all_released(stack, granted=1)


async def test_invoke_without_a_lease_key_takes_no_lease(stack: Any, raw_agents: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = await raw_agents("echo-raw", answering(200, {"output": {"echo": "hi"}}))
    monkeypatch.delenv("AGENTROSTER_LEASE_KEY")
    with pytest.raises(AgentRosterError, match="AGENTROSTER_LEASE_KEY"):
        await stack.roster.invoke("text.echo@^1", {"text": "hi"})
    assert agent.requests == [] and await leases(stack) == (0, 0, 0)
    # With the key given explicitly, the same call goes through.
    from tests.conftest import TEST_LEASE_KEY

    assert await stack.roster.invoke("text.echo@^1", {"text": "hi"}, key=TEST_LEASE_KEY) == {"echo": "hi"}
    await all_released(stack, granted=1)


def test_failover_follows_the_workflows_rule() -> None:
    """One rule for the child workflow and roster.invoke: the error types in wire.FAILOVER_ERRORS."""
    from agentroster.client.invoke import error_type, is_failover
    from agentroster.vocabulary.wire import FAILOVER_ERRORS

    errors = [AgentUnreachableError("x"), AgentTaskFailedError("x"), InvalidAgentOutputError("x"), InvalidTaskInputError("x")]
    assert [is_failover(e) for e in errors] == [True, True, True, False]
    assert {error_type(e) for e in errors[:3]} == FAILOVER_ERRORS


def test_schema_checks_keep_one_validator_per_schema_and_refuse_as_before() -> None:
    """The validator of a schema is built (and the schema checked) once, then kept: the same
    refusals, with the path, as `jsonschema.validate` gives."""
    import jsonschema

    import agentroster.client.invoke as invoke
    from agentroster.models import Lease

    lease = Lease.model_validate(
        {
            "lease_id": "l" * 32, "pool": "p", "agent_id": "a", "deployment": "d", "capability": "echo",
            "version": "1.0.0", "endpoint": "http://127.0.0.1:9", "granted_at": "2026-01-01T00:00:00Z",
            "deadline": "2026-01-01T00:01:00Z",
        }
    )
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"minimum": 3}}, "required": ["text"]}
    invoke.check_input({"text": "hi"}, dict(schema), lease)
    invoke.check_input({"text": "again"}, dict(schema), lease)  # an equal schema from another registration
    assert sum(1 for key in invoke._VALIDATORS if json.loads(key) == schema) == 1
    with pytest.raises(InvalidTaskInputError, match="at text"):
        invoke.check_input({"text": 7}, schema, lease)
    with pytest.raises(InvalidAgentOutputError, match="at n"):
        invoke.check_output({"text": "x", "n": 1}, schema, lease)
    with pytest.raises(jsonschema.SchemaError):  # a schema that is no schema is still refused
        invoke.check_input({}, {"type": 12}, lease)
