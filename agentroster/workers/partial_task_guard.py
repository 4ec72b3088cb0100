"""Refuse the partial workflow tasks a query makes the SDK run, so every history we write replays.

What happens without this guard (temporalio 1.35.0, like temporalio/sdk-python#1591):
a query reaches a worker as a "legacy" query task (the workflow is not cached there,
or new events raced the query), and that task's history holds events no workflow task
has handled yet (a signal, a timer that fired). The SDK's core applies them first, as
a *live* activation with no workflow task of its own: the workflow code runs, its
commands are held, and they are sent with the next real workflow task, ahead of what
that task's own activation adds (update acceptances, more commands). When the history
is replayed, the same events arrive in one activation with that task: update handlers
run first, the commands come in another order, and replay fails with

    [TMPRL1100] Nondeterminism error: Update machine does not handle this event:
    HistoryEvent(id: N, SignalExternalWorkflowExecutionInitiated)

(or `TimerStarted`, or any command). The next worker that rebuilds the workflow from
history is wedged. `benchmarks/repro_cold_start_nde.py` shows it after worker kills.

How the partial task is recognised: the activation is live (not replaying), has jobs
other than queries, its history grew since the previous activation of this run, and
the workflow time did not move. Time moves only on a WorkflowTaskStarted event, so
every real workflow task advances it; the events a query applies have none.

What the guard does: it answers that activation with a failure before any workflow
code runs. The core then fails the query (the caller sees a failed query and asks
again; our client's polls do) and evicts the run; the real workflow task that
follows rebuilds the run from history and meets those events in one activation, as
every replay will. No history event is written and no billed action is added: the
cost is one failed query and one replay on that worker.

Workers use `guarded_workflow_runner()`; replayers keep the plain sandbox (a replayed
history that ends with unhandled events would otherwise be refused the same way).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from temporalio.api.failure.v1 import Failure as ApiFailure
from temporalio.bridge.proto.workflow_activation import WorkflowActivation
from temporalio.bridge.proto.workflow_completion import Failure, WorkflowActivationCompletion
from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails, WorkflowRunner

from agentroster.metrics import PARTIAL_TASKS_REFUSED
from agentroster.workers.context_free import NO_STORE_CONTEXT
from agentroster.wire import PARTIAL_TASK_REFUSED

logger = logging.getLogger("agentroster.worker")

REFUSAL = (
    f"{PARTIAL_TASK_REFUSED}: a query task carried events no workflow task has "
    "handled yet; running them here would write a history that cannot replay (temporalio/sdk-python#1591). "
    "The run is evicted and rebuilt by the next workflow task; ask the query again"
)

_lock = threading.Lock()
_refused = 0


def refused_count() -> int:
    """How many partial workflow tasks this process refused (also `agentroster_worker_partial_tasks_refused_total`)."""
    with _lock:
        return _refused


def is_partial_task(previous: tuple[int, int, int] | None, act: WorkflowActivation) -> bool:
    """Whether `act` is events applied for a query, with no workflow task of their own.

    `previous` is (seconds, nanos, history length) of the last activation of this run
    that had any job other than a query; None before the first.
    """
    if previous is None or act.is_replaying or not _has_work(act):
        return False
    seconds, nanos, length = previous
    same_time = (act.timestamp.seconds, act.timestamp.nanos) == (seconds, nanos)
    return same_time and act.history_length > length


def _has_work(act: WorkflowActivation) -> bool:
    return any(job.WhichOneof("variant") not in ("query_workflow", "remove_from_cache") for job in act.jobs)


class _GuardedInstance(WorkflowInstance):
    def __init__(self, inner: WorkflowInstance, workflow_type: str, context_free: bool = False) -> None:
        self._inner = inner
        self._workflow_type = workflow_type
        self._context_free = context_free
        self._previous: tuple[int, int, int] | None = None

    def activate(self, act: WorkflowActivation) -> WorkflowActivationCompletion:
        if is_partial_task(self._previous, act):
            global _refused
            with _lock:
                _refused += 1
            PARTIAL_TASKS_REFUSED.labels(workflow_type=self._workflow_type).inc()
            logger.warning(
                "%s %s: refused a partial workflow task (history %d, last handled %d): a query carried "
                "unhandled events; the run is rebuilt by its next workflow task",
                self._workflow_type, act.run_id, act.history_length, self._previous[2] if self._previous else -1,
            )
            failure = ApiFailure(message=REFUSAL)
            failure.application_failure_info.SetInParent()
            return WorkflowActivationCompletion(run_id=act.run_id, failed=Failure(failure=failure))
        if _has_work(act):
            self._previous = (act.timestamp.seconds, act.timestamp.nanos, act.history_length)
        return self._inner.activate(act)

    # With `context_free` (see `context_free`): answered here, not by running code in the sandbox.
    def get_serialization_context(self, command_info: Any) -> Any:
        return None if self._context_free else self._inner.get_serialization_context(command_info)

    def get_external_store_context(self, command_info: Any) -> Any:
        return NO_STORE_CONTEXT if self._context_free else self._inner.get_external_store_context(command_info)

    def get_info(self) -> Any:
        return self._inner.get_info()

    def get_thread_id(self) -> int | None:
        return self._inner.get_thread_id()

    def __getattr__(self, name: str) -> Any:  # anything else the SDK may ask of an instance
        return getattr(self._inner, name)


class GuardedWorkflowRunner(WorkflowRunner):
    """A workflow runner (the sandbox) whose instances refuse partial workflow tasks.

    `context_free`: the instances answer serialization contexts themselves; only for a
    worker whose data converter `converter_ignores_context`."""

    def __init__(self, inner: WorkflowRunner, *, context_free: bool = False) -> None:
        self.inner = inner
        self.context_free = context_free

    def prepare_workflow(self, defn: Any) -> None:
        self.inner.prepare_workflow(defn)

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return _GuardedInstance(self.inner.create_instance(det), det.info.workflow_type, self.context_free)

    def set_worker_level_failure_exception_types(self, types: Any) -> None:
        self.inner.set_worker_level_failure_exception_types(types)


__all__ = ["GuardedWorkflowRunner", "REFUSAL", "is_partial_task", "refused_count"]
