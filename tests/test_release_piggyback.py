"""A client's releases ride on its acquires (the `acquire` update's `releases`), or go alone.

Acquires and releases to one pool shard share one pipe in the client: an `acquire` update
carries every release queued when it leaves, so the pool gets one message and one workflow
task instead of an acquire and a `release` (one billed action fewer); a `release` update
goes only when no acquire waits to carry them. `AgentRoster.release_later` (what the
worker's `lease_and_invoke` uses once its task is done) lets a lease wait a few
milliseconds for an acquire to ride on. Tried here as users meet it: the real pool
workflow on the dev server, its history read afterwards, and raw and hostile arguments
from a plain client.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from agentroster.client.roster import AgentRoster
from agentroster.errors import PoolShutdownError
from agentroster.models import Lease
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import eventually, make_registration


async def _pool_events(stack: Any) -> list[Any]:
    history = await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()
    return list(history.events)


def _updates(events: list[Any], name: str, *, carrying: bool | None = None) -> int:
    """Accepted updates named `name` (`carrying`: only those whose `acquire` carried releases, or none)."""
    count = 0
    for e in events:
        if e.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            continue
        request = e.workflow_execution_update_accepted_event_attributes.accepted_request.input
        if request.name != name:
            continue
        if carrying is not None and bool(json.loads(request.args.payloads[0].data).get("releases")) != carrying:
            continue
        count += 1
    return count


def _failed_tasks(events: list[Any]) -> int:
    return sum(1 for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)


async def test_a_parked_release_rides_on_the_next_acquire_and_goes_first(stack) -> None:
    # One slot: the second acquire is served only because the release it carries came first.
    await stack.roster.register(make_registration("one-slot", [("rag.search", "2.1.0", 1, "B")], heartbeat_interval_s=3600))
    first = await stack.roster.acquire("rag.search", timeout=10)
    stack.roster.release_later(first, within_s=30.0)  # long: only the acquire can carry it
    second = await stack.roster.acquire("rag.search", timeout=0)
    assert second.lease_id != first.lease_id and second.agent_id == "one-slot"
    events = await _pool_events(stack)
    assert _updates(events, "acquire", carrying=True) == 1
    assert _updates(events, "release") == 0
    status = await stack.roster.status()
    assert status.active_leases == 1 and status.leases_released == 1
    assert stack.roster._links[0].pipe.waiting_releases == []
    await stack.roster.release(second)


async def test_releases_ride_on_acquires_while_acquires_flow(stack) -> None:
    """Holders that take their next lease as they give back the last one: every release
    rides on an acquire (no `release` update at all), and each `release` returns only once
    the pool has the lease back."""
    await stack.roster.register(make_registration("flow", [("rag.search", "2.1.0", 8, "B")], heartbeat_interval_s=3600))
    holders, rounds = 4, 10

    async def holder() -> Lease:
        held = await stack.roster.acquire("rag.search", timeout=10)
        for _ in range(rounds):
            held, _ = await asyncio.gather(stack.roster.acquire("rag.search", timeout=10), stack.roster.release(held))
        return held

    held = await asyncio.gather(*(holder() for _ in range(holders)))
    status = await stack.roster.status()  # every release has returned: the pool has them all
    assert status.leases_released == holders * rounds and status.active_leases == holders
    events = await _pool_events(stack)
    assert _updates(events, "release") == 0
    carrying = _updates(events, "acquire", carrying=True)
    assert 1 <= carrying <= holders * rounds
    assert _updates(events, "acquire") < holders * (rounds + 1)  # acquires shared updates too
    await stack.roster.release_many(held)
    assert (await stack.roster.status()).active_leases == 0


async def test_many_acquires_at_once_leave_in_one_update(stack) -> None:
    """32 callers at once: one `acquire` update of 32, not 32 of one (nor 4 of 8: each update
    costs the pool a workflow task whatever it carries)."""
    await stack.roster.register(make_registration("wide", [("rag.search", "2.1.0", 32, "B")], heartbeat_interval_s=3600))
    leases = await asyncio.gather(*(stack.roster.acquire("rag.search", timeout=10) for _ in range(32)))
    assert len({lease.lease_id for lease in leases}) == 32
    sizes = []
    for e in await _pool_events(stack):
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            request = e.workflow_execution_update_accepted_event_attributes.accepted_request.input
            if request.name == "acquire":
                sizes.append(len(json.loads(request.args.payloads[0].data)["requests"]))
    assert sizes == [32]
    await stack.roster.release_many(leases)
    assert (await stack.roster.status()).active_leases == 0


async def test_a_lease_whose_caller_gave_up_on_the_wire_is_given_back(stack) -> None:
    await stack.roster.register(make_registration("orphaned", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))
    pipe = stack.roster._links[0].pipe
    asking = asyncio.create_task(stack.roster.acquire("rag.search", timeout=10))
    await eventually(lambda: pipe._acquiring == 1, interval=0)  # its `acquire` update is on the wire
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asking

    async def given_back() -> bool:
        status = await stack.roster.status()
        return status.leases_granted == 1 and status.active_leases == 0 and status.leases_released == 1

    assert await eventually(given_back)


async def test_a_parked_release_goes_alone_when_no_acquire_comes(stack) -> None:
    await stack.roster.register(make_registration("alone", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))
    leases = [await stack.roster.acquire("rag.search", timeout=10) for _ in range(2)]
    for lease in leases:
        stack.roster.release_later(lease, within_s=2.0)
    assert (await stack.roster.status()).active_leases == 2  # still parked

    async def released() -> bool:
        return (await stack.roster.status()).active_leases == 0

    assert await eventually(released)
    events = await _pool_events(stack)
    assert _updates(events, "release") == 1  # both in one update
    assert _updates(events, "acquire", carrying=True) == 0


async def test_a_lease_parked_after_an_early_send_waits_its_own_time(stack) -> None:
    """What is parked goes early when an acquire finds no free slot; the timer of what went
    must not send the next lease before its own time."""
    await stack.roster.register(make_registration("timely", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))
    first, second = [await stack.roster.acquire("rag.search", timeout=10) for _ in range(2)]
    pipe = stack.roster._links[0].pipe
    stack.roster.release_later(first, within_s=0.3)
    pipe.release_waiting_now()  # as `_send_acquires` does when a reply has no lease
    await eventually(lambda: not pipe.waiting_releases, interval=0)  # it has left
    stack.roster.release_later(second, within_s=30.0)
    await asyncio.sleep(0.6)
    assert pipe.waiting_releases == [second.lease_id]
    await stack.roster.flush_releases()
    assert (await stack.roster.status()).active_leases == 0


async def test_flush_releases_sends_what_is_parked_at_once(stack) -> None:
    await stack.roster.register(make_registration("flushed", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))
    lease = await stack.roster.acquire("rag.search", timeout=10)
    stack.roster.release_later(lease, within_s=3600.0)
    await stack.roster.flush_releases()
    assert (await stack.roster.status()).active_leases == 0


async def test_a_lease_of_another_pool_is_released_where_it_lives(stack) -> None:
    await stack.roster.register(make_registration("home", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))
    lease = await stack.roster.acquire("rag.search", timeout=10)
    stranger = AgentRoster(stack.env.client, pool=f"other-{uuid.uuid4().hex[:6]}", task_queue=stack.task_queue)
    stranger.release_later(lease, within_s=3600.0)  # not parked there: released in its own pool at once
    assert stranger._links[0].pipe.waiting_releases == []

    async def released() -> bool:
        return (await stack.roster.status()).active_leases == 0

    assert await eventually(released)


ASK = {"ref": "rag.search", "request_id": "r" * 32}
BAD_ARGUMENTS = [
    None,
    [],
    "lease-1",
    {"releases": []},
    {"requests": []},
    {"releases": ["x"], "requests": []},
    {"releases": "lease-1", "requests": [ASK]},
    {"releases": [None], "requests": [ASK]},
    {"releases": [5], "requests": [ASK]},
    {"releases": [""], "requests": [ASK]},
    {"releases": ["x" * 129], "requests": [ASK]},
    {"releases": ["x"] * 257, "requests": [ASK]},
    {"requests": [ASK] * 257},
    {"requests": [{**ASK, "wait_s": float("nan")}]},
    {"requests": [{**ASK, "surprise": 1}]},
    {"requests": [{"ref": "rag.search"}]},  # no request id
    {"requests": [None]},
    {"requests": [ASK], "extra": True},
    {"releases": ["x" * 100] * 200, "requests": [{**ASK, "exclude_agents": ["a" * 200] * 30}] * 200},  # over the size limit
]


async def test_the_update_refuses_every_malformed_argument_and_the_pool_carries_on(stack) -> None:
    await stack.roster.register(make_registration("steady", [("rag.search", "2.1.0", 1, "B")], heartbeat_interval_s=3600))
    handle = stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool))
    for bad in BAD_ARGUMENTS:
        with pytest.raises((WorkflowUpdateFailedError, RPCError)) as refused:
            await handle.execute_update("acquire", bad)
        if isinstance(refused.value, WorkflowUpdateFailedError):
            assert "acquire" in str(refused.value.cause), bad
        else:  # the server itself may refuse a payload (never the workflow)
            assert refused.value.status in (RPCStatusCode.INVALID_ARGUMENT, RPCStatusCode.RESOURCE_EXHAUSTED), refused.value
    for args in ([], [{"requests": [ASK]}, "second"]):  # wrong arity
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update("acquire", args=args)
    # A well-formed one from a plain client: an unknown lease id is no error, the acquire is answered.
    ask = {"ref": "rag.search", "wait_s": 0, "request_id": uuid.uuid4().hex}
    replies = await handle.execute_update("acquire", {"releases": ["no-such-lease"], "requests": [ask]})
    assert len(replies) == 1 and replies[0]["lease"]["agent_id"] == "steady"
    lease = Lease.model_validate(replies[0]["lease"])
    ask = {"ref": "rag.search", "wait_s": 0, "request_id": uuid.uuid4().hex}
    again = await handle.execute_update("acquire", {"releases": [lease.lease_id], "requests": [ask]})
    assert again[0]["lease"]["agent_id"] == "steady"  # the one slot, freed by the release it carried
    await stack.roster.release(again[0]["lease"]["lease_id"])
    assert _failed_tasks(await _pool_events(stack)) == 0
    assert (await stack.roster.status()).active_leases == 0


async def test_a_shutting_down_pool_refuses_the_acquire_and_still_gets_the_release(stack) -> None:
    await stack.roster.register(make_registration("ending", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))
    lease = await stack.roster.acquire("rag.search", timeout=10)
    other = AgentRoster(stack.env.client, pool=stack.pool, task_queue=stack.task_queue)
    await other.shutdown(deadline_s=120, wait=False, reason="maintenance")
    stack.roster.release_later(lease, within_s=3600.0)
    with pytest.raises(PoolShutdownError):
        await stack.roster.acquire("rag.search", timeout=1)
    assert stack.roster._links[0].pipe.waiting_releases == []

    async def released() -> bool:
        return (await stack.roster.status()).leases_released == 1

    assert await eventually(released)
    assert _failed_tasks(await _pool_events(stack)) == 0


def test_an_acquire_carrying_releases_has_a_recorded_history() -> None:
    """tests/histories/ holds a pool run with an `acquire` that carried releases (replayed by test_replay_histories.py)."""
    import base64

    from tests.test_replay_histories import FILES, load

    def carries(event: dict[str, Any]) -> bool:
        request = (event.get("workflowExecutionUpdateAcceptedEventAttributes") or {}).get("acceptedRequest", {}).get("input", {})
        if request.get("name") != "acquire":
            return False
        return bool(json.loads(base64.b64decode(request["args"]["payloads"][0]["data"])).get("releases"))

    found = [p.name for p in FILES if any(carries(e) for e in load(p)[1]["events"])]
    assert found, "record it: python tests/histories/record.py pool_release_and_acquire"
