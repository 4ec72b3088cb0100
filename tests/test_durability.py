"""Continue-as-new under load, a worker restart mid-lease, and replay of recorded histories."""

from __future__ import annotations

import asyncio
import uuid

from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from agentroster import AgentState
from agentroster.client.roster import AgentRoster
from agentroster.workflows import workflow_classes, workflow_runner
from agentroster.vocabulary.wire import PoolInput
from tests.conftest import eventually, make_registration, pool_notice_counts, start_agent_workflow


async def test_pool_continues_as_new_under_load_losing_nothing(stack) -> None:
    pool = f"can-{uuid.uuid4().hex[:6]}"
    client = stack.env.client
    await client.start_workflow(
        "PoolWorkflow",
        PoolInput(pool=pool, max_updates_per_run=12, max_signals_per_run=20),
        id=f"pool/{pool}",
        task_queue=stack.task_queue,
    )
    roster = AgentRoster(client, pool=pool, task_queue=stack.task_queue)
    roster._pool_started = True
    for i in range(4):
        await roster.register(make_registration(f"can-agent-{i}", [("rag.search", "2.1.0", 2, "B")]))
    held = await roster.acquire("rag.search", lease_ttl_s=600)  # carried across every run
    counts: dict[str, int] = {}

    async def client_loop() -> None:
        for _ in range(25):
            async with roster.borrow("rag.search", timeout=30) as lease:
                counts[lease.agent_id] = counts.get(lease.agent_id, 0) + 1

    await asyncio.gather(*(client_loop() for _ in range(8)))
    runs = (await roster.status()).runs
    # Under load the client batches releases and tickets, so the count of updates (and
    # runs) varies; 400 leases at 12 updates a run still means several runs.
    assert runs >= 4, f"expected several continue-as-new runs, saw {runs}"
    status = await roster.status()
    assert sum(counts.values()) == 200
    assert status.leases_granted == 201 and status.leases_released == 200
    assert status.active_leases == 1 and status.waiting == 0
    assert sorted(a.agent_id for a in status.agents) == [f"can-agent-{i}" for i in range(4)]
    await roster.release(held)
    await eventually(lambda: _active(roster, 0))


async def _active(roster, n):
    return (await roster.status()).active_leases == n


async def test_agent_continues_as_new_keeping_its_state(stack) -> None:
    client = stack.env.client
    reg = make_registration("chatty", [("rag.search", "2.1.0", 1, "A")])
    await start_agent_workflow(stack, reg, max_signals_per_run=10)
    await stack.roster.register(reg)
    lease = await stack.roster.acquire("rag.search")
    await eventually(lambda: _state(stack.roster, "chatty", AgentState.BUSY))
    for _ in range(34):
        await stack.roster.heartbeat("chatty")
    before_last = (await stack.roster.describe("chatty")).last_heartbeat
    await asyncio.sleep(0.05)
    await stack.roster.heartbeat("chatty")
    # The last heartbeat, sent after several continue-as-new hand-overs, still counts.
    assert (await eventually(lambda: _newer_heartbeat(stack.roster, "chatty", before_last))) is True
    await stack.roster.release(lease)
    # A load notice that meets the agent's run closing as new is refused by the server; the pool
    # checks and sends it again after a pause (1, 2, 3 s; `signal-recheck`), so give it time.
    try:
        status = await eventually(lambda: _state(stack.roster, "chatty", AgentState.READY), timeout=30)
    except AssertionError:
        raise AssertionError(f"not Ready after the release; the pool's notices: {await pool_notice_counts(stack)}") from None
    assert status.registration.agent_id == "chatty"
    states = [t.to_state for t in status.transitions]
    assert states[:3] == [AgentState.SPAWNING, AgentState.REGISTERING, AgentState.READY]
    # Load flips are kept apart from the lifecycle transitions, and carried across runs too.
    assert status.busy_flips == 1 and AgentState.BUSY in [t.to_state for t in status.recent_load_flips]
    desc = await client.get_workflow_handle(f"agent/{stack.pool}/chatty").describe()
    assert desc.run_id != (await _first_run_id(client, f"agent/{stack.pool}/chatty"))


async def _newer_heartbeat(roster, agent_id, than):
    status = await roster.describe(agent_id)
    return status.last_heartbeat is not None and than is not None and status.last_heartbeat > than


async def _first_run_id(client, workflow_id):
    runs = [wf async for wf in client.list_workflows(f'WorkflowId="{workflow_id}"')]
    return sorted(runs, key=lambda wf: wf.start_time)[0].run_id


async def _state(roster, agent_id, state):
    status = await roster.describe(agent_id)
    return status if status.state == state else None


async def test_worker_restart_in_the_middle_of_a_lease(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("survivor", [("rag.search", "2.1.0", 1, "A")]))
    lease = await roster.acquire("rag.search")
    await stack.stop_worker()
    # While no worker runs, the `release` update waits (the client retries it); it lands once one starts.
    releasing = asyncio.create_task(roster.release(lease))
    await stack.start_worker()
    await releasing
    await eventually(lambda: _found(roster, ["survivor"]))
    again = await roster.acquire("rag.search", timeout=5)
    assert again.agent_id == "survivor"
    status = await roster.status()
    assert status.leases_granted == 2 and status.leases_released == 1 and status.active_leases == 1


async def _found(roster, expected):
    return await roster.find("rag.search") == expected


async def test_recorded_histories_replay_deterministically(stack) -> None:
    roster = stack.roster
    await roster.register(make_registration("replayed", [("rag.search", "2.1.0", 1, "A")]))
    lease = await roster.acquire("rag.search")
    await eventually(lambda: _state(roster, "replayed", AgentState.BUSY))
    await roster.release(lease)
    await roster.drain("replayed")
    histories = [
        await stack.env.client.get_workflow_handle(wid).fetch_history()
        for wid in (f"agent/{stack.pool}/replayed", f"pool/{stack.pool}")
    ]
    replayer = Replayer(workflows=workflow_classes(), workflow_runner=workflow_runner(), data_converter=pydantic_data_converter)
    for history in histories:
        result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
        assert result.replay_failure is None
    # Round-trip through JSON, as a developer would replay a downloaded history.
    as_json = histories[0].to_json()
    await replayer.replay_workflow(WorkflowHistory.from_json(f"agent/{stack.pool}/replayed", as_json))


async def test_describe_answers_while_the_agent_continues_as_new(stack) -> None:
    """A status query that meets the run just closed by continue-as-new asks the next run
    (it raised WorkflowContinuedAsNewError: the closed run was taken for an ended agent)."""
    reg = make_registration("flipper", [("rag.search", "2.1.0", 1, "A")])
    await start_agent_workflow(stack, reg, max_signals_per_run=3)
    await stack.roster.register(reg)
    handle = stack.env.client.get_workflow_handle(f"agent/{stack.pool}/flipper")
    first_run = (await handle.describe()).run_id
    for _ in range(40):
        await stack.roster.heartbeat("flipper")
        status = await stack.roster.describe("flipper")
        assert status.state == AgentState.READY and status.registration.agent_id == "flipper"
    assert (await handle.describe()).run_id != first_run  # 40 heartbeats at 3 signals a run
