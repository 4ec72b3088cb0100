"""An operator's `status` calls against a running pool, from a process of its own.

`python benchmarks/status_probe.py ADDRESS POOL SHARDS EVERY_S FOR_S` connects as a user's
`AgentRoster` does, reads the pool's status once untimed (the connection and the layout
check), then every EVERY_S seconds for FOR_S seconds times one `status()` and prints a JSON
line: its seconds, the routable agents it counts, and where the time went, read just after
it: the shards' queries alone (answered from each shard's cached reply, as nothing changed
since) and the decoding and merging of those replies here, as `AgentRoster.status` does.
A failed call prints its error instead.

The fleet benchmark runs it beside the simulated agents, not in their process: a dashboard
or the CLI asks from a process of its own, without 10,000 agents' heartbeats and objects.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from temporalio.common import RawValue  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402

from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.client.shard_status import merge_statuses  # noqa: E402
from agentroster.models import PoolStatus  # noqa: E402
from agentroster.vocabulary.wire import pool_workflow_id  # noqa: E402


def routable(status: PoolStatus) -> int:
    """Routable agents, from the capabilities' counts (they cover the rows a big status leaves out;
    each fleet agent offers one capability)."""
    return sum(c.agents.get("Ready", 0) + c.agents.get("Busy", 0) for c in status.capabilities.values())


async def split(roster: AgentRoster) -> tuple[float, float]:
    """Seconds for the shards' queries alone, and for decoding and merging their replies."""
    t = time.monotonic()
    raws = await asyncio.gather(*(
        roster.client.get_workflow_handle(pool_workflow_id(roster.pool, k)).query("status", result_type=RawValue)
        for k in roster.shards
    ))
    queried = time.monotonic() - t
    t = time.monotonic()
    converter = pydantic_data_converter.payload_converter
    statuses = [converter.from_payload(raw.payload, PoolStatus) for raw in raws]
    if len(statuses) > 1:
        merge_statuses(statuses)
    return queried, time.monotonic() - t


async def probe(address: str, pool: str, shards: str, every_s: float, for_s: float) -> None:
    async with AgentRoster.connect(address, pool=pool, shards=shards, ensure_pool=False) as roster:
        await roster.status()
        started = time.monotonic()
        while time.monotonic() - started < for_s:
            t = time.monotonic()
            try:
                status = await roster.status()
            except Exception as exc:  # noqa: BLE001 - a failed query is a figure
                print(json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:160]}"}), flush=True)
            else:
                took = time.monotonic() - t
                queried, decoded = await split(roster)
                print(json.dumps({"s": took, "routable": routable(status), "queries_s": queried, "decode_merge_s": decoded}), flush=True)
            await asyncio.sleep(max(0.0, min(every_s, for_s - (time.monotonic() - started))))


if __name__ == "__main__":
    address, pool, shards, every_s, for_s = sys.argv[1:6]
    asyncio.run(probe(address, pool, shards, float(every_s), float(for_s)))
