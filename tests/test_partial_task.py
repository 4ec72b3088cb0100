"""A query must never make a worker write a pool history that cannot replay (issue 7,
"SDK cold-start nondeterminism", like temporalio/sdk-python#1591).

The sequence, made deterministic by the server's own timers: the pool's worker is
killed with SIGKILL (the real worker CLI, in its own process) while its sticky queue
still holds the pool; a new worker polls the normal queue. A query sent then waits on
the dead sticky queue for the sticky timeout (2 s), so a `release` signal sent one
second later is in the history the query task finally carries to the new worker,
while the workflow task for that signal still waits on the dead sticky queue (one
second longer), with an `acquire` update. Without the guard the new worker ran the
signal for the query (a load notice to the agent: a command held until the real
task) and then accepted the update in the real task: the history shows the notice
before the update's acceptance, and replay, which runs both in one activation,
fails with "Update machine does not handle this event".
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import REGISTRY
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

from agentroster.client import AgentRoster
from agentroster.transport import is_transient
from agentroster.wire import PARTIAL_TASK_REFUSED
from agentroster.workers import partial_task_guard
from agentroster.workers.worker import WORKFLOWS, create_worker, workflow_runner
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
    return WorkflowActivation(
        run_id="r", timestamp=Timestamp(seconds=seconds), is_replaying=replaying, history_length=length, jobs=made
    )


class Recorder:
    """A stand-in for the sandboxed instance: records what reached the workflow code."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def activate(self, act: WorkflowActivation) -> WorkflowActivationCompletion:
        self.seen.append(act.history_length)
        completion = WorkflowActivationCompletion(run_id=act.run_id)
        completion.successful.SetInParent()
        return completion


def test_only_the_partial_task_is_refused() -> None:
    # The activations the cold worker of the chaos repro saw (trace of benchmarks/repro_cold_start_nde.py):
    # replay up to 160, a query's events applied at 163 with the time of 160, the query, the real task at 167.
    # Times as the server's: the real task at t=105 starts after the refusal (wall clock now).
    recorder = Recorder()
    guarded = partial_task_guard._GuardedInstance(recorder, "PoolWorkflow")  # type: ignore[arg-type]
    counted = REGISTRY.get_sample_value("agentroster_worker_partial_tasks_refused_total", {"workflow_type": "PoolWorkflow"}) or 0.0
    outcome = {}
    base = int(time.time()) - 103
    for act in [
        activation(154, base + 100, "release", replaying=True),
        activation(160, base + 101, "release", replaying=True),
        activation(163, base + 101, "timer"),  # no WorkflowTaskStarted among its events: the time did not move
        activation(163, base + 101, "query", replaying=True),
        activation(167, base + 105, "release"),  # the real workflow task
        activation(167, base + 105, "timer"),  # a second activation of that task (nothing new in history)
        activation(171, base + 106, "release"),
    ]:
        completion = guarded.activate(act)
        outcome.setdefault(act.history_length, []).append("failed" if completion.HasField("failed") else "ok")
    assert outcome == {154: ["ok"], 160: ["ok"], 163: ["failed", "ok"], 167: ["ok", "ok"], 171: ["ok"]}
    assert recorder.seen == [154, 160, 163, 167, 167, 171]  # the refused activation never reached the workflow
    assert PARTIAL_TASK_REFUSED in guarded.activate(activation(175, base + 106, "release")).failed.failure.message
    assert REGISTRY.get_sample_value("agentroster_worker_partial_tasks_refused_total", {"workflow_type": "PoolWorkflow"}) == counted + 2

    # A replayer's activations are never refused, nor a run's first activation.
    assert not partial_task_guard.is_partial_task((101, 0, 160), activation(163, 101, "timer", replaying=True))
    assert not partial_task_guard.is_partial_task(None, activation(163, 101, "timer"))


