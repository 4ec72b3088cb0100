"""Scale demand: misses coalesce into one retried scale activity per deployment and window."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from agentroster import PoolExhaustedError
from agentroster.client.roster import AgentRoster
from agentroster.vocabulary.wire import PoolInput
from tests.conftest import eventually, make_registration


async def test_misses_become_one_scale_request_counting_pending_replicas(stack) -> None:
    pool = f"scale-{uuid.uuid4().hex[:6]}"
    await stack.env.client.start_workflow(
        "PoolWorkflow", PoolInput(pool=pool, scale_window_s=0.5), id=f"pool/{pool}", task_queue=stack.task_queue
    )
    roster = AgentRoster(stack.env.client, pool=pool, task_queue=stack.task_queue)
    roster._pool_started = True
    await roster.register(make_registration("s-1", [("rag.search", "2.1.0", 1, "B")], deployment="search-agent"))
    held = await roster.acquire("rag.search")

    async def miss() -> None:
        with pytest.raises(PoolExhaustedError):
            await roster.acquire("rag.search", timeout=0)

    await asyncio.gather(*(miss() for _ in range(20)))  # a burst of misses
    scale_calls = lambda: [c for c in stack.backend.calls if c[0] == "scale"]  # noqa: E731
    assert await eventually(scale_calls, timeout=10) == [("scale", "search-agent", 2)]
    for _ in range(5):  # the requested replica has not registered yet: no storm
        await miss()
        await asyncio.sleep(0.2)
    assert scale_calls() == [("scale", "search-agent", 2)]
    await roster.register(make_registration("s-2", [("rag.search", "2.1.0", 1, "B")], deployment="search-agent"))
    second = await roster.acquire("rag.search", timeout=2)
    assert second.agent_id == "s-2"
    await miss()
    await eventually(lambda: len(scale_calls()) == 2, timeout=10)
    assert scale_calls()[-1] == ("scale", "search-agent", 3)
    await roster.release(held)
    await roster.release(second)


class SlowBackend:
    """A real backend object whose scale call takes long, like a throttled API server."""

    name = "slow"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.release = asyncio.Event()

    async def scale(self, deployment: str, replicas: int) -> None:
        self.calls.append(("scale", deployment, replicas))
        await self.release.wait()

    async def delete_pod(self, deployment: str, agent_id: str) -> None:
        self.calls.append(("delete_pod", deployment, agent_id))

    async def mark_for_removal(self, deployment: str, agent_id: str) -> None:
        self.calls.append(("mark_for_removal", deployment, agent_id))


async def test_continue_as_new_does_not_wait_for_a_slow_scale(stack) -> None:
    await stack.stop_worker()
    stack.backend = SlowBackend()
    await stack.start_worker()
    pool = f"slow-{uuid.uuid4().hex[:6]}"
    await stack.env.client.start_workflow(
        "PoolWorkflow",
        PoolInput(pool=pool, scale_window_s=0.2, max_updates_per_run=6),
        id=f"pool/{pool}",
        task_queue=stack.task_queue,
    )
    roster = AgentRoster(stack.env.client, pool=pool, task_queue=stack.task_queue)
    roster._pool_started = True
    await roster.register(make_registration("slow-1", [("rag.search", "2.1.0", 1, "B")], deployment="search-agent"))
    held = await roster.acquire("rag.search")
    with pytest.raises(PoolExhaustedError):
        await roster.acquire("rag.search", timeout=0)
    await eventually(lambda: stack.backend.calls, timeout=10)  # the scale call is now hanging
    for _ in range(12):  # several continue-as-new rounds while it hangs
        await roster.release(held)
        held = await roster.acquire("rag.search", timeout=5)
    assert (await roster.status()).runs >= 2
    stack.backend.release.set()
    await roster.release(held)
    # The unfinished request was carried over and issued again by each new run.
    assert all(c == ("scale", "search-agent", 2) for c in stack.backend.calls)
