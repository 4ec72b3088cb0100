"""`agentroster a2a add CARD_URL`: an A2A agent joins a pool by its Agent Card.

The card is read with the a2a-sdk client and the agent registered with one capability
per skill (`agentroster.client.a2a.add_a2a_agent`); its agent workflow then checks it
by reading the card every heartbeat interval. Prints what it registered and exits 0; a
card that cannot be fetched, is not an Agent Card or does not fit a registration exits
2 naming the card field at fault.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from agentroster.models import DEFAULT_HEARTBEAT_INTERVAL_S


def add_a2a_parser(sub: Any, common: Callable[[argparse.ArgumentParser, Any], None], settings: Any) -> None:
    a2a = sub.add_parser("a2a", help="A2A agents: join a pool by their Agent Card")
    a2a_sub = a2a.add_subparsers(dest="a2a_command", required=True)
    add = a2a_sub.add_parser("add", help="fetch an Agent Card and register its agent (one capability per skill)")
    common(add, settings)
    add.add_argument("card_url", help="the agent's base URL, or its card's URL (…/.well-known/agent-card.json)")
    add.add_argument("--deployment", default=None, help="deployment name (default: from the card's name)")
    add.add_argument("--agent-id", default=None, help="agent id (default: the card's name and host)")
    add.add_argument("--max-concurrency", type=int, default=1, help="tasks the agent runs at once (cards do not say)")
    add.add_argument("--cost-class", choices=["A", "B", "C"], default="B", help="A cheap < B < C expensive")
    add.add_argument(
        "--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL_S, metavar="SECONDS",
        help="how often its workflow reads the card; 3 intervals without an answer end it (a2a_unreachable)",
    )


async def run_a2a(args: argparse.Namespace, connect: Callable[[argparse.Namespace], Any]) -> int:
    from pydantic import ValidationError

    from agentroster.client.a2a import A2ACardError, fetch_card, registration_from_card

    try:
        card = await fetch_card(args.card_url)
        reg = registration_from_card(
            card, args.card_url, deployment=args.deployment, agent_id=args.agent_id, max_concurrency=args.max_concurrency,
            cost_class=args.cost_class, heartbeat_interval_s=args.heartbeat_interval,
        )
    except (A2ACardError, ValidationError) as exc:
        print(f"agentroster a2a add: refused: {exc}", file=sys.stderr)
        return 2
    roster = await connect(args)
    status = await roster.register(reg)
    print(f"registered A2A agent {reg.agent_id} (deployment {reg.deployment}) in pool {args.pool}: {status.state.value}")
    print(f"  endpoint {reg.endpoint} (JSON-RPC), card {reg.metadata['card_url']}, checked every {reg.heartbeat_interval_s:g}s")
    for cap in reg.capabilities:
        print(f"  capability {cap.key}  max_concurrency {cap.max_concurrency}  cost_class {cap.cost_class}")
    return 0


async def join_fleet_a2a(roster: Any, fleet: Any) -> int:
    """Register the fleet file's `[[a2a]]` agents (at worker start); how many joined.

    One whose card does not answer or does not fit is reported and left out: the
    worker serves the rest, and `agentroster a2a add` adds it once it is up."""
    from pydantic import ValidationError

    from agentroster.client.a2a import A2ACardError, add_a2a_agent

    joined = 0
    for i, entry in enumerate(fleet.a2a):
        try:
            reg = await add_a2a_agent(
                roster, entry.card_url, deployment=entry.deployment, agent_id=entry.agent_id,
                max_concurrency=entry.max_concurrency, cost_class=entry.cost_class,
                heartbeat_interval_s=entry.heartbeat_interval_s or fleet.defaults.heartbeat_interval_s,
            )
        except (A2ACardError, ValidationError) as exc:
            print(f"agentroster worker: a2a[{i}] ({entry.card_url}) left out: {exc}", file=sys.stderr, flush=True)
            continue
        joined += 1
        caps = ", ".join(c.key for c in reg.capabilities)
        print(f"agentroster worker: A2A agent {reg.agent_id} joined ({caps})", flush=True)
    return joined


__all__ = ["add_a2a_parser", "join_fleet_a2a", "run_a2a"]
