"""Invariant checks for the reliability harness (benchmarks/chaos.py).

- `LeaseLedger`: every lease the harness's clients were handed, from the moment
  `acquire` returned until just before `release` was sent. Holding intervals seen
  by clients lie inside the pool's own (the pool granted before the client saw it,
  and the client stops counting before it releases), so more holders of one agent
  than its max_concurrency at any moment, or one lease id handed to two holders,
  is a double lease the pool really made.
- `history_counts`: WorkflowTaskFailed events in every run of a workflow (following
  continue-as-new chains, so a run visibility has not listed yet counts), split by
  cause: failures of the workflow's own task (an exception, non-determinism, a bad
  command: the invariant), tasks the *server* closed so the workflow sees events
  that arrived meanwhile (`SERVER_CLOSED_CAUSES`: a signal that came in while the
  task continued as new, signals buffered past the server's limit). Those are
  retried at once; they are counted and shown, not judged.
- `wait_no_active_leases`: after every client released, leases still active in the
  pool are leaked: nobody holds them.
- `predicted_uuid4s`: what `workflow.uuid4()` returns in a run, computed from the
  run id alone (SipHash-1-3 of the run id seeds the SDK's `random.Random`): what an
  attacker who can describe a workflow can compute.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowHistory
from temporalio.service import RPCError, RPCStatusCode

from agentroster.models import Lease


@dataclass
class Grant:
    lease_id: str
    agent_id: str
    holder: str
    received_at: float  # monotonic, when acquire returned
    granted_at: float  # wall clock, the pool's workflow time


@dataclass
class LeaseLedger:
    """Who holds what, as the clients see it; records every double lease."""

    caps: dict[str, int]
    held: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))  # agent -> lease id -> holder
    grants: list[Grant] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    ever: set[str] = field(default_factory=set)

    def granted(self, lease: Lease, holder: str) -> None:
        now = time.monotonic()
        self.grants.append(Grant(lease.lease_id, lease.agent_id, holder, now, lease.granted_at.timestamp()))
        holders = self.held[lease.agent_id]
        if lease.lease_id in holders:
            self.violations.append(f"lease {lease.lease_id} on {lease.agent_id} handed to {holder} while {holders[lease.lease_id]} holds it")
        elif lease.lease_id in self.ever:
            self.violations.append(f"lease {lease.lease_id} on {lease.agent_id} handed out again to {holder} after it was released")
        holders[lease.lease_id] = holder
        self.ever.add(lease.lease_id)
        cap = self.caps.get(lease.agent_id)
        if cap is not None and len(holders) > cap:
            self.violations.append(
                f"{len(holders)} holders on {lease.agent_id} (max_concurrency {cap}): " + ", ".join(sorted(set(holders.values())))
            )

    def releasing(self, lease: Lease) -> None:
        self.held[lease.agent_id].pop(lease.lease_id, None)

    def held_count(self) -> int:
        return sum(len(h) for h in self.held.values())

    def first_grant_after(self, monotonic_t: float, wall_after: float) -> Grant | None:
        """The first lease a client received after `monotonic_t` that the pool granted after `wall_after`."""
        for grant in self.grants:
            if grant.received_at >= monotonic_t and grant.granted_at >= wall_after:
                return grant
        return None


async def run_ids(client: Client, workflow_id: str) -> list[str]:
    """Every run of `workflow_id`: those visibility lists, and those their continue-as-new chains lead to."""
    found: list[str] = []
    async for wf in client.list_workflows(f'WorkflowId="{workflow_id}"'):
        found.append(wf.run_id)
    try:
        found.append((await client.get_workflow_handle(workflow_id).describe()).run_id)
    except Exception:
        pass
    return list(dict.fromkeys(found))


SERVER_CLOSED_CAUSES = frozenset({
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,  # new events arrived while it completed
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,  # buffered events over the server's limit
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FAILOVER_CLOSE_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE,
    # After a server restart: an update the server had completed, resent by its client under the
    # same id and accepted again by a worker that had not seen the completion; the server refuses
    # that task and the worker retries it from history.
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_BAD_UPDATE_WORKFLOW_EXECUTION_MESSAGE,
})


async def fetch_history(client: Client, workflow_id: str, run_id: str | None = None, *, patience_s: float = 120.0) -> WorkflowHistory:
    """A run's history, asked again while the server says the workflow is busy (RESOURCE_EXHAUSTED:
    a hot workflow's lock is taken), for up to `patience_s`."""
    deadline = time.monotonic() + patience_s
    wait = 0.5
    while True:
        try:
            return await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        except RPCError as exc:
            if exc.status != RPCStatusCode.RESOURCE_EXHAUSTED or time.monotonic() + wait > deadline:
                raise
        await asyncio.sleep(wait)
        wait = min(wait * 2, 10.0)


