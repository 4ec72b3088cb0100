"""Prefetched leases: a stream of supervisor tasks for one ref gets each next lease ahead of time.

`lease_and_invoke` (the one-activity path) asks, once a task of a stream ends and the
stream has no lease in stock, for the next PREFETCH_DEPTH tasks' leases in the update
that returns this one (`prefetch`: granted only from a free slot nobody waits for; never
queued, no scale demand), and keeps each PREFETCH_WINDOW_S for a next task, which then
makes no round trip to the pool. The
first renewal hands the lease to the task workflow (`adopt_by`) so revocation notices
reach it. These tests: the pool's rules (pure core), the wire, and the worker's path on a
real dev server with a real HTTP agent, plus raw and hostile payloads from a plain client.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError

import agentroster.activities.roster as roster_activities
from agentroster.activities.roster import PREFETCH_DEPTH
from agentroster.errors import PoolExhaustedError
from agentroster.messages import AcquireReply, AcquireRequest, AgentSnapshot, CapabilityDigest, RenewRequest
from agentroster.models import AgentState, Lease, TaskInput, TaskResult
from agentroster.core.health import HALF_OPEN, OPEN, Breaker
from agentroster.core.pool import PoolCore
from agentroster.vocabulary.metrics import PREFETCHED_LEASES
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import eventually, one_agent_core
from tests.test_supervisor import FakeAgentEndpoint, _no_leases, _registration, endpoints  # noqa: F401,F811 (a fixture)
from tests.test_supervisor import _run as _run_task


# ----------------------------------------------------------------------------- core
def _core(slots: int = 2) -> tuple[PoolCore, Any]:
    return one_agent_core("prefetch", slots)


def _prefetch(core: PoolCore, new_id: Any, request_id: str = "p" * 32, **fields: Any) -> AcquireReply:
    return core.acquire(AcquireRequest(ref="math.eval", request_id=request_id, wait_s=0, prefetch=True, **fields), 1.0, new_id)


def test_a_prefetch_takes_a_free_slot_for_the_worker_not_for_a_workflow() -> None:
    core, new_id = _core()
    reply = _prefetch(core, new_id, holder="prefetched by a worker of tq", lease_ttl_s=15)
    assert reply.lease is not None and reply.ticket is None and reply.report is None
    record = core.leases.get(reply.lease.lease_id)
    assert record is not None and record.holder == "prefetched by a worker of tq" and not record.holder_is_workflow
    assert record.deadline == 1.0 + 15
    assert core.status().active_leases == 1
    # A retried prefetch (same request id: its first answer was lost) gets the same lease, not a second slot.
    assert _prefetch(core, new_id, holder="prefetched by a worker of tq", lease_ttl_s=15).lease == reply.lease
    assert core.status().active_leases == 1


def test_a_prefetch_never_queues_never_counts_as_demand_and_yields_to_waiters() -> None:
    core, new_id = _core(slots=1)
    counters = dict(core.counters)
    held = core.acquire(AcquireRequest(ref="math.eval", request_id="h" * 32, wait_s=0), 1.0, new_id).lease
    assert held is not None
    # No free slot: nothing at all (no ticket, no report, no place in the queue, no scale demand).
    assert _prefetch(core, new_id) == AcquireReply()
    assert core.status().waiting == 0
    assert core.scaler._demand == {}
    assert core.counters["exhausted"] == counters.get("exhausted", 0)
    # A real caller waits for the capability: a slot freed meanwhile is its, never a prefetch's.
    waiting = core.acquire(AcquireRequest(ref="math.eval", request_id="w" * 32, wait_s=5), 1.0, new_id)
    assert waiting.ticket is not None
    core.agent_snapshot(  # a second agent, so a slot is free while the caller still waits in line
        AgentSnapshot(
            agent_id="a2", deployment="d", endpoint="http://a2:9000", state=AgentState.REGISTERING,
            capabilities=[CapabilityDigest(name="math.eval", version="1.0.0", max_concurrency=1, cost_class="A")],
            resync_interval_s=30.0,
        ),
        1.0, new_id,
    )
    if core.ticket_status(waiting.ticket).lease is None:  # not served yet: the prefetch must not jump the line
        assert _prefetch(core, new_id, request_id="q" * 32).lease is None


def test_no_prefetch_while_the_breaker_is_not_closed_or_the_pool_shuts_down() -> None:
    for state in (OPEN, HALF_OPEN):
        core, new_id = _core()
        core.health.breakers["math.eval"] = Breaker(state=state, since=0.0)
        assert _prefetch(core, new_id) == AcquireReply()
        assert core.status().active_leases == 0
    core, new_id = _core()
    core.begin_shutdown("test", 30.0, 1.0)
    assert _prefetch(core, new_id) == AcquireReply()
    assert core.status().active_leases == 0


def test_the_first_renewal_hands_a_prefetched_lease_to_its_task_workflow() -> None:
    core, new_id = _core()
    lease = _prefetch(core, new_id, holder="worker", lease_ttl_s=15).lease
    assert lease is not None
    renewed = core.renew(RenewRequest(lease_id=lease.lease_id, ttl_s=300, adopt_by="task-1"), 2.0)
    assert renewed is not None
    record = core.leases.get(lease.lease_id)
    assert record is not None and (record.holder, record.holder_is_workflow, record.deadline) == ("task-1", True, 302.0)
    # Not re-keyed (no request id given): the worker's prefetch id still finds it.
    assert core.acquire(AcquireRequest(ref="math.eval", request_id="p" * 32, recover_only=True), 2.0, new_id).lease == core.lease_of(record)
    # Its agent is declared gone: the adopting workflow is told.
    core.agent_gone("a1", "heartbeat_lost", 3.0, new_id)
    assert [(holder, notice.lease_id) for holder, notice in core.take_revocations()] == [("task-1", lease.lease_id)]


def test_an_adopted_lease_is_found_again_by_the_tasks_own_request_id() -> None:
    """What `recover_lease` does for a task whose activity ended without a word: it asks with
    `recover_only` and the task's request id, which the adopting renewal gave the lease."""
    core, new_id = _core()
    lease = _prefetch(core, new_id, holder="worker").lease
    assert lease is not None
    task_request = "t" * 32
    core.renew(RenewRequest(lease_id=lease.lease_id, ttl_s=60, adopt_by="task-1", adopt_request_id=task_request), 2.0)
    found = core.acquire(AcquireRequest(ref="math.eval", request_id=task_request, recover_only=True), 3.0, new_id)
    assert found.lease is not None and found.lease.lease_id == lease.lease_id
    assert core.acquire(AcquireRequest(ref="math.eval", request_id="p" * 32, recover_only=True), 3.0, new_id) == AcquireReply()
    # An id that names something already (another request's) is not taken over.
    other = core.acquire(AcquireRequest(ref="math.eval", request_id="o" * 32), 3.0, new_id).lease
    assert other is not None
    second = _prefetch(core, new_id, request_id="s" * 32).lease
    if second is not None:
        core.renew(RenewRequest(lease_id=second.lease_id, ttl_s=60, adopt_by="task-2", adopt_request_id="o" * 32), 4.0)
        assert core.acquire(AcquireRequest(ref="math.eval", request_id="o" * 32, recover_only=True), 4.0, new_id).lease == other
    # Released, the id finds nothing.
    core.release(lease.lease_id, 5.0, new_id)
    assert core.acquire(AcquireRequest(ref="math.eval", request_id=task_request, recover_only=True), 5.0, new_id) == AcquireReply()


