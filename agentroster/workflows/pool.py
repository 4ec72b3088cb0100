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
- `agent_snapshots` is the one signal: hints, a list of agent snapshots. One that
  changes routing facts (or is an agent's first, or its end) is checked against the
  agent workflow's own `snapshot` query by the `read_agents` activity, and that is
  applied.
- Agent workflows are told about load in coalesced signals, sent together by
  one `deliver_signals` activity, only when saturation flips or a draining
  agent's count moves. A task workflow holding a lease is told `lease_revoked`.
- The pool's own activities (chores) report back with the `report` update; the
  run wakes for messages only (see `run`).
- `status` is the one read: agents, leases, waiters, policies, breakers, the
  shard layout, runs and refusals.
- `shutdown` answers at once; the run then returns its final status once the
  shutdown is over (`core.shutdown` has the phases and why a shut-down pool is
  never started again by a straggling agent).
All decisions are in `core.pool.PoolCore`; this class turns messages into core
calls and the core's queued effects into chores.
"""

from __future__ import annotations

import asyncio
from collections import deque
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ApplicationError

from agentroster.messages import (
    AcquireBatch,
    AcquireReply,
    AgentChecked,
    AgentReadings,
    AgentRef,
    AgentRefs,
    AgentSnapshot,
    ChoreReport,
    ConfirmEvictions,
    Deliveries,
    Delivery,
    DrainRequest,
    EvictionAsk,
    EvictionVerdict,
    HealthCheckBatch,
    HealthResult,
    HealthTarget,
    IndexNotice,
    IndexNotices,
    LEASE_ID_MAX,
    MAX_BATCH,
    Released,
    RenewRequest,
    ScaleDone,
    ScaleRequest,
    SetPolicy,
    ShutdownRequest,
    released_id,
    released_outcome,
)
from agentroster.models import (
    EvictionStatus,
    Lease,
    PoolStatus,
    TicketStatus,
    STATUS_REPLY_MAX_BYTES,
    fit_status,
)
from agentroster.core.pool import PoolCore
from agentroster.core.state_codec import decode_state, encode_state
from agentroster.vocabulary.wire import (
    AGENT_SNAPSHOTS_SIGNAL,
    BACKEND_CHORE_RETRY,
    CHECK_HEALTH,
    CONTINUING_AS_NEW,
    DELIVER_SIGNALS,
    MESSAGE_RETRY,
    POOL_ALARM,
    POOL_SHUT_DOWN,
    READ_AGENTS,
    FIND_AGENTS,
    REPORT_UPDATE,
    RETRY_EVICTION_SIGNAL,
    SCALE_DEPLOYMENT,
    SCALE_UP_REFUSED,
    TELL_INDEXED,
    VERIFY_AGENT,
    PoolInput,
    agent_workflow_id,
    pool_task_timeout,
)
import agentroster.workflows.messages as messages
from agentroster.workflows.messages import Refused

REFUSALS_KEPT = 20
# Agents to read are read in batches, one `read_agents` activity per batch with at most
# READS_IN_FLIGHT batches at once. Every agent snapshot is a hint: unless it only
# confirms what the pool has, the pool applies what the agent workflow itself reports.
READ_BATCH = 200
READS_IN_FLIGHT = 8
# A run relearning its fleet reads a small batch first: the first agents it learns serve the
# callers waiting meanwhile (a batch's readings are applied together, once it is all read).
RELEARN_FIRST_BATCH = 16
# How long a retired agent may finish what it has in flight.
DRAIN_DEADLINE_S = 300.0
# A health round's batches (core.health.HEALTH_BATCH_MAX agents each) are checked at most
# HEALTH_IN_FLIGHT at once, the next started when one reports: each reports by update, and
# the server admits at most 10 updates in flight per workflow, callers' acquires included
# (a shard of 2,500 agents has 13 batches a round). Batches still queued when the run
# continues as new are checked in the next round.
HEALTH_IN_FLIGHT = 4
# A health round that cannot run (no worker) is not retried long: the next round comes.
HEALTH_RETRY = RetryPolicy(maximum_attempts=2)
HEALTH_TIMEOUT = timedelta(seconds=30)
SCALE_TIMEOUT = timedelta(minutes=30)
# Reads, listings and signals: retried for up to MESSAGE_TIMEOUT.
MESSAGE_TIMEOUT = timedelta(minutes=5)
# An alarm's attempt that waits asks for its retry after the wait (`pool_alarm`); an attempt
# that reports may take ALARM_SLACK, and is retried a few times.
ALARM_SLACK = timedelta(seconds=30)
ALARM_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
# A chore whose report has not come this long after its activity's own time ran out is
# taken as lost: what it stood for is handled as a failure (a read that failed, a health
# round that did not run, a scaling that failed), so nothing waits on it for ever.
CHORE_MARGIN_S = 60.0
# How long a run that is due to end (continue as new, or a shutdown over) waits for its activities to end (`_quiesce`).
QUIESCE_S = 3.0
# Chores that never report (signals to deliver, index notices) are kept until their activity
# succeeds, at most this long: an activity the run started but that had not started itself when
# the run continued as new never runs, so a continue-as-new starts them again (each is
# idempotent: notices carry their sequence).
UNREPORTED = ("deliver", "told")
CARRY_S = 5.0
# Signals one `deliver_signals` chore sends (its argument stays far under the 2 MiB a command may carry).
DELIVER_BATCH = 500
# Load notices: while the pool is hot (HOT_WAKES wakes within the last second), they leave
# at most every NOTICE_GAP_S (each agent's latest load), so a stream of leases costs one
# `deliver_signals` chore per gap instead of one per wake; a notice held back goes with
# the next wake after the gap, or at an alarm NOTICE_LATEST_S after the last notices left
# when the stream stops (an alarm costs three actions: it is armed for the stream's end, not
# for every gap). A pool that is not hot sends them at once.
NOTICE_GAP_S = 0.25
NOTICE_LATEST_S = 1.0
HOT_WAKES = 20
# The core's load notices, by the agent workflow's signal names.
LOAD_SIGNALS = ("acquire", "release")
GONE_MAX = 100_000  # agents one `gone` report may name
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
        self._started = False  # the run's first wake has resumed what the previous run left
        self._alarms: dict[str, float] = {}  # alarm chore key -> when it reports
        self._open: dict[str, Any] = {}  # chore key -> its activity's handle, until it ends
        self._retired: list[Delivery] = []  # drains for a scale-down's retirees, sent at the next flush
        self._chores: dict[str, dict[str, Any]] = {}  # key (activity id) -> what its report stands for
        self._zero_waiting: list[ScaleRequest] = []  # a shutdown's scale to zero, after the scaling under way
        self._refused: list[str] = list(input.refused)
        self._continuing = False
        # When load notices last left, and the latest wakes (see NOTICE_GAP_S): carried, so a run
        # that continued as new under load is as hot as the one before it.
        self._notices_sent_at = float("-inf") if input.notices_sent_at is None else input.notices_sent_at
        self._wakes: deque[float] = deque(input.wakes, maxlen=HOT_WAKES)
        self._core.set_shard(input.shard, input.layout())
        self._core.verify_known_agents = True  # every snapshot signal is a hint (see `PoolCore.agent_snapshot`)
        self._read_queue: list[str] = []  # agents to read, in the order the core asked
        self._health_queue: deque[list[HealthTarget]] = deque()  # a health round's batches not yet started
        self._version = 0  # moves with every change to the pool: what `status` is cached against
        self._status_cache: tuple[int, RawValue] | None = None  # (version, encoded `status`)
        self._relearn_batches = 0  # read batches sent while relearning
        self._nudge = False  # held agents to nudge (an eviction policy changed or an operator confirmed)

    # ------------------------------------------------------------------ run
    # The run wakes for updates (and acts in the `agent_snapshots` signal's handler), never
    # for a timer, an activity's end or a signal's delivery: what the pool needs done outside
    # runs as an activity it does not wait for (a chore), which reports back with the
    # `report` update; its next deadline is an alarm chore. Its commands are then decided by
    # the messages alone, in their order, however a worker groups the events of one workflow
    # task into activations (temporalio/sdk-python#1591: a worker that starts cold runs a
    # task's new events apart from its updates; replay runs them together). An update's
    # handler starts nothing itself: what it changed is carried out by the loop it wakes.
    @workflow.run
    async def run(self, input: PoolInput) -> PoolStatus | None:
        """Runs until shut down (the `shutdown` update), continuing as new; returns the final status."""
        # A run that has work waiting (a relearn, its predecessor's effects and chores) or carries a
        # shutdown (which may be over: its last word came to the run before) wakes at once; any
        # other waits for its first message or deadline.
        self._arm_alarm(
            now=self._core.relearning or bool(input.chores) or self._core.has_effects() or self._core.shutdown is not None
        )
        while True:
            await workflow.wait_condition(lambda: self._dirty)
            self._dirty = False
            if self._should_continue_as_new():
                # Nothing is started in the run's last task (an activity not yet started when
                # the run closes never runs): what is queued stays in the state, and the chores
                # started just before are carried, for the next run to carry out.
                self._continuing = True
                await self._quiesce()
                self._tick()
                if self._retired:
                    self._chores["retired"] = {
                        "kind": "deliver", "expires": 0.0, "notices": [], "items": [d.model_dump(mode="json") for d in self._retired],
                    }
                for request in self._zero_waiting:
                    self._chores[f"zero-{request.deployment}"] = {
                        "kind": "scaled", "expires": 0.0, "purpose": "zero", "deployment": request.deployment,
                        "request": request.model_dump(mode="json"),
                    }
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
                        chores=list(self._chores.values()),
                        refused=self._refused,
                        runs=self._input.runs + 1,
                        shard=self._input.shard,
                        shards=self._input.shards,
                        shard_by=self._input.shard_by,
                        wakes=list(self._wakes),
                        notices_sent_at=None if self._notices_sent_at == float("-inf") else self._notices_sent_at,
                    )
                )
            self._wake()
            if self._core.shutdown is not None and await self._shutdown_over():
                return self._core.status()

    async def _quiesce(self) -> None:
        """Before the run ends (a continue-as-new, or a shutdown that is over): the alarms are
        cancelled and the run waits (at most QUIESCE_S) for its other activities to end. An
        activity that ends while the run's last task is being completed would make the server
        refuse that task (UnhandledCommand), and the worker rebuild the run from its history
        before trying again while callers wait; one that ends after the run closed reports to a
        closed workflow (its worker logs "Activity not found on completion").

        Nothing here depends on how a task's events are grouped: handlers start no activity
        (only the loop does), and the loop ends the run in the task where the last activity's
        end, or the timeout, is recorded, or goes on (a shutdown a message reopened), arming
        its alarm again at its next wake."""
        for key, handle in self._open.items():
            if key.startswith("alarm-"):  # (one that has reported may not have ended yet)
                handle.cancel()
                self._alarms.pop(key, None)
        try:
            await workflow.wait_condition(lambda: not self._open and workflow.all_handlers_finished(), timeout=QUIESCE_S)
        except asyncio.TimeoutError:
            workflow.logger.info("pool %s: ending the run with %d activity(ies) still running", self._input.pool, len(self._open))

    def _wake(self) -> None:
        """Deadlines, then every effect queued, then the alarm for the next deadline."""
        if not self._started:
            self._started = True
            if self._core.relearning:  # started without state, or continued as new while relearning
                self._core.begin_relearn()
                self._chore(
                    "found", FIND_AGENTS, self._input.pool, {},
                    summary=f"relearn the fleet: list the running agent workflows of pool {self._input.pool}",
                    start_to_close=timedelta(seconds=60), schedule_to_close=MESSAGE_TIMEOUT, retry=MESSAGE_RETRY,
                )
            self._resume(self._input.chores)
        self._wakes.append(self._now())
        self._tick()
        self._flush()
        self._arm_alarm()
        self._show()
        self._version += 1

    def _show(self) -> None:
        """What the Temporal UI shows as this pool's current details (read on demand: no history cost)."""
        core = self._core
        states = {state.value: n for state, n in core.index.state_counts().items()}
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
                f"`{d}` " + (f"{p.min_replicas}-{p.max_replicas}" if p.sizes else "unsized") for d, p in sorted(core.autoscaler.policies.items())
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
        now = self._now()
        self._core.tick(now, self._new_id)
        for key, chore in list(self._chores.items()):
            if chore["expires"] <= now:
                del self._chores[key]
                if chore["kind"] not in UNREPORTED:
                    self._lost(chore)

    # --------------------------------------------------------------- chores
    def _chore(
        self, kind: str, activity: str, arg: Any, meta: dict[str, Any] | None, *, summary: str,
        start_to_close: timedelta, schedule_to_close: timedelta | None = None, retry: RetryPolicy | None = None,
    ) -> str:
        """Start an activity the pool does not wait for. With `meta` (what its report, or its
        loss, stands for) the pool keeps it until its report, or until it is taken as lost; a
        chore that never reports (`UNREPORTED`) is kept CARRY_S, for a continue-as-new to carry."""
        key = f"{kind}-{self._new_id()[:20]}"
        if meta is not None:
            if kind in UNREPORTED:
                expires = self._now() + CARRY_S
            else:
                budget = (schedule_to_close or start_to_close * ((retry.maximum_attempts if retry else 0) or 1)).total_seconds()
                expires = self._now() + budget + CHORE_MARGIN_S
            self._chores[key] = {"kind": kind, "expires": expires, **meta}
        # A cancelled chore (an alarm, before a continue-as-new) ends when the server has recorded
        # its end: a run that continued as new at the cancel request itself would meet the end of
        # an attempt under way in its closing task (UnhandledCommand).
        handle = workflow.start_activity(
            activity, arg, activity_id=key, summary=summary,
            start_to_close_timeout=start_to_close, schedule_to_close_timeout=schedule_to_close, retry_policy=retry,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        self._open[key] = handle
        handle.add_done_callback(lambda done: self._ended(key, done))
        return key

    def _ended(self, key: str, handle: asyncio.Future[Any]) -> None:
        """A chore's activity ended: it leaves `_open` (read only by `_quiesce`) and its outcome is
        read, so asyncio never logs it as unretrieved. What the activity found came in its `report`;
        a chore that never reports (`UNREPORTED`) is done once its activity succeeded, and a
        continue-as-new no longer carries it (the next run would send it again, and carry that)."""
        self._open.pop(key, None)
        if not handle.cancelled() and handle.exception() is None and self._chores.get(key, {}).get("kind") in UNREPORTED:
            del self._chores[key]

    def _in_flight(self, kind: str, **match: Any) -> int:
        return sum(1 for c in self._chores.values() if c["kind"] == kind and all(c.get(k) == v for k, v in match.items()))

    def _resume(self, chores: list[dict[str, Any]]) -> None:
        """What the previous run's chores stood for, carried on: reads and scaling again (both are
        idempotent), a health round or a check as not done. A report of theirs still counts."""
        for chore in chores:
            kind = chore.get("kind")
            if kind == "read":
                self._read_queue.extend(a for a in chore.get("agent_ids", []) if a not in self._read_queue)
            elif kind == "scaled":
                self._scale_chore(ScaleRequest.model_validate(chore["request"]), chore.get("purpose", "scale"))
            elif kind in ("deliver", "gone"):
                for agent_id in chore.get("notices", []):
                    self._guarded("resend_notice", self._core.resend_notice, agent_id)
                self._deliver([Delivery.model_validate(i) for i in chore.get("items", [])], "deliver again what the previous run sent last",
                              awaited=kind == "gone")
            elif kind == "told":
                self._tell_indexed([IndexNotice.model_validate(n) for n in chore.get("notices", [])])
            else:
                self._lost(chore)

    def _lost(self, chore: dict[str, Any]) -> None:
        """A chore that will not report (or a previous run's, not started again): handled as failed."""
        kind, now = chore["kind"], self._now()
        workflow.logger.warning("pool %s: a %s chore did not report in time", self._input.pool, kind)
        if kind == "read":
            for agent_id in chore.get("agent_ids", []):
                self._guarded("read_agent", self._core.agent_read_failed, agent_id, "its read did not report in time")
            self._guarded("relearn", self._core.relearn_progress, now)
        elif kind == "found":
            self._guarded("relearn", self._core.relearn_found, {}, now)
        elif kind == "health":
            self._core.health_checks_lost(chore.get("agent_ids", []))
        elif kind == "checked":
            # Unknown: checked again later.
            self._guarded("shutdown_check", self._core.shutdown_checked, chore["agent_id"], True, now, self._new_id)
        elif kind == "scaled":
            self._scaled(ScaleDone(request=ScaleRequest.model_validate(chore["request"]), error="its activity did not report in time"))

    @workflow.update(name=REPORT_UPDATE)
    def report(self, *args: Any) -> None:
        """What one of the pool's chores found (sent by the chore's activity). Argument: a ChoreReport.

        A report the pool no longer waits for (a previous run's, or one that came late) is
        still applied: every kind is idempotent, and a read's findings count only as a hint
        (`PoolCore.agent_read_late`: the agent is read again unless they change nothing)."""
        report = self._report_arg(REPORT_UPDATE, args)
        self._updates += 1
        chore = self._chores.pop(report.key, None)
        self._alarms.pop(report.key, None)
        self._guarded(f"report {report.kind}", self._apply_report, report, chore or {})
        self._changed()

    @report.validator
    def _validate_report(self, *args: Any) -> None:
        self._admit(self._report_arg, REPORT_UPDATE, args)

    @staticmethod
    def _report_arg(kind: str, args: tuple[Any, ...]) -> ChoreReport:
        return messages.model(kind, ChoreReport, messages.one(kind, args))

    def _apply_report(self, report: ChoreReport, chore: dict[str, Any]) -> None:
        now = self._now()
        if report.kind == "read":
            readings = AgentReadings.model_validate(report.result)
            for agent_id in readings.agent_ids or chore.get("agent_ids", []):
                failed = readings.failed.get(agent_id)
                reading = readings.readings.get(agent_id)
                if not chore:  # a previous run's read, or one this run took as lost: maybe older than what it asked since
                    if failed is None and reading is not None:
                        self._guarded("read_agent", self._core.agent_read_late, agent_id, reading.snapshot, now, self._new_id)
                elif failed is not None or reading is None:
                    self._guarded("read_agent", self._core.agent_read_failed, agent_id, failed or "no reading returned")
                else:
                    self._guarded("read_agent", self._core.agent_read, agent_id, reading.snapshot, reading.detail, now, self._new_id)
            self._guarded("relearn", self._core.relearn_progress, now)
        elif report.kind == "found":
            found = report.result
            if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
                raise Refused("report found: expected an object of agent id -> deployment")
            workflow.logger.info("pool %s: relearning its fleet: %d agent workflow(s) running", self._input.pool, len(found))
            self._core.relearn_found(found, now)
        elif report.kind == "health":
            self._core.health_results([HealthResult.model_validate(r) for r in report.result], now)
        elif report.kind == "gone":
            # (empty: an awaited delivery that found every workflow running)
            gone = messages.texts("report gone", report.result, field="agent_id", at_most=GONE_MAX, max_length=LEASE_ID_MAX, at_least=0)
            for agent_id in gone:
                self._guarded("agent_gone", self._core.agent_gone, agent_id, "its workflow is gone", now, self._new_id)
        elif report.kind == "checked":
            checked = AgentChecked.model_validate(report.result)
            self._core.shutdown_checked(checked.agent_id, checked.running is not False, now, self._new_id)
        elif report.kind == "scaled":
            self._scaled(ScaleDone.model_validate(report.result))

    def _scaled(self, done: ScaleDone) -> None:
        """A scaling carried out (or failed): a scale-down's retirees drain, a shutdown's zero is done."""
        request = done.request
        if done.error is not None:
            workflow.logger.error("pool %s: scaling %s to %d failed: %s", self._input.pool, request.deployment, request.replicas, done.error)
        if request.shutdown:
            self._guarded("shutdown_scaled", self._core.shutdown_scaled, request.deployment, done.error)
        if request.victims:
            # Sent at the next flush: an update's handler starts nothing itself (see `run`).
            reason = "recycled" if request.reason.startswith("recycled") else "scale-down"
            drain = DrainRequest(reason=reason, deadline_s=DRAIN_DEADLINE_S)
            self._retired.extend(self._to_agent(victim, "drain", drain) for victim in request.victims)

    # --------------------------------------------------------------- alarms
    def _arm_alarm(self, now: bool = False) -> None:
        """One alarm chore for the earliest deadline (a chore's expiry and held-back load notices included), or for now.

        Its report wakes the run like any update. One that never reports (its worker died past
        its retries) is forgotten at the next wake, which arms another."""
        wake = self._now() if now else self._core.next_wakeup()
        expiries = [c["expires"] for c in self._chores.values() if c["kind"] not in UNREPORTED]
        if self._core.has_notices():
            expiries.append(self._notices_sent_at + NOTICE_LATEST_S)
        if expiries:
            wake = min(expiries) if wake is None else min(wake, *expiries)
        for key, at in list(self._alarms.items()):
            if at + ALARM_SLACK.total_seconds() * 5 < self._now():
                del self._alarms[key]
        if wake is None or any(at <= wake for at in self._alarms.values()):
            return
        wait = max(0.0, wake - self._now())
        key = self._chore(
            "alarm", POOL_ALARM, wait, None, summary=f"next deadline in {wait:.2f}s: leases, waiters, scaling, health",
            start_to_close=ALARM_SLACK, retry=ALARM_RETRY,
        )
        self._alarms[key] = wake

    # -------------------------------------------------------------- effects
    def _to_agent(self, agent_id: str, signal: str, arg: Any) -> Delivery:
        return Delivery(
            workflow_id=agent_workflow_id(self._input.pool, agent_id), signal=signal,
            arg=None if arg is None else arg.model_dump(mode="json"), agent_id=agent_id,
        )

    def _deliver(self, items: list[Delivery], summary: str, *, awaited: bool = False) -> None:
        """Signals sent together by `deliver_signals` chores of at most DELIVER_BATCH; an agent
        found gone is reported. `awaited`: the pool waits for their reports (sent even when no
        agent was gone). What a chore carries across a continue-as-new is small: a load
        notice as its agent's id (the next run sends the load as it is then)."""
        for i in range(0, len(items), DELIVER_BATCH):
            batch = items[i : i + DELIVER_BATCH]
            notices = [d.agent_id for d in batch if d.agent_id is not None and d.signal in LOAD_SIGNALS]
            others = [d.model_dump(mode="json") for d in batch if d.agent_id is None or d.signal not in LOAD_SIGNALS]
            self._chore(
                "gone" if awaited else "deliver", DELIVER_SIGNALS, Deliveries(pool=self._input.pool, items=batch, report=awaited),
                {"notices": notices, "items": others},
                summary=summary, start_to_close=timedelta(seconds=60), schedule_to_close=MESSAGE_TIMEOUT, retry=MESSAGE_RETRY,
            )

    def _hot(self) -> bool:
        """Whether HOT_WAKES wakes came within the last second (see NOTICE_GAP_S)."""
        return len(self._wakes) == HOT_WAKES and self._now() - self._wakes[0] <= 1.0

    def _flush(self) -> None:
        """Carry out what the core queued: notices, revocations, reads, scaling, health checks."""
        items: list[Delivery] = []
        if self._core.has_notices() and (not self._hot() or self._now() >= self._notices_sent_at + NOTICE_GAP_S):
            self._notices_sent_at = self._now()
            items = [self._to_agent(agent_id, signal, notice) for agent_id, signal, notice in self._core.take_notices()]
        items += [
            Delivery(workflow_id=holder, signal="lease_revoked", arg=revoked.model_dump(mode="json"))
            for holder, revoked in self._core.take_revocations()
        ]
        self._deliver(items, f"tell {len(items)} workflow(s) their load or a revocation")
        retired, self._retired = self._retired, []
        self._deliver(retired, f"drain {len(retired)} retired agent(s)")
        self._start_reads()
        self._tell_indexed(self._core.take_index_notices())
        for warning in self._core.take_warnings():
            workflow.logger.warning("pool %s: %s", self._input.pool, warning)
        for refusal in self._core.take_refusals():
            self._refuse("agent_snapshots", refusal)
        for request in self._core.take_scale_requests(self._now()):
            workflow.logger.info("pool %s: scale %s to %d (%s)", self._input.pool, request.deployment, request.replicas, request.reason)
            self._scale_chore(request, "scale")
        self._health_queue.extend(self._core.take_health_checks(self._now()))
        while self._health_queue and self._in_flight("health") < HEALTH_IN_FLIGHT:
            batch = self._health_queue.popleft()
            self._chore(
                "health", CHECK_HEALTH, HealthCheckBatch(pool=self._input.pool, targets=batch), {"agent_ids": [t.agent_id for t in batch]},
                summary=f"health check of {len(batch)} agent(s)", start_to_close=HEALTH_TIMEOUT, retry=HEALTH_RETRY,
            )
        for down in self._core.take_scale_downs():
            workflow.logger.info(
                "pool %s: scale %s down to %d, retiring %s (%s)",
                self._input.pool, down.deployment, down.replicas, ", ".join(down.victims), down.reason,
            )
            # The retirees' pods are marked to go first, then the count lowered, then (on the
            # report) they drain: drained before, each would be replaced by its Deployment at once.
            self._scale_chore(ScaleRequest(deployment=down.deployment, replicas=down.replicas, reason=down.reason, victims=down.victims), "down")
        if self._nudge:
            self._nudge = False
            self._nudge_held()
        self._flush_shutdown()

    def _tell_indexed(self, notices: list[IndexNotice]) -> None:
        """Index notices, one `tell_indexed` chore per batch (their `register` calls time out if
        it fails, as they would without the notice)."""
        for i in range(0, len(notices), READ_BATCH):
            batch = notices[i : i + READ_BATCH]
            self._chore(
                "told", TELL_INDEXED, IndexNotices(pool=self._input.pool, notices=batch), {"notices": [n.model_dump(mode="json") for n in batch]},
                summary=f"tell {len(batch)} agent(s) they are indexed: {batch[0].agent_id}{', ...' if len(batch) > 1 else ''}",
                start_to_close=timedelta(seconds=60), schedule_to_close=MESSAGE_TIMEOUT, retry=MESSAGE_RETRY,
            )
            self._core.index_notices_delivered(batch)

    def _start_reads(self) -> None:
        # (an agent a shutdown stopped reading meanwhile is not read)
        queued = self._read_queue + self._core.take_verifications()
        self._read_queue = [agent_id for agent_id in queued if self._core.is_being_read(agent_id)]
        while self._read_queue and self._in_flight("read") < READS_IN_FLIGHT:
            size = READ_BATCH
            if self._core.relearning and not self._relearn_batches:
                size = RELEARN_FIRST_BATCH
            if self._core.relearning:
                self._relearn_batches += 1
            batch, self._read_queue = self._read_queue[:size], self._read_queue[size:]
            self._chore(
                "read", READ_AGENTS, AgentRefs(pool=self._input.pool, agent_ids=batch), {"agent_ids": batch},
                summary=f"read {len(batch)} agent(s)' own snapshots: {batch[0]}{', ...' if len(batch) > 1 else ''}",
                start_to_close=timedelta(seconds=60), schedule_to_close=MESSAGE_TIMEOUT, retry=MESSAGE_RETRY,
            )

    def _scale_chore(self, request: ScaleRequest, purpose: str) -> None:
        what = {"scale": "scale", "down": "scale down", "zero": "scale to zero"}[purpose]
        self._chore(
            "scaled", SCALE_DEPLOYMENT, request, {"request": request.model_dump(mode="json"), "purpose": purpose, "deployment": request.deployment},
            summary=f"{what} {request.deployment} to {request.replicas}" + (f", retiring {', '.join(request.victims)}" if request.victims else ""),
            start_to_close=timedelta(seconds=60), schedule_to_close=SCALE_TIMEOUT, retry=BACKEND_CHORE_RETRY,
        )

    def _changed(self) -> None:
        self._dirty = True
        self._version += 1

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
        raw = messages.listed(kind, messages.one(kind, args), what="lease_ids", at_most=MAX_BATCH)
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
    def set_policy(self, *args: Any) -> PoolStatus:
        """Set (or, with policy None, remove) a deployment's policy, or set the pool's
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
            self._nudge = True
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

    def _flush_shutdown(self) -> None:
        """Carry out the shutdown's effects: agents drained (together), then scaled to zero."""
        effects = self._core.take_shutdown_effects(self._now())
        pool = self._input.pool
        if effects:
            # Scaled to zero once they are told: an agent stopped by its backend first would drain with another reason.
            self._deliver([self._to_agent(agent_id, "drain", request) for agent_id, request in effects.drains],
                          f"drain {len(effects.drains)} agent(s): pool {pool} shuts down", awaited=True)
            for request in effects.scales:
                workflow.logger.info("pool %s: scaling %s to zero (%s)", pool, request.deployment, request.reason)
                self._zero_waiting.append(request)
            for agent_id in effects.checks:  # an agent that outlived its drain: does its workflow still run?
                self._chore(
                    "checked", VERIFY_AGENT, AgentRef(pool=pool, agent_id=agent_id), {"agent_id": agent_id},
                    summary=f"check agent {agent_id} still runs (it outlived its drain)",
                    start_to_close=timedelta(seconds=10), schedule_to_close=MESSAGE_TIMEOUT, retry=MESSAGE_RETRY,
                )
        # A deployment goes to zero after the drains are sent and after any scaling of it already
        # under way (which would land after ours).
        waiting, self._zero_waiting = self._zero_waiting, []
        for request in waiting:
            if self._in_flight("gone") or self._in_flight("scaled", deployment=request.deployment) or self._in_flight("scaled", purpose="down"):
                self._zero_waiting.append(request)
            else:
                self._scale_chore(request, "zero")

    async def _shutdown_over(self) -> bool:
        """Whether the run may end now: the shutdown is complete, and still is once its activities
        ended (`_quiesce`) and every handler finished."""
        if not self._core.shutdown_complete(self._now()):
            return False
        await self._quiesce()
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
    def confirm_evictions(self, *args: Any) -> EvictionStatus:
        """An operator confirms that silent agents are gone. Argument: a ConfirmEvictions (agents None: all)."""
        request = self._confirm_arg("confirm_evictions", args)
        self._updates += 1
        confirmed = self._core.confirm_evictions(request.agents, self._now())
        workflow.logger.warning("pool %s: evictions confirmed by an operator: %s", self._input.pool, confirmed)
        self._changed()
        self._nudge = True
        return self._core.eviction.status()

    @confirm_evictions.validator
    def _validate_confirm_evictions(self, *args: Any) -> None:
        self._admit(self._confirm_arg, "confirm_evictions", args)

    def _nudge_held(self) -> None:
        """Held agents that will now be let go ask again at once instead of at their next retry."""
        agent_ids = self._core.eviction.releasable()
        self._deliver(
            [Delivery(workflow_id=agent_workflow_id(self._input.pool, agent_id), signal=RETRY_EVICTION_SIGNAL) for agent_id in agent_ids],
            f"nudge {len(agent_ids)} held agent(s) to ask again",
        )

    # -------------------------------------------------------------- signals
    def _signal(self, kind: str, apply: Any, args: tuple[Any, ...]) -> None:
        """Apply a signal; a malformed one (or a core refusal) is kept in `status.refusals`, never raised.

        The run's loop wakes for updates only (see `run`): when the signal left something
        to carry out, or a continue-as-new is due, the handler starts an alarm for now, whose
        report wakes the loop (one for every signal of a workflow task: they are read together)."""
        self._signals += 1
        self._version += 1
        try:
            apply(args)
        except Refused as exc:
            self._refuse(kind, str(exc).removeprefix(f"{kind}: "))
        except Exception as exc:  # a raise here would fail every replay of this history
            self._refuse(kind, f"{type(exc).__name__}: {exc}")
        if not self._continuing and (self._core.has_effects() or self._should_continue_as_new() or not self._started):
            self._arm_alarm(now=True)

    @workflow.signal(name=AGENT_SNAPSHOTS_SIGNAL)
    def agent_snapshots(self, *args: Any) -> None:
        """Agent workflows' states and capabilities (or their terminations). Argument: a list of
        1 to MAX_BATCH AgentSnapshots, applied in order; a malformed one is refused alone
        (`status.refusals` names its place in the list), the others are applied.

        Anyone may send it: unless a snapshot only confirms what the pool has, it is a
        hint, and the pool applies what the agent workflow itself reports (`_read_batch`).
        """

        def apply(a: tuple[Any, ...]) -> None:
            raw = messages.listed("agent_snapshots", messages.one("agent_snapshots", a), what="snapshots", at_most=MAX_BATCH)
            for i, item in enumerate(raw):
                try:
                    snapshot = messages.model(f"[{i}]", AgentSnapshot, item)
                except Refused as exc:
                    self._refuse("agent_snapshots", str(exc))
                    continue
                self._guarded("agent_snapshots", self._core.agent_snapshot, snapshot, self._now(), self._new_id)

        self._signal("agent_snapshots", apply, args)

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

        The pool changes only in a message's handler or the wake after it, each of which moves
        `_version`; between two, every query (dashboards, metrics, the CLI: O(agents) each,
        ~20 ms for 1,000 agents) gets the same payload. Queries change nothing."""
        if self._status_cache is None or self._status_cache[0] != self._version:
            converter = workflow.payload_converter()
            status = self._status()
            payload = converter.to_payload(status)
            if len(payload.data) > STATUS_REPLY_MAX_BYTES:  # 6,000-8,000+ agents: rows left out, counted
                payload = converter.to_payload(fit_status(status, len(payload.data), lambda s: len(converter.to_payload(s).data)))
            self._status_cache = (self._version, RawValue(payload))
        return self._status_cache[1]

    @workflow.query(name="tickets")
    def tickets(self, *args: Any) -> list[TicketStatus]:
        """Where queued callers stand (one query serves many waiters). Argument: a list of tickets."""
        raw = messages.one("tickets", args)
        if not isinstance(raw, list) or len(raw) > 10_000:
            raise Refused("tickets: expected a list of at most 10000 tickets")
        return [self._core.ticket_status(messages.text("tickets", t, field="ticket", max_length=LEASE_ID_MAX)) for t in raw]
