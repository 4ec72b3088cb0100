"""A pool rebuilt from carried state (continue-as-new) routes exactly as the pool that carried it.

`PoolCore.from_state` sorts the free lists once (`CapabilityIndex.begin_bulk`/`end_bulk`)
and builds one CapabilityDigest per distinct capability row; these tests hold it to the
one-agent-at-a-time rebuild, including hand-made states that repeat an agent.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentroster.messages import AcquireRequest  # noqa: E402
from agentroster.core.index import CapabilityIndex  # noqa: E402
from agentroster.core.pool import PoolCore, PoolCoreState  # noqa: E402
from benchmarks.bench_state import big_pool  # noqa: E402

NOW = 1_767_225_600.0


def free_lists(core: PoolCore) -> dict[str, dict[str, list[Any]]]:
    return {name: {v: list(keys) for v, keys in versions.items()} for name, versions in core.index._free.items()}


def rebuilt_one_by_one(state: PoolCoreState, monkeypatch: pytest.MonkeyPatch) -> PoolCore:
    with monkeypatch.context() as m:
        m.setattr(CapabilityIndex, "begin_bulk", lambda self: None)
        return PoolCore.from_state(state)


def picks(core: PoolCore, refs: list[str]) -> list[str | None]:
    ids = iter(f"{n:032x}" for n in range(10**6))
    out = []
    for n, ref in enumerate(refs):
        reply = core.acquire(AcquireRequest(ref=ref, lease_ttl_s=60, wait_s=0, holder="t", request_id=f"{n:032x}"), NOW, lambda: next(ids))
        out.append(reply.lease.agent_id if reply.lease else None)
    return out


def test_a_rebuilt_pool_lists_and_picks_as_the_one_that_carried_it(monkeypatch: pytest.MonkeyPatch) -> None:
    core = big_pool(400, 250, now=NOW)
    state = core.to_state()
    bulk = PoolCore.from_state(state)
    slow = rebuilt_one_by_one(state, monkeypatch)
    assert free_lists(bulk) == free_lists(slow) == free_lists(core)
    assert bulk.index._bulk is None
    assert bulk.to_state() == state
    refs = [f"cap{d}.skill{j}" for d in range(10) for j in range(3)] * 4
    assert picks(bulk, refs) == picks(slow, refs) == picks(core, refs)


def test_a_hand_made_state_that_repeats_an_agent_is_rebuilt_like_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    state = big_pool(40, 10, now=NOW).to_state()
    rows = state.model_dump()
    repeated = dict(rows["agents"][3], endpoint="http://10.9.9.9:8080")  # the same agent again, later in the list
    rows["agents"] = rows["agents"][:10] + [repeated] + rows["agents"][10:]
    odd = PoolCoreState.model_validate(rows)
    bulk = PoolCore.from_state(odd)
    slow = rebuilt_one_by_one(odd, monkeypatch)
    assert free_lists(bulk) == free_lists(slow)
    assert bulk.index.get(repeated["agent_id"]).endpoint == "http://10.9.9.9:8080"
    assert bulk.to_state() == slow.to_state()


def test_capability_rows_are_shared_only_when_equal() -> None:
    state = big_pool(30, 0, now=NOW).to_state()
    rows = state.model_dump()
    first = rows["agents"][0]
    twin = dict(first, agent_id="twin", capabilities=[dict(c, max_concurrency=c["max_concurrency"] + 1) for c in first["capabilities"]])
    rows["agents"].append(twin)
    core = PoolCore.from_state(PoolCoreState.model_validate(rows))
    mine = core.index.get("twin").capabilities
    theirs = core.index.get(first["agent_id"]).capabilities
    assert {n: c.max_concurrency for n, c in mine.items()} == {n: c.max_concurrency + 1 for n, c in theirs.items()}
