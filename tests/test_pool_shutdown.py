"""Pool shutdown on the real dev server (`roster.shutdown`, the `shutdown` update, `agentroster shutdown`).

A waiter is told at once, a new acquire raises PoolShutdownError at once (a raw
`acquire` update is rejected with that type), a lease in flight finishes before
the deadline without being cut off, one still held at the deadline is revoked,
every agent workflow ends Terminated after draining with `pool-shutdown`, the
backend is asked to scale every deployment to zero, the pool workflow completes
with its final status and nothing of the pool is left running. A shut-down pool
stays down: a late agent cannot start it again (it is drained instead) until an
operator restarts it. With the local backend, the real agent processes are gone.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from agentroster.core.pool import PoolCore
from agentroster.core.state_codec import encode_state
from agentroster.activities.local_backend import DeploymentSpec, Fleet, FleetDefaults, LocalBackend
from agentroster.client.roster import AgentRoster
from agentroster.errors import LeaseLostError, PoolShutdownError
from agentroster.messages import AcquireRequest
from agentroster.models import POOL_SHUTDOWN_REASON, AgentState, AgentStatus, PoolStatus, TaskInput
from agentroster.vocabulary.wire import (
    AGENT_POOL,
    POOL_SHUT_DOWN,
    REGISTER_SIGNAL,
    AgentWorkflowInput,
    PoolInput,
    agent_workflow_id,
    pool_workflow_id,
)
from agentroster.workers.dev import DevServer
from agentroster.workflows.agent import AgentWorkflow
from agentroster.workflows.task import CapabilityTaskWorkflow
from tests.conftest import Stack, eventually, make_registration, free_port
from tests.test_poison_messages import HUGE, _task_failures

REPO_ROOT = Path(__file__).resolve().parents[1]


async def _running(client: Client, pool: str) -> list[str]:
    """Open workflows of the pool: the pool's own and every agent's (all carry AgentPool)."""
    return [wf.id async for wf in client.list_workflows(f'AgentPool="{pool}" AND ExecutionStatus="Running"')]


async def _nothing_running(stack: Stack) -> bool:
    return await _running(stack.env.client, stack.pool) == []


async def _activities_left_running(client: Client, workflow_id: str) -> list[str]:
    """The activities the workflow's last run scheduled and closed without seeing end: each one's
    worker would report to a closed workflow ("Activity not found on completion")."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    scheduled: dict[int, str] = {}
    for event in history.events:
        kind = event.WhichOneof("attributes")
        if kind == "activity_task_scheduled_event_attributes":
            scheduled[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        elif kind in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                      "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes"):
            scheduled.pop(getattr(event, kind).scheduled_event_id, None)
    return sorted(scheduled.values())


async def _waiting(roster: AgentRoster, count: int) -> bool:
    return (await roster.status()).waiting == count


def _drained_for_shutdown(status: AgentStatus) -> bool:
    return status.state == AgentState.TERMINATED and any(
        t.to_state == AgentState.DRAINING and t.reason == POOL_SHUTDOWN_REASON for t in status.transitions
    )


async def _pool_status(stack: Stack) -> WorkflowExecutionStatus | None:
    return (await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).describe()).status


