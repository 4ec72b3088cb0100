"""The one guard kept against temporalio/sdk-python#1591: refuse a query's partial workflow task.

Remove this module (and its use in `workers.worker.worker_workflow_runner`, and the refusal
text in `transport.is_transient`) when a temporalio release ships the fix ("WFT chunking
v2", sdk-rust PRs #1281/#1509) and `benchmarks/repro_cold_start_nde.py --query-rule`,
run with AGENTROSTER_QUERY_TASK_GUARD=off, replays every pool run over many kills.
It is the only code of ours that looks at an activation (through the SDK's public
`WorkflowRunner`/`WorkflowInstance` interface for custom runners; no `temporalio.bridge` import).

What it is for: a query reaches a worker as a query task whose history holds events no
workflow task has handled yet (a signal, a fired timer). The SDK runs them for the query
as a live activation of their own and sends their commands with the next real workflow
task, ahead of that task's update acceptances; replay meets the same events in one
activation with that task and fails ("Update machine does not handle this event",
"No command scheduled for event ... TimerStarted"): the pool is wedged.
`transport.query_workflow` keeps our queries off the path that brings most of them (a
query outliving a dead worker's sticky queue), but a query dispatched while the pool's
stickiness is cleared (after a worker died) waits on the normal queue for the next
worker and can still meet new events: with four clients querying the pool's status
without pause, the repro wedges a pool within some 15 worker kills under the query rule
alone, and none with this guard. A server restart brings such query tasks too, with
only our ticket polls (benchmarks/chaos.py counts the refusals of each kill row).

How it is recognised: the activation is live (not replaying), has jobs other than
queries, the history grew since the run's previous activation, and the workflow time did
not move. Time moves only with a WorkflowTaskStarted event, so every real workflow task
moves it; events applied for a query have none. The activation is answered with a
failure before any workflow code runs: the SDK fails that query (our client asks again)
and evicts the run, and the next real workflow task rebuilds it from history, meeting
those events as every replay will.

AGENTROSTER_QUERY_TASK_GUARD=off turns it off (for the repro above).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails, WorkflowRunner

from agentroster.vocabulary.wire import PARTIAL_TASK_REFUSED

logger = logging.getLogger("agentroster.worker")


class PartialQueryTaskRefused(RuntimeError):
    """Raised from `activate` for a query's partial workflow task, before any workflow code runs."""

REFUSAL = (
    f"{PARTIAL_TASK_REFUSED}: a query task carried events no workflow task has handled yet; running them "
    "here would write a history that cannot replay (temporalio/sdk-python#1591). Ask the query again"
)


def guard_on(env: dict[str, str] | None = None) -> bool:
    """The switch: on unless AGENTROSTER_QUERY_TASK_GUARD is `off`."""
    value = (os.environ if env is None else env).get("AGENTROSTER_QUERY_TASK_GUARD", "").strip().lower()
    return value != "off"


def _has_work(act: Any) -> bool:
    return any(job.WhichOneof("variant") not in ("query_workflow", "remove_from_cache") for job in act.jobs)


class _GuardedInstance(WorkflowInstance):
    def __init__(self, inner: WorkflowInstance, workflow_type: str) -> None:
        self._inner = inner
        self._workflow_type = workflow_type
        self._previous: tuple[int, int, int] | None = None  # (seconds, nanos, history length) of the last activation with work

    def activate(self, act: Any) -> Any:
        if _has_work(act):
            now = (act.timestamp.seconds, act.timestamp.nanos, act.history_length)
            previous, self._previous = self._previous, now
            if previous is not None and not act.is_replaying and now[:2] == previous[:2] and now[2] > previous[2]:
                logger.warning("%s %s: refused a query's partial workflow task (history %d, last handled %d)",
                               self._workflow_type, act.run_id, now[2], previous[2])
                # The worker answers an activation that raises with a failed completion: the
                # query fails (our client asks again) and the run is evicted and rebuilt.
                raise PartialQueryTaskRefused(REFUSAL)
        return self._inner.activate(act)

    def get_serialization_context(self, command_info: Any) -> Any:
        return self._inner.get_serialization_context(command_info)

    def get_external_store_context(self, command_info: Any) -> Any:
        return self._inner.get_external_store_context(command_info)

    def get_info(self) -> Any:
        return self._inner.get_info()

    def get_thread_id(self) -> int | None:
        return self._inner.get_thread_id()


class QueryTaskGuardRunner(WorkflowRunner):
    """`inner`, whose instances refuse a query's partial workflow task."""

    def __init__(self, inner: WorkflowRunner) -> None:
        self.inner = inner

    def prepare_workflow(self, defn: Any) -> None:
        self.inner.prepare_workflow(defn)

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return _GuardedInstance(self.inner.create_instance(det), det.info.workflow_type)

    def set_worker_level_failure_exception_types(self, types: Any) -> None:
        self.inner.set_worker_level_failure_exception_types(types)


__all__ = ["REFUSAL", "QueryTaskGuardRunner", "guard_on"]
