"""The liveness check of an agent registered from its Agent Card (`agentroster.a2a_agents`).

Such an agent runs no code of ours and sends no heartbeat: its agent workflow runs
`check_a2a_agent` once per heartbeat interval, and an answer counts as a heartbeat.
The activity reads the card (`A2ACardResolver`) and returns None when it answers as an
Agent Card, else why not; it is tried once per interval (the next interval is the
retry), so a dead agent costs no retry storm.
"""

from __future__ import annotations

from temporalio import activity

from agentroster.a2a_agents import CHECK_A2A_AGENT, A2ACheck, card_answers


@activity.defn(name=CHECK_A2A_AGENT)
async def check_a2a_agent(check: A2ACheck) -> str | None:
    """None when the card at `check.card_url` answers, else the reason it does not."""
    return await card_answers(check.card_url, timeout_s=check.timeout_s)


__all__ = ["check_a2a_agent"]
