"""`transport.TicketWatcher`: one ticket poll that never answers does not hold the client's waiters.

Seen in the reliability harness (server kill -9 row): four waiters of one client stayed in
`acquire` 12-20 s past the end of the load while the pool granted others; their client's
single poll loop was stuck in a query sent as the server died.
"""

from __future__ import annotations

import asyncio
import time

from agentroster.models import TicketStatus
from agentroster.client.transport import TicketWatcher


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


async def test_a_slow_poll_gets_a_hedge_beside_it_and_the_first_answer_serves() -> None:
    # After a worker kill -9, a query held for the dead worker (or behind a workflow task the
    # new worker never got) is answered only by its own timeout; one sent a moment later is
    # answered at once. The first poll here never answers and its timeout (60 s) is past the
    # waiter's deadline (20 s): only a second poll beside it can serve the waiter.
    calls, cancelled = 0, 0
    never = asyncio.Event()

    async def query(tickets: list[str]) -> list[TicketStatus]:
        nonlocal calls, cancelled
        calls += 1
        if calls == 1:
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled += 1
                raise
        return [TicketStatus(ticket=t, pending=False) for t in tickets]

    watcher = TicketWatcher(query, interval_s=0.01, timeout_s=60.0, hedge_s=0.05)
    status = await watcher.wait("t-1", time.monotonic() + 20.0)
    assert status is not None and status.ticket == "t-1" and not status.pending
    assert calls == 2 and watcher.polls_sent == 2
    await asyncio.sleep(0)  # the hung poll is given up once the hedge answered
    assert cancelled == 1


async def test_hedges_stop_at_max_polls_and_a_failed_one_does_not_end_the_others() -> None:
    calls = 0
    release = asyncio.Event()

    async def query(tickets: list[str]) -> list[TicketStatus]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("refused")  # e.g. a partial workflow task the worker refused
        await release.wait()
        return [TicketStatus(ticket=t, pending=False) for t in tickets]

    watcher = TicketWatcher(query, interval_s=0.01, timeout_s=60.0, hedge_s=0.01, max_polls=3, give_up_s=60.0)
    waiter = asyncio.create_task(watcher.wait("t-1", time.monotonic() + 20.0))
    for _ in range(200):
        await asyncio.sleep(0.01)
    # Poll 1 hangs, poll 2 failed, polls 3 and 4 hang: 3 in flight, no more.
    assert calls == 4 and not waiter.done()
    release.set()
    status = await waiter
    assert status is not None and not status.pending


async def test_when_polls_are_full_the_oldest_is_given_up_for_a_fresh_one() -> None:
    # Polls sent while the pool's worker was dead stay unanswered (here: for ever); once it is
    # back, only a poll sent after that answers. With the cap full of doomed polls, the oldest
    # is given up after give_up_s and a fresh one goes out.
    back = asyncio.Event()
    calls, cancelled = 0, 0

    async def query(tickets: list[str]) -> list[TicketStatus]:
        nonlocal calls, cancelled
        calls += 1
        if not back.is_set():
            try:
                await asyncio.Event().wait()  # sent during the outage: never answered
            except asyncio.CancelledError:
                cancelled += 1
                raise
        return [TicketStatus(ticket=t, pending=False) for t in tickets]

    watcher = TicketWatcher(query, interval_s=0.01, timeout_s=60.0, hedge_s=0.01, max_polls=2, give_up_s=0.05)
    waiter = asyncio.create_task(watcher.wait("t-1", time.monotonic() + 20.0))
    while calls < 4:  # the outage lasts a few polls
        await asyncio.sleep(0.01)
    back.set()
    status = await waiter
    assert status is not None and not status.pending
    assert cancelled >= 2  # the doomed ones were given up, not waited out (their timeout is 60 s)


async def test_polls_that_serve_nothing_stretch_the_gap_and_a_grant_or_a_new_waiter_shrinks_it() -> None:
    # Each poll is a billed query and an activation on the pool's worker: a waiter queued
    # behind long tasks must not cost ~30 a second.
    polls: list[tuple[float, bool]] = []  # (the gap before this poll, whether it served a ticket)
    served: set[str] = set()

    async def query(tickets: list[str]) -> list[TicketStatus]:
        answers = [TicketStatus(ticket=t, pending=t not in served) for t in tickets]
        polls.append((watcher.gap_s, any(not a.pending for a in answers)))
        return answers

    async def until(count: int) -> None:
        while len(polls) < count:
            await asyncio.sleep(0.001)

    watcher = TicketWatcher(query, interval_s=0.001, max_interval_s=0.004, timeout_s=5.0)
    first = asyncio.create_task(watcher.wait("t-1", time.monotonic() + 20.0))
    await until(8)
    gaps = [gap for gap, _ in polls]
    assert gaps[0] == 0.001 and gaps[-1] == 0.004  # stretched by half per empty poll, capped
    assert all(a <= b for a, b in zip(gaps, gaps[1:]))
    before = len(polls)
    second = asyncio.create_task(watcher.wait("t-2", time.monotonic() + 20.0))
    await until(before + 2)
    # A new waiter brings the gap back (a poll in flight then may stretch it once).
    assert min(gap for gap, _ in polls[before : before + 2]) <= 0.0015
    served.add("t-1")
    assert (await first) is not None
    await until(len(polls) + 2)
    after = [i for i, (_, did_serve) in enumerate(polls) if did_serve][0] + 1
    assert polls[after][0] == 0.001  # the poll after a grant comes at the shortest gap
    served.add("t-2")
    assert (await second) is not None


async def test_no_poll_goes_out_once_every_waiter_has_given_up() -> None:
    # The pool's worker is down for longer than the waiters wait: the watcher stops with
    # them instead of hedging unanswered polls for ever.
    calls = 0

    async def query(tickets: list[str]) -> list[TicketStatus]:
        nonlocal calls
        calls += 1
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    watcher = TicketWatcher(query, interval_s=0.01, timeout_s=60.0, hedge_s=0.01, max_polls=2, give_up_s=0.03)
    assert await watcher.wait("t-1", time.monotonic() + 0.2) is None
    assert watcher._task is not None
    await asyncio.wait_for(watcher._task, timeout=10.0)  # the loop ended with its last waiter
    sent = calls
    await asyncio.sleep(0.1)
    assert calls == sent


async def test_a_poll_that_fails_at_once_beside_a_held_one_is_not_replaced_in_a_tight_loop() -> None:
    # One poll is held; every other one is refused at once (e.g. a worker restarting): the
    # refused ones are replaced a hedge apart, not as fast as they fail.
    calls = 0

    async def query(tickets: list[str]) -> list[TicketStatus]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.Event().wait()
        raise RuntimeError("refused")

    watcher = TicketWatcher(query, interval_s=0.01, timeout_s=60.0, hedge_s=0.05, give_up_s=60.0)
    assert await watcher.wait("t-1", time.monotonic() + 0.5) is None
    assert calls <= 20  # ~10 at one per hedge in 0.5 s; a tight loop would send thousands
