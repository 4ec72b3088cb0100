"""Outlier ejection and default protection on the real dev server with real HTTP agents (issue 28, items 1 and 2).

Four in-process agent runtimes serve `work.run@1.0.0` over HTTP; tasks go through
`roster.invoke`, whose releases tell the pool how each task went. From the outside:
an agent answering 500 is ejected after the threshold and gets few tasks; a hung
agent is ejected after timeouts; an agent whose failures start mid-run and stop is
ejected, then back after its trial task; a deployment's policy sets its own outlier
settings, and bad ones are refused naming the field; the max-ejection share holds; `status`,
`describe` and the metrics show the ejection; an agent whose reset hook fails refuses
new tasks with 503 and drains. None of it needs a sizing policy.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowUpdateFailedError
import pytest

from agentroster.agent.runtime import AgentRuntime
from agentroster.models import AgentState, OutlierPolicy, PoolPolicy, TaskInput, TaskResult
from agentroster.ops.metrics_exporter import pool_families
from agentroster.vocabulary.wire import pool_workflow_id
from tests.conftest import eventually

CAP = "work.run"
REF = "work.run@==1.0.0"


class Agent:
    """An agent runtime whose task handler does what `mode` says: ok, fail (HTTP 500) or hang."""

    def __init__(self, stack: Any, agent_id: str, mode: str = "ok", deployment: str = "workers") -> None:
        self.mode = mode
        self.calls = 0
        self.never = asyncio.Event()
        self.runtime = AgentRuntime(
            agent_id=agent_id, deployment=deployment, roster=stack.roster, port=0, host="127.0.0.1", heartbeat_interval_s=5.0
        )

        @self.runtime.capability(CAP, "1.0.0", max_concurrency=4)
        async def work(payload: Any) -> Any:
            self.calls += 1
            if self.mode == "fail":
                raise RuntimeError("the model provider answered 500")
            if self.mode == "hang":
                await self.never.wait()
            return {"done": payload}


async def _fleet(stack: Any, modes: list[str]) -> list[Agent]:
    agents = [Agent(stack, f"outl-{i}", mode) for i, mode in enumerate(modes)]
    for agent in agents:
        await agent.runtime.start()
    await eventually(lambda: _routable(stack, len(agents)), timeout=30, interval=0.2)
    return agents


async def _routable(stack: Any, n: int) -> bool:
    return len(await stack.roster.find(REF)) == n


async def _stop(agents: list[Agent]) -> None:
    for agent in agents:
        agent.never.set()
        await agent.runtime.stop(drain=False)


async def _row(stack: Any, agent_id: str) -> Any:
    return next(r for r in (await stack.roster.status()).agents if r.agent_id == agent_id)


async def _ejected(stack: Any, agent_id: str) -> Any:
    row = await _row(stack, agent_id)
    return row if row.ejected and row.ejected_until is not None else None


async def test_an_agent_answering_500_is_ejected_after_the_threshold_and_gets_few_tasks(stack: Any) -> None:
    agents = await _fleet(stack, ["fail", "ok", "ok", "ok"])  # outl-0 sorts first: picked first while idle
    try:
        outputs = [await stack.roster.invoke(REF, {"n": i}, task_timeout_s=10) for i in range(60)]
        assert outputs == [{"done": {"n": i}} for i in range(60)]  # no task failed: each failure failed over
        threshold = OutlierPolicy().consecutive_failures
        assert agents[0].calls == threshold  # then ejected: no more tasks while its ejection lasts
        assert sum(a.calls for a in agents[1:]) == 60
        row = await _ejected(stack, "outl-0")
        assert row is not None and row.ejected == f"{threshold} failed tasks in a row"
        assert row.state == AgentState.READY  # alive, still registered
        described = await stack.roster.describe("outl-0")
        assert described.ejected == row.ejected and described.ejected_until == row.ejected_until
        status = await stack.roster.status()
        assert status.capabilities[CAP].counters["outcome.failed_5xx"] == threshold
        assert status.capabilities[CAP].counters["outcome.succeeded"] == 60
        families = {f.name: f for f in pool_families({stack.pool: status}, per_agent=True)}
        ejected = {tuple(s.labels.values()): s.value for s in families["agentroster_agents_ejected"].samples}
        assert ejected[(stack.pool, "workers")] == 1
        until = {s.labels["agent"]: s.value for s in families["agentroster_agent_ejected_until"].samples}
        assert until == {"outl-0": row.ejected_until.timestamp()}
        outcomes = {s.labels["outcome"]: s.value for s in families["agentroster_task_outcomes"].samples if s.name.endswith("_total")}
        assert outcomes == {"failed_5xx": threshold, "succeeded": 60}
        # The Temporal UI's current details of the pool workflow (the SDK's metadata query).
        meta = await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).query(
            "__temporal_workflow_metadata", result_type=WorkflowMetadata
        )
        assert f"ejected: 1 agent(s): `outl-0` {threshold} failed tasks in a row (until" in meta.current_details
    finally:
        await _stop(agents)


@pytest.mark.slow
async def test_a_hung_agent_is_ejected_after_its_tasks_time_out(stack: Any) -> None:
    agents = await _fleet(stack, ["hang", "ok", "ok", "ok"])
    try:
        outputs = [await stack.roster.invoke(REF, {"n": i}, task_timeout_s=1.0) for i in range(12)]
        assert outputs == [{"done": {"n": i}} for i in range(12)]
        assert agents[0].calls == OutlierPolicy().consecutive_failures
        row = await _ejected(stack, "outl-0")
        assert row is not None and row.ejected == "3 failed tasks in a row"
        counters = (await stack.roster.status()).capabilities[CAP].counters
        assert counters["outcome.failed_timeout"] == 3
    finally:
        await _stop(agents)


@pytest.mark.slow
async def test_an_agent_failing_mid_run_is_ejected_then_back_after_its_trial_task(stack: Any) -> None:
    agents = await _fleet(stack, ["ok", "ok", "ok", "ok"])
    try:
        # Short ejections for the test, set per deployment by a policy that sizes nothing.
        await stack.roster.set_policy("workers", PoolPolicy(outliers=OutlierPolicy(base_ejection_s=2)))
        for i in range(8):
            await stack.roster.invoke(REF, {"n": i}, task_timeout_s=10)
        before = agents[0].calls
        assert before > 0  # it served while healthy
        agents[0].mode = "fail"
        for i in range(12):
            await stack.roster.invoke(REF, {"n": i}, task_timeout_s=10)
        row = await _row(stack, "outl-0")
        assert row.ejected == "3 failed tasks in a row" and agents[0].calls == before + 3
        agents[0].mode = "ok"  # the provider is back
        # After its ejection the agent is routable for one trial task; it succeeds: back for good.
        await eventually(lambda: _probing(stack, "outl-0"), timeout=20, interval=0.2)
        served = agents[0].calls
        for i in range(8):
            await stack.roster.invoke(REF, {"n": i}, task_timeout_s=10)
        assert agents[0].calls > served + 1  # the trial, then more
        row = await _row(stack, "outl-0")
        assert row.ejected is None and row.ejected_until is None
        assert any("outl-0 back in rotation" in w for w in (await stack.roster.status()).warnings)
    finally:
        await _stop(agents)


async def test_a_deployments_policy_sets_its_outlier_settings_and_bad_ones_are_refused_naming_the_field(stack: Any) -> None:
    pool = stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool))
    # Sent raw, as any client could: the pool's update validator refuses them, nothing changes.
    for bad, field in (
        ({"consecutive_failures": 0}, "consecutive_failures"),
        ({"base_ejection_s": 60, "max_ejection_s": 30}, "max_ejection_s"),
        ({"max_ejection_percent": 150}, "max_ejection_percent"),
        ({"success_rate_gap": "wide"}, "success_rate_gap"),
        ({"ejection_s": 5}, "ejection_s"),
    ):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await pool.execute_update("set_policy", {"deployment": "workers", "policy": {"outliers": bad}})
        said = str(refused.value.cause)
        assert "policy.outliers" in said and field in said, (bad, said)
    # Sizing fields need max_replicas: given alone they are refused, not ignored.
    for bad, field in (({"min_replicas": 2}, "min_replicas"), ({"max_uses": 50, "outliers": {}}, "max_uses")):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await pool.execute_update("set_policy", {"deployment": "workers", "policy": bad})
        said = str(refused.value.cause)
        assert f"{field}: sizing needs max_replicas" in said, (bad, said)
    assert await stack.roster.policies() == {}
    agents = await _fleet(stack, ["fail", "ok", "ok", "ok"])
    try:
        # Five failures in a row for this deployment, where the default is three; the policy sizes nothing.
        await stack.roster.set_policy("workers", {"outliers": {"consecutive_failures": 5}})
        policy = (await stack.roster.policies())["workers"]
        assert policy.outliers == OutlierPolicy(consecutive_failures=5) and not policy.sizes
        outputs = [await stack.roster.invoke(REF, {"n": i}, task_timeout_s=10) for i in range(30)]
        assert outputs == [{"done": {"n": i}} for i in range(30)]
        assert agents[0].calls == 5
        row = await _ejected(stack, "outl-0")
        assert row is not None and row.ejected == "5 failed tasks in a row"
    finally:
        await _stop(agents)


@pytest.mark.slow
async def test_a_hung_agent_is_ejected_on_the_task_workflows_road_too(stack: Any) -> None:
    """CapabilityTaskWorkflow's attempts (the `lease_and_invoke` activity) release with the
    outcome as `roster.invoke` does: a task that timed out is a failure."""
    agents = await _fleet(stack, ["hang", "ok", "ok", "ok"])
    try:
        for i in range(6):
            result = await stack.env.client.execute_workflow(
                "CapabilityTaskWorkflow",
                TaskInput(ref=REF, payload={"n": i}, pool=stack.pool, task_timeout_s=1.0),
                id=f"task-{uuid.uuid4().hex[:8]}",
                task_queue=stack.task_queue,
                result_type=TaskResult,
            )
            assert result.output == {"done": {"n": i}}
        row = await eventually(lambda: _ejected(stack, "outl-0"), timeout=20, interval=0.2)
        assert row.ejected == "3 failed tasks in a row"
        counters = (await stack.roster.status()).capabilities[CAP].counters
        assert agents[0].calls >= 3 and counters["outcome.failed_timeout"] == agents[0].calls  # each one it took timed out
    finally:
        await _stop(agents)


async def _probing(stack: Any, agent_id: str) -> bool:
    row = await _row(stack, agent_id)
    return bool(row.ejected and row.ejected.startswith("probing"))


@pytest.mark.slow
async def test_no_more_than_the_max_share_of_a_capabilitys_agents_is_ejected(stack: Any) -> None:
    agents = await _fleet(stack, ["fail", "fail", "fail", "ok"])
    try:
        for i in range(30):
            assert await stack.roster.invoke(REF, {"n": i}, task_timeout_s=10, max_attempts=4) == {"done": {"n": i}}
        status = await stack.roster.status()
        out = sorted(r.agent_id for r in status.agents if r.ejected)
        assert len(out) == 2  # 50% of four, by default
        assert any("not ejected" in w and "max_ejection_percent 50" in w for w in status.warnings)
    finally:
        await _stop(agents)


@pytest.mark.slow
async def test_a_failed_reset_refuses_new_tasks_with_503_and_drains_without_a_policy(stack: Any) -> None:
    agent = Agent(stack, "resetting-0")

    @agent.runtime.on_reset
    def clear_scratch() -> None:
        raise RuntimeError("could not clear the scratch directory")

    await agent.runtime.start()
    try:
        await eventually(lambda: _routable(stack, 1), timeout=30, interval=0.2)
        async with stack.roster.borrow(REF, timeout=10) as lease, aiohttp.ClientSession() as http:
            body = {"lease_id": lease.lease_id, "capability": CAP, "version": lease.version, "input": {"n": 1}}
            url = f"{lease.endpoint}/tasks/{CAP}"
            async with http.post(url, json=body, headers=stack.roster.lease_headers(lease)) as response:
                assert response.status == 200  # the task itself succeeded; the reset after it did not
            async with http.post(url, json=body, headers=stack.roster.lease_headers(lease)) as response:
                assert response.status == 503  # at once: the next task fails over
                assert "clear_scratch" in (await response.json())["error"]
        # It drains itself (its process would exit, and its backend start a fresh one).
        described = await eventually(lambda: _ended(stack, "resetting-0"), timeout=30, interval=0.3)
        assert described.terminated_reason == "drain"
    finally:
        await agent.runtime.stop(drain=False)


async def _ended(stack: Any, agent_id: str) -> Any:
    described = await stack.roster.describe(agent_id)
    return described if described.state == AgentState.TERMINATED else None

