"""Oversized arguments are refused before they reach a pool workflow task, with a clear error.

Our client measures what it would send: a message over MESSAGE_MAX_BYTES (512 KiB encoded)
raises MessageTooLargeError naming the message and the limit before anything is sent, and a
batch too big for one message goes in halves. A plain temporalio client may send anything:
an argument under the server's 2 MiB blob limit is refused by the update's validator, naming
the field and the limit (never echoing the value); one over it cannot be answered by any
workflow (the SDK's reply to a refused update carries the request again), so the worker
leaves that reply to the server, which refuses it at once and aborts the update. Either way
the caller hears at once and the pool's history shows no failed workflow task.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from agentroster.errors import MESSAGE_MAX_BYTES, MessageTooLargeError
from agentroster.workflows.pool import PoolWorkflow
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import make_registration

MIB = 1024 * 1024


async def _plain(stack: Any) -> Client:
    """A plain client, default data converter, nothing of ours."""
    return await Client.connect(stack.env.client.service_client.config.target_host, namespace=stack.env.client.namespace)


async def _failed_tasks(stack: Any) -> int:
    history = await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()
    return sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)


def _acquire_of(size: int) -> dict[str, Any]:
    """An `acquire` argument of about `size` bytes of JSON: many requests, each well-formed."""
    one = {"ref": "rag.search", "request_id": "r" * 32, "wait_s": 0, "holder": "h" * 400}
    return {"requests": [one] * (size // 480)}


async def test_a_raw_argument_under_the_blob_limit_is_refused_by_the_validator_naming_the_limit(stack) -> None:
    await stack.roster.register(make_registration("steady", [("rag.search", "2.1.0", 1, "A")]))
    pool = (await _plain(stack)).get_workflow_handle(pool_workflow_id(stack.pool))
    for name, arg in (("acquire", _acquire_of(int(1.5 * MIB))), ("cancel", ["t" * 32] * (int(1.5 * MIB) // 35))):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await asyncio.wait_for(pool.execute_update(name, arg), timeout=60)
        text = str(refused.value.cause)
        assert text.startswith(f"InvalidArgument: {name}:") or f"{name}:" in text, text
        assert f"{MESSAGE_MAX_BYTES}-byte limit" in text and len(text) < 1024, text  # named, never echoed
    lease = await stack.roster.acquire("rag.search", timeout=5)  # the pool carries on
    await stack.roster.release(lease)
    assert await _failed_tasks(stack) == 0


async def test_a_raw_argument_over_the_blob_limit_is_refused_at_once_and_the_pool_carries_on(stack) -> None:
    await stack.roster.register(make_registration("steady", [("rag.search", "2.1.0", 1, "A")]))
    pool = (await _plain(stack)).get_workflow_handle(pool_workflow_id(stack.pool))
    for name, arg in (("acquire", _acquire_of(int(2.2 * MIB))), ("cancel", ["t" * 32] * (int(2.2 * MIB) // 35))):
        # Answered by the server's refusal of the reply, not by the caller's own timeout.
        with pytest.raises((WorkflowUpdateFailedError, RPCError)):
            await asyncio.wait_for(pool.execute_update(name, arg), timeout=60)
        status = await pool.query("status")  # the pool answers between them
        assert status["pool"] == stack.pool
    lease = await stack.roster.acquire("rag.search", timeout=5)
    await stack.roster.release(lease)
    assert await _failed_tasks(stack) == 0


async def test_our_client_refuses_an_oversized_message_before_sending_it(stack) -> None:
    with pytest.raises(MessageTooLargeError) as refused:
        await stack.roster._pool_update(PoolWorkflow.cancel, ["t" * 32] * 20_000, deadline=0.0)
    assert isinstance(refused.value, ValueError)
    text = str(refused.value)
    assert "update cancel" in text and f"{MESSAGE_MAX_BYTES:,}-byte limit" in text
    assert await _failed_tasks(stack) == 0


async def test_our_client_sends_a_batch_too_big_for_one_message_in_parts(stack) -> None:
    """Acquires that each exclude 100 long agent ids: together far over one message, each
    well under it. They are answered all the same (in halves), in order."""
    await stack.roster.register(make_registration("wide", [("rag.search", "2.1.0", 64, "A")]))
    excluded = [f"gone-{i:03d}-" + "x" * 240 for i in range(100)]
    leases = await asyncio.gather(
        *(stack.roster.acquire("rag.search", timeout=10, exclude_agents=excluded, request_id=uuid.uuid4().hex) for _ in range(40))
    )
    assert {lease.agent_id for lease in leases} == {"wide"}
    await stack.roster.release_many(leases)
    assert (await stack.roster.status()).active_leases == 0
    assert await _failed_tasks(stack) == 0
