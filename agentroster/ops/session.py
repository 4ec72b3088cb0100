"""The rosters a command connects, closed when the command ends.

Every command of the CLI and of the operator tools connects through
`connect_roster`, and `closing` closes them all before `asyncio.run` returns, so
a command leaves nothing running at interpreter exit.
"""

from __future__ import annotations

import argparse
from typing import Any

_rosters: list[Any] = []


async def connect_roster(args: argparse.Namespace, **options: Any) -> Any:
    """The command's roster, on the pool and server its flags name; closed when the command ends."""
    from agentroster.client.roster import AgentRoster

    roster = await AgentRoster.connect(
        args.address, namespace=args.namespace, pool=getattr(args, "pool", None), task_queue=getattr(args, "task_queue", None),
        ensure_pool=False, **options,
    )
    _rosters.append(roster)
    return roster


async def closing(command: Any) -> int:
    """Run a command, then close every roster it connected."""
    try:
        return await command
    finally:
        while _rosters:
            await _rosters.pop().close()
