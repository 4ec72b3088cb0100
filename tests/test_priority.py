"""Pool workflows go ahead of agent workflows on a shared task queue (`wire.POOL_PRIORITY`).

While a fleet registers, the worker's backlog is mostly agent workflows' tasks; callers
wait on the pool's. Every way a pool starts gives its workflow priority 1 (agents keep
the server's default), and a continue-as-new keeps it, as the server reports it.
"""

from __future__ import annotations

from temporalio.client import Client

from agentroster.client.roster import AgentRoster, pool_start_options
from agentroster.vocabulary.shards import ShardLayout
from agentroster.vocabulary.wire import POOL_PRIORITY, PoolInput, agent_workflow_id, pool_workflow_id
from tests.conftest import Stack, make_registration


async def _priority(client: Client, workflow_id: str) -> int:
    described = await client.get_workflow_handle(workflow_id).describe()
    return described.raw_description.workflow_execution_info.priority.priority_key


async def test_pools_run_ahead_of_agents_and_keep_it_across_continue_as_new(stack: Stack) -> None:
    client = stack.env.client
    assert POOL_PRIORITY.priority_key == 1
    assert await _priority(client, pool_workflow_id(stack.pool)) == 1  # started by ensure_pool
    await stack.roster.register(make_registration("p1", [("rag.search", "2.1.0", 2, "A")]))
    assert await _priority(client, agent_workflow_id(stack.pool, "p1")) == 0  # the server's default (3)

    pool = f"prio-{stack.pool}"
    options = {**pool_start_options(pool, 0, ShardLayout()), "arg": PoolInput(pool=pool, max_updates_per_run=3)}
    await client.start_workflow("PoolWorkflow", task_queue=stack.task_queue, **options)
    roster = AgentRoster(client, pool=pool, task_queue=stack.task_queue)
    await roster.register(make_registration("p2", [("rag.search", "2.1.0", 2, "A")]))
    for _ in range(3):
        await roster.release(await roster.acquire("rag.search", timeout=10))
    status = await roster.status()
    assert status.runs > 1
    assert await _priority(client, pool_workflow_id(pool)) == 1
    await roster.shutdown()
