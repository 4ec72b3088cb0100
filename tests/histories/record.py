"""Record the histories that `tests/test_replay_histories.py` replays.

    .venv/bin/python tests/histories/record.py            # record every scenario
    .venv/bin/python tests/histories/record.py tasks       # only the named scenarios

Starts its own Temporal dev server (the settings of `tests/conftest.py`), a
worker with the `none` backend and, for the task scenarios, small HTTP agents;
drives each scenario through the public client, then writes every run of the
workflows it names to `tests/histories/<name>.json` (`<name>_runN.json` when
the workflow continued as new): the JSON of `WorkflowHistory.to_json()` (the format
`temporal workflow show --output json` exports), written one event per line.

Read tests/histories/README.md first: before the first published release a
workflow change re-records the histories it touches (`--overwrite`); from the
first release on, a release's histories are never re-recorded. A history already
on disk is kept (the new recording of it is dropped) unless `--overwrite` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the repository root, for `agentroster`

from aiohttp import web  # noqa: E402
from temporalio.client import Client, WorkflowFailureError, WorkflowHistory  # noqa: E402
from temporalio.common import SearchAttributePair, TypedSearchAttributes  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402

from agentroster.activities.backend import NoneBackend  # noqa: E402
from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.errors import CapabilityUnknownError, PoolExhaustedError, PoolShutdownError
from agentroster.models import AgentRegistration, AgentState, Capability, RoutingTable, TaskInput, TaskResult
from agentroster.client.lease_tokens import generate_key  # noqa: E402
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path  # noqa: E402
from agentroster.ops.ports import free_port  # noqa: E402
from agentroster.workers.worker import create_worker  # noqa: E402
from agentroster.vocabulary.wire import (  # noqa: E402
    POOL_ALARM,
    AGENT_POOL,
    REGISTER_SIGNAL,
    SEARCH_ATTRIBUTES,
    AgentWorkflowInput,
    PoolInput,
    agent_workflow_id,
    pool_workflow_id,
)

log = logging.getLogger("record")
TASK_QUEUE = "histories"

MATH_INPUT = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
MATH_OUTPUT = {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}


# ------------------------------------------------------------------ helpers
def registration(
    agent_id: str,
    *,
    capability: str = "rag.search",
    version: str = "2.1.0",
    max_concurrency: int = 1,
    cost_class: str = "B",
    deployment: str = "search-agent",
    endpoint: str = "http://127.0.0.1:9",
    heartbeat_interval_s: float = 30.0,
    input_schema: dict[str, Any] | None = None,
    output_schema: dict[str, Any] | None = None,
) -> AgentRegistration:
    return AgentRegistration(
        agent_id=agent_id,
        deployment=deployment,
        endpoint=endpoint,
        heartbeat_interval_s=heartbeat_interval_s,
        capabilities=[
            Capability(
                name=capability,
                version=version,
                max_concurrency=max_concurrency,
                cost_class=cost_class,  # type: ignore[arg-type]
                input_schema=input_schema or {"type": "object"},
                output_schema=output_schema or {},
            )
        ],
    )


def math_registration(agent_id: str, endpoint: str, cost_class: str, heartbeat_interval_s: float = 30.0) -> AgentRegistration:
    return registration(
        agent_id,
        capability="math.eval",
        version="1.2.0",
        max_concurrency=2,
        cost_class=cost_class,
        deployment="math-agent",
        endpoint=endpoint,
        heartbeat_interval_s=heartbeat_interval_s,
        input_schema=MATH_INPUT,
        output_schema=MATH_OUTPUT,
    )


async def eventually(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what} (last value {value!r})")
        await asyncio.sleep(0.05)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MathAgent:
    """A real HTTP agent: `POST /tasks/math.eval` sums the expression (after `delay_s`, or never with `hang`)."""

    def __init__(self, delay_s: float = 0.0, hang: bool = False) -> None:
        self.delay_s = delay_s
        self.hang = hang
        self.received = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/tasks/{capability}", self._task)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _task(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.set()
        if self.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s)
        expression = body["input"]["expression"]
        return web.json_response({"output": {"value": float(sum(int(x) for x in expression.split("+")))}})


def one_event_per_line(history: WorkflowHistory) -> str:
    """`history.to_json()`, re-indented with one event per line: the same JSON document,
    a third smaller than the indented form, and a diff shows which events changed."""
    events = json.loads(history.to_json())["events"]
    lines = ",\n".join(json.dumps(event, separators=(",", ":")) for event in events)
    return '{"events":[\n' + lines + "\n]}\n"


class Recorder:
    def __init__(self, client: Client, out: Path, overwrite: bool) -> None:
        self.client = client
        self.out = out
        self.overwrite = overwrite
        self.written: list[Path] = []
        self._key = generate_key()
        self._worker: Any = None
        self._running: asyncio.Task[None] | None = None

    async def restart_worker(self, **options: Any) -> None:
        """(Re)start the one worker, e.g. with a patch activation callback for a scenario that records an older path."""
        await self.stop_worker()
        # The recorded agents are plain HTTP servers that check no token; the worker still signs.
        self._worker = create_worker(self.client, task_queue=TASK_QUEUE, backend=NoneBackend(), lease_key=self._key, **options)
        self._running = asyncio.create_task(self._worker.run())

    async def stop_worker(self) -> None:
        if self._worker is not None and self._running is not None:
            await self._worker.shutdown()
            await self._running
        self._worker = self._running = None

    async def settle(self, workflow_id: str) -> None:
        """Wait until the run has no workflow task or activity in progress (its history stops moving)."""

        async def quiet() -> bool:
            desc = await self.client.get_workflow_handle(workflow_id).describe()
            raw = desc.raw_description
            # (a pool's alarm sleeps until its next deadline: not work in progress)
            busy = [a for a in raw.pending_activities if a.activity_type.name != POOL_ALARM]
            return not raw.HasField("pending_workflow_task") and not busy

        await asyncio.sleep(0.5)  # signals in flight land first
        await eventually(quiet, f"{workflow_id} to settle")

    async def end(self, workflow_id: str) -> None:
        """Terminate a run that never ends by itself (a pool), once it is idle, so its history is complete."""
        await self.settle(workflow_id)
        await self.client.get_workflow_handle(workflow_id).terminate("history recorded")

    async def save(self, workflow_id: str, name: str) -> None:
        """Write every run of `workflow_id` (oldest first): `name.json`, or `name_runN.json` after continue-as-new.

        A recording already on disk is kept (and this one dropped) unless `--overwrite`.
        """
        existing = sorted([*self.out.glob(f"{name}.json"), *self.out.glob(f"{name}_run*.json")])
        if existing and not self.overwrite:
            log.warning("kept the existing %s (recorded histories are not re-recorded; see README.md)", ", ".join(p.name for p in existing))
            return
        for path in existing:
            path.unlink()
        histories: list[WorkflowHistory] = []
        run_id: str | None = None  # None: the latest run
        while True:
            history = await self.client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
            histories.insert(0, history)
            started = history.events[0].workflow_execution_started_event_attributes
            run_id = started.continued_execution_run_id or None
            if run_id is None:
                break
        for i, history in enumerate(histories, start=1):
            filename = f"{name}.json" if len(histories) == 1 else f"{name}_run{i}.json"
            path = self.out / filename
            text = one_event_per_line(history)
            path.write_text(text)
            self.written.append(path)
            log.info("wrote %s (%d events, %.1f KB)", path.name, len(history.events), len(text) / 1024)


# ------------------------------------------------------------------ scenarios
async def agent_register_lease_drain(rec: Recorder) -> None:
    """Register, a lease makes it Busy, a heartbeat, release (Ready), drain to Terminated (delete_pod)."""
    roster = AgentRoster(rec.client, pool="agents", task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("agent-a"))
    lease = await roster.acquire("rag.search@>=2,<3", lease_ttl_s=120)
    await eventually(lambda: _state_is(roster, "agent-a", AgentState.BUSY), "agent-a busy")
    await roster.heartbeat("agent-a")
    await roster.release(lease)
    await eventually(lambda: _state_is(roster, "agent-a", AgentState.READY), "agent-a ready")
    final = await roster.drain("agent-a", reason="scale-down", deadline_s=60)
    assert final.state == AgentState.TERMINATED, final
    await rec.save(agent_workflow_id("agents", "agent-a"), "agent_register_lease_drain")


async def agent_heartbeat_lost(rec: Recorder) -> None:
    """A 1 s heartbeat interval, two heartbeats, then silence: it asks its pool (`request_eviction`),
    allowed: Terminated with heartbeat_lost, `delete_pod`."""
    roster = AgentRoster(rec.client, pool="agents", task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("agent-silent", heartbeat_interval_s=1.0))
    for _ in range(2):
        await asyncio.sleep(0.5)
        await roster.heartbeat("agent-silent")
    final = await asyncio.wait_for(roster.wait_ended("agent-silent"), timeout=30)
    assert final.terminated_reason == "heartbeat_lost", final
    await rec.save(agent_workflow_id("agents", "agent-silent"), "agent_heartbeat_lost")


async def agent_continue_as_new(rec: Recorder) -> None:
    """max_signals_per_run=4: register, lease (Busy), heartbeats across runs, release, drain in the last run."""
    pool = "agents-can"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    reg = registration("agent-chatty")
    await rec.client.start_workflow(
        "AgentWorkflow",
        AgentWorkflowInput(agent_id="agent-chatty", pool=pool, max_signals_per_run=4),
        id=agent_workflow_id(pool, "agent-chatty"),
        task_queue=TASK_QUEUE,
        start_signal=REGISTER_SIGNAL,
        start_signal_args=[reg.model_dump(mode="json")],
        search_attributes=TypedSearchAttributes([SearchAttributePair(AGENT_POOL, pool)]),
    )
    await roster.register(reg)  # already started: waits until routable
    lease = await roster.acquire("rag.search", lease_ttl_s=120)
    await eventually(lambda: _state_is(roster, "agent-chatty", AgentState.BUSY), "agent-chatty busy")
    for _ in range(6):
        await roster.heartbeat("agent-chatty")
        await asyncio.sleep(0.1)
    await roster.release(lease)
    await eventually(lambda: _state_is(roster, "agent-chatty", AgentState.READY), "agent-chatty ready")
    final = await roster.drain("agent-chatty", deadline_s=60)
    assert final.state == AgentState.TERMINATED, final
    await rec.save(agent_workflow_id(pool, "agent-chatty"), "agent_continue_as_new")
    await rec.end(pool_workflow_id(pool))


async def agent_lost_with_lease(rec: Recorder) -> None:
    """Capacity 1, its lease held, a 1 s heartbeat interval, then silence: Busy -> Terminated
    heartbeat_lost (AgentEndReason), the pool revokes the lease."""
    pool = "timeline-lost"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("agent-gone", max_concurrency=1, heartbeat_interval_s=1.0, deployment="gone-agent"))
    lease = await roster.acquire("rag.search", lease_ttl_s=120)
    await eventually(lambda: _state_is(roster, "agent-gone", AgentState.BUSY), "agent-gone busy")
    final = await asyncio.wait_for(roster.wait_ended("agent-gone"), timeout=30)
    assert final.terminated_reason == "heartbeat_lost", final
    await eventually(lambda: _revoked(roster), "the lease revoked")
    await rec.save(agent_workflow_id(pool, "agent-gone"), "agent_lost_with_lease")
    await rec.end(pool_workflow_id(pool))


async def _revoked(roster: AgentRoster) -> bool:
    status = await roster.status()
    return status.leases_revoked >= 1 and status.active_leases == 0


async def pool_leases_queue_expiry(rec: Recorder) -> None:
    """Acquire, a queued waiter served by a release, a renewed short lease that then expires,
    a waiter that gives up (`cancel`), an unknown capability, and a drained agent."""
    pool = "leases"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("lease-agent", max_concurrency=1))
    first = await roster.acquire("rag.search", lease_ttl_s=120, holder="recorder")
    waiter = asyncio.create_task(roster.acquire("rag.search", timeout=20, lease_ttl_s=3, holder="waiter"))
    await eventually(lambda: _pool(roster, "waiting", 1), "a waiter")
    await roster.release(first)
    short = await waiter
    renewed = await roster.renew(short, 3)
    assert renewed.deadline > short.deadline
    try:
        await roster.acquire("rag.search", timeout=0.5)  # the slot is taken: queued, then gives up
        raise AssertionError("expected PoolExhaustedError")
    except PoolExhaustedError:
        pass
    try:
        await roster.acquire("nobody.offers@>=1", timeout=0.5)
        raise AssertionError("expected CapabilityUnknownError")
    except CapabilityUnknownError:
        pass
    await eventually(lambda: _pool(roster, "leases_expired", 1), "the short lease to expire", timeout=15)
    again = await roster.acquire("rag.search", lease_ttl_s=120)
    await roster.release(again)
    await eventually(lambda: _pool(roster, "active_leases", 0), "no active lease")
    await roster.drain("lease-agent", deadline_s=30)
    await eventually(lambda: _pool_agents(roster, 0), "the drained agent to leave the index")
    await rec.end(pool_workflow_id(pool))
    await rec.save(pool_workflow_id(pool), "pool_leases_queue_expiry")


async def pool_release_and_acquire(rec: Recorder) -> None:
    """A release riding on the next acquire (the `acquire` update's `releases`: the release first, its slot
    serves the acquire), then a parked release that goes alone when no acquire comes."""
    pool = "piggyback"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("one-slot-agent", max_concurrency=1))
    first = await roster.acquire("rag.search", lease_ttl_s=120, holder="recorder")
    roster.release_later(first, within_s=30.0)
    second = await roster.acquire("rag.search", timeout=0, lease_ttl_s=120, holder="recorder")
    roster.release_later(second, within_s=0.05)
    await eventually(lambda: _pool(roster, "active_leases", 0), "the lone release")
    await rec.end(pool_workflow_id(pool))
    await rec.save(pool_workflow_id(pool), "pool_release_and_acquire")


async def pool_continue_as_new(rec: Recorder) -> None:
    """max_updates_per_run=3: registrations, a lease held across runs, acquire/release cycles, a queued waiter."""
    pool = "pool-can"
    await rec.client.start_workflow(
        "PoolWorkflow",
        PoolInput(pool=pool, max_updates_per_run=3, max_signals_per_run=6),
        id=pool_workflow_id(pool),
        task_queue=TASK_QUEUE,
        search_attributes=TypedSearchAttributes([SearchAttributePair(AGENT_POOL, pool)]),
    )
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()  # already running: a no-op
    await roster.register(registration("can-agent-1", max_concurrency=1))
    await roster.register(registration("can-agent-2", max_concurrency=1))
    held = await roster.acquire("rag.search", lease_ttl_s=600)  # carried across every run
    for _ in range(3):
        lease = await roster.acquire("rag.search", timeout=10, lease_ttl_s=60)
        waiter = asyncio.create_task(roster.acquire("rag.search", timeout=10, lease_ttl_s=60))
        await eventually(lambda: _pool(roster, "waiting", 1), "a waiter")
        await roster.release(lease)
        await roster.release(await waiter)
        await eventually(lambda: _pool(roster, "active_leases", 1), "only the held lease")
    runs = (await roster.status()).runs
    assert runs >= 2, f"expected the pool to continue as new, it ran {runs + 1} run(s)"
    status = await roster.status()
    assert status.leases_granted == 7 and status.leases_released == 6, status
    await roster.release(held)
    await eventually(lambda: _pool(roster, "active_leases", 0), "no active lease")
    await rec.end(pool_workflow_id(pool))
    await rec.save(pool_workflow_id(pool), "pool_continue_as_new")
    for agent_id in ("can-agent-1", "can-agent-2"):
        await rec.client.get_workflow_handle(agent_workflow_id(pool, agent_id)).terminate("history recorded")


async def tasks(rec: Recorder) -> None:
    """CapabilityTaskWorkflow, one `lease_and_invoke` per attempt: a success (the activity renews
    the 3 s lease: nothing in the workflow's history), a failover from an unreachable agent, a
    task that waits in the pool's queue inside its activity, a forged `lease_revoked` that stops
    an attempt (`recover_lease` finds the lease still held: the notice is refused, the attempt
    runs again), a failover after the pool revoked the lease of an agent that died mid-task
    (`lease_revoked`); and the pool that served them."""
    pool = "tasks"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    slow = MathAgent(delay_s=1.5)  # longer than a third of the 3 s lease: one renewal, by the activity
    dying = MathAgent(hang=True)
    agents = [slow, dying]
    try:
        alive_url = await slow.start()
        await roster.register(math_registration("math-alive", alive_url, "C"))

        async def run(task_id: str, **options: Any) -> TaskResult:
            options = {"acquire_timeout_s": 10, "lease_ttl_s": 3, **options}
            return await rec.client.execute_workflow(
                "CapabilityTaskWorkflow",
                TaskInput(ref="math.eval@>=1,<2", payload={"expression": "2+3+4"}, pool=pool, **options),
                id=task_id,
                task_queue=TASK_QUEUE,
                result_type=TaskResult,
            )

        ok = await run("task-success")
        assert (ok.agent_id, ok.attempts, ok.output) == ("math-alive", 1, {"value": 9.0}), ok
        await rec.save("task-success", "task_success")

        # The cheapest agent (cost A) is tried first and cannot be reached.
        await roster.register(math_registration("math-unreachable", f"http://127.0.0.1:{closed_port()}", "A"))
        failover = await run("task-failover", record_agents_served=True)
        assert (failover.agent_id, failover.attempts) == ("math-alive", 2), failover
        await rec.save("task-failover", "task_failover")
        await roster.drain("math-unreachable", deadline_s=30)

        # Both slots of math-alive are held: the task waits in the pool's queue, then is granted.
        held = [await roster.acquire("math.eval", lease_ttl_s=120) for _ in range(2)]
        handle = await rec.client.start_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="math.eval", payload={"expression": "20+22"}, pool=pool, acquire_timeout_s=30, lease_ttl_s=3),
            id="task-queued",
            task_queue=TASK_QUEUE,
            result_type=TaskResult,
        )
        await eventually(lambda: _pool(roster, "waiting", 1), "the task to queue")
        await roster.release(held[0])
        queued = await asyncio.wait_for(handle.result(), timeout=30)
        assert (queued.agent_id, queued.attempts) == ("math-alive", 1), queued
        await roster.release(held[1])
        await rec.save("task-queued", "task_queued_grant")
        await eventually(lambda: _pool(roster, "active_leases", 0), "no active lease")

        slow.delay_s = 4.0
        slow.received.clear()
        handle = await rec.client.start_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(ref="math.eval", payload={"expression": "1+2"}, pool=pool, acquire_timeout_s=10, lease_ttl_s=30),
            id="task-forged-revoke",
            task_queue=TASK_QUEUE,
            result_type=TaskResult,
        )
        await asyncio.wait_for(slow.received.wait(), timeout=30)
        await handle.signal("lease_revoked", {"lease_id": "f" * 32, "agent_id": "math-alive", "reason": "forged"})
        refused = await asyncio.wait_for(handle.result(), timeout=30)  # the pool says the lease is held: the attempt goes on
        assert (refused.agent_id, refused.attempts) == ("math-alive", 1), refused
        await rec.save("task-forged-revoke", "task_forged_revoke")

        # An agent (cost A) that takes the task and dies: the pool revokes the lease, the task fails over.
        dying_url = await dying.start()
        await roster.register(math_registration("math-dying", dying_url, "A", heartbeat_interval_s=1.0))

        async def heartbeat_until_the_task_arrives() -> None:
            while not dying.received.is_set():
                await roster.heartbeat("math-dying")
                await asyncio.sleep(0.3)

        beating = asyncio.create_task(heartbeat_until_the_task_arrives())
        revoked = await asyncio.wait_for(run("task-revoked", task_timeout_s=30), timeout=60)
        await beating
        assert (revoked.agent_id, revoked.attempts) == ("math-alive", 2), revoked
        await rec.save("task-revoked", "task_failover_lease_revoked")

        await eventually(lambda: _pool(roster, "active_leases", 0), "no active lease")
        await roster.drain("math-alive", deadline_s=30)
        await eventually(lambda: _pool_agents(roster, 0), "every agent gone")
        await rec.end(pool_workflow_id(pool))
        await rec.save(pool_workflow_id(pool), "pool_tasks_renew_grant_revoke")
    finally:
        for agent in agents:
            await agent.stop()


async def task_types(rec: Recorder) -> None:
    """CapabilityTaskWorkflow given a task type and a routing table instead of a ref: one
    routed to its pool and run, one whose type the table does not know (fails at once)."""
    pool = "routed"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    agent = MathAgent()
    table = RoutingTable.model_validate({"routes": {"calculate": {"pool": pool, "ref": "math.eval@>=1,<2"}}})
    try:
        await roster.register(math_registration("math-routed", await agent.start(), "A"))
        routed = await rec.client.execute_workflow(
            "CapabilityTaskWorkflow",
            TaskInput(task_type="calculate", routing_table=table, payload={"expression": "1+2"}, acquire_timeout_s=10),
            id="task-routed",
            task_queue=TASK_QUEUE,
            result_type=TaskResult,
        )
        assert (routed.agent_id, routed.pool, routed.task_type) == ("math-routed", pool, "calculate"), routed
        await rec.save("task-routed", "task_routed_by_type")
        try:
            await rec.client.execute_workflow(
                "CapabilityTaskWorkflow",
                TaskInput(task_type="summarize", routing_table=table, payload={}),
                id="task-unknown-type",
                task_queue=TASK_QUEUE,
                result_type=TaskResult,
            )
            raise AssertionError("a task with an unknown task type completed")
        except WorkflowFailureError:
            pass
        await rec.save("task-unknown-type", "task_unknown_task_type")
        await eventually(lambda: _pool(roster, "active_leases", 0), "no active lease")
        await roster.drain("math-routed", deadline_s=30)
    finally:
        await agent.stop()
async def eviction(rec: Recorder) -> None:
    """Eviction safety: 3 of 4 agents (1 s heartbeats) fall
    silent at once. The first is allowed to go (`request_eviction`, then Terminated and
    `delete_pod`); the pool holds the other two (self-preservation), which ask again; one
    heartbeats again (back to Ready, then drained); an operator confirms the last
    (`retry_eviction` nudge, allowed, Terminated)."""
    pool = "eviction"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    silent = ["ev-1", "ev-2", "ev-3"]
    for agent_id in [*silent, "ev-live"]:
        await roster.register(registration(agent_id, heartbeat_interval_s=1.0))
    alive = {"ev-live", *silent}

    async def beat() -> None:
        while True:
            await asyncio.gather(*(roster.heartbeat(a) for a in sorted(alive)), return_exceptions=True)
            await asyncio.sleep(0.3)

    beating = asyncio.create_task(beat())
    try:
        await asyncio.sleep(0.5)
        alive.difference_update(silent)

        async def settled() -> dict[str, Any] | None:
            described = {a: await roster.describe(a) for a in silent}
            done = all(s.state == AgentState.TERMINATED or s.eviction_denials >= 2 for s in described.values())
            return described if done else None

        described = await eventually(settled, "the silent agents to be reaped or held twice", timeout=60)
        allowed = [a for a, s in described.items() if s.state == AgentState.TERMINATED]
        held = sorted(a for a, s in described.items() if s.state != AgentState.TERMINATED)
        assert len(allowed) == 1 and len(held) == 2, described
        back, confirmed = held
        alive.add(back)

        async def recovered() -> bool:
            status = await roster.describe(back)
            return status.eviction_held is None and back in await roster.find("rag.search")

        await eventually(recovered, f"{back} to recover")
        alive.discard(back)  # it goes quiet again, but is drained first
        await roster.drain(back, deadline_s=30)
        await roster.confirm_evictions([confirmed])
        final = await asyncio.wait_for(roster.wait_ended(confirmed), timeout=30)
        assert final.terminated_reason == "heartbeat_lost", final
    finally:
        beating.cancel()
    await roster.drain("ev-live", deadline_s=30)
    await eventually(lambda: _pool_agents(roster, 0), "every agent gone")
    await rec.save(agent_workflow_id(pool, allowed[0]), "agent_eviction_allowed")
    await rec.save(agent_workflow_id(pool, back), "agent_eviction_held_recovered")
    await rec.save(agent_workflow_id(pool, confirmed), "agent_eviction_confirmed")
    await rec.end(pool_workflow_id(pool))
    await rec.save(pool_workflow_id(pool), "pool_eviction_self_preservation")


async def _state_is(roster: AgentRoster, agent_id: str, state: AgentState) -> bool:
    return (await roster.describe(agent_id)).state == state


async def _pool(roster: AgentRoster, field: str, value: int) -> bool:
    return getattr(await roster.status(), field) == value


async def _pool_agents(roster: AgentRoster, count: int) -> bool:
    return len((await roster.status()).agents) == count


async def pool_shutdown(rec: Recorder) -> None:
    """The `shutdown` update: a client waiter and a queued task workflow told (their next ticket poll), a lease
    renewed while the pool shuts down and revoked at the deadline, both agents drained (pool-shutdown),
    both deployments scaled to zero, the run completed with its final status."""
    pool = "shutdown"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("shut-search", max_concurrency=1))
    await roster.register(registration("shut-code", capability="code.python.exec", version="1.0.0", deployment="code-agent"))
    held = await roster.acquire("rag.search", lease_ttl_s=120, holder="recorder")
    waiter = asyncio.create_task(roster.acquire("rag.search", timeout=60))
    await eventually(lambda: _pool(roster, "waiting", 1), "a waiter")
    queued = await rec.client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="rag.search", pool=pool, acquire_timeout_s=60),
        id="task-shut-out",
        task_queue=TASK_QUEUE,
    )
    await eventually(lambda: _pool(roster, "waiting", 2), "the task to queue")
    await roster.shutdown(deadline_s=3, wait=False, reason="recorded")
    try:
        await waiter
        raise AssertionError("expected PoolShutdownError")
    except PoolShutdownError:
        pass
    await roster.renew(held, 120)
    final = await asyncio.wait_for(roster.shutdown(), timeout=60)
    assert final.shutdown.leases_revoked == 1 and final.shutdown.agents_drained == 2, final
    try:
        await queued.result()
        raise AssertionError("expected the queued task to fail")
    except WorkflowFailureError:
        pass
    await rec.save(pool_workflow_id(pool), "pool_shutdown")
    await rec.save("task-shut-out", "task_pool_shut_down")


async def pool_shards(rec: Recorder) -> None:
    """A pool of 2 shards placed by agent: agents in both, a lease from each shard (one by
    falling back from the other), a renewal and releases sent to the granting shard, a queued
    waiter served in its shard, an exhausted acquire. Records shard 1 (`pool/shards/shard-1`)
    and an agent workflow homed there."""
    from agentroster.vocabulary.shards import ShardLayout

    layout = ShardLayout(2, "agent")
    pool = "shards"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE, shards=layout)
    await roster.ensure_pool()
    homes: dict[int, str] = {}
    n = 0
    while len(homes) < 2:
        homes.setdefault(layout.home_shard(f"shard-agent-{n}", "search-agent"), f"shard-agent-{n}")
        n += 1
    for agent_id in homes.values():
        await roster.register(registration(agent_id, max_concurrency=1))
    leases = [await roster.acquire("rag.search", lease_ttl_s=120, holder="recorder") for _ in range(2)]
    assert sorted(lease.agent_id for lease in leases) == sorted(homes.values()), leases
    in_one = next(lease for lease in leases if lease.agent_id == homes[1])
    await roster.renew(in_one, 180)
    try:
        await roster.acquire("rag.search", timeout=0.5)  # every shard busy: queued in one, then gives up
        raise AssertionError("expected PoolExhaustedError")
    except PoolExhaustedError:
        pass
    for lease in leases:
        await roster.release(lease)
    await eventually(lambda: _pool(roster, "active_leases", 0), "no active lease")
    await rec.end(pool_workflow_id(pool, 1))
    await rec.save(pool_workflow_id(pool, 1), "pool_shard")
    await roster.drain(homes[1], deadline_s=30)
    await rec.save(agent_workflow_id(pool, homes[1]), "agent_in_shard")


async def _refusals(rec: Recorder, pool: str, count: int) -> bool:
    status = await rec.client.get_workflow_handle(pool_workflow_id(pool)).query("status")
    return len(status.get("refusals", [])) >= count


async def pool_snapshot_hints(rec: Recorder) -> None:
    """The `snapshot-as-hint` patch: new agents indexed from their workflow's own snapshot (`read_agent`),
    a resync-like snapshot applied at once (no read), forged snapshots for a known agent (more slots,
    then Terminated) read and refused, a genuine re-registration read and applied, a drain that ends it."""
    pool = "hints"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("hint-agent", max_concurrency=1))
    held = await roster.acquire("rag.search", lease_ttl_s=120, holder="recorder")
    handle = rec.client.get_workflow_handle(pool_workflow_id(pool))
    genuine = await rec.client.get_workflow_handle(agent_workflow_id(pool, "hint-agent")).query("snapshot")
    await handle.signal("agent_snapshots", [genuine])  # what a resync sends: applied, no read
    forged = {**genuine, "max_concurrency": 50}
    forged["capabilities"] = [{**c, "max_concurrency": 50} for c in forged["capabilities"]]
    await handle.signal("agent_snapshots", [forged])
    await eventually(lambda: _refusals(rec, pool, 1), "the forged capacity refused")
    await handle.signal("agent_snapshots", [{**forged, "state": "Terminated", "reason": "forged"}])
    await eventually(lambda: _refusals(rec, pool, 2), "the forged termination refused")
    assert (await roster.status()).active_leases == 1
    await roster.register(registration("hint-agent", max_concurrency=2))  # genuine: read and applied
    second = await eventually(lambda: _second_lease(roster), "the second slot")
    await roster.release(held)
    await roster.release(second)
    await roster.drain("hint-agent", reason="recorded")
    await eventually(lambda: _pool_agents(roster, 0), "the drained agent to leave")
    await rec.end(pool_workflow_id(pool))
    await rec.save(pool_workflow_id(pool), "pool_snapshot_hints")


async def _second_lease(roster: AgentRoster) -> Any:
    try:
        return await roster.acquire("rag.search", timeout=0.2, lease_ttl_s=120, holder="recorder")
    except PoolExhaustedError:
        return None


async def agent_liveness(rec: Recorder) -> None:
    """Register (1 s heartbeats), heartbeats across liveness timers, then the backend's `pod_gone`
    (a malformed one refused first): Terminated `process_exited`, the pool told, `delete_pod`."""
    from agentroster.messages import PodGone
    from agentroster.vocabulary.wire import POD_GONE_SIGNAL

    roster = AgentRoster(rec.client, pool="agents", task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await roster.register(registration("agent-crashed", heartbeat_interval_s=1.0))
    for _ in range(6):
        await asyncio.sleep(0.7)
        await roster.heartbeat("agent-crashed")
    handle = rec.client.get_workflow_handle(agent_workflow_id("agents", "agent-crashed"))
    await handle.signal(POD_GONE_SIGNAL, args=[])  # refused: no argument
    await handle.signal(POD_GONE_SIGNAL, PodGone(agent_id="agent-crashed", reason="process_exited", detail="killed by SIGKILL"))
    final = await asyncio.wait_for(roster.wait_ended("agent-crashed"), timeout=30)
    assert final.terminated_reason == "process_exited", final
    await rec.save(agent_workflow_id("agents", "agent-crashed"), "agent_pod_gone")


async def registration_notices(rec: Recorder) -> None:
    """The pool's `read-batches` and `index-notice` patches (and the agent's `index-notice`): agents
    registering together, read in `read_agents` batches with a forged snapshot for an agent that has
    no workflow (read, refused), each told by `tell_indexed` (its `wait_routable` answers then); a
    re-registration that changes nothing (applied at once, told), one that changes a slot count (read,
    told), a malformed `pool_indexed` refused, a drain to Terminated."""
    from agentroster.vocabulary.wire import INDEX_NOTICE_SIGNAL

    pool = "notices"
    roster = AgentRoster(rec.client, pool=pool, task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    handle = rec.client.get_workflow_handle(pool_workflow_id(pool))
    await roster.register(registration("notice-0"))
    ghost = {**await rec.client.get_workflow_handle(agent_workflow_id(pool, "notice-0")).query("snapshot"), "agent_id": "ghost"}
    await asyncio.gather(handle.signal("agent_snapshots", [ghost]), *(roster.register(registration(f"notice-{i}")) for i in (1, 2, 3)))
    await eventually(lambda: _refusals(rec, pool, 1), "the ghost refused")
    agent = rec.client.get_workflow_handle(agent_workflow_id(pool, "notice-1"))
    await agent.signal(INDEX_NOTICE_SIGNAL, {"agent_id": "someone-else", "registration": 1})  # refused
    await roster.register(registration("notice-1"))  # the same facts: applied with no read, told
    await roster.register(registration("notice-1", max_concurrency=2))  # a change: read, told
    await roster.drain("notice-1", reason="recorded")
    await eventually(lambda: _pool_agents(roster, 3), "the drained agent to leave")
    await rec.save(agent_workflow_id(pool, "notice-1"), "agent_index_notice")
    await rec.end(pool_workflow_id(pool))
    await rec.save(pool_workflow_id(pool), "pool_read_batches_index_notices")


async def agent_a2a_unreachable(rec: Recorder) -> None:
    """An A2A agent registered from its Agent Card, checked every 1 s (`check_a2a_agent`, a timer
    between), its card gone: asks its pool, allowed: Terminated `a2a_unreachable`, no `delete_pod`."""
    from agentroster.client.a2a import add_a2a_agent

    app = web.Application()
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    card: dict[str, Any] = {}
    app.router.add_get("/.well-known/agent-card.json", lambda request: web.json_response(card))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    card.update({
        "name": "Echo", "version": "1.0.0", "capabilities": {}, "defaultInputModes": ["text/plain"], "defaultOutputModes": ["text/plain"],
        "supportedInterfaces": [{"url": url + "/", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}],
        "skills": [{"id": "text.echo", "name": "echo", "description": "echo", "tags": ["echo"]}],
    })
    roster = AgentRoster(rec.client, pool="agents", task_queue=TASK_QUEUE)
    await roster.ensure_pool()
    await add_a2a_agent(roster, url, agent_id="agent-a2a", heartbeat_interval_s=1.0)
    await asyncio.sleep(2.5)  # two checks answered
    await runner.cleanup()
    final = await asyncio.wait_for(roster.wait_ended("agent-a2a"), timeout=30)
    assert final.terminated_reason == "a2a_unreachable", final
    await rec.save(agent_workflow_id("agents", "agent-a2a"), "agent_a2a_unreachable")


SCENARIOS: dict[str, Callable[[Recorder], Awaitable[None]]] = {
    "agent_register_lease_drain": agent_register_lease_drain,
    "agent_heartbeat_lost": agent_heartbeat_lost,
    "agent_continue_as_new": agent_continue_as_new,
    "agent_lost_with_lease": agent_lost_with_lease,
    "pool_leases_queue_expiry": pool_leases_queue_expiry,
    "pool_continue_as_new": pool_continue_as_new,
    "pool_release_and_acquire": pool_release_and_acquire,
    "tasks": tasks,
    "task_types": task_types,
    "pool_shutdown": pool_shutdown,
    "eviction": eviction,
    "pool_shards": pool_shards,
    "pool_snapshot_hints": pool_snapshot_hints,
    "agent_liveness": agent_liveness,
    "registration_notices": registration_notices,
    "agent_a2a_unreachable": agent_a2a_unreachable,
}


# ------------------------------------------------------------------ main
async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", metavar="scenario", help=f"default: all of {', '.join(SCENARIOS)}")
    parser.add_argument("--out", type=Path, default=HERE, help="directory for the JSON files (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files (0.x only: see README.md)")
    args = parser.parse_args(argv)
    chosen = args.scenarios or list(SCENARIOS)
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    args.out.mkdir(parents=True, exist_ok=True)

    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=list(DEV_SERVER_DYNAMIC_CONFIG),
        data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES,
    )
    rec = Recorder(env.client, args.out, args.overwrite)
    try:
        await rec.restart_worker()
        try:
            for name in chosen:
                log.info("scenario %s", name)
                await SCENARIOS[name](rec)
        finally:
            await rec.stop_worker()
    finally:
        await env.shutdown()
    total = sum(p.stat().st_size for p in rec.written)
    print(f"wrote {len(rec.written)} histories ({total / 1024:.0f} KB) to {args.out}")
    for path in rec.written:
        print(f"  {path.name:45} {path.stat().st_size / 1024:6.1f} KB")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("temporalio").setLevel(logging.WARNING)
    asyncio.run(main(sys.argv[1:]))
