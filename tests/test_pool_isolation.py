"""Pools are isolation boundaries: one agent id in two pools is two agents; a lease is
released in its own pool whichever roster releases it."""

from __future__ import annotations

import uuid

import pytest

from agentroster import AgentRoster, AgentState
from agentroster.vocabulary.wire import agent_workflow_id
from tests.conftest import eventually, make_registration


async def test_the_same_agent_id_in_two_pools_is_two_agents(stack) -> None:
    prod = stack.roster
    staging = AgentRoster(stack.env.client, pool=f"staging-{uuid.uuid4().hex[:6]}", task_queue=stack.task_queue)
    await staging.ensure_pool()

    in_prod = await prod.register(make_registration("x", [("rag.search", "2.1.0", 1, "A")]))
    in_staging = await staging.register(make_registration("x", [("rag.search", "2.1.0", 1, "A")], endpoint="http://127.0.0.1:10"))

    assert (in_prod.pool, in_prod.state) == (prod.pool, AgentState.READY)
    assert (in_staging.pool, in_staging.state) == (staging.pool, AgentState.READY)  # was: Ready with pool=prod
    assert await staging.find("rag.search") == ["x"]
    assert await prod.find("rag.search") == ["x"]
    staged = await staging.acquire("rag.search", timeout=2)
    assert staged.pool == staging.pool and staged.endpoint == "http://127.0.0.1:10"

    # Draining one leaves the other alone.
    await staging.drain("x", reason="staging teardown", deadline_s=1)
    assert (await staging.describe("x")).state == AgentState.TERMINATED
    assert (await prod.describe("x")).state == AgentState.READY
    ids = {agent_workflow_id(prod.pool, "x"), agent_workflow_id(staging.pool, "x")}
    assert len(ids) == 2


async def test_a_lease_released_through_another_pools_roster_is_released_in_its_own(stack) -> None:
    other = AgentRoster(stack.env.client, pool=f"other-{uuid.uuid4().hex[:6]}", task_queue=stack.task_queue)
    await other.ensure_pool()
    await stack.roster.register(make_registration("solo", [("rag.search", "2.1.0", 1, "A")]))
    lease = await stack.roster.acquire("rag.search", timeout=2)

    await other.release(lease)  # the wrong roster: this used to be ignored until the TTL

    assert await eventually(lambda: _active(stack.roster, 0))
    again = await stack.roster.acquire("rag.search", timeout=2)
    assert again.agent_id == "solo"
    assert (await other.status()).leases_released == 0


async def _active(roster: AgentRoster, n: int) -> bool:
    return (await roster.status()).active_leases == n


def test_pool_names_that_would_break_workflow_ids_are_refused() -> None:
    for bad in ("a/b", "", " prod", "prod\n", "x" * 200):
        with pytest.raises(ValueError, match="pool"):
            AgentRoster(object(), pool=bad)  # type: ignore[arg-type]
