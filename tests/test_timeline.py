"""What operators read offline: `describe`'s text, replayed histories, `agents` queries, status rows.

No server, no worker: the recorded histories in `tests/histories/`. `describe`'s text is
formatted from the agent workflow's own status (here: the results recorded runs returned,
which is what `AgentRoster.describe` reads for an ended agent).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHistory

from agentroster.messages import AgentSnapshot, CapabilityDigest
from agentroster.models import AgentRegistration, AgentState, AgentStatus, Capability, PoolAgentRow
import agentroster.core.lifecycle as lifecycle
from agentroster.core.lifecycle import AgentLifecycle
from agentroster.core.pool import RECENTLY_ENDED_KEPT, PoolCore, PoolCoreState
from agentroster.core.state_codec import decode_state, encode_state
from agentroster.ops.replay import event_id_from_error, load_history_file, make_replayer, replay_history
from agentroster.ops.timeline import decode_payload, format_status
from agentroster.ops.inspect import AgentListing, agents_query, keep_listing
from agentroster.ops.status_table import ended_rows, live_row

HISTORIES = Path(__file__).parent / "histories"
# The recorded agent's last run (how many runs it took depends on the recording's timing).
LAST_CAN_RUN = max(HISTORIES.glob("agent_continue_as_new_run*.json"), key=lambda p: int(p.stem.rsplit("run", 1)[1])).name
REPO = Path(__file__).resolve().parent.parent
S = AgentState


def recorded_result(name: str) -> AgentStatus:
    """What the recorded run returned when it ended (the last event's result)."""
    history = WorkflowHistory.from_json("x", json.loads((HISTORIES / name).read_text()))
    last = history.events[-1]
    return AgentStatus.model_validate(decode_payload(last.workflow_execution_completed_event_attributes.result.payloads[0]))


# ------------------------------------------------------------------ describe
def test_the_result_of_the_last_run_holds_the_whole_life_across_continue_as_new() -> None:
    """Several runs (continue-as-new every 4 signals): the last run's result still starts at Spawning."""
    status = recorded_result(LAST_CAN_RUN)
    steps = [(t.from_state, t.to_state) for t in status.transitions]
    assert steps[:3] == [(None, S.SPAWNING), (S.SPAWNING, S.REGISTERING), (S.REGISTERING, S.READY)]
    assert steps[-2:] == [(S.READY, S.DRAINING), (S.DRAINING, S.TERMINATED)]
    assert status.busy_flips == 1 and [t.to_state for t in status.recent_load_flips] == [S.BUSY, S.READY]

    text = format_status(status, now=status.transitions[-1].at + timedelta(minutes=5))
    lines = text.splitlines()
    assert lines[0] == "agent agent-chatty in pool agents-can: Terminated (drain)"
    assert "deployment search-agent at http://127.0.0.1:9; capabilities rag.search@2.1.0" in lines
    assert any(line.endswith("start -> Spawning (workflow started)") for line in lines)
    assert any(line.endswith("Ready -> Busy (saturated (1 in flight))") for line in lines)
    assert lines[-1].endswith("Draining -> Terminated (drain)")
    assert "load turned it Busy 1 time(s)" in text and "lease(s) in flight" not in text  # ended: the pool's count no longer matters
    times = [line[:23] for line in lines if line[:2] == "20"]
    assert len(times) == 9 and times == sorted(times)


def test_a_dead_agent_with_a_lease_in_flight() -> None:
    status = recorded_result("agent_lost_with_lease.json")
    assert (status.transitions[-1].from_state, status.transitions[-1].reason) == (S.BUSY, "heartbeat_lost")
    text = format_status(status, now=status.transitions[-1].at)
    assert text.splitlines()[0] == "agent agent-gone in pool timeline-lost: Terminated (heartbeat_lost)"
    assert "heartbeat every 1s, the last at " in text and text.splitlines()[-1].endswith("Busy -> Terminated (heartbeat_lost)")


def test_where_the_log_left_transitions_out_is_shown() -> None:
    """An agent that re-registers in a loop: the first steps, a line for the gap, the newest."""
    life = AgentLifecycle(agent_id="a1", pool="p")
    t0 = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)
    life.spawn(t0)
    reg = AgentRegistration(agent_id="a1", deployment="d", endpoint="http://127.0.0.1:9", capabilities=[Capability(name="rag.search", version="2.1.0")])
    for i in range(40):
        life.register(reg, t0 + timedelta(seconds=i))
        life.indexed(t0 + timedelta(seconds=i, milliseconds=500))
    status = life.status()
    assert status.transitions_dropped == 1 + 80 - lifecycle.RECENT_TRANSITIONS_KEPT
    lines = format_status(status, now=t0 + timedelta(minutes=1)).splitlines()
    gap = next(i for i, line in enumerate(lines) if "left out of the agent's log" in line)
    assert f"... {status.transitions_dropped} transition(s) left out" in lines[gap]
    assert lines[gap - 1].endswith("Registering -> Ready (indexed by pool)") and lines[gap - 1] < lines[gap + 1]  # by time
    assert "1 lease(s) in flight" not in lines and "0 lease(s) in flight; not yet indexed by its pool" in lines


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


def delete_pod_event(path: Path) -> tuple[int, int]:
    """The id of the `delete_pod` ActivityTaskScheduled event, and of the WorkflowTaskCompleted before it."""
    task = 0
    for event in json.loads(path.read_text())["events"]:
        attrs = event.get("activityTaskScheduledEventAttributes")
        if attrs and attrs["activityType"]["name"] == "delete_pod":
            return int(event["eventId"]), task
        if event["eventType"] == "EVENT_TYPE_WORKFLOW_TASK_COMPLETED":
            task = int(event["eventId"])
    raise AssertionError(f"{path.name} deletes no pod")


async def test_replay_reports_the_diverging_event(tmp_path: Path) -> None:
    path = HISTORIES / LAST_CAN_RUN
    replayer = make_replayer()
    good = await replay_history(load_history_file(path), replayer=replayer)
    assert good.ok and good.event_id is None
    bad = await replay_history(load_history_file(tampered(path, tmp_path)), replayer=replayer)
    assert not bad.ok and bad.error_type == "NondeterminismError"
    event_id, task_id = delete_pod_event(path)
    assert (bad.event_id, bad.found_by, bad.task_event_id) == (event_id, "bisection", task_id)
    assert any(line.startswith(f"  >> #{event_id} ActivityTaskScheduled activity delete_pod_v2") for line in bad.context)


def test_event_ids_named_by_core() -> None:
    assert event_id_from_error("No command scheduled for event HistoryEvent(id: 40, TimerCanceled)") == 40
    assert event_id_from_error("History is out of order. Last processed event: 15, event id: 17") == 17
    assert event_id_from_error("Activity type of scheduled event 'x' does not match") is None


def test_a_file_that_is_not_a_history_is_refused(tmp_path: Path) -> None:
    from agentroster.ops.replay import HistoryFileError

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
    assert report["ok"] is False and report["event_id"] == delete_pod_event(HISTORIES / "agent_lost_with_lease.json")[0]
    assert "delete_pod_v2" in report["error"]
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
