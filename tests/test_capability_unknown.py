"""A capability nobody in the pool ever offered fails at once; one that exists but is busy,
drained away or scaled to zero keeps the caller waiting."""

from __future__ import annotations

import time
import uuid

import pytest
from temporalio.client import WorkflowFailureError

from agentroster import CapabilityUnknownError, PoolExhaustedError
from agentroster.models import TaskInput, TaskResult
from tests.conftest import make_registration


async def test_a_never_offered_capability_fails_at_once(stack) -> None:
    await stack.roster.register(make_registration("only-search", [("rag.search", "2.1.0", 1, "A")]))
    started = time.monotonic()
    with pytest.raises(CapabilityUnknownError) as caught:
        await stack.roster.acquire("text.lower@>=1", timeout=30)
    assert time.monotonic() - started < 30  # it did not wait out the timeout (it used to)
    assert isinstance(caught.value, PoolExhaustedError)  # existing handlers still catch it
    assert "text.lower" in str(caught.value) and stack.pool in str(caught.value)
    assert caught.value.waited_s == 0


async def test_busy_or_scaled_to_zero_capabilities_keep_the_caller_waiting(stack) -> None:
    await stack.roster.register(make_registration("busy-one", [("rag.search", "2.1.0", 1, "A")]))
    held = await stack.roster.acquire("rag.search", timeout=1)
    with pytest.raises(PoolExhaustedError) as busy:
        await stack.roster.acquire("rag.search", timeout=0.5)
    assert not isinstance(busy.value, CapabilityUnknownError)
    await stack.roster.release(held)
    await stack.roster.drain("busy-one", deadline_s=5)  # its deployment is now at zero agents
    with pytest.raises(PoolExhaustedError) as gone:
        await stack.roster.acquire("rag.search@>=2", timeout=0.5)
    assert not isinstance(gone.value, CapabilityUnknownError)
    assert gone.value.waited_s >= 0.5


async def test_a_supervisor_task_on_an_unknown_capability_fails_with_its_own_type(stack) -> None:
    with pytest.raises(WorkflowFailureError) as caught:
        await stack.env.client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="text.lower@>=1", payload={}, pool=stack.pool, acquire_timeout_s=30),
            id=f"task-{uuid.uuid4().hex[:8]}",
            task_queue=stack.task_queue,
            result_type=TaskResult,
        )
    assert getattr(caught.value.cause, "type", None) == "CapabilityUnknownError"
