"""The status table shared by `agentroster status` and `agentroster dev`."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from agentroster.client import AgentRoster
from agentroster.contracts import AgentNotFoundError, PoolAgentRow


def format_status_table(rows: list[list[str]]) -> str:
    header = ["AGENT", "DEPLOYMENT", "CAPABILITIES", "STATE", "IN-FLIGHT", "LAST HEARTBEAT"]
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table)


async def status_rows(roster: AgentRoster) -> list[list[str]]:
    """One row per agent in the pool, with its last heartbeat from its own workflow."""
    pool = await roster.status()
    now = datetime.now(timezone.utc)

    async def row(agent: PoolAgentRow) -> list[str]:
        try:
            described = await roster.describe(agent.agent_id)
            beat = described.last_heartbeat
            ago = f"{(now - beat).total_seconds():.1f}s ago" if beat else "-"
        except AgentNotFoundError:
            ago = "-"
        return [
            agent.agent_id,
            agent.deployment,
            ",".join(agent.capabilities),
            agent.state.value + (" (silent)" if agent.silent else ""),
            str(agent.in_flight),
            ago,
        ]

    return list(await asyncio.gather(*(row(a) for a in pool.agents)))
