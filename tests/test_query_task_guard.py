"""`workers.query_task_guard`: a query's partial workflow task is refused, and nothing else.

The sequence it exists for, made deterministic by the server's own timers: the pool's
worker is killed with SIGKILL (the real worker CLI, in its own process) while its sticky
queue still holds the pool; a new worker polls the normal queue. A plain query (no query
rule: what an operator's UI sends) waits on the dead sticky queue for the sticky timeout,
so an `agent_snapshot` signal sent a second later is in the history its query task carries to the
new worker. Unguarded, the new worker runs the signal for the query and accepts the next
update in the real task after it: the history does not replay.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.bridge.proto.workflow_activation import (
    FireTimer,
    QueryWorkflow,
    SignalWorkflow,
    WorkflowActivation,
    WorkflowActivationJob,
)
from temporalio.bridge.proto.workflow_completion import WorkflowActivationCompletion
from temporalio.client import WorkflowQueryFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from agentroster.client.roster import AgentRoster
from agentroster.client.transport import is_transient
from agentroster.vocabulary.wire import PARTIAL_TASK_REFUSED
import agentroster.workers.query_task_guard as query_task_guard
from agentroster.workers.worker import create_worker
from agentroster.workflows import workflow_classes, workflow_runner
from benchmarks.chaos_procs import WorkerProcess
from tests.conftest import make_registration

REF = "rag.search"


def activation(length: int, seconds: int, *jobs: str, replaying: bool = False) -> WorkflowActivation:
    made = []
    for job in jobs:
        if job == "query":
            made.append(WorkflowActivationJob(query_workflow=QueryWorkflow(query_id="legacy_query", query_type="status")))
        elif job == "timer":
            made.append(WorkflowActivationJob(fire_timer=FireTimer(seq=1)))
        else:
            made.append(WorkflowActivationJob(signal_workflow=SignalWorkflow(signal_name=job)))
    return WorkflowActivation(run_id="r", timestamp=Timestamp(seconds=seconds), is_replaying=replaying, history_length=length, jobs=made)


class Recorder:
    """Stands in for the sandboxed instance: records which activations reached the workflow code."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def activate(self, act: WorkflowActivation) -> WorkflowActivationCompletion:
        self.seen.append(act.history_length)
        completion = WorkflowActivationCompletion(run_id=act.run_id)
        completion.successful.SetInParent()
        return completion


def test_only_the_partial_task_is_refused() -> None:
    # What a cold worker of the repro saw: replay up to 160, a query's events applied at 163 with
    # the time of 160 (no WorkflowTaskStarted among them), the query, then the real task at 167.
    recorder = Recorder()
    guarded = query_task_guard._GuardedInstance(recorder, "PoolWorkflow")  # type: ignore[arg-type]
    outcome: dict[int, list[str]] = {}
    for act in [
        activation(154, 100, "release", replaying=True),
        activation(160, 101, "release", replaying=True),
        activation(163, 101, "timer"),  # the partial task: live, history grew, time did not move
        activation(163, 101, "query", replaying=True),
        activation(167, 105, "release"),  # the real workflow task
        activation(167, 105, "timer"),  # a second activation of that task (nothing new in history)
        activation(171, 106, "release"),
    ]:
        try:
            guarded.activate(act)
            result = "ok"
        except query_task_guard.PartialQueryTaskRefused:
            result = "failed"
        outcome.setdefault(act.history_length, []).append(result)
    assert outcome == {154: ["ok"], 160: ["ok"], 163: ["failed", "ok"], 167: ["ok", "ok"], 171: ["ok"]}
    assert recorder.seen == [154, 160, 163, 167, 167, 171]  # the refused activation never reached the workflow
    with pytest.raises(query_task_guard.PartialQueryTaskRefused, match=PARTIAL_TASK_REFUSED):
        guarded.activate(activation(175, 106, "release"))
    # A replay's activations are never refused, nor a run's first activation.
    fresh = query_task_guard._GuardedInstance(Recorder(), "PoolWorkflow")  # type: ignore[arg-type]
    assert fresh.activate(activation(163, 101, "timer")).HasField("successful")
    replaying = query_task_guard._GuardedInstance(Recorder(), "PoolWorkflow")  # type: ignore[arg-type]
    replaying.activate(activation(160, 101, "release", replaying=True))
    assert replaying.activate(activation(163, 101, "timer", replaying=True)).HasField("successful")


