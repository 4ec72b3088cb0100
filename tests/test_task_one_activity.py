"""CapabilityTaskWorkflow: one activity per attempt, what a run does and that it stays correct.

Each attempt asks for its lease (waiting in the pool's queue if need be),
invokes the agent and releases in one activity (`lease_and_invoke`), so a task
has the shape of a child that only calls its agent: one activity, two workflow
tasks, no local activity, no timer, whether its lease came at once or from the
queue. The workflow learns the lease only when the activity ends; a lease the
activity took but could not report (it was stopped, or its worker died) is
found by the request's secret id and given back (`recover_lease`). The tests in
test_supervisor.py (failover, revocation while the agent hangs, cancellation,
queueing) run on this path too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import ActivityEnvironment

from agentroster.activities.roster import RosterActivities
from agentroster.errors import PoolExhaustedError, PoolReport, LeaseLostError
from agentroster.messages import (
    AcquireReply,
    LeaseAndInvoke,
    LeaseInvokeFailure,
    LeaseInvokeOutcome,
    PoolAcquireRequest,
)
from agentroster.models import Lease, TaskInput, TaskResult
from agentroster.vocabulary.wire import ACQUIRE_FAILED, AGENTS_SERVED, LEASE_LOST
from tests.conftest import eventually
from tests.test_supervisor import FakeAgentEndpoint, _registration, endpoints  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parent.parent


async def _start(stack: Any, payload: Any, **options: Any) -> WorkflowHandle[Any, TaskResult]:
    return await stack.env.client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="math.eval@>=1,<2", payload=payload, pool=stack.pool, **{"acquire_timeout_s": 5, **options}),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
        result_type=TaskResult,
        task_timeout=timedelta(seconds=3),
    )


async def _shape(handle: WorkflowHandle[Any, Any]) -> dict[str, Any]:
    """What the run did: its patch markers, local activities, activities (in order), timers and workflow tasks."""
    shape: dict[str, Any] = {"patches": [], "local_activities": 0, "activities": [], "timers": 0, "workflow_tasks": 0, "upserts": 0}
    for event in (await handle.fetch_history()).events:
        kind = event.WhichOneof("attributes")
        if kind == "upsert_workflow_search_attributes_event_attributes":
            shape["upserts"] += 1
        elif kind == "marker_recorded_event_attributes":
            marker = event.marker_recorded_event_attributes
            if marker.marker_name == "core_patch":
                shape["patches"].append(json.loads(marker.details["patch-data"].payloads[0].data)["id"])
            elif marker.marker_name == "core_local_activity":
                shape["local_activities"] += 1
        elif kind == "activity_task_scheduled_event_attributes":
            shape["activities"].append(event.activity_task_scheduled_event_attributes.activity_type.name)
        elif kind == "timer_started_event_attributes":
            shape["timers"] += 1
        elif kind == "workflow_task_completed_event_attributes":
            shape["workflow_tasks"] += 1
    return shape


async def _released(stack: Any, n: int) -> bool:
    status = await stack.roster.status()
    return status.active_leases == 0 and status.leases_released == n


async def test_a_task_runs_in_one_activity_with_the_floors_shape(stack, endpoints) -> None:
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-one", url, "A"))
    handle = await _start(stack, {"expression": "2+3"})
    result = await handle.result()
    assert (result.agent_id, result.output, result.attempts) == ("math-one", {"value": 5.0}, 1)
    # No marker, no search attribute upsert (AgentsServed is asked for per task), no local activity,
    # no renewal timer, one activity, two workflow tasks: a child that only calls its agent.
    assert await _shape(handle) == {
        "patches": [], "local_activities": 0, "activities": ["lease_and_invoke"], "timers": 0, "workflow_tasks": 2, "upserts": 0,
    }
    await eventually(lambda: _released(stack, 1))  # the release lands after the activity completed
    assert len(agent.requests) == 1 and agent.requests[0]["lease_id"]


async def test_agents_served_costs_one_upsert_per_agent_and_only_when_asked(stack, endpoints) -> None:
    _, liar_url = await endpoints("bad-output")
    _, good_url = await endpoints()
    await stack.roster.register(_registration("math-liar-sa", liar_url, "A"))
    await stack.roster.register(_registration("math-honest-sa", good_url, "C"))
    asked = await _start(stack, {"expression": "1+1"}, record_agents_served=True)
    assert (await asked.result()).agent_id == "math-honest-sa"
    assert (await _shape(asked))["upserts"] == 2  # the agent it failed over from, then the one that served it
    served = (await asked.describe()).typed_search_attributes.get(AGENTS_SERVED)
    assert served == ["math-liar-sa", "math-honest-sa"]
    plain = await _start(stack, {"expression": "2+2"})
    assert (await plain.result()).attempts == 2
    assert (await _shape(plain))["upserts"] == 0
    assert (await plain.describe()).typed_search_attributes.get(AGENTS_SERVED) is None


async def test_a_refused_payload_fails_the_task_and_the_activity_releases(stack, endpoints) -> None:
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-refuses", url, "A"))
    handle = await _start(stack, {"expr": "1+1"})
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert isinstance(caught.value.cause, ApplicationError) and caught.value.cause.type == "InvalidTaskInput"
    assert agent.requests == []
    assert (await _shape(handle))["activities"] == ["lease_and_invoke"]  # released by the activity: no release_lease
    await eventually(lambda: _released(stack, 1))


async def test_a_failover_runs_one_activity_per_attempt_and_releases_every_lease(stack, endpoints) -> None:
    _, liar_url = await endpoints("bad-output")
    _, good_url = await endpoints()
    await stack.roster.register(_registration("math-liar", liar_url, "A"))
    await stack.roster.register(_registration("math-honest", good_url, "C"))
    handle = await _start(stack, {"expression": "40+2"})
    result = await handle.result()
    assert (result.agent_id, result.attempts, result.output) == ("math-honest", 2, {"value": 42.0})
    assert (await _shape(handle))["activities"] == ["lease_and_invoke", "lease_and_invoke"]
    await eventually(lambda: _released(stack, 2))


async def test_a_queued_task_waits_in_its_activity_and_gets_its_lease_by_the_same_road(stack, endpoints) -> None:
    _, url = await endpoints()
    await stack.roster.register(_registration("math-full", url, "A"))
    held = [await stack.roster.acquire("math.eval"), await stack.roster.acquire("math.eval")]  # both slots
    handle = await _start(stack, {"expression": "20+22"}, acquire_timeout_s=30)
    await eventually(lambda: _waiting(stack, 1))

    async def pending_activity() -> bool:
        return bool((await handle.describe()).raw_description.pending_activities)

    assert await pending_activity()  # the activity waits in the queue (heartbeating)
    await stack.roster.release(held[0])
    result = await asyncio.wait_for(handle.result(), timeout=20)
    assert (result.agent_id, result.output, result.attempts) == ("math-full", {"value": 42.0}, 1)
    assert await _shape(handle) == {
        "patches": [], "local_activities": 0, "activities": ["lease_and_invoke"], "timers": 0, "workflow_tasks": 2, "upserts": 0,
    }
    await stack.roster.release(held[1])
    await eventually(lambda: _released(stack, 3))


class _SlowOnce(FakeAgentEndpoint):
    """Its first task takes `first_s` (by default it never ends before the caller hangs up); every later one answers at once."""

    def __init__(self, first_s: float = 60.0) -> None:
        super().__init__("ok")
        self.calls = 0
        self.first_s = first_s

    async def _task(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.calls == 1:
            self.received.set()
            await asyncio.sleep(self.first_s)
        return await super()._task(request)


async def test_a_revocation_the_pool_contradicts_is_refused_and_the_attempt_goes_on(stack) -> None:
    """While the activity runs, the workflow cannot tell its lease from another: a well-formed
    `lease_revoked` (here from a plain temporalio client, raw JSON) makes it ask the pool what
    its request holds (`request_holds`). Still its lease: the notice was not the pool's, it is
    refused and the attempt runs to its end, no attempt spent. Malformed ones are refused as ever."""
    agent = _SlowOnce(first_s=3.0)
    url = await agent.start()
    try:
        await stack.roster.register(_registration("math-slow", url, "A"))
        handle = await _start(stack, {"expression": "1+2"}, lease_ttl_s=300)
        await asyncio.wait_for(agent.received.wait(), timeout=15)
        plain = await Client.connect(stack.env.client.service_client.config.target_host)  # the default converter: raw JSON
        task = plain.get_workflow_handle(handle.id)
        await task.signal("lease_revoked")  # no argument
        await task.signal("lease_revoked", {"lease_id": 7})  # wrong type
        await task.signal("lease_revoked", {"lease_id": "f" * 32, "agent_id": "math-slow", "reason": "forged"})
        result = await asyncio.wait_for(handle.result(), timeout=30)
        assert (result.agent_id, result.attempts, result.output) == ("math-slow", 1, {"value": 3.0})
        refusals = await handle.query("refusals")
        assert any("still holds its lease or place" in r for r in refusals), refusals
        assert sum("lease_revoked refused" in r for r in refusals) >= 3, refusals
        shape = await _shape(handle)
        assert shape["activities"] == ["lease_and_invoke", "request_holds"]
        await eventually(lambda: _released(stack, 1))
        assert (await stack.roster.status()).leases_revoked == 0
        assert agent.calls == 1  # the agent ran the task once
    finally:
        await agent.stop()


async def test_a_lease_whose_worker_died_mid_task_is_given_back(stack, endpoints) -> None:
    """The activity's worker is killed (SIGKILL) while the agent works: nobody can say which
    lease it held. Its heartbeat times out, and the workflow, on the worker that is left,
    finds the lease by the request's secret id (`recover_lease`) and releases it, long before
    the lease's TTL (300 s) would have ended it."""
    hang, url = await endpoints("hang")
    await stack.roster.register(_registration("math-hangs", url, "A"))
    await stack.stop_worker()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", "worker",
        "--address", stack.env.client.service_client.config.target_host,
        "--pool", stack.pool, "--task-queue", stack.task_queue, "--backend", "none",
        env=env, cwd=str(REPO), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        handle = await _start(stack, {"expression": "1+1"}, lease_ttl_s=300)
        await asyncio.wait_for(hang.received.wait(), timeout=60)
        assert (await stack.roster.status()).active_leases == 1
    finally:
        worker.send_signal(signal.SIGKILL)
        await worker.wait()
    await stack.start_worker()
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(handle.result(), timeout=60)
    assert isinstance(caught.value.cause, ActivityError)  # the task failed, as an invoke whose worker died does
    assert (await _shape(handle))["activities"] == ["lease_and_invoke", "recover_lease"]
    await eventually(lambda: _released(stack, 1))
    assert (await stack.roster.status()).leases_expired == 0


