"""Sharded pools on the real dev server (issue 10, goal 4).

A pool of N shards is N pool workflows behind the same `AgentRoster` API and the same
`CapabilityTaskWorkflow`: agents land in their home shard (and only there), leases are
granted by whichever shard has a free agent and are renewed and released in the shard
that granted them, an acquire falls back to the other shards when its first one has no
match or is exhausted, statuses add up, and a client or worker configured with another
layout than the pool's is told so clearly instead of splitting agents.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from agentroster.client.roster import AgentRoster
from agentroster.errors import AgentRosterError, CapabilityUnknownError, PoolExhaustedError
from agentroster.models import TaskInput, TaskResult
from agentroster.vocabulary.shards import ShardLayout, shard_of_id
from agentroster.vocabulary.wire import pool_workflow_id
from agentroster.workflows.pool import PoolWorkflow
from tests.conftest import Stack, eventually, make_registration
from tests.test_supervisor import _registration, endpoints  # noqa: F401 (a fixture)

BY_AGENT = ShardLayout(3, "agent")


class ShardedStack(Stack):
    def __init__(self, env: Any, pool: str, task_queue: str, layout: ShardLayout) -> None:
        super().__init__(env, pool, task_queue)
        self.layout = layout
        self.roster = AgentRoster(env.client, pool=pool, task_queue=task_queue, shards=layout)

    async def start_worker(self, **options: Any) -> None:
        await super().start_worker(pool_shards=self.layout, **options)


@pytest.fixture
async def sharded(dev_env):
    suffix = uuid.uuid4().hex[:8]
    s = ShardedStack(dev_env, pool=f"shards-{suffix}", task_queue=f"tq-{suffix}", layout=BY_AGENT)
    await s.start_worker()
    await s.roster.ensure_pool()
    try:
        yield s
    finally:
        await s.stop_worker()


def _agents_by_shard(layout: ShardLayout, per_shard: int, deployment: str = "search-agent") -> dict[int, list[str]]:
    """Agent ids, `per_shard` of them homed in each shard."""
    out: dict[int, list[str]] = {k: [] for k in range(layout.shards)}
    n = 0
    while any(len(ids) < per_shard for ids in out.values()):
        agent_id = f"agent-{n}"
        home = layout.home_shard(agent_id, deployment)
        if len(out[home]) < per_shard:
            out[home].append(agent_id)
        n += 1
    return out


async def _shard_status(stack: ShardedStack, shard: int) -> Any:
    return await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool, shard)).query(PoolWorkflow.status)


async def test_agents_land_in_their_home_shards_and_status_adds_up(sharded: ShardedStack) -> None:
    homes = _agents_by_shard(sharded.layout, 2)
    await asyncio.gather(*(
        sharded.roster.register(make_registration(a, [("rag.search", "2.1.0", 1, "B")])) for ids in homes.values() for a in ids
    ))
    for shard, ids in homes.items():
        handle = sharded.env.client.get_workflow_handle(pool_workflow_id(sharded.pool, shard))
        status = await handle.query(PoolWorkflow.status)
        assert (status.shard, status.shards, status.shard_by) == (shard, 3, "agent")
        assert sorted(a.agent_id for a in status.agents) == sorted(ids)
    assert pool_workflow_id(sharded.pool, 2) == f"pool/{sharded.pool}/shard-2"
    total = await sharded.roster.status()
    assert sorted(a.agent_id for a in total.agents) == sorted(a for ids in homes.values() for a in ids)
    assert total.capabilities["rag.search"].slots == 6
    assert sorted(await sharded.roster.find("rag.search")) == sorted(a for ids in homes.values() for a in ids)
    some = homes[1][0]
    assert (await sharded.roster.describe(some)).in_flight == 0  # asked of its home shard
    # The metrics exporter finds the pool once (not once per shard) and adds its shards up.
    from prometheus_client import CollectorRegistry

    from agentroster.ops.metrics_exporter import MetricsExporter

    exporter = MetricsExporter(sharded.env.client, port=0, task_queue=sharded.task_queue, registry=CollectorRegistry())
    statuses = await exporter.refresh(force=True)
    assert list(statuses) == [sharded.pool]
    assert len(statuses[sharded.pool].agents) == 6  # type: ignore[union-attr]


async def test_leases_come_from_every_shard_and_go_back_to_the_one_that_granted_them(sharded: ShardedStack) -> None:
    homes = _agents_by_shard(sharded.layout, 2)
    home_of = {a: k for k, ids in homes.items() for a in ids}
    await asyncio.gather(*(
        sharded.roster.register(make_registration(a, [("rag.search", "2.1.0", 1, "B")])) for a in home_of
    ))
    leases = await asyncio.gather(*(sharded.roster.acquire("rag.search", timeout=5, lease_ttl_s=60) for _ in home_of))
    assert sorted(lease.agent_id for lease in leases) == sorted(home_of)  # every agent, whichever shard asked first
    for lease in leases:
        assert shard_of_id(lease.lease_id) == home_of[lease.agent_id]
    renewed = await asyncio.gather(*(sharded.roster.renew(lease, 120) for lease in leases))
    assert all(r.deadline > lease.deadline for r, lease in zip(renewed, leases))
    with pytest.raises(PoolExhaustedError) as caught:
        await sharded.roster.acquire("rag.search", timeout=0.3)
    assert caught.value.report.matching == 6 and caught.value.report.busy == 6  # every shard's figures, added up
    await asyncio.gather(*(sharded.roster.release(lease) for lease in leases))
    status = await eventually(lambda: _released(sharded, 6))
    assert status.leases_granted == 6 and status.leases_renewed == 6
    for shard in range(3):
        shard_status = await _shard_status(sharded, shard)
        assert shard_status.leases_granted == shard_status.leases_released == 2


async def _released(stack: ShardedStack, n: int) -> Any:
    status = await stack.roster.status()
    return status if status.active_leases == 0 and status.leases_released == n else None


async def _all_back(stack: ShardedStack, at_least: int) -> Any:
    status = await stack.roster.status()
    done = status.active_leases == 0 and status.leases_released >= at_least and status.leases_released == status.leases_granted
    return status if done else None


async def test_an_acquire_falls_back_to_another_shard_and_waits_in_one(sharded: ShardedStack) -> None:
    homes = _agents_by_shard(sharded.layout, 1)
    lonely = homes[2][0]  # the only agent: every acquire that asks shard 0 or 1 first must fall back
    await sharded.roster.register(make_registration(lonely, [("rag.search", "2.1.0", 1, "B")]))
    elsewhere = [r for r in (f"fallback-{n:012d}" for n in range(100)) if sharded.layout.acquire_order(r)[0] != 2][:6]
    for n, request_id in enumerate(elsewhere):  # each asks shard 0 or 1 first
        sharded.roster._found.clear()  # no memory of where rag.search was granted last
        lease = await sharded.roster.acquire("rag.search", timeout=2, request_id=request_id)
        assert lease.agent_id == lonely and shard_of_id(lease.lease_id) == 2
        await sharded.roster.release(lease)
        await eventually(lambda: _released(sharded, n + 1))
    held = await sharded.roster.acquire("rag.search", timeout=2)
    waiter = asyncio.create_task(sharded.roster.acquire("rag.search", timeout=10))
    await asyncio.sleep(0.5)
    assert not waiter.done()
    await sharded.roster.release(held)
    served = await asyncio.wait_for(waiter, 10)
    assert served.agent_id == lonely
    await sharded.roster.release(served)
    with pytest.raises(CapabilityUnknownError):
        await sharded.roster.acquire("never.offered", timeout=0.5)  # unknown in every shard


async def test_a_client_or_worker_with_another_layout_is_refused_clearly(dev_env, sharded: ShardedStack) -> None:
    for wrong in (ShardLayout(1), ShardLayout(2, "agent"), ShardLayout(3, "deployment")):
        other = AgentRoster(dev_env.client, pool=sharded.pool, task_queue=sharded.task_queue, shards=wrong)
        with pytest.raises(AgentRosterError, match=r"runs as 3 shard\(s\) placed by agent.*AGENTROSTER_POOL_SHARDS=3:agent"):
            await other.ensure_pool()
    # An unsharded pool (started before shards existed, or with the default) refuses a sharded client too.
    plain_pool = f"plain-{uuid.uuid4().hex[:8]}"
    await AgentRoster(dev_env.client, pool=plain_pool, task_queue=sharded.task_queue).ensure_pool()
    with pytest.raises(AgentRosterError, match=r"runs as 1 shard\(s\)"):
        await AgentRoster(dev_env.client, pool=plain_pool, task_queue=sharded.task_queue, shards=4).ensure_pool()
    # A snapshot that reaches the wrong shard (a sender with another layout) is refused, never indexed.
    homes = _agents_by_shard(sharded.layout, 1)
    stray = homes[1][0]
    wrong_home = AgentRoster(dev_env.client, pool=sharded.pool, task_queue=sharded.task_queue, shards=ShardLayout(3, "deployment"))
    wrong_home._pool_started = True  # skip its own check, as a misconfigured process that never ran one would
    deployment = "search-agent"
    if ShardLayout(3, "deployment").home_shard(stray, deployment) == 1:
        deployment = next(d for d in (f"d{i}" for i in range(100)) if ShardLayout(3, "deployment").home_shard(stray, d) != 1)
    with pytest.raises(AgentRosterError, match="did not index it"):
        await wrong_home.register(make_registration(stray, deployment=deployment), timeout=3)
    shard = ShardLayout(3, "deployment").home_shard(stray, deployment)
    warnings = (await _shard_status(sharded, shard)).warnings
    assert any(stray in w and "belongs to shard 1" in w for w in warnings), warnings


async def test_a_pool_sharded_by_agent_refuses_sizing_policies_and_takes_unsized_ones_on_every_shard(sharded: ShardedStack) -> None:
    with pytest.raises(AgentRosterError, match="sharded by agent"):
        await sharded.roster.set_policy("search-agent", {"min_replicas": 1, "max_replicas": 2})
    # Outlier ejection and health checks size nothing: every shard holds them for its part of the deployment.
    policy = await sharded.roster.set_policy("search-agent", {"health_interval_s": 120, "outliers": {"consecutive_failures": 5}})
    assert policy is not None and policy.outliers.consecutive_failures == 5 and not policy.sizes
    for shard in range(sharded.layout.shards):
        held = (await _shard_status(sharded, shard)).policies["search-agent"]
        assert held.outliers.consecutive_failures == 5 and held.health_interval_s == 120, shard
    await sharded.roster.set_policy("search-agent", None)
    for shard in range(sharded.layout.shards):
        assert "search-agent" not in (await _shard_status(sharded, shard)).policies, shard


async def test_the_supervisor_child_runs_unchanged_on_a_sharded_pool(sharded: ShardedStack, endpoints) -> None:
    _, url = await endpoints()
    homes = _agents_by_shard(sharded.layout, 1, deployment="math-agent")
    for ids in homes.values():
        await sharded.roster.register(_registration(ids[0], url, "A"))
    results = await asyncio.gather(*(
        sharded.env.client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="math.eval@>=1,<2", payload={"expression": f"{n}+1"}, pool=sharded.pool, acquire_timeout_s=10),
            id=f"task-{uuid.uuid4().hex[:8]}",
            task_queue=sharded.task_queue,
            result_type=TaskResult,
        )
        for n in range(9)
    ))
    assert sorted(r.output["value"] for r in results) == [float(n + 1) for n in range(9)]
    # Every lease comes back: the tasks' own, and any the worker prefetched for a next task
    # of their stream that never came (given back after its window).
    status = await eventually(lambda: _all_back(sharded, at_least=9))
    assert status.leases_granted == status.leases_released


async def test_a_worker_with_another_layout_fails_the_task_saying_so(dev_env, sharded: ShardedStack, endpoints) -> None:
    _, url = await endpoints()
    await sharded.roster.register(_registration(_agents_by_shard(sharded.layout, 1, "math-agent")[0][0], url, "A"))
    await sharded.stop_worker()
    await Stack.start_worker(sharded)  # the environment's layout: one shard, not the pool's three
    with pytest.raises(WorkflowFailureError) as caught:
        await sharded.env.client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="math.eval@>=1,<2", payload={"expression": "1+1"}, pool=sharded.pool, acquire_timeout_s=5),
            id=f"task-{uuid.uuid4().hex[:8]}",
            task_queue=sharded.task_queue,
            result_type=TaskResult,
        )
    cause = caught.value.cause
    while cause is not None and not (isinstance(cause, ApplicationError) and cause.type == "ShardLayoutMismatch"):
        cause = cause.cause
    assert cause is not None and "AGENTROSTER_POOL_SHARDS=3:agent" in str(cause), caught.value


async def test_a_sharded_pool_shuts_down_every_shard(sharded: ShardedStack) -> None:
    homes = _agents_by_shard(sharded.layout, 1)
    await asyncio.gather(*(sharded.roster.register(make_registration(ids[0])) for ids in homes.values()))
    final = await sharded.roster.shutdown(deadline_s=1, timeout=60)
    assert final.shutdown is not None and final.shutdown.phase == "done" and final.shutdown.agents_drained == 3
    for shard in range(3):
        description = await sharded.env.client.get_workflow_handle(pool_workflow_id(sharded.pool, shard)).describe()
        assert description.status is not None and description.status.name == "COMPLETED"


async def test_connect_takes_the_layout_from_agentroster_pool_shards(dev_env, sharded: ShardedStack, monkeypatch) -> None:
    address = dev_env.client.service_client.config.target_host
    monkeypatch.setenv("AGENTROSTER_POOL_SHARDS", f"other=2,{sharded.pool}=3:agent")
    roster = await AgentRoster.connect(address, pool=sharded.pool, task_queue=sharded.task_queue)
    assert roster.layout == ShardLayout(3, "agent")
    assert len((await roster.status()).agents) == 0
    monkeypatch.setenv("AGENTROSTER_POOL_SHARDS", "2")
    with pytest.raises(AgentRosterError, match="AGENTROSTER_POOL_SHARDS=3:agent"):
        await AgentRoster.connect(address, pool=sharded.pool, task_queue=sharded.task_queue)
