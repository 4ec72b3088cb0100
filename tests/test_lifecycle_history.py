"""The transition log the agent workflow keeps survives load flips.

A capacity-1 agent flips Ready <-> Busy on every lease; those flips are counted and
kept in a short ring of their own, so Registering/Ready are never pushed out of the
lifecycle transitions `status` keeps (and carries across continue-as-new).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

from agentroster.messages import LoadNotice
from agentroster.models import AgentRegistration, AgentState, AgentStatus, Capability
import agentroster.core.lifecycle as lifecycle
from agentroster.core.lifecycle import AgentLifecycle
from tests.conftest import eventually, make_registration

S = AgentState
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def registration() -> AgentRegistration:
    return AgentRegistration(
        agent_id="agent-1",
        deployment="search-agent",
        endpoint="http://127.0.0.1:9000",
        capabilities=[Capability(name="rag.search", version="2.1.0", max_concurrency=1)],
    )


def flipping_agent(notices: int = 200) -> AgentLifecycle:
    """Spawned, registered, indexed, then `notices` load notices alternating saturated / free."""
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    life.spawn(at(0))
    life.register(registration(), at(1))
    life.indexed(at(2))
    for seq in range(1, notices + 1):
        saturated = seq % 2 == 1
        life.apply_load(LoadNotice(in_flight=int(saturated), saturated=saturated, seq=seq), at(2 + seq))
    return life


def steps(transitions: list[Any]) -> list[tuple[AgentState | None, AgentState, str]]:
    return [(t.from_state, t.to_state, t.reason) for t in transitions]


CAME_UP = [
    (None, S.SPAWNING, "workflow started"),
    (S.SPAWNING, S.REGISTERING, "registered"),
    (S.REGISTERING, S.READY, "indexed by pool"),
]


# ------------------------------------------------------------------ pure


def test_registering_survives_200_load_flips() -> None:
    reached = {(t.to_state, t.reason) for t in flipping_agent().status().transitions}
    assert (S.REGISTERING, "registered") in reached
    assert (S.READY, "indexed by pool") in reached


def test_load_flips_are_counted_and_kept_apart() -> None:
    life = flipping_agent()
    status = life.status()
    assert life.state == S.READY
    assert steps(status.transitions) == CAME_UP  # no load flip among the lifecycle transitions
    assert status.busy_flips == 100
    assert status.last_busy_at == at(2 + 199)  # the last saturated notice
    assert len(status.recent_load_flips) == lifecycle.LOAD_FLIPS_KEPT
    assert all({t.from_state, t.to_state} == {S.READY, S.BUSY} for t in status.recent_load_flips)
    assert status.recent_load_flips[-1].at == at(2 + 200)
    assert status.recent_load_flips[-1].to_state == S.READY
    # The rest of the life still lands in the lifecycle history.
    life.drain("rollout", 60, at(300))
    life.terminate("drain", at(301))
    assert steps(life.status().transitions) == [
        *CAME_UP,
        (S.READY, S.DRAINING, "rollout"),
        (S.DRAINING, S.TERMINATED, "drain"),
    ]


def test_saturated_at_indexing_is_a_load_flip() -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    life.spawn(at(0))
    life.register(registration(), at(1))
    life.apply_load(LoadNotice(in_flight=1, saturated=True, seq=1), at(2))
    returned = life.indexed(at(3))
    assert [t.to_state for t in returned] == [S.READY, S.BUSY]  # the workflow still records both
    assert steps(life.transitions) == CAME_UP
    assert [t.to_state for t in life.recent_load_flips] == [S.BUSY] and life.busy_flips == 1


def test_a_re_registration_loop_keeps_the_first_and_the_latest_transitions() -> None:
    life = flipping_agent(notices=0)
    loops = 200
    for i in range(loops):
        life.register(registration(), at(10 + i))
        life.indexed(at(10 + i))
    kept = lifecycle.RECENT_TRANSITIONS_KEPT
    assert len(life.transitions) == kept
    assert steps(life.transitions[: lifecycle.FIRST_TRANSITIONS_KEPT]) == CAME_UP
    assert steps(life.transitions[-2:]) == [
        (S.READY, S.REGISTERING, "re-registered"),
        (S.REGISTERING, S.READY, "indexed by pool"),
    ]
    assert life.transitions[-1].at == at(10 + loops - 1)
    assert life.status().transitions_dropped == 3 + 2 * loops - kept


# ------------------------------------------------------------------ continue-as-new carry


def test_carry_round_trips_through_json() -> None:
    life = flipping_agent(notices=25)
    life.told_pool(at(30), 0.25)
    carried = json.loads(json.dumps(life.to_carried()))
    assert AgentLifecycle.from_carried(carried) == life


def test_an_ended_life_carries_through_json_whole() -> None:
    """The log, the counts and the end reason, as `status` (and the run's result) report them."""
    life = flipping_agent(notices=8)
    life.drain("rollout", 60, at(300))
    life.terminate("drain", at(301))
    again = AgentLifecycle.from_carried(json.loads(json.dumps(life.to_carried())))
    assert again.status() == life.status()
    assert steps(again.status().transitions)[-2:] == [(S.READY, S.DRAINING, "rollout"), (S.DRAINING, S.TERMINATED, "drain")]


# ------------------------------------------------------------------ through the real server


async def test_a_capacity_one_agent_keeps_its_lifecycle_through_60_leases(stack) -> None:
    """Also continues as new every 25 signals, so the new fields cross real run hand-overs."""
    client = stack.env.client
    reg = make_registration("one-slot", [("rag.search", "2.1.0", 1, "A")])
    first_run = await client.start_workflow(
        "AgentWorkflow",
        {"agent_id": "one-slot", "pool": stack.pool, "max_signals_per_run": 25},
        id=f"agent/{stack.pool}/one-slot",
        task_queue=stack.task_queue,
        start_signal="register",
        start_signal_args=[reg.model_dump(mode="json")],
    )
    await stack.roster.register(reg)

    async def reached(state: AgentState, in_flight: int) -> AgentStatus | None:
        status = await stack.roster.describe("one-slot")
        return status if (status.state, status.in_flight) == (state, in_flight) else None

    # Waiting for each flip keeps the pool from coalescing a grant and its
    # release into one notice: 60 leases are 120 flips, more than the old list held.
    for _ in range(60):
        lease = await stack.roster.acquire("rag.search", timeout=10)
        assert lease.agent_id == "one-slot"
        await eventually(lambda: reached(S.BUSY, 1), timeout=15)
        await stack.roster.release(lease)
        await eventually(lambda: reached(S.READY, 0), timeout=15)

    status = await stack.roster.describe("one-slot")
    seen = [(t.to_state, t.reason) for t in status.transitions]
    assert (S.REGISTERING, "registered") in seen
    assert (S.READY, "indexed by pool") in seen
    assert S.BUSY not in [t.to_state for t in status.transitions]
    assert status.busy_flips == 60 and status.last_busy_at is not None
    assert len(status.recent_load_flips) == lifecycle.LOAD_FLIPS_KEPT
    current = await client.get_workflow_handle(f"agent/{stack.pool}/one-slot").describe()
    assert current.run_id != first_run.result_run_id, "expected the agent workflow to continue as new"

    # The run's result when it ends is the same log, carried through every run, and the end.
    final = await stack.roster.drain("one-slot", reason="rollout", deadline_s=30)
    assert final.transitions[: len(seen)] == status.transitions
    assert [(t.from_state, t.to_state, t.reason) for t in final.transitions[-2:]] == [
        (S.READY, S.DRAINING, "rollout"),
        (S.DRAINING, S.TERMINATED, "drain"),
    ]
    assert (final.busy_flips, final.recent_load_flips, final.terminated_reason) == (60, status.recent_load_flips, "drain")
