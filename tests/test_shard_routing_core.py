"""Sharded pools, the pure parts (issue 10, goal 4): routing, ids, layout settings, status sums, state sizes.

`core.shards` is what every process agrees on: the client, the workers' activities, the
agent workflow and each pool shard. The properties here are the ones sharding relies on:
one home shard per agent (its `max_concurrency` caps it across capabilities, so it is
never split), every shard tried once by an acquire, ids that name the shard that made
them, and an unsharded pool that behaves (and names its workflow) exactly as before.

The state-size tests show a 100,000-agent roster, each agent with a lease, split into
shards whose continue-as-new state each packs within the 1.5 MiB budget
(`benchmarks/bench_state.py`: one shard carries ~12,000 agents with leases).
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import AgentState, CapabilityStatus, PoolAgentRow, PoolStatus
from agentroster.errors import AgentRosterError
from agentroster.core.pool import PoolCore
from agentroster.vocabulary.shards import MAX_SHARDS, ShardLayout, shard_of_id, stable_hash, tag_id
from agentroster.core.state_codec import decode_state, encode_state, packed_size
from agentroster.client.settings import Settings, pool_shards_from_env
from agentroster.client.shard_status import merge_statuses
from agentroster.vocabulary.wire import PoolInput, pool_workflow_id

BUDGET = int(1.5 * 1024 * 1024)
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=40)
layouts = st.builds(ShardLayout, st.integers(1, MAX_SHARDS), st.sampled_from(["deployment", "agent"]))


# ------------------------------------------------------------------ routing
@given(layouts, ids, ids)
def test_every_agent_has_one_home_shard_in_range_and_every_process_agrees(layout: ShardLayout, agent: str, deployment: str) -> None:
    home = layout.home_shard(agent, deployment)
    assert 0 <= home < layout.shards
    assert home == ShardLayout(layout.shards, layout.by).home_shard(agent, deployment)  # a stable digest, not hash()
    if layout.shards == 1:
        assert home == 0


@given(st.integers(2, MAX_SHARDS), ids, st.lists(ids, min_size=1, max_size=20))
def test_a_deployment_stays_whole_when_placed_by_deployment(shards: int, deployment: str, agents: list[str]) -> None:
    layout = ShardLayout(shards, "deployment")
    homes = {layout.home_shard(a, deployment) for a in agents}
    assert homes == {layout.deployment_shard(deployment)}
    assert ShardLayout(shards, "agent").deployment_shard(deployment) is None  # spread: no one shard sizes it


@given(layouts, ids, st.none() | st.integers(0, MAX_SHARDS - 1))
def test_an_acquire_tries_every_shard_exactly_once_preferred_first(layout: ShardLayout, key: str, preferred: int | None) -> None:
    order = layout.acquire_order(key, preferred)
    assert sorted(order) == list(range(layout.shards))
    if preferred is not None and preferred < layout.shards:
        assert order[0] == preferred


def test_a_hot_capability_spreads_over_the_shards() -> None:
    """Placed by agent, 40,000 agents land within 5 % of an even split; first tries spread too."""
    layout = ShardLayout(4, "agent")
    homes = Counter(layout.home_shard(f"agent-{i}", "one-deployment") for i in range(40_000))
    assert all(abs(n - 10_000) < 500 for n in homes.values()), homes
    firsts = Counter(layout.acquire_order(f"request-{i}")[0] for i in range(40_000))
    assert all(abs(n - 10_000) < 500 for n in firsts.values()), firsts


@given(st.integers(0, MAX_SHARDS - 1), st.text(alphabet="0123456789abcdef", min_size=32, max_size=32))
def test_lease_ids_and_tickets_name_their_shard(shard: int, raw: str) -> None:
    tagged = tag_id(shard, raw)
    assert shard_of_id(tagged) == shard
    assert len(tagged) <= 128
    if shard == 0:
        assert tagged == raw  # an unsharded pool's ids are what they always were
    assert shard_of_id(raw) == 0


def test_shard_workflow_ids_are_readable_and_shard_zero_is_the_unsharded_id() -> None:
    assert pool_workflow_id("prod") == "pool/prod" == pool_workflow_id("prod", 0)
    assert pool_workflow_id("prod", 3) == "pool/prod/shard-3"
    assert PoolInput(pool="prod").layout() == ShardLayout()  # runs recorded before shards: one shard


def test_stable_hash_is_fixed() -> None:
    """Changing the hash would move every agent of a running sharded pool: pinned here."""
    assert stable_hash("agent:a1") == stable_hash("agent:a1")
    assert ShardLayout(4, "agent").home_shard("agent-1", "d") == stable_hash("agent:agent-1") % 4
    assert ShardLayout(4, "deployment").home_shard("x", "search") == stable_hash("deployment:search") % 4


# ------------------------------------------------------------------ settings
def test_the_shard_setting_reads_one_layout_or_one_per_pool() -> None:
    assert Settings.from_env({}).shards_for("default") == ShardLayout()
    assert Settings.from_env({"AGENTROSTER_POOL_SHARDS": "4"}).shards_for("any") == ShardLayout(4, "deployment")
    env = {"AGENTROSTER_POOL_SHARDS": "2, prod=8:agent"}
    assert Settings.from_env(env).shards_for("prod") == ShardLayout(8, "agent")
    assert Settings.from_env(env).shards_for("staging") == ShardLayout(2)
    assert ShardLayout.parse("4:agent") == ShardLayout(4, "agent") and str(ShardLayout(4, "agent")) == "4:agent"


@pytest.mark.parametrize("value", ["0", "65", "four", "4:capability", "prod=", "bad/pool=2"])
def test_a_bad_shard_setting_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(AgentRosterError, match="AGENTROSTER_POOL_SHARDS"):
        pool_shards_from_env({"AGENTROSTER_POOL_SHARDS": value})


# ------------------------------------------------------------------ the core of one shard
NOW = 1_767_225_600.0


def _snapshot(agent_id: str, deployment: str, caps: list[str], concurrency: int = 2) -> AgentSnapshot:
    return AgentSnapshot(
        agent_id=agent_id,
        deployment=deployment,
        endpoint=f"http://{agent_id}:8080",
        state=AgentState.READY,
        capabilities=[CapabilityDigest(name=c, version="1.0.0", max_concurrency=concurrency, cost_class="A") for c in caps],
        resync_interval_s=300.0,
    )


def _shard_core(shard: int, layout: ShardLayout, pool: str = "p") -> tuple[PoolCore, object]:
    core = PoolCore(pool, epoch="test")
    core.set_shard(shard, layout)
    counter = itertools.count()
    return core, lambda: f"{next(counter):032x}"


def _offer(core: PoolCore, new_id: object, snap: AgentSnapshot) -> None:
    core.agent_snapshot(snap, NOW, new_id)  # type: ignore[arg-type]
    for pending in core.take_verifications():
        core.agent_verified(pending, True, NOW, new_id)  # type: ignore[arg-type]


def test_a_shard_indexes_only_its_own_agents_and_says_why_it_refused_the_others() -> None:
    layout = ShardLayout(4, "agent")
    core, new_id = _shard_core(2, layout)
    mine = next(f"a{i}" for i in itertools.count() if layout.home_shard(f"a{i}", "d") == 2)
    other = next(f"a{i}" for i in itertools.count() if layout.home_shard(f"a{i}", "d") != 2)
    _offer(core, new_id, _snapshot(mine, "d", ["x"]))
    _offer(core, new_id, _snapshot(other, "d", ["x"]))
    assert core.is_indexed(mine) and not core.is_indexed(other)
    assert any(f"agent {other}" in w and "AGENTROSTER_POOL_SHARDS" in w for w in core.take_warnings())


def test_a_shard_tags_its_leases_and_tickets_and_an_unsharded_core_does_not() -> None:
    layout = ShardLayout(3, "deployment")
    shard = layout.deployment_shard("d")
    assert shard is not None
    core, new_id = _shard_core(shard, layout)
    _offer(core, new_id, _snapshot("a1", "d", ["x"], concurrency=1))
    lease = core.acquire(AcquireRequest(ref="x", wait_s=0, request_id="r" * 16), NOW, new_id).lease  # type: ignore[arg-type]
    assert lease is not None and shard_of_id(lease.lease_id) == shard
    ticket = core.acquire(AcquireRequest(ref="x", wait_s=5, request_id="q" * 16), NOW, new_id).ticket  # type: ignore[arg-type]
    assert ticket is not None and shard_of_id(ticket) == shard
    assert core.release(lease.lease_id, NOW, new_id)  # type: ignore[arg-type]
    assert core.ticket_status(ticket).lease is not None  # the queued caller got the freed slot, same shard

    plain, plain_id = _shard_core(0, ShardLayout())
    _offer(plain, plain_id, _snapshot("a1", "d", ["x"]))
    lease = plain.acquire(AcquireRequest(ref="x", wait_s=0, request_id="r" * 16), NOW, plain_id).lease  # type: ignore[arg-type]
    assert lease is not None and "~" not in lease.lease_id and len(lease.lease_id) == 32


def test_an_agent_wide_cap_holds_because_the_agent_is_never_split() -> None:
    """Two capabilities that would hash to different shards still live in the agent's one home shard."""
    layout = ShardLayout(8, "deployment")
    home = layout.home_shard("multi", "d")
    core, new_id = _shard_core(home, layout)
    snap = _snapshot("multi", "d", ["cap.a", "cap.b", "cap.c"], concurrency=2).model_copy(update={"max_concurrency": 2})
    _offer(core, new_id, snap)
    granted = [core.acquire(AcquireRequest(ref=c, wait_s=0, request_id=secrets.token_hex(16)), NOW, new_id).lease for c in ("cap.a", "cap.b", "cap.c")]  # type: ignore[arg-type]
    assert sum(g is not None for g in granted) == 2  # the cap of 2 across capabilities


