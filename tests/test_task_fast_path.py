"""CapabilityTaskWorkflow's fast path (patch `lease-fast-path`): what a run does and that it stays correct.

A run that starts with the patch asks for its lease in a local activity, and its
invoke activity (`invoke_and_release`) releases the lease once the output is
checked; the workflow releases (the `release_lease` activity) only when that did
not happen. The end-to-end tests here read the run's history to show which path
ran. New runs take the one-activity path (test_task_one_activity.py), so these
start runs as they were started before (an input without `protocol`) on a worker
that leaves the `lease-in-invoke` patch off, as a replay of a run started before it does.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from agentroster.activities.roster import RosterActivities
from agentroster.contracts import Capability, InvokeInput, InvokeOutcome, Lease, TaskInput, TaskResult
from agentroster.workflows.task import FAST_PATH_PATCH, ONE_ACTIVITY_PATCH, RENEWAL_PATCH
from tests.conftest import eventually
from tests.test_supervisor import INPUT_SCHEMA, OUTPUT_SCHEMA, _registration, endpoints  # noqa: F401 (a fixture)
from tests.test_task_one_activity import _waiting


@pytest.fixture
async def stack(stack: Any) -> Any:
    """The shared stack, its worker leaving the one-activity patch off: runs take the fast path."""
    await stack.stop_worker()
    await stack.start_worker(patch_activation_callback=lambda input: input.patch_id != ONE_ACTIVITY_PATCH)
    return stack


async def _start(stack: Any, payload: Any, **options: Any) -> WorkflowHandle[Any, TaskResult]:
    return await stack.env.client.start_workflow(
        "CapabilityTaskWorkflow",
        # Written as inputs were before `protocol` existed: the run decides its path by patch markers.
        TaskInput(ref="math.eval@>=1,<2", payload=payload, pool=stack.pool, **{"acquire_timeout_s": 5, **options}).model_dump(
            mode="json", exclude={"protocol"}
        ),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
        result_type=TaskResult,
    )


async def _shape(handle: WorkflowHandle[Any, Any]) -> dict[str, Any]:
    """What the run did: its patch markers, local activities and activities, in order."""
    patches: list[str] = []
    local: int = 0
    activities: list[str] = []
    for event in (await handle.fetch_history()).events:
        kind = event.WhichOneof("attributes")
        if kind == "marker_recorded_event_attributes":
            marker = event.marker_recorded_event_attributes
            if marker.marker_name == "core_patch":
                patches.append(json.loads(marker.details["patch-data"].payloads[0].data)["id"])
            elif marker.marker_name == "core_local_activity":
                local += 1
        elif kind == "activity_task_scheduled_event_attributes":
            activities.append(event.activity_task_scheduled_event_attributes.activity_type.name)
    return {"patches": patches, "local_activities": local, "activities": activities}


async def _status(stack: Any) -> Any:
    return await stack.roster.status()


async def test_a_task_takes_the_fast_path_and_its_invoke_releases_the_lease(stack, endpoints) -> None:
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-fast", url, "A"))
    handle = await _start(stack, {"expression": "2+3"})
    result = await handle.result()
    assert (result.agent_id, result.output, result.attempts) == ("math-fast", {"value": 5.0}, 1)
    # One patch marker (the fast path implies renewal: no second marker), the lease asked
    # for in a local activity, one activity in all: no request_lease, no release_lease.
    assert await _shape(handle) == {"patches": [FAST_PATH_PATCH], "local_activities": 1, "activities": ["invoke_and_release"]}
    status = await _status(stack)
    assert status.active_leases == 0 and status.leases_released == 1


async def test_the_lease_is_released_when_the_invoke_fails(stack, endpoints) -> None:
    """A payload the input schema refuses fails the task (no failover): the workflow releases."""
    agent, url = await endpoints()
    await stack.roster.register(_registration("math-refuses", url, "A"))
    handle = await _start(stack, {"expr": "1+1"})
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert isinstance(caught.value.cause, ApplicationError) and caught.value.cause.type == "InvalidTaskInput"
    assert agent.requests == []
    assert (await _shape(handle))["activities"] == ["invoke_and_release", "release_lease"]
    status = await _status(stack)
    assert status.active_leases == 0 and status.leases_released == 1


async def test_every_lease_of_a_failover_is_released(stack, endpoints) -> None:
    """The first agent's output breaks its schema (failover, the workflow releases that
    lease); the second agent answers (its invoke releases)."""
    _, liar_url = await endpoints("bad-output")
    _, good_url = await endpoints()
    await stack.roster.register(_registration("math-liar", liar_url, "A"))
    await stack.roster.register(_registration("math-honest", good_url, "C"))
    handle = await _start(stack, {"expression": "40+2"})
    result = await handle.result()
    assert (result.agent_id, result.attempts, result.output) == ("math-honest", 2, {"value": 42.0})
    shape = await _shape(handle)
    assert shape["local_activities"] == 2  # a lease asked for per attempt
    assert shape["activities"] == ["invoke_and_release", "release_lease", "invoke_and_release"]
    status = await _status(stack)
    assert status.active_leases == 0 and status.leases_released == 2


async def test_a_queued_task_still_waits_in_the_workflow_and_gets_its_lease(stack, endpoints) -> None:
    _, url = await endpoints()
    await stack.roster.register(_registration("math-full", url, "A"))
    held = [await stack.roster.acquire("math.eval"), await stack.roster.acquire("math.eval")]  # both slots
    handle = await _start(stack, {"expression": "20+22"}, acquire_timeout_s=30)
    await eventually(lambda: _waiting(stack, 1))

    async def no_pending_activity() -> bool:
        return not (await handle.describe()).raw_description.pending_activities

    await eventually(no_pending_activity)  # the local activity returned a ticket: nothing is held while it waits
    await stack.roster.release(held[0])
    result = await asyncio.wait_for(handle.result(), timeout=20)
    assert (result.agent_id, result.output, result.attempts) == ("math-full", {"value": 42.0}, 1)
    assert await _shape(handle) == {"patches": [FAST_PATH_PATCH], "local_activities": 1, "activities": ["invoke_and_release"]}
    await stack.roster.release(held[1])
    await eventually(lambda: _no_leases(stack))
    assert (await _status(stack)).leases_released == 3


async def test_schemas_are_asked_once_per_agent_capability_and_version(stack, endpoints) -> None:
    _, url = await endpoints()
    await stack.roster.register(_registration("math-cached", url, "A"))
    for expression in ("1+1", "2+2", "3+3"):
        assert (await (await _start(stack, {"expression": expression})).result()).output["value"] > 0
    assert stack.worker._roster_activities.schemas.queries == 1


async def test_a_payload_refused_by_a_cached_schema_is_checked_against_the_current_one(stack, endpoints) -> None:
    """The agent registers again with the same version and a looser input schema: a payload
    the cached schema refuses is checked again against the agent's current one, and runs."""
    _, url = await endpoints()
    await stack.roster.register(_registration("math-loosened", url, "A"))
    assert (await (await _start(stack, {"expression": "1+1"})).result()).output == {"value": 2.0}
    looser = _registration("math-loosened", url, "A")
    loose_schema = {**INPUT_SCHEMA, "additionalProperties": True}
    looser.capabilities = [Capability(**{**looser.capabilities[0].model_dump(), "input_schema": loose_schema, "output_schema": OUTPUT_SCHEMA})]
    await stack.roster.register(looser)
    result = await (await _start(stack, {"expression": "2+2", "note": "allowed now"})).result()
    assert result.output == {"value": 4.0}
    assert stack.worker._roster_activities.schemas.queries == 2