def test_a_query_task_ending_with_a_dropped_task_start_is_refused_on_a_cold_instance() -> None:
    # The pool history a killed worker left (benchmarks/chaos.py, worker row, 2026-12-03): replay up to the
    # task at 1139 (t=21.8), then a query task whose events end after a task the dead worker started at
    # t=22.4 and dropped (it timed out); core gives four release signals at t=22.4 as a live activation.
    # The new worker began at t=24.5: none of its tasks can carry t=22.4.
    # (Times as the server's: the real task at t=25 starts after the refusal, made at the wall clock's now.)
    base = int(time.time()) - 24
    times = partial_task_guard._LiveTimes()
    cold = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=base + 24.5, live_times=times)  # type: ignore[arg-type]
    assert cold.activate(activation(1139, base + 21, "timer", replaying=True)).HasField("successful")
    refused = cold.activate(activation(1148, base + 22, "release", "release", "release", "release"))
    assert PARTIAL_TASK_REFUSED in refused.failed.failure.message
    # The real workflow task (started by the new worker) runs, on a rebuilt instance.
    rebuilt = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=base + 24.5, live_times=times)  # type: ignore[arg-type]
    assert rebuilt.activate(activation(1139, base + 21, "timer", replaying=True)).HasField("successful")
    assert rebuilt.activate(activation(1149, base + 25, "release", "release")).HasField("successful")
    assert rebuilt.activate(activation(1149, base + 25, "timer")).HasField("successful")  # a second activation of that task


def test_a_query_task_carrying_a_task_this_worker_dropped_is_refused() -> None:
    # A busy worker ran the task at t=50 but its completion came too late (the task timed out); the run
    # was evicted. A query task then brings that task's start back: its time is one this worker already ran.
    times = partial_task_guard._LiveTimes()
    first = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=10.0, live_times=times)  # type: ignore[arg-type]
    assert first.activate(activation(40, 49, "release")).HasField("successful")
    assert first.activate(activation(44, 50, "release")).HasField("successful")
    again = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=10.0, live_times=times)  # type: ignore[arg-type]
    assert again.activate(activation(44, 49, "release", replaying=True)).HasField("successful")
    assert again.activate(activation(48, 50, "release")).HasField("failed")
    # Another run's task at the same time is its own business.
    other = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=10.0, live_times=times)  # type: ignore[arg-type]
    assert other.activate(activation_of("other", 48, 50, "release")).HasField("successful")


def activation_of(run_id: str, length: int, seconds: int, *jobs: str) -> WorkflowActivation:
    act = activation(length, seconds, *jobs)
    act.run_id = run_id
    return act


def test_the_client_asks_again_after_a_refused_query() -> None:
    assert is_transient(WorkflowQueryFailedError(partial_task_guard.REFUSAL))
    assert not is_transient(WorkflowQueryFailedError("query handler raised: KeyError"))


def replayer() -> Replayer:
    return Replayer(workflows=WORKFLOWS, workflow_runner=workflow_runner(), data_converter=pydantic_data_converter)


async def registered_on_a_killed_worker(env: WorkflowEnvironment, log: Path, *, leased: bool) -> tuple[AgentRoster, str, Any]:
    """A pool and agent `a0` (one slot) served by the real worker CLI, then that worker killed with SIGKILL
    while its sticky queue still holds them; with `leased`, a0's slot is leased first. (roster, queue, lease)"""
    client = env.client
    suffix = uuid.uuid4().hex[:8]
    pool, queue = f"partial-{suffix}", f"tq-partial-{suffix}"
    roster = AgentRoster(client, pool=pool, task_queue=queue)
    old = WorkerProcess(client.service_client.config.target_host, pool, queue, log)
    await old.start()
    lease = None
    try:
        await roster.ensure_pool()
        await roster.register(make_registration("a0", [(REF, "2.1.0", 1, "A")], heartbeat_interval_s=3600))
        if leased:
            lease = await roster.acquire(REF, timeout=30, lease_ttl_s=600)  # the agent is saturated: a release notices it
        await asyncio.sleep(0.5)  # the last workflow tasks are over: nothing pending, still sticky to `old`
    finally:
        await old.kill9()
    return roster, queue, lease


async def one_round(env: WorkflowEnvironment, tmp_path: Path, n: int) -> dict[str, Any]:
    client = env.client
    roster, queue, lease = await registered_on_a_killed_worker(env, tmp_path / f"worker-{n}.log", leased=True)
    pool = roster.pool
    refused = partial_task_guard.refused_count()
    handle = client.get_workflow_handle(f"pool/{pool}")  # a plain temporalio handle: raw messages
    async with create_worker(client, task_queue=queue, backend="none", check_search_attributes=False):
        query = asyncio.create_task(handle.query("status"))
        await asyncio.sleep(1.0)
        await handle.signal("release", lease.lease_id)
        second = await roster.acquire(REF, timeout=30, lease_ttl_s=600)  # one slot: granted once the release is in
        answer = (await asyncio.gather(query, return_exceptions=True))[0]
        await roster.release(second)
        history = await handle.fetch_history()
    replay = await replayer().replay_workflow(history, raise_on_replay_failure=False)
    return {
        "replay_failure": replay.replay_failure,
        "refused": partial_task_guard.refused_count() - refused,
        "answer": answer,
        "granted": second.agent_id,
    }


