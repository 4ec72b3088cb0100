"""How the client talks to the pool: retries, batching and ticket watching.

Kept apart from the `AgentRoster` facade so the rules about the server's
refusals live in one place:
- RESOURCE_EXHAUSTED (10 updates in flight per workflow), a pool continuing as
  new, a workflow task failing for a moment, a query a worker refused to run as a
  partial workflow task: retried with jittered backoff
  inside the caller's own timeout, so a user never sees them.
- Every query goes through `query_workflow` (the rule that keeps queries from
  tripping temporalio/sdk-python#1591).
- Concurrent callers share updates: acquires and releases to a pool shard go down
  one pipe (`LeasePipe`: releases ride on the `acquire` update, or go as `release`
  when no acquire waits), cancels and renewals each share one (`Batcher`), so a
  process stays well under the server's per-workflow limits.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from agentroster.errors import AgentRosterError
from agentroster.models import TicketStatus
from agentroster.vocabulary.wire import (
    CONTINUING_AS_NEW,
    QUERY_RPC_TIMEOUT,
    STICKY_TIMEOUT,
)
from agentroster.messages import MAX_BATCH

T = TypeVar("T")
R = TypeVar("R")
L = TypeVar("L")  # one release item (a lease id, or one with its task's outcome)

_TRANSIENT_STATUSES = {
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.ABORTED,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.CANCELLED,
}


UNPROCESSED_UPDATE = "UnprocessedUpdate"  # the server's rejection of an update no worker answered


def is_transient(exc: BaseException) -> bool:
    """A refusal that a retry a moment later will get past."""
    if isinstance(exc, RPCError):
        if exc.status in _TRANSIENT_STATUSES:
            return True
        # The server fails admitted updates when the workflow task that carried
        # them failed (e.g. UnhandledCommand while continuing as new), and refuses
        # new ones while a workflow task is failing.
        message = exc.message.lower()
        return exc.status == RPCStatusCode.FAILED_PRECONDITION and (
            "workflow task failure" in message or "workflow task in failed state" in message
        )
    if isinstance(exc, WorkflowUpdateRPCTimeoutOrCancelledError):
        return True
    if isinstance(exc, WorkflowQueryRejectedError) and exc.status == WorkflowExecutionStatus.CONTINUED_AS_NEW:
        # A query with reject_condition met the run that just continued as new; the next run answers.
        return True
    if isinstance(exc, WorkflowUpdateFailedError):
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == CONTINUING_AS_NEW:
            return True
        if isinstance(cause, ApplicationError) and cause.type == UNPROCESSED_UPDATE:
            # Rejected by the server, not by the workflow: the workflow task that carried it
            # completed without a word on it (seen right after a worker kill -9, when the
            # retried task no longer carried it). Nothing of it was applied.
            return True
        # An update admitted just as the run continued as new is aborted by the server.
        text = str(cause).lower()
        return ("continue" in text and "new" in text) or "closing" in text
    return False


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, RPCError) and exc.status == RPCStatusCode.NOT_FOUND


# A signal that finds no run is sent again this many times (0.05-0.5 s apart, ~10 s in
# all) while the workflow's latest run is open or has just continued as new. The server
# refuses signals for as long as a failed continue-as-new is retried, which on a busy
# worker includes replaying the run (1.5 s in all was not enough in the full suite).
SIGNAL_NOT_FOUND_RETRIES = 24


async def signal_current_run(handle: WorkflowHandle[Any, Any], signal: Any, *args: Any) -> None:
    """`handle.signal(signal, *args)` to the workflow's current run, across a continue-as-new.

    The server refuses a signal that meets a run closing by continue-as-new with
    NOT_FOUND (temporalio/temporal#2694), and keeps refusing them while a
    continue-as-new that failed on buffered signals is retried (temporalio/temporal#8097;
    the run still describes as RUNNING); a describe in that moment may also still see
    the closed run. NOT_FOUND is raised only once the latest run
    is neither open nor just continued as new: the workflow has really ended.
    """
    started = time.monotonic()
    for attempt in range(SIGNAL_NOT_FOUND_RETRIES + 1):
        try:
            await handle.signal(signal, *args)
            return
        except RPCError as exc:
            if not is_not_found(exc):
                raise
            latest = "not described (retries spent)"
            if attempt < SIGNAL_NOT_FOUND_RETRIES:
                latest = await _latest_run_status(handle)
                if latest in _OPEN_OR_HANDED_OVER:
                    await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
                    continue
            # Says why the refusal was taken as the end, for whoever reads the failure.
            exc.add_note(
                f"signal_current_run: {attempt + 1} attempt(s) over {time.monotonic() - started:.1f} s; "
                f"latest run: {latest}"
            )
            raise


# RUNNING, or CONTINUED_AS_NEW (its next run is, or is coming), or not known because the
# describe itself failed on a busy server: worth another try while retries last.
_OPEN_OR_HANDED_OVER = ("RUNNING", "CONTINUED_AS_NEW", "DESCRIBE_FAILED")


async def _latest_run_status(handle: WorkflowHandle[Any, Any]) -> str:
    """The latest run's status name, NOT_FOUND when the workflow does not exist, DESCRIBE_FAILED when unknown."""
    try:
        description = await handle.describe()
    except RPCError as exc:
        return "NOT_FOUND" if is_not_found(exc) else "DESCRIBE_FAILED"
    return description.status.name if description.status else "UNKNOWN"



async def retry_until(
    call: Callable[[], Awaitable[T]],
    deadline: float,
    *,
    what: str,
    on_not_found: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """Run `call`, retrying transient refusals with jittered backoff until `deadline` (monotonic).

    `on_not_found` (e.g. start the pool) runs before retrying a NOT_FOUND; without
    it NOT_FOUND is raised to the caller.
    """
    delay = 0.01
    while True:
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            return await asyncio.wait_for(call(), timeout=remaining)
        except asyncio.TimeoutError as exc:
            raise AgentRosterError(f"{what}: no answer from the server or worker before the timeout") from exc
        except Exception as exc:
            if is_not_found(exc) and on_not_found is not None:
                await on_not_found()
            elif not is_transient(exc):
                raise
            if time.monotonic() + delay > deadline:
                raise AgentRosterError(f"{what}: the server kept refusing until the timeout: {exc}") from exc
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.5)


class Hedge:
    """When to send an unanswered update again, under its own update id.

    An update that meets a run closing by continue-as-new is refused by the server, and
    the SDK waits about a second before it asks again (whatever the client's retry
    settings). The same update sent again under the same id a little later reaches the
    next run at once; the server runs one update per id in a run (a resend joins the
    one in flight or gets its outcome), and what crosses runs is made safe by the pool
    (an acquire's `request_id` gives back the same lease or ticket; a release is
    idempotent). The wait before a resend follows this link's recent round trips: a few
    times their moving average, within HEDGE_MIN_S and HEDGE_MAX_S, so a busy server is
    not sent more while it is only slow.
    """

    def __init__(self) -> None:
        self._average_s: float | None = None

    def delay(self) -> float:
        if self._average_s is None:
            return HEDGE_MAX_S
        return min(HEDGE_MAX_S, max(HEDGE_MIN_S, HEDGE_FACTOR * self._average_s))

    def observe(self, seconds: float) -> None:
        self._average_s = seconds if self._average_s is None else self._average_s + 0.1 * (seconds - self._average_s)

    async def execute_update(self, handle: WorkflowHandle[Any, Any], update: Any, arg: Any) -> Any:
        """`handle.execute_update(update, arg)`, sent again (at most HEDGE_SENDS in all) while unanswered.

        The first answer wins; an error is raised once no send is left in flight."""
        update_id = uuid.uuid4().hex
        started = time.monotonic()
        sends = [asyncio.ensure_future(handle.execute_update(update, arg, id=update_id))]
        try:
            while True:
                waiting = {send for send in sends if not send.done()}
                if not waiting:  # every send failed
                    raise sends[0].exception()  # type: ignore[misc]
                more = len(sends) < HEDGE_SENDS
                done, _ = await asyncio.wait(waiting, timeout=self.delay() if more else None, return_when=asyncio.FIRST_COMPLETED)
                for send in done:
                    if send.exception() is None:
                        self.observe(time.monotonic() - started)
                        return send.result()
                if not done:  # unanswered for the hedge's wait (a failed send is not sent again)
                    sends.append(asyncio.ensure_future(handle.execute_update(update, arg, id=update_id)))
        finally:
            for send in sends:
                _drop(send)  # the sends still in flight are not waited for


# The bounds of a hedge's wait (see `Hedge`): under the SDK's ~1 s wait after a refusal,
# over a round trip on an idle server; and how many sends one update may take.
HEDGE_MIN_S = 0.05
HEDGE_MAX_S = 0.4
HEDGE_FACTOR = 4.0
HEDGE_SENDS = 3


# Per workflow id: when (monotonic) this process may query it again after a query to it
# timed out (see `query_workflow`).
_query_hold: dict[str, float] = {}
_QUERY_TIMED_OUT = (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED)


async def query_workflow(
    handle: WorkflowHandle[Any, Any],
    query: Any,
    *args: Any,
    deadline: float | None = None,
    what: str = "",
    on_not_found: Callable[[], Awaitable[None]] | None = None,
    **options: Any,
) -> Any:
    """`handle.query(query, *args, **options)`: the one way our code queries a workflow.

    What it keeps rare (temporalio/sdk-python#1591, open in temporalio 1.35.0): a query that
    reaches a worker as a query task whose history holds events no workflow task has
    handled yet (a signal, a fired timer). The SDK runs those events for the query as an
    activation of their own, apart from the next task's updates; a workflow whose commands
    depend on that grouping writes a history that does not replay. The pool's do not (it
    wakes for messages only, see `workflows.pool`); an agent workflow's `wait_routable`
    update is the one left. It happens when the server sends the query to the normal task
    queue while events arrive, which it does after the sticky timeout (`wire.STICKY_TIMEOUT`):

    - a query sent while the worker that last ran the workflow is dead waits that long on
      its sticky queue, then goes to the normal queue. Each attempt's gRPC deadline is
      `wire.QUERY_RPC_TIMEOUT`, under the sticky timeout: a query whose deadline passed
      first is dropped by the server before it leaves the sticky queue;
    - the server still clears the workflow's stickiness when that sticky wait ends, and
      until the next workflow task makes it sticky again every query goes to the normal
      queue. So after an attempt timed out, this process sends that workflow no query
      until the server's wait for it is over (STICKY_TIMEOUT and a margin after it was
      sent), rather than one more every moment the worker is away.

    With `deadline` (monotonic) an attempt that gave up is asked again until then
    (`retry_until`); without, once (the caller asks again, as `TicketWatcher` does).
    Revisit when the SDK's fix ("WFT chunking v2") ships: then this rule can go.
    """
    if "rpc_timeout" in options:
        raise TypeError("query_workflow: rpc_timeout is always wire.QUERY_RPC_TIMEOUT (under the sticky timeout)")
    options["rpc_timeout"] = QUERY_RPC_TIMEOUT

    async def once() -> Any:
        wait = _query_hold.get(handle.id, 0.0) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        sent = time.monotonic()
        try:
            return await handle.query(query, *args, **options)
        except RPCError as exc:
            if exc.status in _QUERY_TIMED_OUT:
                _hold_queries(handle.id, sent + QUERY_HOLD_S)
            raise

    if deadline is None:
        return await once()
    name = what or f"{handle.id} query {getattr(query, '__name__', query)}"
    return await retry_until(once, deadline, what=name, on_not_found=on_not_found)


# How long after a query that timed out was sent the server may still clear stickiness for it.
QUERY_HOLD_S = STICKY_TIMEOUT.total_seconds() + 0.5


def _hold_queries(workflow_id: str, until: float) -> None:
    now = time.monotonic()
    for key in [k for k, t in _query_hold.items() if t <= now]:
        del _query_hold[key]
    _query_hold[workflow_id] = max(until, _query_hold.get(workflow_id, 0.0))


class Batcher(Generic[T, R]):
    """Sends queued items in batches, with at most `max_in_flight` batches on the wire.

    A lone item goes out at once (no added latency); items arriving while
    batches are in flight ride together in the next one. With `size_of`, a batch
    also stays within `max_bytes` (an item alone may exceed it).
    """

    def __init__(
        self,
        send: Callable[[list[T]], Awaitable[list[R]]],
        *,
        max_in_flight: int,
        max_batch: int = 128,
        size_of: Callable[[T], int] | None = None,
        max_bytes: int = 0,
    ) -> None:
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch: must be 1 to {MAX_BATCH} (what the pool accepts in one message), got {max_batch}")
        if size_of is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes: must be positive with size_of, got {max_bytes}")
        self._send = send
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._size_of = size_of
        self._max_bytes = max_bytes
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._in_flight = 0

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._kick()
        return await future

    def _kick(self) -> None:
        while self._queue and self._in_flight < self._max_in_flight:
            take = limit = min(len(self._queue), self._max_batch)
            if self._size_of is not None:
                take, total = 1, self._size_of(self._queue[0][0])
                while take < limit and (total := total + self._size_of(self._queue[take][0])) <= self._max_bytes:
                    take += 1
            batch, self._queue = self._queue[:take], self._queue[take:]
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._send([item for item, _ in batch])
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        finally:
            self._in_flight -= 1
            self._kick()


@dataclass(eq=False)
class _QueuedRelease(Generic[L]):
    item: L
    until: float  # monotonic: the `release` update is retried until then
    due: float  # monotonic: from then on it goes alone if no acquire carries it (it rides on any batch before)
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class LeasePipe(Generic[T, L, R]):
    """One pool shard's acquires and releases, in one queue: a client's `acquire` and `release` updates.

    A batch that holds an acquire goes as the `acquire` update with every queued release
    riding in it (the pool returns them first, so a slot they free serves its queue before
    these acquires); releases go alone, as the `release` update, only when no acquire waits
    to carry them. At most `acquires_in_flight` acquire updates and `releases_in_flight`
    release updates are on the wire at once; what arrives meanwhile leaves with the next
    batch, and so does whatever was queued in the same turn of the event loop: one
    message carries every queued acquire (up to MAX_BATCH), since each update costs the
    pool a workflow task and the server an update whatever it carries.

    A release is answered once the update that carried it is (its caller's lease is then
    back in the pool). One that may wait (`linger_s`) rides on any batch that leaves
    before then and goes alone after. When an `acquire` update carrying releases fails,
    the acquires get its error and the releases go again alone (a release is idempotent).
    An acquire reply whose caller has given up goes to `on_orphan`, which gives it back.
    """

    def __init__(
        self,
        send_acquires: Callable[[list[T], list[L]], Awaitable[list[R]]],
        send_releases: Callable[[list[L], float], Awaitable[Any]],
        *,
        acquires_in_flight: int,
        releases_in_flight: int,
        on_orphan: Callable[[R], None],
    ) -> None:
        if acquires_in_flight < 1 or releases_in_flight < 1:
            raise ValueError(
                f"acquires_in_flight and releases_in_flight: must be at least 1, got {acquires_in_flight} and {releases_in_flight}"
            )
        self._send_acquires = send_acquires
        self._send_releases = send_releases
        self._on_orphan = on_orphan
        self._max_acquiring = acquires_in_flight
        self._max_releasing = releases_in_flight
        self._acquires: list[tuple[T, asyncio.Future[R]]] = []
        self._releases: list[_QueuedRelease[L]] = []
        self._acquiring = 0  # acquire updates on the wire
        self._releasing = 0  # release updates on the wire
        self._kick_soon: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None  # for the queued release due first

    @property
    def waiting_releases(self) -> list[L]:
        """The releases queued here, not yet sent."""
        return [queued.item for queued in self._releases]

    async def acquire(self, request: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._acquires.append((request, future))
        self._schedule()
        return await future

    def release(self, item: L, *, until: float, linger_s: float = 0.0) -> asyncio.Future[None]:
        """Queue `item`; the future is done once the pool has it (or its last retry before `until` failed)."""
        now = time.monotonic()
        queued = _QueuedRelease(item, until=until, due=now + max(0.0, linger_s))
        self._releases.append(queued)
        self._schedule()
        return queued.future

    def release_waiting_now(self) -> None:
        """Every queued release is due now: it goes with the next batch, alone if need be."""
        now = time.monotonic()
        for queued in self._releases:
            queued.due = min(queued.due, now)
        self._schedule()

    def _schedule(self) -> None:
        # A batch leaves on the next turn of the event loop: callers resumed by the answer
        # of the last one (scheduled before this) have queued their next item by then.
        if self._kick_soon is None:
            self._kick_soon = asyncio.get_running_loop().call_soon(self._kick)

    def _kick(self) -> None:
        self._kick_soon = None
        loop = asyncio.get_running_loop()
        # An acquire whose caller gave up before it left never reaches the pool (a release does).
        self._acquires = [(request, future) for request, future in self._acquires if not future.done()]
        while self._acquires and self._acquiring < self._max_acquiring:
            requests, self._acquires = self._acquires[:MAX_BATCH], self._acquires[MAX_BATCH:]
            riders, self._releases = self._releases[:MAX_BATCH], self._releases[MAX_BATCH:]
            self._acquiring += 1
            loop.create_task(self._flush_acquires(requests, riders))
        now = time.monotonic()
        while not self._acquires and self._releasing < self._max_releasing and any(q.due <= now for q in self._releases):
            batch, self._releases = self._releases[:MAX_BATCH], self._releases[MAX_BATCH:]
            self._releasing += 1
            loop.create_task(self._flush_releases(batch))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        first_due = min((q.due for q in self._releases), default=None)
        if first_due is not None and first_due > now:
            self._timer = loop.call_later(first_due - now, self._kick)

    async def _flush_acquires(self, requests: list[tuple[T, asyncio.Future[R]]], riders: list[_QueuedRelease[L]]) -> None:
        try:
            try:
                replies = await self._send_acquires([request for request, _ in requests], [q.item for q in riders])
            except BaseException as exc:
                _fail([future for _, future in requests], exc)
                if riders and isinstance(exc, Exception):
                    await self._deliver(riders)  # again, alone
                else:
                    _fail([q.future for q in riders], exc)
                return
            _answer(riders)
            for (_, future), reply in zip(requests, replies):
                if not future.done():
                    future.set_result(reply)
                else:
                    self._on_orphan(reply)  # its caller gave up while it was on the wire: give it back
        finally:
            self._acquiring -= 1
            self._schedule()

    async def _flush_releases(self, batch: list[_QueuedRelease[L]]) -> None:
        try:
            await self._deliver(batch)
        finally:
            self._releasing -= 1
            self._schedule()

    async def _deliver(self, batch: list[_QueuedRelease[L]]) -> None:
        """The `release` update for `batch`, retried until the latest `until` among them."""
        try:
            await self._send_releases([q.item for q in batch], max(q.until for q in batch))
        except BaseException as exc:
            _fail([q.future for q in batch], exc)
            if not isinstance(exc, Exception):
                raise
        else:
            _answer(batch)


def _answer(released: list[_QueuedRelease[Any]]) -> None:
    for queued in released:
        if not queued.future.done():
            queued.future.set_result(None)


def _fail(futures: list[asyncio.Future[Any]], exc: BaseException) -> None:
    for future in futures:
        if not future.done():
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)


def _drop(poll: asyncio.Future[Any]) -> None:
    """Cancel a poll nobody waits for; its failure, if it ends with one (its deadline passing
    as it is cancelled), is read so asyncio does not log it as never retrieved."""
    poll.cancel()
    poll.add_done_callback(lambda done: done.cancelled() or done.exception())


class TicketWatcher:
    """Polls the pool for every queued ticket of this client with one query.

    A poll unanswered after `hedge_s` gets another beside it, and the first answer serves:
    a query the server holds behind the pool's workflow tasks (seen under contention: one
    poll held for seconds while another sent a moment later answers at once), or one sent to
    a worker that was just killed, is otherwise answered only by its own timeout. At most
    `max_polls` are in flight; when full, the oldest is given up once it is `give_up_s`
    old, so polls sent during an outage do not keep fresh ones from being sent after it.

    Polls come `interval_s` apart while they serve tickets; each poll that served none
    stretches the gap by half, up to `max_interval_s`, and a served or newly queued
    ticket brings it back: each poll is a query (billed on Temporal Cloud, and an
    activation on the pool's worker), and a waiter queued behind long tasks would
    otherwise cost ~30 of them a second.
    """

    def __init__(
        self,
        query: Callable[[list[str]], Awaitable[list[TicketStatus]]],
        interval_s: float,
        *,
        timeout_s: float = 6.0,
        hedge_s: float = 0.25,
        max_polls: int = 3,
        give_up_s: float = 1.5,
        max_interval_s: float | None = None,
    ) -> None:
        self._query = query
        self._interval_s = interval_s
        self._max_interval_s = max(interval_s, max_interval_s if max_interval_s is not None else interval_s)
        self.gap_s = interval_s  # the gap before the next poll (grows while polls serve nothing)
        # One poll that hangs (sent just as the server or the pool's worker was killed)
        # would otherwise hold every waiter of this client until its own deadline.
        self._timeout_s = timeout_s
        self._hedge_s = hedge_s
        self._max_polls = max_polls
        self._give_up_s = give_up_s
        self._waiting: dict[str, asyncio.Future[TicketStatus]] = {}
        self._task: asyncio.Task[None] | None = None
        self.polls_sent = 0  # how many queries this watcher sent (hedges included)

    async def wait(self, ticket: str, deadline: float) -> TicketStatus | None:
        """The ticket's final status, or None if `deadline` (monotonic) passes first."""
        future: asyncio.Future[TicketStatus] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = future
        self.gap_s = self._interval_s  # a new waiter: its grant may come soon (a release in flight)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None
        finally:
            self._waiting.pop(ticket, None)

    async def _run(self) -> None:
        while self._waiting:
            try:
                statuses = await self._answer()
            except Exception:  # the waiters keep their deadlines whatever a poll raised
                statuses = None
            if statuses is None:
                await asyncio.sleep(self._interval_s * 5)
                continue
            served = False
            for status in statuses:
                future = self._waiting.get(status.ticket)
                if future is not None and not future.done() and not status.pending:
                    future.set_result(status)
                    served = True
            self.gap_s = self._interval_s if served else min(self.gap_s * 1.5, self._max_interval_s)
            await asyncio.sleep(self.gap_s)

    async def _answer(self) -> list[TicketStatus] | None:
        """The first answer of a poll and its hedges; None when every one failed or timed out,
        or every waiter has given up."""
        polls: dict[asyncio.Future[list[TicketStatus]], float] = {}  # poll -> when it was sent
        last_sent = float("-inf")
        try:
            while self._waiting:
                now = time.monotonic()
                oldest = min(polls, key=polls.__getitem__, default=None)
                if len(polls) >= self._max_polls and oldest is not None and now - polls[oldest] >= self._give_up_s:
                    del polls[oldest]
                    _drop(oldest)
                if len(polls) < self._max_polls and now - last_sent >= self._hedge_s:
                    self.polls_sent += 1
                    poll = asyncio.ensure_future(asyncio.wait_for(self._query(list(self._waiting)), timeout=self._timeout_s))
                    polls[poll] = last_sent = now
                # The next poll goes out hedge_s after the last one (a failed poll is not
                # replaced sooner), or, with polls full, when the oldest is given up.
                next_at = last_sent + self._hedge_s if len(polls) < self._max_polls else min(polls.values()) + self._give_up_s
                done, _ = await asyncio.wait(polls, timeout=max(0.0, next_at - now), return_when=asyncio.FIRST_COMPLETED)
                answer = self._first_answer(done, polls)
                if answer is not None or (done and not polls):
                    return answer
            return None
        finally:
            for poll in polls:
                _drop(poll)

    @staticmethod
    def _first_answer(done: set[asyncio.Future[list[TicketStatus]]], polls: dict[asyncio.Future[list[TicketStatus]], float]) -> list[TicketStatus] | None:
        """The answer among `done` polls, if one answered (each failure read, all taken out of `polls`)."""
        answers = []
        for poll in done:
            del polls[poll]
            if poll.exception() is None:
                answers.append(poll.result())
        return answers[0] if answers else None
