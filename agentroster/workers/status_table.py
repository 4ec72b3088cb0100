"""The status table and shutdown summary shared by `agentroster status`, `shutdown` and `dev`."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from agentroster.client import AgentRoster
from agentroster.contracts import POOL_SHUTDOWN_REASON, AgentNotFoundError, PoolAgentRow, PoolStatus


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


def format_shutdown(status: PoolStatus) -> str:
    """What a pool's shutdown did (or is doing), for people."""
    s = status.shutdown
    if s is None:
        return f"pool {status.pool}: no shutdown asked for"
    if s.phase != "done":
        return (
            f"pool {status.pool}: shutting down ({s.reason}), {s.phase}: {s.waiters_ended} waiter(s) told; "
            f"{status.active_leases} lease(s) in flight may run until {s.deadline:%Y-%m-%d %H:%M:%S} UTC, then are revoked; "
            f"{len(status.agents)} agent(s) to drain, {s.agents_left} draining"
        )
    took = (s.finished_at - s.requested_at).total_seconds() if s.finished_at else 0.0
    finished = s.leases_at_start - s.leases_revoked
    lines = [
        f"pool {status.pool} shut down ({s.reason}) in {took:.1f}s; its workflow has ended and no agent workflow is left",
        f"  waiters told: {s.waiters_ended}",
        f"  leases in flight: {s.leases_at_start} ({finished} finished, {s.leases_revoked} revoked at the deadline)",
        f"  agents drained ({POOL_SHUTDOWN_REASON}): {s.agents_drained}",
        f"  deployments scaled to 0: {', '.join(s.deployments_scaled) or 'none'}",
    ]
    lines += [f"  could not scale {d} to 0: {why}" for d, why in sorted(s.scale_failures.items())]
    return "\n".join(lines)