async def test_shutdown_tells_waiters_lets_the_lease_finish_drains_scales_to_zero_and_ends(stack: Stack) -> None:
    client, roster = stack.env.client, stack.roster
    await roster.register(make_registration("s1", [("rag.search", "2.1.0", 1, "A")], deployment="search-agent"))
    await roster.register(make_registration("c1", [("code.python.exec", "1.0.0", 2, "C")], deployment="code-agent"))
    held = await roster.acquire("rag.search", timeout=5, lease_ttl_s=120)
    waiter = asyncio.create_task(roster.acquire("rag.search", timeout=120))
    await eventually(lambda: _waiting(roster, 1))
    queued_task = await client.start_workflow(
        CapabilityTaskWorkflow.run,
        TaskInput(ref="rag.search", pool=stack.pool, acquire_timeout_s=120),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
    )
    await eventually(lambda: _waiting(roster, 2))

    began = await roster.shutdown(deadline_s=120, wait=False, reason="maintenance")
    assert began.shutting_down and began.shutdown.phase == "finishing-leases"
    assert began.shutdown.waiters_ended == 2 and began.waiting == 0 and began.active_leases == 1

    # Queued callers are told: the client's waiter and the supervisor's child workflow.
    with pytest.raises(PoolShutdownError, match="shutting down: maintenance"):
        await waiter
    with pytest.raises(WorkflowFailureError) as failed:
        await queued_task.result()
    assert isinstance(failed.value.cause, ApplicationError) and failed.value.cause.type == POOL_SHUT_DOWN
    # A new acquire is refused at once (it would otherwise wait its 120 s and raise PoolExhaustedError).
    with pytest.raises(PoolShutdownError) as refused:
        await roster.acquire("code.python.exec", timeout=120)
    assert not refused.value.finished and "grants no new leases" in str(refused.value)
    raw = client.get_workflow_handle(pool_workflow_id(stack.pool))
    with pytest.raises(WorkflowUpdateFailedError) as rejected:
        await raw.execute_update("acquire", {"requests": [AcquireRequest(ref="rag.search", request_id=uuid.uuid4().hex).model_dump(mode="json")]})
    assert isinstance(rejected.value.cause, ApplicationError) and rejected.value.cause.type == POOL_SHUT_DOWN
    assert "shutting down" in rejected.value.cause.message

    # The holder is not cut off: its lease stays active and renewable, its agent still routable.
    await roster.renew(held)
    status = await roster.status()
    assert status.shutdown.phase == "finishing-leases"
    assert {a.agent_id: a.state for a in status.agents} == {"s1": AgentState.READY, "c1": AgentState.READY}
    assert {a.agent_id: a.in_flight for a in status.agents} == {"s1": 1, "c1": 0}
    await roster.release(held)

    final = await roster.shutdown(deadline_s=5)  # a second call: waits for the end, the first deadline stands
    assert final.shutdown.phase == "done" and final.shutdown.finished_at is not None
    assert final.shutdown.leases_at_start == 1 and final.shutdown.leases_revoked == 0 and final.leases_released == 1
    assert final.shutdown.agents_drained == 2 and final.shutdown.agents_left == 0 and final.agents == []
    assert sorted(final.shutdown.deployments_scaled) == ["code-agent", "search-agent"]
    assert final.active_leases == 0 and final.waiting == 0

    for agent_id in ("s1", "c1"):
        ended = await roster.wait_ended(agent_id)
        assert _drained_for_shutdown(ended), ended.transitions
        assert ended.terminated_reason == "drain"  # a roster drain: agent runtimes do not register again
    scales = sorted(call for call in stack.backend.calls if call[0] == "scale")
    assert scales == [("scale", "code-agent", 0), ("scale", "search-agent", 0)]
    assert await _pool_status(stack) == WorkflowExecutionStatus.COMPLETED
    result = await client.get_workflow_handle(pool_workflow_id(stack.pool), result_type=PoolStatus).result()
    assert result == final
    await eventually(lambda: _nothing_running(stack), timeout=20)
    assert await roster.shutdown() == final  # after the end too
    assert await _task_failures(client, pool_workflow_id(stack.pool)) == 0
    assert await _activities_left_running(client, pool_workflow_id(stack.pool)) == []


async def test_a_lease_still_held_at_the_deadline_is_revoked(stack: Stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("s1", [("rag.search", "2.1.0", 2, "A")]))
    held = await roster.acquire("rag.search", timeout=5, lease_ttl_s=600)
    final = await roster.shutdown(deadline_s=1)
    assert final.shutdown.leases_at_start == 1 and final.shutdown.leases_revoked == 1 and final.leases_revoked == 1
    assert any("revoked" in w for w in final.warnings)
    assert final.active_leases == 0
    with pytest.raises(LeaseLostError, match="has shut down"):
        await roster.renew(held)
    await roster.release(held)  # harmless: nothing to return
    assert _drained_for_shutdown(await roster.wait_ended("s1"))
    await eventually(lambda: _nothing_running(stack), timeout=20)


