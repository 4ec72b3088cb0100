"""The liveness check of an agent registered from its Agent Card (`agentroster.client.a2a`).

Such an agent runs no code of ours and sends no heartbeat: its agent workflow runs
`check_a2a_agent` once per heartbeat interval, and an answer counts as a heartbeat.
The activity reads the card (`A2ACardResolver`) and returns None when it answers as an
Agent Card, else why not. It is tried once per interval (the next interval is the
retry), so a dead agent costs no retry storm; the card is waited for until 1 s before
the activity's own timeout.
"""

from __future__ import annotations

from temporalio import activity

from agentroster.client.a2a import card_answers
from agentroster.vocabulary.a2a import CHECK_A2A_AGENT


@activity.defn(name=CHECK_A2A_AGENT)
async def check_a2a_agent(card_url: str) -> str | None:
    """None when the card at `card_url` answers, else the reason it does not."""
    limit = activity.info().start_to_close_timeout
    timeout_s = max(0.5, limit.total_seconds() - 1.0) if limit else 10.0
    return await card_answers(card_url, timeout_s=timeout_s)


__all__ = ["check_a2a_agent"]
