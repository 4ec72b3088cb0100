"""AgentRuntime against a real dev server and worker: HTTP contract, lifecycle, drain, re-registration."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from agentroster.agent.runtime import AgentRuntime, TaskRefused
from agentroster.client.roster import AgentRoster
from agentroster.errors import AgentNotFoundError
from agentroster.models import AgentState, AgentStatus, TaskInput, TaskResult
from agentroster.client.lease_tokens import LeaseClaims, LeaseKeys
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import TEST_LEASE_KEY, eventually, explain_workflow

REPO = Path(__file__).resolve().parents[1]
ECHO_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "refuse": {"type": "boolean"}, "sleep_s": {"type": "number"}},
    "required": ["text"],
    "additionalProperties": False,
}
ECHO_OUTPUT = {"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]}


def new_id(prefix: str = "agent") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Harness:
    """One in-process agent with an `echo` and a `slow` capability, and an HTTP session to it."""

    def __init__(self, stack: Any, session: aiohttp.ClientSession, **options: Any) -> None:
        self.stack = stack
        self.http = session
        self.resets = 0
        self.calls: list[dict[str, Any]] = []
        self.agent_id = new_id()
        options.setdefault("heartbeat_interval_s", 1.0)
        options.setdefault("drain_timeout_s", 15.0)
        self.agent = AgentRuntime(
            agent_id=self.agent_id,
            deployment="test-agent",
            roster=options.pop("roster", stack.roster),
            port=0,
            host="127.0.0.1",
            reset=self._reset,
            **options,
        )

        @self.agent.capability("test.echo", "1.2.0", input_schema=ECHO_SCHEMA, output_schema=ECHO_OUTPUT, max_concurrency=2, cost_class="A")
        async def echo(payload: dict[str, Any]) -> dict[str, Any]:
            self.calls.append(payload)
            await asyncio.sleep(payload.get("sleep_s", 0))
            if payload.get("refuse"):
                raise TaskRefused("this text is not welcome")
            if payload["text"] == "crash":
                raise RuntimeError("the handler crashed")
            return {"echo": payload["text"]}

        @self.agent.capability("test.slow", "1.0.0", input_schema={"type": "object"}, max_concurrency=1, cost_class="C")
        def slow(payload: dict[str, Any]) -> dict[str, Any]:  # sync: runs in a thread
            import time

            time.sleep(payload.get("sleep_s", 1.5))
            return {"slept": True}

    def _reset(self) -> None:
        self.resets += 1

    @property
    def url(self) -> str:
        assert self.agent.endpoint is not None
        return self.agent.endpoint

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.url + path) as resp:
            return resp.status, await resp.json()

    async def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    def lease_headers(self, capability: str, version: str, lease_id: str) -> dict[str, str]:
        """A lease token for this agent, as the invoke activity signs it (the session's key)."""
        claims = LeaseClaims(
            pool=self.stack.pool,
            lease_id=lease_id,
            agent_id=self.agent_id,
            capability=capability,
            version=version,
            expires_at=datetime.now(timezone.utc) + timedelta(seconds=60),
        )
        return LeaseKeys.parse(TEST_LEASE_KEY).headers(claims)

    async def task(self, capability: str, version: str, payload: Any) -> tuple[int, Any]:
        """A task posted directly, with a made-up lease id and a valid token for it."""
        lease_id = uuid.uuid4().hex
        body = {"lease_id": lease_id, "capability": capability, "version": version, "input": payload}
        return await self.post(f"/tasks/{capability}", body, self.lease_headers(capability, version, lease_id))

    async def run_task(self, ref: str, payload: Any, **options: Any) -> TaskResult:
        """Through the real CapabilityTaskWorkflow: lease, invoke, release. A task that has not
        ended in 120 s fails the test with where it and the pool stand."""
        task_id = new_id("task")
        try:
            return await asyncio.wait_for(self.stack.env.client.execute_workflow(
                "CapabilityTaskWorkflow",
                TaskInput(ref=ref, payload=payload, pool=self.stack.pool, acquire_timeout_s=5, **options),
                id=task_id,
                task_queue=self.stack.task_queue,
                result_type=TaskResult,
            ), timeout=120)
        except asyncio.TimeoutError:
            client = self.stack.env.client
            where = [await explain_workflow(client, task_id), await explain_workflow(client, pool_workflow_id(self.stack.pool))]
            raise AssertionError("the task did not end in 120 s:\n" + "\n".join(where)) from None

    async def describe(self) -> AgentStatus | None:
        try:
            return await self.stack.roster.describe(self.agent_id)
        except AgentNotFoundError:
            return None


@pytest_asyncio.fixture
async def harness(stack: Any) -> AsyncIterator[Callable[..., Harness]]:
    made: list[Harness] = []
    async with aiohttp.ClientSession() as session:

        def make(**options: Any) -> Harness:
            h = Harness(stack, session, **options)
            made.append(h)
            return h

        try:
            yield make
        finally:
            for h in made:
                await h.agent.stop(drain=False)


async def test_ready_after_registration_then_tasks_end_to_end(harness: Callable[..., Harness], stack: Any) -> None:
    h = harness()
    release = asyncio.Event()

    @h.agent.on_startup
    async def load_model() -> None:
        await release.wait()

    await h.agent.start()
    assert (await h.get("/healthz"))[0] == 200
    status, body = await h.get("/ready")
    assert status == 503 and body["state"] == "Spawning"
    assert (await h.task("test.echo", "1.2.0", {"text": "early"}))[0] == 503
    release.set()
    await h.agent.wait_ready(20)
    assert (await h.get("/ready"))[0] == 200
    assert await stack.roster.find("test.echo@>=1,<2") == [h.agent_id]
    assert (await h.describe()).state == AgentState.READY  # type: ignore[union-attr]

    result = await h.run_task("test.echo@>=1,<2", {"text": "hello"})
    assert (result.agent_id, result.capability, result.version, result.output) == (h.agent_id, "test.echo", "1.2.0", {"echo": "hello"})
    assert h.resets == 1
    await h.run_task("test.echo", {"text": "again"})
    assert h.resets == 2
    status, body = await h.get("/status")
    assert status == 200
    assert body["state"] == "Ready" and body["tasks_served"] == 2
    assert body["in_flight"] == {"test.echo": 0, "test.slow": 0}


async def test_bad_input_fails_the_task_without_failover(harness: Callable[..., Harness]) -> None:
    h = harness()
    await h.agent.start()
    await h.agent.wait_ready(20)
    # Caught by the invoke activity against the registered input_schema.
    with pytest.raises(WorkflowFailureError) as err:
        await h.run_task("test.echo", {"text": 42})
    assert isinstance(err.value.cause, ApplicationError) and err.value.cause.type == "InvalidTaskInput"
    assert h.calls == []
    # Refused by the handler itself (TaskRefused -> 422): still no failover, one attempt only.
    with pytest.raises(WorkflowFailureError) as err:
        await h.run_task("test.echo", {"text": "x", "refuse": True})
    assert isinstance(err.value.cause, ApplicationError) and err.value.cause.type == "InvalidTaskInput"
    assert "not welcome" in str(err.value.cause)
    assert len(h.calls) == 1 and h.resets == 1  # the reset hook ran after the refused task too


async def test_http_contract(harness: Callable[..., Harness]) -> None:
    h = harness()
    await h.agent.start()
    await h.agent.wait_ready(20)
    status, body = await h.task("no.such", "1.0.0", {})
    assert status == 404 and "does not serve 'no.such'" in body["error"]
    assert (await h.post("/tasks/test.echo", {"lease_id": "x"}, h.lease_headers("test.echo", "1.2.0", "x")))[0] == 400
    status, body = await h.task("test.echo", "9.9.9", {"text": "x"})
    assert status == 409 and "test.echo@1.2.0" in body["error"]
    status, body = await h.task("test.echo", "1.2.0", {"text": 1})
    assert status == 422 and "input does not match the schema at text" in body["error"]
    assert h.calls == []
    status, body = await h.task("test.echo", "1.2.0", {"text": "crash"})
    assert status == 500 and "RuntimeError: the handler crashed" in body["error"]
    assert h.resets == 1  # after the failed task as well

    # max_concurrency 2: a third concurrent task is refused with 429, never run.
    slow = [asyncio.create_task(h.task("test.echo", "1.2.0", {"text": f"s{i}", "sleep_s": 0.5})) for i in range(2)]
    await eventually(lambda: h.agent.status()["in_flight"]["test.echo"] == 2)
    status, body = await h.task("test.echo", "1.2.0", {"text": "third"})
    assert status == 429 and "max_concurrency" in body["error"]
    assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]
    capability = (await h.get("/status"))[1]["capabilities"]["test.echo"]
    assert capability["served"] == 2 and capability["failed"] == 1 and capability["refused"] == 1
    assert h.resets == 3


