"""CapabilityTaskWorkflow: a supervisor's child that runs one task by capability ref.

Acquire a lease, invoke the agent over HTTP (through an activity) while
renewing the lease every third of its TTL, release in every outcome. If the agent dies mid-task (unreachable, or the pool revokes the
lease because the agent was declared Terminated) it fails over to another
agent, excluding the ones that failed, up to `max_attempts`.

The fast path (patch `lease-fast-path`, every run that starts with it): the
lease is requested by a local activity (no activity task, no workflow task of
its own: the invoke activity is scheduled in the same workflow task), and the
invoke activity releases the lease itself once the output is checked
(`invoke_and_release`); only when it did not (a failure, a failover, a
cancellation) does the workflow release with the `release_lease` activity. A
queued request still waits in the workflow for `lease_granted`, holding no
activity slot; the lease token is still signed in the invoke activity.

The one-activity path (patch `lease-in-invoke`, every run that starts with it):
the lease request, the invoke and the release are one activity,
`lease_and_invoke`, scheduled in the run's first workflow task, so a task that
gets a lease at once runs the shape of a child that only calls the agent: one
activity, two workflow tasks, no local activity, no renewal timer (the activity
renews the lease while the task runs, by update, and so sees a lease the pool
ended). No lease at once: the pool's ticket comes back and the workflow waits
for `lease_granted` as above, then invokes as on the fast path. A lease the
activity took but could not report (it was cancelled, or its worker died) is
found by the request's secret id and given back (`recover_lease`).

Every run whose input says `protocol: 2` (all our models write) takes the
one-activity path with no marker at all: the marker and the TemporalChangeVersion
upsert the SDK adds to it were two of a task's thirteen history events and two of
its billed actions. Inputs without the key decide by the marker, as recorded.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, NoReturn

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from agentroster.contracts import (
        AcquireReply,
        CancelTicket,
        InvokeInput,
        InvokeOutcome,
        Lease,
        LeaseAndInvoke,
        LeaseGranted,
        CapabilityUnknownError,
        LeaseInvokeFailure,
        LeaseInvokeOutcome,
        LeaseRevoked,
        PoolAcquireRequest,
        PoolExhaustedError,
        RecoverLease,
        RenewRequest,
        TaskInput,
        TaskResult,
        TicketEnded,
        TicketStatus,
        UnknownTaskTypeError,
    )
    from agentroster.wire import (
        CANCEL_TICKET,
        CAPABILITY_TASK_FAILED,
        CAPABILITY_UNKNOWN,
        CIRCUIT_OPEN,
        FAILOVER_ERRORS,
        INVOKE_AGENT,
        INVOKE_AND_RELEASE,
        ACQUIRE_FAILED,
        LEASE_AND_INVOKE,
        LEASE_LOST,
        POOL_EXHAUSTED,
        POOL_RENEW_SIGNAL,
        POOL_SHUT_DOWN,
        RECOVER_LEASE,
        RELEASE_LEASE,
        REQUEST_LEASE,
        UNKNOWN_TASK_TYPE,
        pool_workflow_id,
    )
    from agentroster.core.shards import shard_of_id
    from agentroster.workflows import messages
    from agentroster.workflows.messages import Refused

# Histories recorded before lease renewal existed used a TTL of task_timeout + 60 s
# and never renewed; `workflow.patched` keeps them replaying.
RENEWAL_PATCH = "lease-renewal"
# Runs that start with this marker take the fast path (see the module's docstring); it
# implies renewal, so they record no `lease-renewal` marker (one marker and one
# TemporalChangeVersion upsert per run, not two).
FAST_PATH_PATCH = "lease-fast-path"
# Runs that start with this marker ask for the lease, invoke and release in one activity
# (`lease_and_invoke`; see the module's docstring). It implies the fast path and renewal:
# one marker per run.
ONE_ACTIVITY_PATCH = "lease-in-invoke"
REFUSALS_KEPT = 20
# Notices for a ticket or lease this task cannot know yet (its `lease_and_invoke` is in flight) kept until it can.
EARLY_NOTICES_KEPT = 8


@workflow.defn(name="CapabilityTaskWorkflow")
class CapabilityTaskWorkflow:
    def __init__(self) -> None:
        self._revoked: dict[str, str] = {}
        self._granted: dict[str, Lease] = {}
        self._ended: dict[str, str] = {}  # ticket -> why the pool ended our place (it shuts down)
        self._tickets: set[str] = set()  # queue places this task waits on
        self._leases: set[str] = set()  # leases this task holds or held
        self._refused: list[str] = []
        self._renewing = False
        self._fast = False
        self._one: bool | None = None  # the one-activity path (decided at the first attempt)
        # While a `lease_and_invoke` is in flight its ticket or lease is not known here yet:
        # notices that name an unknown one are kept (a few) until the activity says which is ours.
        self._requesting = False
        self._early_grants: dict[str, Lease] = {}
        self._early_ends: dict[str, str] = {}
        self._unknown_revoked: LeaseRevoked | None = None

    # Signals take `*args` (see workflows/messages.py) and are refused, never raised,
    # when malformed. Anyone can signal a workflow, so only the ticket we wait on and
    # the lease we hold are believed.
    def _signal(self, kind: str, apply: Any, args: tuple[Any, ...]) -> None:
        try:
            apply(args)
        except Exception as exc:
            text = f"{kind} refused: {str(exc).removeprefix(f'{kind}: ')}"
            workflow.logger.warning(text)
            self._refused = (self._refused + [text])[-REFUSALS_KEPT:]

    @workflow.signal(name="lease_granted")
    def lease_granted(self, *args: Any) -> None:
        """The pool served our place in its queue. Argument: a LeaseGranted."""

        def apply(a: tuple[Any, ...]) -> None:
            notice = messages.model("lease_granted", LeaseGranted, messages.one("lease_granted", a))
            if notice.ticket not in self._tickets:
                if self._requesting and len(self._early_grants) < EARLY_NOTICES_KEPT:
                    self._early_grants[notice.ticket] = notice.lease  # ours only if the activity says this ticket
                    return
                raise Refused(f"lease_granted: ticket {notice.ticket!r} is not one this task waits on")
            self._granted[notice.ticket] = notice.lease

        self._signal("lease_granted", apply, args)

    @workflow.signal(name="ticket_ended")
    def ticket_ended(self, *args: Any) -> None:
        """The pool ended our place in its queue without a lease (it shuts down). Argument: a TicketEnded."""

        def apply(a: tuple[Any, ...]) -> None:
            notice = messages.model("ticket_ended", TicketEnded, messages.one("ticket_ended", a))
            if notice.ticket not in self._tickets:
                if self._requesting and len(self._early_ends) < EARLY_NOTICES_KEPT:
                    self._early_ends[notice.ticket] = notice.reason
                    return
                raise Refused(f"ticket_ended: ticket {notice.ticket!r} is not one this task waits on")
            self._ended[notice.ticket] = notice.reason

        self._signal("ticket_ended", apply, args)

    @workflow.signal(name="lease_revoked")
    def lease_revoked(self, *args: Any) -> None:
        """The pool revoked one of our leases (its agent died, or it expired). Argument: a LeaseRevoked."""

        def apply(a: tuple[Any, ...]) -> None:
            notice = messages.model("lease_revoked", LeaseRevoked, messages.one("lease_revoked", a))
            if notice.lease_id not in self._leases:
                if self._requesting and self._unknown_revoked is None:
                    # Perhaps the lease our activity holds: it is stopped and the lease looked up (`_lease_and_invoke`).
                    self._unknown_revoked = notice
                    return
                raise Refused(f"lease_revoked: lease {notice.lease_id!r} is not one this task holds")
            self._revoked[notice.lease_id] = notice.reason

        self._signal("lease_revoked", apply, args)

    @workflow.query(name="refusals")
    def refusals(self) -> list[str]:
        """Malformed or foreign signals this task refused, with the reason."""
        return list(self._refused)

    @workflow.run
    async def run(self, task: TaskInput) -> TaskResult:
        task_type = task.task_type
        protocol = task.written_protocol  # of the input as written (routing makes a copy)
        task = self._route(task)
        excluded: list[str] = []
        failures: list[str] = []
        for attempt in range(1, task.max_attempts + 1):
            if self._one is None:
                # An input of protocol 2 says the run was started by code that takes the one-activity
                # path: no marker. Older inputs decide by one marker per run, as they were recorded
                # (the one-activity path implies the fast path and renewal).
                self._one = protocol >= 2 or workflow.patched(ONE_ACTIVITY_PATCH)
                if self._one:
                    self._fast = self._renewing = True
            if self._one:
                try:
                    ran = await self._lease_and_invoke(task, excluded, attempt)
                except _Failover as failover:
                    where = f" on {failover.agent_id}" if failover.agent_id else ""
                    failures.append(f"attempt {attempt}{where}: {failover}")
                    workflow.logger.warning("task %s: attempt %d failed over%s: %s", task.ref, attempt, where, failover)
                    if failover.agent_id:
                        excluded.append(failover.agent_id)
                    continue
                if isinstance(ran, tuple):
                    return self._result(task, task_type, ran[0], ran[1], attempt)
                lease = ran  # granted through the queue: invoked below, as on the fast path
            else:
                lease = await self._acquire(task, excluded)
            released = False  # by the invoke activity (the fast path), once the output was checked
            try:
                output, released = await self._invoke(task, lease)
            except _Failover as failover:
                failures.append(f"attempt {attempt} on {lease.agent_id}: {failover}")
                workflow.logger.warning("task %s: failing over from %s: %s", task.ref, lease.agent_id, failover)
                excluded.append(lease.agent_id)
                continue
            finally:
                if not released:
                    await self._release(lease)
            return self._result(task, task_type, lease, output, attempt)
        raise ApplicationError(
            f"{task.ref}: no agent completed the task in {task.max_attempts} attempt(s): " + "; ".join(failures),
            type=CAPABILITY_TASK_FAILED,
            non_retryable=True,
        )

    @staticmethod
    def _result(task: TaskInput, task_type: str | None, lease: Lease, output: Any, attempt: int) -> TaskResult:
        return TaskResult(
            ref=task.ref,
            agent_id=lease.agent_id,
            capability=lease.capability,
            version=lease.version,
            output=output,
            attempts=attempt,
            pool=lease.pool,
            task_type=task_type,
        )

    async def _release(self, lease: Lease) -> None:
        await workflow.execute_activity(
            RELEASE_LEASE,
            lease,
            summary=f"release lease on {lease.agent_id}",
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=0, maximum_interval=timedelta(seconds=10)),
        )

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

    async def _acquire(self, task: TaskInput, excluded: list[str]) -> Lease:
        """A lease now, or a place in the pool's queue and a wait for `lease_granted`.

        The wait is a workflow condition, not an activity: queued supervisors hold
        no worker slots, so they can never starve the releases that would serve them.
        """
        self._fast = workflow.patched(FAST_PATH_PATCH)
        self._renewing = self._fast or workflow.patched(RENEWAL_PATCH)
        request = PoolAcquireRequest(
            pool=task.pool,
            ref=task.ref,
            wait_s=task.acquire_timeout_s,
            lease_ttl_s=task.lease_ttl_s if self._renewing else task.task_timeout_s + 60,
            holder=workflow.info().workflow_id,
            holder_is_workflow=True,
            exclude_agents=excluded,
        )
        options: dict[str, Any] = {
            "result_type": AcquireReply,
            "start_to_close_timeout": timedelta(seconds=60),
            "retry_policy": RetryPolicy(maximum_interval=timedelta(seconds=10)),
            "summary": f"lease {task.ref} in pool {task.pool}",
        }
        # The fast path asks in a local activity: the pool's answer (a lease or a ticket,
        # never a wait) comes back within this workflow task, whose commands then
        # schedule the invoke activity at once.
        reply: AcquireReply = await (
            workflow.execute_local_activity(REQUEST_LEASE, request, **options)
            if self._fast
            else workflow.execute_activity(REQUEST_LEASE, request, **options)
        )
        if reply.lease is not None:
            self._leases.add(reply.lease.lease_id)
            return reply.lease
        if reply.ticket is None:
            self._exhausted(task, reply)
        self._tickets.add(reply.ticket)
        return await self._wait_for_grant(task, reply.ticket)

    async def _wait_for_grant(self, task: TaskInput, ticket: str) -> Lease:
        """Our place in the pool's queue: wait for `lease_granted` (or `ticket_ended`), give it up at the timeout."""
        try:
            await workflow.wait_condition(lambda: ticket in self._granted or ticket in self._ended, timeout=task.acquire_timeout_s)
        except asyncio.TimeoutError:
            status: TicketStatus = await workflow.execute_activity(
                CANCEL_TICKET,
                CancelTicket(pool=task.pool, ticket=ticket),
                result_type=TicketStatus,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
            )
            if status.lease is not None:  # granted just as we gave up: keep it
                self._leases.add(status.lease.lease_id)
                return status.lease
            self._exhausted(task, AcquireReply(report=status.report))
        if ticket not in self._granted:  # only `ticket_ended` (never sent to runs recorded before it existed)
            raise ApplicationError(
                f"{task.ref}: pool {task.pool!r} ended our place in its queue: {self._ended[ticket]}",
                type=POOL_SHUT_DOWN,
                non_retryable=True,
            )
        lease = self._granted.pop(ticket)
        self._leases.add(lease.lease_id)
        return lease

    async def _lease_and_invoke(self, task: TaskInput, excluded: list[str], attempt: int) -> tuple[Lease, Any] | Lease:
        """The one-activity path: (lease, checked output) when `lease_and_invoke` ran the task and
        released its lease; the Lease when none came at once and the queue granted one (the
        caller invokes it, as on the fast path); _Failover when this attempt's agent failed.

        The activity's lease is unknown here until it ends. A `lease_revoked` for a lease this
        task never saw, meanwhile, is perhaps for it: the activity is stopped and its lease
        looked up (`recover_lease`, by the request's secret id, which releases it). Gone: the
        pool had ended it, the notice was ours, fail over from its agent. Still held: the
        notice was not ours (refused); the attempt is retried on any agent.
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
        )
        self._requesting = True
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
            watcher = asyncio.ensure_future(workflow.wait_condition(lambda: self._unknown_revoked is not None))
            try:
                done, _ = await workflow.wait([run, watcher], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the task itself is cancelled: give back what the activity took
                watcher.cancel()
                run.cancel()
                await self._recover(task, key)
                raise
            if run not in done:
                run.cancel()
                notice = self._unknown_revoked
                assert notice is not None
                if await self._recover(task, key) is None:
                    raise _Failover(f"lease revoked: {notice.reason}", notice.agent_id)
                self._refuse("lease_revoked", f"lease {notice.lease_id!r} is not the one this task held; the attempt it stopped is retried")
                raise _Failover("stopped by a lease_revoked notice for a lease this task did not hold")
            watcher.cancel()
            try:
                outcome = run.result()
            except ActivityError as exc:
                failed = await self._lease_and_invoke_failed(task, key, exc)
                if failed is exc:
                    raise
                raise failed from exc
            if outcome.lease is not None:
                self._leases.add(outcome.lease.lease_id)
                if not outcome.released:
                    await self._release(outcome.lease)
                return outcome.lease, outcome.output
            reply = outcome.reply or AcquireReply()
            if reply.ticket is None:
                self._exhausted(task, reply)
            ticket = reply.ticket
            self._tickets.add(ticket)
            if ticket in self._early_grants:
                self._granted[ticket] = self._early_grants[ticket]
            if ticket in self._early_ends:
                self._ended[ticket] = self._early_ends[ticket]
        finally:
            self._requesting = False
            self._early_grants.clear()
            self._early_ends.clear()
            if self._unknown_revoked is not None and self._unknown_revoked.lease_id not in self._leases:
                self._refuse("lease_revoked", f"lease {self._unknown_revoked.lease_id!r} is not one this task holds")
            self._unknown_revoked = None
        return await self._wait_for_grant(task, ticket)

    async def _lease_and_invoke_failed(self, task: TaskInput, key: str, exc: ActivityError) -> Exception:
        """What a failed `lease_and_invoke` means: a _Failover, or the error the task fails with.
        Its lease is given back first: released (unless the activity did), or recovered when
        the activity could not say which it was."""
        cause = exc.cause
        failure: LeaseInvokeFailure | None = None
        if isinstance(cause, ApplicationError) and cause.details:
            try:
                failure = LeaseInvokeFailure.model_validate(cause.details[0])
            except Exception:
                failure = None
        if failure is None:
            # Ended before it had a lease (the pool shuts down, or did not answer), or without
            # a word (timed out: its worker is gone; cancelled): the lease it may hold is looked up.
            if not (isinstance(cause, ApplicationError) and cause.type == POOL_SHUT_DOWN):
                await self._recover(task, key)
            if isinstance(cause, ApplicationError) and cause.type == ACQUIRE_FAILED:
                return _Failover(cause.message)
            return exc
        self._leases.add(failure.lease.lease_id)
        if not failure.released:
            await self._release(failure.lease)
        kind = cause.type if isinstance(cause, ApplicationError) else None
        message = cause.message if isinstance(cause, ApplicationError) else str(exc)
        if kind in FAILOVER_ERRORS or kind == LEASE_LOST:
            return _Failover(message, failure.lease.agent_id)
        return ApplicationError(message, type=kind or CAPABILITY_TASK_FAILED, non_retryable=True)

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

    async def _keep_renewed(self, task: TaskInput, lease: Lease) -> None:
        """Renew every third of the TTL while the task runs: a slow task keeps its slot,
        a dead worker stops renewing and the lease expires."""
        # The shard that granted it (`pool/{pool}` for every unsharded lease, as recorded before shards).
        pool = workflow.get_external_workflow_handle(pool_workflow_id(lease.pool, shard_of_id(lease.lease_id)))
        while True:
            await workflow.sleep(task.lease_ttl_s / 3, summary="renew the lease")
            await pool.signal(POOL_RENEW_SIGNAL, RenewRequest(lease_id=lease.lease_id, ttl_s=task.lease_ttl_s))

    async def _invoke(self, task: TaskInput, lease: Lease) -> tuple[Any, bool]:
        """The checked output, and whether the invoke activity released the lease (fast path only)."""
        renewer = asyncio.ensure_future(self._keep_renewed(task, lease)) if self._renewing else None
        try:
            result = await self._invoke_once(task, lease)
        finally:
            if renewer is not None:
                renewer.cancel()
        return (result.output, result.released) if self._fast else (result, False)

    async def _invoke_once(self, task: TaskInput, lease: Lease) -> Any:
        invoke = workflow.start_activity(
            INVOKE_AND_RELEASE if self._fast else INVOKE_AGENT,
            InvokeInput(lease=lease, payload=task.payload, timeout_s=task.task_timeout_s),
            result_type=InvokeOutcome if self._fast else None,
            summary=f"{lease.capability}@{lease.version} on {lease.agent_id}",
            start_to_close_timeout=timedelta(seconds=task.task_timeout_s + 10),
            heartbeat_timeout=timedelta(seconds=5),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        watcher = asyncio.ensure_future(workflow.wait_condition(lambda: lease.lease_id in self._revoked))
        done, _ = await workflow.wait([invoke, watcher], return_when=asyncio.FIRST_COMPLETED)
        if invoke not in done:
            invoke.cancel()
            raise _Failover(f"lease revoked: {self._revoked[lease.lease_id]}")
        watcher.cancel()
        try:
            return invoke.result()
        except ActivityError as exc:
            cause = exc.cause
            kind = cause.type if isinstance(cause, ApplicationError) else None
            if kind in FAILOVER_ERRORS:
                raise _Failover(cause.message if isinstance(cause, ApplicationError) else str(exc)) from exc
            if isinstance(cause, ApplicationError):
                raise ApplicationError(cause.message, type=kind or CAPABILITY_TASK_FAILED, non_retryable=True) from exc
            raise


class _Failover(Exception):
    """This agent cannot finish the task; try another (`agent_id`, when known, is not tried again)."""

    def __init__(self, message: str, agent_id: str | None = None) -> None:
        super().__init__(message)
        self.agent_id = agent_id
