"""A worker resets a run of ours that its own build wrote and cannot replay; one another
build wrote it leaves to an operator, with the reset command (issue 7: recovery without a
human from the SDK wedge in the README's Known limits).

The wedge is made the honest way the tests can make it on demand: a run written by other
code under the pool's workflow type (tests/old_pool.py's `OldPoolWithReleases`: its first task starts a timer that
today's pool does not), picked up by today's worker. Written under this code's build id
(`code_build_id()`, what every agentroster worker records) the run looks exactly like one
this build wrote (the SDK wedge's case); with another build id it looks like a rollout's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.converter import DataConverter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from temporalio.workflow import _Definition

from agentroster.client import AgentRoster
from agentroster.contracts import AgentRosterError, CapabilityUnknownError
from agentroster.replay import ReplayReport, replay_history
from agentroster.settings import Settings
from agentroster.workers.cli import build_parser
from agentroster.workers.self_heal import (
    GRANTING_UPDATES,
    MIN_RESET_INTERVAL_S,
    RELEASES_RIDING_ON,
    RESENT_SUFFIX,
    RESENT_UPDATES,
    build_of_task,
    claim_id,
    claim_reset,
    code_build_id,
    decide,
    last_reset_age_s,
    reset_request_id,
    updates_to_resend,
)
from agentroster.workers.worker import create_worker
from agentroster.wire import pool_workflow_id
from agentroster.workflows.pool import PoolWorkflow
from tests.conftest import eventually
from tests.old_pool import OldPoolWithReleases, released


def report(ok: bool = False, task_event_id: int | None = 4, error_type: str = "NondeterminismError") -> ReplayReport:
    return ReplayReport(
        "pool/x", "PoolWorkflow", 20, ok, error="[TMPRL1100] Nondeterminism error", error_type=error_type, event_id=5, task_event_id=task_event_id
    )


def test_only_a_divergence_this_build_wrote_is_reset() -> None:
    assert decide(report(ok=True), "b1", "b1", None).action == "none"
    assert decide(report(), "b1", "b1", None).action == "reset"
    other = decide(report(), "b0", "b1", None)
    assert other.action == "left_to_operator" and "written by build b0" in other.why
    assert decide(report(), None, "b1", None).action == "left_to_operator"
    assert decide(report(task_event_id=None), "b1", "b1", None).action == "left_to_operator"
    # Only a nondeterminism error is a divergence a reset mends (not, say, the deadlock detector on a busy worker).
    stuck = decide(report(error_type="_DeadlockError"), "b1", "b1", None)
    assert stuck.action == "left_to_operator" and "not a nondeterminism error" in stuck.why
    # A workflow this worker reset a little while ago and that diverged again is left alone.
    again = decide(report(), "b1", "b1", MIN_RESET_INTERVAL_S / 2)
    assert again.action == "left_to_operator" and "diverged again" in again.why
    assert decide(report(), "b1", "b1", MIN_RESET_INTERVAL_S + 1).action == "reset"


def test_the_build_of_a_task_and_one_reset_id_for_every_worker() -> None:
    def completed(event_id: int, build: str) -> Any:
        attributes = SimpleNamespace(
            worker_version=SimpleNamespace(build_id=build), deployment_version=SimpleNamespace(build_id=""),
            deployment=SimpleNamespace(build_id=""), binary_checksum="",
        )  # fmt: skip
        return SimpleNamespace(event_id=event_id, event_type=EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED, workflow_task_completed_event_attributes=attributes)

    events = [completed(4, "b0"), completed(9, "b1")]
    assert build_of_task(events, 9) == "b1" and build_of_task(events, 4) == "b0" and build_of_task(events, 5) is None
    assert reset_request_id("pool/x", "r1", 4) == reset_request_id("pool/x", "r1", 4) != reset_request_id("pool/x", "r2", 4)
    uuid.UUID(reset_request_id("pool/x", "r1", 4))  # the server's request ids are UUIDs


def test_the_worker_cli_and_the_environment_turn_it_off() -> None:
    assert build_parser(Settings.from_env({})).parse_args(["worker"]).self_heal is True
    assert build_parser(Settings.from_env({})).parse_args(["worker", "--no-self-heal"]).self_heal is False
    assert build_parser(Settings.from_env({"AGENTROSTER_SELF_HEAL": "off"})).parse_args(["worker"]).self_heal is False
    assert Settings.from_env({"AGENTROSTER_SELF_HEAL": "on"}).self_heal is True
    with pytest.raises(AgentRosterError, match="AGENTROSTER_SELF_HEAL='sometimes': expected"):
        Settings.from_env({"AGENTROSTER_SELF_HEAL": "sometimes"})


async def wedged_pool(client: Client, build_id: str | None) -> tuple[Any, str, str]:
    """A pool run written by old code (no sticky cache, so the next task goes to any worker of
    the queue), sent one `release` signal and, after the point a reset goes back to, an
    `acquire_many`, a `release_leases` and a `release_and_acquire` update that it completed;
    (handle, run id, task queue)."""
    pool, queue = f"heal-{uuid.uuid4().hex[:6]}", f"heal-{uuid.uuid4().hex[:6]}"
    options: dict[str, Any] = {"build_id": build_id} if build_id else {}
    async with Worker(client, task_queue=queue, workflows=[OldPoolWithReleases], max_cached_workflows=0, **options):
        handle = await client.start_workflow("PoolWorkflow", {"pool": pool}, id=pool_workflow_id(pool), task_queue=queue)
        await handle.signal("release", ["lease-1"])
        assert await eventually(lambda: released(handle, 1)) == ["lease-1"]
        # Updates the old run completed after the point a reset goes back to: the server does not
        # apply them again (REAPPLY_EXCLUDED); the healer sends the release again, not the acquire.
        ask = {"ref": "rag.search@>=1", "wait_s": 0, "request_id": uuid.uuid4().hex}
        assert await handle.execute_update("acquire_many", [ask], id="acquire-before-the-wedge") == [{}]
        assert await handle.execute_update("release_leases", ["lease-0"], id="release-before-the-wedge") == 0
        riding = {"releases": ["lease-3"], "acquires": [ask]}
        assert await handle.execute_update("release_and_acquire", riding, id="riding-before-the-wedge") == [{}]
    return client.get_workflow_handle(handle.id), handle.first_execution_run_id or "", queue


def healing_worker(client: Client, queue: str) -> Any:
    """Today's worker on the wedged run's queue, looking at a wedge after 0.5 s (not 5)."""
    worker = create_worker(client, task_queue=queue, check_search_attributes=False)
    assert worker.healer is not None
    worker.healer.delay_s = 0.5
    return worker


def resets(outcome: str) -> float:
    return REGISTRY.get_sample_value("agentroster_worker_workflow_resets_total", {"workflow_type": "PoolWorkflow", "outcome": outcome}) or 0.0


async def test_a_wedged_run_this_build_wrote_is_reset_by_the_worker(dev_env: WorkflowEnvironment, caplog: pytest.LogCaptureFixture) -> None:
    client = dev_env.client
    handle, run_id, queue = await wedged_pool(client, build_id=code_build_id())  # what a worker of this code records
    before = resets("reset")
    caplog.set_level(logging.WARNING, logger="agentroster.worker")
    worker = healing_worker(client, queue)
    roster = AgentRoster(client, pool=handle.id.removeprefix("pool/"), task_queue=queue)
    roster._pool_started = True
    async with worker:
        await handle.signal("release", ["lease-2"])  # a workflow task for today's code: it cannot replay the run
        # A caller that asks while the run is wedged gets its answer from the new run (no agent
        # offers the capability: CapabilityUnknownError, an answer, not a timeout).
        waiting = asyncio.create_task(roster.acquire("rag.search@>=1", timeout=60))

        async def new_run() -> str | None:
            current = (await handle.describe()).run_id
            return current if current != run_id else None

        reset_run = await eventually(new_run, timeout=60)
        old = await client.get_workflow_handle(handle.id, run_id=run_id).describe()
        assert old.status == WorkflowExecutionStatus.TERMINATED
        # Counted and logged once the healer has also sent the new run what it must send again.
        await eventually(lambda: resets("reset") == before + 1, timeout=30)
        assert any("is reset to the workflow task completed at event" in r.getMessage() for r in caplog.records)
        # The new run is today's pool: it answers, and it was given both releases again.
        new = client.get_workflow_handle(handle.id, run_id=reset_run)
        status = await eventually(lambda: new.query("status"), timeout=30)
        assert status is not None
        history = await new.fetch_history()
        signalled = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]
        assert len(signalled) == 2, [e.workflow_execution_signaled_event_attributes.signal_name for e in signalled]
        # Updates are not applied again (REAPPLY_EXCLUDED: their reapplied form does not replay):
        # the one the old run completed after the reset point is not in the new run...
        assert not any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ADMITTED for e in history.events)
        with pytest.raises(CapabilityUnknownError):
            await asyncio.wait_for(waiting, 60)
        history = await new.fetch_history()
        updates = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED]
        ids = [e.workflow_execution_update_completed_event_attributes.meta.update_id for e in updates]
        assert not any(i.startswith("acquire-before-the-wedge") for i in ids)
        # ...the release it completed was sent again by the healer (its caller was told it was
        # done), and so was the release that rode on a release_and_acquire, alone...
        assert "release-before-the-wedge" + RESENT_SUFFIX in ids and "riding-before-the-wedge" + RESENT_SUFFIX in ids
        resent = {r.meta.update_id: r for r in (e.workflow_execution_update_accepted_event_attributes.accepted_request for e in history.events
                  if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)}  # fmt: skip
        riding = resent["riding-before-the-wedge" + RESENT_SUFFIX]
        assert riding.input.name == "release_leases"
        assert DataConverter.default.payload_converter.from_payloads(list(riding.input.args.payloads), None) == [["lease-3"]]
        assert any("sent 2 update(s) from after that point again (release_leases, release_leases)" in r.getMessage() for r in caplog.records)
        # ...and the caller that was waiting was answered by the new run (its acquire_many, ours).
        accepted = [e.workflow_execution_update_accepted_event_attributes.accepted_request for e in history.events
                    if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED]
        assert [r.input.name for r in accepted if not r.meta.update_id.endswith(RESENT_SUFFIX)] == ["acquire_many"]
        assert (await replay_history(history)).ok
        # Every worker can read that this run was made by a reset just now (the per-workflow limit).
        age = last_reset_age_s(list(history.events))
        assert age is not None and age < 120
        assert last_reset_age_s(list((await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()).events)) is None
        # The claim is a record of what was done; a worker that looks at the old run now does
        # not reset it again (the server would: it resets a closed run too, terminating the
        # current one): the run is closed.
        claim = await client.get_workflow_handle(claim_id(handle.id, run_id)).describe()
        assert claim.status == WorkflowExecutionStatus.TERMINATED
        assert await worker.healer.heal(handle.id, run_id) is None
        # Nor does a worker whose claim came after (the first claim ended, so its id is free):
        # it checks the run again after claiming, and gives its claim up.
        assert await claim_reset(client, handle.id, run_id, "a late second worker")
        assert await worker.healer.reset_claimed(handle.id, run_id, 4, 5, "a late second worker") is None
        late = await client.get_workflow_handle(claim_id(handle.id, run_id)).describe()
        assert late.status == WorkflowExecutionStatus.TERMINATED
        assert (await handle.describe()).run_id == reset_run
        # The reliability harness names the reset when it lists the runs that do not replay.
        from benchmarks.chaos_checks import replay_failures

        [failure] = [f for f in await replay_failures(client, [handle.id]) if run_id in f]
        assert ' (reset by a self-healing worker: "agentroster worker: history written by this build does not replay from event' in failure
        await new.terminate("test over")


async def test_one_worker_claims_a_reset_and_a_dead_claimers_claim_times_out(dev_env: WorkflowEnvironment) -> None:
    
    client = dev_env.client
    workflow_id, run_id = f"pool/claims-{uuid.uuid4().hex[:6]}", "run-1"
    assert await claim_reset(client, workflow_id, run_id, "first worker", timeout=timedelta(seconds=2))
    assert not await claim_reset(client, workflow_id, run_id, "second worker")  # running: the first is on it
    claim = client.get_workflow_handle(claim_id(workflow_id, run_id))

    async def timed_out() -> bool:
        return (await claim.describe()).status == WorkflowExecutionStatus.TIMED_OUT

    await eventually(timed_out, timeout=30)  # the first worker died before it reset the run
    assert await claim_reset(client, workflow_id, run_id, "second worker")  # so another one takes over
    await claim.terminate("test over")


def test_the_build_id_changes_with_a_workflow_method_and_not_between_processes(tmp_path: Any) -> None:
    import subprocess
    import sys

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "flows.py").write_text("def on_release(state):\n    return state + 1\n")
    before = code_build_id.__wrapped__(package)
    (package / "flows.py").write_text("def on_release(state):\n    return state + 2\n")  # only a body changes
    assert code_build_id.__wrapped__(package) != before
    # What a killed worker recorded, a restarted one of the same code computes again.
    other = subprocess.run(
        [sys.executable, "-c", "from agentroster.workers.self_heal import code_build_id; print(code_build_id())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert other == code_build_id() and other.startswith("agentroster-")


async def test_a_wedged_run_another_build_wrote_is_left_to_an_operator(dev_env: WorkflowEnvironment, caplog: pytest.LogCaptureFixture) -> None:
    client = dev_env.client
    handle, run_id, queue = await wedged_pool(client, build_id="agentroster-test-an-older-build")
    before = resets("left_to_operator")
    caplog.set_level(logging.WARNING, logger="agentroster.worker")
    worker = healing_worker(client, queue)
    async with worker:
        await handle.signal("release", ["lease-2"])
        await eventually(lambda: resets("left_to_operator") == before + 1, timeout=60)
        assert (await handle.describe()).run_id == run_id  # not reset
        logged = [r.getMessage() for r in caplog.records if "is wedged" in r.getMessage()]
        assert logged and "written by build agentroster-test-an-older-build" in logged[-1]
        assert re.search(rf"To reset it: temporal workflow reset --workflow-id {handle.id} --run-id {run_id} --event-id \d+ ", logged[-1])
    await handle.terminate("test over")


async def test_a_worker_without_self_heal_only_fails_the_task(dev_env: WorkflowEnvironment) -> None:
    client = dev_env.client
    handle, run_id, queue = await wedged_pool(client, build_id=None)
    worker = create_worker(client, task_queue=queue, check_search_attributes=False, self_heal=False)
    assert worker.healer is None
    async with worker:
        await handle.signal("release", ["lease-2"])

        async def failing() -> bool:
            raw = (await handle.describe()).raw_description
            return raw.HasField("pending_workflow_task") and raw.pending_workflow_task.attempt >= 2

        await eventually(failing, timeout=30)
        assert (await handle.describe()).run_id == run_id
    await handle.terminate("test over")


async def test_the_sdk_wedge_itself_is_one_this_build_resets() -> None:
    """The recorded pool history with its load notice moved before the update's acceptance, as
    temporalio 1.35's core wrote it after a worker kill (tests/test_partial_task.py): the replay
    names the workflow task that diverged, and a worker of the build that wrote it resets it."""
    import json

    from temporalio.client import WorkflowHistory

    from tests.test_partial_task import HISTORY, _swap_notice_before_acceptance

    recorded = json.loads(HISTORY.read_text())
    history = WorkflowHistory.from_json("pool/exp", {"events": _swap_notice_before_acceptance(recorded["events"])})
    found = await replay_history(history)
    assert not found.ok and "Update machine does not handle this event" in (found.error or "")
    assert found.task_event_id is not None
    wrote = build_of_task(list(history.events), found.task_event_id)
    assert wrote
    assert decide(found, wrote, wrote, None).action == "reset"
    assert decide(found, wrote, "a-newer-build", None).action == "left_to_operator"


async def test_the_worker_cli_resets_a_run_a_worker_of_the_same_code_wrote(dev_env: WorkflowEnvironment, tmp_path: Any) -> None:
    """`agentroster worker` as users run it, in its own process (as a worker restarted after a
    kill): the run this process wrote with the same code's build id is reset by it."""
    from benchmarks.chaos_procs import WorkerProcess

    client = dev_env.client
    handle, run_id, queue = await wedged_pool(client, build_id=code_build_id())
    log = tmp_path / "worker.log"
    worker = WorkerProcess(client.service_client.config.target_host, handle.id.split("/", 1)[1], queue, log)
    await worker.start()
    try:
        await handle.signal("release", ["lease-2"])
        await eventually(lambda: "is reset to the workflow task completed at event" in log.read_text(), timeout=60)
        assert (await handle.describe()).run_id != run_id
        assert (await client.get_workflow_handle(handle.id, run_id=run_id).describe()).status == WorkflowExecutionStatus.TERMINATED
    finally:
        await worker.terminate()
        await handle.terminate("test over")


