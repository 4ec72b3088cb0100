"""Long timeouts (default heartbeat window, default lease TTL) on the time-skipping test server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest_asyncio
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from agentroster import AgentState, AgentStatus
from agentroster.activities.backend import NoneBackend
from agentroster.client import AgentRoster
from agentroster.workers.devserver import time_skipping_server_path
from agentroster.workers.worker import create_worker
from tests.conftest import make_registration


@pytest_asyncio.fixture
async def skipping() -> AsyncIterator[tuple[WorkflowEnvironment, AgentRoster, NoneBackend]]:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=time_skipping_server_path(), data_converter=pydantic_data_converter
    )
    backend = NoneBackend()
    queue = f"ts-{uuid.uuid4().hex[:6]}"
    worker = create_worker(env.client, task_queue=queue, backend=backend)
    async with worker:
        roster = AgentRoster(env.client, pool="ts", task_queue=queue)
        await roster.ensure_pool()
        yield env, roster, backend
    await env.shutdown()


async def test_default_heartbeat_window_is_three_intervals(skipping) -> None:
    env, roster, backend = skipping
    await roster.register(make_registration("quiet", [("rag.search", "2.1.0", 1, "A")]))  # 10 s interval
    await env.sleep(25)
    await roster.heartbeat("quiet")
    await env.sleep(25)  # 25 s since the last heartbeat: still alive
    assert (await roster.describe("quiet")).state == AgentState.READY
    await env.sleep(10)  # now 35 s: past 3 x 10 s
    final = await env.client.get_workflow_handle("agent/ts/quiet", result_type=AgentStatus).result()
    assert final.terminated_reason == "heartbeat_lost"
    assert ("delete_pod", "search-agent", "quiet") in backend.calls
    assert await roster.find("rag.search") == []


async def test_default_lease_ttl_expires_a_forgotten_lease(skipping) -> None:
    env, roster, _ = skipping
    await roster.register(make_registration("holder", [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=3600))
    lease = await roster.acquire("rag.search")  # default TTL: 300 s
    assert await roster.find("rag.search") == []
    await env.sleep(301)
    assert await roster.lease_status(lease.lease_id) is None
    assert await roster.find("rag.search") == ["holder"]
    assert (await roster.status()).leases_expired == 1


async def test_a_pool_that_lost_its_state_learns_its_agents_again(skipping) -> None:
    env, roster, _ = skipping
    await roster.register(make_registration("loyal", [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=5))
    old_lease = await roster.acquire("rag.search")
    pool = env.client.get_workflow_handle("pool/ts")
    await pool.terminate(reason="operator error")  # index and leases gone
    await roster.ensure_pool()
    assert await roster.find("rag.search") == []
    for _ in range(7):  # one resync interval: 30 s (the minimum; 6 heartbeats of 5 s)
        await env.sleep(5)
        await roster.heartbeat("loyal")
    assert await roster.find("rag.search") == ["loyal"]
    lease = await roster.acquire("rag.search")
    assert lease.lease_id != old_lease.lease_id
    # The new pool's notices count from 1 again: the agent must not drop them as stale.
    busy = await roster.describe("loyal")
    for _ in range(20):
        if busy.state == AgentState.BUSY:
            break
        await env.sleep(1)
        busy = await roster.describe("loyal")
    assert busy.state == AgentState.BUSY


async def test_an_agent_whose_workflow_vanished_is_dropped(skipping) -> None:
    env, roster, _ = skipping
    await roster.register(make_registration("ghost", [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=10))
    await roster.register(make_registration("alive", [("rag.search", "2.1.0", 1, "C")], heartbeat_interval_s=3600))
    await env.client.get_workflow_handle("agent/ts/ghost").terminate(reason="operator error")  # no last word to the pool
    assert await roster.find("rag.search") == ["ghost", "alive"]
    await env.sleep(3 * 60 + 5)  # three resync intervals of 60 s (30 s minimum, 6 x 10 s)
    assert await roster.find("rag.search") == ["alive"]
    assert any("ghost dropped" in w for w in (await roster.status()).warnings)
