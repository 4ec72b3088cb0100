"""Replay a recorded workflow history against this code: `agentroster replay`.

The replayer has exactly the worker's settings (`workflows.workflow_classes()`,
`workflows.workflow_runner()`, the pydantic data converter), so a history that replays here replays on a
worker, and one that does not would get that run stuck the moment a worker
with this code picks it up.

When a replay fails, the event where the code and the history part ways is
found from the error (core names it for most mismatches, e.g.
`HistoryEvent(id: 40, TimerCanceled)`), or else by replaying ever shorter
prefixes of the history (a prefix that ends before the divergence replays
cleanly): the first prefix that fails ends with the diverging event.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

from agentroster.ops.timeline import event_line

# For an exported history whose first event lacks the workflow id (older servers and UIs).
PLACEHOLDER_ID = "replayed-workflow"
CONTEXT_BEFORE = 4
CONTEXT_AFTER = 2

_MESSAGE = re.compile(r'message: "((?:[^"\\]|\\.)*)"')
_EVENT_IDS = (
    re.compile(r"HistoryEvent\(id: (\d+)"),
    re.compile(r"event id:? (\d+)", re.IGNORECASE),
)


class HistoryFileError(ValueError):
    """The file is not a workflow history (names the file and why)."""


def load_history_file(path: str | Path) -> WorkflowHistory:
    """A history as `temporal workflow show -o json`, the UI's download or `WorkflowHistory.to_json()` write it."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HistoryFileError(f"{path}: cannot read a JSON history: {exc}") from exc
    if isinstance(raw, list):  # a bare list of events
        raw = {"events": raw}
    if not isinstance(raw, dict) or not isinstance(raw.get("events"), list) or not raw["events"]:
        raise HistoryFileError(f"{path}: not a workflow history (expected {{\"events\": [...]}} with at least one event)")
    first = raw["events"][0]
    started = first.get("workflowExecutionStartedEventAttributes") if isinstance(first, dict) else None
    if not isinstance(started, dict):
        raise HistoryFileError(f"{path}: the first event is not WorkflowExecutionStarted: not a whole history")
    workflow_id = started.get("workflowId") or PLACEHOLDER_ID
    try:
        return WorkflowHistory.from_json(workflow_id, raw)
    except Exception as exc:  # protobuf's ParseError and friends
        raise HistoryFileError(f"{path}: not a workflow history: {exc}") from exc


def make_replayer(quiet: bool = True) -> Any:
    """The worker's replayer settings; `quiet` keeps core's per-task warnings off stderr (we report instead)."""
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
    from temporalio.worker import Replayer

    from agentroster.workflows import workflow_classes, workflow_runner

    runtime = (
        Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))))
        if quiet
        else None
    )
    return Replayer(workflows=workflow_classes(), workflow_runner=workflow_runner(), data_converter=pydantic_data_converter, runtime=runtime)


@dataclass
class ReplayReport:
    workflow_id: str
    workflow_type: str
    events: int
    ok: bool
    error: str | None = None
    error_type: str | None = None
    event_id: int | None = None
    found_by: str | None = None  # "the error" or "bisection"
    context: list[str] = field(default_factory=list)
    task_event_id: int | None = None  # the WorkflowTaskCompleted whose commands diverged

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def core_message(error: BaseException) -> str:
    """The failure message inside core's `Failure { ... message: "..." ... }` repr, or the error's text."""
    text = str(error)
    found = _MESSAGE.search(text)
    return found.group(1).replace('\\"', '"') if found else text


def event_id_from_error(message: str) -> int | None:
    """The event id core names in a nondeterminism message, if it names one."""
    for pattern in _EVENT_IDS:
        found = pattern.search(message)
        if found:
            return int(found.group(1))
    return None


