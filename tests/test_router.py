"""The Router on a real dev server: real agents (the agent runtime, in process) in two
isolated pools, `prod` and `staging`, and a routing table from task types to them.

summarize -> prod,    text.summarize@^2.1  (prod also has 3.0.0, staging has a 2.3.0)
translate -> staging, text.translate@~1.4  (staging also has 2.0.0)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from agentroster import PoolExhaustedError, Router, RoutingTable, TaskInput, TaskResult, UnknownTaskTypeError
from agentroster.agent.runtime import AgentRuntime
from agentroster.client.roster import AgentRoster
from tests.conftest import eventually

TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}

# agent id -> (pool side, capability, version)
AGENTS = {
    "sum-v2": ("prod", "text.summarize", "2.3.0"),
    "sum-v3": ("prod", "text.summarize", "3.0.0"),
    "sum-staging": ("staging", "text.summarize", "2.3.0"),
    "tr-14": ("staging", "text.translate", "1.4.2"),
    "tr-20": ("staging", "text.translate", "2.0.0"),
}


@dataclass
class TwoPools:
    stack: Any
    prod: AgentRoster
    staging: AgentRoster
    table: RoutingTable
    router: Router
    agents: dict[str, AgentRuntime]
    served: dict[str, list[str]]  # agent id -> texts it was given


def _agent(agent_id: str, roster: AgentRoster, capability: str, version: str, served: list[str]) -> AgentRuntime:
    agent = AgentRuntime(agent_id=agent_id, deployment=capability.replace(".", "-"), roster=roster, port=0, host="127.0.0.1", heartbeat_interval_s=5.0)

    async def handle(payload: dict[str, Any]) -> dict[str, Any]:
        served.append(payload["text"])
        return {"text": f"{capability}@{version}: {payload['text']}", "agent": agent_id}

    agent.capability(capability, version, input_schema=TEXT_SCHEMA, max_concurrency=1, cost_class="A")(handle)
    return agent


@pytest_asyncio.fixture
async def pools(stack: Any) -> AsyncIterator[TwoPools]:
    suffix = uuid.uuid4().hex[:6]
    prod = AgentRoster(stack.env.client, pool=f"prod-{suffix}", task_queue=stack.task_queue)
    staging = AgentRoster(stack.env.client, pool=f"staging-{suffix}", task_queue=stack.task_queue)
    await asyncio.gather(prod.ensure_pool(), staging.ensure_pool())
    table = RoutingTable.model_validate(
        {
            "routes": {
                "summarize": {"pool": prod.pool, "ref": "text.summarize@^2.1"},
                "translate": {"pool": staging.pool, "ref": "text.translate@~1.4"},
            }
        }
    )
    served: dict[str, list[str]] = {agent_id: [] for agent_id in AGENTS}
    agents = {
        agent_id: _agent(agent_id, prod if side == "prod" else staging, cap, version, served[agent_id])
        for agent_id, (side, cap, version) in AGENTS.items()
    }
    try:
        await asyncio.gather(*(a.start() for a in agents.values()))
        await asyncio.gather(*(a.wait_ready(30) for a in agents.values()))
        router = Router(stack.env.client, table, task_queue=stack.task_queue)
        yield TwoPools(stack, prod, staging, table, router, agents, served)
    finally:
        await asyncio.gather(*(a.stop(drain=False) for a in agents.values()), return_exceptions=True)


async def _post(router: Router, lease: Any, text: str) -> dict[str, Any]:
    """Send a task to the leased agent, with the lease token its runtime checks."""
    body = {"lease_id": lease.lease_id, "capability": lease.capability, "version": lease.version, "input": {"text": text}}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{lease.endpoint}/tasks/{lease.capability}", json=body, headers=router.lease_headers(lease)) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["output"]


async def _no_leases(*rosters: AgentRoster) -> bool:
    statuses = await asyncio.gather(*(r.status() for r in rosters))
    return all(s.active_leases == 0 and s.waiting == 0 for s in statuses)


async def test_task_types_go_to_their_pool_and_capability_version(pools: TwoPools) -> None:
    router = pools.router
    assert router.route("summarize") == (pools.prod.pool, "text.summarize@^2.1")
    assert router.route("translate") == (pools.staging.pool, "text.translate@~1.4")

    async with router.borrow("summarize", timeout=10) as lease:
        assert (lease.pool, lease.agent_id, lease.capability, lease.version) == (pools.prod.pool, "sum-v2", "text.summarize", "2.3.0")
        output = await _post(router, lease, "a long text")
        assert output == {"text": "text.summarize@2.3.0: a long text", "agent": "sum-v2"}

    lease = await router.acquire("translate", timeout=10)
    try:
        assert (lease.pool, lease.agent_id, lease.capability, lease.version) == (pools.staging.pool, "tr-14", "text.translate", "1.4.2")
        assert (await _post(router, lease, "bonjour"))["agent"] == "tr-14"
    finally:
        await router.release(lease)

    assert await router.find("summarize") == ["sum-v2"]
    assert await router.find("translate") == ["tr-14"]
    assert pools.served["sum-v2"] == ["a long text"] and pools.served["tr-14"] == ["bonjour"]
    assert all(not pools.served[a] for a in ("sum-v3", "sum-staging", "tr-20"))
    assert await eventually(lambda: _no_leases(pools.prod, pools.staging), timeout=20)
    statuses = await router.status()
    assert set(statuses) == {pools.prod.pool, pools.staging.pool}
    assert statuses[pools.prod.pool].leases_granted == 1 and statuses[pools.staging.pool].leases_granted == 1


async def test_pools_stay_isolated(pools: TwoPools) -> None:
    router = pools.router
    # staging has a free text.summarize 2.3.0 agent, which matches the route's ref...
    assert await pools.staging.find("text.summarize@^2.1") == ["sum-staging"]
    # ...but summarize goes to prod, whose one ^2.1 agent (max_concurrency 1) is taken.
    held = await router.acquire("summarize", timeout=10)
    try:
        assert (held.pool, held.agent_id) == (pools.prod.pool, "sum-v2")
        with pytest.raises(PoolExhaustedError) as caught:
            await router.acquire("summarize", timeout=0.5)
        assert caught.value.pool == pools.prod.pool and caught.value.matching == 1 and caught.value.busy == 1
        assert caught.value.total_slots == 1 and caught.value.idle_slots == 0
    finally:
        await router.release(held)

    # Many borrows in a row: every one served in prod by the prod agent.
    seen: set[tuple[str, str]] = set()
    for _ in range(5):
        async with router.borrow("summarize", timeout=10) as lease:
            seen.add((lease.pool, lease.agent_id))
    assert seen == {(pools.prod.pool, "sum-v2")}
    staging = await pools.staging.status()
    assert staging.leases_granted == 0  # staging's agents never served a prod task type
    assert (await pools.staging.describe("sum-staging")).in_flight == 0
    assert await eventually(lambda: _no_leases(pools.prod, pools.staging), timeout=20)


async def test_capability_task_workflow_by_task_type(pools: TwoPools) -> None:
    client = pools.stack.env.client  # a plain temporalio client: no Router involved
    for task_type, text, expected in (
        ("translate", "hello", (pools.staging.pool, "tr-14", "1.4.2")),
        ("summarize", "long", (pools.prod.pool, "sum-v2", "2.3.0")),
    ):
        result: TaskResult = await client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(task_type=task_type, routing_table=pools.table, payload={"text": text}, acquire_timeout_s=10),
            id=f"task-{task_type}-{uuid.uuid4().hex[:8]}",
            task_queue=pools.stack.task_queue,
            result_type=TaskResult,
        )
        assert (result.pool, result.agent_id, result.version) == expected
        assert result.task_type == task_type and result.output["agent"] == expected[1]
    # The router builds the same input, carrying only the route it needs.
    routed = pools.router.task_input("translate", {"text": "again"}, acquire_timeout_s=10)
    assert routed.routing_table is not None and routed.routing_table.task_types == ["translate"]
    result = await client.execute_workflow(
        "CapabilityTaskWorkflow", routed, id=f"task-{uuid.uuid4().hex[:8]}", task_queue=pools.stack.task_queue, result_type=TaskResult
    )
    assert (result.pool, result.agent_id) == (pools.staging.pool, "tr-14")
    assert pools.served["tr-14"] == ["hello", "again"] and pools.served["sum-v2"] == ["long"]
    assert await eventually(lambda: _no_leases(pools.prod, pools.staging), timeout=20)


async def test_capability_task_workflow_with_an_unknown_task_type_fails_at_once(pools: TwoPools) -> None:
    client = pools.stack.env.client
    workflow_id = f"task-unknown-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(task_type="summarise", routing_table=pools.table, payload={"text": "x"}),
        id=workflow_id,
        task_queue=pools.stack.task_queue,
        result_type=TaskResult,
    )
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), timeout=60)  # a stuck workflow would hang here
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "UnknownTaskTypeError" and cause.non_retryable
    assert "'summarise'" in cause.message and "did you mean 'summarize'" in cause.message
    assert "'summarize', 'translate'" in cause.message
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED
    # Failed by its first workflow task: no activity ran, no lease was asked for.
    events = [e.event_type async for e in handle.fetch_history_events()]
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED not in events
    assert events.count(EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED) == 0
    assert (await pools.prod.status()).leases_granted == 0 and (await pools.staging.status()).leases_granted == 0


async def test_router_from_a_table_file_and_unknown_types_on_a_live_stack(pools: TwoPools, tmp_path: Any) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(
        f'[routes.translate]\npool = "{pools.staging.pool}"\nref = "text.translate@>=2"\n'
    )
    router = Router(pools.stack.env.client, path, task_queue=pools.stack.task_queue)
    async with router.borrow("translate", timeout=10) as lease:
        assert (lease.pool, lease.agent_id, lease.version) == (pools.staging.pool, "tr-20", "2.0.0")
    with pytest.raises(UnknownTaskTypeError, match="the routing table knows 'translate'"):
        router.borrow("summarize")  # raises when called, before any `async with`
    with pytest.raises(UnknownTaskTypeError):
        await router.acquire("summarize", timeout=5)
    assert await eventually(lambda: _no_leases(pools.staging), timeout=20)
