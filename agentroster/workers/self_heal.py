"""A worker resets a run of ours that its own build wrote and cannot replay (issue 7).

The rare wedge it is for: after a worker is killed, temporalio 1.35's core can write a
history whose commands come in another order than replay gives them (a workflow task the
restarted worker dropped; see `partial_task_guard` and the README's Known limits). Every
worker that rebuilds that run from history then fails its workflow tasks with a
nondeterminism error, for ever: the pool answers nothing. What unsticks it is a reset to
the workflow task whose commands diverged; `agentroster replay` prints that command, and
this module runs it without waiting for a human, but only when the diverging task was
completed by a worker of this very build:

- same build: the code that wrote the task cannot replay it, so no code change is at
  fault (nothing newer to deploy instead); the reset runs that task again with this code,
  and the server applies the signals that came after it again (not the updates:
  `REAPPLY_EXCLUDED`);
- another build (a rollout, a code change without `workflow.patched`): a reset would throw
  away what the other build recorded; this worker logs the reset command and counts the
  run in `agentroster_worker_workflow_resets{outcome="left_to_operator"}`, and an operator
  chooses between deploying code that replays and running the command.

How it learns of a wedge: the SDK evicts a run whose replay failed with a nondeterminism
error, and the eviction reaches our runner's instance (`partial_task_guard`), which calls
`notice`; no polling, no billed action. The history is then read and replayed here (the
worker's own sandbox and converter), so a failure that does not reproduce changes nothing;
only a nondeterminism error leads to a reset. "This very build" is `code_build_id()`, a hash
of our source files that workers record on every task (the SDK's default build id hashes
only modules' top-level bytecode and stays the same when a workflow method changes).
At most one reset per run: workers that see the same wedge at once elect one by starting a
claim workflow with an id derived from the run (`claim_reset`; the server itself would reset
the run twice; a claim whose worker died times out and another worker takes over); and at
most one per workflow every `MIN_RESET_INTERVAL_S`, read from the history (a run made by a
reset says when): a workflow that diverges again within it is left to an operator.

What a reset costs a pool: the server does not apply the updates after the reset point
again (`REAPPLY_EXCLUDED`); the healer sends the new run those that told their callers
something was done and may be applied twice (releases, cancels, renewals, policies, a
shutdown, eviction asks: `RESENT_UPDATES`; the releases that rode on a
`release_and_acquire`, as a `release_leases`), after the reapplied signals. Not the grants: a lease granted
after the reset point is not known to the new run. Its holder's next renewal raises
LeaseLostError (a CapabilityTaskWorkflow fails over; `leased()` logs it; a plain
`acquire()` caller that does not renew never learns); until that holder is done, its agent
may be given one task more than its max_concurrency per such lease (the agent's own limit
answers 429). A caller whose acquire was waiting on the wedged run is answered by the new
run (the server or our client asks it again). A human running `agentroster replay`'s
command gets the same, without the updates sent again; a wedged pool grants nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyExcludeType, UpdateWorkflowExecutionLifecycleStage, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.update.v1 import Meta, Request, WaitPolicy
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest, UpdateWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDReusePolicy
from temporalio.converter import DataConverter, PayloadConverter
from temporalio.exceptions import WorkflowAlreadyStartedError

from agentroster.metrics import WORKFLOW_RESETS
from agentroster.replay import ReplayReport, make_replayer, replay_history, reset_command

logger = logging.getLogger("agentroster.worker")

# A wedge is looked at this long after the first failure: the history settles, and a
# failure that was only this worker's (an eviction racing a task) has passed.
HEAL_DELAY_S = 5.0
# At most one automatic reset per workflow id in this long (a workflow that keeps diverging
# is left to an operator); a run left to the operator is logged again after as long.
MIN_RESET_INTERVAL_S = 600.0
RESET_REASON = "agentroster worker: history written by this build does not replay from event {event}"
# What a reset does not apply again: updates. The server reapplies them as UpdateAdmitted
# events, which temporalio 1.35's core hands to the workflow in history order among the
# signals when it runs the task live, but after all of them in replay; a pool (whose
# acquires and releases depend on their order) then writes a run that does not replay
# again (seen in the reliability harness; tests/test_reset_reapply.py). Signals are
# reapplied: they are delivered in the same order both ways.
REAPPLY_EXCLUDED = [ResetReapplyExcludeType.RESET_REAPPLY_EXCLUDE_TYPE_UPDATE]
# The updates after the reset point that the healer itself sends the new run again, in
# their order and with their own arguments (after the reset's reapplied signals): each
# told its caller something was done (a release, a cancel, a renewal, a policy, a
# shutdown, an eviction allowed or held), and applying it again does no harm (a released
# lease released again is a no-op; an eviction ask asked again counts the agent in the
# eviction window, as the old run did). Not the updates that grant: a grant applied again
# is a lease under a new id that nobody holds (`GRANTING_UPDATES`: their leases are
# unknown to the new run, see the module's docstring); of a `release_and_acquire`, only
# its releases are sent again, as a `release_leases` (`RELEASES_RIDING_ON`).
RESENT_UPDATES: dict[str, frozenset[str]] = {
    "PoolWorkflow": frozenset({
        "release_lease", "release_leases", "cancel_ticket", "cancel_tickets", "renew_lease",
        "set_policy", "shutdown", "confirm_evictions", "set_eviction_policy", "may_evict",
    }),
}
GRANTING_UPDATES: dict[str, frozenset[str]] = {
    "PoolWorkflow": frozenset({"acquire", "acquire_many", "release_and_acquire"}),
}
# Granting updates whose argument also returns leases: (workflow type, update) -> (the
# argument's field that lists them, the update that returns them alone).
RELEASES_RIDING_ON: dict[tuple[str, str], tuple[str, str]] = {
    ("PoolWorkflow", "release_and_acquire"): ("releases", "release_leases"),
}
RESENT_SUFFIX = "/after-reset"
RESENT_IDENTITY = "agentroster self-heal"
# The claim workflows (`claim_reset`): no worker polls this queue.
CLAIM_PREFIX = "agentroster-reset/"
CLAIM_WORKFLOW_TYPE = "AgentRosterResetClaim"
CLAIM_TASK_QUEUE = "agentroster-reset-claims"
# A claim whose worker died before it reset the run times out after this; its id is then free again.
CLAIM_TIMEOUT = timedelta(minutes=2)
# Versions of what our workflows' behaviour depends on besides our own code (see `code_build_id`).
_CODE_DEPENDENCIES = ("temporalio", "pydantic", "packaging", "sortedcontainers")


@dataclass(frozen=True)
class Verdict:
    """What to do with a run whose workflow task failed with a nondeterminism error."""

    action: str  # "none" (it replays), "reset", "left_to_operator"
    why: str


def decide(report: ReplayReport, written_by: str | None, this_build: str, last_reset_s_ago: float | None) -> Verdict:
    """Reset only a run whose replay fails with a nondeterminism error in a workflow task this
    build completed, and not twice within MIN_RESET_INTERVAL_S for one workflow
    (`last_reset_s_ago`: since its latest reset by any worker, when known)."""
    if report.ok:
        return Verdict("none", "its history replays with this code")
    if report.error_type != "NondeterminismError":
        # E.g. the deadlock detector on a busy worker: not a divergence, nothing a reset would mend.
        return Verdict("left_to_operator", f"the replay failed with {report.error_type or 'an error'}, not a nondeterminism error")
    if report.task_event_id is None:
        return Verdict("left_to_operator", "the workflow task whose commands diverged was not found")
    if not written_by:
        return Verdict("left_to_operator", f"the workflow task completed at event {report.task_event_id} names no build id")
    if written_by != this_build:
        return Verdict(
            "left_to_operator",
            f"the workflow task completed at event {report.task_event_id} was written by build {written_by}, this worker is "
            f"{this_build}: deploy code that replays it, or reset",
        )
    if last_reset_s_ago is not None and last_reset_s_ago < MIN_RESET_INTERVAL_S:
        return Verdict("left_to_operator", f"the workflow was reset {last_reset_s_ago:.0f} s ago: it diverged again")
    return Verdict("reset", f"this build wrote the workflow task completed at event {report.task_event_id} and cannot replay it")


def updates_to_resend(
    events: list[HistoryEvent], task_event_id: int, workflow_type: str, converter: PayloadConverter | None = None
) -> list[Request]:
    """The update requests after the reset point (`task_event_id`) that the healer sends the new
    run again: accepted and completed in the old run, of a kind in `RESENT_UPDATES` as they
    were, and the releases of a `RELEASES_RIDING_ON` grant as their own update; in order."""
    kinds = RESENT_UPDATES.get(workflow_type, frozenset())
    completed = {
        e.workflow_execution_update_completed_event_attributes.meta.update_id
        for e in events
        if e.event_id > task_event_id and e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED
    }
    found = []
    for e in events:
        if e.event_id > task_event_id and e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            request = e.workflow_execution_update_accepted_event_attributes.accepted_request
            if request.meta.update_id not in completed:
                continue
            if request.input.name in kinds:
                found.append(request)
            elif (workflow_type, request.input.name) in RELEASES_RIDING_ON:
                field, update = RELEASES_RIDING_ON[(workflow_type, request.input.name)]
                releases = _riding_releases(request, field, update, converter or DataConverter.default.payload_converter)
                if releases is not None:
                    found.append(releases)
    return found


def _riding_releases(request: Request, field: str, update: str, converter: PayloadConverter) -> Request | None:
    """`request`'s releases (its argument's `field`) as an `update` request of their own under
    its id, or None when it released nothing (or its argument cannot be read)."""
    try:
        [argument] = converter.from_payloads(list(request.input.args.payloads), None)
        lease_ids = argument[field] if isinstance(argument, dict) else None
    except Exception:  # validated when it was taken; another encoding is not ours to read
        lease_ids = None
    if not isinstance(lease_ids, list) or not lease_ids:
        if lease_ids is None:
            logger.warning("the releases of update %s (%s) could not be read: not sent again", request.meta.update_id, request.input.name)
        return None
    releases = Request(meta=Meta(update_id=request.meta.update_id, identity=request.meta.identity))
    releases.input.name = update
    releases.input.header.CopyFrom(request.input.header)
    releases.input.args.payloads.extend(converter.to_payloads([lease_ids]))
    return releases


def build_of_task(events: list[Any], task_event_id: int) -> str | None:
    """The build id that completed the workflow task at `task_event_id` (WorkflowTaskCompleted)."""
    for event in events:
        if event.event_id == task_event_id and event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            a = event.workflow_task_completed_event_attributes
            return a.worker_version.build_id or a.deployment_version.build_id or a.deployment.build_id or a.binary_checksum or None
    return None


@functools.cache
def code_build_id(package_dir: Path | None = None) -> str:
    """A build id that names this code: a hash of every source file of the package and the
    versions of what its workflows depend on. The SDK's default hashes only each module's
    top-level bytecode, so a change inside a workflow method keeps it; self-heal must not
    mistake a run an older version wrote for one this version wrote."""
    root = package_dir or Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for dependency in _CODE_DEPENDENCIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{dependency}=={metadata.version(dependency)}\n".encode())
    digest.update(f"python {sys.version_info.major}.{sys.version_info.minor}\n".encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"agentroster-{digest.hexdigest()[:32]}"


# Read once, as the code is imported: files changed on disk afterwards (a pull into an editable
# install) must not give the running code the new code's id.
code_build_id()


def last_reset_age_s(events: list[Any], now: datetime | None = None) -> float | None:
    """Seconds since the run was made by a reset (its WorkflowTaskFailed with cause
    RESET_WORKFLOW, which every worker can read), or None if it was not."""
    for event in reversed(events):
        if (
            event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
            and event.workflow_task_failed_event_attributes.cause == WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_WORKFLOW
        ):
            at = event.event_time.ToDatetime().replace(tzinfo=timezone.utc)
            return max(0.0, ((now or datetime.now(timezone.utc)) - at).total_seconds())
    return None


def reset_request_id(workflow_id: str, run_id: str, event_id: int) -> str:
    """The reset's request id: the same from every worker that resets this run at this event."""
    digest = hashlib.sha256(f"agentroster-reset:{workflow_id}:{run_id}:{event_id}".encode()).digest()
    return str(uuid.UUID(bytes=digest[:16]))


