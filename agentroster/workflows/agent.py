"""AgentWorkflow (id `agent/{pool}/{agent_id}`): the one writer of an agent's lifecycle.

A thin shell over `core.lifecycle.AgentLifecycle`. Signals land in an inbox and
the main loop applies them in order, so every transition, every pool
notification and every pod deletion is one readable step in the history.

The workflow keeps its own transition log (`AgentLifecycle.transitions`: how the
agent came up and the newest steps, plus counts of what was left out and of load
flips), carries it across continue-as-new, answers it in the `status` query and
returns it as the run's result once the agent is Terminated: `describe` reads that,
never the history.
"""

from __future__ import annotations

import asyncio
from collections import deque
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

from agentroster.vocabulary.a2a import CHECK_A2A_AGENT, UNREACHABLE_REASON, card_url_of, is_a2a
from agentroster.messages import (
    AgentSnapshot,
    CapabilityDigest,
    DrainRequest,
    EvictionVerdict,
    IndexNotice,
    LoadNotice,
    PodGone,
    PodRef,
    PoolEvictionAsk,
    PoolNotification,
)
from agentroster.models import AgentRegistration, AgentState, AgentStatus, Transition
from agentroster.core.lifecycle import AgentLifecycle, TransitionRefused
from agentroster.vocabulary.wire import (
    AGENT_END_REASON,
    BACKEND_RETRY,
    DELETE_POD,
    INDEX_NOTICE_SIGNAL,
    MESSAGE_RETRY,
    NOTIFY_POOL,
    POD_GONE_SIGNAL,
    REGISTER_SIGNAL,
    REQUEST_EVICTION,
    RETRY_EVICTION_SIGNAL,
    AgentWorkflowInput,
    agent_search_attributes,
)
import agentroster.workflows.messages as messages
from agentroster.workflows.messages import Refused

REFUSALS_KEPT = 20
# How long a silent agent waits for its pool's answer before it terminates anyway.
EVICTION_ASK_TIMEOUT = timedelta(seconds=30)


