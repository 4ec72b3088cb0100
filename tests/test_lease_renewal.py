"""Leases can be renewed: a task longer than its TTL keeps its slot, a dead holder's lease still expires."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from aiohttp import web

from agentroster import LeaseLostError, PoolExhaustedError
from agentroster.models import TaskInput, TaskResult
from tests.conftest import eventually, make_registration


async def test_renew_moves_the_deadline_and_a_lost_lease_says_so(stack) -> None:
    await stack.roster.register(make_registration("renewable", [("rag.search", "2.1.0", 1, "A")]))
    lease = await stack.roster.acquire("rag.search", timeout=2, lease_ttl_s=30)
    renewed = await stack.roster.renew(lease, 120)
    assert renewed.lease_id == lease.lease_id
    assert (renewed.deadline - lease.deadline).total_seconds() > 60
    await stack.roster.release(lease)
    await eventually(lambda: _active(stack, 0))
    with pytest.raises(LeaseLostError, match=lease.lease_id):
        await stack.roster.renew(lease)


async def test_a_borrow_longer_than_its_ttl_keeps_its_slot_while_a_dead_holders_lease_expires(stack) -> None:
    await stack.roster.register(make_registration("one-slot", [("rag.search", "2.1.0", 1, "A")]))
    await stack.roster.register(make_registration("other-slot", [("code.exec", "1.0.0", 1, "A")]))
    # A holder that "died": acquired with a 3 s TTL and never renewed or released.
    await stack.roster.acquire("code.exec", timeout=2, lease_ttl_s=3)
    async with stack.roster.borrow("rag.search", timeout=2, lease_ttl_s=3):
        await asyncio.sleep(5)  # longer than the TTL: renewed every second
        assert {a.agent_id: a.in_flight for a in (await stack.roster.status()).agents}["one-slot"] == 1
        with pytest.raises(PoolExhaustedError):  # nobody else got the slot meanwhile
            await stack.roster.acquire("rag.search", timeout=0.3)
    status = await stack.roster.status()
    assert status.leases_expired == 1 and status.leases_renewed >= 2
    assert await eventually(lambda: _active(stack, 0))


async def test_a_supervisor_task_longer_than_its_lease_ttl_keeps_its_slot(stack) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"output": {"ok": True}})

    app = web.Application()
    app.add_routes([web.post("/tasks/{capability}", slow)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        await stack.roster.register(
            make_registration("slow-agent", [("rag.search", "2.1.0", 1, "A")], endpoint=f"http://127.0.0.1:{port}")
        )
        result: Any = await stack.env.client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="rag.search", payload={}, pool=stack.pool, lease_ttl_s=3, task_timeout_s=30),
            id=f"task-{uuid.uuid4().hex[:8]}",
            task_queue=stack.task_queue,
            result_type=TaskResult,
        )
    finally:
        await runner.cleanup()
    assert result.output == {"ok": True} and result.attempts == 1
    status = await stack.roster.status()
    assert status.leases_expired == 0 and status.leases_revoked == 0 and status.leases_renewed >= 2


async def _active(stack, n: int) -> bool:
    return (await stack.roster.status()).active_leases == n