async def test_twice_is_fine_and_a_shut_down_pool_stays_down_until_restarted(stack: Stack) -> None:
    client, roster = stack.env.client, stack.roster
    await roster.register(make_registration("s1", [("rag.search", "2.1.0", 2, "A")]))
    first, second = await asyncio.gather(roster.shutdown(deadline_s=5), roster.shutdown(deadline_s=50))
    assert first == second and first.shutdown.phase == "done"
    assert await roster.shutdown() == first
    run_id = (await client.get_workflow_handle(pool_workflow_id(stack.pool)).describe()).run_id

    fresh = AgentRoster(client, pool=stack.pool, task_queue=stack.task_queue)
    with pytest.raises(PoolShutdownError, match="has shut down") as down:
        await fresh.ensure_pool()
    assert down.value.finished and down.value.status == first
    with pytest.raises(PoolShutdownError):
        await fresh.register(make_registration("late"))
    with pytest.raises(PoolShutdownError, match="has shut down"):
        await roster.acquire("rag.search", timeout=60)

    # The race: an agent workflow that starts anyway (a pod that registered late) tells
    # its pool by signal-with-start. The pool is not started again: the agent is drained.
    registration = make_registration("straggler", [("rag.search", "2.1.0", 2, "A")])
    await client.start_workflow(
        AgentWorkflow.run,
        AgentWorkflowInput(agent_id="straggler", pool=stack.pool),
        id=agent_workflow_id(stack.pool, "straggler"),
        task_queue=stack.task_queue,
        start_signal=REGISTER_SIGNAL,
        start_signal_args=[registration.model_dump(mode="json")],
    )
    straggler = await roster.wait_ended("straggler")
    assert _drained_for_shutdown(straggler), straggler.transitions
    description = await client.get_workflow_handle(pool_workflow_id(stack.pool)).describe()
    assert description.status == WorkflowExecutionStatus.COMPLETED and description.run_id == run_id

    # An operator starts it again.
    await fresh.ensure_pool(restart=True)
    await fresh.register(make_registration("again", [("rag.search", "2.1.0", 2, "A")]))
    lease = await fresh.acquire("rag.search", timeout=5)
    await fresh.release(lease)
    assert (await fresh.status()).shutdown is None
    final = await fresh.shutdown(deadline_s=1)
    assert final.shutdown.agents_drained == 1
    await eventually(lambda: _nothing_running(stack), timeout=20)


async def test_a_shutdown_carries_on_across_continue_as_new(stack: Stack) -> None:
    client = stack.env.client
    pool = f"can-{stack.pool}"
    await client.start_workflow(
        "PoolWorkflow",
        PoolInput(pool=pool, max_updates_per_run=3),
        id=pool_workflow_id(pool),
        task_queue=stack.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(AGENT_POOL, pool)]),
    )
    roster = AgentRoster(client, pool=pool, task_queue=stack.task_queue)
    await roster.register(make_registration("s1", [("rag.search", "2.1.0", 2, "A")]))
    held = await roster.acquire("rag.search", timeout=5, lease_ttl_s=120)
    await roster.shutdown(deadline_s=120, wait=False)
    runs_before = (await roster.status()).runs
    for _ in range(4):  # updates while shutting down: the run continues as new with the shutdown in its state
        held = await roster.renew(held)
    assert (await roster.status()).runs > runs_before
    status = await roster.status()
    assert status.shutdown.phase == "finishing-leases" and status.active_leases == 1
    with pytest.raises(PoolShutdownError):
        await roster.acquire("rag.search", timeout=60)
    await roster.release(held)
    final = await roster.shutdown()  # the result of the last run
    assert final.shutdown.phase == "done" and final.shutdown.leases_revoked == 0 and final.shutdown.agents_drained == 1
    assert _drained_for_shutdown(await roster.wait_ended("s1"))
    await eventually(lambda: _none_running(client, pool), timeout=20)
    assert await _activities_left_running(client, pool_workflow_id(pool)) == []


async def test_a_run_that_starts_with_its_shutdown_over_ends_by_itself(stack: Stack) -> None:
    """A run can continue as new in the task where its shutdown's last wait ended (the agents'
    last words came in that task): the next run then carries a shutdown with nothing left to
    wait for, and no message will come to wake it. It ends at once, on its own."""
    client = stack.env.client
    pool = f"over-{stack.pool}"
    core = PoolCore(pool)
    assert core.begin_shutdown("stop", 60, time.time())  # no agent, no deployment: nothing to wait for
    assert core.shutdown is not None and core.shutdown.phase == "draining-agents"
    handle = await client.start_workflow(
        "PoolWorkflow",
        PoolInput(pool=pool, state=encode_state(core.to_state()), runs=2),
        id=pool_workflow_id(pool),
        task_queue=stack.task_queue,
        search_attributes=TypedSearchAttributes([SearchAttributePair(AGENT_POOL, pool)]),
    )
    final = PoolStatus.model_validate(await asyncio.wait_for(handle.result(), timeout=30))
    assert final.shutdown is not None and final.shutdown.phase == "done" and final.shutdown.reason == "stop"


async def _none_running(client: Client, pool: str) -> bool:
    return await _running(client, pool) == []


