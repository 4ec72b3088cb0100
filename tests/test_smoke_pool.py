from __future__ import annotations

import pytest

from agentroster import AgentState, PoolExhaustedError
from tests.conftest import make_registration


async def test_register_acquire_release(stack) -> None:
    roster = stack.roster
    status = await roster.register(make_registration("a1", [("rag.search", "2.1.0", 1, "B")]))
    assert status.state == AgentState.READY
    assert await roster.find("rag.search@>=2,<3") == ["a1"]
    lease = await roster.acquire("rag.search@>=2,<3", timeout=2)
    assert lease.agent_id == "a1"
    assert await roster.find("rag.search@>=2,<3") == []
    with pytest.raises(PoolExhaustedError) as err:
        await roster.acquire("rag.search@>=2,<3", timeout=0.3)
    assert "1 agent(s) match, 1 busy" in str(err.value)
    await roster.release(lease)
    async with roster.borrow("rag.search", timeout=2) as again:
        assert again.agent_id == "a1"
