"""An agent's whole life, read from its workflow histories alone: `agentroster describe`.

No query and no worker: a closed run cannot answer a query without a worker
replaying it, and an agent that ended a week ago has nothing left but its
history (kept for the namespace's retention). Everything here is read from
events the agent workflow wrote:

- transitions: the `AgentState` search attribute the workflow upserts on every
  transition that changes it (a run on the `agent-2026-12` patch upserts only
  what changes: its first task's patch marker stands for the Spawning -> (the
  state it was started with) steps), the reason taken from what caused it in
  the same history (the
  `register`/`drain`/`acquire`/`release` signal and its input, the
  `AgentEndReason` attribute, the `notify_pool`/`delete_pod` activity inputs,
  the run's final result);
- registrations and drains (with the reason the operator gave and who sent it)
  from the signals received;
- pod deletions and pool notifications from the activities scheduled (their
  user-metadata summary and input) and how each ended;
- leases revoked: the in-flight count the pool last told the agent when it
  ended (the pool revokes those leases when it hears the agent is gone);
- runs: continue-as-new links (each run's start event names the previous run).

`build_timeline` and `run_timeline` are pure functions over history events
(unit-tested with `tests/histories/`); `fetch_agent_runs` is the only I/O.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from agentroster.contracts import AgentState
from agentroster.core.lifecycle import ALLOWED_TRANSITIONS
from agentroster.workflows.agent import CURRENT_PATCH as CURRENT_AGENT_PATCH

S = AgentState
EntryKind = Literal[
    "run_started",
    "registered",
    "transition",
    "drain_requested",
    "pool_told",
    "pod_deletion",
    "leases_revoked",
    "activity",
    "signal",
    "run_ended",
]
# Kinds the text output shows by default (JSON always has everything).
SHOWN_KINDS = frozenset({"run_started", "registered", "transition", "drain_requested", "pod_deletion", "leases_revoked", "run_ended"})
# In text, this many consecutive Ready <-> Busy load flips or more collapse into one line (unless --all).
LOAD_FLIPS_COLLAPSED = 4


class TimelineEntry(BaseModel):
    """One thing that happened to the agent, with the history event it was read from."""

    at: datetime
    run: int = Field(description="1-based position of the run among the agent's runs, oldest first")
    run_id: str
    event_id: int
    kind: EntryKind
    text: str
    from_state: AgentState | None = None
    to_state: AgentState | None = None
    reason: str | None = None
    load_flip: bool = Field(default=False, description="Ready <-> Busy caused by load")
    details: dict[str, Any] = Field(default_factory=dict)


class RunInfo(BaseModel):
    run: int
    run_id: str
    started_at: datetime | None = None
    ended_at: datetime | None = None
    continued_from: str | None = Field(default=None, description="The run this one continued as new from")
    ended: str = Field(default="running", description="running, continued as new, completed, failed, terminated, timed out, canceled")
    events: int = 0
    signals: int = 0
    heartbeats: int = 0
    last_heartbeat: datetime | None = None


class AgentTimeline(BaseModel):
    agent_id: str
    pool: str
    workflow_id: str
    state: AgentState | None = Field(default=None, description="The last state the history shows")
    end_reason: str | None = None
    runs: list[RunInfo] = Field(default_factory=list)
    entries: list[TimelineEntry] = Field(default_factory=list)

    @property
    def transitions(self) -> list[TimelineEntry]:
        return [e for e in self.entries if e.kind == "transition"]


# ------------------------------------------------------------------ decoding
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


def _first(payloads: Any) -> Any:
    items = list(payloads.payloads) if payloads is not None else []
    return decode_payload(items[0]) if items else None


def _has_first(payloads: Any) -> bool:
    return payloads is not None and len(payloads.payloads) > 0


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
    """The event's time, converted as `workflow.now()` converts it (so times equal the `status` query's)."""
    return datetime.fromtimestamp(event.event_time.ToNanoseconds() / 1e9, timezone.utc)


def search_attributes_of(event: HistoryEvent) -> dict[str, Any]:
    fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
    return {name: decode_payload(payload) for name, payload in fields.items()}


def _patch_id(event: HistoryEvent) -> str | None:
    """The patch id a marker event records, if it is a patch marker."""
    patch = event.marker_recorded_event_attributes.details.get("patch-data")
    if patch is None or not _has_first(patch):
        return None
    data = _first(patch)
    return str(data["id"]) if isinstance(data, dict) and "id" in data else None


def _state(value: Any) -> AgentState | None:
    try:
        return AgentState(value) if value else None
    except ValueError:
        return None


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
        values = search_attributes_of(event)
        parts.append(", ".join(f"{k}={v}" for k, v in sorted(values.items())))
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


# ------------------------------------------------------------------ one run
@dataclass
class LifeSoFar:
    """What reading the earlier runs (or a run's carried input) told us.

    `inbox` mirrors the workflow's own inbox: the register, drain and load
    messages it accepted, in order, not yet seen to take effect. The workflow
    applies them one by one (a register spans tasks: it awaits the pool), so
    the cause of a transition is the first queued message of its kind; the
    messages before it took no visible effect (a load notice still updates
    the in-flight count).
    """

    state: AgentState | None = None
    registered: bool = False  # a registration was applied (the next is a re-registration)
    registers_seen: int = 0
    in_flight: int = 0
    saturated: bool = False
    load_seq: int = -1
    load_epoch: str = ""
    drain_reason: str | None = None
    last_heartbeat: datetime | None = None
    end_reason: str | None = None
    agent_id: str = ""
    pool: str = ""
    inbox: deque[tuple[str, dict[str, Any]]] = field(default_factory=deque)

    def new_life(self) -> None:
        """A new workflow with this id (not continue-as-new): an agent that came back."""
        self.state, self.registered, self.registers_seen = None, False, 0
        self.in_flight, self.saturated, self.load_seq, self.load_epoch = 0, False, -1, ""
        self.drain_reason = self.end_reason = None
        self.inbox.clear()

    def apply_load(self, notice: dict[str, Any]) -> None:
        """As `AgentLifecycle.apply_load`: stale notices (an older seq of the same pool) change nothing."""
        epoch = str(notice.get("epoch", ""))
        if epoch != self.load_epoch:
            self.load_epoch, self.load_seq = epoch, -1
        seq = notice.get("seq", 0)
        if not isinstance(seq, int) or seq <= self.load_seq:
            return
        self.load_seq = seq
        self.in_flight = notice.get("in_flight", self.in_flight)
        self.saturated = bool(notice.get("saturated", self.saturated))

    def take(self, kind: str, match: Any = None) -> dict[str, Any] | None:
        """Pop messages up to the first `kind` one (that `match` accepts): the cause of a transition."""
        while self.inbox:
            got, data = self.inbox.popleft()
            if got == "load":
                before = self.saturated
                self.apply_load(data)
                if kind == "load" and (match is None or match(before, self.saturated)):
                    return data
            elif got == kind and (match is None or match(data)):
                return data
        return None

    def take_all(self) -> None:
        """The inbox was worked through (the workflow decides liveness and drains only then)."""
        self.take("")


@dataclass
class _RunReader:
    run: int
    run_id: str
    life: LifeSoFar
    entries: list[TimelineEntry] = field(default_factory=list)
    info: RunInfo | None = None
    task_started: dict[int, datetime] = field(default_factory=dict)
    task_time: datetime | None = None  # workflow.now() of the task being applied
    activities: dict[int, TimelineEntry] = field(default_factory=dict)
    timer_fired_in_task: bool = False  # the task whose commands are being read woke up on a timer
    _timer_fired: bool = False
    unresolved_end: TimelineEntry | None = None
    _pending_reason: str = "registered"
    _start_state: AgentState | None = None  # the AgentState a new workflow was started with

    def add(self, event: HistoryEvent, kind: EntryKind, text: str, *, at: datetime | None = None, **more: Any) -> TimelineEntry:
        entry = TimelineEntry(
            at=at or event_time(event), run=self.run, run_id=self.run_id, event_id=event.event_id, kind=kind, text=text, **more
        )
        self.entries.append(entry)
        return entry

    # -- transitions -----------------------------------------------------
    def transition(self, event: HistoryEvent, new: AgentState, end_reason: str | None) -> None:
        old = self.life.state
        if new == old:
            return
        at = self.task_time or event_time(event)
        if new == S.REGISTERING:
            self.life.take("register")
            self.life.last_heartbeat = at  # `AgentLifecycle.register` counts as a heartbeat
            again, self.life.registered = self.life.registered, True
            self._pending_reason = "re-registered" if again else "registered"
        elif new == S.DRAINING:
            request = self.life.take("drain")
            self.life.drain_reason = str((request or {}).get("reason") or "drain")
        elif {old, new} == {S.READY, S.BUSY}:
            self.life.take("load", lambda before, after: after == (new == S.BUSY))
        elif new == S.TERMINATED:
            if old in (S.SPAWNING, S.REGISTERING) and end_reason in (None, "drain"):
                self.life.take("drain")  # a drain before the agent was routable ends it at once
            else:
                self.life.take_all()
        # One upsert per batch of steps: `indexed` may go Registering -> Ready -> Busy in one.
        if new not in ALLOWED_TRANSITIONS.get(old, frozenset()) and S.READY in ALLOWED_TRANSITIONS.get(old, frozenset()):
            if new in ALLOWED_TRANSITIONS[S.READY]:
                self._step(event, old, S.READY, self._reason(old, S.READY, None), at)
                old = S.READY
        self._step(event, old, new, self._reason(old, new, end_reason), at)

    def _step(self, event: HistoryEvent, old: AgentState | None, new: AgentState, reason: str | None, at: datetime) -> None:
        flip = {old, new} == {S.READY, S.BUSY}
        entry = self.add(
            event,
            "transition",
            "",
            at=at,
            from_state=old,
            to_state=new,
            reason=reason,
            load_flip=flip,
        )
        if new == S.TERMINATED:
            entry.details["in_flight"] = self.life.in_flight
            if self.life.last_heartbeat is not None:
                entry.details["last_heartbeat"] = self.life.last_heartbeat.isoformat()
                entry.details["silent_s"] = round((at - self.life.last_heartbeat).total_seconds(), 3)
            if reason is None:
                self.unresolved_end = entry
            else:
                self.life.end_reason = reason.partition(":")[0]
        self.life.state = new
        _set_transition_text(entry)

    def _reason(self, old: AgentState | None, new: AgentState, end_reason: str | None) -> str | None:
        life = self.life
        if new == S.SPAWNING:
            return "workflow started"
        if new == S.REGISTERING:
            return self._pending_reason
        if new == S.READY and old == S.REGISTERING:
            return "indexed by pool"
        if new == S.BUSY:
            return f"saturated ({life.in_flight} in flight)"
        if new == S.READY and old == S.BUSY:
            return f"slot freed ({life.in_flight} in flight)"
        if new == S.DRAINING:
            return life.drain_reason or "drain"
        if new == S.TERMINATED:
            return end_reason  # None: resolved from what follows (notify_pool, delete_pod, the result)
        return None

    def resolve_end(self, reason: str | None, detail: str | None = None) -> None:
        entry = self.unresolved_end
        if entry is None or not reason:
            return
        entry.reason = detail if detail and detail.startswith(reason) else reason
        self.life.end_reason = reason
        self.unresolved_end = None
        _set_transition_text(entry)

    def refine_end(self, full_reason: str) -> None:
        """The result's last transition has the detail (e.g. `drain: deadline passed with 1 task(s) in flight`)."""
        for entry in reversed(self.entries):
            if entry.kind == "transition" and entry.to_state == S.TERMINATED:
                if entry.reason is None or (full_reason.startswith(entry.reason) and full_reason != entry.reason):
                    entry.reason = full_reason
                    _set_transition_text(entry)
                return

    # -- the events ------------------------------------------------------
    def read(self, events: Sequence[HistoryEvent]) -> None:
        for event in events:
            self.read_event(event)
        if self.unresolved_end is not None:
            # Nothing said why: Draining ends by its drain; otherwise a liveness timer fired.
            entry = self.unresolved_end
            self.resolve_end("drain" if entry.from_state == S.DRAINING else ("heartbeat_lost" if self.timer_fired_in_task else "unknown"))
        self._leases_revoked()

    def read_event(self, event: HistoryEvent) -> None:
        info = self.info
        assert info is not None
        info.events += 1
        et = event.event_type
        E = EventType
        if et == E.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            self.task_started[event.event_id] = event_time(event)
        elif et == E.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            self.task_time = self.task_started.get(event.workflow_task_completed_event_attributes.started_event_id)
            self.timer_fired_in_task, self._timer_fired = self._timer_fired, False
        elif et == E.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            self.on_started(event)
        elif et == E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            self.on_signal(event)
        elif et == E.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            values = search_attributes_of(event)
            state = _state(values.get("AgentState"))
            if state is not None:
                self.transition(event, state, values.get("AgentEndReason") or None)
        elif et == E.EVENT_TYPE_MARKER_RECORDED:
            if _patch_id(event) == CURRENT_AGENT_PATCH and self.life.state is None:
                # This run upserts only what changes: its first task went Spawning -> the state it
                # was started with (if any; a registration that came with the start upserts the rest).
                self.transition(event, S.SPAWNING, None)
                if self._start_state is not None:
                    self.transition(event, self._start_state, None)
        elif et == E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            self.on_activity(event)
        elif et in (
            E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            E.EVENT_TYPE_ACTIVITY_TASK_FAILED,
            E.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
            E.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
        ):
            self.on_activity_end(event)
        elif et == E.EVENT_TYPE_TIMER_FIRED:
            self._timer_fired = True  # delivered to the next workflow task
        elif et in _CLOSING_EVENTS:
            self.on_closed(event)

    def on_started(self, event: HistoryEvent) -> None:
        attrs = event.workflow_execution_started_event_attributes
        info = self.info
        assert info is not None
        info.started_at = event_time(event)
        data = _first(attrs.input) if _has_first(attrs.input) else None
        data = data if isinstance(data, dict) else {}
        self.life.agent_id = data.get("agent_id") or self.life.agent_id
        self.life.pool = data.get("pool") or self.life.pool
        carried = data.get("carried") if isinstance(data.get("carried"), dict) else None
        details: dict[str, Any] = {"workflow_type": attrs.workflow_type.name}
        summary = summary_of(event)
        if summary:
            details["summary"] = summary
        if attrs.continued_execution_run_id:
            info.continued_from = attrs.continued_execution_run_id
            self.life.inbox.clear()  # a run continues as new with an empty inbox
            if carried:
                # The carried state is the previous run's own word: trust it over our reading.
                self.life.state = _state(carried.get("state")) or self.life.state
                self.life.registered = self.life.registered or bool(carried.get("registration"))
                self.life.in_flight = int(carried.get("in_flight") or 0)
                self.life.saturated = bool(carried.get("saturated"))
                self.life.load_seq = int(carried.get("load_seq", self.life.load_seq))
                self.life.load_epoch = str(carried.get("load_epoch", self.life.load_epoch) or "")
                self.life.drain_reason = carried.get("drain_reason") or self.life.drain_reason
                beat = _parse_time(carried.get("last_heartbeat"))
                self.life.last_heartbeat = beat or self.life.last_heartbeat
            state = self.life.state.value if self.life.state else "unknown"
            text = f"run {self.run} continued as new from run {attrs.continued_execution_run_id} (state {state} carried over)"
        else:
            # A new workflow with this id: a new life (an agent that came back registers again).
            self.life.new_life()
            started_with = attrs.search_attributes.indexed_fields.get("AgentState")
            self._start_state = _state(decode_payload(started_with)) if started_with is not None else None
            text = f"run {self.run}: agent workflow started" + (f" - {summary}" if summary else "")
        details["run_id"] = self.run_id
        self.add(event, "run_started", text, details=details)

    def on_signal(self, event: HistoryEvent) -> None:
        attrs = event.workflow_execution_signaled_event_attributes
        info = self.info
        assert info is not None
        info.signals += 1
        name = attrs.signal_name
        data = _first(attrs.input) if _has_first(attrs.input) else None
        sender = attrs.identity or (attrs.external_workflow_execution.workflow_id if attrs.HasField("external_workflow_execution") else "")
        at = event_time(event)
        if name == "heartbeat":
            info.heartbeats += 1
            info.last_heartbeat = at
            self.life.last_heartbeat = at
        elif name == "register":
            reg = data if isinstance(data, dict) else {}
            caps = [f"{c.get('name')}@{c.get('version')}" for c in reg.get("capabilities") or [] if isinstance(c, dict)]
            refused = _refused_registration(reg, self.life.agent_id)
            again = self.life.registered or self.life.registers_seen > 0
            if refused is None:
                self.life.registers_seen += 1
                self.life.last_heartbeat = at  # the handler counts a registration as a heartbeat
                if self.life.state not in (S.DRAINING, S.TERMINATED):
                    self.life.inbox.append(("register", reg))
            text = (
                f"{'refused registration' if refused else 're-registered' if again else 'registered'}: deployment {reg.get('deployment', '?')}, "
                f"endpoint {reg.get('endpoint', '?')}, {', '.join(caps) or 'no capabilities'}, "
                f"heartbeat every {reg.get('heartbeat_interval_s', '?')}s"
                + (f" (sent by {sender})" if sender else "")
                + (f": {refused}" if refused else "")
            )
            self.add(
                event,
                "registered",
                text,
                details={
                    "deployment": reg.get("deployment"),
                    "endpoint": reg.get("endpoint"),
                    "capabilities": caps,
                    "heartbeat_interval_s": reg.get("heartbeat_interval_s"),
                    "sender": sender,
                    "again": again,
                    "refused": refused,
                },
            )
        elif name == "drain":
            request = data if isinstance(data, dict) else {}
            reason = str(request.get("reason") or "drain")
            deadline = request.get("deadline_s", 300.0)
            if data is None or isinstance(data, dict):
                self.life.inbox.append(("drain", request))
            self.add(
                event,
                "drain_requested",
                f"drain requested: {reason!r}, deadline {deadline}s" + (f" (sent by {sender})" if sender else ""),
                reason=reason,
                details={"reason": reason, "deadline_s": deadline, "sender": sender},
            )
        elif name == "pod_gone" and isinstance(data, dict):
            what = f"{data.get('reason', '?')}" + (f": {data.get('detail')}" if data.get("detail") else "")
            self.add(
                event,
                "signal",
                f"the backend reported the agent gone ({what})" + (f" (sent by {sender})" if sender else ""),
                details={"signal": name, "input": data},
            )
        elif name in ("acquire", "release"):
            if isinstance(data, dict) and isinstance(data.get("in_flight"), int) and isinstance(data.get("saturated"), bool):
                self.life.inbox.append(("load", data))
        else:
            self.add(event, "signal", f"signal {name}" + (f" from {sender}" if sender else ""), details={"signal": name, "input": data})

    def on_activity(self, event: HistoryEvent) -> None:
        attrs = event.activity_task_scheduled_event_attributes
        name = attrs.activity_type.name
        data = _first(attrs.input) if _has_first(attrs.input) else None
        summary = summary_of(event)
        if name == "delete_pod":
            pod = data if isinstance(data, dict) else {}
            text = summary or f"delete pod {pod.get('agent_id')} of {pod.get('deployment')} ({pod.get('reason')})"
            entry = self.add(event, "pod_deletion", text, reason=pod.get("reason"), details={**pod, "outcome": "pending"})
            self.resolve_end(pod.get("reason"))
        elif name == "notify_pool":
            note = data if isinstance(data, dict) else {}
            snap = note.get("snapshot") if isinstance(note.get("snapshot"), dict) else {}
            reason = snap.get("reason") or ""
            state = snap.get("state")
            text = summary or f"tell pool {note.get('pool')}: {state} ({reason})"
            entry = self.add(event, "pool_told", text, reason=reason, details={"pool": note.get("pool"), "state": state, "reason": reason, "outcome": "pending"})
            if state == S.TERMINATED.value:
                self.resolve_end(reason)
        else:
            entry = self.add(event, "activity", summary or f"activity {name}", details={"activity": name, "outcome": "pending"})
        self.activities[event.event_id] = entry

    def on_activity_end(self, event: HistoryEvent) -> None:
        kind = event.WhichOneof("attributes")
        attrs = getattr(event, kind)
        entry = self.activities.get(attrs.scheduled_event_id)
        if entry is None:
            return
        E = EventType
        if event.event_type == E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            entry.details["outcome"] = "done"
        elif event.event_type == E.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            entry.details["outcome"] = f"failed: {attrs.failure.message}"
        elif event.event_type == E.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            entry.details["outcome"] = "timed out"
        else:
            entry.details["outcome"] = "canceled"
        entry.details["outcome_at"] = event_time(event).isoformat()

    def on_closed(self, event: HistoryEvent) -> None:
        info = self.info
        assert info is not None
        info.ended_at = event_time(event)
        E = EventType
        et = event.event_type
        if et == E.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            attrs = event.workflow_execution_continued_as_new_event_attributes
            info.ended = "continued as new"
            self.add(
                event,
                "run_ended",
                f"run {self.run} continued as new after {info.signals} signal(s) ({info.events} events) -> run {attrs.new_execution_run_id}",
                details={"new_run_id": attrs.new_execution_run_id},
            )
            return
        if et == E.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            info.ended = "completed"
            result = _first(event.workflow_execution_completed_event_attributes.result)
            result = result if isinstance(result, dict) else {}
            reason = result.get("terminated_reason")
            transitions = result.get("transitions") or []
            last = transitions[-1] if transitions and isinstance(transitions[-1], dict) else {}
            self.resolve_end(reason, last.get("reason") if last.get("to_state") == S.TERMINATED.value else None)
            if last.get("to_state") == S.TERMINATED.value and isinstance(last.get("reason"), str):
                self.refine_end(last["reason"])
            state = result.get("state") or (self.life.state.value if self.life.state else "?")
            self.add(event, "run_ended", f"run {self.run} completed: {state}" + (f" ({reason})" if reason else ""), details={"result_state": state, "terminated_reason": reason})
            return
        if et == E.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED:
            attrs = event.workflow_execution_terminated_event_attributes
            info.ended = "terminated"
            text = f"run {self.run} terminated" + (f" by {attrs.identity}" if attrs.identity else "") + (f": {attrs.reason}" if attrs.reason else "")
        elif et == E.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
            info.ended = "failed"
            text = f"run {self.run} failed: {event.workflow_execution_failed_event_attributes.failure.message}"
        elif et == E.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT:
            info.ended = "timed out"
            text = f"run {self.run} timed out"
        else:
            info.ended = "canceled"
            text = f"run {self.run} canceled"
        self.add(event, "run_ended", text, details={"ended": info.ended})

    def _leases_revoked(self) -> None:
        """An agent that ends with leases in flight: the pool revokes them when it hears (holders are told)."""
        for entry in list(self.entries):
            if entry.kind == "transition" and entry.to_state == S.TERMINATED and entry.details.get("in_flight", 0) > 0:
                n = entry.details["in_flight"]
                revoked = TimelineEntry(
                    at=entry.at,
                    run=entry.run,
                    run_id=entry.run_id,
                    event_id=entry.event_id,
                    kind="leases_revoked",
                    text=f"{n} lease(s) in flight when it ended (the pool's last count): revoked by the pool, holders told",
                    details={"leases": n},
                )
                self.entries.insert(self.entries.index(entry) + 1, revoked)


def _refused_registration(reg: dict[str, Any], agent_id: str) -> str | None:
    """Why the workflow's `register` handler refused this payload (so it never reached its inbox), or None."""
    from pydantic import ValidationError

    from agentroster.contracts import AgentRegistration

    try:
        parsed = AgentRegistration.model_validate(reg)
    except ValidationError as exc:
        return f"invalid ({exc.error_count()} error(s))"
    if agent_id and parsed.agent_id != agent_id:
        return f"agent_id {parsed.agent_id!r} is not this workflow's"
    return None


_CLOSING_EVENTS = frozenset(
    {
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
    }
)


def _set_transition_text(entry: TimelineEntry) -> None:
    old = entry.from_state.value if entry.from_state else "start"
    new = entry.to_state.value if entry.to_state else "?"
    entry.text = f"{old} -> {new}" + (f" ({entry.reason})" if entry.reason else "")
    if entry.to_state == S.TERMINATED and entry.reason and entry.reason.startswith("heartbeat_lost") and "silent_s" in entry.details:
        entry.text += f", last heartbeat {entry.details['silent_s']:g}s before"


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def run_timeline(
    events: Sequence[HistoryEvent], *, run: int = 1, run_id: str = "", life: LifeSoFar | None = None
) -> tuple[RunInfo, list[TimelineEntry], LifeSoFar]:
    """Read one run's events. `life` is what the earlier runs said (it is updated and returned)."""
    reader = _RunReader(run=run, run_id=run_id, life=life or LifeSoFar())
    reader.info = RunInfo(run=run, run_id=run_id)
    reader.read(events)
    return reader.info, reader.entries, reader.life


def build_timeline(runs: Sequence[tuple[str, Sequence[HistoryEvent]]], *, workflow_id: str = "") -> AgentTimeline:
    """The agent's life from the histories of its runs (any order; sorted by start time)."""
    ordered = sorted((r for r in runs if r[1]), key=lambda r: event_time(r[1][0]))
    life = LifeSoFar()
    infos: list[RunInfo] = []
    entries: list[TimelineEntry] = []
    for number, (run_id, events) in enumerate(ordered, start=1):
        info, found, life = run_timeline(events, run=number, run_id=run_id, life=life)
        infos.append(info)
        entries.extend(found)
    agent_id, pool = life.agent_id, life.pool
    if workflow_id and not agent_id:
        _, _, rest = workflow_id.partition("/")
        pool, _, agent_id = rest.partition("/")
    return AgentTimeline(
        agent_id=agent_id,
        pool=pool,
        workflow_id=workflow_id or (f"agent/{pool}/{agent_id}" if agent_id else ""),
        state=life.state,
        end_reason=life.end_reason if life.state == S.TERMINATED else None,
        runs=infos,
        entries=entries,
    )


# ------------------------------------------------------------------ text
def format_timeline(timeline: AgentTimeline, *, show_all: bool = False, now: datetime | None = None) -> str:
    """The timeline as lines an operator reads: `time  [run N #event]  what happened`."""
    state = timeline.state.value if timeline.state else "unknown"
    head = f"agent {timeline.agent_id} in pool {timeline.pool} ({timeline.workflow_id}): {state}"
    if timeline.end_reason:
        head += f" ({timeline.end_reason})"
    last_run = timeline.runs[-1] if timeline.runs else None
    if last_run is not None:
        head += f"; {len(timeline.runs)} run(s), the last {last_run.ended}"
        if last_run.ended_at and now is not None:
            head += f" {ago((now - last_run.ended_at).total_seconds())} ago"
    lines = [head]
    shown = [e for e in timeline.entries if show_all or e.kind in SHOWN_KINDS or _failed(e)]
    i = 0
    while i < len(shown):
        entry = shown[i]
        if not show_all and entry.load_flip:
            j = i
            while j < len(shown) and shown[j].load_flip:
                j += 1
            if j - i >= LOAD_FLIPS_COLLAPSED:
                busy = sum(1 for e in shown[i:j] if e.to_state == S.BUSY)
                lines.append(
                    f"{_when(entry.at)}  [run {entry.run} #{entry.event_id}]  {j - i} load flips Ready <-> Busy "
                    f"({busy} times saturated) until {_when(shown[j - 1].at)} (--all lists them)"
                )
                i = j
                continue
        text = entry.text
        outcome = entry.details.get("outcome")
        if outcome and outcome != "pending" or (outcome == "pending" and entry.kind == "pod_deletion"):
            text += f": {outcome}"
        lines.append(f"{_when(entry.at)}  [run {entry.run} #{entry.event_id}]  {text}")
        i += 1
    beats = sum(info.heartbeats for info in timeline.runs)
    last_beat = max((info.last_heartbeat for info in timeline.runs if info.last_heartbeat), default=None)
    if beats:
        lines.append(f"{beats} heartbeat signal(s) over {len(timeline.runs)} run(s), the last at {_when(last_beat)}")
    return "\n".join(lines)


def _failed(entry: TimelineEntry) -> bool:
    outcome = entry.details.get("outcome")
    return isinstance(outcome, str) and outcome not in ("done", "pending")


def _when(moment: datetime | None) -> str:
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


# ------------------------------------------------------------------ fetching
async def fetch_agent_runs(
    client: Any, workflow_id: str, *, last_runs: int | None = None, concurrency: int = 4
) -> list[tuple[str, list[HistoryEvent]]]:
    """Every run of `workflow_id` (within retention) with its events, oldest first.

    Runs come from visibility (`WorkflowId="..."`) and from the continue-as-new
    links in the histories themselves, so a run visibility has not indexed yet
    is still found. `last_runs` keeps only the most recent ones (fewer fetches).
    """
    from temporalio.service import RPCError

    from agentroster.transport import is_not_found

    starts: dict[str, datetime | None] = {}
    async for execution in client.list_workflows(f'WorkflowId="{workflow_id}"'):
        starts[execution.run_id] = execution.start_time
    try:
        latest = await client.get_workflow_handle(workflow_id).describe()
        starts.setdefault(latest.run_id, latest.start_time)
    except RPCError as exc:
        if not is_not_found(exc):
            raise
    if last_runs is not None:
        keep = sorted(starts, key=lambda r: starts[r] or datetime.min.replace(tzinfo=timezone.utc))[-last_runs:]
        starts = {r: starts[r] for r in keep}
    gate = asyncio.Semaphore(concurrency)
    fetched: dict[str, list[HistoryEvent]] = {}

    async def fetch(run_id: str) -> None:
        async with gate:
            history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        fetched[run_id] = list(history.events)

    pending = set(starts)
    while pending:
        await asyncio.gather(*(fetch(r) for r in pending))
        linked: set[str] = set()
        if last_runs is None:
            for events in fetched.values():
                first = events[0].workflow_execution_started_event_attributes if events else None
                if first is not None and first.continued_execution_run_id:
                    linked.add(first.continued_execution_run_id)
                last = events[-1] if events else None
                if last is not None and last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                    linked.add(last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id)
        pending = {r for r in linked if r and r not in fetched}
        # A linked run past retention is gone: stop there rather than fail.
        for run_id in list(pending):
            try:
                await client.get_workflow_handle(workflow_id, run_id=run_id).describe()
            except RPCError as exc:
                if not is_not_found(exc):
                    raise
                pending.discard(run_id)
                fetched[run_id] = []
    runs = [(r, e) for r, e in fetched.items() if e]
    return sorted(runs, key=lambda r: event_time(r[1][0]))


__all__ = [
    "AgentTimeline",
    "RunInfo",
    "TimelineEntry",
    "ago",
    "build_timeline",
    "decode_payload",
    "event_line",
    "fetch_agent_runs",
    "format_timeline",
    "run_timeline",
]
