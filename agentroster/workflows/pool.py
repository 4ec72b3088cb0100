"""PoolWorkflow (id `pool/{pool}`): the one writer of the capability index and leases.

Messaging, chosen for the Temporal limits in the README's "How it works":
- `acquire` is an update that never blocks: it answers at once with a lease,
  or with a ticket (a place in the FIFO queue). Waiting happens in the caller,
  which polls the `tickets` query; a blocking update would cap waiters at 10.
- `release`, `agent_snapshot` are signals: cheap, ordered with the updates.
- Agent workflows are told about load in coalesced signals, sent together
  (never one by one) and only when saturation flips or a draining agent's
  count moves.
All decisions are in `core.pool.PoolCore`; this class turns messages into core
calls and the core's queued effects into signals and activities.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from agentroster.contracts import (
        AcquireReply,
        AcquireRequest,
        AgentSnapshot,
        Lease,
        PoolStatus,
        RenewRequest,
        ScaleRequest,
        TicketStatus,
    )
    from agentroster.core.pool import PoolCore, PoolCoreState
    from agentroster.wire import (
        AGENT_SNAPSHOT_SIGNAL,
        BACKEND_RETRY,
        CONTINUING_AS_NEW,
        MAX_BATCH,
        POOL_RENEW_SIGNAL,
        SCALE_DEPLOYMENT,
        PoolInput,
        agent_workflow_id,
        refusal_reason,
    )
    from agentroster.workflows.agent import AgentWorkflow
    from agentroster.workflows.task import CapabilityTaskWorkflow

REFUSALS_KEPT = 20
# The core names the load notice; these are the agent workflow's signals for it.
LOAD_SIGNALS = {"acquire": AgentWorkflow.acquire, "release": AgentWorkflow.release}
# Well under the server's 50 MB per run: batched acquires make big events.
MAX_HISTORY_BYTES = 10 * 1024 * 1024


@workflow.defn(name="PoolWorkflow")
class PoolWorkflow:
    @workflow.init
    def __init__(self, input: PoolInput) -> None:
        self._input = input
        if input.state:
            self._core = PoolCore.from_state(PoolCoreState.model_validate(input.state))
        else:
            self._core = PoolCore(
                input.pool, scale_window_s=input.scale_window_s, epoch=workflow.info().first_execution_run_id
            )
        self._updates = 0
        self._signals = 0
        self._dirty = False
        self._alarms: set[float] = set()
        self._alarm_tasks: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._scaling: dict[str, ScaleRequest] = {}  # deployment -> request being carried out
        self._refused: list[str] = list(input.refused)
        self._continuing = False

    # ------------------------------------------------------------------ run
    @workflow.run
    async def run(self, input: PoolInput) -> None:
        self._tick()
        for raw in input.pending_scale:
            self._start_scaling(ScaleRequest.model_validate(raw))
        await self._flush()  # effects carried over from the previous run
        while True:
            self._arm_alarm()
            await workflow.wait_condition(lambda: self._dirty or self._should_continue_as_new())
            self._dirty = False
            self._tick()
            await self._flush()
            if self._should_continue_as_new():
                self._continuing = True
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._flush()
                workflow.continue_as_new(
                    PoolInput(
                        pool=self._input.pool,
                        max_updates_per_run=self._input.max_updates_per_run,
                        max_signals_per_run=self._input.max_signals_per_run,
                        max_history_events=self._input.max_history_events,
                        scale_window_s=self._input.scale_window_s,
                        state=self._core.to_state().model_dump(mode="json"),
                        pending_scale=[r.model_dump(mode="json") for r in self._scaling.values()],
                        refused=self._refused,
                        runs=self._input.runs + 1,
                    )
                )

    def _should_continue_as_new(self) -> bool:
        return (
            self._updates >= self._input.max_updates_per_run
            or self._signals >= self._input.max_signals_per_run
            or workflow.info().get_current_history_length() >= self._input.max_history_events
            or workflow.info().get_current_history_size() >= MAX_HISTORY_BYTES
        )

    def _now(self) -> float:
        return workflow.now().timestamp()

    def _new_id(self) -> str:
        return workflow.uuid4().hex

    def _tick(self) -> None:
        self._core.tick(self._now(), self._new_id)

    # --------------------------------------------------------------- timers
    def _arm_alarm(self) -> None:
        """One timer for the earliest deadline; no timer churn on every message."""
        wake = self._core.next_wakeup()
        if wake is None or any(alarm <= wake for alarm in self._alarms):
            return
        self._alarms.add(wake)
        self._spawn(self._alarm(wake), self._alarm_tasks)

    async def _alarm(self, at: float) -> None:
        await asyncio.sleep(max(0.001, at - self._now()))
        self._alarms.discard(at)
        self._dirty = True

    @staticmethod
    def _spawn(coro: Any, into: set[asyncio.Task[Any]]) -> None:
        task = asyncio.create_task(coro)
        into.add(task)
        task.add_done_callback(into.discard)

    # -------------------------------------------------------------- effects
    async def _flush(self) -> None:
        """Carry out what the core queued: notices, revocations, scaling."""
        sends = []
        told: list[str | None] = []  # the agent behind each send (None: a lease holder)
        for agent_id, signal, notice in self._core.take_notices():
            handle = workflow.get_external_workflow_handle(agent_workflow_id(self._input.pool, agent_id))
            sends.append(handle.signal(LOAD_SIGNALS[signal], notice))
            told.append(agent_id)
        for holder, granted in self._core.take_grants():
            sends.append(workflow.get_external_workflow_handle(holder).signal(CapabilityTaskWorkflow.lease_granted, granted))
            told.append(None)
        for holder, revoked in self._core.take_revocations():
            sends.append(workflow.get_external_workflow_handle(holder).signal(CapabilityTaskWorkflow.lease_revoked, revoked))
            told.append(None)
        for warning in self._core.take_warnings():
            workflow.logger.warning("pool %s: %s", self._input.pool, warning)
        for request in self._core.take_scale_requests(self._now()):
            workflow.logger.info("pool %s: scale %s to %d (%s)", self._input.pool, request.deployment, request.replicas, request.reason)
            self._start_scaling(request)
        if sends:
            # Sent together: a workflow-to-workflow hop costs ~12-100 ms here.
            results = await asyncio.gather(*sends, return_exceptions=True)
            for agent_id, result in zip(told, results):
                if not isinstance(result, BaseException):
                    continue
                workflow.logger.info("pool %s: a notice found no running workflow: %s", self._input.pool, result)
                if agent_id is not None:
                    # Its workflow has ended and its last word never arrived: no ghost stays routable.
                    self._guarded("agent_gone", self._core.agent_gone, agent_id, "its workflow is gone", self._now(), self._new_id)
                    self._dirty = True

    def _start_scaling(self, request: ScaleRequest) -> None:
        self._scaling[request.deployment] = request
        self._spawn(self._scale(request), self._background)

    async def _scale(self, request: ScaleRequest) -> None:
        try:
            await workflow.execute_activity(
                SCALE_DEPLOYMENT,
                request,
                start_to_close_timeout=timedelta(seconds=60),
                schedule_to_close_timeout=timedelta(minutes=30),
                retry_policy=BACKEND_RETRY,
            )
        except Exception as exc:
            workflow.logger.error("pool %s: scaling %s failed: %s", self._input.pool, request.deployment, exc)
        finally:
            if self._scaling.get(request.deployment) is request:
                del self._scaling[request.deployment]

    def _changed(self) -> None:
        self._dirty = True

    def _refuse(self, kind: str, reason: str) -> None:
        text = f"{kind} refused: {reason}"
        workflow.logger.warning("pool %s: %s", self._input.pool, text)
        self._refused = (self._refused + [text])[-REFUSALS_KEPT:]

    # -------------------------------------------------------------- updates
    def _reject_while_continuing(self) -> None:
        if self._continuing:
            # The client retries this type with backoff; the next run answers.
            raise ApplicationError("pool is continuing as new; retry", type=CONTINUING_AS_NEW)

    @workflow.update(name="acquire")
    def acquire(self, request: AcquireRequest) -> AcquireReply:
        """A lease now, or a ticket for the FIFO queue (poll `tickets`)."""
        self._updates += 1
        reply = self._core.acquire(request, self._now(), self._new_id)
        self._changed()
        return reply

    @acquire.validator
    def _validate_acquire(self, request: AcquireRequest) -> None:
        self._reject_while_continuing()

    @workflow.update(name="acquire_many")
    def acquire_many(self, requests: list[AcquireRequest]) -> list[AcquireReply]:
        """Several callers' acquires in one update, answered in order (clients batch them)."""
        self._updates += 1
        now = self._now()
        replies = [self._core.acquire(request, now, self._new_id) for request in requests]
        self._changed()
        return replies

    @acquire_many.validator
    def _validate_acquire_many(self, requests: list[AcquireRequest]) -> None:
        self._reject_while_continuing()
        if not requests or len(requests) > MAX_BATCH:
            raise ValueError(f"requests: expected 1 to {MAX_BATCH} acquire requests, got {len(requests)}")

    @workflow.update(name="cancel_ticket")
    def cancel_ticket(self, ticket: str) -> TicketStatus:
        """The caller stopped waiting; a lease granted meanwhile is returned, not lost."""
        self._updates += 1
        status = self._core.cancel_ticket(ticket, self._now())
        self._changed()
        return status

    @cancel_ticket.validator
    def _validate_cancel(self, ticket: str) -> None:
        self._reject_while_continuing()
        if not isinstance(ticket, str) or not ticket:
            raise ValueError("ticket: must be a non-empty string")

    @workflow.update(name="release_lease")
    def release_lease(self, lease_id: str) -> bool:
        """Release and confirm (the `release` signal is the fire-and-forget form)."""
        self._updates += 1
        released = self._core.release(lease_id, self._now(), self._new_id)
        self._changed()
        return released

    @release_lease.validator
    def _validate_release(self, lease_id: str) -> None:
        self._reject_while_continuing()
        if not isinstance(lease_id, str) or not lease_id:
            raise ValueError("lease_id: must be a non-empty string")

    @workflow.update(name="renew_lease")
    def renew_lease(self, request: RenewRequest) -> Lease | None:
        """Move a lease's deadline to now + ttl_s; None when the lease has already ended."""
        self._updates += 1
        renewed = self._core.renew(request, self._now())
        self._changed()  # the earliest deadline may have moved: re-arm the alarm
        return renewed

    @renew_lease.validator
    def _validate_renew(self, request: RenewRequest) -> None:
        self._reject_while_continuing()

    # -------------------------------------------------------------- signals
    @workflow.signal(name=POOL_RENEW_SIGNAL)
    def renew(self, raw: Any) -> None:
        """Renew a lease, fire-and-forget (for workflow holders: a signal costs less than an activity)."""
        self._signals += 1
        try:
            request = RenewRequest.model_validate(raw)
        except ValidationError as exc:
            self._refuse("renew", refusal_reason(exc))
            return
        except Exception as exc:
            self._refuse("renew", f"{type(exc).__name__}: {exc}")
            return
        self._guarded("renew", self._core.renew, request, self._now())
        self._changed()

    @workflow.signal(name="release")
    def release(self, raw: Any) -> None:
        """Return leases (idempotent). Payload: a lease id, a list of them, or {"lease_id": ...}."""
        self._signals += 1
        lease_ids = raw if isinstance(raw, list) else [raw.get("lease_id") if isinstance(raw, dict) else raw]
        if not lease_ids or len(lease_ids) > MAX_BATCH:
            self._refuse("release", f"lease_id: expected 1 to {MAX_BATCH} lease ids, got {len(lease_ids)}")
            return
        now = self._now()
        for lease_id in lease_ids:
            if isinstance(lease_id, str) and lease_id:
                self._guarded("release", self._core.release, lease_id, now, self._new_id)
            else:
                self._refuse("release", f"lease_id: expected a non-empty string, got {type(lease_id).__name__}")
        self._changed()

    def _guarded(self, kind: str, call: Any, *args: Any) -> None:
        """Run a core call from a signal handler: a raise there would fail every replay."""
        try:
            call(*args)
        except Exception as exc:
            self._refuse(kind, f"{type(exc).__name__}: {exc}")

    @workflow.signal(name=AGENT_SNAPSHOT_SIGNAL)
    def agent_snapshot(self, raw: Any) -> None:
        """An agent workflow's state and capabilities (or its termination)."""
        self._signals += 1
        try:
            snapshot = AgentSnapshot.model_validate(raw)
        except ValidationError as exc:
            self._refuse("agent_snapshot", refusal_reason(exc))
            return
        except Exception as exc:
            self._refuse("agent_snapshot", f"{type(exc).__name__}: {exc}")
            return
        self._guarded("agent_snapshot", self._core.agent_snapshot, snapshot, self._now(), self._new_id)
        self._changed()

    # -------------------------------------------------------------- queries
    @workflow.query(name="tickets")
    def tickets(self, tickets: list[str]) -> list[TicketStatus]:
        """Where queued callers stand (one query serves many waiters)."""
        return [self._core.ticket_status(t) for t in tickets]

    @workflow.query(name="find")
    def find(self, ref: str) -> list[str]:
        """Routable agent ids for a capability ref, best first; [] means backpressure."""
        return self._core.find(ref)

    @workflow.query(name="status")
    def status(self) -> PoolStatus:
        return self._core.status()

    @workflow.query(name="agent_in_flight")
    def agent_in_flight(self, agent_id: str) -> int:
        agent = self._core.index.get(agent_id)
        return agent.total_in_flight if agent else 0

    @workflow.query(name="lease")
    def lease(self, lease_id: str) -> Lease | None:
        record = self._core.leases.get(lease_id)
        return self._core.lease_of(record) if record else None

    @workflow.query(name="refusals")
    def refusals(self) -> list[str]:
        return list(self._refused)

    @workflow.query(name="runs")
    def runs(self) -> int:
        """How many times this pool has continued as new."""
        return self._input.runs
