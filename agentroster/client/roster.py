"""AgentRoster: the facade for code outside workflows.

    async with AgentRoster.connect("localhost:7233", pool="default") as roster:
        await roster.register(registration)
        output = await roster.invoke("rag.search@>=2,<3", {"query": "..."})   # lease, POST, checks, release
        async with roster.borrow("rag.search@>=2,<3", timeout=5.0) as lease:
            await http.post(f"{lease.endpoint}/tasks/{lease.capability}", json=...,
                            headers=roster.lease_headers(lease))   # the lease token agents check

Leaving the `async with` block (or `await roster.close()`) sends what is still
queued and lets the temporalio client's threads finish before the process exits.

Transient refusals from the server are retried inside the caller's own
timeout (see `agentroster.client.transport`), so a user never sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any

from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryRejectedError,
    WorkflowExecutionStatus,
    WorkflowUpdateFailedError,
)
from temporalio.common import QueryRejectCondition, SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter

from agentroster.errors import (
    MESSAGE_MAX_BYTES,
    PoolReport,
    AgentNotFoundError,
    AgentRosterError,
    CapabilityUnknownError,
    CircuitOpenError,
    LeaseKeyMissingError,
    LeaseLostError,
    MessageTooLargeError,
    PoolExhaustedError,
    PoolShutdownError,
    TaskError,
    TaskFailedError,
)
from agentroster.messages import (
    AcquireBatch,
    AcquireReply,
    AcquireRequest,
    ConfirmEvictions,
    DrainRequest,
    EvictionAsk,
    EvictionVerdict,
    OUTCOMES,
    Outcome,
    Released,
    SetPolicy,
    RenewRequest,
    ShutdownRequest,
    released_id,
)
from agentroster.models import (
    AttemptFailure,
    CostClass,
    TaskResult,
    AgentRegistration,
    AgentState,
    AgentStatus,
    CapabilityRef,
    EvictionPolicy,
    EvictionStatus,
    Lease,
    PoolPolicy,
    PoolStatus,
    TicketStatus,
)
from agentroster.vocabulary.shards import ShardLayout, shard_of_id
from agentroster.client.lease_tokens import LeaseKeys
from agentroster.vocabulary.metrics import ACQUIRE_WAIT, capability_of
from agentroster.client.shard_status import merge_evictions, merge_statuses
from agentroster.client.search_attributes import ensure_search_attributes, until_accepted
from agentroster.client.settings import LEASE_KEY_HELP, Settings, check_pool_name, resolve_lease_keys
from agentroster.client.transport import (
    Batcher,
    Hedge,
    LeasePipe,
    TicketWatcher,
    is_not_found,
    query_workflow,
    retry_until,
    signal_current_run,
)
from agentroster.vocabulary.wire import (
    AGENT_POOL,
    POOL_SHUT_DOWN,
    SCALE_UP_REFUSED,
    REGISTER_SIGNAL,
    POOL_PRIORITY,
    WORKFLOW_TASK_TIMEOUT,
    AgentWorkflowInput,
    PoolInput,
    agent_search_attributes,
    agent_workflow_id,
    pool_workflow_id,
)
from agentroster.workflows.agent import AgentWorkflow
from agentroster.workflows.pool import PoolWorkflow

logger = logging.getLogger("agentroster")


def agent_summary(reg: AgentRegistration) -> str:
    """One line for the Temporal UI's workflow list: who the agent is and what it offers."""
    names = ", ".join(f"{c.name}@{c.version}" for c in reg.capabilities[:6])
    more = f" +{len(reg.capabilities) - 6}" if len(reg.capabilities) > 6 else ""
    return f"agent {reg.agent_id} of {reg.deployment}: {names}{more}"[:400]


def agent_details(reg: AgentRegistration) -> str:
    """The UI's static details of an agent workflow (markdown)."""
    rows = "\n".join(
        f"| `{c.name}` | {c.version} | {c.max_concurrency} | {c.cost_class} |" for c in reg.capabilities
    )
    return (
        f"**{reg.agent_id}** of deployment `{reg.deployment}` at {reg.endpoint}, "
        f"heartbeat every {reg.heartbeat_interval_s:g}s\n\n"
        f"| capability | version | max concurrency | cost |\n|---|---|---|---|\n{rows}"
    )

DEFAULT_BORROW_TTL_S = 60.0
# How long a place whose cancellation the pool did not answer is still given back in the background.
ABANDON_RETRY_S = 120.0
# How long describe() asks again while its query gets no answer (a worker restarting, or busy).
DESCRIBE_TIMEOUT_S = 30.0
# One poll of a client's queued tickets (transport.TicketWatcher): a poll in flight to a
# worker that is killed is never answered, so it is given up after this and asked again.
# A query waits behind the pool's workflow task (at most its 2 s timeout); a poll that
# times out on the first task of a run of many thousand agents is asked again, harmlessly.
TICKET_POLL_TIMEOUT_S = 2.5
# A poll unanswered this long gets another beside it, the first answer serving: the server
# may hold a poll behind the pool's workflow tasks for seconds while one sent a moment later
# answers at once. Polls that answer take 10-200 ms, so a hedge goes out only for one that is
# held; each is one query (billed on Temporal Cloud). At most TICKET_POLLS_IN_FLIGHT; when
# full, the oldest is given up after TICKET_POLL_GIVE_UP_S, so polls sent during an outage do
# not keep fresh ones from going out after it. That stays under the workers' sticky
# schedule-to-start timeout (wire.STICKY_TIMEOUT, 2 s): a poll given up before it
# never reaches a restarted worker as a query task on a partial history. Each poll's own gRPC
# deadline is wire.QUERY_RPC_TIMEOUT (`transport.query_workflow`, the one road for queries).
TICKET_POLL_HEDGE_S = 0.25
TICKET_POLLS_IN_FLIGHT = 3
TICKET_POLL_GIVE_UP_S = 1.5
# How long a release is retried while the server refuses it (a `release_later` one: until its lease would have ended).
RELEASE_RETRY_S = 30.0
# How long `release_later` waits for an acquire to ride on before the lease goes alone.
RELEASE_LATER_S = 0.1
# A prefetched lease lives this long unless a task renews it (a worker that dies holding
# one frees its slot this soon).
PREFETCH_TTL_S = 15.0
# The memo keys a pool workflow is started with: its layout, readable with no worker running.
MEMO_SHARDS = "agentroster_shards"
MEMO_SHARD_BY = "agentroster_shard_by"


class _ShardLink:
    """What a client keeps per pool shard: the lease pipe (acquire and release updates), the
    cancel and renew updates and the ticket poll, each sharing its messages among concurrent callers."""

    def __init__(
        self, roster: AgentRoster, shard: int, acquires_in_flight: int, releases_in_flight: int, poll_s: float, max_poll_s: float
    ) -> None:
        self.shard = shard
        self.tickets = TicketWatcher(
            lambda tickets: roster._query_tickets(tickets, shard), poll_s, max_interval_s=max_poll_s, timeout_s=TICKET_POLL_TIMEOUT_S + 0.5,
            hedge_s=TICKET_POLL_HEDGE_S, max_polls=TICKET_POLLS_IN_FLIGHT, give_up_s=TICKET_POLL_GIVE_UP_S,
        )
        # Concurrent callers share updates: one update carries every item queued while the
        # previous ones were in flight, releases riding on acquires. This keeps a process well
        # under the server's 10 in-flight updates per workflow. A worker's prefetches ride with
        # the acquires, and the leases given to `release_later` wait here for one to ride on.
        self.pipe: LeasePipe[AcquireRequest, str | Released, AcquireReply] = LeasePipe(
            lambda requests, releases: roster._send_acquires(requests, releases, shard),
            lambda releases, until: roster._send_releases(releases, shard, until=until),
            acquires_in_flight=acquires_in_flight,
            releases_in_flight=releases_in_flight,
            on_orphan=roster._return_orphan,
        )
        # Callers that time out together give up their places in one update, not one each.
        self.cancels: Batcher[str, TicketStatus] = Batcher(lambda tickets: roster._send_cancels(tickets, shard), max_in_flight=2)
        self.renewals: Batcher[RenewRequest, Lease | None] = Batcher(
            lambda requests: roster._send_renewals(requests, shard), max_in_flight=2
        )


def _release_item(lease_id: str, outcome: str | None) -> str | Released:
    """What one release sends: the lease id alone, or with its task's outcome."""
    if outcome is None:
        return lease_id
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome: expected one of {', '.join(OUTCOMES)}, got {outcome!r}")
    return Released(lease_id=lease_id, outcome=outcome)  # type: ignore[arg-type]