async def test_drain_endpoint_waits_for_the_slow_task(harness: Callable[..., Harness], stack: Any) -> None:
    h = harness()
    await h.agent.start()
    await h.agent.wait_ready(20)
    task = asyncio.create_task(h.run_task("test.slow", {"sleep_s": 1.5}))
    await eventually(lambda: h.agent.status()["in_flight"]["test.slow"] == 1, timeout=15)

    status, outcome = await h.post("/drain")
    assert status == 200
    assert outcome["drained"] is True and outcome["timed_out"] is False
    assert outcome["workflow_state"] == "Terminated" and outcome["terminated_reason"] == "drain"
    assert outcome["in_flight"] == 0  # the drain waited for the slow task
    result = await asyncio.wait_for(task, 10)
    assert result.output == {"slept": True} and result.attempts == 1

    described = await h.describe()
    assert described is not None and described.state == AgentState.TERMINATED and described.terminated_reason == "drain"
    assert [t.reason for t in described.transitions if t.to_state == AgentState.DRAINING] == ["prestop"]
    assert (await h.get("/ready"))[0] == 503
    assert (await h.task("test.echo", "1.2.0", {"text": "late"}))[0] == 503
    assert await stack.roster.find("test.echo") == []
    # A second drain (e.g. SIGTERM after the preStop hook) returns the same outcome at once.
    assert (await h.agent.drain("sigterm")) == outcome


