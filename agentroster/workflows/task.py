"""CapabilityTaskWorkflow: a supervisor's child that runs one task by capability ref.

Acquire a lease, invoke the agent over HTTP (through an activity), release in
every outcome. If the agent dies mid-task (unreachable, or the pool revokes the
lease because the agent was declared Terminated) it fails over to another
agent, excluding the ones that failed, up to `max_attempts`.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, NoReturn

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from agentroster.contracts import (
        AcquireReply,
        CancelTicket,
        InvokeInput,
        Lease,
        LeaseGranted,
        LeaseRevoked,
        PoolAcquireRequest,
        PoolExhaustedError,
        PoolReport,
        TaskInput,
        TaskResult,
        TicketStatus,
    )

# Kept in step with agentroster.activities.roster (not imported: it pulls in aiohttp).
AGENT_UNREACHABLE = "AgentUnreachable"
AGENT_FAILED = "AgentTaskFailed"
INVALID_TASK_INPUT = "InvalidTaskInput"
INVALID_AGENT_OUTPUT = "InvalidAgentOutput"
POOL_EXHAUSTED = "PoolExhaustedError"
FAILOVER_ERRORS = {AGENT_UNREACHABLE, AGENT_FAILED, INVALID_AGENT_OUTPUT}


@workflow.defn(name="CapabilityTaskWorkflow")
class CapabilityTaskWorkflow:
    def __init__(self) -> None:
        self._revoked: dict[str, str] = {}
        self._granted: dict[str, Lease] = {}

    @workflow.signal(name="lease_granted")
    def lease_granted(self, raw: Any) -> None:
        """The pool served our place in its queue."""
        try:
            notice = LeaseGranted.model_validate(raw)
        except (ValidationError, ValueError) as exc:
            workflow.logger.warning("lease_granted refused: %s", exc)
            return
        self._granted[notice.ticket] = notice.lease

    @workflow.signal(name="lease_revoked")
    def lease_revoked(self, raw: Any) -> None:
        """The pool revoked one of our leases (its agent died, or it expired)."""
        try:
            notice = LeaseRevoked.model_validate(raw)
        except (ValidationError, ValueError) as exc:
            workflow.logger.warning("lease_revoked refused: %s", exc)
            return
        self._revoked[notice.lease_id] = notice.reason

    @workflow.run
    async def run(self, task: TaskInput) -> TaskResult:
        excluded: list[str] = []
        failures: list[str] = []
        for attempt in range(1, task.max_attempts + 1):
            lease = await self._acquire(task, excluded)
            try:
                output = await self._invoke(task, lease)
            except _Failover as failover:
                failures.append(f"attempt {attempt} on {lease.agent_id}: {failover}")
                workflow.logger.warning("task %s: failing over from %s: %s", task.ref, lease.agent_id, failover)
                excluded.append(lease.agent_id)
                continue
            finally:
                await workflow.execute_activity(
                    "release_lease",
                    lease,
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
            )
        raise ApplicationError(
            f"{task.ref}: no agent completed the task in {task.max_attempts} attempt(s): " + "; ".join(failures),
            type="CapabilityTaskFailed",
            non_retryable=True,
        )

    async def _acquire(self, task: TaskInput, excluded: list[str]) -> Lease:
        """A lease now, or a place in the pool's queue and a wait for `lease_granted`.

        The wait is a workflow condition, not an activity: queued supervisors hold
        no worker slots, so they can never starve the releases that would serve them.
        """
        reply: AcquireReply = await workflow.execute_activity(
            "request_lease",
            PoolAcquireRequest(
                pool=task.pool,
                ref=task.ref,
                wait_s=task.acquire_timeout_s,
                lease_ttl_s=task.task_timeout_s + 60,
                holder=workflow.info().workflow_id,
                holder_is_workflow=True,
                exclude_agents=excluded,
            ),
            result_type=AcquireReply,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
        )
        if reply.lease is not None:
            return reply.lease
        if reply.ticket is None:
            self._exhausted(task, reply.report)
        ticket = reply.ticket
        try:
            await workflow.wait_condition(lambda: ticket in self._granted, timeout=task.acquire_timeout_s)
        except asyncio.TimeoutError:
            status: TicketStatus = await workflow.execute_activity(
                "cancel_ticket",
                CancelTicket(pool=task.pool, ticket=ticket),
                result_type=TicketStatus,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
            )
            if status.lease is not None:  # granted just as we gave up: keep it
                return status.lease
            self._exhausted(task, status.report)
        return self._granted.pop(ticket)

    @staticmethod
    def _exhausted(task: TaskInput, report: PoolReport | None) -> NoReturn:
        error = PoolExhaustedError(task.ref, waited_s=task.acquire_timeout_s, report=report, pool=task.pool)
        raise ApplicationError(str(error), error.report.model_dump(), type=POOL_EXHAUSTED, non_retryable=True)

    async def _invoke(self, task: TaskInput, lease: Lease) -> Any:
        invoke = workflow.start_activity(
            "invoke_agent",
            InvokeInput(lease=lease, payload=task.payload, timeout_s=task.task_timeout_s),
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
                raise ApplicationError(cause.message, type=kind or "CapabilityTaskFailed", non_retryable=True) from exc
            raise


class _Failover(Exception):
    """This agent cannot finish the task; try another."""
