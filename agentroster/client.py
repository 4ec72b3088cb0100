"""AgentRoster: the facade for code outside workflows.

    roster = await AgentRoster.connect("localhost:7233", pool="default")
    await roster.register(registration)
    async with roster.borrow("rag.search@>=2,<3", timeout=5.0) as lease:
        ...

Transient refusals from the server (RESOURCE_EXHAUSTED when 10 updates are in
flight, a pool continuing as new) are retried here with jittered backoff
inside the caller's own timeout, so a user never sees them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Generic, TypeVar

from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from agentroster.contracts import (
    AcquireReply,
    AcquireRequest,
    AgentNotFoundError,
    AgentRegistration,
    AgentRosterError,
    AgentState,
    AgentStatus,
    CapabilityRef,
    DrainRequest,
    Lease,
    PoolExhaustedError,
    PoolStatus,
    TicketStatus,
)
from agentroster.workflows.common import (
    AGENT_POOL,
    AGENT_STATE,
    AgentWorkflowInput,
    PoolInput,
    agent_workflow_id,
    pool_workflow_id,
)

T = TypeVar("T")
logger = logging.getLogger("agentroster")

DEFAULT_ADDRESS = "localhost:7233"
DEFAULT_NAMESPACE = "default"
DEFAULT_POOL = "default"
DEFAULT_TASK_QUEUE = "agentroster"
CONTINUING_AS_NEW = "PoolContinuingAsNew"

_TRANSIENT_STATUSES = {
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.ABORTED,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.CANCELLED,
}


def _is_transient(exc: BaseException) -> bool:
    """A refusal that a retry a moment later will get past."""
    if isinstance(exc, RPCError):
        if exc.status in _TRANSIENT_STATUSES:
            return True
        # The server fails admitted updates when the workflow task that carried
        # them was failed (e.g. UnhandledCommand while continuing as new).
        return exc.status == RPCStatusCode.FAILED_PRECONDITION and "workflow task failure" in exc.message
    if isinstance(exc, WorkflowUpdateRPCTimeoutOrCancelledError):
        return True
    if isinstance(exc, WorkflowUpdateFailedError):
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == CONTINUING_AS_NEW:
            return True
        # An update admitted just as the run continued as new is aborted by the server.
        return "continue" in str(cause).lower() and "new" in str(cause).lower() or "closing" in str(cause).lower()
    return False


def _is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, RPCError) and exc.status == RPCStatusCode.NOT_FOUND


def tls_from_env(env: dict[str, str] | None = None) -> bool | TLSConfig:
    """TLS settings from the environment: False, True (system roots) or a TLSConfig."""
    env = dict(os.environ if env is None else env)

    def read(var: str) -> bytes | None:
        path = env.get(var)
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise AgentRosterError(f"{var}={path}: cannot read the file: {exc.strerror}") from exc

    cert, key, ca = read("TEMPORAL_TLS_CERT"), read("TEMPORAL_TLS_KEY"), read("TEMPORAL_TLS_CA")
    server_name = env.get("TEMPORAL_TLS_SERVER_NAME") or None
    if (cert is None) != (key is None):
        raise AgentRosterError("TEMPORAL_TLS_CERT and TEMPORAL_TLS_KEY must be set together (an mTLS client pair)")
    if cert or ca or server_name:
        return TLSConfig(client_cert=cert, client_private_key=key, server_root_ca_cert=ca, domain=server_name)
    return env.get("TEMPORAL_TLS", "").lower() in ("1", "true", "yes")


class AgentRoster:
    """One pool's client: register agents, find and lease capabilities, drain, describe."""

    def __init__(
        self,
        client: Client,
        *,
        pool: str = DEFAULT_POOL,
        task_queue: str = DEFAULT_TASK_QUEUE,
        ticket_poll_interval_s: float = 0.02,
    ) -> None:
        self._client = client
        self.pool = pool
        self.task_queue = task_queue
        self._pool_started = False
        self._tickets = _TicketWatcher(self, ticket_poll_interval_s)
        # Concurrent callers share updates and signals: one update carries every
        # acquire queued while the previous ones were in flight. This keeps a
        # process well under the server's 10 in-flight updates per workflow.
        self._acquires: _Batcher[AcquireRequest, AcquireReply] = _Batcher(
            self._send_acquires, max_in_flight=4, on_orphan=self._return_orphan
        )
        self._releases: _Batcher[str, None] = _Batcher(self._send_releases, max_in_flight=8)

    # --------------------------------------------------------------- connect
    @classmethod
    async def connect(
        cls,
        target_host: str | None = None,
        *,
        namespace: str | None = None,
        pool: str | None = None,
        task_queue: str | None = None,
        tls: bool | TLSConfig | None = None,
        api_key: str | None = None,
        ensure_pool: bool = True,
        **client_options: Any,
    ) -> AgentRoster:
        """Connect with the pydantic data converter; settings default to the environment.

        TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS,
        TEMPORAL_TLS_CERT / TEMPORAL_TLS_KEY (mTLS client pair, PEM files),
        TEMPORAL_TLS_CA (server CA), TEMPORAL_TLS_SERVER_NAME,
        AGENTROSTER_POOL, AGENTROSTER_TASK_QUEUE.
        """
        api_key = api_key if api_key is not None else os.environ.get("TEMPORAL_API_KEY") or None
        if tls is None:
            tls = tls_from_env() or (True if api_key else False)
        client = await Client.connect(
            target_host or os.environ.get("TEMPORAL_ADDRESS", DEFAULT_ADDRESS),
            namespace=namespace or os.environ.get("TEMPORAL_NAMESPACE", DEFAULT_NAMESPACE),
            data_converter=pydantic_data_converter,
            tls=tls,
            api_key=api_key,
            **client_options,
        )
        roster = cls(
            client,
            pool=pool or os.environ.get("AGENTROSTER_POOL", DEFAULT_POOL),
            task_queue=task_queue or os.environ.get("AGENTROSTER_TASK_QUEUE", DEFAULT_TASK_QUEUE),
        )
        if ensure_pool:
            await roster.ensure_pool()
        return roster

    @property
    def client(self) -> Client:
        """The temporalio Client (with the pydantic data converter)."""
        return self._client

    def _pool_handle(self) -> WorkflowHandle[Any, Any]:
        return self._client.get_workflow_handle(pool_workflow_id(self.pool))

    def _agent_handle(self, agent_id: str) -> WorkflowHandle[Any, Any]:
        return self._client.get_workflow_handle(agent_workflow_id(agent_id))

    async def ensure_pool(self) -> None:
        """Start this pool's workflow unless it runs already."""
        await self._client.start_workflow(
            "PoolWorkflow",
            PoolInput(pool=self.pool),
            id=pool_workflow_id(self.pool),
            task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=TypedSearchAttributes([SearchAttributePair(AGENT_POOL, self.pool)]),
        )
        self._pool_started = True

    # --------------------------------------------------------------- retries
    async def _retry(self, call: Callable[[], Awaitable[T]], deadline: float, *, what: str) -> T:
        """Run `call`, retrying transient refusals with jittered backoff until `deadline`."""
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
                if _is_not_found(exc) and what.startswith("pool"):
                    await self.ensure_pool()
                elif not _is_transient(exc):
                    raise
                if time.monotonic() + delay > deadline:
                    raise AgentRosterError(f"{what}: the server kept refusing until the timeout: {exc}") from exc
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)

    async def _pool_update(self, name: str, arg: Any, result_type: type[T], deadline: float) -> T:
        handle = self._pool_handle()
        return await self._retry(
            lambda: handle.execute_update(name, arg, result_type=result_type), deadline, what=f"pool {self.pool} {name}"
        )

    async def _pool_query(self, name: str, arg: Any, result_type: Any, timeout: float = 30.0) -> Any:
        handle = self._pool_handle()
        args = [] if arg is None else [arg]
        return await self._retry(
            lambda: handle.query(name, *args, result_type=result_type),
            time.monotonic() + timeout,
            what=f"pool {self.pool} query {name}",
        )

    # --------------------------------------------------------------- agents
    async def register(self, registration: AgentRegistration | dict[str, Any], *, wait: bool = True, timeout: float = 30.0) -> AgentStatus:
        """Register (or re-register) an agent. Idempotent; starts `agent/{id}` when needed.

        With `wait`, returns once the pool routes to it (state Ready or Busy).
        """
        reg = AgentRegistration.model_validate(registration)
        warning = reg.short_heartbeat_warning()
        if warning:
            logger.warning(warning)
        if not self._pool_started:
            await self.ensure_pool()
        handle = await self._client.start_workflow(
            "AgentWorkflow",
            AgentWorkflowInput(agent_id=reg.agent_id, pool=self.pool),
            id=agent_workflow_id(reg.agent_id),
            task_queue=self.task_queue,
            start_signal="register",
            start_signal_args=[reg.model_dump(mode="json")],
            search_attributes=TypedSearchAttributes(
                [SearchAttributePair(AGENT_POOL, self.pool), SearchAttributePair(AGENT_STATE, AgentState.SPAWNING.value)]
            ),
        )
        if not wait:
            return AgentStatus(agent_id=reg.agent_id, pool=self.pool, state=AgentState.REGISTERING, registration=reg)
        status = await self._retry(
            lambda: handle.execute_update("wait_routable", result_type=AgentStatus),
            time.monotonic() + timeout,
            what=f"register {reg.agent_id}",
        )
        if status.state not in (AgentState.READY, AgentState.BUSY):
            refusals = await handle.query("refusals", result_type=list[str])
            raise AgentRosterError(
                f"agent {reg.agent_id} did not become routable: it is {status.state.value}"
                + (f" ({refusals[-1]})" if refusals else "")
            )
        return status

    async def heartbeat(self, agent_id: str) -> None:
        """Tell the agent's workflow it is alive. Raises AgentNotFoundError when its run has ended."""
        try:
            await self._agent_handle(agent_id).signal("heartbeat")
        except RPCError as exc:
            if _is_not_found(exc):
                raise AgentNotFoundError(f"agent {agent_id} has no running workflow; register it again") from exc
            raise

    async def drain(self, agent_id: str, reason: str = "drain", *, deadline_s: float = 300.0, wait: bool = True) -> AgentStatus:
        """Stop new leases to the agent; with `wait`, return once it is Terminated."""
        request = DrainRequest(reason=reason, deadline_s=deadline_s)
        handle = self._client.get_workflow_handle(agent_workflow_id(agent_id), result_type=AgentStatus)
        try:
            await handle.signal("drain", request.model_dump(mode="json"))
        except RPCError as exc:
            if not _is_not_found(exc):
                raise
            # Already ended: report how it ended.
            return await self.describe(agent_id)
        if not wait:
            return await self.describe(agent_id)
        try:
            return await handle.result()
        except WorkflowFailureError as exc:
            raise AgentRosterError(f"agent {agent_id}'s workflow failed while draining: {exc.cause}") from exc

    async def describe(self, agent_id: str) -> AgentStatus:
        """The agent's lifecycle state, in-flight count, last heartbeat and recent transitions."""
        try:
            status: AgentStatus = await self._agent_handle(agent_id).query("status", result_type=AgentStatus)
        except RPCError as exc:
            if _is_not_found(exc):
                raise AgentNotFoundError(f"no agent {agent_id} has ever registered (no workflow agent/{agent_id})") from exc
            raise
        if status.state != AgentState.TERMINATED:
            # The pool owns the lease count; the agent workflow only hears coalesced notices.
            status.in_flight = await self._pool_query("agent_in_flight", agent_id, int)
        else:
            status.in_flight = 0
        return status

    # --------------------------------------------------------------- leases
    async def find(self, ref: str) -> list[str]:
        """Routable agent ids for `ref`, best first. [] is backpressure: queue, spill or scale."""
        CapabilityRef.parse(ref)
        return await self._pool_query("find", ref, list[str])

    async def acquire(
        self,
        ref: str,
        timeout: float = 5.0,
        *,
        lease_ttl_s: float = 300.0,
        holder: str | None = None,
        holder_is_workflow: bool = False,
        exclude_agents: Sequence[str] = (),
        request_id: str | None = None,
    ) -> Lease:
        """A lease on the best agent for `ref`, waiting up to `timeout` seconds in FIFO order.

        Raises PoolExhaustedError (with counts) when none frees up in time.
        `request_id` makes a retried call return the same lease or ticket.
        """
        CapabilityRef.parse(ref)
        if timeout < 0:
            raise ValueError(f"timeout: must be >= 0, got {timeout}")
        started = time.monotonic()
        deadline = started + timeout
        request = AcquireRequest(
            ref=ref,
            lease_ttl_s=lease_ttl_s,
            wait_s=timeout,
            holder=holder,
            holder_is_workflow=holder_is_workflow,
            exclude_agents=list(exclude_agents),
            request_id=request_id or uuid.uuid4().hex,
        )
        reply = await self.request(request)
        if reply.lease is not None:
            return reply.lease
        if reply.ticket is None:
            raise PoolExhaustedError(ref, waited_s=time.monotonic() - started, report=reply.report, pool=self.pool)
        status: TicketStatus | None = None
        try:
            status = await self._tickets.wait(reply.ticket, deadline)
        except BaseException:
            # Cancelled by our caller: give the place (or a lease granted meanwhile) back.
            await asyncio.shield(self._abandon(reply.ticket))
            raise
        if status is not None and status.lease is not None:
            return status.lease
        final: TicketStatus = await self._pool_update("cancel_ticket", reply.ticket, TicketStatus, time.monotonic() + 10.0)
        if final.lease is not None:
            return final.lease
        raise PoolExhaustedError(ref, waited_s=time.monotonic() - started, report=final.report or reply.report, pool=self.pool)

    async def request(self, request: AcquireRequest) -> AcquireReply:
        """One acquire without waiting: a lease, a ticket (place in the queue), or a report.

        For callers that wait elsewhere: a workflow holder (`holder_is_workflow`)
        is signalled `lease_granted` when its ticket is served.
        """
        return await self._acquires.submit(request)

    async def cancel_ticket(self, ticket: str) -> TicketStatus:
        """Give up a place in the queue; a lease granted meanwhile comes back in the status."""
        return await self._pool_update("cancel_ticket", ticket, TicketStatus, time.monotonic() + 30.0)

    async def _abandon(self, ticket: str) -> None:
        final: TicketStatus = await self._pool_update("cancel_ticket", ticket, TicketStatus, time.monotonic() + 10.0)
        if final.lease is not None:
            await self.release(final.lease)

    async def release(self, lease: Lease | str) -> None:
        """Return a lease's slot. Idempotent: releasing twice, or after expiry, is harmless."""
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        if not isinstance(lease_id, str) or not lease_id:
            raise ValueError("lease: expected a Lease or a non-empty lease id")
        await self._releases.submit(lease_id)

    async def _return_orphan(self, reply: AcquireReply) -> None:
        if reply.lease is not None:
            await self.release(reply.lease)
        elif reply.ticket is not None:
            await self._abandon(reply.ticket)

    async def _send_acquires(self, requests: list[AcquireRequest]) -> list[AcquireReply]:
        # The request itself may take a little past the callers' waits: the server is busy, not empty.
        deadline = time.monotonic() + max(r.wait_s for r in requests) + 10.0
        return await self._pool_update("acquire_many", requests, list[AcquireReply], deadline)  # type: ignore[arg-type]

    async def _send_releases(self, lease_ids: list[str]) -> list[None]:
        handle = self._pool_handle()
        await self._retry(lambda: handle.signal("release", lease_ids), time.monotonic() + 30.0, what=f"pool {self.pool} release")
        return [None] * len(lease_ids)

    @asynccontextmanager
    async def borrow(self, ref: str, timeout: float = 5.0, **options: Any) -> AsyncIterator[Lease]:
        """`async with roster.borrow(ref) as lease:` the lease is returned whatever happens inside."""
        lease = await self.acquire(ref, timeout, **options)
        try:
            yield lease
        finally:
            await asyncio.shield(self.release(lease))

    async def lease_status(self, lease_id: str) -> Lease | None:
        """The lease if it is still active (not released, expired or revoked)."""
        return await self._pool_query("lease", lease_id, Lease | None)

    async def status(self) -> PoolStatus:
        """The pool: agents with state and in-flight, leases, waiters, counters, warnings."""
        return await self._pool_query("status", None, PoolStatus)