def claim_id(workflow_id: str, run_id: str) -> str:
    """The workflow id whose start claims the reset of one run (see `claim_reset`)."""
    return f"{CLAIM_PREFIX}{workflow_id}/{run_id}"


async def claim_reset(client: Client, workflow_id: str, run_id: str, summary: str, timeout: timedelta = CLAIM_TIMEOUT) -> bool:
    """Whether this worker is the one to reset the run. The server makes a second reset of
    the same run if asked (it resets closed runs too, terminating the current one), so
    workers that saw the same wedge elect one: the first to start a workflow with the id
    `claim_id(...)` (a record in the UI, never run: it is terminated with what was done);
    the others find it running. A claim whose worker died times out and its id is free
    again (ALLOW_DUPLICATE_FAILED_ONLY: a terminated or timed-out claim can be started
    again), so the caller must check that the run still needs its reset after claiming.
    One billed action per claim."""
    try:
        await client.start_workflow(
            CLAIM_WORKFLOW_TYPE,
            id=claim_id(workflow_id, run_id),
            task_queue=CLAIM_TASK_QUEUE,
            execution_timeout=timeout,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
            static_summary=summary,
        )
    except WorkflowAlreadyStartedError:
        return False
    return True


class SelfHealer:
    """Resets runs of ours that this build wrote and cannot replay (see the module's docstring)."""

    def __init__(
        self,
        client: Client,
        build_id: str,
        *,
        workflow_types: set[str] | frozenset[str],
        delay_s: float = HEAL_DELAY_S,
        replayer_factory: Callable[[], Any] = make_replayer,
    ) -> None:
        self.client = client
        self.build_id = build_id
        self.workflow_types = frozenset(workflow_types)
        self.delay_s = delay_s
        self._replayer_factory = replayer_factory
        self.loop: asyncio.AbstractEventLoop | None = None  # the worker's, set when it starts
        self._looking: set[str] = set()  # run ids being looked at
        self._looked_at: dict[str, float] = {}  # run id -> (monotonic) when last looked at
        self._reset_at: dict[str, float] = {}  # workflow id -> (monotonic) when this worker last reset it
        self._retry_after: dict[str, float] = {}  # run id -> (monotonic) look again from then (another worker's claim)
        self._jobs: set[asyncio.Task[None]] = set()
        # One replay at a time: a rollout that breaks replay for every agent must not turn this
        # worker into a replayer of all their histories at once.
        self._one_at_a_time = asyncio.Semaphore(1)
        self.verdicts: list[tuple[str, str, Verdict]] = []  # (workflow id, run id, verdict), the latest 100

    def notice(self, workflow_id: str, run_id: str, workflow_type: str, message: str) -> None:
        """A run was evicted for nondeterminism (called from the workflow task thread)."""
        if workflow_type not in self.workflow_types or self.loop is None or self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self._start, workflow_id, run_id, workflow_type, message)

    def _reset_age_here(self, workflow_id: str) -> float | None:
        at = self._reset_at.get(workflow_id)
        return None if at is None else time.monotonic() - at

    def _start(self, workflow_id: str, run_id: str, workflow_type: str, message: str) -> None:
        now = time.monotonic()
        last = self._looked_at.get(run_id)
        again = self._retry_after.get(run_id)
        recently = last is not None and now - last < MIN_RESET_INTERVAL_S and not (again is not None and now >= again)
        if run_id in self._looking or recently:
            return
        self._retry_after.pop(run_id, None)
        self._looking.add(run_id)
        logger.warning("%s %s (run %s) does not replay on this worker: %s; looking at it in %g s", workflow_type, workflow_id, run_id, message, self.delay_s)
        job = asyncio.get_running_loop().create_task(self._look(workflow_id, run_id, workflow_type))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def _look(self, workflow_id: str, run_id: str, workflow_type: str) -> None:
        try:
            await asyncio.sleep(self.delay_s)
            async with self._one_at_a_time:
                verdict = await self.heal(workflow_id, run_id)
            if verdict is not None:
                self.verdicts = [*self.verdicts[-99:], (workflow_id, run_id, verdict)]
                if verdict.action != "none":
                    WORKFLOW_RESETS.labels(workflow_type=workflow_type, outcome=verdict.action).inc()
        except Exception:
            logger.exception("%s %s (run %s): could not look at its history; an operator can: agentroster replay %s", workflow_type, workflow_id, run_id, workflow_id)
        finally:
            self._looking.discard(run_id)
            now = time.monotonic()
            # Forget what is past its interval: a long-lived worker keeps only what still matters.
            for seen in [r for r, at in self._looked_at.items() if now - at >= MIN_RESET_INTERVAL_S]:
                del self._looked_at[seen]
            for seen in [w for w, at in self._reset_at.items() if now - at >= MIN_RESET_INTERVAL_S]:
                del self._reset_at[seen]
            for seen in [r for r, at in self._retry_after.items() if now - at >= MIN_RESET_INTERVAL_S]:
                del self._retry_after[seen]
            self._looked_at[run_id] = now

    async def heal(self, workflow_id: str, run_id: str) -> Verdict | None:
        """Read and replay the run; reset it when `decide` says so. None: the run is no longer open."""
        handle = self.client.get_workflow_handle(workflow_id, run_id=run_id)
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            return None
        history = await handle.fetch_history()
        report = await replay_history(history, replayer=self._replayer_factory())
        events = list(history.events)
        written_by = build_of_task(events, report.task_event_id) if report.task_event_id is not None else None
        ages = [age for age in (self._reset_age_here(workflow_id), last_reset_age_s(events)) if age is not None]
        verdict = decide(report, written_by, self.build_id, min(ages) if ages else None)
        if verdict.action == "none":
            logger.info("%s (run %s) replays with this code now: nothing to do", workflow_id, run_id)
        elif verdict.action == "left_to_operator":
            command = reset_command(report, run_id)
            logger.error(
                "%s (run %s) is wedged: no worker can run its workflow tasks (%s); not reset automatically: %s.%s",
                workflow_id, run_id, report.error, verdict.why, f" To reset it: {command}" if command else "",
            )
        else:
            assert report.task_event_id is not None
            summary = f"reset of {workflow_id} run {run_id} to the workflow task completed at event {report.task_event_id}"
            if not await claim_reset(self.client, workflow_id, run_id, summary):
                logger.info("%s (run %s): another worker resets it", workflow_id, run_id)
                # Look again once that claim would have timed out (its worker may have died).
                self._retry_after[run_id] = time.monotonic() + CLAIM_TIMEOUT.total_seconds()
                return Verdict("none", "another worker claimed the reset")
            new_run = await self.reset_claimed(workflow_id, run_id, report.task_event_id, report.event_id, summary)
            if new_run is None:
                return None
            resent = await self.resend_updates(
                workflow_id, new_run, updates_to_resend(events, report.task_event_id, description.workflow_type, self.client.data_converter.payload_converter)
            )
            logger.warning(
                "%s (run %s) was wedged (%s) and is reset to the workflow task completed at event %d: new run %s, "
                "sent %d update(s) from after that point again (%s). Leases granted after that point are unknown "
                "to the new run (their holders' renewals fail over)",
                workflow_id, run_id, report.error, report.task_event_id, new_run, len(resent), ", ".join(resent) or "none",
            )
        return verdict

    async def reset_claimed(self, workflow_id: str, run_id: str, task_event_id: int, event_id: int | None, summary: str) -> str | None:
        """Reset a run whose claim this worker holds; the new run id, or None if the run is no
        longer open. The claim is terminated with what was done (a terminated claim can be
        started again: the next worker to see the wedge tries if this one failed)."""
        claim = self.client.get_workflow_handle(claim_id(workflow_id, run_id))
        try:
            # The claim may be a second one (the first timed out, or was done just now): reset
            # only a run that is still open, or the server would reset it again.
            if (await self.client.get_workflow_handle(workflow_id, run_id=run_id).describe()).status != WorkflowExecutionStatus.RUNNING:
                with contextlib.suppress(Exception):
                    await claim.terminate("the run was no longer open: nothing to reset")
                return None
            response = await self.client.workflow_service.reset_workflow_execution(
                ResetWorkflowExecutionRequest(
                    namespace=self.client.namespace,
                    workflow_execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
                    reason=RESET_REASON.format(event=event_id),
                    workflow_task_finish_event_id=task_event_id,
                    request_id=reset_request_id(workflow_id, run_id, task_event_id),
                    reset_reapply_exclude_types=REAPPLY_EXCLUDED,
                )
            )
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await claim.terminate(f"reset failed: {exc!r}"[:1000])
            raise
        self._reset_at[workflow_id] = time.monotonic()
        with contextlib.suppress(Exception):  # the record in the UI says what was done; it times out otherwise
            await claim.terminate(f"{summary}: new run {response.run_id}")
        return response.run_id

    async def resend_updates(self, workflow_id: str, new_run: str, requests: list[Request]) -> list[str]:
        """Send the new run these update requests again, one after another (each its original
        arguments and headers, under its id + RESENT_SUFFIX, so a second healer's copy is the
        same update); the names of those it took. One it refuses is logged, not retried."""
        sent = []
        for request in requests:
            again = Request(meta=Meta(update_id=request.meta.update_id + RESENT_SUFFIX, identity=RESENT_IDENTITY))
            again.input.CopyFrom(request.input)
            try:
                response = await self.client.workflow_service.update_workflow_execution(
                    UpdateWorkflowExecutionRequest(
                        namespace=self.client.namespace,
                        workflow_execution=WorkflowExecution(workflow_id=workflow_id, run_id=new_run),
                        request=again,
                        wait_policy=WaitPolicy(
                            lifecycle_stage=UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_COMPLETED
                        ),
                    ),
                    retry=True,
                    timeout=timedelta(seconds=30),
                )
            except Exception as exc:
                logger.warning("%s (run %s): the update %s %s from before the reset was not taken again: %s",
                               workflow_id, new_run, request.input.name, request.meta.update_id, exc)
                continue
            if response.outcome.HasField("failure"):
                logger.warning("%s (run %s): the update %s %s from before the reset was refused by the new run: %s",
                               workflow_id, new_run, request.input.name, request.meta.update_id, response.outcome.failure.message)
                continue
            sent.append(request.input.name)
        return sent

    async def close(self) -> None:
        """Stop looking (the worker stops)."""
        for job in list(self._jobs):
            job.cancel()
        if self._jobs:
            await asyncio.wait(set(self._jobs), timeout=5)


__all__ = ["CLAIM_PREFIX", "CLAIM_TIMEOUT", "claim_id", "claim_reset", "code_build_id", "last_reset_age_s", "HEAL_DELAY_S", "MIN_RESET_INTERVAL_S", "GRANTING_UPDATES", "REAPPLY_EXCLUDED", "RELEASES_RIDING_ON", "RESENT_UPDATES", "SelfHealer", "Verdict", "build_of_task", "decide", "reset_request_id", "updates_to_resend"]
