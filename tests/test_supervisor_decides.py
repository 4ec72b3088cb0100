"""The supervisor decides: a cost cap on a request (never a silent spill to a dearer agent),
a scale-up asked by a caller (in the pool's history), the full TaskResult from `invoke`, and
task workflows findable by the agents that served them (`AgentsServed`). Real dev server,
real HTTP agents (tests.test_invoke.RawAgent)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType

from agentroster import PoolExhaustedError
from agentroster.errors import AgentRosterError
from agentroster.models import PoolPolicy, TaskInput, TaskResult
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import eventually, make_registration
from tests.test_invoke import RawAgent


async def _outcomes(roster: Any, outcome: str) -> int:
    """The pool's count of text.echo tasks that ended so (what agentroster_task_outcomes exports)."""
    status = await roster.status()
    cap = status.capabilities.get("text.echo")
    return cap.counters.get(f"outcome.{outcome}", 0) if cap else 0


async def _counted(roster: Any, n: int) -> bool:
    return await _outcomes(roster, "failed_5xx") == n and await _outcomes(roster, "succeeded") == n


async def _echo(body: dict[str, Any]) -> tuple[int, str]:
    return 200, json.dumps({"output": {"echo": body["input"]["text"]}})


async def _broken(body: dict[str, Any]) -> tuple[int, str]:
    return 500, json.dumps({"error": "model provider down"})


async def test_a_cost_cap_never_spills_to_a_dearer_agent(stack) -> None:
    await stack.roster.register(make_registration("cheap", [("rag.search", "2.1.0", 1, "A")]))
    await stack.roster.register(make_registration("dear", [("rag.search", "2.1.0", 1, "C")], deployment="dear-agent"))
    held = await stack.roster.acquire("rag.search", timeout=5, max_cost_class="A")
    assert held.agent_id == "cheap"
    # Only the dear one is free: a request capped at B waits, then is refused, saying why.
    with pytest.raises(PoolExhaustedError) as refused:
        await stack.roster.acquire("rag.search", timeout=0.5, max_cost_class="B")
    assert refused.value.report.over_cost_cap == 1 and refused.value.report.max_cost_class == "B"
    assert "1 excluded by the cost cap (cost class above B" in str(refused.value)
    # Uncapped, the same request takes the dear one.
    assert (await stack.roster.acquire("rag.search", timeout=5)).agent_id == "dear"
    # A capped waiter is served by a cheap slot freed meanwhile, never by a dear one.
    await stack.roster.release(held)
    assert (await stack.roster.acquire("rag.search", timeout=5, max_cost_class="A")).agent_id == "cheap"


async def test_a_capped_task_workflow_and_invoke_refuse_dearer_agents(stack) -> None:
    dear = await RawAgent(stack, "dear-echo", _echo, cost_class="C").start()
    try:
        with pytest.raises(PoolExhaustedError, match="excluded by the cost cap"):
            await stack.roster.invoke("text.echo", {"text": "hi"}, timeout=0.5, max_cost_class="B")
        handle = await stack.env.client.start_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="text.echo", payload={"text": "hi"}, pool=stack.pool, acquire_timeout_s=0.5, max_cost_class="A"),
            id=f"task-{uuid.uuid4().hex[:8]}",
            task_queue=stack.task_queue,
        )
        with pytest.raises(Exception) as failed:
            await handle.result()
        assert "excluded by the cost cap" in str(failed.value.cause)  # type: ignore[attr-defined]
    finally:
        await dear.stop()


async def test_invoke_full_result_and_agents_served_search_attribute(stack) -> None:
    broken = await RawAgent(stack, "broken-echo", _broken, cost_class="A").start()  # picked first: cheapest
    good = await RawAgent(stack, "good-echo", _echo, cost_class="B").start()
    try:
        result = await stack.roster.invoke("text.echo", {"text": "hi"}, timeout=5, full=True)
        assert isinstance(result, TaskResult)
        assert result.output == {"echo": "hi"} and result.agent_id == "good-echo" and result.attempts == 2
        assert [(f.attempt, f.agent_id) for f in result.failures] == [(1, "broken-echo")]
        assert "500" in result.failures[0].error
        assert await stack.roster.invoke("text.echo", {"text": "hi"}, timeout=5) == {"echo": "hi"}  # the output alone
        # Outcomes counted by pool, capability and outcome: no agent label, however many agents.
        assert await eventually(lambda: _counted(stack.roster, 2))  # each tried the cheap one first

        task_id = f"task-{uuid.uuid4().hex[:8]}"
        done: TaskResult = await stack.env.client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="text.echo", payload={"text": "yo"}, pool=stack.pool, record_agents_served=True),
            id=task_id,
            task_queue=stack.task_queue,
            result_type=TaskResult,
        )
        assert done.agent_id == "good-echo" and [f.agent_id for f in done.failures] == ["broken-echo"]
        # the worker's attempts (its releases ride on later messages: counted once they land)
        assert await eventually(lambda: _counted(stack.roster, 3))

        async def found(agent_id: str) -> list[str]:
            return [w.id async for w in stack.env.client.list_workflows(f"AgentsServed='{agent_id}'")]

        assert task_id in await eventually(lambda: found("good-echo"), timeout=15)
        assert task_id in await eventually(lambda: found("broken-echo"), timeout=15)  # it touched the task too
    finally:
        await broken.stop()
        await good.stop()


