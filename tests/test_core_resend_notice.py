"""`PoolCore.resend_notice`: a load notice that failed to reach a running agent workflow is sent again, as the load is now."""

from __future__ import annotations

import itertools

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import AgentState
from agentroster.core.pool import PoolCore

_ids = (f"{i:032x}" for i in itertools.count())


def _new_id() -> str:
    return next(_ids)


def _core_with_agent(slots: int = 1) -> PoolCore:
    core = PoolCore("p", epoch="e1")
    core.agent_snapshot(
        AgentSnapshot(
            agent_id="a",
            deployment="dep",
            endpoint="http://a.local:8080",
            state=AgentState.READY,
            capabilities=[CapabilityDigest(name="rag.search", version="2.1.0", max_concurrency=slots, cost_class="B")],
        ),
        0.0,
        _new_id,
    )
    if core.take_verifications() == ["a"]:  # indexed once its workflow is seen running
        core.agent_verified("a", True, 0.0, _new_id)
    assert core.is_indexed("a")
    return core


def test_a_resent_notice_carries_the_load_as_it_is_now_with_a_newer_seq() -> None:
    core = _core_with_agent()
    reply = core.acquire(AcquireRequest(ref="rag.search", wait_s=0, request_id=_new_id()), 1.0, _new_id)
    assert reply.lease is not None
    [(agent, signal, first)] = core.take_notices()
    assert (agent, signal, first.in_flight, first.saturated) == ("a", "acquire", 1, True)

    core.resend_notice("a")  # the first never arrived; nothing changed since
    [(agent, _, again)] = core.take_notices()
    assert (agent, again.in_flight, again.saturated) == ("a", 1, True)
    assert again.seq > first.seq  # the agent takes it: not stale

    assert core.release(reply.lease.lease_id, 2.0, _new_id)
    core.take_notices()  # this one failed too, its check came later
    core.resend_notice("a")
    [(_, _, now)] = core.take_notices()
    assert (now.in_flight, now.saturated) == (0, False)


def test_no_notice_for_an_agent_the_pool_no_longer_has() -> None:
    core = _core_with_agent()
    core.agent_gone("a", "heartbeat lost", 1.0, _new_id)
    core.take_notices()
    core.resend_notice("a")
    core.resend_notice("never-seen")
    assert core.take_notices() == []
