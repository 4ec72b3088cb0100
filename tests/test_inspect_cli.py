"""`agentroster describe | agents | status | replay`, run as a user runs them, against a real dev server.

The CLI runs in a subprocess started with `asyncio.create_subprocess_exec`, so
this test's event loop keeps running the worker meanwhile. `describe` of an ended
agent and `replay` are also run after the worker has stopped: the run's result and
its history need no worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from pathlib import Path

from agentroster.models import AgentState, AgentStatus
from agentroster.vocabulary.wire import agent_workflow_id
from tests.conftest import eventually, make_registration, start_agent_workflow

REPO = Path(__file__).resolve().parent.parent
S = AgentState


async def cli(*args: str, timeout: float = 180) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", *args, cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode or 0, out.decode(), err.decode()


def common(stack) -> list[str]:
    return ["--address", stack.env.client.service_client.config.target_host, "--pool", stack.pool, "--task-queue", stack.task_queue]


async def state_is(stack, agent_id: str, state: AgentState) -> bool:
    return (await stack.roster.describe(agent_id)).state == state


async def test_describe_an_agent_drained_across_runs_after_its_workflow_closed(stack) -> None:
    agent_id = "story-1"
    reg = make_registration(agent_id, [("rag.search", "2.1.0", 1, "A")])
    # A small max_signals_per_run: the agent's life spans several continue-as-new runs.
    await start_agent_workflow(stack, reg, max_signals_per_run=3)
    await stack.roster.register(reg)
    lease = await stack.roster.acquire("rag.search", lease_ttl_s=120)
    await eventually(lambda: state_is(stack, agent_id, S.BUSY))

    # Running: the workflow's `status` query, with the pool's lease count.
    code, out, err = await cli("describe", agent_id, *common(stack), "--json")
    assert code == 0, out + err
    running = AgentStatus.model_validate_json(out)
    assert (running.state, running.in_flight, running.indexed_by_pool) == (S.BUSY, 1, True)
    code, out, err = await cli("describe", agent_id, *common(stack))
    assert code == 0, out + err
    assert out.splitlines()[0] == f"agent {agent_id} in pool {stack.pool}: Busy" and "1 lease(s) in flight" in out
    assert "Ready -> Busy (saturated (1 in flight))" in out

    for _ in range(4):
        await stack.roster.heartbeat(agent_id)
    await stack.roster.release(lease)
    await eventually(lambda: state_is(stack, agent_id, S.READY))

    code, out, err = await cli("drain", agent_id, *common(stack), "--reason", "kernel upgrade (OPS-12)", "--deadline", "60")
    assert code == 0, out + err
    final: AgentStatus = await stack.roster.wait_ended(agent_id)
    assert final.terminated_reason == "drain"
    workflow_id = agent_workflow_id(stack.pool, agent_id)

    async def runs_listed() -> list:
        runs = [w async for w in stack.env.client.list_workflows(f'WorkflowId="{workflow_id}"')]
        return runs if len(runs) >= 2 and all(w.close_time for w in runs) else []

    runs = await eventually(runs_listed)  # it continued as new (visibility catches up)
    await stack.stop_worker()  # from here on no worker answers anything

    # Ended: the run's result, which holds the log the workflow carried through every run.
    code, out, err = await cli("describe", agent_id, *common(stack), "--json")
    assert code == 0, out + err
    ended = AgentStatus.model_validate_json(out)
    assert ended == final.model_copy(update={"in_flight": 0})
    steps = [(t.from_state, t.to_state, t.reason) for t in ended.transitions]
    assert steps[:3] == [(None, S.SPAWNING, "workflow started"), (S.SPAWNING, S.REGISTERING, "registered"), (S.REGISTERING, S.READY, "indexed by pool")]
    assert steps[-2:] == [(S.READY, S.DRAINING, "kernel upgrade (OPS-12)"), (S.DRAINING, S.TERMINATED, "drain")]
    assert ended.busy_flips == 1

    code, out, err = await cli("describe", agent_id, *common(stack))
    assert code == 0, out + err
    assert out.splitlines()[0] == f"agent {agent_id} in pool {stack.pool}: Terminated (drain)"
    assert "Ready -> Draining (kernel upgrade (OPS-12))" in out
    assert "Draining -> Terminated (drain)" in out
    assert "load turned it Busy 1 time(s)" in out

    code, _, err = await cli("describe", "nobody", *common(stack))
    assert code == 1 and "no agent nobody has ever registered" in err

    # The recorded history replays against this code, from the server (latest run and the first).
    code, out, err = await cli("replay", workflow_id, "--address", common(stack)[1])
    assert code == 0 and "replayed cleanly" in out, out + err
    oldest = min(runs, key=lambda w: w.start_time)
    code, out, err = await cli("replay", workflow_id, "--run-id", oldest.run_id, "--address", common(stack)[1])
    assert code == 0 and "replayed cleanly" in out, out + err
    code, _, err = await cli("replay", "agent/nowhere/nobody", "--address", common(stack)[1])
    assert code == 2 and "no workflow" in err


async def test_status_keeps_ended_agents_and_agents_lists_by_visibility(stack) -> None:
    await stack.roster.register(make_registration("st-search", [("rag.search", "2.1.0", 2, "A")]))
    await stack.roster.register(make_registration("st-math", [("math.eval", "1.2.0", 2, "A")], deployment="math-agent"))
    await stack.roster.register(make_registration("st-gone", [("rag.search", "3.0.0", 2, "B")]))
    await stack.roster.register(make_registration("st-busy", [("code.run", "1.0.0", 1, "A")], deployment="code-agent"))
    lease = await stack.roster.acquire("code.run")
    await stack.roster.drain("st-busy", reason="maintenance window", deadline_s=600, wait=False)
    ended = await stack.roster.drain("st-gone", reason="retired by ops")
    assert ended.state == S.TERMINATED

    async def pool_knows() -> bool:
        status = await stack.roster.status()
        draining = {a.agent_id: a.drain_reason for a in status.agents if a.state == S.DRAINING}
        return [e.agent_id for e in status.recently_ended] == ["st-gone"] and draining == {"st-busy": "maintenance window"}

    await eventually(pool_knows)

    code, out, err = await cli("status", *common(stack))
    assert code == 0, out + err
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip() and not line.startswith(("pool ", "warning"))}
    assert rows["st-gone"].split()[3:6] == ["Terminated", "-", "-"]
    assert "ago: drain (retired by ops)" in rows["st-gone"]
    assert rows["st-search"].split()[3] == "Ready" and rows["st-math"].split()[3] == "Ready"
    assert rows["st-busy"].split()[3] == "Draining" and "draining: maintenance window" in rows["st-busy"]

    # Visibility is eventually consistent: wait until it has seen the drain and every registration.
    client = stack.env.client

    async def indexed() -> bool:
        running = [w.id async for w in client.list_workflows(f'AgentPool="{stack.pool}" AND AgentCapabilities="rag.search" AND ExecutionStatus="Running"')]
        ready = [w.id async for w in client.list_workflows(f'AgentPool="{stack.pool}" AND AgentState="Ready" AND ExecutionStatus="Running"')]
        closed = [w.id async for w in client.list_workflows(f'AgentPool="{stack.pool}" AND AgentEndReason="drain"')]
        return len(running) == 1 and len(ready) == 2 and len(closed) == 1

    await eventually(indexed, timeout=30)

    code, out, err = await cli("agents", *common(stack), "--capability", "rag.search", "--json")
    assert code == 0, out + err
    listed = json.loads(out)["agents"]
    assert [(a["agent_id"], a["state"], a["capabilities"]) for a in listed] == [("st-search", "Ready", ["rag.search@2.1.0"])]

    code, out, err = await cli("agents", *common(stack), "--capability", "rag.search@>=3", "--ended", "--json")
    assert code == 0, out + err
    listed = json.loads(out)["agents"]
    assert [(a["agent_id"], a["state"], a["status"], a["end_reason"]) for a in listed] == [("st-gone", "Terminated", "Completed", "drain")]

    code, out, err = await cli("agents", *common(stack), "--state", "Ready", "--capability", "math.eval@1.2.0")
    assert code == 0, out + err
    header, *rows_ = out.strip().splitlines()
    assert header.split()[:4] == ["AGENT", "DEPLOYMENT", "STATE", "CAPABILITIES"]
    assert [r.split()[:4] for r in rows_] == [["st-math", "math-agent", "Ready", "math.eval@1.2.0"]]
    await stack.roster.release(lease)


async def test_replay_of_a_stuck_run_prints_the_reset_that_unsticks_it(stack) -> None:
    """A pool run written by other code (a worker from long ago) does not replay with this code:
    `replay` names the diverging workflow task and prints the `temporal workflow reset` for it,
    which the real CLI accepts: the run is reset (a new run, the same workflow id)."""
    from agentroster.workers.devserver import temporal_cli_path
    from tests.old_pool import old_pool, released

    async with old_pool(stack.env.client) as (handle, roster):
        await handle.signal("release", ["lease-1"])
        await handle.signal("release", ["lease-2"])

        async def handled() -> bool:
            return len(await handle.query("released", result_type=list)) == 2

        await eventually(handled)
        address = common(stack)[1]
        code, out, err = await cli("replay", handle.id, "--address", address)
        assert code == 1 and "replay FAILED" in out, out + err
        run_id = (await handle.describe()).run_id
        command = next(line for line in out.splitlines() if line.strip().startswith("temporal workflow reset"))
        assert f"--workflow-id {handle.id} --run-id {run_id} --event-id " in command
        assert " --reapply-exclude Update " in command  # reapplied updates would make a run that does not replay
        code, out, err = await cli("replay", handle.id, "--address", address, "--json")
        assert code == 1 and json.loads(out)["reset_command"] == command.strip()
        proc = await asyncio.create_subprocess_exec(
            temporal_cli_path(), *shlex.split(command)[1:], "--address", address,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, (out_b + err_b).decode()
        reset_run = (await stack.env.client.get_workflow_handle(handle.id).describe()).run_id
        assert reset_run != run_id
        # The new run has what the stuck one was sent (here: both releases).
        assert await eventually(lambda: released(stack.env.client.get_workflow_handle(handle.id), 2)) == ["lease-1", "lease-2"]