def test_adopt_by_never_takes_a_workflows_lease_away_from_it() -> None:
    core, new_id = _core()
    lease = core.acquire(
        AcquireRequest(ref="math.eval", request_id="r" * 32, holder="task-a", holder_is_workflow=True), 1.0, new_id
    ).lease
    assert lease is not None
    assert core.renew(RenewRequest(lease_id=lease.lease_id, ttl_s=60, adopt_by="someone-else"), 2.0) is not None
    record = core.leases.get(lease.lease_id)
    assert record is not None and (record.holder, record.holder_is_workflow) == ("task-a", True)


def test_a_prefetched_lease_survives_continue_as_new_as_adopted() -> None:
    core, new_id = _core()
    lease = _prefetch(core, new_id, holder="worker").lease
    assert lease is not None
    core.renew(RenewRequest(lease_id=lease.lease_id, ttl_s=60, adopt_by="task-1"), 2.0)
    again = PoolCore.from_state(core.to_state())
    record = again.leases.get(lease.lease_id)
    assert record is not None and (record.holder, record.holder_is_workflow) == ("task-1", True)


# ----------------------------------------------------------------------------- wire
def test_the_new_fields_are_left_off_the_wire_unless_set() -> None:
    """Ordinary acquires and renewals are written as before (a pool run by an older worker refuses unknown fields)."""
    assert "prefetch" not in AcquireRequest(ref="math.eval", request_id="r" * 16).model_dump(mode="json")
    assert AcquireRequest(ref="math.eval", request_id="r" * 16, prefetch=True).model_dump(mode="json")["prefetch"] is True
    assert RenewRequest(lease_id="l", ttl_s=5).model_dump(mode="json") == {"lease_id": "l", "ttl_s": 5.0}
    assert RenewRequest(lease_id="l", ttl_s=5, adopt_by="t").model_dump(mode="json") == {"lease_id": "l", "ttl_s": 5.0, "adopt_by": "t"}
    adopted = RenewRequest(lease_id="l", ttl_s=5, adopt_by="t", adopt_request_id="r" * 16).model_dump(mode="json")
    assert adopted["adopt_request_id"] == "r" * 16


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"adopt_by": ""}, "adopt_by"),
        ({"adopt_by": "x" * 513}, "adopt_by"),
        ({"adopt_by": 5}, "adopt_by"),
        ({"adopt_by": "t", "adopt_request_id": "short"}, "adopt_request_id"),
        ({"adopt_by": "t", "adopt_request_id": None, "adopt_extra": 1}, "adopt_extra"),
    ],
)
def test_a_bad_adopt_by_is_refused_naming_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as caught:
        RenewRequest.model_validate({"lease_id": "l", "ttl_s": 5, **bad})
    assert field in str(caught.value)


