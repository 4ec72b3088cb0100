"""CapabilityTaskWorkflow: a supervisor's child that runs one task by capability ref.

Each attempt is one activity, `lease_and_invoke`: it asks the pool for a lease
(waiting in the pool's FIFO queue when none is free, heartbeating while it
waits), invokes the agent over HTTP, renews the lease every third of its TTL
while the task runs (the pool's `renew` update: a lease the pool ended is seen
in the reply, and the task fails over), and releases the lease. A lease reaches
this workflow by that one road whether it was granted at once or from the queue.

If the agent dies mid-task (unreachable, or the pool revokes the lease because
the agent was declared Terminated) the task fails over to another agent,
excluding the ones that failed, up to `max_attempts`. The pool tells a holder
workflow of a revocation by one signal, `lease_revoked`. Anyone may send one, and
while the activity runs its lease is unknown here, so a notice is believed only
when the pool says the request holds nothing any more (`request_holds`, by the
request's secret id): then the activity is stopped and the task fails over. A
notice for a request that still holds its lease or waits in the queue is refused
and the attempt goes on; after FOREIGN_NOTICES_MAX refusals notices are refused
unasked (the activity's own renewals still see a real revocation).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, NoReturn

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

from agentroster.errors import CapabilityUnknownError, PoolExhaustedError, UnknownTaskTypeError
from agentroster.messages import (
    AcquireReply,
    LeaseAndInvoke,
    LeaseInvokeFailure,
    LeaseInvokeOutcome,
    LeaseRevoked,
    PoolAcquireRequest,
    RecoverLease,
    RequestHolds,
)
from agentroster.models import AttemptFailure, Lease, TaskInput, TaskResult
from agentroster.vocabulary.wire import (
    ACQUIRE_FAILED,
    AGENTS_SERVED,
    CAPABILITY_ATTRIBUTE_MAX_BYTES,
    CAPABILITY_TASK_FAILED,
    CAPABILITY_UNKNOWN,
    CIRCUIT_OPEN,
    FAILOVER_ERRORS,
    LEASE_AND_INVOKE,
    LEASE_LOST,
    POOL_EXHAUSTED,
    POOL_SHUT_DOWN,
    RECOVER_LEASE,
    REQUEST_HOLDS,
    UNKNOWN_TASK_TYPE,
)
import agentroster.workflows.messages as messages

REFUSALS_KEPT = 20
# Notices refused after a look at the pool, past which a task refuses them unasked.
FOREIGN_NOTICES_MAX = 10


@workflow.defn(name="CapabilityTaskWorkflow")
class CapabilityTaskWorkflow:
    def __init__(self) -> None:
        self._refused: list[str] = []
        self._leases: set[str] = set()  # leases this task held (reported by its activities)
        self._running = False  # a `lease_and_invoke` is in flight
        self._revoked: LeaseRevoked | None = None  # a notice that came while it ran
        self._foreign = 0  # notices the pool contradicted
        self._served: list[str] = []  # agents its attempts ran on, when the input asks for AgentsServed

    # The signal takes `*args` (see workflows/messages.py) and is refused, never raised,
    # when malformed. Anyone can signal a workflow, so a notice only stops the attempt in
    # flight, whose lease is then looked up in the pool (`_attempt`).
    @workflow.signal(name="lease_revoked")
    def lease_revoked(self, *args: Any) -> None:
        """The pool revoked one of our leases (its agent died, or it expired). Argument: a LeaseRevoked."""
        try:
            notice = messages.model("lease_revoked", LeaseRevoked, messages.one("lease_revoked", args))
        except Exception as exc:
            self._refuse("lease_revoked", str(exc).removeprefix("lease_revoked: "))
            return
        if not self._running or self._revoked is not None or self._foreign >= FOREIGN_NOTICES_MAX:
            self._refuse("lease_revoked", f"lease {notice.lease_id!r} is not one this task holds")
            return
        self._revoked = notice

    @workflow.query(name="refusals")
    def refusals(self) -> list[str]:
        """Malformed or foreign signals this task refused, with the reason."""
        return list(self._refused)

    @workflow.run
    async def run(self, task: TaskInput) -> TaskResult:
        task_type = task.task_type
        task = self._route(task)
        excluded: list[str] = []
        failures: list[AttemptFailure] = []
        for attempt in range(1, task.max_attempts + 1):
            try:
                lease, output = await self._attempt(task, excluded, attempt)
            except _Failover as failover:
                where = f" on {failover.agent_id}" if failover.agent_id else ""
                failures.append(AttemptFailure(attempt=attempt, agent_id=failover.agent_id, error=str(failover)))
                workflow.logger.warning("task %s: attempt %d failed over%s: %s", task.ref, attempt, where, failover)
                if failover.agent_id:
                    excluded.append(failover.agent_id)
                    self._mark_served(task, failover.agent_id)
                continue
            self._mark_served(task, lease.agent_id)
            return TaskResult(
                ref=task.ref,
                agent_id=lease.agent_id,
                capability=lease.capability,
                version=lease.version,
                output=output,
                attempts=attempt,
                pool=lease.pool,
                task_type=task_type,
                failures=failures,
            )
        raise ApplicationError(
            f"{task.ref}: no agent completed the task in {task.max_attempts} attempt(s): "
            + "; ".join(f"attempt {f.attempt}{f' on {f.agent_id}' if f.agent_id else ''}: {f.error}" for f in failures),
            type=CAPABILITY_TASK_FAILED,
            non_retryable=True,
        )

    def _mark_served(self, task: TaskInput, agent_id: str) -> None:
        """Name the agent in AgentsServed (one upsert, a billed action, per new agent), while the
        list stays under the server's 2,048 bytes for a keyword list. Only a task whose input asks
        for it (`record_agents_served`) pays for it: the agent is unknown when the task starts,
        where search attributes would be free."""
        if not task.record_agents_served or agent_id in self._served:
            return
        if sum(len(a.encode()) for a in self._served) + len(agent_id.encode()) > CAPABILITY_ATTRIBUTE_MAX_BYTES:
            return
        self._served.append(agent_id)
        workflow.upsert_search_attributes([AGENTS_SERVED.value_set(list(self._served))])

    @staticmethod
    def _route(task: TaskInput) -> TaskInput:
        """A task given by type: its ref and pool from the routing table in its own input.

        Pure and in the input, so replay resolves it the same way. An unknown type
        fails the workflow at once, non-retryable: retrying cannot teach the table.
        """
        if task.task_type is None:
            return task
        try:
            routed = task.routed()
        except UnknownTaskTypeError as exc:
            raise ApplicationError(
                str(exc), {"task_type": exc.task_type, "known": exc.known}, type=UNKNOWN_TASK_TYPE, non_retryable=True
            ) from None
        workflow.logger.info("task type %s routed to %s in pool %s", task.task_type, routed.ref, routed.pool)
        return routed

    async def _attempt(self, task: TaskInput, excluded: list[str], attempt: int) -> tuple[Lease, Any]:
        """One `lease_and_invoke`: (lease, checked output) once it ran the task and released its
        lease; _Failover when this attempt's agent failed; the task's error otherwise.

        The activity's lease is unknown here until it ends. A `lease_revoked` meanwhile is
        perhaps for it: the pool is asked what the request holds (`request_holds`). Nothing:
        the pool ended our lease, so the activity is stopped, anything left is given back
        (`recover_lease`) and the task fails over from the notice's agent. A lease or a place
        in the queue: the notice was not ours (refused) and the attempt goes on.
        """
        key = str(attempt)
        request = PoolAcquireRequest(
            pool=task.pool,
            ref=task.ref,
            wait_s=task.acquire_timeout_s,
            lease_ttl_s=task.lease_ttl_s,
            holder=workflow.info().workflow_id,
            holder_is_workflow=True,
            exclude_agents=excluded,
            max_cost_class=task.max_cost_class,
        )
        self._running = True
        try:
            run = workflow.start_activity(
                LEASE_AND_INVOKE,
                LeaseAndInvoke(request=request, payload=task.payload, timeout_s=task.task_timeout_s, key=key),
                result_type=LeaseInvokeOutcome,
                summary=f"{task.ref} in pool {task.pool}",
                start_to_close_timeout=timedelta(seconds=task.acquire_timeout_s + task.task_timeout_s + 30),
                heartbeat_timeout=timedelta(seconds=5),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
            while True:
                watcher = asyncio.ensure_future(workflow.wait_condition(lambda: self._revoked is not None))
                try:
                    done, _ = await workflow.wait([run, watcher], return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:  # the task itself is cancelled: give back what the activity took
                    watcher.cancel()
                    run.cancel()
                    await self._recover(task, key)
                    raise
                if run in done:
                    break
                notice = self._revoked
                assert notice is not None
                if await self._still_holds(task, key):
                    self._foreign += 1
                    self._refuse("lease_revoked", f"lease {notice.lease_id!r}: the pool says this task's request still holds its lease or place")
                    self._revoked = None
                    continue
                run.cancel()
                await self._recover(task, key)
                raise _Failover(f"lease revoked: {notice.reason}", notice.agent_id)
            watcher.cancel()
            try:
                outcome = run.result()
            except ActivityError as exc:
                failed = await self._failed(task, key, exc)
                if failed is exc:
                    raise
                raise failed from exc
        finally:
            self._running = False
            if self._revoked is not None and self._revoked.lease_id not in self._leases:
                self._refuse("lease_revoked", f"lease {self._revoked.lease_id!r} is not one this task holds")
            self._revoked = None
        if outcome.lease is None:
            self._exhausted(task, outcome.reply or AcquireReply())
        self._leases.add(outcome.lease.lease_id)
        return outcome.lease, outcome.output

    async def _failed(self, task: TaskInput, key: str, exc: ActivityError) -> Exception:
        """What a failed `lease_and_invoke` means: a _Failover, or the error the task fails with.
        The activity released the lease it names in its details; one it could not name (it
        ended before it had a lease, or without a word: timed out, its worker gone) is looked up."""
        cause = exc.cause
        failure: LeaseInvokeFailure | None = None
        if isinstance(cause, ApplicationError) and cause.details:
            try:
                failure = LeaseInvokeFailure.model_validate(cause.details[0])
            except Exception:
                failure = None
        if failure is None:
            if isinstance(cause, ApplicationError) and cause.type == POOL_SHUT_DOWN:  # it holds nothing: the pool ended its place
                return ApplicationError(f"{task.ref}: {cause.message}", type=POOL_SHUT_DOWN, non_retryable=True)
            await self._recover(task, key)
            if isinstance(cause, ApplicationError) and cause.type == ACQUIRE_FAILED:
                return _Failover(cause.message)
            return exc
        self._leases.add(failure.lease.lease_id)
        kind = cause.type if isinstance(cause, ApplicationError) else None
        message = cause.message if isinstance(cause, ApplicationError) else str(exc)
        if kind in FAILOVER_ERRORS or kind == LEASE_LOST:
            return _Failover(message, failure.lease.agent_id)
        return ApplicationError(message, type=kind or CAPABILITY_TASK_FAILED, non_retryable=True)

    async def _still_holds(self, task: TaskInput, key: str) -> bool:
        """Whether the attempt's request still holds a lease or waits in the queue (`request_holds`)."""
        try:
            holds = await workflow.execute_activity(
                REQUEST_HOLDS,
                RecoverLease(pool=task.pool, ref=task.ref, key=key),
                result_type=RequestHolds,
                summary=f"check a revocation notice for attempt {key}",
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError:  # the pool cannot say (shut down): believe the notice
            return False
        return holds.lease is not None or holds.queued

    async def _recover(self, task: TaskInput, key: str) -> Lease | None:
        """Give back the lease a `lease_and_invoke` took but did not report (the `recover_lease` activity)."""
        try:
            return await workflow.execute_activity(
                RECOVER_LEASE,
                RecoverLease(pool=task.pool, ref=task.ref, key=key),
                result_type=Lease | None,  # type: ignore[arg-type]
                summary=f"give back the lease of attempt {key}",
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=0, maximum_interval=timedelta(seconds=10)),
            )
        except ActivityError as exc:  # its pool has shut down: it holds no lease any more
            workflow.logger.warning("task %s: could not look up the lease of attempt %s: %s", task.ref, key, exc.cause or exc)
            return None

    def _refuse(self, kind: str, reason: str) -> None:
        text = f"{kind} refused: {reason}"
        workflow.logger.warning(text)
        self._refused = (self._refused + [text])[-REFUSALS_KEPT:]

    @staticmethod
    def _exhausted(task: TaskInput, reply: AcquireReply) -> NoReturn:
        if reply.circuit_open:
            raise ApplicationError(
                f"circuit open for {task.ref!r} in pool {task.pool!r}: {reply.circuit_open}", type=CIRCUIT_OPEN, non_retryable=True
            )
        if reply.unknown_capability:
            unknown = CapabilityUnknownError(task.ref, pool=task.pool, report=reply.report)
            raise ApplicationError(str(unknown), unknown.report.model_dump(), type=CAPABILITY_UNKNOWN, non_retryable=True)
        error = PoolExhaustedError(task.ref, waited_s=task.acquire_timeout_s, report=reply.report, pool=task.pool)
        raise ApplicationError(str(error), error.report.model_dump(), type=POOL_EXHAUSTED, non_retryable=True)


class _Failover(Exception):
    """This agent cannot finish the task; try another (`agent_id`, when known, is not tried again)."""

    def __init__(self, message: str, agent_id: str | None = None) -> None:
        super().__init__(message)
        self.agent_id = agent_id