@workflow.defn(name="AgentWorkflow")
class AgentWorkflow:
    @workflow.init
    def __init__(self, input: AgentWorkflowInput) -> None:
        self._input = input
        self._life = (
            AgentLifecycle.from_carried(input.carried)
            if input.carried
            else AgentLifecycle(agent_id=input.agent_id, pool=input.pool)
        )
        self._inbox: deque[tuple[str, Any]] = deque()
        self._signals = 0
        self._refused: deque[str] = deque(input.refused, maxlen=REFUSALS_KEPT)
        self._wake = False
        self._handing_over = False  # continuing as new: waiting updates answer now
        self._unpublished: AgentState | None = None  # a state not upserted yet (see `run`)
        self._checked_at: Any = None  # an A2A agent's last liveness check (see `_check_due`)
        # The lifecycle's wake-up the loop's timer waits for (None: it waits for an A2A check, or nothing).
        self._armed: datetime | None = None

    # ------------------------------------------------------------------ run
    @workflow.run
    async def run(self, input: AgentWorkflowInput) -> AgentStatus:
        now = workflow.now()
        if self._life.state is None:
            spawned = self._life.spawn(now)
            if self._inbox:
                # A registration came with the start: the upsert it makes in this same task says it all.
                self._log(spawned)
                self._unpublished = spawned[-1].to_state
            else:
                self._record(spawned)
        while True:
            if self._unpublished is not None and not self._inbox:
                self._publish(self._unpublished)  # what came with the start made no transition
            self._show()
            wakeup = self._armed = self._life.next_wakeup()
            check = self._check_due()
            if check is not None and (wakeup is None or check < wakeup):
                wakeup, self._armed = check, None
            timeout = max(0.0, (wakeup - workflow.now()).total_seconds()) if wakeup else None
            try:
                await workflow.wait_condition(
                    lambda: self._wake or self._should_continue_as_new(), timeout=timeout, timeout_summary="liveness check"
                )
            except asyncio.TimeoutError:
                pass
            self._wake = False
            while self._inbox:
                kind, message = self._inbox.popleft()
                await self._apply(kind, message)
            now = workflow.now()
            check = self._check_due()
            if check is not None and now >= check:
                await self._check_a2a()
                now = workflow.now()
            if self._life.state != AgentState.TERMINATED:
                if self._life.is_lost(now):
                    if self._life.eviction_held_until is not None:
                        if self._life.eviction_retry_due(now):
                            await self._ask_eviction()
                    elif self._life.registration is not None:
                        await self._ask_eviction()
                    else:
                        await self._terminate(self._lost_reason())
                elif self._life.eviction_held_until is not None:
                    await self._recovered()
                elif self._life.resync_wanted(now):
                    await self._tell_pool("resync", resync=True)
                elif self._life.drain_finished(now):
                    finished = self._life.drain_count_confirmed and self._life.in_flight == 0
                    await self._terminate(
                        "drain", None if finished else f"deadline passed with {self._life.in_flight} task(s) in flight"
                    )
            if self._life.state == AgentState.TERMINATED:
                self._show()
                await workflow.wait_condition(workflow.all_handlers_finished)
                return self._life.status()
            if self._should_continue_as_new():
                # A registration still waiting for its pool's notice is answered now (not
                # indexed_by_pool: its client then asks the pool), so a notice that never
                # comes cannot hold the run open.
                self._handing_over = True
                await workflow.wait_condition(workflow.all_handlers_finished)
                self._handing_over = False
                if self._inbox or self._wake:
                    continue
                workflow.continue_as_new(
                    AgentWorkflowInput(
                        agent_id=self._input.agent_id,
                        pool=self._input.pool,
                        max_signals_per_run=self._input.max_signals_per_run,
                        carried=self._carry(),
                        refused=list(self._refused),
                        pool_shards=self._input.pool_shards,
                        pool_shard_by=self._input.pool_shard_by,
                    )
                )

    def _should_continue_as_new(self) -> bool:
        return self._signals >= self._input.max_signals_per_run or workflow.info().is_continue_as_new_suggested()

    def _carry(self) -> dict[str, Any]:
        return self._life.to_carried()

    # ------------------------------------------------------------ applying
    async def _apply(self, kind: str, message: Any) -> None:
        now = workflow.now()
        try:
            if kind == "register":
                steps = self._life.register(message, now)
                self._record(steps)
                await self._tell_pool("registered")
                self._record(self._life.indexed(workflow.now()))
            elif kind == "load":
                self._record(self._life.apply_load(message, now))
            elif kind == "drain":
                was_registered = self._life.registration is not None
                steps = self._life.drain(message.reason, message.deadline_s, now)
                self._record(steps)
                if steps and was_registered:
                    await self._tell_pool(message.reason)
            elif kind == "pod_gone":
                steps = self._life.pod_gone(message, now)
                if steps:
                    await self._ended(steps)
        except TransitionRefused as exc:
            self._refuse(kind, str(exc))

    async def _terminate(self, reason: str, detail: str | None = None) -> None:
        await self._ended(self._life.terminate(reason, workflow.now(), detail))

    async def _ended(self, steps: list[Transition]) -> None:
        """After the Terminated transition: tell the pool, then delete the pod (a retried activity)."""
        self._record(steps)
        reason = self._life.terminated_reason or "terminated"
        if self._life.registration is not None:
            reg = self._life.registration
            # The pool first, so no new lease goes to a pod that is about to vanish.
            await self._tell_pool(reason)
            if is_a2a(reg.metadata):
                return  # an agent registered from its Agent Card runs elsewhere: no pod of ours to delete
            try:
                await workflow.execute_activity(
                    DELETE_POD,
                    PodRef(deployment=reg.deployment, agent_id=reg.agent_id, reason=reason),
                    summary=f"delete pod {reg.agent_id} of {reg.deployment} ({reason})",
                    start_to_close_timeout=timedelta(seconds=60),
                    retry_policy=BACKEND_RETRY,
                    schedule_to_close_timeout=timedelta(hours=1),
                )
            except ActivityError as exc:
                # The agent is Terminated whatever the backend says; an operator
                # finds the refusal (e.g. RBAC 403) here and in the history.
                self._refuse("delete_pod", f"{exc.cause or exc}")

    async def _ask_eviction(self) -> None:
        """Silent for its whole window: ask the pool whether to terminate now (self-preservation may say no)."""
        reg = self._life.registration
        assert reg is not None
        try:
            verdict: EvictionVerdict = await workflow.execute_activity(
                REQUEST_EVICTION,
                PoolEvictionAsk(
                    pool=self._life.pool, agent_id=reg.agent_id, window_s=self._life.heartbeat_window_s, shard=self._home_shard()
                ),
                result_type=EvictionVerdict,
                start_to_close_timeout=timedelta(seconds=10),
                schedule_to_close_timeout=EVICTION_ASK_TIMEOUT,
                retry_policy=MESSAGE_RETRY,
            )
        except ActivityError as exc:
            # No answer in time: the agent is silent and no pool holds it back, so it terminates.
            self._refuse("request_eviction", f"pool {self._life.pool} did not answer: {exc.cause or exc}")
            await self._terminate(self._lost_reason(), f"pool {self._life.pool} did not answer the eviction request")
            return
        now = workflow.now()
        if not self._life.is_lost(now):
            await self._recovered()  # a heartbeat came while it asked
        elif verdict.allow:
            # The transition says why when it is not the plain case (confirmed, unknown to the pool, safety off).
            await self._terminate(self._lost_reason(), verdict.reason if verdict.reason not in ("", "already allowed") else None)
        else:
            self._life.hold_eviction(verdict.reason, verdict.retry_after_s, now)
            workflow.logger.warning(
                "agent %s: silent, but pool %s holds its termination back (%s); asking again in %.1fs",
                reg.agent_id, self._life.pool, verdict.reason, verdict.retry_after_s,
            )

    # ------------------------------------------------ agents that run no code of ours
    def _check_due(self) -> Any:
        """When an A2A agent (registered from its Agent Card) is checked next, or None.

        Such an agent sends no heartbeat: this workflow reads its card once per heartbeat
        interval (one timer and one activity), and an answer counts as a heartbeat. One
        workflow per agent, so one check whatever the number of workers."""
        life = self._life
        if life.state in (None, AgentState.TERMINATED) or life.registration is None or not is_a2a(life.registration.metadata):
            return None
        last = self._checked_at or life.last_heartbeat or workflow.now()
        return last + timedelta(seconds=life.heartbeat_interval_s)

    async def _check_a2a(self) -> None:
        reg = self._life.registration
        assert reg is not None
        self._checked_at = workflow.now()
        interval = self._life.heartbeat_interval_s
        try:
            why: str | None = await workflow.execute_activity(
                CHECK_A2A_AGENT,
                card_url_of(reg.metadata, reg.endpoint),
                summary="read the A2A agent's card",
                start_to_close_timeout=timedelta(seconds=min(10.0, interval) + 1),
                retry_policy=RetryPolicy(maximum_attempts=1),  # the next interval is the retry
            )
        except ActivityError as exc:
            why = f"{exc.cause or exc}"
        if why is None or not isinstance(why, str):
            self._life.heartbeat(workflow.now())
        else:
            workflow.logger.info("agent %s: the A2A card did not answer: %s", reg.agent_id, why)

    def _lost_reason(self) -> str:
        """Why a silent agent ends: its heartbeats stopped, or (A2A) its card stopped answering."""
        reg = self._life.registration
        return UNREACHABLE_REASON if reg is not None and is_a2a(reg.metadata) else "heartbeat_lost"

    async def _recovered(self) -> None:
        """A heartbeat after the window: the agent stays, and the pool routes to it again."""
        self._life.release_eviction_hold()
        workflow.logger.info("agent %s: heartbeat resumed after its window", self._life.agent_id)
        await self._tell_pool("heartbeat resumed")

    def _snapshot(self, reason: str) -> AgentSnapshot | None:
        """What this agent tells its pool (and what the `snapshot` query answers): None before it registers."""
        reg = self._life.registration
        if reg is None or self._life.state is None:
            return None
        return AgentSnapshot(
            agent_id=reg.agent_id,
            deployment=reg.deployment,
            endpoint=reg.endpoint,
            state=self._life.state,
            capabilities=[
                CapabilityDigest(name=c.name, version=c.version, max_concurrency=c.max_concurrency, cost_class=c.cost_class)
                for c in reg.capabilities
            ],
            max_concurrency=reg.max_concurrency,
            reason=reason,
            resync_interval_s=self._life.resync_interval_s,
            awaits_index=self._life.awaits_index,
        )

    async def _tell_pool(self, reason: str, *, resync: bool = False) -> None:
        reg = self._life.registration
        snapshot = self._snapshot(reason)
        if reg is None or snapshot is None or self._life.state is None:
            return
        self._life.told_pool(workflow.now(), None if resync else workflow.random().random())
        try:
            await workflow.execute_activity(
                NOTIFY_POOL,
                PoolNotification(
                    pool=self._life.pool, snapshot=snapshot, shard=self._home_shard(),
                    shards=self._input.pool_shards, shard_by=self._input.layout().by,
                ),
                summary=f"tell pool {self._life.pool}: {self._life.state.value} ({reason})",
                start_to_close_timeout=timedelta(seconds=10),
                schedule_to_close_timeout=timedelta(minutes=10),
                retry_policy=MESSAGE_RETRY,
            )
        except ActivityError as exc:  # pragma: no cover - only after 10 minutes of retries
            workflow.logger.error("agent %s: could not tell pool %s: %s", reg.agent_id, self._life.pool, exc)

    def _home_shard(self) -> int:
        """The pool shard that holds this agent (0 in an unsharded pool; see `core.shards`)."""
        reg = self._life.registration
        if reg is None:
            return 0
        return self._input.layout().home_shard(reg.agent_id, reg.deployment)

    def _record(self, steps: list[Transition]) -> None:
        """Log each transition and upsert the search attributes operators filter on."""
        if not steps:
            return
        self._log(steps)
        self._publish(steps[-1].to_state)

    def _log(self, steps: list[Transition]) -> None:
        for step in steps:
            workflow.logger.info(
                "agent %s: %s -> %s (%s)",
                self._life.agent_id,
                step.from_state.value if step.from_state else "start",
                step.to_state.value,
                step.reason,
            )

    def _publish(self, state: AgentState) -> None:
        """Upsert the search attributes for `state` that change (every upsert is a billed action)."""
        self._unpublished = None
        updates = [key.value_set(value) for key, value in agent_search_attributes(self._life.pool, state.value, self._life.registration)]
        if state == AgentState.TERMINATED and self._life.terminated_reason:
            updates.append(AGENT_END_REASON.value_set(self._life.terminated_reason))
        current = workflow.info().typed_search_attributes
        updates = [u for u in updates if current.get(u.key) != u.value]
        if updates:
            workflow.upsert_search_attributes(updates)

    def _show(self) -> None:
        """What the Temporal UI shows as this agent's current details (read on demand: no history cost)."""
        life = self._life
        reg = life.registration
        state = life.state.value if life.state else "Spawning"
        lines = [f"**{state}**" + (f" — ended: `{life.terminated_reason}`" if life.terminated_reason else "")]
        if reg is not None:
            # The pool tells an agent workflow only when saturation flips (cost): exact counts are in the pool.
            load = f"saturated ({life.in_flight}/{reg.total_concurrency} in flight)" if life.saturated else f"free slots (capacity {reg.total_concurrency})"
            lines.append(f"{load} · deployment `{reg.deployment}` · {reg.endpoint}")
            lines.append("capabilities: " + ", ".join(f"`{c.name}@{c.version}`" for c in reg.capabilities))
        if life.last_heartbeat is not None:
            lines.append(f"last heartbeat {life.last_heartbeat.isoformat(timespec='seconds')} (every {life.heartbeat_interval_s:g}s)")
        if life.state == AgentState.DRAINING and life.drain_deadline is not None:
            lines.append(f"draining ({life.drain_reason}) until {life.drain_deadline.isoformat(timespec='seconds')}")
        workflow.set_current_details("\n\n".join(lines))

    def _refuse(self, kind: str, reason: str) -> None:
        text = f"{kind} refused: {reason}"
        workflow.logger.warning("agent %s: %s", self._input.agent_id, text)
        self._refused.append(text)

    def _signal(self, kind: str, apply: Any, args: tuple[Any, ...]) -> None:
        """Apply a signal; a malformed one is logged in `refusals`, never raised (that would fail every replay)."""
        self._signals += 1
        try:
            apply(args)
        except Refused as exc:
            self._refuse(kind, str(exc).removeprefix(f"{kind}: "))
        except Exception as exc:
            self._refuse(kind, f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------- signals
    # Every handler takes `*args` so the SDK hands over whatever was sent; see
    # `workflows/messages.py`.
    @workflow.signal(name=REGISTER_SIGNAL)
    def register(self, *args: Any) -> None:
        """(Re-)register the agent with its capabilities. Argument: an AgentRegistration."""

        def apply(a: tuple[Any, ...]) -> None:
            reg = messages.model("register", AgentRegistration, messages.one("register", a))
            if reg.agent_id != self._input.agent_id:
                raise Refused(f"register: agent_id {reg.agent_id!r} does not match this workflow's agent {self._input.agent_id!r}")
            warning = reg.short_heartbeat_warning()
            if warning:
                workflow.logger.warning(warning)
            self._life.heartbeat(workflow.now())
            self._inbox.append(("register", reg))
            self._wake = True

        self._signal("register", apply, args)

    @workflow.signal(name="heartbeat")
    def heartbeat(self, *args: Any) -> None:
        """The agent is alive. Takes no argument (any is ignored: a heartbeat is its arrival)."""
        self._signals += 1
        if self._life.state in (AgentState.SPAWNING, AgentState.REGISTERING, AgentState.READY, AgentState.BUSY):
            # Most heartbeats wake nothing: one signal event. Every second one wakes the
            # loop to arm the next wake-up (`wake_wanted`), so no timer fires while they come.
            now = workflow.now()
            self._life.heartbeat(now)
            # One held by its pool is back now, not at the next ask.
            if self._life.eviction_held_until is not None or self._life.wake_wanted(self._armed, now):
                self._wake = True

    @workflow.signal(name=POD_GONE_SIGNAL)
    def pod_gone(self, *args: Any) -> None:
        """The backend saw the agent's process exit or its pod go: Terminated at once. Argument: a PodGone."""

        def apply(a: tuple[Any, ...]) -> None:
            message = messages.model(POD_GONE_SIGNAL, PodGone, messages.one(POD_GONE_SIGNAL, a))
            if message.agent_id != self._input.agent_id:
                raise Refused(f"{POD_GONE_SIGNAL}: agent_id {message.agent_id!r} does not match this workflow's agent {self._input.agent_id!r}")
            self._inbox.append((POD_GONE_SIGNAL, message))
            self._wake = True

        self._signal(POD_GONE_SIGNAL, apply, args)

    @workflow.signal(name=RETRY_EVICTION_SIGNAL)
    def retry_eviction(self, *args: Any) -> None:
        """The pool's nudge to a held agent: ask again now (an operator confirmed). Any argument is ignored."""
        self._signals += 1
        if self._life.eviction_held_until is not None:
            self._life.eviction_held_until = workflow.now()
            self._wake = True

    @workflow.signal(name=INDEX_NOTICE_SIGNAL)
    def pool_indexed(self, *args: Any) -> None:
        """The pool indexed a registration: `wait_routable` answers. Argument: an IndexNotice.

        Anyone may send it; a forged one only lets a `register` call return before the
        pool routes to the agent (the pool still indexes only what it read from here)."""

        def apply(a: tuple[Any, ...]) -> None:
            notice = messages.model(INDEX_NOTICE_SIGNAL, IndexNotice, messages.one(INDEX_NOTICE_SIGNAL, a))
            if notice.agent_id != self._input.agent_id:
                raise Refused(f"{INDEX_NOTICE_SIGNAL}: agent_id {notice.agent_id!r} does not match this workflow's agent {self._input.agent_id!r}")
            self._life.pool_indexed(notice.registration)

        self._signal(INDEX_NOTICE_SIGNAL, apply, args)

    def _load(self, kind: str, args: tuple[Any, ...]) -> None:
        notice = messages.model(kind, LoadNotice, messages.one(kind, args))
        problem = self._life.implausible(notice)
        if problem:
            raise Refused(f"{kind}: {problem}")
        self._inbox.append(("load", notice))
        self._wake = True

    @workflow.signal(name="acquire")
    def acquire(self, *args: Any) -> None:
        """The pool granted leases: its load notice (coalesced). Argument: a LoadNotice."""
        self._signal("acquire", lambda a: self._load("acquire", a), args)

    @workflow.signal(name="release")
    def release(self, *args: Any) -> None:
        """Leases ended: the pool's load notice (coalesced). Argument: a LoadNotice."""
        self._signal("release", lambda a: self._load("release", a), args)

    @workflow.signal(name="drain")
    def drain(self, *args: Any) -> None:
        """Stop new leases now; terminate once in-flight reaches zero or the deadline passes.

        Argument (optional): a DrainRequest (reason, deadline_s).
        """

        def apply(a: tuple[Any, ...]) -> None:
            raw = messages.one("drain", a, optional=True)
            request = messages.model("drain", DrainRequest, {} if raw is None else raw)
            self._inbox.append(("drain", request))
            self._wake = True

        self._signal("drain", apply, args)

    # ------------------------------------------------------------- reading
    @workflow.query(
        name="status",
        description="The agent: state, load, last heartbeat, its transitions with their reasons (the run's result when it ends)",
    )
    def status(self) -> AgentStatus:
        return self._life.status()

    @workflow.query(name="refusals", description="The last messages refused, with the reason")
    def refusals(self) -> list[str]:
        return list(self._refused)

    @workflow.query(name="snapshot", description="What this agent tells its pool now (no schemas); null before it registers")
    def snapshot(self) -> AgentSnapshot | None:
        """The pool reads this (the `read_agent` activity) instead of trusting an `agent_snapshots` signal."""
        life = self._life
        if life.state == AgentState.TERMINATED:
            reason = life.terminated_reason or "terminated"
        elif life.state == AgentState.DRAINING:
            reason = life.drain_reason or "drain"
        else:
            reason = "read by its pool"
        return self._snapshot(reason[:1024])

    @workflow.update(name="wait_routable")
    async def wait_routable(self, *args: Any) -> AgentStatus:
        """Return once the agent is Ready or Busy and its pool has said it indexed it (or it
        drains or has ended): what `register` waits on. A run about to continue as new answers
        at once (`indexed_by_pool` false: the caller then asks the pool)."""
        await workflow.wait_condition(
            lambda: (self._life.routable_for_caller and not self._inbox)
            or (self._handing_over and self._life.awaits_index is not None)
        )
        return self._life.status()

    @wait_routable.validator
    def _validate_wait_routable(self, *args: Any) -> None:
        if args:
            raise ApplicationError(f"wait_routable: takes no argument, got {len(args)}", type="InvalidArgument", non_retryable=True)