R = TypeVar("R")


class _Batcher(Generic[T, R]):
    """Sends queued items in batches, with at most `max_in_flight` batches on the wire.

    A lone item goes out at once (no added latency); items arriving while
    batches are in flight ride together in the next one.
    """

    def __init__(
        self,
        send: Callable[[list[T]], Awaitable[list[R]]],
        *,
        max_in_flight: int,
        max_batch: int = 128,
        on_orphan: Callable[[R], Awaitable[None]] | None = None,
    ) -> None:
        self._send = send
        self._on_orphan = on_orphan
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._in_flight = 0

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._kick()
        return await future

    def _kick(self) -> None:
        while self._queue and self._in_flight < self._max_in_flight:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._send([item for item, _ in batch])
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
                elif self._on_orphan is not None:
                    # The caller gave up while its item was on the wire: undo what it got.
                    await self._on_orphan(result)
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        finally:
            self._in_flight -= 1
            self._kick()


class _TicketWatcher:
    """Polls the pool for every queued ticket of this client with one query."""

    def __init__(self, roster: AgentRoster, interval_s: float) -> None:
        self._roster = roster
        self._interval_s = interval_s
        self._waiting: dict[str, asyncio.Future[TicketStatus]] = {}
        self._task: asyncio.Task[None] | None = None

    async def wait(self, ticket: str, deadline: float) -> TicketStatus | None:
        """The ticket's final status, or None if `deadline` passes first."""
        future: asyncio.Future[TicketStatus] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = future
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None
        finally:
            self._waiting.pop(ticket, None)

    async def _run(self) -> None:
        handle = self._roster._pool_handle()
        while self._waiting:
            tickets = list(self._waiting)
            try:
                statuses = await handle.query("tickets", tickets, result_type=list[TicketStatus])
            except Exception:
                await asyncio.sleep(self._interval_s * 5)
                continue
            for status in statuses:
                future = self._waiting.get(status.ticket)
                if future is not None and not future.done() and not status.pending:
                    future.set_result(status)
            await asyncio.sleep(self._interval_s)