async def test_a_long_lived_worker_forgets_runs_past_the_interval() -> None:
    import time

    from agentroster.workers.self_heal import SelfHealer

    healer = SelfHealer(None, "b1", workflow_types={"PoolWorkflow"}, delay_s=0)  # type: ignore[arg-type]
    looked: list[str] = []

    async def heal(workflow_id: str, run_id: str) -> None:
        looked.append(run_id)

    healer.heal = heal  # type: ignore[method-assign]
    long_ago = time.monotonic() - MIN_RESET_INTERVAL_S - 1
    healer._looked_at = {"old-run": long_ago, "recent-run": time.monotonic()}
    healer._reset_at = {"pool/old": long_ago, "pool/recent": time.monotonic()}
    await healer._look("pool/x", "new-run", "PoolWorkflow")
    assert looked == ["new-run"]
    assert set(healer._looked_at) == {"recent-run", "new-run"}
    assert set(healer._reset_at) == {"pool/recent"}


def _update_events(first_id: int, name: str, argument: Any, update_id: str, completed: bool = True) -> list[HistoryEvent]:
    """The UpdateAccepted (and UpdateCompleted) events of one update, as the server writes them."""
    accepted = HistoryEvent(event_id=first_id, event_type=EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)
    request = accepted.workflow_execution_update_accepted_event_attributes.accepted_request
    request.meta.update_id, request.meta.identity, request.input.name = update_id, "a client", name
    request.input.args.payloads.extend(DataConverter.default.payload_converter.to_payloads([argument]))
    if not completed:
        return [accepted]
    done = HistoryEvent(event_id=first_id + 1, event_type=EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED)
    done.workflow_execution_update_completed_event_attributes.meta.update_id = update_id
    return [accepted, done]


