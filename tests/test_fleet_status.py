"""The pool's `status` over many agents (issue 10, goal 2): built once per state of the
pool, not once per query, and the same answer for every reader (a plain client too)."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client

from agentroster.core.pool import PoolCore
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import make_registration


async def test_status_is_built_once_per_state_of_the_pool(stack, monkeypatch) -> None:
    built: list[int] = []
    original = PoolCore.status

    def counted(self: PoolCore) -> Any:
        built.append(len(self.index))
        return original(self)

    monkeypatch.setattr(PoolCore, "status", counted)  # core is passed through into the workflow sandbox
    await stack.roster.register(make_registration("one"))
    raw = await Client.connect(stack.env.client.service_client.config.target_host, namespace=stack.env.client.namespace)
    pool = raw.get_workflow_handle(pool_workflow_id(stack.pool))
    first = await pool.query("status")
    built.clear()
    for _ in range(5):
        assert await pool.query("status") == first
        assert (await stack.roster.status()).model_dump(mode="json", exclude_unset=True)["agents"] == first["agents"]
    assert built == []  # nothing changed: the payload built for the first query answered them all
    await stack.roster.register(make_registration("two"))
    lease = await stack.roster.acquire("rag.search", timeout=5)
    status = await stack.roster.status()
    assert [a.agent_id for a in status.agents] == ["one", "two"] and status.active_leases == 1
    assert built and built[-1] == 2  # a change: built again, with what changed
    await stack.roster.release(lease)
    assert (await stack.roster.status()).active_leases == 0