async def _waiting(stack: Any, n: int) -> bool:
    return (await stack.roster.status()).waiting == n


# ------------------------------------------------------------ lease_and_invoke alone
def _lease() -> Lease:
    return Lease.model_validate(
        {
            "lease_id": "l" * 32, "pool": "p", "agent_id": "a", "deployment": "d", "capability": "math.eval",
            "version": "1.2.0", "endpoint": "http://127.0.0.1:9", "granted_at": "2026-01-01T00:00:00Z",
            "deadline": "2026-01-01T00:00:03Z",  # a 3 s TTL: renewed every second
        }
    )


class _Roster:
    def __init__(self, *, reply: AcquireReply | None, renew_fails: bool = False) -> None:
        self.reply = reply
        self.renew_fails = renew_fails
        self.requests: list[Any] = []
        self.renewed = 0
        self.released: list[str] = []
        self.signals = 0
        self.later: list[tuple[str, float]] = []
        self.outcomes: list[str | None] = []  # what each release_later says of its task

    async def lease_for(self, request: Any, *, started: float | None = None, on_queued: Any = None) -> Lease:
        self.requests.append(request)
        if self.reply is None:
            raise RuntimeError("pool p update acquire: gave up after retries")
        if self.reply.lease is None:
            raise PoolExhaustedError(request.ref, waited_s=request.wait_s, report=self.reply.report, pool="p")
        return self.reply.lease

    async def renew(self, lease: Lease, ttl_s: float | None = None, *, adopt_by: str | None = None) -> Lease:
        self.renewed += 1
        if self.renew_fails:
            raise LeaseLostError(f"lease {lease.lease_id} has ended")
        return lease

    async def release(self, lease: Lease) -> None:
        self.released.append(lease.lease_id)

    async def release_many(self, leases: list[Lease]) -> None:
        self.signals += 1
        self.released.extend(lease.lease_id for lease in leases)

    def release_later(self, lease: Lease, within_s: float, outcome: str | None = None) -> None:
        self.later.append((lease.lease_id, within_s))
        self.outcomes.append(outcome)


