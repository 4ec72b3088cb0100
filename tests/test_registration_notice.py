"""Registration answered by the pool's index notice (issue 10, goal 2).

`register` waits on the agent workflow's `wait_routable` update, which answers once
the pool has said it indexed that registration (`pool_indexed`, sent by the pool's
`tell_indexed` activity): no client polls the pool. The pool reads new agents in
batches (`read_agents`, one activity per batch) and still indexes only what an agent
workflow reports about itself. Notices from anyone else are checked like every other
signal (a plain temporalio client sends them here). Real dev server; no timing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateStage

from agentroster.activities.roster import RosterActivities
from agentroster.client.roster import AgentRoster
from agentroster.models import AgentState
from agentroster.vocabulary.wire import (
    INDEX_NOTICE_SIGNAL,
    READ_AGENTS,
    TELL_INDEXED,
    agent_workflow_id,
    pool_workflow_id,
)
from tests.conftest import eventually, make_registration
from tests.test_poison_messages import _signal_all, _task_failures


# A worker that leaves the pool's notices off: the pool of a run (or a worker) from before them.
async def _start_worker_without_notices(stack: Any, monkeypatch: Any) -> None:
    """Restart the worker with a `tell_indexed` that tells nobody: registrations wait for a notice that never comes."""

    @activity.defn(name=TELL_INDEXED)
    async def tell_nobody(self: RosterActivities, batch: Any) -> int:
        return 0

    monkeypatch.setattr(RosterActivities, "tell_indexed", tell_nobody)
    await stack.stop_worker()
    await stack.start_worker()


async def _raw_client(stack: Any) -> Client:
    """A plain client, default data converter, nothing of ours."""
    return await Client.connect(stack.env.client.service_client.config.target_host, namespace=stack.env.client.namespace)


async def _activity_inputs(stack: Any, name: str) -> list[dict[str, Any]]:
    """The input of every `name` activity the pool scheduled (every run), oldest first."""
    inputs: list[dict[str, Any]] = []
    async for wf in stack.env.client.list_workflows(f'WorkflowId="{pool_workflow_id(stack.pool)}"'):
        history = await stack.env.client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        for e in history.events:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                scheduled = e.activity_task_scheduled_event_attributes
                if scheduled.activity_type.name == name:
                    inputs.append(json.loads(scheduled.input.payloads[0].data))
    return inputs


def _spy_on_pool_queries(monkeypatch: Any) -> list[str]:
    asked: list[str] = []
    original = AgentRoster._pool_query

    async def spy(self: AgentRoster, query: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(query.__name__)
        return await original(self, query, *args, **kwargs)

    monkeypatch.setattr(AgentRoster, "_pool_query", spy)
    return asked


async def test_register_returns_once_indexed_without_polling_the_pool(stack, monkeypatch) -> None:
    asked = _spy_on_pool_queries(monkeypatch)
    ids = sorted(f"fast-{i}" for i in range(12))
    statuses = await asyncio.gather(*(stack.roster.register(make_registration(agent_id)) for agent_id in ids))
    assert [(s.state, s.indexed_by_pool) for s in statuses] == [(AgentState.READY, True)] * len(ids)
    assert asked == []  # the agent workflow's update answered: no client polled the pool
    assert sorted(await stack.roster.find("rag.search")) == ids  # and the pool routes to every one
    # Read in batches (no activity per agent), each agent once; each told once.
    read = [agent_id for batch in await _activity_inputs(stack, READ_AGENTS) for agent_id in batch["agent_ids"]]
    assert sorted(read) == ids
    told = [n["agent_id"] for batch in await _activity_inputs(stack, TELL_INDEXED) for n in batch["notices"]]
    assert sorted(told) == ids


async def test_a_batch_indexes_only_agents_whose_workflow_speaks_for_them(stack) -> None:
    roster: AgentRoster = stack.roster
    genuine = ["real-0", "real-1", "real-2"]
    for agent_id in genuine:
        await roster.register(make_registration(agent_id))
    attacker = await _raw_client(stack)
    snapshot = await attacker.get_workflow_handle(agent_workflow_id(stack.pool, "real-0")).query("snapshot")
    batches_before = len(await _activity_inputs(stack, READ_AGENTS))
    # With the worker stopped, every hint lands in the pool's next workflow task: one batch.
    await stack.stop_worker()
    pool = attacker.get_workflow_handle(pool_workflow_id(stack.pool))
    ghosts = [f"ghost-{i}" for i in range(5)]
    for ghost in ghosts:
        await pool.signal("agent_snapshots", [{**snapshot, "agent_id": ghost, "awaits_index": 1}])
    for agent_id in genuine:  # forged: more slots than the agent registered
        forged = {**snapshot, "agent_id": agent_id, "max_concurrency": 40}
        forged["capabilities"] = [{**c, "max_concurrency": 40} for c in forged["capabilities"]]
        await pool.signal("agent_snapshots", [forged])
    await stack.start_worker()

    async def refused() -> list[str] | None:
        refusals = (await pool.query("status")).get("refusals", [])
        return refusals if sum(1 for r in refusals if "not indexed" in r or "not updated as sent" in r) >= 8 else None

    refusals = await eventually(refused, timeout=30)
    batches = (await _activity_inputs(stack, READ_AGENTS))[batches_before:]
    assert [sorted(b["agent_ids"]) for b in batches] == [sorted(ghosts + genuine)]
    assert all(any(f"agent {g} not indexed" in r for r in refusals) for g in ghosts)
    status = await roster.status()
    assert sorted(a.agent_id for a in status.agents) == genuine
    assert status.capabilities["rag.search"].slots == 2 * len(genuine)  # what the agents registered, not 40
    told = [n["agent_id"] for b in await _activity_inputs(stack, TELL_INDEXED) for n in b["notices"]]
    assert not set(told) & set(ghosts)


async def test_hostile_index_notices_are_refused_and_a_stale_one_answers_nothing(stack, monkeypatch) -> None:
    # The pool sends no notice here, so only what this test sends can answer `wait_routable`.
    await _start_worker_without_notices(stack, monkeypatch)
    await stack.roster.register(make_registration("waiting"), wait=False)
    client = await _raw_client(stack)
    agent = client.get_workflow_handle(agent_workflow_id(stack.pool, "waiting"))
    pending = await agent.start_update("wait_routable", wait_for_stage=WorkflowUpdateStage.ACCEPTED)

    async def status() -> dict[str, Any]:
        return await agent.query("status")  # answered after the signals sent before it

    await eventually(lambda: _state(status, "Ready"), timeout=20)
    sent = await _signal_all(agent, [INDEX_NOTICE_SIGNAL])
    for bad in (
        {"agent_id": "someone-else", "registration": 1},
        {"agent_id": "waiting", "registration": 0},
        {"agent_id": "waiting", "registration": -1},
        {"agent_id": "waiting", "registration": 2**60},
        {"agent_id": "waiting"},
    ):
        await agent.signal(INDEX_NOTICE_SIGNAL, bad)
    await agent.signal(INDEX_NOTICE_SIGNAL, {"agent_id": "waiting", "registration": 7})  # ahead of the registrations: ignored
    assert (await status())["indexed_by_pool"] is False
    refusals = await agent.query("refusals")
    assert sum(1 for r in refusals if r.startswith(f"{INDEX_NOTICE_SIGNAL} refused")) == sent + 5
    assert any("does not match this workflow's agent" in r for r in refusals)

    # A second registration: the first one's notice is stale now and answers nothing.
    await stack.roster.register(make_registration("waiting", [("rag.search", "2.1.0", 3, "B")]), wait=False)
    await eventually(lambda: _registrations(status, 2), timeout=20)
    await agent.signal(INDEX_NOTICE_SIGNAL, {"agent_id": "waiting", "registration": 1})
    assert (await status())["indexed_by_pool"] is False
    await agent.signal(INDEX_NOTICE_SIGNAL, {"agent_id": "waiting", "registration": 2})
    answered = await asyncio.wait_for(pending.result(), timeout=30)
    assert answered["state"] == "Ready" and answered["indexed_by_pool"] is True
    assert await _task_failures(stack.env.client, agent_workflow_id(stack.pool, "waiting")) == 0


async def _state(status: Any, state: str) -> bool:
    return (await status())["state"] == state


async def _registrations(status: Any, count: int) -> bool:
    s = await status()
    return s["state"] == "Ready" and len([t for t in s["transitions"] if t["to_state"] == "Registering"]) >= count


async def test_a_registration_still_waiting_is_answered_when_its_workflow_continues_as_new(stack, monkeypatch) -> None:
    """A notice that never comes (here: the pool's left off) cannot hold an agent's run open:
    at continue-as-new the waiting update answers, not indexed, and the client asks the pool."""
    from agentroster.vocabulary.wire import AgentWorkflowInput

    await _start_worker_without_notices(stack, monkeypatch)
    reg = make_registration("handover")
    workflow_id = agent_workflow_id(stack.pool, "handover")
    handle = await stack.env.client.start_workflow(
        "AgentWorkflow",
        AgentWorkflowInput(agent_id="handover", pool=stack.pool, max_signals_per_run=4),
        id=workflow_id,
        task_queue=stack.task_queue,
        start_signal="register",
        start_signal_args=[reg.model_dump(mode="json")],
    )
    agent = (await _raw_client(stack)).get_workflow_handle(workflow_id)
    pending = await agent.start_update("wait_routable", wait_for_stage=WorkflowUpdateStage.ACCEPTED)
    for _ in range(4):
        await stack.roster.heartbeat("handover")
    answered = await asyncio.wait_for(pending.result(), timeout=30)
    assert answered["state"] == "Ready" and answered["indexed_by_pool"] is False
    assert (await handle.describe()).run_id != handle.result_run_id  # it continued as new
    assert (await stack.roster.describe("handover")).indexed_by_pool is False  # still waiting, carried over
    await eventually(lambda: _found(stack, ["handover"]), timeout=20)  # the pool routes to it all the same


async def _found(stack: Any, expected: list[str]) -> bool:
    return await stack.roster.find("rag.search") == expected