def test_the_client_asks_again_after_a_refused_query() -> None:
    assert is_transient(WorkflowQueryFailedError(query_task_guard.REFUSAL))
    assert not is_transient(WorkflowQueryFailedError("query handler raised: KeyError"))


async def test_one_switch_turns_it_off(dev_env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    assert query_task_guard.guard_on({}) and not query_task_guard.guard_on({"AGENTROSTER_QUERY_TASK_GUARD": "off"})
    on = create_worker(dev_env.client, task_queue="guard-switch", check_search_attributes=False)
    assert isinstance(on.config()["workflow_runner"], query_task_guard.QueryTaskGuardRunner)
    monkeypatch.setenv("AGENTROSTER_QUERY_TASK_GUARD", "off")
    off = create_worker(dev_env.client, task_queue="guard-switch-off", check_search_attributes=False)
    assert not isinstance(off.config()["workflow_runner"], query_task_guard.QueryTaskGuardRunner)


async def registered_on_a_killed_worker(env: WorkflowEnvironment, log: Path) -> tuple[AgentRoster, str, Any]:
    """A pool and agent `a0` (one slot, leased) served by the real worker CLI, then that worker
    killed with SIGKILL while its sticky queue still holds them. (roster, queue, lease)"""
    client = env.client
    suffix = uuid.uuid4().hex[:8]
    pool, queue = f"partial-{suffix}", f"tq-partial-{suffix}"
    roster = AgentRoster(client, pool=pool, task_queue=queue)
    old = WorkerProcess(client.service_client.config.target_host, pool, queue, log)
    await old.start()
    try:
        await roster.ensure_pool()
        await roster.register(make_registration("a0", [(REF, "2.1.0", 1, "A")], heartbeat_interval_s=3600))
        lease = await roster.acquire(REF, timeout=30, lease_ttl_s=600)  # the agent is saturated: a release notices it
        await asyncio.sleep(0.5)  # the last workflow tasks are over: nothing pending, still sticky to `old`
    finally:
        await old.kill9()
    return roster, queue, lease


@pytest.mark.slow
async def test_a_plain_query_carrying_a_release_leaves_a_replayable_history(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    # Up to three rounds, until one ran the dangerous sequence (the query's answer is the refusal).
    answers = []
    for n in range(3):
        client = dev_env.client
        roster, queue, lease = await registered_on_a_killed_worker(dev_env, tmp_path / f"worker-{n}.log")
        handle = client.get_workflow_handle(f"pool/{roster.pool}")  # a plain temporalio handle: raw messages
        async with create_worker(client, task_queue=queue, backend="none", check_search_attributes=False):
            query = asyncio.create_task(handle.query("status"))
            await asyncio.sleep(1.0)
            # A well-formed snapshot of an agent the pool does not know: a hint it answers with a read
            # (an activity), so the signal's commands would meet the next update's acceptance.
            await handle.signal("agent_snapshot", {
                "agent_id": f"ghost-{n}", "deployment": "d", "endpoint": "http://127.0.0.1:1", "state": "Ready",
                "capabilities": [{"name": REF.split("@")[0], "version": "2.1.0", "max_concurrency": 1, "cost_class": "A"}],
            })
            await roster.release(lease)
            second = await roster.acquire(REF, timeout=30, lease_ttl_s=600)  # one slot: granted once the release is in
            answer = (await asyncio.gather(query, return_exceptions=True))[0]
            await roster.release(second)
            history = await handle.fetch_history()
        replayer = Replayer(workflows=workflow_classes(), workflow_runner=workflow_runner(), data_converter=pydantic_data_converter)
        replay = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert replay.replay_failure is None, f"round {n}: the pool history does not replay: {replay.replay_failure}"
        assert second.agent_id == "a0"
        answers.append(answer)
        if isinstance(answer, BaseException):  # the refused query; nothing else may fail it
            assert isinstance(answer, WorkflowQueryFailedError) and PARTIAL_TASK_REFUSED in str(answer), answer
            break
    assert isinstance(answers[-1], WorkflowQueryFailedError), f"no round carried a signal in a query's task: {answers}"