def _activities(roster: _Roster, invoke: Any) -> RosterActivities:
    acts = RosterActivities.__new__(RosterActivities)  # no client: the roster and the invoke are stubbed
    acts._request_secret = b"s" * 32
    acts.release_linger_s = 0.05
    acts.prefetch_window_s = 0.0  # these tests are about one task (tests/test_lease_prefetch.py: streams)
    acts._prefetched, acts._last_end, acts._prefetching, acts._asking, acts._owed = {}, {}, set(), {}, {}

    async def checked_roster(pool: str) -> Any:
        return roster

    async def session() -> Any:
        return None

    acts._checked_roster = checked_roster  # type: ignore[method-assign]
    acts._roster = lambda pool: roster  # type: ignore[method-assign]
    acts._session = session  # type: ignore[method-assign]
    acts.client = None  # type: ignore[assignment]
    acts.lease_keys = None
    acts.schemas = None  # type: ignore[assignment]
    import agentroster.activities.roster as module

    module_invoke = module.invoke_leased
    module.invoke_leased = invoke  # type: ignore[assignment]
    acts._restore = lambda: setattr(module, "invoke_leased", module_invoke)  # type: ignore[attr-defined]
    return acts


def _input() -> LeaseAndInvoke:
    return LeaseAndInvoke(request=PoolAcquireRequest(pool="p", ref="math.eval", wait_s=5), payload={"expression": "1+1"}, key="1")