async def test_a_scale_up_asked_by_a_caller_is_in_the_pool_history(stack) -> None:
    await stack.roster.register(make_registration("s-1", deployment="sized"))
    await stack.roster.register(make_registration("u-1", deployment="unsized"))
    await stack.roster.set_policy("sized", PoolPolicy(min_replicas=1, max_replicas=3))
    await stack.roster.scale_up("sized", 2, reason="a batch of reports is coming")
    await stack.roster.scale_up("unsized", 1)
    await eventually(lambda: ("scale", "sized", 3) in stack.backend.calls and ("scale", "unsized", 2) in stack.backend.calls)
    with pytest.raises(AgentRosterError, match="max_replicas 3"):
        await stack.roster.scale_up("sized", 1)
    with pytest.raises(AgentRosterError, match="never served"):
        await stack.roster.scale_up("nobody", 1)
    events = (await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()).events
    asked = [
        e.workflow_execution_update_accepted_event_attributes.accepted_request.input.args.payloads[0].data
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
    ]
    assert any(b'"scale_up":2' in a and b"a batch of reports is coming" in a for a in asked)
    status = await stack.roster.status()
    assert any("scale-up of sized to 3 asked" in w for w in status.warnings)
    # The operator's road to the same update: `agentroster policy scale-up`.
    from tests.test_policy_integration import _cli

    where = ["--address", stack.env.client.service_client.config.target_host, "--pool", stack.pool, "--task-queue", stack.task_queue]
    code, out, err = await _cli("policy", "scale-up", "unsized", "--add", "2", "--reason", "on call", *where)
    assert code == 0 and "asked for 2 more agent(s) of unsized" in out, err
    await eventually(lambda: ("scale", "unsized", 3) in stack.backend.calls)
    code, _, err = await _cli("policy", "scale-up", "sized", *where)
    assert code == 1 and "max_replicas 3" in err


# ------------------------------------------------------------------ core

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(
    classes=st.lists(st.sampled_from("ABC"), min_size=1, max_size=8),
    cap=st.sampled_from(["A", "B", "C", None]),
    acquires=st.integers(1, 12),
)
def test_core_a_capped_acquire_never_gets_a_dearer_agent(classes: list[str], cap: str | None, acquires: int) -> None:
    from agentroster.core.pool import PoolCore
    from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
    from agentroster.models import COST_RANK, AgentState

    core = PoolCore("p")
    core.verify_new_agents = False
    ids = iter(range(10_000))
    new_id = lambda: f"{next(ids):032x}"  # noqa: E731
    for i, cost in enumerate(classes):
        core.agent_snapshot(AgentSnapshot(
            agent_id=f"a{i}", deployment="d", endpoint=f"http://a{i}:80", state=AgentState.READY,
            capabilities=[CapabilityDigest(name="cap", version="1.0.0", max_concurrency=1, cost_class=cost)],  # type: ignore[arg-type]
        ), 0.0, new_id)
    within = sum(1 for c in classes if cap is None or COST_RANK[c] <= COST_RANK[cap])
    granted = 0
    for _ in range(acquires):
        reply = core.acquire(AcquireRequest(ref="cap", wait_s=0, max_cost_class=cap, request_id=new_id()), 0.0, new_id)
        if reply.lease is None:
            assert reply.report.over_cost_cap == len(classes) - within
            continue
        granted += 1
        assert cap is None or COST_RANK[classes[int(reply.lease.agent_id[1:])]] <= COST_RANK[cap]
    assert granted == min(acquires, within)


def test_core_scale_up_stays_within_the_policy_and_counts_what_it_asked_for() -> None:
    from agentroster.core.pool import PoolCore
    from agentroster.messages import AgentSnapshot, CapabilityDigest
    from agentroster.models import AgentState

    core = PoolCore("p")
    core.verify_new_agents = False
    core.agent_snapshot(AgentSnapshot(
        agent_id="a0", deployment="d", endpoint="http://a0:80", state=AgentState.READY,
        capabilities=[CapabilityDigest(name="cap", version="1.0.0", max_concurrency=1, cost_class="A")],
    ), 0.0, lambda: "x")
    core.set_policy("d", PoolPolicy(min_replicas=1, max_replicas=3))
    assert core.scale_up("d", 5, "a burst", 1.0).replicas == 3  # clamped to max_replicas
    with pytest.raises(ValueError, match="max_replicas 3"):
        core.scale_up("d", 1, "again", 2.0)  # the two asked for count as pending
    assert [r.replicas for r in core.take_scale_requests(2.0) if "a burst" in r.reason] == [3]