@pytest.mark.slow
async def test_a_query_carrying_a_release_leaves_a_replayable_history(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    # Up to three rounds, until one ran the dangerous sequence (the server's timers make it
    # happen every time on a quiet machine; a round where the query won no race proves nothing).
    rounds = []
    for n in range(3):
        result = await one_round(dev_env, tmp_path, n)
        rounds.append(result)
        assert result["replay_failure"] is None, f"round {n}: the pool history does not replay: {result['replay_failure']}"
        assert result["granted"] == "a0"
        answer = result["answer"]
        if isinstance(answer, BaseException):  # the refused query; nothing else may fail it
            assert isinstance(answer, WorkflowQueryFailedError) and PARTIAL_TASK_REFUSED in str(answer), answer
        if result["refused"]:
            assert isinstance(answer, WorkflowQueryFailedError)
            break
    assert rounds[-1]["refused"] >= 1, f"no round carried a signal in a query's task: {rounds}"


@pytest.mark.slow
async def test_a_query_carrying_a_drain_to_an_agent_leaves_a_replayable_history(dev_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """The same sequence against an agent workflow: its worker killed, a `status` query sent to the
    agent through a plain handle, a raw `drain` signal a second later (Draining, then Terminated
    with a `delete_pod` activity: commands the query's task must not run), then `wait_routable`.
    Every history replays; a round where the query carried the signal sees it refused."""
    rounds = []
    for n in range(3):
        client = dev_env.client
        roster, queue, _ = await registered_on_a_killed_worker(dev_env, tmp_path / f"agent-worker-{n}.log", leased=False)
        pool = roster.pool
        refused = partial_task_guard.refused_count()
        handle = client.get_workflow_handle(f"agent/{pool}/a0")  # a plain temporalio handle: raw messages
        async with create_worker(client, task_queue=queue, backend="none", check_search_attributes=False):
            query = asyncio.create_task(handle.query("status"))
            await asyncio.sleep(1.0)
            await handle.signal("drain", {"reason": "partial-task test", "deadline_s": 30})
            routable = await handle.execute_update("wait_routable")  # answers once Draining or Terminated
            answer = (await asyncio.gather(query, return_exceptions=True))[0]
            final = await roster.wait_ended("a0")
            history = await handle.fetch_history()
        replay = await replayer().replay_workflow(history, raise_on_replay_failure=False)
        assert replay.replay_failure is None, f"round {n}: the agent history does not replay: {replay.replay_failure}"
        assert routable["state"] in ("Draining", "Terminated") and final.terminated_reason == "drain"
        if isinstance(answer, BaseException):  # the refused query; nothing else may fail it
            assert isinstance(answer, WorkflowQueryFailedError) and PARTIAL_TASK_REFUSED in str(answer), answer
        rounds.append(partial_task_guard.refused_count() - refused)
        if rounds[-1]:
            assert isinstance(answer, WorkflowQueryFailedError)
            break
    assert rounds[-1] >= 1, f"no round carried a signal in a query's task: {rounds}"




def test_a_query_task_ending_with_a_task_that_timed_out_before_it_ran_here_is_refused() -> None:
    # The pool history of a harness run (2026-12-03): the worker polled a task at t=36.2 but dropped it
    # unrun (a refused query had evicted the run meanwhile); the task timed out at t=39.2 (3 s). A query
    # task then carried the signals up to it: core ran them live at t=36.2 on a rebuilt instance.
    times = partial_task_guard._LiveTimes()

    def cold() -> partial_task_guard._GuardedInstance:
        guarded = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=35.0, live_times=times, task_timeout_s=3.0)  # type: ignore[arg-type]
        assert guarded.activate(activation(420, 33, "release", replaying=True)).HasField("successful")
        return guarded

    late = activation(435, 36, "release", "release", "timer")
    assert PARTIAL_TASK_REFUSED in cold().activate(late).failed.failure.message  # wall clock is hours past t=36
    # The real task at t=39.2, run within its timeout, is not refused.
    fresh = activation(436, 0, "release")
    fresh.timestamp.GetCurrentTime()
    assert cold().activate(fresh).HasField("successful")
    # A worker clock far ahead of the server's would refuse every rebuild (for its age, or as started before
    # the last refusal): after 3 such refusals with no task run as it started in between (the fresh one
    # above was), neither is checked for the run.
    # (Each a task of its own: its retries start later. Copies of one start count once, below.)
    for k in range(3):
        assert cold().activate(activation(435, 37 + k, "release")).HasField("failed")
    assert cold().activate(activation(435, 40, "release")).HasField("successful")


def test_a_long_lived_instance_runs_every_activation_of_its_tasks() -> None:
    # A second activation of a task (same time, nothing new in history) on an instance that has run many
    # tasks is that task's own, never a dropped one's: only a rebuilt instance's first live activation is
    # compared with the times earlier instances ran.
    now = int(time.time())  # tasks that start now: no age to refuse
    times = partial_task_guard._LiveTimes()
    guarded = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=now - 60, live_times=times, task_timeout_s=3.0)  # type: ignore[arg-type]
    for n in range(100):
        assert guarded.activate(activation(10 + 4 * n, now + n, "release")).HasField("successful")
    assert guarded.activate(activation(406, now + 99, "timer")).HasField("successful")


