"""`transport.TicketWatcher`: one ticket poll that never answers does not hold the client's waiters.

Seen in the reliability harness (server kill -9 row): four waiters of one client stayed in
`acquire` 12-20 s past the end of the load while the pool granted others; their client's
single poll loop was stuck in a query sent as the server died.
"""

from __future__ import annotations

import asyncio
import time

from agentroster.contracts import TicketStatus
from agentroster.transport import TicketWatcher


async def test_a_poll_that_hangs_is_given_up_and_the_next_one_serves_the_waiter() -> None:
    calls = 0
    never = asyncio.Event()

    async def query(tickets: list[str]) -> list[TicketStatus]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await never.wait()  # the poll that was in flight when the server died
        return [TicketStatus(ticket=t, pending=False) for t in tickets]

    watcher = TicketWatcher(query, interval_s=0.01, timeout_s=0.2)
    # None would mean the deadline passed with the first poll still hanging.
    status = await watcher.wait("t-1", time.monotonic() + 30.0)
    assert status is not None and status.ticket == "t-1" and not status.pending
    assert calls >= 2


async def test_a_waiter_whose_deadline_passes_gets_none() -> None:
    async def query(tickets: list[str]) -> list[TicketStatus]:
        return [TicketStatus(ticket=t, pending=True) for t in tickets]

    watcher = TicketWatcher(query, interval_s=0.01, timeout_s=0.2)
    assert await watcher.wait("t-1", time.monotonic() + 0.1) is None