def merge_reports(ref: str, reports: Sequence[PoolReport | None]) -> PoolReport | None:
    """Shards' figures for one ref, added up (None when no shard sent any)."""
    present = [r for r in reports if r is not None]
    if not present:
        return None
    total = PoolReport(ref=ref)
    for report in present:
        for field in ("matching", "busy", "draining", "routable", "excluded", "waiting", "total_agents", "active_leases", "slots", "idle_slots"):
            setattr(total, field, getattr(total, field) + getattr(report, field))
    return total


def pool_start_options(pool: str, shard: int, layout: ShardLayout) -> dict[str, Any]:
    """How every process starts pool `pool`'s shard `shard`: its id, input, summary and recorded layout."""
    label = f"pool {pool}" + (f" shard {shard} of {layout.shards}" if layout.sharded else "")
    return {
        "arg": PoolInput(pool=pool, shard=shard, shards=layout.shards, shard_by=layout.by),
        "id": pool_workflow_id(pool, shard),
        "task_timeout": WORKFLOW_TASK_TIMEOUT,
        "priority": POOL_PRIORITY,
        "static_summary": f"{label}: capability index and leases",
        "memo": {MEMO_SHARDS: layout.shards, MEMO_SHARD_BY: layout.by},
        "id_conflict_policy": WorkflowIDConflictPolicy.USE_EXISTING,
        "search_attributes": TypedSearchAttributes([SearchAttributePair(AGENT_POOL, pool)]),
    }


async def start_pool_shard(
    client: Client, pool: str, shard: int, layout: ShardLayout, task_queue: str, *, restart: bool = False, **more: Any
) -> WorkflowHandle[Any, Any]:
    """Start one pool shard's workflow unless it runs (`more`: e.g. a start signal)."""
    reuse = WorkflowIDReusePolicy.ALLOW_DUPLICATE if restart else WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY
    return await client.start_workflow(
        PoolWorkflow.run, task_queue=task_queue, id_reuse_policy=reuse, **pool_start_options(pool, shard, layout), **more
    )


async def pool_layout(client: Client, pool: str) -> ShardLayout | None:
    """The layout pool `pool` was started with, from shard 0's memo; None when it has no workflow.
    A pool workflow started by hand, without the memo, is one shard."""
    try:
        description = await client.get_workflow_handle(pool_workflow_id(pool)).describe()
    except RPCError as exc:
        if is_not_found(exc):
            return None
        raise
    memo = await description.memo()
    try:
        return ShardLayout(int(memo.get(MEMO_SHARDS, 1)), str(memo.get(MEMO_SHARD_BY, ShardLayout().by)))
    except (TypeError, ValueError) as exc:
        raise AgentRosterError(f"pool {pool}: its workflow records an unreadable shard layout: {exc}") from exc


# How long `close` gives up the GIL once the roster's work is done: see `AgentRoster.close`.
CLOSE_SETTLE_S = 0.05


class _Connecting:
    """What `AgentRoster.connect` returns: await it for the roster, or use it as
    `async with AgentRoster.connect(...) as roster:`, which closes the roster at the end."""

    def __init__(self, connecting: Any) -> None:
        self._connecting = connecting
        self._roster: AgentRoster | None = None

    def __await__(self) -> Any:
        return self._connecting.__await__()

    async def __aenter__(self) -> AgentRoster:
        self._roster = await self._connecting
        return self._roster

    async def __aexit__(self, *exc: object) -> None:
        if self._roster is not None:
            await self._roster.close()


