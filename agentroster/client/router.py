"""Router: task types to isolated pools, by a routing table that is data.

    table = load_routing_table("routes.toml")          # or RoutingTable(routes={...})
    router = Router(client, table, task_queue="agentroster")
    async with router.borrow("summarize", timeout=5.0) as lease:   # a lease in the route's pool
        ...
    pool, ref = router.route("translate")               # where a task type goes, no network

A routing table file is TOML (like the fleet file) or JSON (by its `.json`
suffix), one entry per task type:

    [routes.summarize]
    pool = "prod"
    ref = "text.summarize@^2.1"

    [routes.translate]
    pool = "staging"
    ref = "text.translate@~1.4"

Every pool gets its own `AgentRoster`, made on first use, so pools stay
isolated: a route's leases come only from its own pool's agents. An unknown
task type raises `UnknownTaskTypeError` at once, before any network call.

Inside a workflow there is no Router (no client, no files): give
`CapabilityTaskWorkflow` a `TaskInput(task_type=..., routing_table=table)` and
it resolves the type from the table in its input (see `Router.task_input`).
"""

from __future__ import annotations

import asyncio
import json
import tomllib
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from temporalio.client import Client

from agentroster.client.roster import DEFAULT_BORROW_TTL_S, AgentRoster
from agentroster.client.settings import Settings
from agentroster.errors import AgentRosterError, UnknownTaskTypeError
from agentroster.models import Lease, PoolStatus, RoutingTable, TaskInput, TaskRoute

__all__ = [
    "Router",
    "RoutingTable",
    "RoutingTableError",
    "TaskRoute",
    "UnknownTaskTypeError",
    "load_routing_table",
    "parse_routing_table",
]


