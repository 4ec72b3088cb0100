"""A pool's workflow tasks go ahead of other waiting work (`wire.POOL_PRIORITY`).

Every acquire and release waits on a pool shard, so its workflow tasks take the
task queue's first priority; agents and task workflows keep the default. Checked on
the real dev server from the outside: what `describe` shows for a pool started the
one way every process starts it (`pool_start_options`), across continue-as-new, and
which task a busy worker takes first from its sticky queue.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from agentroster.client.roster import AgentRoster, pool_start_options
from agentroster.vocabulary.shards import ShardLayout
from agentroster.vocabulary.wire import POOL_PRIORITY, PoolInput, agent_workflow_id, pool_workflow_id
from agentroster.workflows.pool import PoolWorkflow
from tests.conftest import Stack, eventually, make_registration


@workflow.defn(name="PriorityTestBusy", sandboxed=False)
class BusyWorkflow:
    """Work of the default priority on the same worker: each `poke` holds the worker for 20 ms."""

    def __init__(self) -> None:
        self.stopped = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self.stopped)

    @workflow.signal
    def poke(self) -> None:
        until = time.perf_counter() + 0.02
        while time.perf_counter() < until:
            pass

    @workflow.signal
    def stop(self) -> None:
        self.stopped = True


async def _priority_key(client: Client, workflow_id: str) -> int:
    described = await client.get_workflow_handle(workflow_id).describe()
    return described.raw_description.workflow_execution_info.priority.priority_key


async def _first_task_started(client: Client, workflow_id: str) -> int:
    """The event time (ns) at which the workflow's first workflow task started."""
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            return event.event_time.ToNanoseconds()
    raise AssertionError(f"{workflow_id}: no workflow task started")


async def test_a_pool_runs_first_in_line_across_continue_as_new_and_agents_keep_the_default(stack: Stack) -> None:
    client = stack.env.client
    assert POOL_PRIORITY.priority_key == 1
    assert await _priority_key(client, pool_workflow_id(stack.pool)) == 1

    # The same start options with a short run: every run after a continue-as-new keeps it.
    pool = f"prio-{uuid.uuid4().hex[:6]}"
    options = {**pool_start_options(pool, 0, ShardLayout()), "arg": PoolInput(pool=pool, max_updates_per_run=20)}
    handle = await client.start_workflow(PoolWorkflow.run, task_queue=stack.task_queue, **options)
    roster = AgentRoster(client, pool=pool, task_queue=stack.task_queue)
    await roster.register(make_registration("prio-agent", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=3600))
    for _ in range(30):
        await roster.release(await roster.acquire("rag.search", timeout=30))
    described = await client.get_workflow_handle(pool_workflow_id(pool)).describe()
    assert described.run_id != handle.first_execution_run_id, "expected the pool to have continued as new"
    assert described.raw_description.workflow_execution_info.priority.priority_key == 1

    # An agent's workflow keeps the task queue's default (unset).
    assert await _priority_key(client, agent_workflow_id(pool, "prio-agent")) == 0
    await roster.close()


async def test_a_busy_worker_takes_the_pools_task_before_older_ones_on_its_sticky_queue(stack: Stack) -> None:
    """Forty workflows cached on the stack's worker each get a signal whose handler holds the
    worker for 20 ms: their tasks queue on its sticky queue. A release sent to the pool just
    after waits behind none of them (the worker's slots aside), where first in, first out it
    would wait behind them all."""
    client = stack.env.client
    chores = [f"{stack.pool}-chore-{i}" for i in range(40)]
    await stack.stop_worker()
    await stack.start_worker(extra_workflows=[BusyWorkflow], max_concurrent_workflow_tasks=2)
    handles = [await client.start_workflow(BusyWorkflow.run, id=w, task_queue=stack.task_queue) for w in chores]
    await stack.roster.release("no-such-lease")  # the pool too has run a task on this worker
    await eventually(lambda: _all_started(client, chores), timeout=30)  # each has run its first task: now sticky

    await asyncio.gather(*(h.signal(BusyWorkflow.poke) for h in handles))
    await stack.roster.release("no-such-lease")
    await asyncio.gather(*(h.signal(BusyWorkflow.stop) for h in handles))
    await asyncio.gather(*(h.result() for h in handles))

    pool_scheduled, pool_started = await _last_task(client, pool_workflow_id(stack.pool))
    ahead = overtaken = 0
    for workflow_id in chores:
        scheduled, started = await _poke_task(client, workflow_id)
        if scheduled < pool_scheduled:
            if started < pool_started:
                ahead += 1
            else:
                overtaken += 1
    # 40 x 20 ms of work arrive within a few ms of each other: the pool's task always meets a
    # backlog, so passing means it overtook at least 36 older tasks (not vacuous on a fast machine).
    assert ahead <= 4, f"{ahead} of {ahead + overtaken} older tasks ran before the pool's: first in, first out"


async def _all_started(client: Client, workflow_ids: list[str]) -> bool:
    for workflow_id in workflow_ids:
        async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                break
        else:
            return False
    return True


async def _last_task(client: Client, workflow_id: str) -> tuple[int, int]:
    """(scheduled, started) event times in ns of the workflow task that accepted its latest update."""
    scheduled = started = 0
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            candidate = event.event_time.ToNanoseconds()
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            task = (candidate, event.event_time.ToNanoseconds())
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            scheduled, started = task
    assert started, f"{workflow_id}: no update accepted"
    return scheduled, started


async def _poke_task(client: Client, workflow_id: str) -> tuple[int, int]:
    """(scheduled, started) event times in ns of the workflow task that took the `poke` signal."""
    seen_poke = False
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            seen_poke = seen_poke or event.workflow_execution_signaled_event_attributes.signal_name == "poke"
        elif seen_poke and event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            scheduled = event.event_time.ToNanoseconds()
        elif seen_poke and event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            return scheduled, event.event_time.ToNanoseconds()
    raise AssertionError(f"{workflow_id}: no task took its poke")
