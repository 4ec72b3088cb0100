"""Text for operators: an agent's status as `agentroster describe` prints it, and one line per
history event as `agentroster replay` prints them.

`describe` reads what the agent workflow records itself (its `status` query while it
runs, the run's result once it has ended: `AgentRoster.describe`); nothing here reads
the agent's life from history.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from agentroster.models import AgentState, AgentStatus, Transition
from agentroster.core.lifecycle import FIRST_TRANSITIONS_KEPT


# ------------------------------------------------------------------ describe
def format_status(status: AgentStatus, now: datetime) -> str:
    """The agent as lines an operator reads: what it is, then its transitions in time order.

    The lifecycle log and the newest load flips (Ready <-> Busy) are merged by time;
    a line says where the workflow left transitions out of its bounded log.
    """
    head = f"agent {status.agent_id} in pool {status.pool}: {status.state.value}"
    if status.terminated_reason:
        head += f" ({status.terminated_reason})"
    lines = [head]
    reg = status.registration
    if reg is not None:
        caps = ", ".join(f"{c.name}@{c.version}" for c in reg.capabilities)
        lines.append(f"deployment {reg.deployment} at {reg.endpoint}; capabilities {caps}")
        beat = f"heartbeat every {reg.heartbeat_interval_s:g}s"
        if status.last_heartbeat is not None:
            beat += f", the last at {when(status.last_heartbeat)} ({ago((now - status.last_heartbeat).total_seconds())} ago)"
        lines.append(beat)
    if status.state != AgentState.TERMINATED:
        lines.append(f"{status.in_flight} lease(s) in flight" + ("" if status.indexed_by_pool else "; not yet indexed by its pool"))
    if status.eviction_held:
        lines.append(f"silent, but its pool holds back its termination: {status.eviction_held}")
    if status.eviction_denials:
        lines.append(f"its pool refused to let it be terminated {status.eviction_denials} time(s)")
    if status.busy_flips:
        kept = len(status.recent_load_flips)
        lines.append(
            f"load turned it Busy {status.busy_flips} time(s), the last at {when(status.last_busy_at)}"
            f" (the newest {kept} load flip(s) are listed)"
        )
    gap = FIRST_TRANSITIONS_KEPT if status.transitions_dropped else None
    steps: list[tuple[datetime, int, str]] = []
    for i, step in enumerate(status.transitions):
        if i == gap:
            steps.append((step.at, 0, f"... {status.transitions_dropped} transition(s) left out of the agent's log"))
        steps.append((step.at, 1, _step_line(step)))
    steps.extend((step.at, 1, _step_line(step)) for step in status.recent_load_flips)
    lines.extend(f"{when(at)}  {text}" for at, _, text in sorted(steps, key=lambda s: (s[0], s[1])))
    return "\n".join(lines)


def _step_line(step: Transition) -> str:
    old = step.from_state.value if step.from_state else "start"
    return f"{old} -> {step.to_state.value} ({step.reason})"


def when(moment: datetime | None) -> str:
    """`2026-12-06 04:00:00.123Z`, or `-`."""
    if moment is None:
        return "-"
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def ago(seconds: float) -> str:
    """`25s`, `12m`, `3.5h`, `2.0d`."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


# ------------------------------------------------------------------ history events (replay)
def decode_payload(payload: Payload) -> Any:
    """A payload's value: JSON (how the pydantic converter writes models), None for null, else a note."""
    encoding = payload.metadata.get("encoding", b"")
    if encoding in (b"json/plain", b"json/protobuf"):
        try:
            return json.loads(payload.data)
        except ValueError:
            return None
    if encoding == b"binary/null":
        return None
    if encoding == b"binary/plain":
        return f"<{len(payload.data)} bytes>"
    return f"<{encoding.decode(errors='replace') or 'unknown'} payload>"


def summary_of(event: HistoryEvent) -> str | None:
    """The event's user-metadata summary (what the Temporal UI shows), if any."""
    if not event.HasField("user_metadata") or not event.user_metadata.HasField("summary"):
        return None
    value = decode_payload(event.user_metadata.summary)
    return value if isinstance(value, str) else None


def event_type_name(event: HistoryEvent) -> str:
    """`ActivityTaskScheduled` for EVENT_TYPE_ACTIVITY_TASK_SCHEDULED (the UI's spelling)."""
    raw = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")
    return "".join(part.capitalize() for part in raw.split("_"))


def event_time(event: HistoryEvent) -> datetime:
    """The event's time, converted as `workflow.now()` converts it."""
    return datetime.fromtimestamp(event.event_time.ToNanoseconds() / 1e9, timezone.utc)


def _patch_id(event: HistoryEvent) -> str | None:
    """The patch id a marker event records, if it is a patch marker."""
    patch = event.marker_recorded_event_attributes.details.get("patch-data")
    if patch is None or not patch.payloads:
        return None
    data = decode_payload(patch.payloads[0])
    return str(data["id"]) if isinstance(data, dict) and "id" in data else None


def event_line(event: HistoryEvent) -> str:
    """One line about any history event: its id, type and what matters in it (for `replay`)."""
    kind = event.WhichOneof("attributes") or ""
    attrs = getattr(event, kind) if kind else None
    parts: list[str] = [f"#{event.event_id}", event_type_name(event)]
    et = event.event_type
    if et == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
        parts.append(f"activity {attrs.activity_type.name} (id {attrs.activity_id})")
    elif et == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
        parts.append(f"signal {attrs.signal_name}")
    elif et in (EventType.EVENT_TYPE_TIMER_STARTED, EventType.EVENT_TYPE_TIMER_FIRED, EventType.EVENT_TYPE_TIMER_CANCELED):
        parts.append(f"timer {attrs.timer_id}")
    elif et == EventType.EVENT_TYPE_MARKER_RECORDED:
        parts.append(f"marker {attrs.marker_name}")
        patch_id = _patch_id(event)
        if patch_id is not None:
            parts.append(f"patch {patch_id!r}")
    elif et == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
        fields = attrs.search_attributes.indexed_fields
        parts.append(", ".join(f"{k}={decode_payload(v)}" for k, v in sorted(fields.items())))
    elif et == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
        parts.append(f"child {attrs.workflow_type.name} ({attrs.workflow_id})")
    elif et == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
        parts.append(f"signal {attrs.signal_name} to {attrs.workflow_execution.workflow_id}")
    elif et == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
        parts.append(f"update {attrs.accepted_request.input.name}")
    elif et == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
        parts.append(f"workflow {attrs.workflow_type.name}")
    elif hasattr(attrs, "scheduled_event_id") and attrs.scheduled_event_id:
        parts.append(f"(of #{attrs.scheduled_event_id})")
    summary = summary_of(event)
    if summary:
        parts.append(f"- {summary!r}")
    parts.append(f"at {event_time(event).isoformat(timespec='milliseconds')}")
    return " ".join(parts)


__all__ = ["ago", "decode_payload", "event_line", "format_status", "when"]