class RoutingTableError(AgentRosterError, ValueError):
    """A routing table that cannot be read or does not validate; the message names the field."""


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as `routes.summarize.pool` (a bad key: `routes.<key> (the task type)`)."""
    parts = [str(p) for p in loc]
    if parts and parts[-1] == "[key]":
        return ".".join(parts[:-1]) + " (the task type)"
    return ".".join(parts) or "routing table"


def describe_errors(error: ValidationError) -> str:
    """Pydantic errors as `routes.summarize.pool: message` phrases, joined by '; '."""
    return "; ".join(f"{_where(tuple(e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in error.errors())


def parse_routing_table(data: RoutingTable | Mapping[str, Any], *, source: str = "routing table") -> RoutingTable:
    """Validate a table given as data (`{"routes": {...}}`); raises RoutingTableError naming the field."""
    if isinstance(data, RoutingTable):
        return data
    if not isinstance(data, Mapping):
        raise RoutingTableError(f"{source}: expected a mapping with a `routes` table, got {type(data).__name__}")
    unknown = sorted(set(data) - {"routes"})
    if unknown:
        raise RoutingTableError(f"{source}: unknown top-level key(s) {unknown}; expected only `routes`")
    if "routes" not in data:
        raise RoutingTableError(f"{source}: routes: missing; add one [routes.<task type>] table with `pool` and `ref` per task type")
    try:
        return RoutingTable.model_validate(dict(data))
    except ValidationError as exc:
        raise RoutingTableError(f"{source}: {describe_errors(exc)}") from exc


def load_routing_table(path: str | Path) -> RoutingTable:
    """Read and validate a routing table file: TOML, or JSON when it ends in `.json`.

    Raises RoutingTableError naming the file and the field.
    """
    path = Path(path)
    source = f"routing table {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RoutingTableError(f"{source}: cannot read it: {exc}") from exc
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RoutingTableError(f"{source}: not valid JSON: {exc}") from exc
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RoutingTableError(f"{source}: not valid TOML: {exc}") from exc
    return parse_routing_table(data, source=source)


class Router:
    """Several isolated pools behind one routing table: borrow and acquire by task type.

    `table` is a RoutingTable, its data as a mapping, or the path of a table file.
    One AgentRoster per pool is made on first use (no network before), on
    `task_queue`; pass ready-made ones in `rosters` (pool -> roster) for pools
    whose workers listen on another queue.
    """

    def __init__(
        self,
        client: Client,
        table: RoutingTable | Mapping[str, Any] | str | Path,
        *,
        task_queue: str = "agentroster",
        rosters: Mapping[str, AgentRoster] | None = None,
    ) -> None:
        self._client = client
        self.table = load_routing_table(table) if isinstance(table, (str, Path)) else parse_routing_table(table)
        self.task_queue = task_queue
        self._rosters: dict[str, AgentRoster] = {}
        for pool, roster in (rosters or {}).items():
            if roster.pool != pool:
                raise ValueError(f"rosters[{pool!r}] is the roster of pool {roster.pool!r}")
            self._rosters[pool] = roster

    @classmethod
    async def connect(
        cls,
        table: RoutingTable | Mapping[str, Any] | str | Path,
        target_host: str | None = None,
        *,
        namespace: str | None = None,
        task_queue: str | None = None,
        **connect_options: Any,
    ) -> Router:
        """Connect like `AgentRoster.connect` (unset settings from the environment); no pool is touched yet."""
        table = load_routing_table(table) if isinstance(table, (str, Path)) else parse_routing_table(table)
        roster = await AgentRoster.connect(target_host, namespace=namespace, task_queue=task_queue, ensure_pool=False, **connect_options)
        return cls(roster.client, table, task_queue=roster.task_queue)

    @property
    def client(self) -> Client:
        return self._client

    @property
    def task_types(self) -> list[str]:
        """The task types the table routes, sorted."""
        return self.table.task_types

    def route(self, task_type: str) -> tuple[str, str]:
        """`(pool, capability ref)` for `task_type`; raises UnknownTaskTypeError at once."""
        route = self.table.resolve(task_type)
        return route.pool, route.ref

    def roster(self, pool: str) -> AgentRoster:
        """The AgentRoster of `pool` (made on first use)."""
        roster = self._rosters.get(pool)
        if roster is None:
            shards = Settings.from_env().shards_for(pool)  # AGENTROSTER_POOL_SHARDS: this pool's layout
            roster = self._rosters[pool] = AgentRoster(self._client, pool=pool, task_queue=self.task_queue, shards=shards)
        return roster

    def roster_for(self, task_type: str) -> AgentRoster:
        """The AgentRoster of the pool `task_type` goes to; raises UnknownTaskTypeError at once."""
        return self.roster(self.table.resolve(task_type).pool)

    # ------------------------------------------------------------------ leases
    async def acquire(self, task_type: str, timeout: float = 5.0, **options: Any) -> Lease:
        """A lease for `task_type`'s ref in its pool: `AgentRoster.acquire` there (same options and errors)."""
        route = self.table.resolve(task_type)
        return await self.roster(route.pool).acquire(route.ref, timeout, **options)

    def borrow(
        self, task_type: str, timeout: float = 5.0, *, lease_ttl_s: float = DEFAULT_BORROW_TTL_S, **options: Any
    ) -> AbstractAsyncContextManager[Lease]:
        """`async with router.borrow("summarize") as lease:` as `AgentRoster.borrow`, in the route's pool.

        An unknown task type raises here, when called, not when the block is entered.
        """
        route = self.table.resolve(task_type)
        return self.roster(route.pool).borrow(route.ref, timeout, lease_ttl_s=lease_ttl_s, **options)

    async def find(self, task_type: str) -> list[str]:
        """Routable agent ids for `task_type` in its pool, best first."""
        route = self.table.resolve(task_type)
        return await self.roster(route.pool).find(route.ref)

    async def release(self, lease: Lease) -> None:
        """Return a lease's slot in its own pool."""
        await self.roster(lease.pool).release(lease)

    async def renew(self, lease: Lease, ttl_s: float | None = None) -> Lease:
        """Move a lease's deadline (see `AgentRoster.renew`)."""
        return await self.roster(lease.pool).renew(lease, ttl_s)

    def lease_headers(self, lease: Lease, key: Any = None) -> dict[str, str]:
        """The lease token header for a POST to `lease.endpoint` (see `AgentRoster.lease_headers`)."""
        return self.roster(lease.pool).lease_headers(lease, key)

    async def status(self) -> dict[str, PoolStatus]:
        """Every routed pool's status, by pool name."""
        pools = self.table.pools
        statuses = await asyncio.gather(*(self.roster(pool).status() for pool in pools))
        return dict(zip(pools, statuses))

    # ------------------------------------------------------------------ workflows
    def task_input(self, task_type: str, payload: Any = None, **options: Any) -> TaskInput:
        """A `CapabilityTaskWorkflow` input for `task_type`, carrying its route (unknown types raise at once)."""
        return TaskInput(task_type=task_type, routing_table=self.table.only(task_type), payload=payload, **options)


def format_routing_table(table: RoutingTable) -> str:
    """The table as aligned columns: task type, pool, capability ref."""
    rows = [("TASK TYPE", "POOL", "CAPABILITY REF")] + [
        (task_type, table.routes[task_type].pool, table.routes[task_type].ref) for task_type in table.task_types
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)
