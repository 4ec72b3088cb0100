"""Activities the workflows use to reach other workflows and the agents.

- `notify_pool`: an agent workflow's snapshot to its pool, by signal-with-start
  so a pool that is not running yet is started rather than the message lost;
  never a pool that shut down (see `core.shutdown`). The snapshots a worker has
  for one pool shard at once travel together, in one `agent_snapshots` signal.
- `lease_and_invoke` / `recover_lease`: a task workflow's one activity per
  attempt (lease, waiting in the pool's queue if need be; invoke; renew; release),
  and what gives back a lease that activity took but could not report.
- `verify_agent` / `read_agent`: whether an agent's workflow runs, and what it
  says about itself (its `snapshot` query): the pool applies that, never an
  `agent_snapshots` signal as sent (anyone may send one).
- `request_eviction`: a silent agent's question to its pool (`may_evict`
  update): may it be terminated now, or does self-preservation hold it?
- The invoke inside `lease_and_invoke`: HTTP POST of a task to the leased
  agent, with the payload checked against the capability's input schema and the
  answer against its output schema. The POST carries the lease's JWT (`Authorization: Bearer
  ...`, signed here with the worker's lease key, so neither the token nor the
  key enters workflow history); without a key the task fails at once
  (`LeaseKeyMissing`, no failover). An agent's 401 or 409 (token refused,
  lease expired) fails over to another agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aiohttp
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory, WorkflowAlreadyStartedError

from agentroster.client.roster import PREFETCH_TTL_S, AgentRoster, start_pool_shard
from agentroster.vocabulary.shards import ShardLayout, shard_of_id
from agentroster.client.settings import Settings
from agentroster.errors import (
    MESSAGE_MAX_BYTES,
    AgentRosterError,
    CapabilityUnknownError,
    CircuitOpenError,
    PoolExhaustedError,
    LeaseKeyMissingError,
    LeaseLostError,
    PoolShutdownError,
    TaskError,
)
from agentroster.messages import (
    MAX_BATCH,
    AcquireReply,
    AgentChecked,
    ChoreReport,
    Deliveries,
    Delivery,
    AcquireRequest,
    AgentReading,
    AgentReadings,
    AgentRef,
    AgentRefs,
    AgentSnapshot,
    CapabilityDigest,
    HealthCheckBatch,
    HealthResult,
    HealthTarget,
    IndexNotice,
    IndexNotices,
    DrainRequest,
    EvictionVerdict,
    LeaseAndInvoke,
    LeaseInvokeFailure,
    LeaseInvokeOutcome,
    Outcome,
    PoolEvictionAsk,
    PoolNotification,
    RecoverLease,
    RequestHolds,
)
from agentroster.models import POOL_SHUTDOWN_REASON, AgentState, AgentStatus, Lease, json_size
from agentroster.core.lifecycle import resync_interval
from agentroster.core.shutdown import STRAGGLER_DRAIN_DEADLINE_S
from agentroster.client.invoke import SchemaCache, error_type, invoke_leased, outcome_of
from agentroster.client.lease_tokens import INSECURE_NO_AUTH, KEY_VAR, LeaseKeys
from agentroster.vocabulary.metrics import HEALTH_CHECKS, INVOKE_DURATION, PREFETCHED_LEASES
from agentroster.client.settings import LEASE_KEY_HELP, resolve_lease_keys
from agentroster.client.transport import Batcher, is_not_found, query_workflow, retry_until, signal_current_run
from agentroster.client.lease_tokens import LEASE_KEY_MISSING
from agentroster.vocabulary.wire import (
    AGENT_FAILED,
    AGENT_SNAPSHOTS_SIGNAL,
    AGENT_UNREACHABLE,
    INVALID_AGENT_OUTPUT,
    INVALID_TASK_INPUT,
    CHECK_HEALTH,
    DELIVER_SIGNALS,
    POOL_ALARM,
    REPORT_UPDATE,
    ACQUIRE_FAILED,
    LEASE_AND_INVOKE,
    LEASE_LOST,
    NOTIFY_POOL,
    RECOVER_LEASE,
    REQUEST_HOLDS,
    POOL_SHUT_DOWN,
    INDEX_NOTICE_SIGNAL,
    READ_AGENTS,
    FIND_AGENTS,
    AGENT_DEPLOYMENT,
    AGENT_WORKFLOW_PREFIX,
    REQUEST_EVICTION,
    TELL_INDEXED,
    VERIFY_AGENT,
    agent_workflow_id,
)
from agentroster.workflows.agent import AgentWorkflow

logger = logging.getLogger("agentroster.worker")

# Agent workflows one `read_agents` / `tell_indexed` activity reads or signals at once.
READ_CONCURRENCY = 32


# notify_pool: one `agent_snapshots` signal per pool shard on the wire at once from a worker;
# the snapshots that arrive meanwhile (a burst of registrations) go together in the next,
# within this many bytes of JSON (the pool's limit for one message is twice that). Each
# signal is written to the shard's history under its lock: 128 separate signals at once
# held a shard's workflow task back past its timeout (benchmarks/bench_cost.py --fleet).
NOTIFY_IN_FLIGHT = 1
NOTIFY_MAX_BYTES = MESSAGE_MAX_BYTES // 2


# Workflows one page of the `find_agents` listing carries.
FIND_PAGE_SIZE = 1000


def _visibility_quoted(text: str) -> str:
    """`text` inside a double-quoted visibility query literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _seconds_left() -> float:
    """Until this activity attempt's start-to-close deadline (60 s when it has none)."""
    timeout = activity.info().start_to_close_timeout
    return timeout.total_seconds() if timeout else 60.0