# ----------------------------------------------------------------------------- worker, real server
def _prefetched() -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in PREFETCHED_LEASES.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["outcome"]] = out.get(sample.labels["outcome"], 0.0) + sample.value
    return out


async def _run(stack: Any, expression: str) -> TaskResult:
    return await _run_task(stack, {"expression": expression})


def _wide_window(stack: Any) -> None:
    """A 1 s window instead of 0.25 s: tasks started back to back by the test still count as a
    stream when the machine is loaded (CI runs two suites' servers on 2 cores)."""
    stack.worker._roster_activities.prefetch_window_s = 1.0


async def test_a_stream_of_tasks_takes_prefetched_leases_and_gives_the_last_back(stack, endpoints) -> None:
    """Tasks back to back (a supervisor's loop): from the third on each finds its lease waiting;
    once the stream ends the spare lease goes back within the window (+ the release linger)."""
    # (the window is widened for a loaded CI machine; bench_supervisor measures the default)
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-1", url, "A"))
    _wide_window(stack)
    before = _prefetched()
    results = [await _run(stack, f"{n}+1") for n in range(6)]
    assert [r.output for r in results] == [{"value": float(n + 1)} for n in range(6)]
    assert len(agent.requests) == 6 and len({r["lease_id"] for r in agent.requests}) == 6  # one lease per task
    after = _prefetched()
    used = after.get("used", 0) - before.get("used", 0)
    assert used >= 3, after
    await eventually(lambda: _no_leases(stack), timeout=5)
    status = await stack.roster.status()
    unused = _prefetched().get("unused", 0) - before.get("unused", 0)
    # Every lease granted came back: one per task plus the spares that no task took.
    assert status.leases_granted == 6 + unused and status.leases_released == status.leases_granted
    assert unused <= PREFETCH_DEPTH


