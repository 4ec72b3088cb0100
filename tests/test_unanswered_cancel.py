"""A caller whose checkout timed out while the pool could not answer.

The cancellation of its place then cannot get through (no worker runs the pool's
workflow tasks). The caller still gets what its timeout promises, a
PoolExhaustedError, and the client keeps giving the place back in the background,
so when the pool answers again nobody waits in its name and no lease is left
granted to it.
"""

from __future__ import annotations

import asyncio
import pytest

from agentroster import PoolExhaustedError
from tests.conftest import eventually, make_registration

pytestmark = pytest.mark.slow


async def test_a_timeout_while_the_pool_is_unanswered_is_pool_exhausted_and_the_place_is_given_back(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("only-one", [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=600))
    holder = await roster.acquire("rag.search", lease_ttl_s=600)

    waiter = asyncio.create_task(roster.acquire("rag.search", timeout=1.0))
    await eventually(lambda: _waiting(roster, 1))
    await stack.stop_worker()  # the pool's workflow tasks now wait for a worker
    with pytest.raises(PoolExhaustedError) as caught:
        await waiter
    assert caught.value.pool == roster.pool and caught.value.ref == "rag.search"
    assert "no answer" in str(caught.value.__cause__) or "refusing" in str(caught.value.__cause__)
    assert roster._abandoning, "the place is still being given back"

    await stack.start_worker()
    await eventually(lambda: not roster._abandoning, timeout=60)
    status = await roster.status()
    assert status.waiting == 0 and status.active_leases == 1, status
    await roster.release(holder)
    final = await eventually(lambda: _settled(roster), timeout=30)
    assert final.leases_granted == final.leases_released == 1, final


async def _waiting(roster, n):
    return (await roster.status()).waiting == n


async def _settled(roster):
    status = await roster.status()
    return status if status.active_leases == 0 and status.waiting == 0 else None
