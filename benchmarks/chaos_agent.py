"""The reliability harness's agent: a real agent runtime serving `chaos.hold@1.0.0`.

A task holds its slot for `hold_s` seconds and answers how many tasks this agent
was running at once, counted inside the handler. The runtime answers 429 past the
capability's `max_concurrency` (CHAOS_SLOTS), so a holder that gets 429 while it
holds a lease has met a double lease from the agent's own point of view.

The outlier scenario turns one agent bad while it runs: with CHAOS_MODE_FILE set,
each task reads the file's first word and behaves accordingly,

- `ok` (or no file): as above;
- `fail`: raises at once, so the runtime answers HTTP 500 (a model provider's error);
- `hang`: accepts the task and answers nothing while the mode stays `hang` (at most
  HANG_MAX_S), as an agent whose model call sticks;

and with CHAOS_CALLS_FILE set, appends one line per task it starts: its wall time and
the mode it served it in (what reached the agent, counted by the agent itself).

    AGENT_ID=a1 AGENTROSTER_POOL=chaos CHAOS_SLOTS=2 python -m benchmarks.chaos_agent
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from agentroster.agent.runtime import AgentRuntime, run_agent

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"hold_s": {"type": "number", "minimum": 0, "maximum": 30}},
    "required": ["hold_s"],
}
OUTPUT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"running": {"type": "integer"}}, "required": ["running"]}
HANG_MAX_S = 60.0  # a hung task's slot comes back at the latest then (the harness turns the mode back long before)
MODES = ("ok", "fail", "hang")


def read_mode(path: Path | None) -> str:
    """The mode the file names (`ok` without a file, or with one that names none of MODES)."""
    if path is None:
        return "ok"
    try:
        words = path.read_text().split()
    except OSError:
        return "ok"
    return words[0] if words and words[0] in MODES else "ok"


def build_agent() -> AgentRuntime:
    slots = int(os.environ.get("CHAOS_SLOTS", "2"))
    mode_file = Path(os.environ["CHAOS_MODE_FILE"]) if os.environ.get("CHAOS_MODE_FILE") else None
    calls_file = Path(os.environ["CHAOS_CALLS_FILE"]) if os.environ.get("CHAOS_CALLS_FILE") else None
    agent = AgentRuntime.from_env(deployment="chaos-agent")
    running = 0
    peak = 0

    @agent.capability("chaos.hold", "1.0.0", input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA, max_concurrency=slots, cost_class="A")
    async def hold(payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal running, peak
        mode = read_mode(mode_file)
        if calls_file is not None:
            with open(calls_file, "a") as calls:
                calls.write(f"{time.time():.6f} {mode}\n")
        if mode == "fail":
            raise RuntimeError("the model provider answered 500")
        running += 1
        peak = max(peak, running)
        try:
            if mode == "hang":
                ends = time.monotonic() + HANG_MAX_S
                while read_mode(mode_file) == "hang" and time.monotonic() < ends:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(float(payload["hold_s"]))
            return {"running": running, "peak": peak}
        finally:
            running -= 1

    return agent


if __name__ == "__main__":
    run_agent(build_agent())
