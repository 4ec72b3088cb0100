"""A signal from the pool to an agent workflow that fails drops the agent only when its workflow has ended.

The server refuses a signal sent while the target run is closing by
continue-as-new (temporalio/temporal#2694, #8097), so the pool's load notice
can fail although the agent's workflow carries on in its next run: the
`deliver_signals` activity sends it again while the latest run is open or has
just continued as new, and reports the agent gone only when its workflow has
ended. The race itself is rare here (the first test drives an agent through
continue-as-new every 3 signals under heartbeat load and asserts the agent is
never lost, whether or not it meets the race); the other two make the server
refuse deterministically: a terminated workflow (reported gone and dropped)
and a running one whose run has used up the server's signal limit (kept).
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from agentroster.models import AgentState, PoolStatus
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path
from agentroster.ops.ports import free_port
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES, agent_workflow_id, pool_workflow_id
from tests.conftest import Stack, eventually, make_registration, pool_notice_counts, start_agent_workflow


async def test_agent_continuing_as_new_under_heartbeats_stays_in_the_pool(stack) -> None:
    agent_id = "can-1"
    reg = make_registration(agent_id, [("rag.search", "2.1.0", 1, "A")])
    await start_agent_workflow(stack, reg, max_signals_per_run=3)
    await stack.roster.register(reg)
    handle = stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, agent_id))
    stop = asyncio.Event()
    refused = 0

    async def hammer() -> None:
        nonlocal refused
        while not stop.is_set():
            try:
                await handle.signal("heartbeat")  # plain signals, as a raw client sends them
            except Exception:
                refused += 1
                await asyncio.sleep(0.01)

    hammers = [asyncio.create_task(hammer()) for _ in range(3)]
    try:
        for _ in range(40):
            lease = await stack.roster.acquire("rag.search", 20, lease_ttl_s=120)
            await stack.roster.release(lease)
    finally:
        stop.set()
        await asyncio.gather(*hammers)
    status = await stack.roster.status()
    assert status.agents_lost == 0, (refused, status.recently_ended, status.warnings)
    assert [a.agent_id for a in status.agents] == [agent_id]
    try:
        await eventually(lambda: _ready(stack, agent_id), timeout=20)
    except AssertionError:
        described = await stack.roster.describe(agent_id)
        pool_view = (await stack.roster.status()).agents
        trouble = {**await pool_notice_counts(stack), "heartbeats refused": refused}
        raise AssertionError(
            f"{described.state} in_flight={described.in_flight}; pool: {pool_view}; {trouble}; {described.model_dump_json()[-3000:]}"
        ) from None


async def _ready(stack, agent_id: str) -> bool:
    described = await stack.roster.describe(agent_id)
    return described.state == AgentState.READY and described.in_flight == 0


async def test_an_agent_whose_workflow_was_terminated_is_checked_then_dropped_at_its_next_notice(stack) -> None:
    """An operator terminates an agent workflow (no word reaches the pool); the release's notice fails:
    `deliver_signals` reports the agent gone (the pool's `report` update) and the pool drops it."""
    agent_id = "ended-1"
    reg = make_registration(agent_id, [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=600)
    await stack.roster.register(reg)
    lease = await stack.roster.acquire("rag.search", 20, lease_ttl_s=120)
    await eventually(lambda: _state(stack, agent_id, AgentState.BUSY))
    await stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, agent_id)).terminate("operator")
    await stack.roster.release(lease)

    status = await eventually(lambda: _without_agents(stack), timeout=30)
    assert status.agents_lost == 1
    assert [(r.agent_id, r.reason) for r in status.recently_ended] == [(agent_id, "its workflow is gone")]
    events = await _pool_events(stack)
    assert _updates_named(events, "report") >= 1 and _activities_named(events, "deliver_signals") >= 1


async def _without_agents(stack) -> PoolStatus | None:
    status = await stack.roster.status()
    return status if not status.agents else None


async def _pool_events(stack) -> list[Any]:
    return list((await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()).events)


def _activities_named(events: list[Any], name: str) -> int:
    return sum(
        1 for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and e.activity_task_scheduled_event_attributes.activity_type.name == name
    )


def _updates_named(events: list[Any], name: str) -> int:
    return sum(
        1 for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
        and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name == name
    )


async def _state(stack, agent_id: str, state: AgentState) -> bool:
    try:
        return (await stack.roster.describe(agent_id)).state == state
    except Exception:
        return False


async def test_an_agent_whose_running_workflow_refuses_notices_is_kept() -> None:
    """The agent workflow runs but the server refuses its signals (its run reached the server's
    signal limit, `history.maximumSignalsPerExecution`, on a server of its own): the notice is
    given up, the delivery ends, and the agent stays (its workflow runs; were it silent, its own
    heartbeat window would end it and its last word would reach the pool)."""
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--dynamic-config-value", f"history.maximumSignalsPerExecution={SIGNAL_LIMIT}"],
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    try:
        stack = Stack(env, pool="limited", task_queue="tq-limited")
        await stack.start_worker()
        try:
            await stack.roster.ensure_pool()
            agent_id = "limited-1"
            await stack.roster.register(make_registration(agent_id, [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=600))
            lease = await stack.roster.acquire("rag.search", 20, lease_ttl_s=120)
            await eventually(lambda: _state(stack, agent_id, AgentState.BUSY))
            agent = env.client.get_workflow_handle(agent_workflow_id(stack.pool, agent_id))
            for _ in range(SIGNAL_LIMIT):  # fill the run's signal budget
                try:
                    await agent.signal("heartbeat")
                except RPCError:
                    break
            else:
                raise AssertionError("the server never refused a signal: is the limit set?")
            delivered_before = _completed(await _pool_events(stack), "deliver_signals")
            await stack.roster.release(lease)

            async def delivered() -> bool:
                return _completed(await _pool_events(stack), "deliver_signals") > delivered_before

            await eventually(delivered, timeout=60)
            status = await stack.roster.status()
            assert [a.agent_id for a in status.agents] == [agent_id] and status.agents_lost == 0
            assert (await agent.describe()).status == WorkflowExecutionStatus.RUNNING
        finally:
            await stack.stop_worker()
    finally:
        await env.shutdown()


SIGNAL_LIMIT = 12


def _completed(events: list[Any], name: str) -> int:
    """How many of the pool's activities named `name` have completed."""
    scheduled = {
        e.event_id for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED and e.activity_task_scheduled_event_attributes.activity_type.name == name
    }
    return sum(
        1 for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED and e.activity_task_completed_event_attributes.scheduled_event_id in scheduled
    )
