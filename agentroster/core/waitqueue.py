"""The pool's wait queue: callers waiting for a capability, FIFO per capability name.

Indexed by name (a freed slot only helps waiters on its own name) with a heap
of expiries, so no message ever scans every waiter.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Waiter:
    """One queued caller: what it asked for and until when it waits."""

    ticket: str
    ref: str
    enqueued_at: float
    expires_at: float
    lease_ttl_s: float
    holder: str | None
    holder_is_workflow: bool
    exclude: tuple[str, ...]
    request_id: str | None = None
    max_cost: str | None = None  # the caller's cost cap (`AcquireRequest.max_cost_class`)

    @property
    def name(self) -> str:
        """The capability name waited on."""
        return self.ref.partition("@")[0]

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Waiter:
        return cls(**{**row, "exclude": tuple(row["exclude"])})


class WaitQueue:
    """Waiters by ticket, in arrival order, also grouped by capability name."""

    def __init__(self) -> None:
        self._all: OrderedDict[str, Waiter] = OrderedDict()
        self._by_name: dict[str, OrderedDict[str, Waiter]] = {}
        self._expiries: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, ticket: str) -> bool:
        return ticket in self._all

    def __iter__(self) -> Iterator[str]:
        """Tickets in arrival order (as a dict of waiters would)."""
        return iter(list(self._all))

    def values(self) -> list[Waiter]:
        return list(self._all.values())

    def items(self) -> list[tuple[str, Waiter]]:
        return list(self._all.items())

    def get(self, ticket: str) -> Waiter | None:
        return self._all.get(ticket)

    def waits_on(self, name: str) -> bool:
        """Whether anyone is queued for capability `name`: O(1)."""
        return name in self._by_name

    def names(self) -> list[str]:
        return list(self._by_name)

    def count(self, name: str) -> int:
        """How many callers wait on `name`: O(1)."""
        return len(self._by_name.get(name, ()))

    def line(self, name: str) -> list[str]:
        """Tickets waiting on `name`, oldest first (a copy: safe to change the queue while iterating)."""
        return list(self._by_name.get(name, ()))

    def push(self, waiter: Waiter) -> None:
        self._all[waiter.ticket] = waiter
        self._by_name.setdefault(waiter.name, OrderedDict())[waiter.ticket] = waiter
        heapq.heappush(self._expiries, (waiter.expires_at, waiter.ticket))

    def remove(self, ticket: str) -> Waiter | None:
        waiter = self._all.pop(ticket, None)
        if waiter is not None:
            line = self._by_name[waiter.name]
            del line[ticket]
            if not line:
                del self._by_name[waiter.name]
        return waiter

    def expired(self, now: float) -> list[str]:
        """Pop the tickets whose wait ended by `now` (some may have been served or cancelled since)."""
        out: list[str] = []
        while self._expiries and self._expiries[0][0] <= now:
            out.append(heapq.heappop(self._expiries)[1])
        return out

    def next_expiry(self) -> float | None:
        while self._expiries and self._expiries[0][1] not in self._all:
            heapq.heappop(self._expiries)  # served or cancelled earlier
        return self._expiries[0][0] if self._expiries else None
