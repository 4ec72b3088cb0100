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

Two more signs of the same thing, for a run this instance did not see from the start
(the worker restarted, or the run was evicted and rebuilt): the query task's events end
with a workflow task that a worker *started* and then dropped (killed, or too slow: the
task timed out), and core moves the workflow time to that start. The time moved, so the
rule above cannot see it; but no real workflow task of this worker can carry a time
from before the worker began (its tasks start once it polls), nor the time of a task
this worker already ran for the run in an earlier instance. Seen in the reliability
harness after worker kills: a live activation at the dead worker's task start (2-3 s
before the new worker polled) ran four `release` signals for a query, and its notices
went out ahead of the next task's update acceptances.

A third sign, for a run this worker just refused an activation of: the refusal evicts
the run, and core, when it evicts a run, keeps *one* of the tasks it had buffered for it
(queries first) and drops the rest (sdk-core `workflow_stream.rs`, "There were leftover
buffered tasks when evicting run"). A real workflow task this worker had polled can be
dropped that way; a second query task then carries its start, and core runs the events
up to it live, at that task's start time, on the rebuilt instance: the times above do
not tell it from the real task, and its commands go out with the next task (seen in the
reliability harness: `Update machine does not handle this event: ... TimerStarted`). So
a rebuilt instance's first live activation whose task started before this worker refused
one of the run's activations is refused too, while a task that started then could still
be dropped (the task timeout). When it was the real task after all (no query was
buffered with it): on the task's first attempt, one WorkflowTaskFailed with our refusal
as its message, retried by the server at once; on a later attempt (after a kill the
real task is often attempt 2) core does not report the failure and the task waits for
its timeout (2 s for a pool, the server's 10 s for agent and task workflows). Either
way the updates it carried fail to their callers (our client asks again). Compared
with the server's clock with no margin: a worker clock ahead by more than the moment a
retry takes has the retry refused once more (the next one starts later), and one
behind by d misses copies of tasks that started within d before the refusal.

What the guard does: it answers that activation with a failure before any workflow
code runs. The core then fails the query (the caller sees a failed query and asks
again; our client's polls do) and evicts the run; the real workflow task that
follows rebuilds the run from history and meets those events in one activation, as
every replay will. For a query's task no history event is written and no billed
action is added: the cost is one failed query and one replay on that worker.

Workers use `guarded_workflow_runner()`; replayers keep the plain sandbox (a replayed
history that ends with unhandled events would otherwise be refused the same way).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from temporalio.api.failure.v1 import Failure as ApiFailure
from temporalio.bridge.proto.workflow_activation import RemoveFromCache, WorkflowActivation
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


# Server and worker clocks may differ by this much before a task this worker started looks older than the worker.
CLOCK_MARGIN_S = 1.0
# Live task times remembered per run (for its later instances on this worker), and how many runs.
_TIMES_PER_RUN = 16
_RUNS_REMEMBERED = 20_000
# Refusals of one run's activations for their time (the age check, and "started before a
# refusal") before both are given up for the run, unless a live task in between ran as it started.
MAX_TIMEOUT_REFUSALS = 3
# After a refusal, how long a task that started before it may still be a dropped one, for a
# run whose task timeout is unknown (the server's default).
DROP_WINDOW_S = 10.0


class _LiveTimes:
    """The workflow times of live activations this worker ran, per run, across the run's instances,
    and how often a run's activations were refused for their age."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, deque[tuple[int, int]]] = {}
        self._age_refusals: dict[str, int] = {}
        self._refused_at: dict[str, float] = {}  # run -> when (wall clock) this worker last refused one of its activations
        self._last_refused_start: dict[str, tuple[int, int]] = {}  # run -> the task start last refused for time

    def note_refusal(self, run_id: str, at: float) -> None:
        with self._lock:
            self._refused_at.pop(run_id, None)
            self._refused_at[run_id] = at
            if len(self._refused_at) > _RUNS_REMEMBERED:
                self._refused_at.pop(next(iter(self._refused_at)))

    def last_refusal(self, run_id: str) -> float | None:
        with self._lock:
            return self._refused_at.get(run_id)

    def seen(self, run_id: str, at: tuple[int, int]) -> bool:
        with self._lock:
            times = self._by_run.get(run_id)
            return times is not None and at in times

    def add(self, run_id: str, at: tuple[int, int]) -> None:
        with self._lock:
            times = self._by_run.get(run_id)
            if times is None:
                if len(self._by_run) >= _RUNS_REMEMBERED:
                    self._by_run.pop(next(iter(self._by_run)))  # the oldest run first
                times = self._by_run[run_id] = deque(maxlen=_TIMES_PER_RUN)
            if not times or times[-1] != at:
                times.append(at)

    def clock_agrees(self, run_id: str) -> None:
        """A live task of the run ran within a second of its start by this worker's clock: the
        clocks agree, so earlier refusals for time were not the clock's doing (count them again)."""
        if run_id not in self._age_refusals:  # every live task comes here: no lock when there is nothing to forget
            return
        with self._lock:
            self._age_refusals.pop(run_id, None)

    def age_checked(self, run_id: str) -> bool:
        """False once the time checks refused MAX_TIMEOUT_REFUSALS of the run's activations with no
        live task in between that ran as it started: a worker clock far ahead of the server's would
        otherwise refuse every real task of a run rebuilt here."""
        with self._lock:
            return self._age_refusals.get(run_id, 0) < MAX_TIMEOUT_REFUSALS

    def refused_for_age(self, run_id: str, started: tuple[int, int] | None = None) -> None:
        """Count a refusal for time. Copies of one task's start (several queries carrying the same
        dropped task) count once: a clock far ahead shows as refusals of different, later starts."""
        with self._lock:
            if started is not None:
                if self._last_refused_start.get(run_id) == started:
                    return
                self._last_refused_start[run_id] = started
                if len(self._last_refused_start) > _RUNS_REMEMBERED:
                    self._last_refused_start.pop(next(iter(self._last_refused_start)))
            count = self._age_refusals[run_id] = self._age_refusals.get(run_id, 0) + 1
            if len(self._age_refusals) > _RUNS_REMEMBERED:
                self._age_refusals.pop(next(iter(self._age_refusals)))
        if count == MAX_TIMEOUT_REFUSALS:
            logger.warning("run %s: %d activations refused as too old; is this worker's clock ahead of the "
                           "server's? Their age is not checked for this run any more", run_id, count)


def is_dropped_task_replay(
    act: WorkflowActivation,
    worker_started: float,
    times: _LiveTimes,
    *,
    first_live: bool,
    task_timeout_s: float | None = None,
    now: float | None = None,
) -> str | None:
    """Why `act` can only be a query's partial task whose events end with a dropped task's start, or None.

    `worker_started`: when this worker's runner was made (wall clock, seconds); `first_live`: no
    live activation of this instance ran before (a rebuilt run meets a query's events there);
    `task_timeout_s`: the run's workflow task timeout. Refusing for age is counted in `times`.
    """
    if act.is_replaying or not _has_work(act):
        return None
    started_at = act.timestamp.seconds + act.timestamp.nanos / 1e9
    if started_at < worker_started - CLOCK_MARGIN_S:
        return "its workflow time is from before this worker began (a task another worker started and dropped)"
    if not first_live:
        return None
    if times.seen(act.run_id, (act.timestamp.seconds, act.timestamp.nanos)):
        return "its workflow time is that of a task this worker already ran for the run (a task it dropped)"
    now = time.time() if now is None else now
    refused_at = times.last_refusal(act.run_id)
    if (
        refused_at is not None
        and started_at < refused_at
        and now - refused_at < (task_timeout_s or DROP_WINDOW_S) + CLOCK_MARGIN_S
        and times.age_checked(act.run_id)
    ):
        # Compared with this worker's clock, like the age below: counted with it, so a worker
        # clock far ahead of the server's stops refusing after a few.
        times.refused_for_age(act.run_id, (act.timestamp.seconds, act.timestamp.nanos))
        return ("its task started before this worker refused an activation of the run, which evicted it "
                "(core may have dropped that task and be running a query's copy of its start)")
    if task_timeout_s and now - started_at >= task_timeout_s and times.age_checked(act.run_id):
        # The task that started then has timed out already (its timeout is in the history this came with).
        times.refused_for_age(act.run_id, (act.timestamp.seconds, act.timestamp.nanos))
        return f"its workflow time is at least the task timeout ({task_timeout_s:g} s) old: a task that timed out (dropped before it ran here)"
    return None


def _has_work(act: WorkflowActivation) -> bool:
    return any(job.WhichOneof("variant") not in ("query_workflow", "remove_from_cache") for job in act.jobs)


class _GuardedInstance(WorkflowInstance):
    def __init__(
        self,
        inner: WorkflowInstance,
        workflow_type: str,
        context_free: bool = False,
        *,
        worker_started: float = 0.0,
        live_times: _LiveTimes | None = None,
        task_timeout_s: float | None = None,
        workflow_id: str = "",
        on_nondeterminism: Callable[[str, str, str, str], None] | None = None,
    ) -> None:
        self._inner = inner
        self._workflow_id = workflow_id
        self._on_nondeterminism = on_nondeterminism
        self._workflow_type = workflow_type
        self._context_free = context_free
        self._previous: tuple[int, int, int] | None = None
        self._worker_started = worker_started
        self._live_times = live_times if live_times is not None else _LiveTimes()
        self._ran_live = False
        self._task_timeout_s = task_timeout_s

    def activate(self, act: WorkflowActivation) -> WorkflowActivationCompletion:
        if self._on_nondeterminism is not None:
            for job in act.jobs:
                if job.HasField("remove_from_cache") and job.remove_from_cache.reason == RemoveFromCache.EvictionReason.NONDETERMINISM:
                    try:  # an eviction that raises is retried by the SDK for ever: never let the notice fail it
                        self._on_nondeterminism(self._workflow_id, act.run_id, self._workflow_type, job.remove_from_cache.message)
                    except Exception:
                        logger.exception("%s %s: could not report its nondeterminism eviction", self._workflow_type, act.run_id)
        why = "a query carried unhandled events" if is_partial_task(self._previous, act) else None
        why = why or is_dropped_task_replay(
            act, self._worker_started, self._live_times, first_live=not self._ran_live, task_timeout_s=self._task_timeout_s
        )
        if why is not None:
            global _refused
            with _lock:
                _refused += 1
            PARTIAL_TASKS_REFUSED.labels(workflow_type=self._workflow_type).inc()
            self._live_times.note_refusal(act.run_id, time.time())
            logger.warning(
                "%s %s: refused a partial workflow task (history %d, last handled %d): %s; "
                "the run is rebuilt by its next workflow task",
                self._workflow_type, act.run_id, act.history_length, self._previous[2] if self._previous else -1, why,
            )
            failure = ApiFailure(message=REFUSAL)
            failure.application_failure_info.SetInParent()
            return WorkflowActivationCompletion(run_id=act.run_id, failed=Failure(failure=failure))
        if _has_work(act):
            self._previous = (act.timestamp.seconds, act.timestamp.nanos, act.history_length)
            if not act.is_replaying:
                self._ran_live = True
                self._live_times.add(act.run_id, (act.timestamp.seconds, act.timestamp.nanos))
                if abs(time.time() - (act.timestamp.seconds + act.timestamp.nanos / 1e9)) < CLOCK_MARGIN_S:
                    self._live_times.clock_agrees(act.run_id)
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

    def __init__(
        self, inner: WorkflowRunner, *, context_free: bool = False, on_nondeterminism: Callable[[str, str, str, str], None] | None = None
    ) -> None:
        self.inner = inner
        # Told (workflow id, run id, type, message) when the SDK evicts a run whose replay
        # failed with a nondeterminism error (`self_heal.SelfHealer.notice`).
        self.on_nondeterminism = on_nondeterminism
        self.context_free = context_free
        self.started = time.time()  # no real task of this worker starts before it
        self.live_times = _LiveTimes()

    def prepare_workflow(self, defn: Any) -> None:
        self.inner.prepare_workflow(defn)

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return _GuardedInstance(
            self.inner.create_instance(det), det.info.workflow_type, self.context_free,
            worker_started=self.started, live_times=self.live_times,
            task_timeout_s=det.info.task_timeout.total_seconds() if det.info.task_timeout else None,
            workflow_id=det.info.workflow_id, on_nondeterminism=self.on_nondeterminism,
        )

    def set_worker_level_failure_exception_types(self, types: Any) -> None:
        self.inner.set_worker_level_failure_exception_types(types)


__all__ = ["GuardedWorkflowRunner", "REFUSAL", "is_dropped_task_replay", "is_partial_task", "refused_count"]