async def _ready_then_terminated(h: Harness, stack: Any) -> tuple[Any, str]:
    """Start the agent, wait until it is Ready, then terminate its workflow by hand: the
    workflow's handle and the run that was terminated."""
    await h.agent.start()
    await h.agent.wait_ready(20)
    handle = stack.env.client.get_workflow_handle(f"agent/{stack.pool}/{h.agent_id}")
    first_run = (await handle.describe()).run_id
    await handle.terminate(reason="operator lost patience")
    return handle, first_run


async def test_reregisters_after_its_workflow_is_terminated(harness: Callable[..., Harness], stack: Any) -> None:
    h = harness()
    _, first_run = await _ready_then_terminated(h, stack)

    async def new_run_ready() -> bool:
        description = await stack.env.client.get_workflow_handle(f"agent/{stack.pool}/{h.agent_id}").describe()
        status = await h.describe()
        return description.run_id != first_run and status is not None and status.state == AgentState.READY

    await eventually(new_run_ready, timeout=15, interval=0.2)
    # Its register call returns once the pool has indexed the new run (just after Ready).
    await eventually(lambda: h.agent.status()["registrations"] == 2, timeout=15, interval=0.05)
    result = await h.run_task("test.echo", {"text": "back"})
    assert result.agent_id == h.agent_id and result.output == {"echo": "back"}