def test_after_a_refusal_a_rebuilt_runs_first_task_that_started_before_it_is_refused() -> None:
    # A harness run (2026-12-05, kill 4 of 4): the new worker polled the pool's task (started at t=15.09),
    # refused a query's partial task at 15.73, and core, evicting the run, kept a second query task and
    # dropped the real one. The second query's history ends with that task's start: core ran the fired
    # timer live at t=15.09 on the rebuilt instance, and its TimerStarted went out ahead of the next
    # task's update acceptances (`Update machine does not handle this event: ... TimerStarted`).
    now = time.time()
    times = partial_task_guard._LiveTimes()

    def rebuilt(run_id: str = "r") -> partial_task_guard._GuardedInstance:
        guarded = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", worker_started=now - 5, live_times=times, task_timeout_s=2.0)  # type: ignore[arg-type]
        replayed = activation_of(run_id, 1470, int(now) - 3, "release")
        replayed.is_replaying = True
        assert guarded.activate(replayed).HasField("successful")
        return guarded

    def at(run_id: str, length: int, seconds: float, *jobs: str) -> WorkflowActivation:
        act = activation_of(run_id, length, 0, *jobs)
        act.timestamp.FromNanoseconds(int(seconds * 1e9))
        return act

    polled = now - 0.6  # the real task this worker polled, then dropped
    first = rebuilt()
    first.activate(at("r", 1472, now - 3, "timer"))  # a previous activation at that time...
    assert first.activate(at("r", 1474, now - 3, "release")).HasField("failed")  # ...so this is a partial task: refused
    # The query's copy of the dropped task's start, on the rebuilt instance: refused.
    zombie = rebuilt().activate(at("r", 1475, polled, "timer"))
    assert PARTIAL_TASK_REFUSED in zombie.failed.failure.message
    # Every waiter's query may carry another copy of it: they are all refused (one start counts once
    # toward giving the time checks up, which is for a worker clock far ahead).
    for _ in range(6):
        assert rebuilt().activate(at("r", 1475, polled, "timer")).HasField("failed")
    # The server hands the task out again after its timeout: it starts after the refusal and runs.
    assert rebuilt().activate(at("r", 1478, time.time() + 0.01, "timer", "release")).HasField("successful")
    # Another run of this worker is not concerned.
    assert rebuilt("other").activate(at("other", 1475, polled, "timer")).HasField("successful")
    # Once a task started before the refusal would have timed out, this rule no longer applies.
    late = at("r", 1475, polled, "timer")
    assert partial_task_guard.is_dropped_task_replay(late, now - 5, times, first_live=True, task_timeout_s=None, now=now + 60) is None


def test_the_time_checks_count_again_once_a_task_runs_as_it_starts() -> None:
    # Several worker kills within one pool run: each may cost a refusal for time. A live task that ran
    # within a second of its start shows the clocks agree, so the checks stay on for the next kill.
    times = partial_task_guard._LiveTimes()
    for _ in range(5):
        times.refused_for_age("r")
        times.refused_for_age("r")
        guarded = partial_task_guard._GuardedInstance(Recorder(), "PoolWorkflow", live_times=times, task_timeout_s=2.0)  # type: ignore[arg-type]
        fresh = activation(10, 0, "release")
        fresh.timestamp.GetCurrentTime()
        assert guarded.activate(fresh).HasField("successful")
        assert times.age_checked("r")
    # With no such task in between (a worker clock far ahead: every task looks old), they are given up.
    for _ in range(3):
        times.refused_for_age("r")
    assert not times.age_checked("r")