# lease_and_invoke's background release waits at most this long for an acquire of this
# worker to ride on (or for others to share its `release` update), and for its task workflow to
# complete first: long enough for PREFETCH_DEPTH tasks of a stream of short tasks to end, so
# their releases ride on the one acquire that asks for their successors' leases. A worker
# asking for leases more often than this releases by no message of its own; an acquire that
# finds no free slot sends what waits at once.
RELEASE_LINGER_S = 0.15
# A stream of tasks of one (pool, ref) on a worker (a task starting within this long of the
# previous one's end) gets its next leases ahead of time: lease_and_invoke asks for them in the
# update that returns the lease just used (the `acquire` that carries its release: no message of its own), and
# the next tasks take them with no round trip to the pool. Each unused after this long goes back.
PREFETCH_WINDOW_S = 0.25
PREFETCH_MAX_WAITING = 32  # prefetched leases waiting per (pool, ref) and worker
# Each task of a stream that ends owes its successor a lease; the worker asks for them this
# many at a time (sooner when the stream has none waiting nor asked for: then this many at
# once, the extra ones counted as credit). The releases of the tasks that ended meanwhile
# (parked for RELEASE_LINGER_S) ride on that update, so a steady stream costs one `acquire`
# update per PREFETCH_DEPTH tasks, not one per task.
PREFETCH_DEPTH = 3
# A worker that stops waits at most this long for its prefetches under way, and for each
# pool to answer the releases it still holds (`return_leases`).
RETURN_LEASES_TIMEOUT_S = 10.0

# invoke_agent's error types as the outcome label of agentroster_invoke_duration_seconds.
_INVOKE_OUTCOMES = {
    AGENT_FAILED: "agent_failed",
    AGENT_UNREACHABLE: "unreachable",
    INVALID_TASK_INPUT: "invalid_input",
    INVALID_AGENT_OUTPUT: "invalid_output",
    LEASE_KEY_MISSING: "lease_key_missing",
}


@contextlib.asynccontextmanager
async def _heartbeating(interval_s: float = 1.0) -> AsyncIterator[None]:
    """Heartbeat while the body runs, so a cancellation reaches a waiting activity."""

    async def beat() -> None:
        # The first beat after `interval_s`, not at once: the SDK sends a first heartbeat
        # straight away (later ones are throttled), and a task that ends within the
        # interval then costs no heartbeat (a billed action) at all.
        while True:
            await asyncio.sleep(interval_s)
            activity.heartbeat()

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


@contextlib.contextmanager
def _shutdown_is_final() -> Any:
    """A pool that shuts down answers the same to every retry: fail at once, not retried."""
    try:
        yield
    except PoolShutdownError as exc:
        raise ApplicationError(str(exc), exc.reason, type=POOL_SHUT_DOWN, non_retryable=True) from exc


@dataclass
class _Prefetched:
    """A lease waiting for a stream's next task, and the timer that gives it back."""

    lease: Lease
    fetched_at: float  # monotonic: the lease's term counts from about then (no clock of the pool's needed)
    timer: asyncio.TimerHandle | None = None