async def test_bad_shutdown_arguments_are_refused_and_break_nothing(stack: Stack) -> None:
    client, roster = stack.env.client, stack.roster
    await roster.register(make_registration("steady", [("rag.search", "2.1.0", 1, "A")]))
    raw = client.get_workflow_handle(pool_workflow_id(stack.pool))
    bad: list[tuple[str, list[Any]]] = [
        ("two arguments", [{"deadline_s": 1}, {"deadline_s": 2}]),
        ("a string", ["soon"]),
        ("a number", [42]),
        ("a list", [[1, 2]]),
        ("NaN", [{"deadline_s": math.nan}]),
        ("infinity", [{"deadline_s": math.inf}]),
        ("negative", [{"deadline_s": -1}]),
        ("too far", [{"deadline_s": 10.0**9}]),
        ("a string deadline", [{"deadline_s": "later"}]),
        ("an empty reason", [{"reason": ""}]),
        ("an unknown field", [{"deadline_s": 1, "force": True}]),
        ("huge", [{"reason": HUGE}]),
        ("a protobuf", [WorkflowExecution(workflow_id="proto")]),
    ]
    for what, args in bad:
        with pytest.raises((WorkflowUpdateFailedError, RPCError)) as refused:
            await raw.execute_update("shutdown", args=args)
        if isinstance(refused.value, WorkflowUpdateFailedError):
            assert "shutdown" in str(refused.value.cause), what
    with pytest.raises(ValidationError, match="deadline_s"):
        await roster.shutdown(deadline_s=-1)
    status = await roster.status()
    assert status.shutdown is None and not status.shutting_down
    lease = await roster.acquire("rag.search", timeout=5)  # still serving
    await roster.release(lease)
    assert await _task_failures(client, pool_workflow_id(stack.pool)) == 0
    # No argument at all is a shutdown with the defaults.
    began = PoolStatus.model_validate(await raw.execute_update("shutdown", args=[]))
    assert began.shutdown.reason == "shutdown requested"
    assert (await roster.shutdown()).shutdown.phase == "done"
    assert await _task_failures(client, pool_workflow_id(stack.pool)) == 0


async def _cli(*args: str) -> tuple[int, str, str]:
    """The CLI as a user runs it (a separate process; this loop keeps running the worker)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode or 0, out.decode(), err.decode()


async def test_the_shutdown_command(stack: Stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("cli-agent", [("rag.search", "2.1.0", 2, "A")]))
    address = stack.env.client.service_client.config.target_host
    where = ["--address", address, "--pool", stack.pool, "--task-queue", stack.task_queue]
    code, _, err = await _cli("shutdown", *where, "--deadline", "-1")
    assert code == 2 and "deadline_s" in err
    assert (await roster.status()).shutdown is None
    lease = await roster.acquire("rag.search", timeout=5)

    code, out, err = await _cli("shutdown", *where, "--no-wait", "--deadline", "60", "--reason", "from the cli")
    assert code == 0, err
    assert f"pool {stack.pool}: shutting down (from the cli), finishing-leases" in out and "1 lease(s) in flight" in out
    await roster.release(lease)
    code, out, err = await _cli("shutdown", *where)
    assert code == 0, err
    assert f"pool {stack.pool} shut down (from the cli)" in out
    assert "leases in flight: 1 (1 finished, 0 revoked at the deadline)" in out
    assert "agents drained (pool-shutdown): 1" in out and "deployments scaled to 0: search-agent" in out
    code, again, err = await _cli("shutdown", *where)
    assert code == 0 and again.splitlines()[-5:] == out.splitlines()[-5:]
    code, out, err = await _cli("status", *where)
    assert code == 0 and f"pool {stack.pool} shut down" in out
    code, _, err = await _cli("shutdown", "--address", address, "--pool", f"never-{stack.pool}")
    assert code == 1 and "not running" in err

    # A worker (re)started on the shut-down pool leaves it down, unless asked to restart it.
    run_id = (await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).describe()).run_id
    said = await _worker_until(where, "has shut down")
    assert "--restart-pool" in said
    description = await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).describe()
    assert description.status == WorkflowExecutionStatus.COMPLETED and description.run_id == run_id
    await _worker_until([*where, "--restart-pool"], "agentroster worker: task queue")
    assert await _pool_status(stack) == WorkflowExecutionStatus.RUNNING
    assert (await roster.shutdown(deadline_s=1)).shutdown.phase == "done"
    await eventually(lambda: _nothing_running(stack), timeout=20)


async def _worker_until(args: list[str], text: str) -> str:
    """Run `agentroster worker` until it prints `text`, then Ctrl-C it; returns what it printed."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", "worker", "--backend", "none", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ},
    )
    assert process.stdout is not None
    seen: list[str] = []
    try:
        while not any(text in line for line in seen):
            line = await asyncio.wait_for(process.stdout.readline(), timeout=60)
            assert line, "".join(seen)
            seen.append(line.decode())
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0, "".join(seen)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return "".join(seen)


