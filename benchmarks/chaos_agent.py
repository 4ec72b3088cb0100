"""The reliability harness's agent: a real agent runtime serving `chaos.hold@1.0.0`.

A task holds its slot for `hold_s` seconds and answers how many tasks this agent
was running at once, counted inside the handler. The runtime answers 429 past the
capability's `max_concurrency` (CHAOS_SLOTS), so a holder that gets 429 while it
holds a lease has met a double lease from the agent's own point of view.

    AGENT_ID=a1 AGENTROSTER_POOL=chaos CHAOS_SLOTS=2 python -m benchmarks.chaos_agent
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from agentroster.agent.runtime import AgentRuntime, run_agent

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"hold_s": {"type": "number", "minimum": 0, "maximum": 30}},
    "required": ["hold_s"],
}
OUTPUT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"running": {"type": "integer"}}, "required": ["running"]}


def build_agent() -> AgentRuntime:
    slots = int(os.environ.get("CHAOS_SLOTS", "2"))
    agent = AgentRuntime.from_env(deployment="chaos-agent")
    running = 0
    peak = 0

    @agent.capability("chaos.hold", "1.0.0", input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA, max_concurrency=slots, cost_class="A")
    async def hold(payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(float(payload["hold_s"]))
            return {"running": running, "peak": peak}
        finally:
            running -= 1

    return agent


if __name__ == "__main__":
    run_agent(build_agent())