def test_every_pool_update_is_either_sent_again_after_a_reset_or_a_grant() -> None:
    # A new update on the pool must be placed in one of the two (or the healer silently drops it).
    updates = set(_Definition.from_class(PoolWorkflow).updates)
    assert RESENT_UPDATES["PoolWorkflow"] | GRANTING_UPDATES["PoolWorkflow"] == updates
    assert not RESENT_UPDATES["PoolWorkflow"] & GRANTING_UPDATES["PoolWorkflow"]
    for (workflow_type, update), (_field, alone) in RELEASES_RIDING_ON.items():
        assert update in GRANTING_UPDATES[workflow_type] and alone in RESENT_UPDATES[workflow_type]


def test_what_the_healer_sends_again_each_kind_of_update() -> None:
    arguments: dict[str, Any] = {
        "release_lease": "l1", "release_leases": ["l2"], "cancel_ticket": "t1", "cancel_tickets": ["t2"],
        "renew_lease": {"lease_id": "l3", "ttl_s": 30}, "set_policy": {"capability": "rag.search"},
        "shutdown": {}, "confirm_evictions": {"agents": None}, "set_eviction_policy": {"enabled": True},
        "may_evict": {"agent_id": "a1", "window_s": 30},
    }  # fmt: skip
    events = _update_events(2, "release_leases", ["before-the-point"], "u-before")  # before the reset point: the reset keeps it
    next_id = 10
    for name, argument in arguments.items():
        events += _update_events(next_id, name, argument, f"u-{name}")
        next_id += 2
    ask = {"ref": "rag.search@>=1", "request_id": "r1"}
    events += _update_events(next_id, "acquire", ask, "u-acquire")
    events += _update_events(next_id + 2, "acquire_many", [ask], "u-acquire-many")
    events += _update_events(next_id + 4, "release_and_acquire", {"releases": ["l4", "l5"], "acquires": [ask]}, "u-rna")
    events += _update_events(next_id + 6, "release_and_acquire", {"releases": [], "acquires": [ask]}, "u-rna-nothing")
    events += _update_events(next_id + 8, "release_leases", ["never-completed"], "u-open", completed=False)

    resent = updates_to_resend(events, 5, "PoolWorkflow")
    # Every non-granting kind, in history order, with its own id and argument; no grant; of
    # the release_and_acquire that released, its releases alone; nothing not completed.
    assert [r.meta.update_id for r in resent] == [f"u-{name}" for name in arguments] + ["u-rna"]
    assert [r.input.name for r in resent] == list(arguments) + ["release_leases"]
    converter = DataConverter.default.payload_converter
    for request, argument in zip(resent, [*arguments.values(), ["l4", "l5"]], strict=True):
        assert converter.from_payloads(list(request.input.args.payloads), None) == [argument]
    # Other workflow types: nothing (their updates are not the pool's).
    assert updates_to_resend(events, 5, "AgentWorkflow") == []


def test_a_release_and_acquire_whose_argument_cannot_be_read_is_logged_not_sent(caplog: pytest.LogCaptureFixture) -> None:
    events = _update_events(10, "release_and_acquire", {"acquires": []}, "u-odd")
    caplog.set_level(logging.WARNING, logger="agentroster.worker")
    assert updates_to_resend(events, 5, "PoolWorkflow") == []
    assert any("the releases of update u-odd (release_and_acquire) could not be read" in r.getMessage() for r in caplog.records)