async def test_a_worker_that_shuts_down_gives_its_spare_lease_back_while_it_still_runs_the_pool(stack, endpoints) -> None:
    """The worker is the pool's only worker: the lease it prefetched for the next task of a
    stream goes back before it stops polling, not at the lease's TTL after it."""
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-1", url, "A"))
    stack.worker._roster_activities.prefetch_window_s = 60.0  # the spare is still held at the shutdown
    before = _prefetched()
    for n in range(4):
        await _run(stack, f"{n}+1")
    assert _prefetched().get("used", 0) > before.get("used", 0)  # a stream: a spare lease is waiting
    await stack.stop_worker()
    at_shutdown = _lease_updates(await _pool_events(stack))
    await stack.start_worker()
    status = await stack.roster.status()
    assert status.active_leases == 0 and status.leases_released == status.leases_granted, status
    # Nothing was left for the next worker to carry out: the spare's release was in the
    # history before the old worker stopped, not an update waiting for a worker.
    assert _lease_updates(await _pool_events(stack)) == at_shutdown


async def _pool_events(stack: Any) -> list[Any]:
    history = await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()
    return list(history.events)


def _lease_updates(events: list[Any]) -> int:
    """Accepted `acquire` and `release` updates in a pool's history."""
    accepted = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
    return sum(
        1 for e in events
        if e.event_type == accepted and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name in ("acquire", "release")
    )