async def test_describe_of_a_run_that_ended_while_the_agent_registered_again_answers(harness: Callable[..., Harness], stack: Any) -> None:
    """`describe` asks for a closed run's result when the server refuses the query (its latest
    run had closed). If the agent registers again in between, the latest run is the new one:
    its result would not come until it ends. The closed run is named by its run id instead."""
    h = harness()
    handle, first_run = await _ready_then_terminated(h, stack)
    await eventually(lambda: h.agent.status()["registrations"] == 2, timeout=15, interval=0.05)
    assert (await handle.describe()).run_id != first_run
    # What `describe` does after a refused query, once the agent is back: it must answer.
    status = await asyncio.wait_for(stack.roster._ended_agent_status(handle), timeout=30)
    assert status.state == AgentState.READY


class FlakyRoster(AgentRoster):
    """The stack's roster, with heartbeats failing as if the server were unreachable."""

    unreachable = False

    async def heartbeat(self, agent_id: str) -> None:
        if self.unreachable:
            raise RuntimeError("connection refused (simulated)")
        await super().heartbeat(agent_id)


async def test_unreachable_server_then_state_lost_reregisters(harness: Callable[..., Harness], stack: Any) -> None:
    roster = FlakyRoster(stack.env.client, pool=stack.pool, task_queue=stack.task_queue)
    h = harness(roster=roster)
    await h.agent.start()
    await h.agent.wait_ready(20)
    roster.unreachable = True
    await eventually(lambda: h.agent.status()["heartbeat_failures"] >= 2, timeout=10)
    assert h.agent.state == AgentState.READY  # an unreachable server is not a reason to stop serving
    # Meanwhile the server "lost" the agent (its workflow is gone without a drain).
    await stack.env.client.get_workflow_handle(f"agent/{stack.pool}/{h.agent_id}").terminate()
    roster.unreachable = False
    await eventually(lambda: h.agent.status()["registrations"] == 2, timeout=15)
    status = await h.describe()
    assert status is not None and status.state == AgentState.READY


async def test_drained_by_the_roster_does_not_come_back(harness: Callable[..., Harness], stack: Any) -> None:
    h = harness()
    await h.agent.start()
    await h.agent.wait_ready(20)
    final = await stack.roster.drain(h.agent_id, reason="operator", wait=True)
    assert final.state == AgentState.TERMINATED and final.terminated_reason == "drain"
    await eventually(lambda: h.agent.state == AgentState.TERMINATED, timeout=10)
    assert (await h.get("/ready"))[0] == 503
    assert h.agent.status()["registrations"] == 1
    assert (await h.describe()).state == AgentState.TERMINATED  # type: ignore[union-attr]


# ------------------------------------------------------------ real processes


