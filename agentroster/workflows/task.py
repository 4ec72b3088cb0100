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
        LeaseGranted,
        CapabilityUnknownError,
        LeaseRevoked,
        PoolAcquireRequest,
        PoolExhaustedError,
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
        POOL_EXHAUSTED,
        POOL_RENEW_SIGNAL,
        POOL_SHUT_DOWN,
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
REFUSALS_KEPT = 20


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
                raise Refused(f"lease_granted: ticket {notice.ticket!r} is not one this task waits on")
            self._granted[notice.ticket] = notice.lease

        self._signal("lease_granted", apply, args)

    @workflow.signal(name="ticket_ended")
    def ticket_ended(self, *args: Any) -> None:
        """The pool ended our place in its queue without a lease (it shuts down). Argument: a TicketEnded."""

        def apply(a: tuple[Any, ...]) -> None:
            notice = messages.model("ticket_ended", TicketEnded, messages.one("ticket_ended", a))
            if notice.ticket not in self._tickets:
                raise Refused(f"ticket_ended: ticket {notice.ticket!r} is not one this task waits on")
            self._ended[notice.ticket] = notice.reason

        self._signal("ticket_ended", apply, args)

    @workflow.signal(name="lease_revoked")
    def lease_revoked(self, *args: Any) -> None:
        """The pool revoked one of our leases (its agent died, or it expired). Argument: a LeaseRevoked."""

        def apply(a: tuple[Any, ...]) -> None:
            notice = messages.model("lease_revoked", LeaseRevoked, messages.one("lease_revoked", a))
            if notice.lease_id not in self._leases:
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
        task = self._route(task)
        excluded: list[str] = []
        failures: list[str] = []
        for attempt in range(1, task.max_attempts + 1):
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
                    await workflow.execute_activity(
                        RELEASE_LEASE,
                        lease,
                        summary=f"release lease on {lease.agent_id}",
                        start_to_close_timeout=timedelta(seconds=30),
                        retry_policy=RetryPolicy(maximum_attempts=0, maximum_interval=timedelta(seconds=10)),
                    )
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
        raise ApplicationError(
            f"{task.ref}: no agent completed the task in {task.max_attempts} attempt(s): " + "; ".join(failures),
            type=CAPABILITY_TASK_FAILED,
            non_retryable=True,
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
        ticket = reply.ticket
        self._tickets.add(ticket)
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
    """This agent cannot finish the task; try another."""