# ------------------------------------------------------------------ status over shards
def test_statuses_add_up_over_shards() -> None:
    a = PoolStatus(
        pool="p", agents=[PoolAgentRow(agent_id="b", deployment="d", state=AgentState.READY, in_flight=1, capabilities=["x@1.0.0"])],
        active_leases=1, leases_granted=5, capabilities={"x": CapabilityStatus(agents={"ready": 1}, slots=2, idle_slots=1, in_flight=1, counters={"granted": 5})},
    )
    b = PoolStatus(
        pool="p", agents=[PoolAgentRow(agent_id="a", deployment="d", state=AgentState.BUSY, in_flight=2, capabilities=["x@1.0.0"])],
        active_leases=2, leases_granted=7, capabilities={"x": CapabilityStatus(agents={"busy": 1}, slots=2, idle_slots=0, in_flight=2, counters={"granted": 7}),
                                                         "y": CapabilityStatus(slots=1)},
    )
    before = [a.model_dump_json(), b.model_dump_json()]
    merged = merge_statuses([a, b])
    assert [a.model_dump_json(), b.model_dump_json()] == before  # the shards' statuses are left as they were
    assert [r.agent_id for r in merged.agents] == ["a", "b"]
    assert (merged.active_leases, merged.leases_granted) == (3, 12)
    x = merged.capabilities["x"]
    assert (x.agents, x.slots, x.idle_slots, x.in_flight, x.counters) == ({"ready": 1, "busy": 1}, 4, 1, 3, {"granted": 12})
    assert set(merged.capabilities) == {"x", "y"}
    assert merge_statuses([a]) is a  # unsharded: untouched