async def history_counts(client: Client, workflow_id: str) -> dict[str, Any]:
    """Counts over every run: runs, WorkflowTaskFailed (by the workflow / closed by the
    server, with causes), WorkflowTaskTimedOut, events."""
    counts: dict[str, Any] = {"runs": 0, "task_failed": 0, "server_closed": 0, "task_timed_out": 0, "events": 0, "causes": {}}
    pending = await run_ids(client, workflow_id)
    seen: set[str] = set()
    while pending:
        run_id = pending.pop()
        if run_id in seen:
            continue
        seen.add(run_id)
        history = await fetch_history(client, workflow_id, run_id)
        counts["runs"] += 1
        for event in history.events:
            counts["events"] += 1
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                attributes = event.workflow_task_failed_event_attributes
                cause = WorkflowTaskFailedCause.Name(attributes.cause).removeprefix("WORKFLOW_TASK_FAILED_CAUSE_")
                counts["causes"][cause] = counts["causes"].get(cause, 0) + 1
                if attributes.cause in SERVER_CLOSED_CAUSES:
                    counts["server_closed"] += 1
                else:
                    counts["task_failed"] += 1
                    counts.setdefault("failures", []).append(f"{workflow_id} run {run_id} event {event.event_id}: {cause}: {attributes.failure.message[:300]}")
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
                counts["task_timed_out"] += 1
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                pending.append(event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id)
    return counts


@dataclass
class PoolTasks:
    """A pool's workflow tasks over its whole continue-as-new chain, for a benchmark where no
    worker is killed: every task that timed out or failed is a spurious one."""

    runs: int = 0
    timed_out: int = 0
    failed: int = 0
    server_closed: int = 0

    @classmethod
    def of(cls, counts: dict[str, Any]) -> PoolTasks:
        """From `history_counts`."""
        return cls(counts["runs"], counts["task_timed_out"], counts["task_failed"], counts["server_closed"])

    @property
    def ok(self) -> bool:
        return self.timed_out == 0 and self.failed == 0

    def plus(self, other: PoolTasks) -> PoolTasks:
        """Two pools' counts together."""
        return PoolTasks(
            self.runs + other.runs, self.timed_out + other.timed_out, self.failed + other.failed, self.server_closed + other.server_closed
        )


async def wait_no_active_leases(roster: Any, timeout: float, expected: int = 0) -> int:
    """Poll the pool until at most `expected` leases are active; returns what is left above it."""
    deadline = time.monotonic() + timeout
    while True:
        status = await asyncio.wait_for(roster.status(), timeout=max(1.0, deadline - time.monotonic()) + 5)
        if status.active_leases <= expected or time.monotonic() > deadline:
            return max(0, status.active_leases - expected)
        await asyncio.sleep(0.25)


# ----------------------------------------------------------------- predicting workflow.uuid4()
_M = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M


def siphash13(data: bytes, k0: int = 0, k1: int = 0) -> int:
    """SipHash-1-3 (one compression round, three finalisation rounds), as Rust's `siphasher` crate."""
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573

    def rounds(n: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & _M
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & _M
            v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & _M
            v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & _M
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)

    end = len(data) - len(data) % 8
    for i in range(0, end, 8):
        m = int.from_bytes(data[i : i + 8], "little")
        v3 ^= m
        rounds(1)
        v0 ^= m
    last = ((len(data) & 0xFF) << 56) | int.from_bytes(data[end:], "little")
    v3 ^= last
    rounds(1)
    v0 ^= last
    v2 ^= 0xFF
    rounds(3)
    return v0 ^ v1 ^ v2 ^ v3


def run_seed(run_id: str) -> int:
    """The seed sdk-core gives a run's `workflow.random()`: SipHash-1-3 of the run id as Rust hashes a str."""
    return siphash13(run_id.encode() + b"\xff")


def predicted_uuid4s(run_id: str, count: int) -> list[str]:
    """The first `count` values of `workflow.uuid4().hex` in the run `run_id` (no other use of
    `workflow.random()` in between, and no reset of the seed)."""
    rng = random.Random(run_seed(run_id))
    return [uuid.UUID(bytes=rng.getrandbits(128).to_bytes(16, "big"), version=4).hex for _ in range(count)]


async def replay_failures(client: Client, workflow_ids: list[str]) -> list[str]:
    """Replay every run of every workflow with the worker's own workflows and sandbox: a
    history the workflow code cannot replay wedges that workflow the next time a worker
    rebuilds it (after a restart or a cache eviction), even if it has not happened yet."""
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.worker import Replayer

    from agentroster.workflows import workflow_classes, workflow_runner

    # debug_mode: no 2 s deadlock detector here. A task that slow is a WorkflowTaskFailed the
    # histories already show; this check is about determinism alone.
    replayer = Replayer(workflows=workflow_classes(), workflow_runner=workflow_runner(), data_converter=pydantic_data_converter, debug_mode=True)
    failures: list[str] = []
    for workflow_id in workflow_ids:
        pending = await run_ids(client, workflow_id)
        seen: set[str] = set()
        while pending:
            run_id = pending.pop()
            if run_id in seen:
                continue
            seen.add(run_id)
            history = await fetch_history(client, workflow_id, run_id)
            for event in history.events:
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                    pending.append(event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id)
            result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
            if result.replay_failure is not None:
                failures.append(f"{workflow_id} run {run_id}: {str(result.replay_failure)[:400]}")
    return failures

