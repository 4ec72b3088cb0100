"""The status table and shutdown summary shared by `agentroster status`, `shutdown` and `dev`."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from agentroster.client.roster import AgentRoster
from agentroster.ops.timeline import ago
from agentroster.errors import AgentNotFoundError
from agentroster.models import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    MISSED_HEARTBEATS,
    POOL_SHUTDOWN_REASON,
    ROUTABLE_STATES,
    AgentState,
    AgentStatus,
    PoolAgentRow,
    PoolStatus,
)


HEADER = ["AGENT", "DEPLOYMENT", "CAPABILITIES", "STATE", "IN-FLIGHT", "LAST HEARTBEAT", "NOTE"]
# Agents that left the pool stay in the table this long (the pool keeps the last 50).
ENDED_SHOWN_S = 3600.0
# A routable agent whose last heartbeat is older than this many intervals is shown as silent
# (its workflow declares it lost after MISSED_HEARTBEATS intervals).
SILENT_AFTER_INTERVALS = 1.5


def format_status_table(rows: list[list[str]]) -> str:
    table = [HEADER, *(r + [""] * (len(HEADER) - len(r)) for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table)


def live_row(agent: PoolAgentRow, described: AgentStatus | None, now: datetime) -> list[str]:
    """A row for an agent in the pool's index, corrected by its own workflow's word.

    The pool hears of a death only when the agent workflow declares it (after
    MISSED_HEARTBEATS intervals of silence): until then the pool says Ready. The
    agent workflow's last heartbeat says more: a silent agent is shown as such,
    and one its workflow already ended shows Terminated.
    """
    state = agent.state.value
    beat = described.last_heartbeat if described else None
    age = (now - beat).total_seconds() if beat else None
    notes: list[str] = []
    if described is not None and described.state == AgentState.TERMINATED:
        state = AgentState.TERMINATED.value
        notes.append(f"ended: {described.terminated_reason or 'terminated'} (the pool is being told)")
    elif described is not None and described.state in ROUTABLE_STATES and age is not None:
        interval = described.registration.heartbeat_interval_s if described.registration else DEFAULT_HEARTBEAT_INTERVAL_S
        if age > SILENT_AFTER_INTERVALS * interval:
            state = f"silent {age:.0f}s"
            notes.append(f"{agent.state.value} in the pool; declared lost after {MISSED_HEARTBEATS * interval:g}s without a heartbeat")
    drain_reason = agent.drain_reason or (_drain_reason(described) if agent.state == AgentState.DRAINING else None)
    if drain_reason:
        notes.append(f"draining: {drain_reason}")
    if agent.retiring and agent.retiring != drain_reason:
        notes.append(f"retiring: {agent.retiring}")
    if agent.health_failures:
        notes.append(f"{agent.health_failures} failed health check(s)")
    if agent.silent:
        notes.append("silent: its termination is held back by eviction safety")
    return [
        agent.agent_id,
        agent.deployment,
        ",".join(agent.capabilities),
        state,
        str(agent.in_flight),
        f"{age:.1f}s ago" if age is not None else "-",
        "; ".join(notes),
    ]


def _drain_reason(described: AgentStatus | None) -> str | None:
    if described is None:
        return None
    steps = [t for t in described.transitions if t.to_state == AgentState.DRAINING]
    return steps[-1].reason if steps else None


def ended_rows(pool: PoolStatus, now: datetime, within_s: float = ENDED_SHOWN_S) -> list[list[str]]:
    """Agents that left the pool in the last `within_s` seconds, newest first (not those back since)."""
    live = {a.agent_id for a in pool.agents}
    rows = []
    for ended in reversed(pool.recently_ended):
        since = (now - ended.ended_at).total_seconds()
        if ended.agent_id in live or since > within_s:
            continue
        why = ended.reason + (f" ({ended.drain_reason})" if ended.drain_reason and ended.drain_reason != ended.reason else "")
        rows.append(
            [ended.agent_id, ended.deployment, ",".join(ended.capabilities), AgentState.TERMINATED.value, "-", "-", f"ended {ago(since)} ago: {why}"]
        )
    return rows


async def status_rows(roster: AgentRoster, *, ended_within_s: float = ENDED_SHOWN_S, pool: PoolStatus | None = None) -> list[list[str]]:
    """One row per agent in the pool (state and heartbeat from its own workflow), then those that recently ended."""
    pool = pool or await roster.status()
    now = datetime.now(timezone.utc)

    async def row(agent: PoolAgentRow) -> list[str]:
        try:
            described: AgentStatus | None = await roster.describe(agent.agent_id)
        except AgentNotFoundError:
            described = None
        return live_row(agent, described, now)

    live = list(await asyncio.gather(*(row(a) for a in pool.agents)))
    return live + ended_rows(pool, now, ended_within_s)


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