async def test_old_runs_keep_their_path(stack, endpoints) -> None:
    """A worker that leaves the patch off (as replay of an older run does) runs the path before it."""
    _, url = await endpoints()
    await stack.roster.register(_registration("math-old", url, "A"))
    await stack.stop_worker()
    await stack.start_worker(patch_activation_callback=lambda input: input.patch_id not in (FAST_PATH_PATCH, ONE_ACTIVITY_PATCH))
    handle = await _start(stack, {"expression": "5+5"})
    assert (await handle.result()).output == {"value": 10.0}
    assert await _shape(handle) == {
        "patches": [RENEWAL_PATCH],
        "local_activities": 0,
        "activities": ["request_lease", "invoke_agent", "release_lease"],
    }
    assert (await _status(stack)).active_leases == 0


# ------------------------------------------------------------ invoke_and_release alone
class _Roster:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.released: list[str] = []

    async def release(self, lease: Lease) -> None:
        if self.fail:
            raise RuntimeError("the server keeps refusing")
        self.released.append(lease.lease_id)


def _invoke_input() -> InvokeInput:
    lease = Lease.model_validate(
        {
            "lease_id": "l" * 32, "pool": "p", "agent_id": "a", "deployment": "d", "capability": "math.eval",
            "version": "1.2.0", "endpoint": "http://127.0.0.1:9", "granted_at": "2026-01-01T00:00:00Z",
            "deadline": "2026-01-01T00:01:00Z",
        }
    )
    return InvokeInput(lease=lease, payload={"expression": "1+1"})


@pytest.mark.parametrize("fail", [False, True])
async def test_invoke_and_release_says_whether_the_release_reached_the_pool(fail: bool) -> None:
    acts = RosterActivities.__new__(RosterActivities)  # no client needed: the roster and the invoke are stubbed
    roster = _Roster(fail)

    async def invoke_agent(task: InvokeInput) -> Any:
        return {"value": 2.0}

    acts._roster = lambda pool: roster  # type: ignore[method-assign]
    acts.invoke_agent = invoke_agent  # type: ignore[method-assign]
    outcome = await ActivityEnvironment().run(acts.invoke_and_release, _invoke_input())
    assert outcome == InvokeOutcome(output={"value": 2.0}, released=not fail)
    assert roster.released == ([] if fail else ["l" * 32])


async def test_invoke_and_release_releases_nothing_when_the_invoke_fails() -> None:
    acts = RosterActivities.__new__(RosterActivities)
    roster = _Roster(False)

    async def invoke_agent(task: InvokeInput) -> Any:
        raise ApplicationError("agent answered 500", type="AgentTaskFailed", non_retryable=True)

    acts._roster = lambda pool: roster  # type: ignore[method-assign]
    acts.invoke_agent = invoke_agent  # type: ignore[method-assign]
    with pytest.raises(ApplicationError):
        await ActivityEnvironment().run(acts.invoke_and_release, _invoke_input())
    assert roster.released == []  # the workflow releases, with its retried activity


async def _no_leases(stack: Any) -> bool:
    return (await stack.roster.status()).active_leases == 0


def test_the_fast_path_has_a_recorded_history() -> None:
    """tests/histories/ holds runs that took the fast path (replayed by test_replay_histories.py)."""
    from tests.test_replay_histories import FILES, _patch_data, load

    fast = [p.name for p in FILES if any((d := _patch_data(e)) and d["id"] == FAST_PATH_PATCH for e in load(p)[1]["events"])]
    assert fast, "record the fast path: python tests/histories/record.py tasks_fast_path"