def agent_env(stack: Any, agent_id: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    env.update(
        TEMPORAL_ADDRESS=stack.env.client.service_client.config.target_host,
        TEMPORAL_NAMESPACE=stack.env.client.namespace,
        AGENTROSTER_POOL=stack.pool,
        AGENTROSTER_TASK_QUEUE=stack.task_queue,
        AGENTROSTER_LEASE_KEY=TEST_LEASE_KEY,
        AGENT_ID=agent_id,
        AGENT_PORT="0",
        AGENT_HOST="127.0.0.1",
        HEARTBEAT_INTERVAL_S="1",
        DRAIN_TIMEOUT_S="20",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


async def wait_registered(stack: Any, agent_id: str, proc: asyncio.subprocess.Process) -> AgentStatus:
    async def ready() -> AgentStatus | None:
        assert proc.returncode is None, f"the agent exited with {proc.returncode}"
        try:
            status = await stack.roster.describe(agent_id)
        except AgentNotFoundError:
            return None
        return status if status.state == AgentState.READY else None

    return await eventually(ready, timeout=20, interval=0.1)


@pytest_asyncio.fixture
async def processes() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    started: list[asyncio.subprocess.Process] = []
    yield started
    for proc in started:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def spawn(processes: list[asyncio.subprocess.Process], *args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(sys.executable, *args, env=env, cwd=str(REPO))
    processes.append(proc)
    return proc


async def test_math_agent_process_serves_and_exits_cleanly(stack: Any, processes: list[asyncio.subprocess.Process]) -> None:
    agent_id = new_id("math")
    proc = await spawn(processes, "-m", "examples.math_agent", env=agent_env(stack, agent_id))
    status = await wait_registered(stack, agent_id, proc)
    assert status.registration is not None and status.registration.capability_keys == ["math.eval@1.0.0"]
    result = await stack.env.client.execute_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="math.eval@>=1,<2", payload={"expression": "2 ** 10 + sqrt(16)"}, pool=stack.pool),
        id=new_id("task"),
        task_queue=stack.task_queue,
        result_type=TaskResult,
    )
    assert result.output == {"value": 1028.0} and result.agent_id == agent_id
    with pytest.raises(WorkflowFailureError) as err:  # refused by the evaluator: no failover
        await stack.env.client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="math.eval", payload={"expression": "__import__('os')"}, pool=stack.pool),
            id=new_id("task"),
            task_queue=stack.task_queue,
            result_type=TaskResult,
        )
    assert isinstance(err.value.cause, ApplicationError) and err.value.cause.type == "InvalidTaskInput"
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 20) == 0
    final = await stack.roster.describe(agent_id)
    assert final.state == AgentState.TERMINATED and final.terminated_reason == "drain"


SLOW_AGENT = textwrap.dedent(
    """
    import asyncio

    from agentroster.agent.runtime import AgentRuntime, run_agent

    agent = AgentRuntime.from_env(deployment="slow-agent")


    @agent.capability("test.sleep", "1.0.0", input_schema={"type": "object"}, max_concurrency=1, cost_class="C")
    async def sleep(payload):
        await asyncio.sleep(payload["sleep_s"])
        return {"slept": payload["sleep_s"], "note": payload["note"]}


    run_agent(agent)
    """
)


async def test_sigterm_mid_task_drains_with_the_task_completed(stack: Any, processes: list[asyncio.subprocess.Process], tmp_path: Path) -> None:
    script = tmp_path / "slow_agent.py"
    script.write_text(SLOW_AGENT)
    agent_id = new_id("slow")
    proc = await spawn(processes, str(script), env=agent_env(stack, agent_id))
    status = await wait_registered(stack, agent_id, proc)
    assert status.registration is not None
    endpoint = status.registration.endpoint

    handle = await stack.env.client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="test.sleep@>=1", payload={"sleep_s": 2, "note": "intact"}, pool=stack.pool),
        id=new_id("task"),
        task_queue=stack.task_queue,
        result_type=TaskResult,
    )
    async with aiohttp.ClientSession() as http:

        async def in_flight() -> bool:
            async with http.get(f"{endpoint}/status") as resp:
                return (await resp.json())["in_flight"]["test.sleep"] == 1

        await eventually(in_flight, timeout=15)
        proc.send_signal(signal.SIGTERM)
        await eventually(lambda: _ready_is(http, endpoint, 503), timeout=5)

    result = await asyncio.wait_for(handle.result(), 20)
    assert result.output == {"slept": 2, "note": "intact"} and result.attempts == 1 and result.agent_id == agent_id
    assert await asyncio.wait_for(proc.wait(), 20) == 0
    final = await stack.roster.describe(agent_id)
    assert final.state == AgentState.TERMINATED and final.terminated_reason == "drain"
    assert [t.reason for t in final.transitions if t.to_state == AgentState.DRAINING] == ["sigterm"]


async def _ready_is(http: aiohttp.ClientSession, endpoint: str, status: int) -> bool:
    async with http.get(f"{endpoint}/ready") as resp:
        return resp.status == status
