"""Index notices in the cores: the agent's lifecycle waits on one per registration
(`awaits_index`), the pool's core queues one when it indexes a registration that waits,
keeps it owed until delivered, and carries it across continue-as-new."""

from __future__ import annotations

import itertools
import json
from datetime import datetime, timezone

from agentroster.messages import AgentSnapshot, CapabilityDigest
from agentroster.models import AgentState
from agentroster.core.lifecycle import AgentLifecycle
from agentroster.core.pool import PoolCore, PoolCoreState
from tests.conftest import make_registration

S = AgentState
NOW = datetime(2026, 12, 3, tzinfo=timezone.utc)


def _snapshot(agent_id: str, state: AgentState = S.REGISTERING, awaits: int | None = 1, slots: int = 2) -> AgentSnapshot:
    return AgentSnapshot(
        agent_id=agent_id,
        deployment="dep",
        endpoint=f"http://{agent_id}.local:8080",
        state=state,
        capabilities=[CapabilityDigest(name="rag.search", version="2.1.0", max_concurrency=slots, cost_class="B")],
        resync_interval_s=60.0,
        awaits_index=awaits,
    )


def _core() -> PoolCore:
    core = PoolCore("p", epoch="e1")
    core.verify_known_agents = True  # the workflow's `snapshot-as-hint` path
    return core


_ids = (str(i) for i in itertools.count())


def _new_id() -> str:
    return next(_ids)


def _hint_and_read(core: PoolCore, snap: AgentSnapshot, now: float = 1.0) -> None:
    core.agent_snapshot(snap, now, _new_id)
    assert core.take_verifications() == [snap.agent_id]
    core.agent_read(snap.agent_id, snap, "", now, _new_id)


# ------------------------------------------------------------------ the agent's side
def test_a_registration_waits_for_its_notice() -> None:
    life = AgentLifecycle(agent_id="a", pool="p")
    life.spawn(NOW)
    life.register(make_registration("a"), NOW)
    assert life.awaits_index == 1
    life.indexed(NOW)
    assert life.state == S.READY and not life.routable_for_caller  # Ready, but its pool has not said so
    assert life.status().indexed_by_pool is False
    assert not life.pool_indexed(2)  # ahead of any registration: not its pool's word
    assert life.pool_indexed(1)
    assert life.routable_for_caller and life.status().indexed_by_pool is True
    assert not life.pool_indexed(1)  # again: nothing waits


def test_a_notice_for_an_earlier_registration_answers_nothing() -> None:
    life = AgentLifecycle(agent_id="a", pool="p")
    life.spawn(NOW)
    life.register(make_registration("a"), NOW)
    life.indexed(NOW)  # Ready; its pool's notice is still on its way when it registers again
    life.register(make_registration("a", [("rag.search", "2.1.0", 3, "B")]), NOW)
    life.indexed(NOW)
    assert life.awaits_index == 2
    assert not life.pool_indexed(1)
    assert life.pool_indexed(2) and life.awaits_index is None


def test_draining_answers_the_caller_whatever_the_pool_said() -> None:
    life = AgentLifecycle(agent_id="a", pool="p")
    life.spawn(NOW)
    life.register(make_registration("a"), NOW)
    life.drain("pool-shutdown", 10, NOW)
    assert life.routable_for_caller


def test_the_wait_is_carried_across_continue_as_new() -> None:
    life = AgentLifecycle(agent_id="a", pool="p")
    life.spawn(NOW)
    life.register(make_registration("a"), NOW)
    again = AgentLifecycle.from_carried(json.loads(json.dumps(life.to_carried())))
    assert (again.registrations, again.awaits_index) == (1, 1)


# ------------------------------------------------------------------ the pool's side
def test_the_pool_tells_a_registration_that_waits_once_it_is_indexed() -> None:
    core = _core()
    core.agent_snapshot(_snapshot("a"), 1.0, _new_id)
    assert core.take_verifications() == ["a"]
    assert core.take_index_notices() == []  # not before the read
    core.agent_read("a", _snapshot("a"), "", 1.0, _new_id)
    (notice,) = core.take_index_notices()
    assert (notice.agent_id, notice.registration, notice.epoch) == ("a", 1, "e1")
    assert core.take_index_notices() == []


def test_no_notice_for_what_waits_on_nothing_or_is_not_indexed() -> None:
    core = _core()
    _hint_and_read(core, _snapshot("quiet", awaits=None))  # a resync, or an agent from before notices
    core.agent_snapshot(_snapshot("ghost"), 1.0, _new_id)  # forged: no workflow speaks for it
    assert core.take_verifications() == ["ghost"]
    core.agent_read("ghost", None, "no agent workflow", 1.0, _new_id)
    assert core.take_index_notices() == [] and "ghost" not in core.index


def test_a_reregistration_that_changes_nothing_is_told_without_a_read() -> None:
    core = _core()
    _hint_and_read(core, _snapshot("a"))
    core.take_index_notices()
    core.agent_snapshot(_snapshot("a", state=S.REGISTERING, awaits=2), 2.0, _new_id)
    assert core.take_verifications() == []  # it confirms what the pool has: applied at once
    assert [(n.agent_id, n.registration) for n in core.take_index_notices()] == [("a", 2)]


def test_owed_notices_are_carried_until_delivered() -> None:
    core = _core()
    _hint_and_read(core, _snapshot("a"))
    _hint_and_read(core, _snapshot("b"))
    handed_out = core.take_index_notices()
    assert [n.agent_id for n in handed_out] == ["a", "b"]
    _hint_and_read(core, _snapshot("c", awaits=3))  # owed, not handed out yet
    state = PoolCoreState.model_validate(json.loads(core.to_state().model_dump_json()))
    assert state.index_notices == {"a": 1, "b": 1, "c": 3}
    core.index_notices_delivered(handed_out)
    assert core.to_state().index_notices == {"c": 3}
    again = PoolCore.from_state(state)  # a new run sends everything the last one still owed
    assert sorted((n.agent_id, n.registration) for n in again.take_index_notices()) == [("a", 1), ("b", 1), ("c", 3)]
    older = PoolCoreState.model_validate({k: v for k, v in state.model_dump().items() if k != "index_notices"})
    assert PoolCore.from_state(older).take_index_notices() == []


def test_an_agent_that_leaves_is_owed_nothing() -> None:
    core = _core()
    _hint_and_read(core, _snapshot("a"))
    core.agent_gone("a", "terminated", 2.0, _new_id)
    assert core.take_index_notices() == []
