"""Lifecycle history survives load flips (defect 9).

A capacity-1 agent flips Ready <-> Busy on every lease; those flips used to push
Registering/Ready out of the 50 transitions `status` keeps. The pure tests reach
new names through the module (`lifecycle.X`) so that, on the old code,
`test_registering_survives_200_load_flips` fails on its assertion rather than on
an import.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

from agentroster.contracts import AgentRegistration, AgentState, AgentStatus, Capability, LoadNotice
from agentroster.core import lifecycle
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
    """The regression: fails on the code before the fix (Registering was pushed out)."""
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
    life.last_told_pool = at(30)
    carried = json.loads(json.dumps(life.to_carried()))
    assert AgentLifecycle.from_carried(carried) == life


def previous_version_carry() -> dict[str, Any]:
    """What `AgentWorkflow._carry` produced before the fix: one mixed list, no load-flip fields."""
    flips = [
        {"from_state": "Ready" if i % 2 == 0 else "Busy", "to_state": "Busy" if i % 2 == 0 else "Ready",
         "reason": "saturated (1 in flight)" if i % 2 == 0 else "slot freed (0 in flight)",
         "at": at(10 + i).isoformat()}
        for i in range(47)
    ]
    return {
        "agent_id": "agent-1",
        "pool": "prod",
        "state": "Busy",
        "registration": registration().model_dump(mode="json"),
        "last_heartbeat": at(5).isoformat(),
        "in_flight": 1,
        "saturated": True,
        "load_seq": 47,
        "load_epoch": "pool-epoch",
        "last_told_pool": at(6).isoformat(),
        "drain_deadline": None,
        "drain_reason": None,
        "drain_count_confirmed": False,
        "terminated_reason": None,
        "transitions": [
            {"from_state": None, "to_state": "Spawning", "reason": "workflow started", "at": at(0).isoformat()},
            {"from_state": "Spawning", "to_state": "Registering", "reason": "registered", "at": at(1).isoformat()},
            {"from_state": "Registering", "to_state": "Ready", "reason": "indexed by pool", "at": at(2).isoformat()},
            *flips,
        ],
        "started_at": at(0).isoformat(),
    }


def test_a_carry_from_the_previous_version_still_rebuilds() -> None:
    life = AgentLifecycle.from_carried(previous_version_carry())
    assert (life.state, life.in_flight, life.load_seq, life.load_epoch) == (S.BUSY, 1, 47, "pool-epoch")
    assert life.last_heartbeat == at(5) and life.last_told_pool == at(6) and life.started_at == at(0)
    # Its mixed list is sorted out: lifecycle steps stay, load flips move to the ring and are counted.
    assert steps(life.transitions) == CAME_UP
    assert len(life.recent_load_flips) == lifecycle.LOAD_FLIPS_KEPT
    assert life.recent_load_flips[-1].at == at(10 + 46)
    assert life.busy_flips == 24 and life.last_busy_at == at(10 + 46)
    # And it carries on: the next flips are counted, and it carries forward in the new shape.
    life.apply_load(LoadNotice(in_flight=0, saturated=False, seq=48, epoch="pool-epoch"), at(100))
    assert life.state == S.READY and steps(life.transitions) == CAME_UP
    again = AgentLifecycle.from_carried(json.loads(json.dumps(life.to_carried())))
    assert again == life


def test_a_carry_with_unknown_keys_still_rebuilds() -> None:
    """A newer version's carry (after a rollback) loses only what this version does not know."""
    carried = {**flipping_agent(notices=4).to_carried(), "something_newer": [1, 2, 3]}
    assert AgentLifecycle.from_carried(carried) == flipping_agent(notices=4)


def test_a_status_from_the_previous_version_still_validates() -> None:
    old = {"agent_id": "agent-1", "pool": "prod", "state": "Ready", "in_flight": 0, "last_heartbeat": None,
           "registration": None, "transitions": [], "terminated_reason": None}
    status = AgentStatus.model_validate_json(json.dumps(old))
    assert (status.busy_flips, status.last_busy_at, status.recent_load_flips, status.transitions_dropped) == (0, None, [], 0)


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