class GatedAgent(FakeAgentEndpoint):
    """An agent that answers only while its gate is open."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def _task(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        await self.gate.wait()
        return web.json_response({"output": {"value": float(sum(int(x) for x in body["input"]["expression"].split("+")))}})


async def test_a_task_on_a_prefetched_lease_is_adopted_at_its_first_renewal(stack, monkeypatch) -> None:
    """A task that took a prefetched lease holds it as the worker's until its first renewal (a
    third into the prefetched lease's short TTL), which names the task workflow as the holder:
    from then on a revocation reaches the workflow, as for a lease it asked for itself."""
    monkeypatch.setattr(roster_activities, "PREFETCH_TTL_S", 6.0)  # the first renewal ~2 s into the task
    agent = GatedAgent()
    url = await agent.start()
    try:
        await stack.roster.register(_registration("math-1", url, "A"))
        _wide_window(stack)
        before = _prefetched().get("used", 0)
        await _run(stack, "1+1")
        await _run(stack, "2+2")  # back to back: a lease is prefetched for the next task
        agent.gate.clear()
        handle = await stack.env.client.start_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="math.eval@>=1,<2", payload={"expression": "3+3"}, pool=stack.pool, acquire_timeout_s=5),
            id=f"task-{uuid.uuid4().hex[:8]}",
            task_queue=stack.task_queue,
            result_type=TaskResult,
        )
        await eventually(lambda: len(agent.requests) == 3, timeout=10)
        assert _prefetched().get("used", 0) - before >= 1
        lease_id = agent.requests[2]["lease_id"]
        pool = stack.env.client.get_workflow_handle(f"pool/{stack.pool}")
        # Once adopted, were its activity to end without a word, the task's recovery would find the
        # lease by its own request id (`recover_only` grants nothing), held by the task workflow.
        acts = stack.worker._roster_activities
        request_id = acts._request_id(handle.id, (await handle.describe()).run_id, "lease-and-invoke/1")

        async def adopted() -> bool:
            replies = await pool.execute_update(
                "acquire", {"requests": [{"ref": "math.eval", "request_id": request_id, "recover_only": True}]},
                result_type=list[AcquireReply],
            )
            found = replies[0].lease
            return found is not None and found.lease_id == lease_id and found.holder == handle.id

        await eventually(adopted, timeout=10)
        agent.gate.set()
        assert (await handle.result()).output == {"value": 6.0}
        await eventually(lambda: _no_leases(stack), timeout=5)
    finally:
        agent.gate.set()
        await agent.stop()


async def test_a_caller_already_waiting_gets_the_slot_before_the_workers_prefetch(stack) -> None:
    """An agent with one slot, a stream of tasks on the worker, and a plain client waiting in
    the pool's queue: when the stream's task ends, its release serves the waiting client
    first and the prefetch riding on the same update finds nothing (counted `missed`)."""
    agent = GatedAgent()
    url = await agent.start()
    try:
        registration = _registration("math-solo", url, "A")
        registration.capabilities[0].max_concurrency = 1
        await stack.roster.register(registration)
        _wide_window(stack)
        missed = _prefetched().get("missed", 0)
        await _run(stack, "1+1")
        await _run(stack, "2+2")  # in stream: a lease is prefetched (the slot was free, nobody waited)
        agent.gate.clear()
        task = asyncio.create_task(_run(stack, "3+3"))  # takes the prefetched lease, then waits at the agent
        await eventually(lambda: len(agent.requests) == 3, timeout=10)
        waiting = asyncio.create_task(stack.roster.acquire("math.eval@>=1,<2", timeout=10))
        await eventually(lambda: _waiting(stack), timeout=10)
        agent.gate.set()
        assert (await task).output == {"value": 6.0}
        lease = await asyncio.wait_for(waiting, timeout=5)  # the waiting caller got the one slot
        assert lease.agent_id == "math-solo"
        await eventually(lambda: _prefetched().get("missed", 0) > missed, timeout=5)
        await stack.roster.release(lease)
        await eventually(lambda: _no_leases(stack), timeout=5)
    finally:
        agent.gate.set()
        await agent.stop()


async def _waiting(stack: Any) -> bool:
    return (await stack.roster.status()).waiting == 1


HOSTILE_PREFETCHES: list[Any] = [
    {"ref": "math.eval", "request_id": "r" * 32, "prefetch": None},
    {"ref": "math.eval", "request_id": "r" * 32, "prefetch": "NaN"},
    {"ref": "math.eval", "request_id": "r" * 32, "prefetch": [True]},
    {"ref": "math.eval", "request_id": "r" * 32, "prefetch": {"yes": 1}},
    {"ref": "math.eval", "request_id": "r" * 32, "prefetch": True, "wait_s": math.nan},
]
HOSTILE_RENEWALS: list[Any] = [
    {"lease_id": "l" * 32, "ttl_s": 5, "adopt_by": ""},
    {"lease_id": "l" * 32, "ttl_s": 5, "adopt_by": 7},
    {"lease_id": "l" * 32, "ttl_s": 5, "adopt_by": ["task"]},
    {"lease_id": "l" * 32, "ttl_s": 5, "adopt_by": "t" * 200_000},
    {"lease_id": "l" * 32, "ttl_s": math.inf, "adopt_by": "task"},
    {"lease_id": "l" * 32, "ttl_s": 5, "adopt_by": "task", "adopt_request_id": "x"},
    {"lease_id": "l" * 32, "ttl_s": 5, "adopt_by": "task", "adopt_request_id": "x" * 129},
]


async def test_raw_and_hostile_prefetches_and_adoptions_are_refused_naming_the_field(stack) -> None:
    """A plain temporalio client sends what our client never would: each is refused by the
    update's validator (nothing enters history), and the pool goes on granting and renewing."""
    await stack.roster.register(_registration("math-1", "http://127.0.0.1:9", "A"))
    pool = stack.env.client.get_workflow_handle(f"pool/{stack.pool}")
    for bad in HOSTILE_PREFETCHES:
        for arg in ({"requests": [bad]}, {"requests": [bad], "releases": ["l" * 32]}):
            with pytest.raises(WorkflowUpdateFailedError) as caught:
                await pool.execute_update("acquire", arg)
            text = str(caught.value.cause)
            assert "prefetch" in text or "NaN" in text, (arg, text)  # the field, or what no field may hold
    for bad in HOSTILE_RENEWALS:
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await pool.execute_update("renew", [bad])
        text = str(caught.value.cause)
        assert "adopt_" in text or "infinities" in text or "bytes" in text, (bad, text)
    with pytest.raises(WorkflowUpdateFailedError):  # wrong arity
        await pool.execute_update("renew", args=[[{"lease_id": "l" * 32, "ttl_s": 5, "adopt_by": "t"}], "extra"])
    # Still serving: a raw prefetch as a worker sends it is granted, adopted by a raw renewal, released.
    raw = {"ref": "math.eval", "request_id": "raw-prefetch-" + "0" * 20, "wait_s": 0, "prefetch": True, "holder": "w"}
    (reply,) = await pool.execute_update("acquire", {"requests": [raw]}, result_type=list[AcquireReply])
    assert reply.lease is not None
    (renewed,) = await pool.execute_update(
        "renew", [{"lease_id": reply.lease.lease_id, "ttl_s": 60, "adopt_by": "task-x"}], result_type=list[Lease | None]
    )
    assert renewed is not None and renewed.holder == "task-x"
    await stack.roster.release(reply.lease)
    assert (await stack.roster.status()).active_leases == 0