class AgentRoster:
    """One pool's client: register agents, find and lease capabilities, drain, describe."""

    def __init__(
        self,
        client: Client,
        *,
        pool: str = "default",
        task_queue: str = "agentroster",
        ticket_poll_interval_s: float = 0.02,
        ticket_poll_max_interval_s: float = 0.25,
        acquires_in_flight: int = 4,
        releases_in_flight: int = 2,
        shards: ShardLayout | int | str | None = None,
    ) -> None:
        """`acquires_in_flight` / `releases_in_flight`: how many `acquire` / `release` updates
        this client keeps on the wire at once (per pool shard); what arrives meanwhile
        rides in the next one. Acquires and releases share one queue per shard: every
        `acquire` update carries the acquires and releases queued when it leaves, and a
        `release` update goes only when no acquire waits to carry them. Fewer
        means bigger batches (fewer pool workflow tasks, less CPU) at the price of a wait
        behind the one in flight; the worker's activities use 1 and 1. `cancel` and `renew` keep at most 2
        each. The server takes at most 10 updates in flight per workflow from all its
        callers (more are retried with backoff): keep these together near 10 or under.

        While callers wait in the pool's queue, this client polls their tickets with one
        `tickets` query every `ticket_poll_interval_s`; each poll that served none
        stretches the gap by half, up to `ticket_poll_max_interval_s` (a grant after a
        quiet wait is then heard of up to that late). Each poll is a query: billed on
        Temporal Cloud, and an activation on the pool's worker.

        `shards`: the pool's shard layout (`4`, `4:agent`; see `core.shards` and the
        README's "Sharded pools"); None or 1 is an unsharded pool, `pool/{pool}`. It must
        match the layout the pool was started with (checked by `ensure_pool`)."""
        self._client = client
        self.pool = check_pool_name(pool)
        self.task_queue = task_queue
        self.layout = shards if isinstance(shards, ShardLayout) else ShardLayout.parse(shards)
        self._pool_started = False
        self._links = [
            _ShardLink(self, k, acquires_in_flight, releases_in_flight, ticket_poll_interval_s, ticket_poll_max_interval_s)
            for k in range(self.layout.shards)
        ]
        # capability name -> the shard that last granted it: where the next acquire asks first
        self._found: dict[str, int] = {}
        self._hedges: dict[str, Hedge] = {}  # pool workflow id -> when its unanswered acquires and releases go again
        self._layout_checked = False
        self._abandoning: set[asyncio.Task[None]] = set()  # places given back after the caller left
        self._releasing: set[asyncio.Future[Any]] = set()  # `release_later` leases not yet back in the pool

    # --------------------------------------------------------------- connect
    @classmethod
    def connect(
        cls,
        target_host: str | None = None,
        *,
        namespace: str | None = None,
        pool: str | None = None,
        task_queue: str | None = None,
        tls: bool | TLSConfig | None = None,
        api_key: str | None = None,
        ensure_pool: bool = True,
        shards: ShardLayout | int | str | None = None,
        **client_options: Any,
    ) -> _Connecting:
        """Connect with the pydantic data converter; unset settings come from the environment.

        `async with AgentRoster.connect(...) as roster:` closes the roster when the
        block ends (see `close`); `roster = await AgentRoster.connect(...)` leaves
        that to the caller. `client_options` go to `temporalio.client.Client.connect`.

        With `ensure_pool` the search attributes are registered where missing (or an
        error says what an operator must run) and the pool's workflow is started (every
        shard's, for a sharded pool: `shards`, default AGENTROSTER_POOL_SHARDS). See
        `agentroster.client.settings` for the variables; beside a running `agentroster dev`,
        TEMPORAL_ADDRESS and the lease key default to that stack's (`agentroster.client.settings`).
        With AGENTROSTER_OTEL on, the client traces with OpenTelemetry (see
        `agentroster.client.tracing`); workers built on it do too.
        """
        return _Connecting(cls._connect(
            target_host, namespace=namespace, pool=pool, task_queue=task_queue, tls=tls, api_key=api_key,
            ensure_pool=ensure_pool, shards=shards, **client_options,
        ))

    @classmethod
    async def _connect(
        cls,
        target_host: str | None = None,
        *,
        namespace: str | None = None,
        pool: str | None = None,
        task_queue: str | None = None,
        tls: bool | TLSConfig | None = None,
        api_key: str | None = None,
        ensure_pool: bool = True,
        shards: ShardLayout | int | str | None = None,
        **client_options: Any,
    ) -> AgentRoster:
        from agentroster.client.tracing import client_interceptors

        settings = Settings.from_env()
        api_key = api_key if api_key is not None else settings.api_key
        if tls is None:
            tls = settings.tls() or (True if api_key else False)
        if settings.otel:
            client_options["interceptors"] = [*client_options.get("interceptors", ()), *client_interceptors()]
        client = await Client.connect(
            target_host or settings.address,
            namespace=namespace or settings.namespace,
            data_converter=pydantic_data_converter,
            tls=tls,
            api_key=api_key,
            **client_options,
        )
        pool = pool or settings.pool
        layout = settings.shards_for(pool) if shards is None else shards
        roster = cls(client, pool=pool, task_queue=task_queue or settings.task_queue, shards=layout)
        if ensure_pool:
            await roster.ensure_pool()
        return roster

    @property
    def client(self) -> Client:
        """The temporalio Client (with the pydantic data converter)."""
        return self._client

    async def close(self) -> None:
        """Finish what this roster still has under way, before the process exits.

        Sends the releases still waiting in `release_later` and waits (up to 10 s) for
        them and for queue places being given back. Then it waits `CLOSE_SETTLE_S`
        with the GIL released: the temporalio client completes each call on one of
        its Rust threads, which enters Python to hand the result to the event loop,
        and a thread still inside Python when the interpreter finalizes aborts the
        process (SIGABRT `PyGILState_Release`, temporalio/sdk-python#300). Closing
        after the last call lets those threads leave Python first, so a script whose
        `asyncio.run(main())` ends after `close` (or an `async with
        AgentRoster.connect(...)` block) exits 0. The roster is not used after
        `close`; the temporalio client stays usable (it may be shared).
        """
        await self.flush_releases()
        if self._abandoning:
            await asyncio.wait(set(self._abandoning), timeout=10.0)
        await asyncio.sleep(CLOSE_SETTLE_S)

    async def __aenter__(self) -> AgentRoster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _pool_handle(self, pool: str | None = None, shard: int = 0) -> WorkflowHandle[Any, Any]:
        return self._client.get_workflow_handle(pool_workflow_id(pool or self.pool, shard))

    def _agent_handle(self, agent_id: str) -> WorkflowHandle[Any, Any]:
        return self._client.get_workflow_handle(agent_workflow_id(self.pool, agent_id))

    @property
    def shards(self) -> range:
        """This pool's shard numbers (range(1) for an unsharded pool)."""
        return range(self.layout.shards)

    async def ensure_pool(self, *, restart: bool = False) -> None:
        """Register the search attributes where missing, then start this pool's workflow(s) unless they run.

        A sharded pool starts shard 0 (`pool/{pool}`) first and checks the layout it
        records against this client's (AgentRosterError when they differ: no agent
        is ever split by two layouts), then the other shards.

        A pool that was shut down stays down: PoolShutdownError, unless `restart`
        (an operator starting it again). The server itself refuses the start after
        a completed run (id-reuse policy ALLOW_DUPLICATE_FAILED_ONLY; a pool run
        completes only through a shutdown), so nothing can race the check.
        """
        await ensure_search_attributes(self._client)
        await self._start_shard(0, restart)
        await self.check_layout()
        if self.layout.sharded:
            await asyncio.gather(*(self._start_shard(k, restart) for k in self.shards if k > 0))
        self._pool_started = True

    async def _start_shard(self, shard: int, restart: bool) -> None:
        try:
            await until_accepted(
                lambda: start_pool_shard(self._client, self.pool, shard, self.layout, self.task_queue, restart=restart),
                what=f"starting pool {self.pool}" + (f" shard {shard}" if shard else ""),
            )
        except WorkflowAlreadyStartedError as exc:
            final = await self._final_status(shard)
            reason = final.shutdown.reason if final is not None and final.shutdown is not None else ""
            raise PoolShutdownError(self.pool, reason, finished=True, status=final) from exc

    async def check_layout(self) -> ShardLayout:
        """The layout the pool's shard 0 was started with (a memo, readable with no worker running);
        AgentRosterError when it differs from this client's."""
        recorded = await pool_layout(self._client, self.pool)
        self._layout_checked = recorded is not None and recorded == self.layout
        if recorded is not None and recorded != self.layout:
            raise AgentRosterError(
                f"pool {self.pool} runs as {recorded.shards} shard(s) placed by {recorded.by} "
                f"(recorded in workflow {pool_workflow_id(self.pool)}), but this client is configured for "
                f"{self.layout.shards} shard(s) by {self.layout.by}: set AGENTROSTER_POOL_SHARDS={recorded} "
                "(or the roster's `shards` option) to match; a pool's layout changes only with a new pool"
            )
        return self.layout if recorded is None else recorded

    async def _final_status(self, shard: int = 0) -> PoolStatus | None:
        """What the pool's last run returned (a run returns only once shut down); None if unknown."""
        handle = self._client.get_workflow_handle(pool_workflow_id(self.pool, shard), result_type=PoolStatus)
        try:
            return await asyncio.wait_for(handle.result(), timeout=30.0)
        except (RPCError, WorkflowFailureError, asyncio.TimeoutError):
            return None

    # --------------------------------------------------------------- calls
    async def _pool_update(
        self,
        update: Any,
        arg: Any,
        deadline: float,
        *,
        pool: str | None = None,
        shard: int = 0,
        start_if_missing: bool = True,
        hedged: bool = False,
    ) -> Any:
        """Run a pool update, retrying transient refusals until `deadline` (starting the pool if it is missing).

        `hedged`: sent again under its update id while unanswered (`transport.Hedge`), for
        the updates a resend cannot apply twice (acquires by their request ids, releases).
        An argument over MESSAGE_MAX_BYTES encoded raises MessageTooLargeError before anything is sent."""
        self._check_size(f"pool {pool or self.pool} update {update.__name__}", arg)
        handle = self._pool_handle(pool, shard)
        hedge = self._hedges.setdefault(handle.id, Hedge()) if hedged else None

        async def call() -> Any:
            try:
                if hedge is not None:
                    return await hedge.execute_update(handle, update, arg)
                return await handle.execute_update(update, arg)
            except WorkflowUpdateFailedError as exc:
                cause = exc.cause
                if isinstance(cause, ApplicationError) and cause.type == POOL_SHUT_DOWN:
                    # Not retried: the pool answers the same until it has ended.
                    reason = cause.details[0] if cause.details else ""
                    raise PoolShutdownError(pool or self.pool, str(reason)) from exc
                raise

        return await retry_until(
            call,
            deadline,
            what=f"pool {pool or self.pool}{' shard ' + str(shard) if shard else ''} {update.__name__}",
            on_not_found=self.ensure_pool if start_if_missing and pool in (None, self.pool) else None,
        )

    def _check_size(self, message: str, arg: Any) -> None:
        """MessageTooLargeError when `arg`, encoded as the client sends it, is over MESSAGE_MAX_BYTES."""
        size = len(self._client.data_converter.payload_converter.to_payloads([arg])[0].data)
        if size > MESSAGE_MAX_BYTES:
            raise MessageTooLargeError(message, size)

    async def _in_parts(self, items: list[Any], send: Callable[[list[Any]], Awaitable[list[Any]]]) -> list[Any]:
        """`send(items)`, or halves of them, each in turn, while one message would be too large."""
        try:
            return await send(items)
        except MessageTooLargeError:
            if len(items) < 2:
                raise
            half = len(items) // 2
            return [*await self._in_parts(items[:half], send), *await self._in_parts(items[half:], send)]

    async def _pool_query(self, query: Any, *args: Any, timeout: float = 30.0, shard: int = 0) -> Any:
        handle = self._pool_handle(shard=shard)
        return await query_workflow(
            handle, query, *args,
            deadline=time.monotonic() + timeout,
            what=f"pool {self.pool}{' shard ' + str(shard) if shard else ''} query {query.__name__}",
            on_not_found=self.ensure_pool,
        )

    async def _each_shard(self, call: Any) -> list[Any]:
        """`call(shard)` for every shard at once, results in shard order."""
        return list(await asyncio.gather(*(call(k) for k in self.shards)))

    async def _query_tickets(self, tickets: list[str], shard: int = 0) -> list[TicketStatus]:
        # The server lets go of it too (the watcher gives up on it a moment later).
        return await query_workflow(self._pool_handle(shard=shard), PoolWorkflow.tickets, tickets)

    def home_shard(self, agent_id: str, deployment: str) -> int:
        """The shard that holds this agent (0 in an unsharded pool)."""
        return self.layout.home_shard(agent_id, deployment)

    # --------------------------------------------------------------- agents
    async def register(self, registration: AgentRegistration | dict[str, Any], *, wait: bool = True, timeout: float = 30.0) -> AgentStatus:
        """Register (or re-register) an agent in this pool. Idempotent; starts `agent/{pool}/{id}` when needed.

        With `wait`, returns once the pool routes to it (state Ready or Busy): the agent
        workflow's `wait_routable` update answers once its pool has said it indexed this
        registration (no polling of the pool). AgentRosterError when that takes longer than
        `timeout`, or the agent ends up neither Ready nor Busy.
        """
        reg = AgentRegistration.model_validate(registration)
        warning = reg.short_heartbeat_warning()
        if warning:
            logger.warning(warning)
        if not self._pool_started:
            await self.ensure_pool()
        await until_accepted(
            lambda: self._client.start_workflow(
                AgentWorkflow.run,
                self._agent_input(reg.agent_id),
                id=agent_workflow_id(self.pool, reg.agent_id),
                task_queue=self.task_queue,
                static_summary=agent_summary(reg),
                static_details=agent_details(reg),
                start_signal=REGISTER_SIGNAL,
                start_signal_args=[reg.model_dump(mode="json")],
                # As its workflow will upsert them once it takes this registration (it then upserts none).
                search_attributes=TypedSearchAttributes(
                    [SearchAttributePair(k, v) for k, v in agent_search_attributes(self.pool, AgentState.REGISTERING.value, reg)]
                ),
            ),
            what=f"registering {reg.agent_id}",
        )
        if not wait:
            return AgentStatus(agent_id=reg.agent_id, pool=self.pool, state=AgentState.REGISTERING, registration=reg)
        deadline = time.monotonic() + timeout
        current = self._agent_handle(reg.agent_id)  # the latest run: a run continuing as new hands the wait over
        shard = self.home_shard(reg.agent_id, reg.deployment)
        not_indexed = f"agent {reg.agent_id} is registered but pool {self.pool}" + (f" (shard {shard})" if self.layout.sharded else "")
        while True:
            try:
                status: AgentStatus = await retry_until(
                    lambda: current.execute_update(AgentWorkflow.wait_routable), deadline, what=f"register {reg.agent_id}"
                )
            except AgentRosterError as exc:
                if type(exc) is not AgentRosterError:
                    raise
                raise AgentRosterError(f"{not_indexed} did not index it within {timeout:g}s ({exc})") from exc
            if status.state not in (AgentState.READY, AgentState.BUSY):
                refusals = await query_workflow(current, AgentWorkflow.refusals, deadline=deadline + 5.0, what=f"refusals of {reg.agent_id}")
                raise AgentRosterError(
                    f"agent {reg.agent_id} did not become routable: it is {status.state.value}"
                    + (f" ({refusals[-1]})" if refusals else "")
                )
            if status.indexed_by_pool:
                return status
            # Answered by a run continuing as new before its pool's word: the next run waits on.
            if time.monotonic() + 0.05 > deadline:
                raise AgentRosterError(f"{not_indexed} did not index it within {timeout:g}s")
            await asyncio.sleep(0.05)

    def _agent_input(self, agent_id: str) -> AgentWorkflowInput:
        if not self.layout.sharded:
            return AgentWorkflowInput(agent_id=agent_id, pool=self.pool)
        return AgentWorkflowInput(agent_id=agent_id, pool=self.pool, pool_shards=self.layout.shards, pool_shard_by=self.layout.by)

    async def heartbeat(self, agent_id: str) -> None:
        """Tell the agent's workflow it is alive. Raises AgentNotFoundError when its run has ended."""
        try:
            # (a continue-as-new moment is not taken for the end, so an agent is not told to register anew)
            await signal_current_run(self._agent_handle(agent_id), AgentWorkflow.heartbeat)
        except RPCError as exc:
            if not is_not_found(exc):
                raise
            raise AgentNotFoundError(f"agent {agent_id} has no running workflow in pool {self.pool}; register it again") from exc

    async def drain(self, agent_id: str, reason: str = "drain", *, deadline_s: float = 300.0, wait: bool = True) -> AgentStatus:
        """Stop new leases to the agent; with `wait`, return once it is Terminated."""
        request = DrainRequest(reason=reason, deadline_s=deadline_s)
        handle = self._client.get_workflow_handle(agent_workflow_id(self.pool, agent_id), result_type=AgentStatus)
        try:
            await signal_current_run(handle, AgentWorkflow.drain, request)
        except RPCError as exc:
            if not is_not_found(exc):
                raise
            # Already ended: report how it ended.
            return await self.describe(agent_id)
        if not wait:
            return await self.describe(agent_id)
        try:
            return await handle.result()
        except WorkflowFailureError as exc:
            raise AgentRosterError(f"agent {agent_id}'s workflow failed while draining: {exc.cause}") from exc

    async def wait_ended(self, agent_id: str) -> AgentStatus:
        """Wait until the agent's run has ended (not just reached Terminated) and return its final status."""
        handle = self._client.get_workflow_handle(agent_workflow_id(self.pool, agent_id), result_type=AgentStatus)
        try:
            return await handle.result()
        except RPCError as exc:
            if is_not_found(exc):
                raise AgentNotFoundError(f"agent {agent_id} has no workflow in pool {self.pool}") from exc
            raise
        except WorkflowFailureError as exc:
            raise AgentRosterError(f"agent {agent_id}'s workflow failed: {exc.cause}") from exc

    async def describe(self, agent_id: str) -> AgentStatus:
        """The agent's lifecycle state, in-flight count, last heartbeat and recent transitions."""
        handle = self._agent_handle(agent_id)
        try:
            try:
                # A closed run is refused by the server at once, not replayed by a worker
                # (slow on a busy one, no answer with none running).
                status = await query_workflow(
                    handle, AgentWorkflow.status, reject_condition=QueryRejectCondition.NOT_OPEN,
                    deadline=time.monotonic() + DESCRIBE_TIMEOUT_S, what=f"describe {agent_id}",
                )
            except WorkflowQueryRejectedError:
                status = await self._ended_agent_status(handle)
        except RPCError as exc:
            if is_not_found(exc):
                raise AgentNotFoundError(
                    f"no agent {agent_id} has ever registered in pool {self.pool} "
                    f"(no workflow {agent_workflow_id(self.pool, agent_id)})"
                ) from exc
            raise
        if status.state != AgentState.TERMINATED:
            # The pool owns the lease count; the agent workflow only hears coalesced notices.
            reg = status.registration
            shard = self.home_shard(agent_id, reg.deployment) if reg is not None else 0
            pool: PoolStatus = await self._pool_query(PoolWorkflow.status, shard=shard)
            row = next((row for row in pool.agents if row.agent_id == agent_id), None)
            if row is not None:
                status.in_flight, status.ejected, status.ejected_until = row.in_flight, row.ejected, row.ejected_until
            else:
                status.in_flight = 0
        else:
            status.in_flight = 0
        return status

    async def _ended_agent_status(self, handle: WorkflowHandle[Any, Any]) -> AgentStatus:
        """A closed agent run's final status: its stored result, or (terminated by hand, so
        no result) a query a worker answers by replaying the run.

        The closed run is named by its run id: the agent may have registered again since the
        query was refused, and the result of its new run (the latest) would not come until
        that run ends. An agent found running again is asked for its status instead."""
        described = await handle.describe()
        if described.status == WorkflowExecutionStatus.RUNNING:
            return await query_workflow(handle, AgentWorkflow.status, deadline=time.monotonic() + DESCRIBE_TIMEOUT_S)  # type: ignore[no-any-return]
        closed = self._client.get_workflow_handle(handle.id, run_id=described.run_id, result_type=AgentStatus)
        try:
            result: AgentStatus = await closed.result(follow_runs=False)
            return result
        except WorkflowFailureError:
            return await query_workflow(closed, AgentWorkflow.status, deadline=time.monotonic() + DESCRIBE_TIMEOUT_S)  # type: ignore[no-any-return]

    # --------------------------------------------------------------- leases
    async def find(self, ref: str) -> list[str]:
        """Agent ids that could take a lease for `ref` now, best first (cheapest cost class,
        then fewest in flight; shard by shard), from the pool's `status`. [] is backpressure:
        queue, spill or scale."""
        parsed = CapabilityRef.parse(ref)
        found: list[str] = []
        for status in await self.shard_statuses():
            capability = status.capabilities.get(parsed.name)
            for entry in capability.free if capability is not None else []:
                agent_id, _, version = entry.rpartition("@")
                if parsed.matches(version):
                    found.append(agent_id)
        return found

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
        max_cost_class: CostClass | None = None,
    ) -> Lease:
        """A lease on the best agent for `ref`, waiting up to `timeout` seconds in FIFO order.

        `max_cost_class` caps the cost class accepted ("A" < "B" < "C"): a dearer agent is
        never handed out, even when it alone is free; the caller waits for one within
        the cap, and a PoolExhaustedError says how many the cap excluded.

        Raises CapabilityUnknownError at once when no agent in the pool has ever
        offered the capability, PoolShutdownError at once when the pool is shutting
        down (or has; a caller waiting in the queue gets it as the shutdown begins),
        PoolExhaustedError (with counts) when none frees up in time. The lease ends at its deadline unless renewed (`renew`).
        `request_id` makes a retried call return the same lease or ticket.
        """
        CapabilityRef.parse(ref)
        if not timeout >= 0:
            raise ValueError(f"timeout: must be >= 0, got {timeout}")
        started = time.monotonic()
        outcome = "error"
        try:
            lease = await self._acquire(
                ref, started, timeout, lease_ttl_s, holder, holder_is_workflow, exclude_agents, request_id, max_cost_class
            )
            outcome = "granted"
            return lease
        except CircuitOpenError:
            outcome = "circuit_open"
            raise
        except CapabilityUnknownError:
            outcome = "unknown_capability"
            raise
        except PoolExhaustedError:
            outcome = "exhausted"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            # The wait as the caller saw it (histogram agentroster_acquire_wait_seconds).
            ACQUIRE_WAIT.labels(self.pool, capability_of(ref), outcome).observe(time.monotonic() - started)

    async def _acquire(
        self,
        ref: str,
        started: float,
        timeout: float,
        lease_ttl_s: float,
        holder: str | None,
        holder_is_workflow: bool,
        exclude_agents: Sequence[str],
        request_id: str | None,
        max_cost_class: CostClass | None = None,
    ) -> Lease:
        request = AcquireRequest(
            max_cost_class=max_cost_class,
            ref=ref,
            lease_ttl_s=lease_ttl_s,
            wait_s=timeout,
            holder=holder,
            holder_is_workflow=holder_is_workflow,
            exclude_agents=list(exclude_agents),
            request_id=request_id or uuid.uuid4().hex,
        )
        return await self.lease_for(request, started=started)

    async def lease_for(
        self, request: AcquireRequest, *, started: float | None = None, on_queued: Callable[[], None] | None = None
    ) -> Lease:
        """A lease for `request`, waiting in the pool's FIFO queue up to its `wait_s` (what
        `acquire` does with the request it builds; the task workflow's activity calls it with
        its own request id, by which `recover` finds what it got). `on_queued` is called when
        the request takes a place in the queue (no slot was free). Raises as `acquire` does."""
        started = time.monotonic() if started is None else started
        ref = request.ref
        deadline = started + request.wait_s
        reply = await self.request(request)
        if reply.lease is not None:
            return reply.lease
        if reply.ticket is None:
            raise self._exhausted(ref, time.monotonic() - started, reply)
        if on_queued is not None:
            on_queued()
        status: TicketStatus | None = None
        try:
            status = await self._link_of(reply.ticket).tickets.wait(reply.ticket, deadline)
        except BaseException:
            # Cancelled by our caller: give the place (or a lease granted meanwhile) back.
            await asyncio.shield(self._abandon(reply.ticket))
            raise
        if status is not None and status.shutdown is not None:
            raise PoolShutdownError(self.pool, status.shutdown)  # our place ended: the pool shuts down
        if status is not None and status.lease is not None:
            return status.lease
        if status is not None and status.unknown_capability:  # the pool relearnt its fleet: nobody offers it
            raise CapabilityUnknownError(ref, pool=self.pool, report=status.report or reply.report)
        try:
            final: TicketStatus = await self.cancel_ticket(reply.ticket)
        except AgentRosterError as exc:
            if type(exc) is not AgentRosterError:  # PoolShutdownError and the like say something else
                raise
            # The pool did not answer the cancellation (a task timing out on a starved
            # worker): our caller's time is up all the same. Keep giving the place back
            # in the background, so a lease granted to it meanwhile is released.
            self._abandon_later(reply.ticket)
            raise PoolExhaustedError(ref, waited_s=time.monotonic() - started, report=reply.report, pool=self.pool) from exc
        if final.lease is not None:
            return final.lease
        if final.unknown_capability:
            raise CapabilityUnknownError(ref, pool=self.pool, report=final.report or reply.report)
        report = final.report or reply.report
        if self.layout.sharded and final.report is not None and reply.report is not None:
            report = merge_reports(ref, [final.report, reply.report])  # the shard it waited in, and the others
        raise PoolExhaustedError(ref, waited_s=time.monotonic() - started, report=report, pool=self.pool)

    def _exhausted(self, ref: str, waited_s: float, reply: AcquireReply) -> PoolExhaustedError:
        if reply.circuit_open:
            return CircuitOpenError(ref, reply.circuit_open, pool=self.pool, report=reply.report)
        if reply.unknown_capability:
            return CapabilityUnknownError(ref, pool=self.pool, report=reply.report)
        return PoolExhaustedError(ref, waited_s=waited_s, report=reply.report, pool=self.pool)

    async def request(self, request: AcquireRequest) -> AcquireReply:
        """One acquire without waiting: a lease, a ticket (place in the queue), or a report.

        For callers that wait elsewhere (`lease_for` waits on the ticket with this client's
        ticket poll). A workflow holder (`holder_is_workflow`) is signalled `lease_revoked`
        when the pool ends its lease.

        In a sharded pool the shards are asked in `acquire_order`, each without
        waiting, until one grants; when none does and the request may wait, it takes
        a place in the queue of the first shard that serves the capability, for
        what is left of `wait_s` (a slot freed in another shard meanwhile does not
        serve it). The ticket names its shard.
        """
        if not self.layout.sharded:
            return await self._links[0].pipe.acquire(request)
        started = time.monotonic()
        name = capability_of(request.ref)
        key = request.request_id or uuid.uuid4().hex
        replies: list[tuple[int, AcquireReply]] = []
        for shard in self.layout.acquire_order(key, self._found.get(name)):
            reply = await self._links[shard].pipe.acquire(request.model_copy(update={"wait_s": 0.0}))
            if reply.lease is not None:
                self._found[name] = shard
                return reply
            replies.append((shard, reply))
        serving = [shard for shard, reply in replies if not reply.unknown_capability and not reply.circuit_open]
        # Wait first where agents match (a shard relearning its fleet may not know the name yet).
        matching = {shard: bool(reply.report and reply.report.matching) for shard, reply in replies}
        serving.sort(key=lambda shard: not matching[shard])
        left = request.wait_s - (time.monotonic() - started)
        if serving and left > 0:
            reply = await self._links[serving[0]].pipe.acquire(request.model_copy(update={"wait_s": left}))
            if reply.lease is not None:
                self._found[name] = serving[0]
                return reply
            if reply.ticket is not None:
                # The other shards' figures ride along: a caller that gives up reports the whole pool.
                others = merge_reports(request.ref, [r.report for shard, r in replies if shard != serving[0]])
                return reply.model_copy(update={"report": others})
            replies.append((serving[0], reply))
        report = merge_reports(request.ref, [reply.report for _, reply in replies])
        if not serving:
            opened = [reply.circuit_open for _, reply in replies if reply.circuit_open]
            if opened:
                return AcquireReply(report=report, circuit_open=opened[0])
            return AcquireReply(report=report, unknown_capability=True)
        return AcquireReply(report=report)

    async def prefetch(self, ref: str, *, shard: int = 0, lease_ttl_s: float = PREFETCH_TTL_S, holder: str | None = None) -> Lease | None:
        """A lease for a task that has not come yet, from one shard (how a worker keeps its next
        task off the pool's round trip; see `RosterActivities`).

        Granted only when a slot is free there now and nobody waits for the capability: it is
        never queued and never counts as unmet demand. None when there is none. A lease
        waiting in `release_later` for that shard rides along. Release it (or let a task renew
        it with `adopt_by`) like any lease.
        """
        request = AcquireRequest(
            ref=ref, lease_ttl_s=lease_ttl_s, wait_s=0.0, holder=holder, request_id=uuid.uuid4().hex + uuid.uuid4().hex, prefetch=True
        )
        reply = await self._links[shard].pipe.acquire(request)
        return reply.lease

    async def holds(self, request_id: str, ref: str) -> tuple[Lease | None, bool]:
        """What an earlier `request` with this `request_id` holds now: (its lease, whether it
        waits in a queue). Changes nothing: each shard is asked with `recover_only`."""
        lease: Lease | None = None
        queued = False
        for link in self._links:
            reply = await link.pipe.acquire(AcquireRequest(ref=ref, request_id=request_id, wait_s=0.0, recover_only=True))
            lease = lease or reply.lease
            queued = queued or (reply.lease is None and reply.ticket is not None)
        return lease, queued

    async def recover(self, request_id: str, ref: str) -> Lease | None:
        """Give back whatever an earlier `request` with this `request_id` still holds: its
        lease (released here) or its place in the queue (cancelled; a lease granted to it
        meanwhile is released). Returns the lease it held, if any; None when the request
        never reached the pool or its lease or place has already ended. Grants nothing:
        each shard is asked with `recover_only`."""
        found: Lease | None = None
        for link in self._links:
            reply = await link.pipe.acquire(AcquireRequest(ref=ref, request_id=request_id, wait_s=0.0, recover_only=True))
            lease = reply.lease
            if lease is None and reply.ticket is not None:
                lease = (await self.cancel_ticket(reply.ticket)).lease
            if lease is not None:
                await self.release(lease)
                found = found or lease
        return found

    def _link_of(self, lease_or_ticket: str) -> _ShardLink:
        """The shard that made a lease id or ticket (shard 0 for every id of an unsharded pool)."""
        shard = shard_of_id(lease_or_ticket)
        if shard >= self.layout.shards:
            raise AgentRosterError(
                f"{lease_or_ticket[:40]!r} comes from shard {shard}, but this client knows pool {self.pool} "
                f"as {self.layout.shards} shard(s): set AGENTROSTER_POOL_SHARDS to the pool's layout"
            )
        return self._links[shard]

    async def cancel_ticket(self, ticket: str) -> TicketStatus:
        """Give up a place in the queue; a lease granted meanwhile comes back in the status."""
        return await self._link_of(ticket).cancels.submit(ticket)

    async def _send_cancels(self, tickets: list[str], shard: int = 0) -> list[TicketStatus]:
        deadline = time.monotonic() + 10.0
        return await self._in_parts(tickets, lambda part: self._pool_update(PoolWorkflow.cancel, part, deadline, shard=shard))

    def _abandon_later(self, ticket: str) -> None:
        task = asyncio.create_task(self._abandon_until_answered(ticket))
        self._abandoning.add(task)
        task.add_done_callback(self._abandoning.discard)

    async def _abandon_until_answered(self, ticket: str, give_up_after_s: float = ABANDON_RETRY_S) -> None:
        deadline = time.monotonic() + give_up_after_s
        delay = 0.5
        while True:
            try:
                await self._abandon(ticket)
                return
            except AgentRosterError as exc:
                if type(exc) is not AgentRosterError or time.monotonic() + delay > deadline:
                    # The pool drops the waiter at its deadline; a lease granted to it
                    # meanwhile ends at its TTL.
                    logger.warning("pool %s: ticket %s could not be given back: %s", self.pool, ticket[:8], exc)
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _abandon(self, ticket: str) -> None:
        try:
            final: TicketStatus = await self.cancel_ticket(ticket)
        except PoolShutdownError:
            return  # the pool has ended: no place, no lease left to give back
        if final.lease is not None:
            await self.release(final.lease)

    async def renew(
        self, lease: Lease, ttl_s: float | None = None, *, adopt_by: str | None = None, adopt_request_id: str | None = None
    ) -> Lease:
        """Move the lease's deadline to now + `ttl_s` (default: its original TTL) and return it.

        `adopt_by`: a workflow that now holds a prefetched lease; the pool sends it
        `lease_revoked` from now on, and `recover` with `adopt_request_id` finds the lease.
        Raises LeaseLostError when the lease has already ended (released,
        expired or revoked): its slot may be someone else's by now.
        """
        if not isinstance(lease, Lease):
            raise ValueError("lease: expected the Lease that acquire returned")
        ttl = ttl_s if ttl_s is not None else (lease.deadline - lease.granted_at).total_seconds()
        request = RenewRequest(lease_id=lease.lease_id, ttl_s=ttl, adopt_by=adopt_by, adopt_request_id=adopt_request_id)
        try:
            renewed: Lease | None
            if lease.pool == self.pool:
                renewed = await self._link_of(lease.lease_id).renewals.submit(request)
            else:  # a lease from another roster's pool: renewed where it lives
                (renewed,) = await self._send_renewals([request], shard_of_id(lease.lease_id), pool=lease.pool)
        except PoolShutdownError as exc:
            raise LeaseLostError(f"lease {lease.lease_id} on {lease.agent_id} has ended: {exc}") from exc
        if renewed is None:
            raise LeaseLostError(
                f"lease {lease.lease_id} on {lease.agent_id} ({lease.capability}) in pool {lease.pool} has ended "
                "(released, expired at its deadline, or revoked); acquire a new one"
            )
        return renewed

    async def _send_renewals(self, requests: list[RenewRequest], shard: int = 0, *, pool: str | None = None) -> list[Lease | None]:
        deadline = time.monotonic() + 30.0
        return await self._in_parts(
            requests, lambda part: self._pool_update(PoolWorkflow.renew, part, deadline, pool=pool, shard=shard)
        )

    async def release(self, lease: Lease | str, outcome: Outcome | None = None) -> None:
        """Return a lease's slot, in the lease's own pool. Idempotent: releasing twice, or after expiry, is harmless.

        `outcome` says how the task on it went (`succeeded`, `failed_5xx`, ...: see
        `agentroster.messages.Outcome`); the pool's outlier detection learns from it.
        Returns once the pool has it. It rides on this client's next `acquire` update to
        the lease's shard when one waits to leave, else goes as the `release` update,
        batched with this client's other releases.
        """
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        if not isinstance(lease_id, str) or not lease_id:
            raise ValueError("lease: expected a Lease or a non-empty lease id")
        item = _release_item(lease_id, outcome)
        pool = lease.pool if isinstance(lease, Lease) else self.pool
        await self._queue_release(item, pool, time.monotonic() + RELEASE_RETRY_S)

    async def release_many(self, leases: Sequence[Lease]) -> None:
        """Return several leases at once (idempotent): they leave together, in one message per
        pool shard (up to 256 a message), as `release` does."""
        until = time.monotonic() + RELEASE_RETRY_S
        await asyncio.gather(*(self._queue_release(lease.lease_id, lease.pool, until) for lease in leases))

    def release_later(self, lease: Lease, within_s: float = RELEASE_LATER_S, outcome: Outcome | None = None) -> None:
        """Return a lease without waiting for it: `release`, except that the lease may wait up
        to `within_s` seconds for an acquire of this client to the lease's shard to ride on
        (one message, one billed action and one pool workflow task fewer than two). It goes
        with any message to that shard leaving before then, and alone after.
        A failure is logged: the lease then ends at its deadline. `flush_releases` sends what
        is still waiting, and waits until it landed."""
        # Retried until the lease would have ended anyway (at least RELEASE_RETRY_S).
        left_s = (lease.deadline - datetime.now(timezone.utc)).total_seconds()
        until = time.monotonic() + max(RELEASE_RETRY_S, left_s)
        landed = self._queue_release(_release_item(lease.lease_id, outcome), lease.pool, until, linger_s=within_s)
        self._releasing.add(landed)
        landed.add_done_callback(self._released_later)

    def _queue_release(self, item: str | Released, pool: str, until: float, linger_s: float = 0.0) -> asyncio.Future[Any]:
        """Send one release (retried until `until`, monotonic) down its shard's lease pipe; done once the pool has it."""
        lease_id = released_id(item)
        if pool != self.pool:
            # A lease from another roster's pool: release it where it lives, never ignore it.
            return asyncio.ensure_future(self._send_releases([item], shard_of_id(lease_id), pool=pool, until=until))
        return self._link_of(lease_id).pipe.release(item, until=until, linger_s=linger_s)

    def _released_later(self, landed: asyncio.Future[Any]) -> None:
        self._releasing.discard(landed)
        if landed.cancelled():
            return
        exc = landed.exception()
        if exc is not None:  # the lease ends at its deadline: nothing is lost, a slot waits
            logger.warning("pool %s: a lease could not be released, it ends at its deadline: %s", self.pool, exc)

    async def flush_releases(self, timeout_s: float = 10.0) -> None:
        """Send every lease still waiting in `release_later` now, and wait (at most `timeout_s`) until they landed."""
        for link in self._links:
            link.pipe.release_waiting_now()
        if self._releasing:
            await asyncio.wait(set(self._releasing), timeout=timeout_s)

    def _return_orphan(self, reply: AcquireReply) -> None:
        """What an acquire got after its caller gave up: given back, off the pipe's path."""
        if reply.lease is not None:
            self.release_later(reply.lease, within_s=0.0)
        elif reply.ticket is not None:
            self._abandon_later(reply.ticket)

    async def _send_acquires(self, requests: list[AcquireRequest], releases: list[str | Released], shard: int = 0) -> list[AcquireReply]:
        """One `acquire` update for `requests` (halves, when one message would be too large),
        with `releases` riding along (returned first)."""
        # The request itself may take a little past the callers' waits: the server is busy, not empty.
        deadline = time.monotonic() + max(r.wait_s for r in requests) + 10.0
        riding = releases

        async def send(part: list[AcquireRequest]) -> list[AcquireReply]:
            nonlocal riding
            riders, riding = riding, []
            try:
                return await self._pool_update(
                    PoolWorkflow.acquire, AcquireBatch(requests=part, releases=riders), deadline, shard=shard, hedged=True
                )
            except MessageTooLargeError:
                riding = riders  # the smaller part carries them
                raise

        replies: list[AcquireReply] = await self._in_parts(requests, send)
        if any(reply.lease is None for reply in replies):
            self._links[shard].pipe.release_waiting_now()  # slots are short: what waits to ride along goes now
        return replies

    async def _send_releases(
        self, lease_ids: list[str | Released], shard: int = 0, *, pool: str | None = None, until: float | None = None
    ) -> None:
        """The `release` update for `lease_ids` (of one shard), retried until `until` (monotonic; default RELEASE_RETRY_S from now)."""
        deadline = until or time.monotonic() + RELEASE_RETRY_S
        try:
            await self._in_parts(
                lease_ids,
                lambda part: self._pool_update(
                    PoolWorkflow.release, part, deadline, pool=pool, shard=shard, start_if_missing=False, hedged=True
                ),
            )
        except RPCError as exc:
            if not is_not_found(exc):
                raise
            # No running pool (e.g. it shut down): it holds no lease, so nothing is left to return.
            logger.debug("pool %s is not running: %d lease(s) already ended", pool or self.pool, len(lease_ids))

    @asynccontextmanager
    async def borrow(
        self, ref: str, timeout: float = 5.0, *, lease_ttl_s: float = DEFAULT_BORROW_TTL_S, **options: Any
    ) -> AsyncIterator[Lease]:
        """`async with roster.borrow(ref) as lease:` the lease is renewed while the body runs and returned whatever happens.

        A holder that dies stops renewing, so its lease expires `lease_ttl_s`
        after the last renewal at the latest.
        """
        async with self._borrow(ref, timeout, lease_ttl_s, options) as (lease, _outcome):
            yield lease

    @asynccontextmanager
    async def _borrow(
        self, ref: str, timeout: float, lease_ttl_s: float, options: dict[str, Any]
    ) -> AsyncIterator[tuple[Lease, list[Outcome | None]]]:
        """`borrow`, with a one-item list in which the body puts its task's outcome: the release carries it."""
        lease = await self.acquire(ref, timeout, lease_ttl_s=lease_ttl_s, **options)
        renewer = asyncio.create_task(self._keep_renewed(lease, lease_ttl_s))
        outcome: list[Outcome | None] = [None]
        try:
            yield lease, outcome
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await renewer
            await asyncio.shield(self.release(lease, outcome[0]))

    async def _keep_renewed(self, lease: Lease, ttl_s: float) -> None:
        """Renew every third of the TTL: two renewals can fail before the lease is at risk."""
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                await self.renew(lease, ttl_s)
            except LeaseLostError as exc:
                logger.warning("%s", exc)
                return
            except Exception as exc:  # the server is briefly unreachable: try again next time
                logger.warning("renewing lease %s failed: %s: %s", lease.lease_id, type(exc).__name__, exc)

    # ----------------------------------------------------------------- tasks
    async def invoke(
        self,
        ref: str,
        payload: Any = None,
        *,
        timeout: float = 30.0,
        task_timeout_s: float = 60.0,
        max_attempts: int = 3,
        lease_ttl_s: float = DEFAULT_BORROW_TTL_S,
        key: LeaseKeys | str | bytes | None = None,
        max_cost_class: CostClass | None = None,
        full: bool = False,
    ) -> Any:
        """Run one task on an agent serving `ref` and return its output: `CapabilityTaskWorkflow`'s rules, from plain code.

        With `full=True` it returns the whole TaskResult instead, as the task workflow
        does: the agent that served it, the version, the attempts and each failed
        attempt's agent and error (one verb and one road; the flag only chooses how much
        of the result comes back). `max_cost_class` caps the cost class of every attempt's
        agent, as `acquire` does.

        Each attempt leases an agent (waiting up to `timeout` seconds for one), checks
        `payload` against the capability's input_schema, POSTs it with the lease token
        (signed with `key`, default AGENTROSTER_LEASE_KEY), waits up to `task_timeout_s`
        for the answer, checks it against the output_schema, and releases the lease
        whatever happens (renewed every third of `lease_ttl_s` meanwhile). An agent that
        cannot be reached, answers with a failure or with a bad output is left out and
        another one tried, up to `max_attempts` in all.

        Raises InvalidTaskInputError (the payload breaks the schema or the agent refused
        it: no other agent is tried), TaskFailedError (every attempt failed; `failures`
        has each one's error), PoolExhaustedError / CapabilityUnknownError /
        PoolShutdownError (no first lease), AgentRosterError (no lease key), all at once
        where waiting cannot help. The rules are in `agentroster.client.invoke`, shared with the
        workflow's invoke activity.
        """
        import aiohttp

        from agentroster.client.invoke import invoke_leased, is_failover, outcome_of

        CapabilityRef.parse(ref)
        if not 1 <= max_attempts <= 20:
            raise ValueError(f"max_attempts: must be 1-20, got {max_attempts}")
        if not task_timeout_s > 0:
            raise ValueError(f"task_timeout_s: must be > 0, got {task_timeout_s}")
        keys = self._lease_keys(key)  # no key: fail before taking a lease
        failures: list[TaskError] = []
        async with aiohttp.ClientSession() as session:
            for _attempt in range(max_attempts):
                excluded = [f.agent_id for f in failures if f.agent_id]
                try:
                    async with self._borrow(
                        ref, timeout, lease_ttl_s, {"exclude_agents": excluded, "max_cost_class": max_cost_class}
                    ) as (lease, outcome):
                        try:
                            output = await invoke_leased(self._client, session, lease, payload, timeout_s=task_timeout_s, keys=keys)
                        except TaskError as exc:
                            outcome[0] = outcome_of(exc)  # the release tells the pool (its outlier detection, its outcome counts)
                            raise
                        outcome[0] = "succeeded"
                    if not full:
                        return output
                    return TaskResult(
                        ref=ref,
                        agent_id=lease.agent_id,
                        capability=lease.capability,
                        version=lease.version,
                        output=output,
                        attempts=len(failures) + 1,
                        pool=lease.pool,
                        failures=[
                            AttemptFailure(attempt=i, agent_id=f.agent_id, error=str(f)) for i, f in enumerate(failures, start=1)
                        ],
                    )
                except TaskError as exc:
                    if not is_failover(exc):
                        raise
                    logger.warning("%s: failing over from %s: %s", ref, exc.agent_id, exc)
                    failures.append(exc)
                except PoolExhaustedError as exc:
                    if not failures:
                        raise
                    raise TaskFailedError(ref, failures, note=f"; then no other agent: {exc}") from exc
        raise TaskFailedError(ref, failures) from failures[-1]

    # ----------------------------------------------------------- lease tokens
    @staticmethod
    def _lease_keys(key: LeaseKeys | str | bytes | None) -> LeaseKeys:
        keys = resolve_lease_keys(key)
        if keys is None:
            raise LeaseKeyMissingError(f"no lease key to sign with: {LEASE_KEY_HELP}")
        return keys

    def sign(self, lease: Lease, key: LeaseKeys | str | bytes | None = None) -> str:
        """The token that lets `lease`'s agent accept a task sent to it directly (outside workflows).

        Signed with `key` (default: AGENTROSTER_LEASE_KEY); it expires at the lease's
        deadline, so sign the lease `renew` returned for a task started after a renewal.
        """
        return self._lease_keys(key).sign(lease)

    def lease_headers(self, lease: Lease, key: LeaseKeys | str | bytes | None = None) -> dict[str, str]:
        """`{"Authorization": "Bearer <JWT>"}` for a POST to `lease.endpoint`; `{}` with `insecure-no-auth`."""
        return self._lease_keys(key).headers(lease)

    async def status(self) -> PoolStatus:
        """The pool: agents with state and in-flight, leases, waiters, counters, warnings (added up over its shards).

        The first call of a roster that never ran `ensure_pool` checks the pool's layout
        (a roster configured for one shard would read only shard 0 of a sharded pool)."""
        if not self._layout_checked:
            await self.check_layout()
        if not self.layout.sharded:
            return await self._pool_query(PoolWorkflow.status)
        return merge_statuses(await self._each_shard(lambda k: self._pool_query(PoolWorkflow.status, shard=k)))

    async def shard_statuses(self) -> list[PoolStatus]:
        """Each shard's own status, in shard order (one item for an unsharded pool)."""
        return await self._each_shard(lambda k: self._pool_query(PoolWorkflow.status, shard=k))

    async def set_policy(
        self, deployment: str, policy: PoolPolicy | dict[str, Any] | None, *, timeout: float = 30.0
    ) -> PoolPolicy | None:
        """Set `deployment`'s policy (None removes it); the change is an update in the pool's history.

        A policy with `max_replicas` sizes the deployment; one without carries only its
        health, breaker and outlier settings. Bad values raise ValidationError naming the
        field, before anything is sent. In a sharded pool the policy goes to the shard that
        holds the deployment; a pool sharded by agent spreads every deployment over its
        shards, so each shard gets a policy that sizes nothing, and one that sizes is
        refused (AgentRosterError): each shard would size from its own part.
        """
        if not isinstance(deployment, str):
            raise ValueError(f"deployment: expected a deployment name, got {type(deployment).__name__}")
        request = SetPolicy(deployment=deployment, policy=None if policy is None else PoolPolicy.model_validate(policy))
        shard = self.layout.deployment_shard(deployment)
        if shard is None and request.policy is not None and request.policy.sizes:
            raise AgentRosterError(
                f"pool {self.pool} is sharded by agent ({self.layout.shards} shards): deployment {deployment} is spread over "
                "every shard, so no shard can size it; a policy here gives no max_replicas (sizing policies need a pool "
                "sharded by deployment, the default)"
            )
        if not self._pool_started:
            await self.ensure_pool()
        deadline = time.monotonic() + timeout
        shards = self.shards if shard is None else [shard]
        statuses: list[PoolStatus] = await asyncio.gather(
            *(self._pool_update(PoolWorkflow.set_policy, request, deadline, shard=k) for k in shards)
        )
        return statuses[0].policies.get(deployment)

    async def scale_up(self, deployment: str, add: int = 1, *, reason: str | None = None, timeout: float = 30.0) -> PoolStatus:
        """Ask for `add` more agents of `deployment` now: the `set_policy` update with `scale_up`,
        so the ask (and `reason`) is in the pool's history and the backend's scale follows it.

        Within the deployment's sizing policy (max_replicas) when it has one; raises
        AgentRosterError with the pool's reason when nothing can be added (at max_replicas,
        a deployment the pool never saw, a pool shutting down)."""
        request = SetPolicy(deployment=deployment, scale_up=add, reason=reason)
        shard = self.layout.deployment_shard(deployment)
        if shard is None:
            raise AgentRosterError(
                f"pool {self.pool} is sharded by agent: deployment {deployment} is spread over every shard, so no shard can scale it"
            )
        if not self._pool_started:
            await self.ensure_pool()
        try:
            status: PoolStatus = await self._pool_update(PoolWorkflow.set_policy, request, time.monotonic() + timeout, shard=shard)
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == SCALE_UP_REFUSED:
                raise AgentRosterError(cause.message) from None
            raise
        return status

    async def policies(self) -> dict[str, PoolPolicy]:
        """Every deployment's policy (those that size it give max_replicas)."""
        return (await self.status()).policies

    # --------------------------------------------------------------- shutdown
    async def shutdown(
        self,
        *,
        deadline_s: float = 60.0,
        wait: bool = True,
        reason: str = "shutdown requested",
        timeout: float | None = None,
    ) -> PoolStatus:
        """Shut this pool down, as the `shutdown` update in its history.

        At once: new acquires raise PoolShutdownError and callers waiting in the
        queue get it too. Leases in flight may run `deadline_s` more seconds
        (then they are revoked). Then every agent is drained (reason
        `pool-shutdown`), every deployment the pool knows is scaled to zero, and
        the pool workflow ends once every agent workflow has. With `wait`, returns
        the final status (`status.shutdown.phase == "done"`), waiting up to
        `timeout` seconds (None: as long as it takes); else the status once the
        shutdown began. Idempotent: a second call (even after the pool ended)
        returns the same; the first call's deadline stands. Bad arguments raise
        ValidationError before anything is sent.

        A shut-down pool stays down (agents that come back cannot start it again):
        `ensure_pool(restart=True)` starts it again. A sharded pool shuts every shard
        down at once; the status is added up over them.
        """
        request = ShutdownRequest(deadline_s=deadline_s, reason=reason)
        statuses = await self._each_shard(lambda k: self._shutdown_shard(k, request, wait, timeout))
        return merge_statuses(statuses)

    async def _shutdown_shard(self, shard: int, request: ShutdownRequest, wait: bool, timeout: float | None) -> PoolStatus:
        handle = self._pool_handle(shard=shard)
        workflow_id = pool_workflow_id(self.pool, shard)
        try:
            status: PoolStatus = await retry_until(
                lambda: handle.execute_update(PoolWorkflow.shutdown, request),
                time.monotonic() + 30.0,
                what=f"pool {self.pool} shutdown",
            )
        except RPCError as exc:
            if not is_not_found(exc):
                raise
            final = await self._final_status(shard)
            if final is None or final.shutdown is None:
                raise AgentRosterError(
                    f"pool {self.pool} is not running: no workflow {workflow_id} to shut down"
                ) from exc
            return final  # shut down already
        if not wait:
            return status
        result = self._client.get_workflow_handle(workflow_id, result_type=PoolStatus).result()
        try:
            final = await (asyncio.wait_for(result, timeout) if timeout is not None else result)
        except asyncio.TimeoutError as exc:
            raise AgentRosterError(f"pool {self.pool} did not finish shutting down within {timeout:g}s") from exc
        except WorkflowFailureError as exc:
            raise AgentRosterError(f"pool {self.pool}'s workflow ended without finishing its shutdown: {exc.cause}") from exc
        return final
    # ------------------------------------------------------- eviction safety
    async def evictions(self) -> EvictionStatus:
        """Eviction safety in this pool: self-preservation, silent (held) agents, counters."""
        return (await self.status()).eviction

    async def confirm_evictions(self, agent_ids: Sequence[str] | None = None, *, timeout: float = 30.0) -> EvictionStatus:
        """Confirm that silent agents are really gone (None: every silent agent): they are terminated,
        their pods deleted, as soon as they ask again (they are told to at once), self-preservation or not."""
        request = ConfirmEvictions(agents=None if agent_ids is None else list(agent_ids))
        if not self._pool_started:
            await self.ensure_pool()
        deadline = time.monotonic() + timeout
        return merge_evictions(
            await self._each_shard(lambda k: self._pool_update(PoolWorkflow.confirm_evictions, request, deadline, shard=k))
        )

    async def set_eviction_policy(
        self, policy: EvictionPolicy | dict[str, Any] | None = None, *, timeout: float = 30.0
    ) -> EvictionStatus:
        """Set this pool's eviction safety (None: the defaults): the `set_policy` update, in every shard's history."""
        request = SetPolicy(eviction=EvictionPolicy.model_validate(policy or {}))
        if not self._pool_started:
            await self.ensure_pool()
        deadline = time.monotonic() + timeout
        statuses: list[PoolStatus] = await self._each_shard(lambda k: self._pool_update(PoolWorkflow.set_policy, request, deadline, shard=k))
        return merge_evictions([status.eviction for status in statuses])

    async def ask_eviction(self, agent_id: str, window_s: float, *, timeout: float = 8.0, shard: int = 0) -> EvictionVerdict:
        """May the silent agent `agent_id` be terminated now? What an agent workflow asks its pool
        (through the `request_eviction` activity) when its heartbeat window passed; `shard`: its home shard."""
        ask = EvictionAsk(agent_id=agent_id, window_s=window_s)
        return await self._pool_update(PoolWorkflow.may_evict, ask, time.monotonic() + timeout, shard=shard)


__all__ = ["AgentRoster"]
