"""PoolWorkflow (id `pool/{pool}`): the one writer of the capability index and leases.

Messaging, chosen for the Temporal limits in the design brief (docs/messages.md
has every message, its argument, reply and limits):
- Callers send updates, one per verb, each batched: `acquire` never blocks (a
  lease at once, or a ticket: a place in the FIFO queue; it may carry lease ids
  to release first), `release`, `cancel`, `renew`; the operators' `set_policy`,
  `shutdown`, `confirm_evictions`; an agent's `may_evict`. Waiting happens in
  the caller, which polls the `tickets` query: a blocking update would cap
  waiters at 10. An update admitted while the run continues as new is refused
  with a retryable reason and answered by the next run.
- `agent_snapshot` is the one signal: a hint. One that changes routing facts (or
  is an agent's first, or its end) is checked against the agent workflow's own
  `snapshot` query by the `read_agents` activity, and that is applied.
- Agent workflows are told about load in coalesced signals, sent together
  (never one by one) and only when saturation flips or a draining agent's
  count moves. A task workflow holding a lease is told `lease_revoked`.
- `status` is the one read: agents, leases, waiters, policies, breakers, the
  shard layout, runs and refusals.
- `shutdown` answers at once; the run then returns its final status once the
  shutdown is over (`core.shutdown` has the phases and why a shut-down pool is
  never started again by a straggling agent).
All decisions are in `core.pool.PoolCore`; this class turns messages into core
calls and the core's queued effects into signals and activities.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from agentroster.messages import (
        AcquireBatch,
        AcquireReply,
        AgentReadings,
        AgentRef,
        AgentRefs,
        AgentSnapshot,
        ConfirmEvictions,
        DrainRequest,
        HealthCheckBatch,
        HealthResult,
        HealthTarget,
        LEASE_ID_MAX,
        IndexNotice,
        IndexNotices,
        EvictionAsk,
        EvictionVerdict,
        PodRef,
        RenewRequest,
        ScaleRequest,
        SetPolicy,
        ShutdownRequest,
    )
    from agentroster.models import (
        EvictionStatus,
        Lease,
        PoolStatus,
        TicketStatus,
        STATUS_REPLY_MAX_BYTES,
        fit_status,
    )
    from agentroster.core.autoscaler import ScaleDown
    from agentroster.core.pool import PoolCore
    from agentroster.core.state_codec import decode_state, encode_state
    from agentroster.vocabulary.wire import (
        AGENT_SNAPSHOT_SIGNAL,
        BACKEND_RETRY,
        CHECK_HEALTH,
        CONTINUING_AS_NEW,
        MARK_POD_FOR_REMOVAL,
        MESSAGE_RETRY,
        POOL_SHUT_DOWN,
        READ_AGENTS,
        FIND_AGENTS,
        RETRY_EVICTION_SIGNAL,
        SCALE_DEPLOYMENT,
        SCALE_UP_REFUSED,
        TELL_INDEXED,
        VERIFY_AGENT,
        PoolInput,
        agent_workflow_id,
        pool_task_timeout,
    )
    from agentroster.messages import MAX_BATCH, Released, released_id, released_outcome
    import agentroster.workflows.messages as messages
    from agentroster.workflows.agent import AgentWorkflow
    from agentroster.workflows.messages import Refused
    from agentroster.workflows.task import CapabilityTaskWorkflow

REFUSALS_KEPT = 20
# Agents to read are read in batches, one `read_agents` activity per batch with at most
# READS_IN_FLIGHT batches at once. Every agent_snapshot signal is a hint: unless it only
# confirms what the pool has, the pool applies what the agent workflow itself reports.
READ_BATCH = 200
READS_IN_FLIGHT = 2
# A run relearning its fleet reads a small batch first: the first agents it learns serve the
# callers waiting meanwhile (a batch's readings are applied together, once it is all read).
RELEARN_FIRST_BATCH = 16
# An agent workflow waiting on a registration is told once it is indexed, by one
# `tell_indexed` activity per batch of notices.
#
# A signal to an agent workflow that fails (a load notice, a drain) is checked before the
# agent is dropped: the server refuses a signal that meets a run closing by continue-as-new
# (temporalio/temporal#2694, #8097) although the agent's next run carries on. One
# `verify_agent` activity per failure, after a pause; the signal is sent again while the
# workflow runs, at most SIGNAL_RECHECKS times in a row.
SIGNAL_RECHECKS = 3
SIGNAL_RECHECK_PAUSE_S = 1.0  # times the failures in a row: 1, 2, 3 s before each check
# The core names the load notice; these are the agent workflow's signals for it.
LOAD_SIGNALS = {"acquire": AgentWorkflow.acquire, "release": AgentWorkflow.release}
# How long a retired agent may finish what it has in flight.
DRAIN_DEADLINE_S = 300.0
# A health round that cannot run (no worker) is not retried long: the next round comes.
HEALTH_RETRY = RetryPolicy(maximum_attempts=2)
# Well under the server's 50 MB per run: batched acquires make big events.
MAX_HISTORY_BYTES = 4 * 1024 * 1024
# A refusal's text at most: a rejected update's reply carries the request again (the SDK
# echoes it), so the refusal itself stays short, as do those `status` keeps.
MAX_REFUSAL_CHARS = 512


@workflow.defn(name="PoolWorkflow")
class PoolWorkflow:
    @workflow.init
    def __init__(self, input: PoolInput) -> None:
        self._input = input
        if input.state:
            self._core = PoolCore.from_state(decode_state(input.state))
        else:
            self._core = PoolCore(
                input.pool, scale_window_s=input.scale_window_s, epoch=workflow.info().first_execution_run_id
            )
            self._core.begin_relearn()  # before any handler runs: an acquire meanwhile waits
        self._updates = 0
        self._signals = 0
        self._dirty = False
        self._alarms: set[float] = set()
        self._alarm_tasks: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._scale_down_tasks: set[asyncio.Task[Any]] = set()  # a shutdown's scale to zero waits for them
        self._scaling: dict[str, ScaleRequest] = {}  # deployment -> request being carried out
        self._refused: list[str] = list(input.refused)
        self._continuing = False
        self._core.set_shard(input.shard, input.layout())
        self._core.verify_known_agents = True  # every snapshot signal is a hint (see `PoolCore.agent_snapshot`)
        self._read_queue: list[str] = []  # agents to read, in the order the core asked
        self._status_cache: tuple[int, RawValue] | None = None  # (history length, encoded `status`)
        self._reads_in_flight = 0
        self._relearn_batches = 0  # read batches sent while relearning
        self._rechecks: dict[str, int] = {}  # agent -> signals to it that failed in a row
        self._checking: dict[str, DrainRequest | None] = {}  # agent -> the signal its check in flight would resend

    # ------------------------------------------------------------------ run
    @workflow.run
    async def run(self, input: PoolInput) -> PoolStatus | None:
        """Runs until shut down (the `shutdown` update), continuing as new; returns the final status."""
        self._tick()
        if self._core.relearning:  # started without state, or continued as new while relearning
            self._core.begin_relearn()
            self._spawn(self._relearn(), self._background)
        for raw in input.pending_scale:
            self._start_scaling(ScaleRequest.model_validate(raw))
        await self._flush()  # effects carried over from the previous run
        while True:
            self._show()
            self._arm_alarm()
            await workflow.wait_condition(lambda: self._dirty or self._should_continue_as_new())
            self._dirty = False
            self._tick()
            await self._flush()
            if self._core.shutdown is not None and await self._shutdown_over():
                return self._core.status()
            if self._should_continue_as_new():
                self._continuing = True
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._flush()
                for agent_id, drain in sorted(self._checking.items()):
                    if drain is None:  # its check ends with this run: the next run sends the notice again
                        self._guarded("resend_notice", self._core.resend_notice, agent_id)
                state = self._core.to_state()
                workflow.continue_as_new(
                    task_timeout=pool_task_timeout(len(state.agents), len(state.leases)),
                    arg=PoolInput(
                        pool=self._input.pool,
                        max_updates_per_run=self._input.max_updates_per_run,
                        max_signals_per_run=self._input.max_signals_per_run,
                        max_history_events=self._input.max_history_events,
                        scale_window_s=self._input.scale_window_s,
                        state=encode_state(state),
                        pending_scale=[r.model_dump(mode="json") for r in self._scaling.values()],
                        refused=self._refused,
                        runs=self._input.runs + 1,
                        shard=self._input.shard,
                        shards=self._input.shards,
                        shard_by=self._input.shard_by,
                    )
                )

    def _show(self) -> None:
        """What the Temporal UI shows as this pool's current details (read on demand: no history cost)."""
        core = self._core
        states: dict[str, int] = {}
        for agent in core.index.agents():
            states[agent.state.value] = states.get(agent.state.value, 0) + 1
        lines = [
            f"**{len(core.index)} agent(s)**" + (" · " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) if states else ""),
            f"{len(core.leases)} active lease(s) · {len(core.waiters)} waiting · run {self._input.runs + 1}",
        ]
        if self._input.shards > 1:
            lines.append(f"shard {self._input.shard} of {self._input.shards} (agents placed by {self._input.layout().by})")
        if core.relearning:
            lines.append("relearning its fleet: this run started without state and reads the agent workflows it found running")
        open_breakers = [f"`{n}` {b.state}" for n, b in sorted(core.health.breakers.items()) if b.state != "closed"]
        if open_breakers:
            lines.append("breakers: " + ", ".join(open_breakers))
        if core.autoscaler.policies:
            lines.append("policies: " + ", ".join(
                f"`{d}` {p.min_replicas}-{p.max_replicas}" for d, p in sorted(core.autoscaler.policies.items())
            ))
        lines.extend(self._ejection_lines())
        if core.warnings:
            lines.append(f"latest warning: {core.warnings[-1]}")
        workflow.set_current_details("\n\n".join(lines))

    def _ejection_lines(self) -> list[str]:
        """Ejected agents for the current details: the first 10, each with why and until when."""
        core = self._core
        ejected = core.outliers.ejected()
        if not ejected:
            return []
        shown = []
        for agent_id in ejected[:10]:
            row = core.ejection_row(agent_id)
            until = row.get("ejected_until")
            shown.append(f"`{agent_id}` {row.get('ejected', '')}" + (f" (until {until:%H:%M:%S} UTC)" if until else ""))
        more = f" and {len(ejected) - 10} more" if len(ejected) > 10 else ""
        return [f"ejected: {len(ejected)} agent(s): " + "; ".join(shown) + more]

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
        await workflow.sleep(max(0.001, at - self._now()), summary="next deadline: leases, waiters, scaling, health")
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
        for holder, revoked in self._core.take_revocations():
            sends.append(workflow.get_external_workflow_handle(holder).signal(CapabilityTaskWorkflow.lease_revoked, revoked))
            told.append(None)
        # (an agent a shutdown stopped reading meanwhile is not read)
        queued = self._read_queue + self._core.take_verifications()
        self._read_queue = [agent_id for agent_id in queued if self._core.is_being_read(agent_id)]
        while self._read_queue and self._reads_in_flight < READS_IN_FLIGHT:
            size = READ_BATCH
            if self._core.relearning and not self._relearn_batches:
                size = RELEARN_FIRST_BATCH
            if self._core.relearning:
                self._relearn_batches += 1
            batch, self._read_queue = self._read_queue[:size], self._read_queue[size:]
            self._reads_in_flight += 1
            self._spawn(self._read_batch(batch), self._background)
        notices = self._core.take_index_notices()
        for i in range(0, len(notices), READ_BATCH):
            self._spawn(self._tell_indexed(notices[i : i + READ_BATCH]), self._background)
        for warning in self._core.take_warnings():
            workflow.logger.warning("pool %s: %s", self._input.pool, warning)
        for refusal in self._core.take_refusals():
            self._refuse("agent_snapshot", refusal)
        for request in self._core.take_scale_requests(self._now()):
            workflow.logger.info("pool %s: scale %s to %d (%s)", self._input.pool, request.deployment, request.replicas, request.reason)
            self._start_scaling(request)
        for batch in self._core.take_health_checks(self._now()):
            self._spawn(self._check_health(batch), self._background)
        for down in self._core.take_scale_downs():
            workflow.logger.info(
                "pool %s: scale %s down to %d, retiring %s (%s)",
                self._input.pool, down.deployment, down.replicas, ", ".join(down.victims), down.reason,
            )
            self._spawn(self._scale_down(down), self._scale_down_tasks)
        if sends:
            # Sent together: a workflow-to-workflow hop costs ~12-100 ms here.
            results = await asyncio.gather(*sends, return_exceptions=True)
            for agent_id, result in zip(told, results):
                if not isinstance(result, BaseException):
                    continue
                workflow.logger.info("pool %s: a notice found no running workflow: %s", self._input.pool, result)
                if agent_id is not None:
                    self._agent_signal_failed(agent_id, None)
            for agent_id, result in zip(told, results):
                if agent_id is not None and not isinstance(result, BaseException):
                    self._rechecks.pop(agent_id, None)
        await self._flush_shutdown()

    def _agent_signal_failed(self, agent_id: str, drain: DrainRequest | None) -> None:
        """A load notice (`drain` None) or a drain found no running agent workflow: check before dropping the agent."""
        if agent_id in self._checking:  # a check is on its way: it resends what failed last
            self._checking[agent_id] = drain or self._checking[agent_id]
            return
        failures = self._rechecks.get(agent_id, 0)
        if failures >= SIGNAL_RECHECKS:
            # Its workflow has ended and its last word never arrived: no ghost stays routable.
            self._rechecks.pop(agent_id, None)
            self._guarded("agent_gone", self._core.agent_gone, agent_id, "its workflow is gone", self._now(), self._new_id)
            self._dirty = True
            return
        self._rechecks[agent_id] = failures + 1
        self._checking[agent_id] = drain
        self._spawn(self._recheck(agent_id), self._background)

    async def _recheck(self, agent_id: str) -> None:
        """Drop the agent if its workflow has ended; otherwise send the signal again.

        After a pause that grows with each failure in a row: the server refuses signals
        for as long as a continue-as-new that failed on buffered signals is retried."""
        failures = self._rechecks.get(agent_id, 1)
        await workflow.sleep(timedelta(seconds=SIGNAL_RECHECK_PAUSE_S * failures), summary=f"a signal to agent {agent_id} failed")
        # Unknown (the check failed): the signal sent again tells (a failure checks again).
        running = await self._agent_runs(agent_id, f"check agent {agent_id} runs (a signal to it failed)") is not False
        drain = self._checking.pop(agent_id, None)
        if not running:
            self._rechecks.pop(agent_id, None)
            self._guarded("agent_gone", self._core.agent_gone, agent_id, "its workflow is gone", self._now(), self._new_id)
        elif drain is None:
            self._guarded("resend_notice", self._core.resend_notice, agent_id)  # the load as it is now
        else:
            try:
                await workflow.get_external_workflow_handle(agent_workflow_id(self._input.pool, agent_id)).signal("drain", drain)
            except Exception:
                self._agent_signal_failed(agent_id, drain)
            else:
                self._rechecks.pop(agent_id, None)
        self._dirty = True

    async def _agent_runs(self, agent_id: str, summary: str | None = None) -> bool | None:
        """Whether the agent's workflow runs (the `verify_agent` activity); None when that could not be found out."""
        try:
            return await workflow.execute_activity(
                VERIFY_AGENT,
                AgentRef(pool=self._input.pool, agent_id=agent_id),
                summary=summary,
                result_type=bool,
                start_to_close_timeout=timedelta(seconds=10),
                schedule_to_close_timeout=timedelta(minutes=5),
                retry_policy=MESSAGE_RETRY,
            )
        except ActivityError as exc:
            workflow.logger.warning("pool %s: could not check agent %s: %s", self._input.pool, agent_id, exc)
            return None

    async def _relearn(self) -> None:
        """List the agent workflows of this pool that run now (`find_agents`); the core reads each
        one it does not know (`_read_batch`), as it reads a hint. A listing that fails leaves the
        pool to learn from the agents' own notices."""
        try:
            found = await workflow.execute_activity(
                FIND_AGENTS,
                self._input.pool,
                summary=f"relearn the fleet: list the running agent workflows of pool {self._input.pool}",
                result_type=dict[str, str],
                start_to_close_timeout=timedelta(seconds=60),
                schedule_to_close_timeout=timedelta(minutes=5),
                retry_policy=MESSAGE_RETRY,
            )
        except ActivityError as exc:
            workflow.logger.warning("pool %s: could not list its agent workflows: %s", self._input.pool, exc)
            found = {}
        workflow.logger.info("pool %s: relearning its fleet: %d agent workflow(s) running", self._input.pool, len(found))
        self._guarded("relearn", self._core.relearn_found, found, self._now())
        self._dirty = True

    async def _read_batch(self, agent_ids: list[str]) -> None:
        """`_read` for a batch of agents: one activity reads each agent workflow's own snapshot."""
        try:
            result = await workflow.execute_activity(
                READ_AGENTS,
                AgentRefs(pool=self._input.pool, agent_ids=agent_ids),
                summary=f"read {len(agent_ids)} agent(s)' own snapshots: {agent_ids[0]}{', ...' if len(agent_ids) > 1 else ''}",
                result_type=AgentReadings,
                start_to_close_timeout=timedelta(seconds=60),
                schedule_to_close_timeout=timedelta(minutes=5),
                retry_policy=MESSAGE_RETRY,
            )
        except ActivityError as exc:
            workflow.logger.warning("pool %s: could not read %d agent(s): %s", self._input.pool, len(agent_ids), exc)
            result = AgentReadings(failed={agent_id: str(exc.cause or exc) for agent_id in agent_ids})
        now = self._now()
        for agent_id in agent_ids:
            failed = result.failed.get(agent_id)
            reading = result.readings.get(agent_id)
            if failed is not None or reading is None:
                self._guarded("read_agent", self._core.agent_read_failed, agent_id, failed or "no reading returned")
            else:
                self._guarded("read_agent", self._core.agent_read, agent_id, reading.snapshot, reading.detail, now, self._new_id)
        self._guarded("relearn", self._core.relearn_progress, now)
        self._reads_in_flight -= 1
        self._dirty = True

    async def _tell_indexed(self, notices: list[IndexNotice]) -> None:
        """Tell agent workflows waiting on a registration that it is indexed (one activity per batch)."""
        try:
            await workflow.execute_activity(
                TELL_INDEXED,
                IndexNotices(pool=self._input.pool, notices=notices),
                summary=f"tell {len(notices)} agent(s) they are indexed: {notices[0].agent_id}{', ...' if len(notices) > 1 else ''}",
                start_to_close_timeout=timedelta(seconds=60),
                schedule_to_close_timeout=timedelta(minutes=5),
                retry_policy=MESSAGE_RETRY,
            )
        except ActivityError as exc:  # their `register` calls time out, as they did before the notice
            workflow.logger.warning("pool %s: could not tell %d agent(s) they are indexed: %s", self._input.pool, len(notices), exc)
        self._core.index_notices_delivered(notices)

    def _start_scaling(self, request: ScaleRequest) -> None:
        self._scaling[request.deployment] = request
        self._spawn(self._scale(request), self._background)

    async def _scale(self, request: ScaleRequest) -> None:
        try:
            await workflow.execute_activity(
                SCALE_DEPLOYMENT,
                request,
                summary=f"scale {request.deployment} to {request.replicas}",
                start_to_close_timeout=timedelta(seconds=60),
                schedule_to_close_timeout=timedelta(minutes=30),
                retry_policy=BACKEND_RETRY,
            )
        except Exception as exc:
            workflow.logger.error("pool %s: scaling %s failed: %s", self._input.pool, request.deployment, exc)
        finally:
            if self._scaling.get(request.deployment) is request:
                del self._scaling[request.deployment]

    async def _check_health(self, batch: list[HealthTarget]) -> None:
        """One round of health checks for a batch of idle agents (one activity, however many agents)."""
        try:
            results = await workflow.execute_activity(
                CHECK_HEALTH,
                HealthCheckBatch(pool=self._input.pool, targets=batch),
                summary=f"health check of {len(batch)} agent(s)",
                result_type=list[HealthResult],
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=HEALTH_RETRY,
            )
        except ActivityError as exc:
            workflow.logger.warning("pool %s: health checks failed to run: %s", self._input.pool, exc)
            self._core.health_checks_lost([t.agent_id for t in batch])
        else:
            self._guarded("check_health", self._core.health_results, results, self._now())
        self._dirty = True

    async def _scale_down(self, down: ScaleDown) -> None:
        """Mark the victims' pods to go first, lower the replicas, then drain the victims' workflows.

        In that order: a victim drained before the replicas are lowered would have
        its pod replaced by the Deployment (or the local backend) at once.
        """
        options: dict[str, Any] = {
            "start_to_close_timeout": timedelta(seconds=60),
            "schedule_to_close_timeout": timedelta(minutes=30),
            "retry_policy": BACKEND_RETRY,
        }
        try:
            await asyncio.gather(*(
                workflow.execute_activity(
                    MARK_POD_FOR_REMOVAL,
                    PodRef(deployment=down.deployment, agent_id=victim, reason=down.reason),
                    summary=f"mark pod {victim} to go first",
                    **options,
                )
                for victim in down.victims
            ))
            await workflow.execute_activity(
                SCALE_DEPLOYMENT,
                ScaleRequest(deployment=down.deployment, replicas=down.replicas, reason=down.reason),
                summary=f"scale {down.deployment} down to {down.replicas}",
                **options,
            )
        except ActivityError as exc:
            workflow.logger.error("pool %s: scaling %s down failed: %s", self._input.pool, down.deployment, exc)
        reason = "recycled" if down.reason.startswith("recycled") else "scale-down"
        results = await asyncio.gather(
            *(
                workflow.get_external_workflow_handle(agent_workflow_id(self._input.pool, victim)).signal(
                    "drain", DrainRequest(reason=reason, deadline_s=DRAIN_DEADLINE_S)
                )
                for victim in down.victims
            ),
            return_exceptions=True,
        )
        for victim, result in zip(down.victims, results):
            if isinstance(result, BaseException):
                self._agent_signal_failed(victim, DrainRequest(reason=reason, deadline_s=DRAIN_DEADLINE_S))
        self._dirty = True

    def _changed(self) -> None:
        self._dirty = True

    def _refuse(self, kind: str, reason: str) -> None:
        text = f"{kind} refused: {reason}"[:MAX_REFUSAL_CHARS]
        workflow.logger.warning("pool %s: %s", self._input.pool, text)
        self._refused = (self._refused + [text])[-REFUSALS_KEPT:]

    # -------------------------------------------------------------- updates
    # Every handler takes `*args`: the SDK then hands over whatever was sent, and
    # `messages` reads it. Validators refuse before anything enters history; the
    # handlers read the same arguments again (they cannot fail after validation).
    # Refusals name the field and the reason, never echo what was sent.
    def _admit(self, check: Any, kind: str, args: tuple[Any, ...]) -> Any:
        """Run a validator's check: continuing-as-new and malformed arguments become rejections."""
        if self._continuing:
            # The client retries this type with backoff; the next run answers.
            raise ApplicationError("pool is continuing as new; retry", type=CONTINUING_AS_NEW)
        self._refuse_when_shutting_down(kind)
        try:
            return check(kind, args)
        except Refused as exc:
            raise ApplicationError(str(exc)[:MAX_REFUSAL_CHARS], type="InvalidArgument", non_retryable=True) from None

    @staticmethod
    def _acquire_arg(kind: str, args: tuple[Any, ...]) -> AcquireBatch:
        return messages.model(kind, AcquireBatch, messages.one(kind, args))

    @staticmethod
    def _releases_arg(kind: str, args: tuple[Any, ...]) -> list[str | Released]:
        raw = messages.plain(kind, messages.one(kind, args))
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_BATCH:
            count = len(raw) if isinstance(raw, list) else type(raw).__name__
            raise Refused(f"{kind}: expected a list of 1 to {MAX_BATCH} lease_ids, got {count}")
        return [
            messages.model(f"{kind}[{i}]", Released, item) if isinstance(item, dict)
            else messages.text(kind, item, field="lease_id", max_length=LEASE_ID_MAX)
            for i, item in enumerate(raw)
        ]

    @staticmethod
    def _tickets_arg(kind: str, args: tuple[Any, ...]) -> list[str]:
        return messages.texts(kind, messages.one(kind, args), field="ticket", at_most=MAX_BATCH, max_length=LEASE_ID_MAX)

    @staticmethod
    def _renew_arg(kind: str, args: tuple[Any, ...]) -> list[RenewRequest]:
        return messages.models(kind, RenewRequest, messages.one(kind, args), at_most=MAX_BATCH)

    @workflow.update(name="acquire")
    def acquire(self, *args: Any) -> list[AcquireReply]:
        """Leases now, or tickets for the FIFO queue (poll `tickets`), answered in order; the
        batch's `releases` are returned first. Argument: an AcquireBatch."""
        batch = self._acquire_arg("acquire", args)
        self._updates += 1
        now = self._now()
        for item in batch.releases:
            self._core.release(released_id(item), now, self._new_id, released_outcome(item))
        replies = [self._core.acquire(request, now, self._new_id) for request in batch.requests]
        self._changed()
        return replies

    @acquire.validator
    def _validate_acquire(self, *args: Any) -> None:
        self._admit(self._acquire_arg, "acquire", args)

    @workflow.update(name="release")
    def release(self, *args: Any) -> int:
        """Return leases (idempotent); how many were still held. Argument: a list of lease ids,
        each alone or with its task's outcome (`{"lease_id": ..., "outcome": ...}`)."""
        items = self._releases_arg("release", args)
        self._updates += 1
        now = self._now()
        released = sum(self._core.release(released_id(i), now, self._new_id, released_outcome(i)) for i in items)
        self._changed()
        return released

    @release.validator
    def _validate_release(self, *args: Any) -> None:
        self._admit(self._releases_arg, "release", args)

    @workflow.update(name="cancel")
    def cancel(self, *args: Any) -> list[TicketStatus]:
        """Callers stopped waiting: their places are given up; a lease granted meanwhile comes
        back in the status (returned, not lost). Argument: a list of tickets."""
        tickets = self._tickets_arg("cancel", args)
        self._updates += 1
        statuses = [self._core.cancel_ticket(ticket, self._now()) for ticket in tickets]
        self._changed()
        return statuses

    @cancel.validator
    def _validate_cancel(self, *args: Any) -> None:
        self._admit(self._tickets_arg, "cancel", args)

    @workflow.update(name="renew")
    def renew(self, *args: Any) -> list[Lease | None]:
        """Move leases' deadlines to now + ttl_s, in order; None for a lease that has already
        ended (released, expired or revoked). Argument: a list of RenewRequest."""
        requests = self._renew_arg("renew", args)
        self._updates += 1
        now = self._now()
        renewed = [self._core.renew(request, now) for request in requests]
        self._changed()  # the earliest deadline may have moved: re-arm the alarm
        return renewed

    @renew.validator
    def _validate_renew(self, *args: Any) -> None:
        self._admit(self._renew_arg, "renew", args)

    @workflow.update(name="set_policy")
    async def set_policy(self, *args: Any) -> PoolStatus:
        """Set (or, with policy None, remove) a deployment's sizing policy, or set the pool's
        eviction safety (threshold, cap, on/off). Argument: a SetPolicy."""
        request = self._set_policy_arg("set_policy", args)
        self._updates += 1
        if request.scale_up is not None:
            self._scale_up(request)
            return self._status()
        if request.eviction is not None:
            self._core.set_eviction_policy(request.eviction, self._now())
            workflow.logger.info("pool %s: eviction policy set to %s", self._input.pool, request.eviction)
        else:
            assert request.deployment is not None  # (SetPolicy's rule)
            self._core.set_policy(request.deployment, request.policy)
            workflow.logger.info("pool %s: policy of %s set to %s", self._input.pool, request.deployment, request.policy)
        self._changed()
        if request.eviction is not None:
            await self._nudge_held()
        return self._status()

    @set_policy.validator
    def _validate_set_policy(self, *args: Any) -> None:
        self._admit(self._set_policy_arg, "set_policy", args)

    def _scale_up(self, request: SetPolicy) -> None:
        """A caller's scale-up (`SetPolicy.scale_up`): the update in the history says who asked
        and why; the `scale_deployment` activity after it carries it out. A refusal (at
        max_replicas, a deployment never seen, shutting down) fails the update with the reason."""
        assert request.deployment is not None and request.scale_up is not None  # (SetPolicy's rule)
        reason = f"asked for {request.scale_up} more" + (f": {request.reason}" if request.reason else "")
        try:
            scale = self._core.scale_up(request.deployment, request.scale_up, reason, self._now())
        except ValueError as exc:
            raise ApplicationError(f"scale_up refused: {exc}"[:MAX_REFUSAL_CHARS], type=SCALE_UP_REFUSED, non_retryable=True) from None
        workflow.logger.info("pool %s: scale-up of %s to %d asked (%s)", self._input.pool, scale.deployment, scale.replicas, reason)
        self._changed()

    @staticmethod
    def _set_policy_arg(kind: str, args: tuple[Any, ...]) -> SetPolicy:
        return messages.model(kind, SetPolicy, messages.one(kind, args))

    # ------------------------------------------------------------- shutdown
    # See `core.shutdown` for the phases and for how a shut-down pool stays down.
    @workflow.update(name="shutdown")
    def shutdown(self, *args: Any) -> PoolStatus:
        """Stop granting, let leases finish until the deadline, drain every agent, scale to zero, end.

        Idempotent: a later call changes nothing and returns the status (the first
        call's deadline stands). Argument (optional): a ShutdownRequest.
        """
        request = self._shutdown_arg("shutdown", args)
        self._updates += 1
        if self._core.begin_shutdown(request.reason, request.deadline_s, self._now()):
            workflow.logger.warning(
                "pool %s: shutting down (%s); leases in flight may run for %gs", self._input.pool, request.reason, request.deadline_s
            )
        self._changed()
        return self._status()

    @shutdown.validator
    def _validate_shutdown(self, *args: Any) -> None:
        self._admit(self._shutdown_arg, "shutdown", args)

    @staticmethod
    def _shutdown_arg(kind: str, args: tuple[Any, ...]) -> ShutdownRequest:
        raw = messages.one(kind, args, optional=True)
        return messages.model(kind, ShutdownRequest, {} if raw is None else raw)

    def _refuse_when_shutting_down(self, kind: str) -> None:
        """An acquire's validator: refused at once (not retried) once a shutdown began."""
        plan = self._core.shutdown
        if plan is not None and kind == "acquire":
            raise ApplicationError(
                f"{kind} refused: pool {self._input.pool!r} is shutting down ({plan.reason}); it grants no new leases",
                plan.reason,
                type=POOL_SHUT_DOWN,
                non_retryable=True,
            )

    async def _flush_shutdown(self) -> None:
        """Carry out the shutdown's effects: agents drained (together), then scaled to zero."""
        effects = self._core.take_shutdown_effects(self._now())
        if not effects:
            return
        pool = self._input.pool
        drains = [
            workflow.get_external_workflow_handle(agent_workflow_id(pool, agent_id)).signal("drain", request)
            for agent_id, request in effects.drains
        ]
        results = await asyncio.gather(*drains, return_exceptions=True)
        for (agent_id, request), result in zip(effects.drains, results):
            if isinstance(result, BaseException):  # ended already, or met mid continue-as-new
                self._agent_signal_failed(agent_id, request)
        # After the drains: an agent stopped by its backend first would drain with another reason.
        for request in effects.scales:
            workflow.logger.info("pool %s: scaling %s to zero (%s)", pool, request.deployment, request.reason)
            self._spawn(self._scale_to_zero(request), self._background)
        for agent_id in effects.checks:
            self._spawn(self._check_agent(agent_id), self._background)

    async def _scale_to_zero(self, request: ScaleRequest) -> None:
        """One deployment to zero, after any scaling of it already under way (which would land after ours)."""
        await workflow.wait_condition(lambda: request.deployment not in self._scaling and not self._scale_down_tasks)
        error: str | None = None
        try:
            await workflow.execute_activity(
                SCALE_DEPLOYMENT,
                request,
                start_to_close_timeout=timedelta(seconds=60),
                schedule_to_close_timeout=timedelta(minutes=10),
                retry_policy=BACKEND_RETRY,
            )
        except ActivityError as exc:
            error = str(exc.cause or exc)
            workflow.logger.error("pool %s: scaling %s to zero failed: %s", self._input.pool, request.deployment, error)
        self._guarded("shutdown_scaled", self._core.shutdown_scaled, request.deployment, error)
        self._dirty = True

    async def _check_agent(self, agent_id: str) -> None:
        """An agent that outlived its drain: does its workflow still run?"""
        running = await self._agent_runs(agent_id) is not False  # unknown: checked again later
        self._guarded("shutdown_check", self._core.shutdown_checked, agent_id, running, self._now(), self._new_id)
        self._dirty = True

    async def _shutdown_over(self) -> bool:
        """Whether the run may end now: the shutdown is complete, and still is once every handler finished."""
        if not self._core.shutdown_complete(self._now()):
            return False
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._core.shutdown_complete(self._now())
    # ------------------------------------------------------ eviction safety
    # A silent agent's workflow asks before it terminates (core.eviction decides);
    # operators confirm, or change the policy. See docs/concepts/eviction.md.
    @staticmethod
    def _eviction_ask_arg(kind: str, args: tuple[Any, ...]) -> EvictionAsk:
        return messages.model(kind, EvictionAsk, messages.one(kind, args))

    @staticmethod
    def _confirm_arg(kind: str, args: tuple[Any, ...]) -> ConfirmEvictions:
        return messages.model(kind, ConfirmEvictions, messages.one(kind, args))

    @workflow.update(name="may_evict")
    def may_evict(self, *args: Any) -> EvictionVerdict:
        """May this silent agent be terminated now? (the `request_eviction` activity) Argument: an EvictionAsk."""
        ask = self._eviction_ask_arg("may_evict", args)
        self._updates += 1
        verdict = self._core.may_evict(ask, self._now())
        log = workflow.logger.info if verdict.allow else workflow.logger.warning
        log("pool %s: eviction of %s %s%s", self._input.pool, ask.agent_id,
            "allowed" if verdict.allow else "held", f" ({verdict.reason})" if verdict.reason else "")
        self._changed()
        return verdict

    @may_evict.validator
    def _validate_may_evict(self, *args: Any) -> None:
        self._admit(self._eviction_ask_arg, "may_evict", args)

    @workflow.update(name="confirm_evictions")
    async def confirm_evictions(self, *args: Any) -> EvictionStatus:
        """An operator confirms that silent agents are gone. Argument: a ConfirmEvictions (agents None: all)."""
        request = self._confirm_arg("confirm_evictions", args)
        self._updates += 1
        confirmed = self._core.confirm_evictions(request.agents, self._now())
        workflow.logger.warning("pool %s: evictions confirmed by an operator: %s", self._input.pool, confirmed)
        self._changed()
        await self._nudge_held()
        return self._core.eviction.status()

    @confirm_evictions.validator
    def _validate_confirm_evictions(self, *args: Any) -> None:
        self._admit(self._confirm_arg, "confirm_evictions", args)

    async def _nudge_held(self) -> None:
        """Held agents that will now be let go ask again at once instead of at their next retry."""
        agent_ids = self._core.eviction.releasable()
        results = await asyncio.gather(
            *(
                workflow.get_external_workflow_handle(agent_workflow_id(self._input.pool, agent_id)).signal(RETRY_EVICTION_SIGNAL)
                for agent_id in agent_ids
            ),
            return_exceptions=True,
        )
        for agent_id, result in zip(agent_ids, results):
            if isinstance(result, BaseException):
                workflow.logger.info("pool %s: held agent %s could not be told to ask again: %s", self._input.pool, agent_id, result)

    # -------------------------------------------------------------- signals
    def _signal(self, kind: str, apply: Any, args: tuple[Any, ...]) -> None:
        """Apply a signal; a malformed one (or a core refusal) is kept in `status.refusals`, never raised."""
        self._signals += 1
        try:
            apply(args)
        except Refused as exc:
            self._refuse(kind, str(exc).removeprefix(f"{kind}: "))
        except Exception as exc:  # a raise here would fail every replay of this history
            self._refuse(kind, f"{type(exc).__name__}: {exc}")
        self._changed()

    @workflow.signal(name=AGENT_SNAPSHOT_SIGNAL)
    def agent_snapshot(self, *args: Any) -> None:
        """An agent workflow's state and capabilities (or its termination). Argument: an AgentSnapshot.

        Anyone may send it: unless it only confirms what the pool has, it is a hint,
        and the pool applies what the agent workflow itself reports (`_read_batch`).
        """

        def apply(a: tuple[Any, ...]) -> None:
            snapshot = messages.model("agent_snapshot", AgentSnapshot, messages.one("agent_snapshot", a))
            self._core.agent_snapshot(snapshot, self._now(), self._new_id)

        self._signal("agent_snapshot", apply, args)

    def _guarded(self, kind: str, call: Any, *args: Any) -> None:
        """Run a core call outside a handler's own guard: a raise there would fail every replay."""
        try:
            call(*args)
        except Exception as exc:
            self._refuse(kind, f"{type(exc).__name__}: {exc}")

    # -------------------------------------------------------------- queries
    # A query that raises fails only that query (the caller sees the reason);
    # reading the arguments here still gives a clear one.
    @workflow.query(name="status", description="Agents with state and in-flight, lease counters, waiters, policies, breakers, layout, refusals")
    def status(self) -> PoolStatus:
        """The pool: agents with state and in-flight, lease counters, waiters, policies,
        breakers, eviction safety, its shard layout, runs and the last refusals."""
        return self._encoded_status()  # type: ignore[return-value]  # the same JSON, encoded once

    def _status(self) -> PoolStatus:
        status = self._core.status()
        status.shard, status.shards, status.shard_by = self._input.shard, self._input.shards, self._input.layout().by
        status.runs = self._input.runs
        status.refusals = list(self._refused)
        return status

    def _encoded_status(self) -> RawValue:
        """`status`, built and encoded once per state of the pool, not once per query.

        Every change to the pool comes in a workflow task, which lengthens the history;
        between two, every query (dashboards, metrics, the CLI: O(agents) each, ~20 ms for
        1,000 agents) gets the same payload. Queries add no events and change nothing."""
        length = workflow.info().get_current_history_length()
        if self._status_cache is None or self._status_cache[0] != length:
            converter = workflow.payload_converter()
            status = self._status()
            payload = converter.to_payload(status)
            if len(payload.data) > STATUS_REPLY_MAX_BYTES:  # 6,000-8,000+ agents: rows left out, counted
                payload = converter.to_payload(fit_status(status, len(payload.data), lambda s: len(converter.to_payload(s).data)))
            self._status_cache = (length, RawValue(payload))
        return self._status_cache[1]

    @workflow.query(name="tickets")
    def tickets(self, *args: Any) -> list[TicketStatus]:
        """Where queued callers stand (one query serves many waiters). Argument: a list of tickets."""
        raw = messages.one("tickets", args)
        if not isinstance(raw, list) or len(raw) > 10_000:
            raise Refused("tickets: expected a list of at most 10000 tickets")
        return [self._core.ticket_status(messages.text("tickets", t, field="ticket", max_length=LEASE_ID_MAX)) for t in raw]