# ----------------------------------------------------------------------------- worker, stubbed pool
class _StreamRoster:
    """What lease_and_invoke sees of AgentRoster, recording what it was asked."""

    def __init__(self) -> None:
        self.reply_ticket = False
        self.requests: list[Any] = []
        self.prefetches: list[dict[str, Any]] = []
        self.later: list[str] = []
        self._n = 0

    def _lease(self, ttl_s: float) -> Lease:
        self._n += 1
        return Lease.model_validate({
            "lease_id": f"{self._n:032d}", "pool": "p", "agent_id": "a", "deployment": "d", "capability": "math.eval",
            "version": "1.2.0", "endpoint": "http://127.0.0.1:9", "granted_at": "2026-01-01T00:00:00Z",
            "deadline": f"2026-01-01T00:{int(ttl_s) // 60:02d}:{int(ttl_s) % 60:02d}Z",
        })

    async def lease_for(self, request: Any, *, started: float | None = None, on_queued: Any = None) -> Lease:
        self.requests.append(request)
        if self.reply_ticket:
            on_queued()
            raise PoolExhaustedError(request.ref, waited_s=request.wait_s, pool="p")
        return self._lease(300)

    async def prefetch(self, ref: str, *, shard: int, lease_ttl_s: float, holder: str) -> Lease | None:
        self.prefetches.append({"ref": ref, "shard": shard, "ttl": lease_ttl_s, "holder": holder})
        return self._lease(lease_ttl_s)

    def release_later(self, lease: Lease, within_s: float = 0.1, outcome: str | None = None) -> None:
        self.later.append(lease.lease_id)


def _stream_activities(roster: _StreamRoster, invoke: Any) -> Any:
    from tests.test_task_one_activity import _activities

    acts = _activities(roster, invoke)  # type: ignore[arg-type]
    acts.prefetch_window_s = 0.25
    acts.task_queue = "tq"
    return acts


def _task(ref: str = "math.eval", exclude: list[str] | None = None) -> Any:
    from agentroster.messages import LeaseAndInvoke, PoolAcquireRequest

    request = PoolAcquireRequest(pool="p", ref=ref, wait_s=5, exclude_agents=exclude or [])
    return LeaseAndInvoke(request=request, payload={"expression": "1+1"}, key="1")


async def test_the_worker_prefetches_only_inside_a_stream_and_gives_back_what_no_task_took() -> None:
    from temporalio.testing import ActivityEnvironment

    roster = _StreamRoster()

    async def invoke(*args: Any, **kwargs: Any) -> Any:
        return {"value": 2.0}

    acts = _stream_activities(roster, invoke)
    used = _prefetched().get("used", 0)
    try:
        first = await ActivityEnvironment().run(acts.lease_and_invoke, _task())
        await asyncio.sleep(0)
        assert roster.prefetches == []  # one task is no stream
        second = await ActivityEnvironment().run(acts.lease_and_invoke, _task())
        await asyncio.sleep(0.01)
        # PREFETCH_DEPTH at once, for the next tasks.
        assert roster.prefetches == [{"ref": "math.eval", "shard": 0, "ttl": 15.0, "holder": "prefetched by a worker of tq"}] * PREFETCH_DEPTH
        third = await ActivityEnvironment().run(acts.lease_and_invoke, _task())  # takes one: no request
        assert len(roster.requests) == 2 and third.lease is not None and third.lease.lease_id == f"{3:032d}"
        assert _prefetched().get("used", 0) == used + 1
        await asyncio.sleep(0.01)
        assert len(roster.prefetches) == PREFETCH_DEPTH  # the others still wait: no more asked for until taken
        other = await ActivityEnvironment().run(acts.lease_and_invoke, _task(ref="math.eval@>=1"))  # another stream: asks
        assert len(roster.requests) == 3 and other.lease is not None
        await asyncio.sleep(0.01)
        # Every task's own lease went back; the leases prefetched and not taken wait, then go back unused.
        assert roster.later[:2] == [first.lease.lease_id, second.lease.lease_id]  # type: ignore[union-attr]
        waiting = {f"{n:032d}" for n in range(4, 3 + PREFETCH_DEPTH)}
        assert waiting and not waiting & set(roster.later)
        await asyncio.sleep(0.35)
        assert waiting <= set(roster.later) and acts._prefetched == {}
    finally:
        acts._restore()


