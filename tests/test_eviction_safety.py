"""Eviction safety on a real dev server: agents that stop heartbeating ask their pool
before they are terminated, and a mass silence is held back (self-preservation).

Agents are registered with a 1 s heartbeat interval (a 3 s window) and kept alive
by heartbeating from the test; "going silent" is the test no longer sending
their heartbeats. Nothing here asserts on timing: waits are for events (a state,
a count of refusals), with generous timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from agentroster import AgentState
from agentroster.activities.backend import BackendActivities
from agentroster.activities.roster import RosterActivities
from agentroster.client.roster import AgentRoster
from agentroster.errors import PoolExhaustedError
from agentroster.messages import EvictionVerdict, PoolEvictionAsk
from agentroster.models import AgentStatus, EvictionStatus
from agentroster.vocabulary.wire import REQUEST_EVICTION, agent_workflow_id
from agentroster.workflows import workflow_classes, workflow_runner
from tests.conftest import eventually, make_registration

REPO = Path(__file__).resolve().parent.parent
WINDOW_S = 3.0  # 3 x the 1 s heartbeat interval


class Heartbeats:
    """Heartbeat every agent in `alive` every 0.3 s, together (one gather), until stopped."""

    def __init__(self, roster: AgentRoster, agents: Iterable[str]) -> None:
        self.roster = roster
        self.alive = set(agents)
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            await asyncio.gather(*(self.roster.heartbeat(a) for a in sorted(self.alive)), return_exceptions=True)
            await asyncio.sleep(0.3)

    def __enter__(self) -> Heartbeats:
        self._task = asyncio.create_task(self._beat())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def _register(roster: AgentRoster, live: list[str], silent: list[str]) -> None:
    # The ones that will go silent are the cheapest: were they routable, they would be picked first.
    for agent_id in silent:
        await roster.register(make_registration(agent_id, [("rag.search", "2.1.0", 2, "A")], heartbeat_interval_s=1))
    for agent_id in live:
        await roster.register(make_registration(agent_id, [("rag.search", "2.1.0", 2, "C")], heartbeat_interval_s=1))


async def _described(roster: AgentRoster, agents: Iterable[str]) -> dict[str, AgentStatus]:
    return {a: await roster.describe(a) for a in agents}


def _deleted(stack) -> list[str]:  # noqa: ANN001
    return [agent for kind, _, agent in stack.backend.calls if kind == "delete_pod"]


def _assert_capped(status: EvictionStatus, window_s: float = WINDOW_S) -> None:
    """Terminations the pool allowed on its own (not confirmed): never two within one window (cap 1)."""
    times = sorted(r.at.timestamp() for r in status.recent if not r.confirmed)
    assert all(b - a >= window_s - 0.01 for a, b in zip(times, times[1:])), times


async def test_three_of_four_silent_at_once_are_held_then_one_recovers_and_the_operator_confirms(stack) -> None:
    roster = stack.roster
    silent = ["s1", "s2", "s3"]
    await _register(roster, ["live"], silent)
    with Heartbeats(roster, ["live", *silent]) as beats:
        await asyncio.sleep(0.5)
        beats.alive -= set(silent)  # all three at once

        # Every silent agent has asked; those not terminated have been refused at least
        # twice (they asked again after their retry-after and were held again).
        async def settled() -> dict[str, AgentStatus] | None:
            described = await _described(roster, silent)
            done = all(s.state == AgentState.TERMINATED or s.eviction_denials >= 2 for s in described.values())
            return described if done else None

        described = await eventually(settled, timeout=60, interval=0.2)
        reaped = sorted(a for a, s in described.items() if s.state == AgentState.TERMINATED)
        held = sorted(a for a, s in described.items() if s.state != AgentState.TERMINATED)
        evictions = await roster.evictions()
        assert held, "all three were reaped: no self-preservation"
        assert len(reaped) == evictions.evictions_allowed and sorted(_deleted(stack)) == reaped
        _assert_capped(evictions)
        assert evictions.self_preservation and evictions.self_preservation_activations == 1
        assert "terminations are held" in (evictions.warning or "")
        assert evictions.silent == held
        status = await roster.status()
        assert any(w.startswith("self-preservation on") for w in status.warnings)
        assert {a.agent_id for a in status.agents if a.silent} == set(held)
        for agent_id in held:
            assert described[agent_id].state == AgentState.READY and described[agent_id].eviction_held
            assert "self-preservation" in described[agent_id].eviction_held

        # The silent ones get no lease; the live one still serves.
        assert await roster.find("rag.search") == ["live"]
        leases = [await roster.acquire("rag.search", timeout=5) for _ in range(2)]
        assert {lease.agent_id for lease in leases} == {"live"}
        with pytest.raises(PoolExhaustedError):
            await roster.acquire("rag.search", timeout=0.5)
        for lease in leases:
            await roster.release(lease)
        await eventually(lambda: _state_is(roster, "live", AgentState.READY), timeout=15)

        # Heartbeats come back on one of them: Ready and routable again.
        back, rest = held[0], held[1:]
        beats.alive.add(back)

        async def recovered() -> bool:
            status = await roster.describe(back)
            return status.state == AgentState.READY and status.eviction_held is None and back in await roster.find("rag.search")

        await eventually(recovered, timeout=30, interval=0.1)
        assert back not in (await roster.evictions()).silent

        # The operator confirms: the rest are terminated and their pods deleted.
        await roster.confirm_evictions()
        for agent_id in rest:
            final = await asyncio.wait_for(roster.wait_ended(agent_id), timeout=30)
            assert final.terminated_reason == "heartbeat_lost"
            assert agent_id in _deleted(stack)
        assert await roster.find("rag.search") == [back, "live"]
        after = await roster.evictions()
        assert not after.self_preservation and after.silent == [] and after.confirmed == []
        assert (await roster.describe(back)).state == AgentState.READY


async def test_one_of_four_silent_is_reaped_at_once(stack) -> None:
    roster = stack.roster
    await _register(roster, ["l1", "l2", "l3"], ["dead"])
    with Heartbeats(roster, ["l1", "l2", "l3", "dead"]) as beats:
        await asyncio.sleep(0.5)
        beats.alive.discard("dead")
        final = await asyncio.wait_for(roster.wait_ended("dead"), timeout=30)
    assert final.terminated_reason == "heartbeat_lost"
    assert final.transitions[-1].reason == "heartbeat_lost"  # as before eviction safety
    assert final.eviction_denials == 0  # never held
    assert _deleted(stack) == ["dead"]
    evictions = await roster.evictions()
    assert evictions.evictions_allowed == 1 and evictions.evictions_denied == 0
    assert evictions.self_preservation_activations == 0 and not evictions.self_preservation
    assert await roster.find("rag.search") == ["l1", "l2", "l3"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    return subprocess.run(
        [sys.executable, "-m", "agentroster.workers.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
async def test_held_agents_stay_held_when_too_few_come_back_until_the_operator_confirms(stack) -> None:
    """Five of six go silent: one heartbeat back still leaves most of the pool silent, so the
    others stay held; `agentroster evictions confirm --all` lets them go at once."""
    roster = stack.roster
    silent = [f"s{i}" for i in range(1, 6)]
    await _register(roster, ["live"], silent)
    where = ["--address", stack.env.client.service_client.config.target_host, "--pool", stack.pool, "--task-queue", stack.task_queue]
    with Heartbeats(roster, ["live", *silent]) as beats:
        await asyncio.sleep(0.5)
        beats.alive -= set(silent)

        async def held_now() -> list[str] | None:  # every silent agent asked: terminated, or held
            described = await _described(roster, silent)
            if not all(s.state == AgentState.TERMINATED or s.eviction_held for s in described.values()):
                return None
            return sorted(a for a, s in described.items() if s.state != AgentState.TERMINATED)

        held = await eventually(held_now, timeout=60, interval=0.2)
        assert len(held) >= 3 and (await roster.evictions()).self_preservation
        shown = await asyncio.to_thread(_cli, "evictions", "show", *where)
        assert shown.returncode == 0, shown.stderr
        assert "self-preservation: ON" in shown.stdout and held[0] in shown.stdout

        back, rest = held[0], held[1:]
        beats.alive.add(back)
        await eventually(lambda: _routable(roster, back), timeout=30, interval=0.1)
        before = await _described(roster, rest)

        # Each of the rest asked again after the recovery, and was held again.
        async def asked_again() -> bool:
            now = await _described(roster, rest)
            return all(now[a].eviction_denials > before[a].eviction_denials for a in rest)

        await eventually(asked_again, timeout=30, interval=0.2)
        described = await _described(roster, rest)
        assert all(s.state == AgentState.READY and s.eviction_held for s in described.values())
        assert (await roster.evictions()).self_preservation

        refused = await asyncio.to_thread(_cli, "evictions", "confirm", *where)
        assert refused.returncode == 2 and "--all" in refused.stderr
        confirmed = await asyncio.to_thread(_cli, "evictions", "confirm", "--all", *where)
        assert confirmed.returncode == 0, confirmed.stderr
        for agent_id in rest:
            final = await asyncio.wait_for(roster.wait_ended(agent_id), timeout=30)
            assert final.transitions[-1].reason == "heartbeat_lost: confirmed by an operator"
        status = await roster.evictions()
        assert status.evictions_confirmed == len(rest) and not status.self_preservation
        assert sorted(await roster.find("rag.search")) == sorted([back, "live"])
        _assert_capped(status)


async def _state_is(roster: AgentRoster, agent_id: str, state: AgentState) -> bool:
    return (await roster.describe(agent_id)).state == state


async def _routable(roster: AgentRoster, agent_id: str) -> bool:
    return agent_id in await roster.find("rag.search")


async def test_eviction_policy_off_and_on_through_the_cli(stack) -> None:
    where = ["--address", stack.env.client.service_client.config.target_host, "--pool", stack.pool, "--task-queue", stack.task_queue]
    result = await asyncio.to_thread(_cli, "evictions", "set", "--off", "--threshold", "0.7", *where)
    assert result.returncode == 0, result.stderr
    policy = (await stack.roster.evictions()).policy
    assert (policy.enabled, policy.threshold, policy.cap_fraction) == (False, 0.7, 0.1)
    bad = await asyncio.to_thread(_cli, "evictions", "set", "--threshold", "1.5", *where)
    assert bad.returncode == 2 and "threshold" in bad.stderr
    await stack.roster.set_eviction_policy(None)  # back to the defaults
    assert (await stack.roster.evictions()).policy.enabled


@activity.defn(name=REQUEST_EVICTION)
async def _unanswered(ask: PoolEvictionAsk) -> EvictionVerdict:
    raise ApplicationError(f"pool {ask.pool} unreachable (test)", non_retryable=True)


@contextlib.asynccontextmanager
async def _worker_without_a_pool_answer(stack) -> AsyncIterator[None]:  # noqa: ANN001
    """The stack's worker, but `request_eviction` never gets an answer from the pool."""
    await stack.stop_worker()
    roster_acts = RosterActivities(stack.env.client, stack.task_queue)
    backend_acts = BackendActivities(stack.backend)
    worker = Worker(
        stack.env.client,
        task_queue=stack.task_queue,
        workflows=workflow_classes(),
        workflow_runner=workflow_runner(),
        activities=[roster_acts.notify_pool, roster_acts.verify_agent, roster_acts.read_agents, roster_acts.find_agents, _unanswered, backend_acts.delete_pod],
    )
    async with worker:
        yield


async def test_an_agent_whose_pool_does_not_answer_is_terminated_as_before(stack) -> None:
    await stack.roster.register(make_registration("orphan", [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=1))
    async with _worker_without_a_pool_answer(stack):
        final = await asyncio.wait_for(stack.roster.wait_ended("orphan"), timeout=60)
        refusals = await stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, "orphan")).query("refusals")
    assert final.terminated_reason == "heartbeat_lost"
    assert final.transitions[-1].reason == f"heartbeat_lost: pool {stack.pool} did not answer the eviction request"
    assert _deleted(stack) == ["orphan"]
    assert any("request_eviction refused" in r and "unreachable" in r for r in refusals)
