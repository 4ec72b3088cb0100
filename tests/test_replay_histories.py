"""Replay every recorded history in `tests/histories/` against the current workflow code.

A change to AgentWorkflow, PoolWorkflow or CapabilityTaskWorkflow that issues other
commands than a recorded run (a command added, removed or reordered) fails here.
Offline: no server is started. tests/histories/README.md says what to do then
(0.x: re-record; from the first release on: version the change, docs/compatibility.md).
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from agentroster.workflows import workflow_classes, workflow_runner

HISTORIES = Path(__file__).parent / "histories"
FILES = sorted(HISTORIES.glob("*.json"))
# For an exported history whose first event lacks the workflow id (older servers): replay does not depend on it.
PLACEHOLDER_ID = "replayed-workflow"


def replayer() -> Replayer:
    """Exactly the worker's settings: its workflows, its sandbox, its data converter."""
    return Replayer(workflows=workflow_classes(), workflow_runner=workflow_runner(), data_converter=pydantic_data_converter)


def started(history: dict[str, Any]) -> dict[str, Any]:
    first = history["events"][0]
    attributes = first.get("workflowExecutionStartedEventAttributes")
    assert attributes is not None, "a history must begin with its WorkflowExecutionStarted event"
    return attributes


def load(path: Path) -> tuple[str, dict[str, Any]]:
    """The workflow id (from the first event, where the server recorded it) and the parsed history."""
    history = json.loads(path.read_text())
    return started(history).get("workflowId") or PLACEHOLDER_ID, history


def test_the_recorded_histories_are_there() -> None:
    """Deleting the histories must not turn the replay tests into a silent pass."""
    assert len(FILES) >= 6, f"expected at least 6 recorded histories in {HISTORIES}, found {[p.name for p in FILES]}"
    types = {started(load(path)[1])["workflowType"]["name"] for path in FILES}
    assert types >= {"AgentWorkflow", "PoolWorkflow", "CapabilityTaskWorkflow"}, types
    events = [e["eventType"] for path in FILES for e in load(path)[1]["events"]]
    # Continue-as-new is where workflow changes break most easily: keep both sides of it.
    assert "EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW" in events
    assert any(started(load(path)[1]).get("continuedExecutionRunId") for path in FILES)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
async def test_history_replays(path: Path) -> None:
    workflow_id, history = load(path)
    result = await replayer().replay_workflow(WorkflowHistory.from_json(workflow_id, history))
    assert result.replay_failure is None


async def test_replay_is_strict_a_changed_command_is_nondeterminism() -> None:
    """The net catches what it should: the same history with one scheduled activity
    renamed (as if the code now called another activity there) fails to replay."""
    workflow_id, history = load(HISTORIES / "task_success.json")
    changed = copy.deepcopy(history)
    scheduled = [e for e in changed["events"] if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"]
    assert scheduled, "task_success.json schedules activities"
    activity_type = scheduled[0]["activityTaskScheduledEventAttributes"]["activityType"]
    assert activity_type["name"] == "lease_and_invoke"
    activity_type["name"] = "lease_and_invoke_v2"

    await replayer().replay_workflow(WorkflowHistory.from_json(workflow_id, history))  # the original still replays
    with pytest.raises(NondeterminismError, match="does not match activity type"):
        await replayer().replay_workflow(WorkflowHistory.from_json(workflow_id, changed))


def test_an_agent_run_upserts_only_the_search_attributes_that_change() -> None:
    """Every upsert is a billed action: `register`'s start attributes leave the first task
    nothing to upsert, then AgentState alone at each change (Ready, Busy, Ready, Draining,
    Terminated with its AgentEndReason). No patch marker, so no TemporalChangeVersion either."""
    history = load(HISTORIES / "agent_register_lease_drain.json")[1]
    assert _patch_ids(history) == set()
    upserts = [
        set(event["upsertWorkflowSearchAttributesEventAttributes"]["searchAttributes"]["indexedFields"])
        for event in history["events"]
        if event["eventType"] == "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"
    ]
    assert upserts[:-1] == [{"AgentState"}] * 4 and upserts[-1] == {"AgentState", "AgentEndReason"}, upserts


def test_pool_and_task_runs_record_no_patch_marker() -> None:
    """Nothing is released yet: the pool and task workflows carry no `workflow.patched`."""
    for path in FILES:
        history = load(path)[1]
        if started(history)["workflowType"]["name"] in ("PoolWorkflow", "CapabilityTaskWorkflow"):
            assert _patch_ids(history) == set(), path.name


def test_a_task_attempt_is_one_activity() -> None:
    """A lease reaches a task by one road: each attempt is one `lease_and_invoke`, granted at once or from the queue."""
    for name, attempts in (("task_success", 1), ("task_queued_grant", 1), ("task_failover", 2)):
        history = load(HISTORIES / f"{name}.json")[1]
        names = [
            e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
            for e in history["events"]
            if e["eventType"] == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED"
        ]
        assert names == ["lease_and_invoke"] * attempts, (name, names)
        assert not [e for e in history["events"] if e["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED"], name


def _patch_payload(event: dict[str, Any]) -> dict[str, Any] | None:
    """The payload of a `workflow.patched` marker: JSON {"id": ..., "deprecated": ...}."""
    if event["eventType"] != "EVENT_TYPE_MARKER_RECORDED":
        return None
    attributes = event["markerRecordedEventAttributes"]
    if attributes.get("markerName") != "core_patch":
        return None
    return attributes["details"]["patch-data"]["payloads"][0]


def _patch_data(event: dict[str, Any]) -> dict[str, Any] | None:
    payload = _patch_payload(event)
    return json.loads(base64.b64decode(payload["data"])) if payload else None


def _set_patch_data(event: dict[str, Any], data: dict[str, Any]) -> None:
    payload = _patch_payload(event)
    assert payload is not None
    payload["data"] = base64.b64encode(json.dumps(data).encode()).decode()


def _patch_ids(history: dict[str, Any]) -> set[str]:
    return {data["id"] for event in history["events"] if (data := _patch_data(event)) is not None}