async def test_a_miss_or_a_cancelled_task_gives_prefetched_leases_back() -> None:
    from temporalio.testing import ActivityEnvironment

    roster = _StreamRoster()
    outcome: dict[str, Any] = {"raise": None}

    async def invoke(*args: Any, **kwargs: Any) -> Any:
        if outcome["raise"] is not None:
            raise outcome["raise"]
        return {"value": 2.0}

    acts = _stream_activities(roster, invoke)
    try:
        for _ in range(2):
            await ActivityEnvironment().run(acts.lease_and_invoke, _task())
        await asyncio.sleep(0.01)
        waiting = [entry.lease.lease_id for entries in acts._prefetched.values() for entry in entries]
        assert len(waiting) == PREFETCH_DEPTH
        # A task of this worker finds no free slot in the pool (a failover attempt: it takes no prefetched lease).
        roster.reply_ticket = True
        reply = await ActivityEnvironment().run(acts.lease_and_invoke, _task(exclude=["a"]))
        assert reply.reply is not None and reply.reply.lease is None
        assert all(w in roster.later for w in waiting) and acts._prefetched == {}
        # A task that took a prefetched lease and is cancelled gives it back (its workflow cannot look it up).
        roster.reply_ticket = False
        for _ in range(2):
            await ActivityEnvironment().run(acts.lease_and_invoke, _task())
        await asyncio.sleep(0.01)
        taken = [entry.lease.lease_id for entries in acts._prefetched.values() for entry in entries][0]  # the oldest goes first
        outcome["raise"] = asyncio.CancelledError()
        with pytest.raises(asyncio.CancelledError):
            await ActivityEnvironment().run(acts.lease_and_invoke, _task())
        assert taken in roster.later
    finally:
        acts._restore()


@pytest.mark.parametrize("value, expected", [("0", 0.0), ("0.5", 0.5), ("5", 5.0), ("", None)])
def test_the_window_comes_from_the_environment(value: str, expected: float | None) -> None:
    from agentroster.client.settings import lease_prefetch_from_env

    assert lease_prefetch_from_env({"AGENTROSTER_LEASE_PREFETCH_S": value}) == expected


@pytest.mark.parametrize("value", ["-1", "6", "nan", "inf", "soon"])
def test_a_bad_window_is_refused_naming_the_variable(value: str) -> None:
    from agentroster.errors import AgentRosterError
    from agentroster.client.settings import lease_prefetch_from_env

    with pytest.raises(AgentRosterError) as caught:
        lease_prefetch_from_env({"AGENTROSTER_LEASE_PREFETCH_S": value})
    assert "AGENTROSTER_LEASE_PREFETCH_S" in str(caught.value) and "0 (off) to 5" in str(caught.value)


async def test_a_worker_takes_the_window_from_the_environment_unless_given_one(dev_env, monkeypatch) -> None:
    from agentroster.workers.worker import create_worker

    monkeypatch.setenv("AGENTROSTER_LEASE_PREFETCH_S", "0")
    off = create_worker(dev_env.client, task_queue=f"tq-{uuid.uuid4().hex[:8]}", backend="none")
    assert off._roster_activities.prefetch_window_s == 0.0
    given = create_worker(dev_env.client, task_queue=f"tq-{uuid.uuid4().hex[:8]}", backend="none", lease_prefetch_s=0.1)
    assert given._roster_activities.prefetch_window_s == 0.1
    monkeypatch.delenv("AGENTROSTER_LEASE_PREFETCH_S")
    default = create_worker(dev_env.client, task_queue=f"tq-{uuid.uuid4().hex[:8]}", backend="none")
    assert default._roster_activities.prefetch_window_s == roster_activities.PREFETCH_WINDOW_S == 0.25