async def test_lease_and_invoke_hands_back_the_pools_figures_when_no_lease_came_in_time() -> None:
    report = PoolReport(ref="math.eval", matching=1, busy=1)
    roster = _Roster(reply=AcquireReply(report=report))

    async def invoke(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no lease: nothing may be sent to an agent")

    acts = _activities(roster, invoke)
    try:
        outcome = await ActivityEnvironment().run(acts.lease_and_invoke, _input())
    finally:
        acts._restore()  # type: ignore[attr-defined]
    assert outcome == LeaseInvokeOutcome(reply=AcquireReply(report=report))
    # The request id is the caller's secret, derived per workflow run and attempt; the workflow is told of revocations.
    (request,) = roster.requests
    assert len(request.request_id) == 32 and request.holder_is_workflow and not request.recover_only


async def test_lease_and_invoke_says_when_the_pool_did_not_answer() -> None:
    """The client retried the acquire until its deadline: a non-retryable AcquireFailed with no
    lease in it (the workflow looks the request up, then fails over)."""
    roster = _Roster(reply=None)

    async def invoke(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no lease: nothing may be sent to an agent")

    acts = _activities(roster, invoke)
    try:
        with pytest.raises(ApplicationError) as caught:
            await ActivityEnvironment().run(acts.lease_and_invoke, _input())
    finally:
        acts._restore()  # type: ignore[attr-defined]
    assert caught.value.type == ACQUIRE_FAILED and caught.value.non_retryable and not caught.value.details
    assert "no answer from pool p" in caught.value.message


async def test_lease_and_invoke_fails_over_when_a_renewal_finds_the_lease_ended() -> None:
    roster = _Roster(reply=AcquireReply(lease=_lease()), renew_fails=True)

    async def invoke(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(30)  # the agent hangs: only the renewal can end this

    acts = _activities(roster, invoke)
    try:
        with pytest.raises(ApplicationError) as caught:
            await asyncio.wait_for(ActivityEnvironment().run(acts.lease_and_invoke, _input()), timeout=10)
    finally:
        acts._restore()  # type: ignore[attr-defined]
    assert caught.value.type == LEASE_LOST and roster.renewed == 1
    failure = LeaseInvokeFailure.model_validate(caught.value.details[0])
    assert failure.lease.lease_id == "l" * 32
    assert roster.released == [] and roster.later == []  # ended by the pool: nothing to release


async def test_lease_and_invoke_renews_while_the_task_runs_and_releases_after() -> None:
    roster = _Roster(reply=AcquireReply(lease=_lease()))

    async def invoke(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(2.5)  # past two renewals of a 3 s lease
        return {"value": 2.0}

    acts = _activities(roster, invoke)
    try:
        outcome = await ActivityEnvironment().run(acts.lease_and_invoke, _input())
    finally:
        acts._restore()  # type: ignore[attr-defined]
    assert outcome.output == {"value": 2.0} and outcome.lease is not None
    # The activity completes first and hands the lease to `AgentRoster.release_later` with the
    # worker's linger (what that does with it, riding on the next acquire or going alone, is
    # tested against a server in test_release_piggyback.py).
    assert roster.renewed == 2 and roster.released == [] and roster.later == [("l" * 32, 0.05)]
    assert roster.outcomes == ["succeeded"]  # the release says how the task went