# ------------------------------------------------------------ local backend
@pytest.mark.slow
async def test_shutdown_stops_the_real_agent_processes(stack: Stack, tmp_path: Path) -> None:
    fleet = Fleet(
        defaults=FleetDefaults(heartbeat_interval_s=2),
        deployments=[
            # min=1: the fleet's floor for sizing; a shutdown goes to zero anyway.
            DeploymentSpec(name="math-agent", command=["{python}", "-m", "examples.math_agent"], replicas=2, min=1, max=3)
        ],
        base_dir=REPO_ROOT,
    )
    backend = LocalBackend(fleet=fleet, roster=stack.roster, reconcile_interval_s=0.2, stop_grace_s=15, log_dir=tmp_path / "logs")
    await stack.stop_worker()
    stack.backend = backend
    await stack.start_worker()
    await backend.start()
    try:
        await eventually(lambda: _routable(stack.roster, 2), timeout=60, interval=0.2)
        processes = [pod.pid for pod in backend.pods()]
        assert len(processes) == 2
        lease = await stack.roster.acquire("math.eval@>=1,<2", timeout=30)
        shutdown = asyncio.create_task(stack.roster.shutdown(deadline_s=90, reason="test"))
        await eventually(lambda: _shutting_down(stack.roster))
        # The holder works on after the shutdown began: its agent still serves it.
        async with aiohttp.ClientSession() as http:
            body = {"lease_id": lease.lease_id, "capability": "math.eval", "version": lease.version, "input": {"expression": "6*7"}}
            async with http.post(f"{lease.endpoint}/tasks/math.eval", json=body, headers=stack.roster.lease_headers(lease)) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["output"]["value"] == 42
        await stack.roster.release(lease)
        final = await shutdown
        assert final.shutdown.leases_revoked == 0 and final.shutdown.deployments_scaled == ["math-agent"]
        assert await backend.current_replicas("math-agent") == 0
        await eventually(lambda: not backend.pods(), timeout=60, interval=0.2)
        assert not [pid for pid in processes if _alive(pid)]
        for agent in backend.pods(include_exited=True):
            assert _drained_for_shutdown(await stack.roster.wait_ended(agent.agent_id))
        await eventually(lambda: _nothing_running(stack), timeout=20)
    finally:
        await backend.stop()


async def _routable(roster: AgentRoster, count: int) -> bool:
    return len(await roster.find("math.eval@>=1,<2")) >= count


async def _shutting_down(roster: AgentRoster) -> bool:
    return (await roster.status()).shutting_down


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------ agentroster dev
@pytest.mark.slow
async def test_dev_ctrl_c_shuts_the_pool_down_before_stopping(tmp_path: Path) -> None:
    port, ui_port = free_port(), free_port()
    db = tmp_path / "state" / "temporal.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", "dev", "--port", str(port), "--ui-port", str(ui_port), "--db", str(db),
        cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    output: list[str] = []

    async def read_until(text: str) -> None:
        while not any(text in line for line in output):
            line = await process.stdout.readline()  # type: ignore[union-attr]
            assert line, "".join(output)[-4000:]
            output.append(line.decode())

    try:
        await asyncio.wait_for(read_until("plan ok"), timeout=180)
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(read_until("stopped."), timeout=180)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0, "".join(output)[-4000:]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = "".join(output)
    assert "shutting down pool default" in text and "pool default shut down (agentroster dev stopped)" in text, text[-4000:]
    server = DevServer(port, ui_port, db)
    assert await server.start()
    try:
        client = await Client.connect(server.address)
        assert (await client.get_workflow_handle(pool_workflow_id("default")).describe()).status == WorkflowExecutionStatus.COMPLETED
        running = [wf.id async for wf in client.list_workflows('ExecutionStatus="Running"')]
        assert running == []
        drained = [wf.id async for wf in client.list_workflows('WorkflowType="AgentWorkflow" AND AgentState="Terminated"')]
        assert len(drained) >= 4
    finally:
        server.stop()


async def test_a_drain_delivery_that_found_every_agent_running_is_no_refusal(stack: Stack) -> None:
    """The shutdown's drains are awaited: their activity reports `gone` even when it found every
    agent workflow running, with an empty list. That report is applied, never refused."""
    await stack.roster.register(make_registration("steady", [("rag.search", "2.1.0", 1, "A")]))
    pool = stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool))
    await pool.execute_update("report", {"key": "drains-1", "kind": "gone", "result": []})
    await pool.execute_update("report", {"key": "drains-2", "kind": "gone", "result": ["nobody-here"]})
    status = await stack.roster.status()
    assert status.refusals == [] and [a.agent_id for a in status.agents] == ["steady"]
