"""Reading an agent's life from history alone, replaying histories, and the status table's rows.

Offline: the recorded histories in `tests/histories/` (no server, no worker).
The strongest check: the transitions `agentroster.timeline` reconstructs from
events (search attribute upserts, signals, activity inputs) are exactly the
ones the workflow itself recorded in its final result, reasons and times
included, for every recorded agent history.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHistory

from agentroster.contracts import AgentRegistration, AgentSnapshot, AgentState, AgentStatus, Capability, CapabilityDigest, PoolAgentRow
from agentroster.core.pool import RECENTLY_ENDED_KEPT, PoolCore, PoolCoreState
from agentroster.core.state_codec import decode_state, encode_state
from agentroster.replay import event_id_from_error, load_history_file, make_replayer, replay_history
from agentroster.timeline import AgentTimeline, build_timeline, decode_payload, format_timeline
from agentroster.workers.inspect_cli import AgentListing, agents_query, keep_listing
from agentroster.workers.status_table import ended_rows, live_row

HISTORIES = Path(__file__).parent / "histories"
REPO = Path(__file__).resolve().parent.parent
S = AgentState

AGENT_LIVES = {
    "agent_register_lease_drain": ["agent_register_lease_drain.json"],
    "agent_heartbeat_lost": ["agent_heartbeat_lost.json"],
    "agent_continue_as_new": [f"agent_continue_as_new_run{i}.json" for i in (1, 2, 3)],
    "agent_timeline": [f"agent_timeline_run{i}.json" for i in (1, 2, 3)],
    "agent_lost_with_lease": ["agent_lost_with_lease.json"],
    # The `agent-2026-12` patch: only changed search attributes upserted.
    "agent_current_register": ["agent_current_register.json"],
    "agent_current_plain": [f"agent_current_plain_run{i}.json" for i in (1, 2, 3)],
}


def runs_of(files: list[str]) -> list[tuple[str, list[Any]]]:
    out = []
    for name in files:
        history = WorkflowHistory.from_json("x", json.loads((HISTORIES / name).read_text()))
        out.append((name, list(history.events)))
    return out


def timeline_of(life: str) -> AgentTimeline:
    return build_timeline(runs_of(AGENT_LIVES[life]))


def final_status(files: list[str]) -> dict[str, Any]:
    last = runs_of(files)[-1][1][-1]
    return decode_payload(last.workflow_execution_completed_event_attributes.result.payloads[0])


@pytest.mark.parametrize("life", sorted(AGENT_LIVES))
def test_transitions_from_events_are_the_workflows_own(life: str) -> None:
    """Every transition (lifecycle and load flips), its reason and its time, as `status` would have said."""
    timeline = timeline_of(life)
    status = AgentStatus.model_validate(final_status(AGENT_LIVES[life]))
    assert status.transitions_dropped == 0 and status.busy_flips <= len(status.recent_load_flips)
    recorded = sorted([*status.transitions, *status.recent_load_flips], key=lambda t: t.at)
    mine = [(t.from_state, t.to_state, t.reason, t.at) for t in timeline.transitions]
    assert mine == [(t.from_state, t.to_state, t.reason, t.at) for t in recorded]
    assert timeline.state == S.TERMINATED and timeline.end_reason == status.terminated_reason


def test_the_operators_drain_across_continue_as_new_runs() -> None:
    timeline = timeline_of("agent_timeline")
    assert [r.ended for r in timeline.runs] == ["continued as new", "continued as new", "completed"]
    assert timeline.runs[1].continued_from and timeline.runs[2].continued_from
    assert (timeline.agent_id, timeline.pool, timeline.workflow_id) == ("agent-story", "timeline", "agent/timeline/agent-story")
    drain = next(e for e in timeline.entries if e.kind == "drain_requested")
    assert drain.reason == "kernel upgrade (ticket OPS-12)" and drain.run == 3 and drain.details["deadline_s"] == 60.0
    assert drain.details["sender"]  # who sent it (the client's identity)
    draining = next(t for t in timeline.transitions if t.to_state == S.DRAINING)
    assert (draining.from_state, draining.reason) == (S.READY, "kernel upgrade (ticket OPS-12)")
    registrations = [e for e in timeline.entries if e.kind == "registered"]
    assert [e.details["again"] for e in registrations] == [False, True]
    assert registrations[0].details["capabilities"] == ["rag.search@2.1.0"]
    deletion = next(e for e in timeline.entries if e.kind == "pod_deletion")
    assert deletion.text == "delete pod agent-story of story-agent (drain)" and deletion.details["outcome"] == "done"
    told = [e.details["state"] for e in timeline.entries if e.kind == "pool_told"]
    assert told[-2:] == ["Draining", "Terminated"]
    assert sum(r.heartbeats for r in timeline.runs) == 5
    assert not [e for e in timeline.entries if e.kind == "leases_revoked"]

    text = format_timeline(timeline)
    assert "agent agent-story in pool timeline (agent/timeline/agent-story): Terminated (drain); 3 run(s)" in text
    assert "Ready -> Draining (kernel upgrade (ticket OPS-12))" in text
    assert "drain requested: 'kernel upgrade (ticket OPS-12)', deadline 60.0s" in text
    assert "run 2 continued as new from run" in text
    assert "delete pod agent-story of story-agent (drain): done" in text
    assert "tell pool" not in text and "tell pool" in format_timeline(timeline, show_all=True)
    # Lines are in time order.
    times = [line[:24] for line in text.splitlines()[1:] if line[:2] == "20"]
    assert times == sorted(times)


def test_a_dead_agent_with_a_lease_in_flight() -> None:
    timeline = timeline_of("agent_lost_with_lease")
    end = timeline.transitions[-1]
    assert (end.from_state, end.to_state, end.reason) == (S.BUSY, S.TERMINATED, "heartbeat_lost")
    assert end.details["in_flight"] == 1 and end.details["silent_s"] >= 3.0  # 3 missed 1 s heartbeats
    revoked = next(e for e in timeline.entries if e.kind == "leases_revoked")
    assert revoked.details["leases"] == 1
    text = format_timeline(timeline)
    assert "Busy -> Terminated (heartbeat_lost), last heartbeat" in text
    assert "1 lease(s) in flight when it ended" in text
    assert "delete pod agent-gone of gone-agent (heartbeat_lost): done" in text


def test_histories_from_before_the_ui_metadata_still_read() -> None:
    """No summaries, no AgentEndReason: the end reason comes from the activities and the result."""
    timeline = timeline_of("agent_heartbeat_lost")
    assert timeline.end_reason == "heartbeat_lost"
    deletion = next(e for e in timeline.entries if e.kind == "pod_deletion")
    assert deletion.text == "delete pod agent-silent of search-agent (heartbeat_lost)"


def test_runs_given_in_any_order_are_read_oldest_first() -> None:
    runs = runs_of(AGENT_LIVES["agent_timeline"])
    assert build_timeline(list(reversed(runs))).model_dump() == build_timeline(runs).model_dump()


def test_a_second_life_with_the_same_id_starts_from_spawning() -> None:
    """An agent that ended and registered again: a new workflow (not continue-as-new), a new life."""
    first = runs_of(AGENT_LIVES["agent_register_lease_drain"])
    second = runs_of(AGENT_LIVES["agent_heartbeat_lost"])  # started later, no continued_execution_run_id
    timeline = build_timeline([*first, *second])
    spawns = [t for t in timeline.transitions if t.to_state == S.SPAWNING]
    assert [t.from_state for t in spawns] == [None, None]
    assert timeline.end_reason == "heartbeat_lost"


def test_a_busy_flip_folded_into_indexing_is_filled_in() -> None:
    """`indexed` may go Registering -> Ready -> Busy in one upsert: the Ready step is put back."""
    events = copy.deepcopy(json.loads((HISTORIES / "agent_register_lease_drain.json").read_text()))
    upserts = [e for e in events["events"] if e["eventType"] == "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"]
    ready = upserts[2]["upsertWorkflowSearchAttributesEventAttributes"]["searchAttributes"]["indexedFields"]["AgentState"]
    assert json.loads(base64.b64decode(ready["data"])) == "Ready"
    ready["data"] = base64.b64encode(b'"Busy"').decode()
    timeline = build_timeline([("r", list(WorkflowHistory.from_json("x", events).events))])
    steps = [(t.from_state, t.to_state) for t in timeline.transitions][:5]
    assert steps[2:4] == [(S.REGISTERING, S.READY), (S.READY, S.BUSY)]


def test_folded_load_flips_in_text() -> None:
    timeline = timeline_of("agent_register_lease_drain")
    flip = next(t for t in timeline.transitions if t.load_flip)
    many = timeline.model_copy(deep=True)
    index = many.entries.index(next(e for e in many.entries if e.load_flip))
    many.entries[index + 1 : index + 1] = [flip.model_copy(update={"event_id": 1000 + i}) for i in range(6)]
    assert "8 load flips Ready <-> Busy (7 times saturated)" in format_timeline(many)  # the 2 recorded + 6
    assert "load flips" not in format_timeline(timeline)  # 2 in a row are listed
    assert "8 load flips" not in format_timeline(many, show_all=True)


# ------------------------------------------------------------------ replay
def tampered(path: Path, tmp_path: Path) -> Path:
    history = json.loads(path.read_text())
    for event in history["events"]:
        attrs = event.get("activityTaskScheduledEventAttributes")
        if attrs and attrs["activityType"]["name"] == "delete_pod":
            attrs["activityType"]["name"] = "delete_pod_v2"
    out = tmp_path / "tampered.json"
    out.write_text(json.dumps(history))
    return out


async def test_replay_reports_the_diverging_event(tmp_path: Path) -> None:
    replayer = make_replayer()
    good = await replay_history(load_history_file(HISTORIES / "agent_timeline_run3.json"), replayer=replayer)
    assert good.ok and good.event_id is None
    bad = await replay_history(load_history_file(tampered(HISTORIES / "agent_timeline_run3.json", tmp_path)), replayer=replayer)
    assert not bad.ok and bad.error_type == "NondeterminismError"
    assert bad.event_id == 35 and bad.found_by == "bisection" and bad.task_event_id == 34
    assert any(line.startswith("  >> #35 ActivityTaskScheduled activity delete_pod_v2") for line in bad.context)


def test_event_ids_named_by_core() -> None:
    assert event_id_from_error("No command scheduled for event HistoryEvent(id: 40, TimerCanceled)") == 40
    assert event_id_from_error("History is out of order. Last processed event: 15, event id: 17") == 17
    assert event_id_from_error("Activity type of scheduled event 'x' does not match") is None


def test_a_file_that_is_not_a_history_is_refused(tmp_path: Path) -> None:
    from agentroster.replay import HistoryFileError

    (tmp_path / "a.json").write_text('{"events": [{"eventId": "1", "eventType": "EVENT_TYPE_TIMER_FIRED"}]}')
    with pytest.raises(HistoryFileError, match="not WorkflowExecutionStarted"):
        load_history_file(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("nope")
    with pytest.raises(HistoryFileError, match="cannot read a JSON history"):
        load_history_file(tmp_path / "b.json")


async def run_cli(*args: str, timeout: float = 180) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", *args, cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_replay_command_on_files(tmp_path: Path) -> None:
    """As a user runs it, on a UI-style download (a history without workflow ids) and a tampered one."""
    code, out, err = await run_cli("replay", str(HISTORIES / "task_success.json"))
    assert code == 0, out + err
    assert "replayed cleanly" in out
    code, out, err = await run_cli("replay", str(tampered(HISTORIES / "agent_lost_with_lease.json", tmp_path)), "--json")
    assert code == 1, out + err
    report = json.loads(out)
    assert report["ok"] is False and report["event_id"] == 41 and "delete_pod_v2" in report["error"]
    code, _, err = await run_cli("replay", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in err


# ------------------------------------------------------------------ agents
def test_agents_query() -> None:
    q = agents_query("prod", state="Ready", capability="rag.search", deployment="search-agent")
    assert q.query == (
        'WorkflowType="AgentWorkflow" AND AgentPool="prod" AND AgentState="Ready" AND AgentDeployment="search-agent" '
        'AND AgentCapabilities="rag.search" AND ExecutionStatus="Running"'
    )
    assert q.ref is None
    exact = agents_query("prod", capability="rag.search@2.1.0")
    assert 'AgentCapabilities="rag.search@2.1.0"' in exact.query and exact.ref is None
    ranged = agents_query("prod", capability="rag.search@>=2,<3", ended=True)
    assert 'AgentCapabilities="rag.search"' in ranged.query and "ExecutionStatus" not in ranged.query
    assert "ExecutionStatus" not in agents_query("prod", state="Terminated").query
    listing = AgentListing("a", "d", "Ready", ["rag.search@2.1.0"], "Running", None, None, None, "agent/prod/a", "r")
    assert keep_listing(listing, ranged.ref)
    assert not keep_listing(listing, agents_query("prod", capability="rag.search@>=3").ref)
    with pytest.raises(ValueError):
        agents_query("prod", capability="not a name")
    with pytest.raises(ValueError):
        agents_query("prod", state="Sleeping")


# ------------------------------------------------------------------ status rows
NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=timezone.utc)


def described(state: AgentState, beat_s_ago: float, interval: float = 10.0, **more: Any) -> AgentStatus:
    reg = AgentRegistration(
        agent_id="a1",
        deployment="d",
        endpoint="http://127.0.0.1:9",
        heartbeat_interval_s=interval,
        capabilities=[Capability(name="rag.search", version="2.1.0")],
    )
    return AgentStatus(agent_id="a1", pool="p", state=state, registration=reg, last_heartbeat=NOW - timedelta(seconds=beat_s_ago), **more)


def pool_row(state: AgentState = S.READY, **more: Any) -> PoolAgentRow:
    return PoolAgentRow(agent_id="a1", deployment="d", state=state, in_flight=0, capabilities=["rag.search@2.1.0"], **more)


def test_a_silent_agent_is_not_shown_ready() -> None:
    assert live_row(pool_row(), described(S.READY, 3.0), NOW)[3] == "Ready"
    row = live_row(pool_row(), described(S.READY, 25.0), NOW)
    assert row[3] == "silent 25s" and row[5] == "25.0s ago"
    assert "Ready in the pool; declared lost after 30s" in row[6]
    ended = live_row(pool_row(), described(S.TERMINATED, 31.0, terminated_reason="heartbeat_lost"), NOW)
    assert ended[3] == "Terminated" and "ended: heartbeat_lost" in ended[6]
    # Draining agents do not heartbeat for their liveness: never "silent".
    draining = live_row(pool_row(S.DRAINING, drain_reason="kernel upgrade"), described(S.DRAINING, 100.0), NOW)
    assert draining[3] == "Draining" and draining[6] == "draining: kernel upgrade"


def snap(agent_id: str, state: AgentState = S.READY, reason: str = "") -> AgentSnapshot:
    return AgentSnapshot(
        agent_id=agent_id,
        deployment="search",
        endpoint="http://127.0.0.1:9",
        state=state,
        reason=reason,
        capabilities=[CapabilityDigest(name="rag.search", version="2.1.0", max_concurrency=2, cost_class="A")],
        resync_interval_s=30,
    )


def test_the_pool_keeps_recently_ended_agents_and_drain_reasons() -> None:
    ids = iter(range(10**6))
    new_id = lambda: f"id{next(ids)}"  # noqa: E731
    core = PoolCore("p", epoch="e")
    core.verify_new_agents = False
    t0 = NOW.timestamp()
    for name in ("a1", "a2"):
        core.agent_snapshot(snap(name), t0, new_id)
    core.agent_snapshot(snap("a1", S.DRAINING, "kernel upgrade"), t0 + 1, new_id)
    assert {a.agent_id: a.drain_reason for a in core.status().agents} == {"a1": "kernel upgrade", "a2": None}
    core.agent_snapshot(snap("a1", S.TERMINATED, "drain"), t0 + 2, new_id)
    core.agent_snapshot(snap("a2", S.TERMINATED, "heartbeat_lost"), t0 + 3, new_id)
    core.agent_snapshot(snap("a2", S.TERMINATED, "heartbeat_lost"), t0 + 4, new_id)  # told twice: one row
    core.agent_snapshot(snap("ghost", S.TERMINATED, "forged"), t0 + 5, new_id)  # never indexed: no row
    ended = core.status().recently_ended
    assert [(e.agent_id, e.reason, e.drain_reason) for e in ended] == [("a1", "drain", "kernel upgrade"), ("a2", "heartbeat_lost", None)]
    assert ended[0].ended_at == NOW + timedelta(seconds=2) and ended[0].capabilities == ["rag.search@2.1.0"]

    # Carried across continue-as-new (packed), and state from older runs (no such keys) still reads.
    again = PoolCore.from_state(decode_state(encode_state(core.to_state())))
    assert again.status().recently_ended == ended
    old = core.to_state().model_dump(mode="json")
    del old["recently_ended"], old["drain_reasons"]
    assert PoolCore.from_state(PoolCoreState.model_validate(old)).status().recently_ended == []

    # Bounded.
    for i in range(RECENTLY_ENDED_KEPT + 5):
        core.agent_snapshot(snap(f"b{i}"), t0 + 10, new_id)
        core.agent_snapshot(snap(f"b{i}", S.TERMINATED, "drain"), t0 + 11, new_id)
    assert len(core.status().recently_ended) == RECENTLY_ENDED_KEPT

    # The status table: newest first, within the window, not those back in the pool.
    status = core.status()
    rows = ended_rows(status, NOW + timedelta(seconds=60))
    assert rows[0][0] == f"b{RECENTLY_ENDED_KEPT + 4}" and rows[0][3] == "Terminated" and rows[0][6] == "ended 49s ago: drain"
    assert ended_rows(status, NOW + timedelta(hours=2)) == []


def test_status_row_text_for_a_drained_agent() -> None:
    core = PoolCore("p", epoch="e")
    core.verify_new_agents = False
    new_id = iter(f"id{i}" for i in range(100)).__next__
    t0 = NOW.timestamp()
    core.agent_snapshot(snap("a1"), t0, new_id)
    core.agent_snapshot(snap("a1", S.DRAINING, "kernel upgrade"), t0, new_id)
    core.agent_snapshot(snap("a1", S.TERMINATED, "drain"), t0 + 1, new_id)
    assert ended_rows(core.status(), NOW + timedelta(seconds=121))[0][6] == "ended 2m ago: drain (kernel upgrade)"


def test_messages_queued_before_a_task_are_applied_in_order() -> None:
    """Two registrations (and a load notice) delivered before the workflow's first task: the first
    transition is the first registration's (`registered`), not the last one's."""
    history = json.loads((HISTORIES / "agent_register_lease_drain.json").read_text())
    events = history["events"]
    register = events[1]
    assert register["workflowExecutionSignaledEventAttributes"]["signalName"] == "register"
    events.insert(2, {**copy.deepcopy(register), "eventId": "1002"})
    timeline = build_timeline([("r", list(WorkflowHistory.from_json("x", history).events))])
    assert timeline.transitions[1].reason == "registered"
    assert [e.details["again"] for e in timeline.entries if e.kind == "registered"] == [False, True]
    # A refused registration (another agent's id) never reaches the workflow's inbox.
    other = copy.deepcopy(register)
    payload = other["workflowExecutionSignaledEventAttributes"]["input"]["payloads"][0]
    reg = json.loads(base64.b64decode(payload["data"]))
    payload["data"] = base64.b64encode(json.dumps({**reg, "agent_id": "someone-else"}).encode()).decode()
    events[2] = {**other, "eventId": "1002"}
    timeline = build_timeline([("r", list(WorkflowHistory.from_json("x", history).events))])
    refused = [e for e in timeline.entries if e.kind == "registered"][1]
    assert refused.details["refused"] and refused.text.startswith("refused registration")


def test_without_any_word_on_why_a_liveness_timer_means_heartbeat_lost() -> None:
    """A history cut short after the Terminated upsert (no AgentEndReason, no activity, no result)."""
    history = json.loads((HISTORIES / "agent_heartbeat_lost.json").read_text())
    events = history["events"]
    terminated = next(
        i for i, e in enumerate(events)
        if e["eventType"] == "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"
        and b"Terminated" in base64.b64decode(e["upsertWorkflowSearchAttributesEventAttributes"]["searchAttributes"]["indexedFields"]["AgentState"]["data"])
    )  # fmt: skip
    history["events"] = events[: terminated + 1]
    timeline = build_timeline([("r", list(WorkflowHistory.from_json("x", history).events))])
    assert timeline.transitions[-1].reason == "heartbeat_lost" and timeline.runs[0].ended == "running"
