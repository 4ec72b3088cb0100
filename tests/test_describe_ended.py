"""`describe` of an agent whose workflow has ended reads the run's stored result.

A query on a closed run needs a worker to replay its whole history: slow on a busy
worker, and no answer at all while none runs. The result needs neither.
"""

from __future__ import annotations

import asyncio

from agentroster import AgentState
from tests.conftest import eventually, make_registration


async def test_describe_an_ended_agent_with_no_worker_running(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("ends-soon", heartbeat_interval_s=600))
    await roster.drain("ends-soon", reason="test")

    async def ended():
        return (await roster.describe("ends-soon")).state == AgentState.TERMINATED

    await eventually(ended, timeout=20)
    await stack.stop_worker()
    described = await asyncio.wait_for(roster.describe("ends-soon"), 10)
    assert described.state == AgentState.TERMINATED and described.terminated_reason == "drain"
    assert described.in_flight == 0
    assert [t.to_state for t in described.transitions][-1] == AgentState.TERMINATED