class RosterActivities:
    """Activities bound to one Temporal client and task queue."""

    def __init__(
        self,
        client: Client,
        task_queue: str,
        lease_key: LeaseKeys | str | bytes | None = None,
        *,
        request_secret: bytes | None = None,
        pool_shards: dict[str, ShardLayout | int | str] | ShardLayout | int | str | None = None,
        lease_prefetch_s: float | None = None,
    ) -> None:
        """`lease_key` (default: AGENTROSTER_LEASE_KEY) signs the lease tokens agents check.

        `request_secret` keys the request ids of workflows' acquires (default: the
        lease key, so every worker derives the same; without one, random per
        process, so a retry on another worker may get a second lease, which then
        expires at its TTL). `lease_prefetch_s` (default PREFETCH_WINDOW_S; 0 turns it off):
        how long a lease prefetched for a stream's next task waits for it (`lease_and_invoke`)."""
        self.client = client
        self.task_queue = task_queue
        self.lease_keys = resolve_lease_keys(lease_key)
        if self.lease_keys is None:
            logger.warning("worker: no lease key, so every task sent to an agent will fail: %s", LEASE_KEY_HELP)
        elif not self.lease_keys.enabled:
            logger.warning("worker: %s=%s: tasks are sent to agents without lease tokens", KEY_VAR, INSECURE_NO_AUTH)
        self._request_secret = request_secret or self._secret_from_keys() or secrets.token_bytes(32)
        self._rosters: dict[str, AgentRoster] = {}
        self._notifiers: dict[tuple[str, int, int, str], Batcher[dict[str, Any], None]] = {}
        self._checked: set[str] = set()  # pools whose recorded shard layout matched ours
        # The shard layout of each pool (default: AGENTROSTER_POOL_SHARDS; see `core.shards`).
        if pool_shards is None:
            self._layout_of = Settings.from_env().shards_for
        elif isinstance(pool_shards, dict):
            layouts = {p: l if isinstance(l, ShardLayout) else ShardLayout.parse(l) for p, l in pool_shards.items()}
            self._layout_of = lambda pool: layouts.get(pool) or layouts.get("") or ShardLayout()
        else:
            one = pool_shards if isinstance(pool_shards, ShardLayout) else ShardLayout.parse(pool_shards)
            self._layout_of = lambda pool: one
        self._http: aiohttp.ClientSession | None = None
        self.schemas = SchemaCache()  # capability schemas, instead of a query to the agent workflow per task
        self.release_linger_s = RELEASE_LINGER_S
        self.prefetch_window_s = PREFETCH_WINDOW_S if lease_prefetch_s is None else max(0.0, lease_prefetch_s)
        self._prefetched: dict[tuple[str, str], list[_Prefetched]] = {}  # (pool, ref) -> leases waiting for a task
        self._last_end: dict[tuple[str, str], float] = {}  # (pool, ref) -> when its latest task ended (monotonic)
        self._prefetching: set[asyncio.Task[None]] = set()
        self._asking: dict[tuple[str, str], int] = {}  # (pool, ref) -> its prefetches under way
        self._owed: dict[tuple[str, str], int] = {}  # (pool, ref) -> leases its next tasks want, not yet asked for

    def _roster(self, pool: str) -> AgentRoster:
        roster = self._rosters.get(pool)
        if roster is None:
            # One acquire update and one release update in flight per pool and worker
            # process: under load, the task workflows of this worker then share them
            # (measured in benchmarks/bench_supervisor.py: fewer pool workflow tasks and
            # less CPU per task, more tasks per second with 8 supervisors' tasks at once).
            roster = self._rosters[pool] = AgentRoster(
                self.client, pool=pool, task_queue=self.task_queue, acquires_in_flight=1, releases_in_flight=1,
                shards=self._layout_of(pool),
            )
        return roster

    async def _checked_roster(self, pool: str) -> AgentRoster:
        """The pool's roster, once its recorded shard layout was found to match this worker's
        (a mismatch fails the activity at once, with what to set)."""
        roster = self._roster(pool)
        if pool not in self._checked:
            try:
                await roster.check_layout()
            except AgentRosterError as exc:
                raise ApplicationError(str(exc), type="ShardLayoutMismatch", non_retryable=True) from exc
            self._checked.add(pool)
        return roster

    @activity.defn(name=NOTIFY_POOL)
    async def notify_pool(self, message: PoolNotification) -> None:
        """Deliver an agent snapshot to its pool, starting the pool if it never ran.

        Never a pool that shut down: the start uses the id-reuse policy
        ALLOW_DUPLICATE_FAILED_ONLY, and a pool run completes only through a
        shutdown, so the server itself refuses to start a run after a shut-down one,
        in the same call as the signal (no window between a check and the start).
        The agent that spoke, if it still serves, is then drained (reason
        `pool-shutdown`) instead: its pool is gone. See `core.shutdown`.
        """
        snapshot = message.snapshot
        try:
            # The agent's home shard (shard 0, `pool/{pool}`, in an unsharded pool): the
            # layout travels with the message, from the agent's registration.
            layout = ShardLayout(message.shards, message.shard_by if message.shard_by in ("deployment", "agent") else "deployment")
            await self._notifier(message.pool, message.shard, layout).submit(snapshot.model_dump(mode="json"))
        except WorkflowAlreadyStartedError:
            logger.info(
                "pool %s has shut down: not started again for agent %s's snapshot (%s)", message.pool, snapshot.agent_id, snapshot.state.value
            )
            if snapshot.state in (AgentState.DRAINING, AgentState.TERMINATED):
                return
            try:
                await signal_current_run(
                    self.client.get_workflow_handle(agent_workflow_id(message.pool, snapshot.agent_id)),
                    AgentWorkflow.drain,
                    DrainRequest(reason=POOL_SHUTDOWN_REASON, deadline_s=STRAGGLER_DRAIN_DEADLINE_S),
                )
            except RPCError as exc:
                if not is_not_found(exc):
                    raise

    def _notifier(self, pool: str, shard: int, layout: ShardLayout) -> Batcher[dict[str, Any], None]:
        """The batcher of `agent_snapshots` signals (with start) to one pool shard."""
        key = (pool, shard, layout.shards, layout.by)
        notifier = self._notifiers.get(key)
        if notifier is None:

            async def send(snapshots: list[dict[str, Any]]) -> list[None]:
                await start_pool_shard(
                    self.client, pool, shard, layout, self.task_queue,
                    start_signal=AGENT_SNAPSHOTS_SIGNAL, start_signal_args=[snapshots],
                )
                return [None] * len(snapshots)

            notifier = self._notifiers[key] = Batcher(
                send, max_in_flight=NOTIFY_IN_FLIGHT, max_batch=MAX_BATCH, size_of=json_size, max_bytes=NOTIFY_MAX_BYTES
            )
        return notifier

    @activity.defn(name=CHECK_HEALTH)
    async def check_health(self, batch: HealthCheckBatch) -> list[HealthResult]:
        """`GET {endpoint}/healthz` on every target at once; 200 is healthy, anything else (or no answer) is not."""
        session = await self._session()
        timeout = aiohttp.ClientTimeout(total=batch.timeout_s)

        async def one(target: HealthTarget) -> HealthResult:
            try:
                async with session.get(f"{target.endpoint.rstrip('/')}/healthz", timeout=timeout) as response:
                    if response.status == 200:
                        return HealthResult(agent_id=target.agent_id, ok=True)
                    text = (await response.text())[:200]
                    return HealthResult(agent_id=target.agent_id, ok=False, detail=f"HTTP {response.status}: {text}"[:512])
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                return HealthResult(agent_id=target.agent_id, ok=False, detail=f"{type(exc).__name__}: {exc}"[:512])

        results = list(await asyncio.gather(*(one(t) for t in batch.targets)))
        for result in results:
            HEALTH_CHECKS.labels(batch.pool, "ok" if result.ok else "failed").inc()
        await self.report("health", [r.model_dump(mode="json") for r in results])
        return results

    @activity.defn(name=VERIFY_AGENT)
    async def verify_agent(self, ref: AgentRef) -> bool:
        """Whether `agent/{pool}/{agent_id}` runs (what a shutdown asks of an agent that outlived its drain)."""
        running = await self._runs(ref)
        await self.report("checked", AgentChecked(agent_id=ref.agent_id, running=running).model_dump(mode="json"))
        return running

    async def _runs(self, ref: AgentRef) -> bool:
        try:
            description = await self.client.get_workflow_handle(agent_workflow_id(ref.pool, ref.agent_id)).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return description.status == WorkflowExecutionStatus.RUNNING

    async def report(self, kind: str, result: Any) -> None:
        """Tell the pool workflow that started this activity what came of it (its `report` update).

        The pool never waits for its activities (see `workflows.pool`): this is how their
        results reach it, in the run that is current then. Nothing is sent for an activity
        another workflow started, or when the pool has ended."""
        info = activity.info()
        if info.workflow_type != "PoolWorkflow" or not info.workflow_id:
            return
        handle = self.client.get_workflow_handle(info.workflow_id)
        report = ChoreReport(key=info.activity_id, kind=kind, result=result)
        try:
            await retry_until(
                lambda: handle.execute_update(REPORT_UPDATE, report),
                time.monotonic() + max(1.0, _seconds_left() - 1.0),
                what=f"{info.workflow_id} report {kind}",
            )
        except RPCError as exc:
            if not is_not_found(exc):
                raise
            logger.info("%s has ended: its %s report is dropped", info.workflow_id, kind)

    @activity.defn(name=DELIVER_SIGNALS)
    async def deliver_signals(self, batch: Deliveries) -> list[str]:
        """Send the pool's signals together: load notices, drains, revocations, nudges.

        A signal that meets a run closing by continue-as-new is sent again to the next run
        (`signal_current_run`); an agent whose workflow has ended is reported `gone` to the
        pool, which drops it from routing. Returns those agents."""
        deadline = time.monotonic() + max(1.0, _seconds_left() - 5.0)
        gone: list[str] = []

        async def one(item: Delivery) -> None:
            handle = self.client.get_workflow_handle(item.workflow_id)
            args = [] if item.arg is None else [item.arg]
            try:
                await retry_until(lambda: signal_current_run(handle, item.signal, *args), deadline, what=f"signal {item.signal} to {item.workflow_id}")
            except RPCError as exc:
                if not is_not_found(exc):
                    # Refused by a running workflow (e.g. its run's signal limit): its next notice says the load as it is then.
                    logger.warning("deliver_signals: %s refused %s: %s", item.workflow_id, item.signal, exc)
                elif item.agent_id is not None:
                    gone.append(item.agent_id)  # its workflow has ended and its last word never came
                # a lease holder that has ended needs no word of its lease

        await asyncio.gather(*(one(item) for item in batch.items))
        if gone or batch.report:
            await self.report("gone", sorted(set(gone)))
        return gone

    @activity.defn(name=POOL_ALARM)
    async def pool_alarm(self, wait_s: float) -> None:
        """Report to the pool once `wait_s` seconds have passed: its next deadline has come.

        The first attempt asks the server to retry it after `wait_s` (`next_retry_delay`), so
        the wait is the server's timer: no worker slot is held meanwhile, a worker that dies
        does not lose it, and a time-skipping test server skips it as it skips timers."""
        if activity.info().attempt == 1 and wait_s > 0:
            raise ApplicationError(
                f"waiting {wait_s:.3f}s for the pool's next deadline", type="PoolAlarmWait",
                next_retry_delay=timedelta(seconds=wait_s), category=ApplicationErrorCategory.BENIGN,
            )
        await self.report("alarm", None)

    @activity.defn(name=READ_AGENTS)
    async def read_agents(self, refs: AgentRefs) -> AgentReadings:
        """`read_agent` for a batch of one pool's agents (the pool's `read-batches` path), READ_CONCURRENCY at a time.

        A refusal a retry gets past is retried within the activity's time; an agent that still
        cannot be read is listed in `failed` (the pool keeps what it has for it), so one
        unreadable agent never holds back the others."""
        gate = asyncio.Semaphore(READ_CONCURRENCY)
        deadline = time.monotonic() + max(1.0, _seconds_left() - 5.0)
        out = AgentReadings(agent_ids=refs.agent_ids)

        async def one(agent_id: str) -> None:
            async with gate:
                try:
                    out.readings[agent_id] = await retry_until(
                        lambda: self._read_agent(AgentRef(pool=refs.pool, agent_id=agent_id)), deadline, what=f"read agent {agent_id}"
                    )
                except Exception as exc:  # noqa: BLE001 - reported per agent
                    out.failed[agent_id] = f"{type(exc).__name__}: {exc}"[:300]

        await asyncio.gather(*(one(agent_id) for agent_id in dict.fromkeys(refs.agent_ids)))
        if out.failed:
            logger.warning("read_agents: %d of %d agent(s) of pool %s could not be read, e.g. %s",
                           len(out.failed), len(refs.agent_ids), refs.pool, next(iter(out.failed.values())))
        await self.report("read", out.model_dump(mode="json"))
        return out

    @activity.defn(name=FIND_AGENTS)
    async def find_agents(self, pool: str) -> dict[str, str]:
        """The ids of the pool's registered agents whose workflows run now: a visibility query on
        `AgentPool`, `AgentState` and the execution status, read page by page (heartbeating each
        page). One still Spawning has no registration to read: its own notice comes with it."""
        prefix = f"{AGENT_WORKFLOW_PREFIX}{pool}/"
        states = ", ".join(f'"{s.value}"' for s in (AgentState.REGISTERING, AgentState.READY, AgentState.BUSY, AgentState.DRAINING))
        query = (
            f'WorkflowType="AgentWorkflow" AND AgentPool="{_visibility_quoted(pool)}" AND ExecutionStatus="Running" '
            f"AND AgentState IN ({states})"
        )
        found: dict[str, str] = {}  # agent id -> its deployment ("" when not set): what places it in a shard
        async for execution in self.client.list_workflows(query, page_size=FIND_PAGE_SIZE):
            if execution.id.startswith(prefix):
                found[execution.id.removeprefix(prefix)] = execution.typed_search_attributes.get(AGENT_DEPLOYMENT) or ""
                if len(found) % FIND_PAGE_SIZE == 0:
                    activity.heartbeat(len(found))
        found = dict(sorted(found.items()))
        await self.report("found", found)
        return found

    @activity.defn(name=TELL_INDEXED)
    async def tell_indexed(self, batch: IndexNotices) -> int:
        """Signal each agent workflow its index notice (`pool_indexed`); returns how many were delivered.

        An agent whose workflow has ended meanwhile is skipped; a refusal a retry gets past is retried."""
        gate = asyncio.Semaphore(READ_CONCURRENCY)
        deadline = time.monotonic() + max(1.0, _seconds_left() - 5.0)
        delivered = 0

        async def one(notice: IndexNotice) -> None:
            nonlocal delivered
            handle = self.client.get_workflow_handle(agent_workflow_id(batch.pool, notice.agent_id))
            async with gate:
                try:
                    await retry_until(lambda: signal_current_run(handle, INDEX_NOTICE_SIGNAL, notice), deadline, what=f"tell agent {notice.agent_id}")
                    delivered += 1
                except Exception as exc:  # noqa: BLE001 - its register call times out, as before notices
                    if not is_not_found(exc):
                        logger.warning("tell_indexed: agent %s of pool %s not told: %s", notice.agent_id, batch.pool, exc)

        await asyncio.gather(*(one(notice) for notice in batch.notices))
        return delivered

    async def _read_agent(self, ref: AgentRef) -> AgentReading:
        """What `agent/{pool}/{agent_id}` itself reports: the pool applies this instead of a snapshot signal.

        Running: its `snapshot` query. Ended: its result, read as a
        Terminated snapshot with its end reason (no query, so no replay of a closed
        run). No workflow, or one that never registered: no snapshot.
        """
        handle = self.client.get_workflow_handle(agent_workflow_id(ref.pool, ref.agent_id))
        try:
            description = await handle.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return AgentReading(detail="no agent workflow")
            raise
        if description.status != WorkflowExecutionStatus.RUNNING:
            try:
                status = await self.client.get_workflow_handle(handle.id, result_type=AgentStatus).result()
            except WorkflowFailureError as exc:
                return AgentReading(detail=f"its agent workflow ended ({description.status.name if description.status else 'closed'}): {exc.cause or exc}"[:512])
            ended = _snapshot_of(status, status.terminated_reason or "terminated")
            if ended is not None:
                # Its result does not say which resync rhythm its run kept (slow-resync patch); it resyncs no more.
                ended.resync_interval_s = None
            return AgentReading(snapshot=ended, detail="its agent workflow ended")
        snapshot = await query_workflow(handle, "snapshot", result_type=AgentSnapshot)
        if snapshot is None:
            return AgentReading(detail="its agent workflow runs but has not registered")
        if snapshot.agent_id != ref.agent_id:
            return AgentReading(detail=f"its agent workflow speaks for {snapshot.agent_id!r}"[:512])
        return AgentReading(snapshot=snapshot)

    @activity.defn(name=REQUEST_EVICTION)
    async def request_eviction(self, ask: PoolEvictionAsk) -> EvictionVerdict:
        """A silent agent's workflow asks its pool whether to terminate now (the `may_evict` update).

        Bounded: the agent workflow gives up after EVICTION_ASK_TIMEOUT and terminates as before.
        """
        return await self._roster(ask.pool).ask_eviction(ask.agent_id, ask.window_s, shard=ask.shard)

    def _request_id(self, workflow_id: str, run_id: str, key: str) -> str:
        """The secret id of a workflow's acquire: the same on every worker that shares the lease key."""
        return hmac.new(self._request_secret, f"{workflow_id}/{run_id}/{key}".encode(), hashlib.sha256).hexdigest()[:32]

    def _secret_from_keys(self) -> bytes | None:
        """A secret for request ids derived from the lease key (never the key itself)."""
        if self.lease_keys is None or not self.lease_keys.enabled:
            return None
        return hmac.new(self.lease_keys.keys[0], b"agentroster request ids", hashlib.sha256).digest()

    async def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    async def return_leases(self) -> None:
        """Prefetched leases go back; releases still waiting for an acquire to ride on, or on
        their way, land (each wait bounded by RETURN_LEASES_TIMEOUT_S)."""
        if self._prefetching:
            await asyncio.wait(set(self._prefetching), timeout=RETURN_LEASES_TIMEOUT_S)
        for pool in {stream[0] for stream in self._prefetched}:
            self._give_back_prefetched(pool, self._roster(pool))
        await asyncio.gather(*(roster.flush_releases(timeout_s=RETURN_LEASES_TIMEOUT_S) for roster in self._rosters.values()))

    async def close(self) -> None:
        await self.return_leases()
        if self._http is not None:
            await self._http.close()

    # ------------------------------------------------- the one-activity task path
    @activity.defn(name=LEASE_AND_INVOKE)
    async def lease_and_invoke(self, task: LeaseAndInvoke) -> LeaseInvokeOutcome:
        """A lease, the task on its agent, the release: one activity per attempt of a
        CapabilityTaskWorkflow, the one road by which a lease reaches it.

        - The lease comes at once or from the pool's FIFO queue: the activity waits there
          (its client's ticket watcher) up to the request's `wait_s`, heartbeating, so a
          cancelled task stops waiting and gives its place back. No lease in time: the
          pool's figures go back to the workflow (`reply`), which fails with them.
        - While the task runs the lease is renewed every third of its TTL (the pool's
          `renew` update), so a pool that ended it (revoked: its agent was declared gone; or
          expired) is seen in the reply and the task fails over (`LeaseLost`).
        - The lease is released after the activity completes, whatever the outcome: it
          rides on this worker's next acquire to the pool, or goes alone, retried until the
          lease would have ended anyway.
        - A failure once the lease was granted names the lease in its details
          (`LeaseInvokeFailure`). An activity that ends without a word (cancelled, its worker
          gone) leaves its lease to `recover_lease`, which finds it by the request's secret id.
        """
        info = activity.info()
        asked = task.request
        request = AcquireRequest.model_validate(
            {
                **asked.model_dump(exclude={"pool"}),
                "request_id": self._request_id(info.workflow_id, info.workflow_run_id, f"lease-and-invoke/{task.key}"),
                "holder": asked.holder or info.workflow_id,
                "holder_is_workflow": True,
            }
        )
        started = time.monotonic()
        outcome = "error"
        async with _heartbeating():
            roster = await self._checked_roster(asked.pool)
            # (a capped request takes no prefetched lease: that one was picked without its cap)
            prefetchable = self.prefetch_window_s > 0 and not request.exclude_agents and request.max_cost_class is None
            stream = (asked.pool, request.ref) if prefetchable else None
            in_stream = stream is not None and started - self._last_end.get(stream, float("-inf")) <= self.prefetch_window_s
            lease = self._take_prefetched(stream, roster) if stream is not None else None
            prefetched = lease is not None
            if lease is None:
                with _shutdown_is_final():
                    try:
                        # No slot free: slots are short, so none prefetched waits idle here meanwhile.
                        lease = await roster.lease_for(
                            request, started=started, on_queued=lambda: self._give_back_prefetched(asked.pool, roster)
                        )
                    except PoolShutdownError:
                        raise
                    except PoolExhaustedError as exc:
                        self._give_back_prefetched(asked.pool, roster)
                        return LeaseInvokeOutcome(reply=AcquireReply(
                            report=exc.report,
                            unknown_capability=isinstance(exc, CapabilityUnknownError),
                            circuit_open=exc.reason if isinstance(exc, CircuitOpenError) else None,
                        ))
                    except Exception as exc:  # retried by the client until its deadline: the workflow fails over
                        raise ApplicationError(f"no answer from pool {asked.pool}: {exc}"[:1024], type=ACQUIRE_FAILED, non_retryable=True) from exc
            try:
                # A prefetched lease is the worker's until its first renewal hands it to the task
                # workflow (`adopt_by`): revocation notices go there from then on.
                output = await self._invoke_renewing(
                    roster, lease, task, ttl_s=request.lease_ttl_s if prefetched else None,
                    adopt=(request.holder, request.request_id) if prefetched and request.holder else None,
                )
            except (TaskError, LeaseKeyMissingError, LeaseLostError) as exc:
                kind = LEASE_LOST if isinstance(exc, LeaseLostError) else error_type(exc)
                outcome = _INVOKE_OUTCOMES.get(kind, "error")
                if not isinstance(exc, LeaseLostError):
                    self._release_later(lease, outcome_of(exc))
                failure = LeaseInvokeFailure(lease=lease)
                raise ApplicationError(str(exc), failure.model_dump(mode="json"), type=kind, non_retryable=True) from exc
            except BaseException:
                # Cancelled: the workflow looks the lease up by its request's id, which a
                # prefetched lease does not have, so this one is given back here.
                if prefetched:
                    self._release_later(lease)
                raise
            finally:
                INVOKE_DURATION.labels(lease.pool, lease.capability, outcome).observe(time.monotonic() - started)
            outcome = "ok"
            if stream is not None:
                self._last_end[stream] = time.monotonic()
            self._release_later(lease, "succeeded")
            if stream is not None and (in_stream or prefetched):
                self._prefetch(roster, stream, lease)
            return LeaseInvokeOutcome(lease=lease, output=output)

    # ------------------------------------------------------------- prefetch
    def _take_prefetched(self, stream: tuple[str, str], roster: AgentRoster) -> Lease | None:
        """The oldest lease prefetched for `stream` with half its term left, if any (the one whose
        window ends first: fewer go back unused when tasks start in bursts)."""
        waiting = self._prefetched.get(stream)
        while waiting:
            entry = waiting.pop(0)
            if entry.timer is not None:
                entry.timer.cancel()
            term_s = (entry.lease.deadline - entry.lease.granted_at).total_seconds()
            if time.monotonic() - entry.fetched_at <= term_s / 2:  # (its timer gives it back much sooner, unless the loop lagged)
                PREFETCHED_LEASES.labels(stream[0], entry.lease.capability, "used").inc()
                return entry.lease
            self._unused(roster, entry.lease)
        return None

    def _prefetch(self, roster: AgentRoster, stream: tuple[str, str], used: Lease) -> None:
        """Count the lease the stream's next task will want and ask, off the task's path, for
        what it is owed PREFETCH_DEPTH at a time (at once when it has none waiting nor asked
        for): from the shard of the lease just used, in the update that returns it (it is
        parked to ride along)."""
        owed = self._owed.get(stream, 0) + 1
        dry = not self._prefetched.get(stream) and not self._asking.get(stream)
        count = max(owed, PREFETCH_DEPTH) if owed >= PREFETCH_DEPTH or dry else 0
        self._owed[stream] = max(owed - count, -PREFETCH_DEPTH)  # below 0: asked for ahead
        if count:
            self._ask_prefetch(roster, stream, used, count)
        if len(self._last_end) > 1024:  # streams long ended are forgotten
            now = time.monotonic()
            self._last_end = {k: t for k, t in self._last_end.items() if now - t <= self.prefetch_window_s}
            self._owed = {k: n for k, n in self._owed.items() if k in self._last_end}

    def _ask_prefetch(self, roster: AgentRoster, stream: tuple[str, str], used: Lease, count: int) -> None:
        """`count` prefetches for `stream`, asked in the same turn (one update carries them all)."""
        pool, ref = stream
        ttl_s = min(PREFETCH_TTL_S, (used.deadline - used.granted_at).total_seconds())

        async def fetch() -> None:
            try:
                lease = await roster.prefetch(
                    ref, shard=shard_of_id(used.lease_id), lease_ttl_s=ttl_s, holder=f"prefetched by a worker of {self.task_queue}"
                )
            except Exception as exc:  # nothing is lost: the next task asks the pool itself
                logger.debug("pool %s: prefetch for %s failed: %s", pool, ref, exc)
                return
            finally:
                self._asking[stream] -= 1
                if not self._asking[stream]:
                    del self._asking[stream]
            if lease is None:
                PREFETCHED_LEASES.labels(pool, used.capability, "missed").inc()
                return
            waiting = self._prefetched.setdefault(stream, [])
            if len(waiting) >= PREFETCH_MAX_WAITING:
                self._unused(roster, lease)
                return
            entry = _Prefetched(lease, fetched_at=time.monotonic())
            entry.timer = asyncio.get_running_loop().call_later(self.prefetch_window_s, self._expire, stream, entry, roster)
            waiting.append(entry)

        self._asking[stream] = self._asking.get(stream, 0) + count
        for _ in range(count):
            job = asyncio.get_running_loop().create_task(fetch())
            self._prefetching.add(job)
            job.add_done_callback(self._prefetching.discard)

    def _expire(self, stream: tuple[str, str], entry: _Prefetched, roster: AgentRoster) -> None:
        waiting = self._prefetched.get(stream, [])
        if entry in waiting:
            waiting.remove(entry)
            self._unused(roster, entry.lease)
        if not waiting:
            self._prefetched.pop(stream, None)

    def _unused(self, roster: AgentRoster, lease: Lease) -> None:
        PREFETCHED_LEASES.labels(lease.pool, lease.capability, "unused").inc()
        roster.release_later(lease)

    def _give_back_prefetched(self, pool: str, roster: AgentRoster) -> None:
        """Every lease prefetched from `pool` goes back now (a task found no free slot there)."""
        for stream in [s for s in self._prefetched if s[0] == pool]:
            for entry in self._prefetched.pop(stream):
                if entry.timer is not None:
                    entry.timer.cancel()
                self._unused(roster, entry.lease)

    def _release_later(self, lease: Lease, outcome: Outcome | None = None) -> None:
        """Release after the activity has completed (off the task's path): the lease rides on
        this worker's next acquire to its pool shard within `release_linger_s` (the pool's
        `acquire` update carries it), or goes alone then, shared with the worker's other
        releases (`AgentRoster.release_later`). A worker that dies before it lands leaves the
        lease to expire at its deadline: no renewal follows a completed activity. `outcome`
        (how the task went) rides with it: what the pool's outlier detection learns from."""
        self._roster(lease.pool).release_later(lease, self.release_linger_s, outcome)

    async def _invoke_renewing(
        self,
        roster: AgentRoster,
        lease: Lease,
        task: LeaseAndInvoke,
        *,
        ttl_s: float | None = None,
        adopt: tuple[str, str | None] | None = None,
    ) -> Any:
        """`invoke_leased`, renewing the lease to `ttl_s` (default: its own TTL) every third of
        that, the first time a third into its own term (a prefetched lease's is short);
        LeaseLostError once the pool ended it. `adopt` (the task workflow, its request id) goes
        with the first renewal that lands (see `AgentRoster.renew`)."""
        term_s = (lease.deadline - lease.granted_at).total_seconds()
        ttl_s = ttl_s or term_s

        async def keep_renewed() -> None:
            adopting = adopt
            await asyncio.sleep(term_s / 3)
            while True:
                try:
                    if adopting is None:
                        await roster.renew(lease, ttl_s)
                    else:
                        await roster.renew(lease, ttl_s, adopt_by=adopting[0], adopt_request_id=adopting[1])
                    adopting = None
                except LeaseLostError:
                    raise
                except Exception as exc:  # the pool is busy or away: the next renewal tries again
                    logger.warning("lease %s: renewal failed, tried again in %.0f s: %s", lease.lease_id, ttl_s / 3, exc)
                await asyncio.sleep(ttl_s / 3)

        session = await self._session()
        invoke = asyncio.ensure_future(
            invoke_leased(self.client, session, lease, task.payload, timeout_s=task.timeout_s, keys=self.lease_keys, schemas=self.schemas)
        )
        renewer = asyncio.ensure_future(keep_renewed())
        try:
            await asyncio.wait({invoke, renewer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for job in (invoke, renewer):
                if not job.done():
                    job.cancel()
            await asyncio.gather(invoke, renewer, return_exceptions=True)
        if not invoke.cancelled():
            return invoke.result()  # the checked output, or the TaskError
        renewer.result()  # the invoke was stopped because the lease ended: LeaseLostError
        raise LeaseLostError(f"lease {lease.lease_id} on {lease.agent_id} has ended")

    @activity.defn(name=RECOVER_LEASE)
    async def recover_lease(self, request: RecoverLease) -> Lease | None:
        """Give back the lease (or queue place) a `lease_and_invoke` of this workflow run took
        but could not report: found by the request's secret id, released here. The lease
        found, or None when it had ended already (or was never granted)."""
        with _shutdown_is_final():
            return await self._roster(request.pool).recover(self._request_of(request), request.ref)

    @activity.defn(name=REQUEST_HOLDS)
    async def request_holds(self, request: RecoverLease) -> RequestHolds:
        """What a `lease_and_invoke` of this workflow run holds now, found by the request's
        secret id: its lease, or its place in the queue. Changes nothing: the task workflow
        asks before it believes a `lease_revoked` notice (anyone may send one)."""
        with _shutdown_is_final():
            lease, queued = await self._roster(request.pool).holds(self._request_of(request), request.ref)
        return RequestHolds(lease=lease, queued=queued)

    def _request_of(self, request: RecoverLease) -> str:
        info = activity.info()
        return self._request_id(info.workflow_id, info.workflow_run_id, f"lease-and-invoke/{request.key}")


def _snapshot_of(status: AgentStatus, reason: str) -> AgentSnapshot | None:
    """An agent workflow's status (its `status` query, or the result of an ended run) as the snapshot it would send."""
    reg = status.registration
    if reg is None:
        return None
    return AgentSnapshot(
        agent_id=reg.agent_id,
        deployment=reg.deployment,
        endpoint=reg.endpoint,
        state=status.state,
        capabilities=[
            CapabilityDigest(name=c.name, version=c.version, max_concurrency=c.max_concurrency, cost_class=c.cost_class)
            for c in reg.capabilities
        ],
        max_concurrency=reg.max_concurrency,
        reason=reason[:1024],
        resync_interval_s=resync_interval(reg.heartbeat_interval_s),
    )
