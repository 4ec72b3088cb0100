"""Agent snapshots travel to a pool shard in batches: the `notify_pool` activities a
worker runs at once for one shard share `agent_snapshots` signals, one on the wire at a
time, within a byte budget. A burst of registrations is then a few signals to the
shard, not one per agent (each signal is written under the shard's lock, and a burst
of them held its workflow task back past its timeout)."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.api.enums.v1 import EventType

from agentroster.activities.roster import NOTIFY_MAX_BYTES, RosterActivities
from agentroster.client.transport import Batcher
from agentroster.messages import AgentSnapshot, PoolNotification
from agentroster.models import AgentState
from agentroster.vocabulary.wire import agent_workflow_id, pool_workflow_id
from tests.conftest import eventually, make_registration


async def test_a_batcher_keeps_each_batch_within_its_byte_budget() -> None:
    sent: list[list[str]] = []
    release = asyncio.Event()

    async def send(items: list[str]) -> list[int]:
        sent.append(items)
        await release.wait()
        return [len(i) for i in items]

    batcher: Batcher[str, int] = Batcher(send, max_in_flight=1, max_batch=256, size_of=len, max_bytes=10)
    calls = [asyncio.create_task(batcher.submit(text)) for text in ["a", "bbbb", "cccc", "dd", "eeeeeeeeeeeeeeee", "f"]]
    for _ in range(3):
        await asyncio.sleep(0)
    assert sent == [["a"]]  # a lone item goes at once
    release.set()
    assert await asyncio.gather(*calls) == [1, 4, 4, 2, 16, 1]
    # The rest left one batch at a time, each within 10 bytes (an item alone may exceed it).
    assert sent == [["a"], ["bbbb", "cccc", "dd"], ["eeeeeeeeeeeeeeee"], ["f"]]


async def _first_run(client: Any, workflow_id: str) -> str:
    return (await client.get_workflow_handle(workflow_id).describe()).run_id


async def _snapshot_signals(client: Any, workflow_id: str, run_id: str) -> list[Any]:
    """The `agent_snapshots` signals of run `run_id` and the runs it continued as."""
    signals = []
    while run_id:
        handle, run_id = client.get_workflow_handle(workflow_id, run_id=run_id), ""
        async for e in handle.fetch_history_events():
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                if e.workflow_execution_signaled_event_attributes.signal_name == "agent_snapshots":
                    signals.append(e.workflow_execution_signaled_event_attributes)
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                run_id = e.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return signals


async def _carried(client: Any, workflow_id: str, run_id: str, before: int, total: int) -> list[int]:
    """How many snapshots each new `agent_snapshots` signal carried, once all `total` are in
    the history (signals that arrive during a workflow task are written when it completes)."""

    async def carried() -> list[int]:
        signals = (await _snapshot_signals(client, workflow_id, run_id))[before:]
        return [len(client.data_converter.payload_converter.from_payloads(s.input.payloads)[0]) for s in signals]

    async def all_in() -> bool:
        return sum(await carried()) == total

    await eventually(all_in)
    return await carried()


async def test_a_burst_of_snapshots_reaches_the_pool_in_two_signals(stack) -> None:
    client = stack.env.client
    agents = [f"burst-{i}" for i in range(3)]
    for agent_id in agents:
        await stack.roster.register(make_registration(agent_id, [("rag.search", "2.1.0", 1, "A")]))
    pool_id = pool_workflow_id(stack.pool)
    run = await _first_run(client, pool_id)
    before = len(await _snapshot_signals(client, pool_id, run))
    snapshots = [
        AgentSnapshot.model_validate(await client.get_workflow_handle(agent_workflow_id(stack.pool, a)).query("snapshot"))
        for a in agents
    ]
    activities = RosterActivities(client, stack.task_queue, "k" * 32)
    burst = [snapshots[i % len(snapshots)].model_copy(update={"reason": f"resync {i}"}) for i in range(60)]
    await asyncio.gather(*(activities.notify_pool(PoolNotification(pool=stack.pool, snapshot=s)) for s in burst))

    carried = await _carried(client, pool_id, run, before, len(burst))
    assert carried == [1, 59]  # the first alone, at once; the 59 that came meanwhile together
    status = await stack.roster.status()
    assert status.refusals == []
    assert sorted(a.agent_id for a in status.agents if a.state == AgentState.READY) == agents
    lease = await stack.roster.acquire("rag.search", timeout=5)
    await stack.roster.release(lease)


async def test_a_batch_of_many_large_snapshots_is_split_within_the_budget(stack) -> None:
    client = stack.env.client
    caps = [(f"cap{i}.x", "1.0.0", 1, "A") for i in range(40)]
    await stack.roster.register(make_registration("wide", caps))
    pool_id = pool_workflow_id(stack.pool)
    raw = await client.get_workflow_handle(agent_workflow_id(stack.pool, "wide")).query("snapshot")
    snapshot = AgentSnapshot.model_validate(raw)
    size = len(snapshot.model_dump_json())
    count = 2 * NOTIFY_MAX_BYTES // size + 4  # more than two budgets' worth
    run = await _first_run(client, pool_id)
    before = len(await _snapshot_signals(client, pool_id, run))
    activities = RosterActivities(client, stack.task_queue, "k" * 32)
    await asyncio.gather(*(
        activities.notify_pool(PoolNotification(pool=stack.pool, snapshot=snapshot.model_copy(update={"reason": f"r{i}"})))
        for i in range(count)
    ))
    await _carried(client, pool_id, run, before, count)
    signals = (await _snapshot_signals(client, pool_id, run))[before:]
    assert 3 <= len(signals) < count
    assert all(sum(len(p.data) for p in s.input.payloads) <= NOTIFY_MAX_BYTES + 1024 for s in signals)
    await eventually(lambda: _no_refusals(stack))
    assert (await stack.roster.describe("wide")).state == AgentState.READY


async def _no_refusals(stack: Any) -> bool:
    return (await stack.roster.status()).refusals == []


async def test_one_malformed_snapshot_in_a_list_is_refused_alone(stack) -> None:
    client = stack.env.client
    await stack.roster.register(make_registration("kept", [("rag.search", "2.1.0", 1, "A")]))
    pool = client.get_workflow_handle(pool_workflow_id(stack.pool))
    genuine = await client.get_workflow_handle(agent_workflow_id(stack.pool, "kept")).query("snapshot")
    await pool.signal("agent_snapshots", [{"agent_id": "ghost"}, {**genuine, "reason": "resync"}, "garbage"])
    await pool.signal("agent_snapshots", {**genuine})  # not a list
    await pool.signal("agent_snapshots", [])
    await pool.signal("agent_snapshots", [genuine] * 257)
    refusals = await _eventual_refusals(stack, 5)
    assert refusals[0].startswith("agent_snapshots refused: [0]: ") and "state" in refusals[0]
    assert refusals[1].startswith("agent_snapshots refused: [2]: expected a JSON object")
    assert refusals[2:] == [
        "agent_snapshots refused: expected a list of 1 to 256 snapshots, got dict",
        "agent_snapshots refused: expected a list of 1 to 256 snapshots, got 0",
        "agent_snapshots refused: expected a list of 1 to 256 snapshots, got 257",
    ]
    assert (await stack.roster.describe("kept")).state == AgentState.READY
    lease = await stack.roster.acquire("rag.search", timeout=5)
    assert lease.agent_id == "kept"
    await stack.roster.release(lease)


async def _eventual_refusals(stack: Any, count: int) -> list[str]:
    async def enough() -> bool:
        return len((await stack.roster.status()).refusals) >= count

    await eventually(enough)
    return (await stack.roster.status()).refusals
