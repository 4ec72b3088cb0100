"""A pool's carried state is packed to fit the server's 2 MiB payload limit (issue 7, item 9).

2,000 agents with 5,000 active leases used to fail every continue-as-new
(`[TMPRL1103] ... size=2298206 limit=2097152`); here such a pool continues as new
on a real dev server and the next run holds every agent and lease. The 10,000
agent figure is measured by `benchmarks/bench_state.py` and `benchmarks/chaos.py`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
import zlib

import pytest
from temporalio.api.enums.v1 import EventType

from agentroster.client.roster import AgentRoster
from agentroster.core.state_codec import (
    MAX_UNPACKED_BYTES,
    STATE_FORMAT,
    StateFormatError,
    decode_state,
    encode_state,
    packed_size,
)
from agentroster.vocabulary.wire import PoolInput, pool_task_timeout
from benchmarks.bench_state import big_pool

SERVER_LIMIT = 2 * 1024 * 1024


def test_packed_state_reads_back_equal_and_is_far_smaller() -> None:
    state = big_pool(1_000, 1_000).to_state()
    packed = encode_state(state)
    assert packed["format"] == STATE_FORMAT
    assert decode_state(json.loads(json.dumps(packed))) == state
    plain = len(json.dumps(state.model_dump(mode="json"), separators=(",", ":")))
    assert packed_size(packed) * 4 < plain


@pytest.mark.parametrize(
    ("carried", "reason"),
    [
        ({"format": "agentroster.pool-state/9", "encoding": "zlib+base64", "data": ""}, "is not"),
        ({"format": STATE_FORMAT, "encoding": "gzip", "data": ""}, "is not"),
        ({"format": STATE_FORMAT, "encoding": "zlib+base64", "data": 7}, "state.data: must be a base64 string"),
        ({"format": STATE_FORMAT, "encoding": "zlib+base64", "data": "not base64!"}, r"not zlib\+base64"),
        ({"format": STATE_FORMAT, "encoding": "zlib+base64", "data": base64.b64encode(b"plain").decode()}, r"not zlib\+base64"),
    ],
)
def test_bad_packed_state_is_refused_naming_the_field(carried: dict, reason: str) -> None:
    with pytest.raises(StateFormatError, match=reason):
        decode_state(carried)


def test_a_decompression_bomb_is_refused_without_inflating_it() -> None:
    bomb = zlib.compress(b" " * (MAX_UNPACKED_BYTES + 1024), 9)
    carried = {"format": STATE_FORMAT, "encoding": "zlib+base64", "data": base64.b64encode(bomb).decode()}
    with pytest.raises(StateFormatError, match="unpacks to more than"):
        decode_state(carried)


def test_big_pools_get_a_longer_workflow_task_timeout_within_bounds() -> None:
    assert pool_task_timeout(0, 0).total_seconds() == 2
    assert pool_task_timeout(10_000, 10_000).total_seconds() == 7
    assert pool_task_timeout(10**6, 10**6).total_seconds() == 10


async def test_two_thousand_agents_with_five_thousand_leases_continue_as_new(stack) -> None:
    pool = f"big-{uuid.uuid4().hex[:6]}"
    core = big_pool(2_000, 5_000, pool=pool, now=time.time())
    state = core.to_state()
    assert len(json.dumps(state.model_dump(mode="json"))) > SERVER_LIMIT  # what used to be carried
    client = stack.env.client
    handle = await client.start_workflow(
        "PoolWorkflow",
        PoolInput(pool=pool, max_updates_per_run=2, state=encode_state(state)),
        id=f"pool/{pool}",
        task_queue=stack.task_queue,
    )
    roster = AgentRoster(client, pool=pool, task_queue=stack.task_queue)
    roster._pool_started = True
    held = [await roster.acquire("cap1.skill0", lease_ttl_s=600, timeout=60) for _ in range(2)]
    deadline = time.monotonic() + 60
    while (await roster.status()).runs < 1:
        assert time.monotonic() < deadline, "the pool never continued as new"
        await asyncio.sleep(0.2)
    status = await roster.status()
    assert len(status.agents) == 2_000
    assert status.active_leases == 5_002
    assert {a.agent_id: a.in_flight for a in status.agents if a.in_flight}.keys() >= {lease.agent_id for lease in held}
    described = await client.get_workflow_handle(f"pool/{pool}").describe()
    assert described.raw_description.execution_config.default_workflow_task_timeout.seconds == 3  # 2 s + 1 s for 7,002 agents and leases
    failures = 0
    async for wf in client.list_workflows(f'WorkflowId="pool/{pool}"'):
        history = await client.get_workflow_handle(f"pool/{pool}", run_id=wf.run_id).fetch_history()
        failures += sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
    assert failures == 0
    await handle.terminate("test over")