async def replay_history(history: WorkflowHistory, *, replayer: Any = None, locate: bool = True) -> ReplayReport:
    """Replay `history`; on failure, find the event where it diverged."""
    replayer = replayer or make_replayer()
    events = list(history.events)
    started = events[0].workflow_execution_started_event_attributes if events else None
    report = ReplayReport(
        workflow_id=history.workflow_id,
        workflow_type=started.workflow_type.name if started is not None else "?",
        events=len(events),
        ok=True,
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    failure = result.replay_failure
    if failure is None:
        return report
    report.ok = False
    report.error_type = type(failure).__name__
    report.error = core_message(failure)
    if not locate:
        return report
    known = {e.event_id for e in events}
    event_id = event_id_from_error(report.error)
    if event_id is not None and event_id in known:
        report.event_id, report.found_by = event_id, "the error"
    else:
        report.event_id = await bisect_divergence(history, replayer)
        report.found_by = "bisection" if report.event_id is not None else None
    if report.event_id is not None:
        report.context = context_lines(events, report.event_id)
        report.task_event_id = next(
            (
                e.event_id
                for e in reversed(events)
                if e.event_id < report.event_id and e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
            ),
            None,
        )
    return report


async def bisect_divergence(history: WorkflowHistory, replayer: Any) -> int | None:
    """The id of the first event whose prefix no longer replays (the full history must fail).

    Prefixes start at the first workflow task (a history of the start event
    alone never finishes replaying).
    """
    events = list(history.events)
    first_task = next((i for i, e in enumerate(events) if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED), None)
    if first_task is None:
        return None

    async def fails(n: int) -> bool:
        prefix = WorkflowHistory(history.workflow_id, events[:n])
        result = await replayer.replay_workflow(prefix, raise_on_replay_failure=False)
        return result.replay_failure is not None

    lo, hi = first_task + 1, len(events)  # invariant: prefix hi fails
    if await fails(lo):
        return events[lo - 1].event_id
    while hi - lo > 1:  # prefix lo replays, prefix hi fails
        mid = (lo + hi) // 2
        if await fails(mid):
            hi = mid
        else:
            lo = mid
    return events[hi - 1].event_id


def context_lines(events: list[Any], event_id: int) -> list[str]:
    """The diverging event with a few around it, the culprit marked `>>`."""
    index = next((i for i, e in enumerate(events) if e.event_id == event_id), None)
    if index is None:
        return []
    out = []
    for e in events[max(0, index - CONTEXT_BEFORE) : index + CONTEXT_AFTER + 1]:
        out.append(("  >> " if e.event_id == event_id else "     ") + event_line(e))
    return out


def reset_command(report: ReplayReport, run_id: str) -> str | None:
    """The `temporal workflow reset` that unsticks a live run whose history does not replay: the
    workflow task whose commands diverged (completed at `task_event_id`) runs again with this code."""
    if report.ok or report.task_event_id is None:
        return None
    reason = f"history does not replay from event {report.event_id}"
    # Updates are not reapplied: their reapplied form replays in another order than it ran
    # (tests/test_reset_reapply.py), and the new run would not replay either.
    return (
        f"temporal workflow reset --workflow-id {report.workflow_id} --run-id {run_id} --event-id {report.task_event_id} "
        f"--reapply-exclude Update --reason '{reason}'"
    )


RESET_ADVICE = (
    "a worker that picks this run up fails every workflow task from there on. To recover, once no newer code "
    "is to be deployed instead:\n    {command}\n"
    "it runs the workflow task completed at event {task} again with this code; the server applies the signals "
    "that came after it again, not the updates (reapplied updates make a run that does not replay), so updates "
    "after that point are undone: send releases, cancels, renewals, policies and a shutdown again. For a pool, "
    "a lease granted after that point is not known to the new run: its agent may be given one task more than "
    "its max_concurrency per such lease, and the holder's next renewal raises LeaseLostError."
)


def format_report(report: ReplayReport, source: str) -> str:
    head = f"{source}: {report.workflow_type} {report.workflow_id}, {report.events} events"
    if report.ok:
        return f"{head}\nreplayed cleanly with this code (the worker's sandbox and data converter)"
    lines = [head, f"replay FAILED ({report.error_type}): {report.error}"]
    if report.event_id is not None:
        where = f"diverged at event {report.event_id} (found by {report.found_by})"
        if report.task_event_id is not None:
            where += f": the code's commands after the workflow task completed at event {report.task_event_id} differ from the history"
        lines.append(where)
        lines.extend(report.context)
        lines.append(
            "the cause may be earlier: what the code did with a signal, an activity result or a patch before this event. "
            "Do not edit the history: see docs/compatibility.md for what a workflow change needs."
        )
    else:
        lines.append("could not tell which event diverged")
    return "\n".join(lines)


__all__ = [
    "HistoryFileError",
    "ReplayReport",
    "bisect_divergence",
    "core_message",
    "event_id_from_error",
    "format_report",
    "load_history_file",
    "make_replayer",
    "replay_history",
    "reset_command",
]