# ------------------------------------------------------------------ state sizes
CAPS_PER_DEPLOYMENT = 4


def _fill_shard(core: PoolCore, new_id: object, members: list[tuple[str, int]]) -> None:
    """Index `members` (agent id, deployment number) and lease one slot on each, as bench_state does."""
    for i, (agent_id, d) in enumerate(members):
        _offer(core, new_id, AgentSnapshot(
            agent_id=agent_id,
            deployment=f"deploy-{d}",
            endpoint=f"http://10.{d % 250}.{i // 250 % 250}.{i % 250}:8080",
            state=AgentState.READY,
            capabilities=[
                CapabilityDigest(name=f"cap{d}.skill{j}", version=f"{1 + j}.{d}.0", max_concurrency=4, cost_class="ABC"[j % 3])
                for j in range(CAPS_PER_DEPLOYMENT)
            ],
            resync_interval_s=300.0,
        ))
    for n, (_agent_id, d) in enumerate(members):
        reply = core.acquire(
            AcquireRequest(ref=f"cap{d}.skill{n % CAPS_PER_DEPLOYMENT}", lease_ttl_s=3600, wait_s=0,
                           holder=f"client-{secrets.token_hex(4)}", request_id=secrets.token_hex(16)),
            NOW, new_id,  # type: ignore[arg-type]
        )
        assert reply.lease is not None
    core.take_notices()


def _roster(agents: int, deployments: int) -> list[tuple[str, int]]:
    return [(f"deploy-{i % deployments}-{secrets.token_hex(5)}-{i}", i % deployments) for i in range(agents)]


@pytest.mark.parametrize(
    "layout,deployments,largest_shard",
    [
        # One hot capability set spread by agent: 10 shards of ~10,000 agents.
        (ShardLayout(10, "agent"), 10, 10_500),
        # 100 deployments of 1,000 agents kept whole: 16 shards, each some whole deployments.
        (ShardLayout(16, "deployment"), 100, 12_000),
    ],
    ids=["by-agent-10-shards", "by-deployment-16-shards"],
)
def test_a_100k_agent_roster_in_shards_fits_each_shards_continue_as_new_limit(
    layout: ShardLayout, deployments: int, largest_shard: int
) -> None:
    roster = _roster(100_000, deployments)
    members: dict[int, list[tuple[str, int]]] = {k: [] for k in range(layout.shards)}
    for agent_id, d in roster:
        members[layout.home_shard(agent_id, f"deploy-{d}")].append((agent_id, d))
    assert sum(len(m) for m in members.values()) == 100_000
    assert max(len(m) for m in members.values()) <= largest_shard, {k: len(m) for k, m in members.items()}
    # The largest shard is the one that could overflow: build it, with a lease on every agent.
    k, biggest = max(members.items(), key=lambda item: len(item[1]))
    core, new_id = _shard_core(k, layout, pool="big")
    _fill_shard(core, new_id, biggest)
    assert len(core.index) == len(biggest) and len(core.leases) == len(biggest)
    state = core.to_state()
    carried = encode_state(state)
    size = packed_size(carried)
    assert size <= BUDGET, f"shard {k} with {len(biggest):,} agents and leases packs to {size / 1024:,.0f} KiB"
    restored = PoolCore.from_state(decode_state(carried))
    assert len(restored.index) == len(biggest) and len(restored.leases) == len(biggest)
    assert all(shard_of_id(record.lease_id) == k for record in state_leases(restored))


def state_leases(core: PoolCore) -> list:
    return [core.leases.get(row["lease_id"]) for row in core.to_state().leases]
