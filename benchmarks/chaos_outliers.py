"""The reliability harness's outlier row: one of four agents turns bad and well again under load.

Four agent processes (benchmarks/chaos_agent.py) serve `chaos.hold@1.0.0`; clients
send tasks through `roster.invoke` (its failover included). The first agent reads its
mode from a file the harness writes, and logs every task that reaches it. Phases:

1. healthy: the latency baseline;
2. broken: the bad agent answers HTTP 500 to every task;
3. recovery: it is healthy again; tasks run until it is back in rotation after its trial task;
4. hung: it accepts tasks and answers nothing (the task times out after `task_timeout_s`);
5. recovery, as 3;
6. healthy again: the second half of the baseline (the machine is shared);
7. pool state lost: the pool workflow is terminated (as by mistake) while the agents
   keep heartbeating, and an acquire is sent at once: the time to its lease (goal
   <= 20 s) and until the new run routes to every agent again.

What each phase shows comes from three places that do not depend on each other: the
clients (latency, failed tasks), the bad agent's own log (tasks that reached it) and
the pool's `status` (its ejection warnings, which say until when; every ejection lasts
the policy's `ejection_s`, so it started `ejection_s` before that).
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agentroster.client.roster import AgentRoster
from agentroster.errors import AgentRosterError

REF = "chaos.hold@>=1,<2"


@dataclass
class OutlierConfig:
    agents: int = 4
    slots: int = 4
    clients: int = 4
    tasks: int = 60  # per phase with a fixed load
    hold_s: float = 0.2  # each task's work
    task_timeout_s: float = 1.0  # what a hung agent costs each task it gets
    ejection_s: float = 3.0  # base and max ejection time of the harness's policy: every ejection lasts this
    recovery_wait_s: float = 30.0  # for the bad agent to be back after its trial task
    state_loss_wait_s: float = 60.0  # for the first lease after the pool's state is lost


STATE_LOSS_GOAL_S = 20.0  # terminating the pool workflow -> the next lease (issue 28)


@dataclass
class Phase:
    name: str
    mode: str  # the bad agent's
    started: float = 0.0  # wall clock (the agents' log and the pool's warnings use it too)
    ended: float = 0.0
    latencies: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    reached: int = 0  # tasks that reached the bad agent, by its own log
    first_bad_task: float | None = None  # wall time of the first task it served in the bad mode
    ejections: list[tuple[float, str]] = field(default_factory=list)  # (when, why): the pool's
    back_s: float | None = None  # recovery: from the mode turned healthy to back in rotation

    @property
    def tasks(self) -> int:
        return len(self.latencies) + len(self.failed)

    @property
    def p50_s(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")

    @property
    def to_ejection_s(self) -> float | None:
        """From the first task that reached the bad agent in its bad mode to its first ejection after."""
        if self.first_bad_task is None:
            return None
        after = [t for t, _ in self.ejections if t >= self.first_bad_task]
        return min(after) - self.first_bad_task if after else None


class Traffic:
    """`clients` coroutines, each sending one task at a time through `roster.invoke`."""

    def __init__(self, rosters: list[AgentRoster], config: OutlierConfig) -> None:
        self.rosters = rosters
        self.config = config

    async def run(self, phase: Phase, tasks: int | None, until: Callable[[], Awaitable[bool]] | None = None, within_s: float = 0.0) -> None:
        """`tasks` tasks, or tasks until `until()` holds (looked at every 0.2 s, for at most `within_s`)."""
        left = [tasks if tasks is not None else -1]
        stop = asyncio.Event()

        async def client(roster: AgentRoster) -> None:
            while not stop.is_set() and left[0] != 0:
                left[0] -= 1
                started = time.monotonic()
                try:
                    await roster.invoke(REF, {"hold_s": self.config.hold_s}, timeout=30.0, task_timeout_s=self.config.task_timeout_s)
                    phase.latencies.append(time.monotonic() - started)
                except AgentRosterError as exc:
                    phase.failed.append(f"{type(exc).__name__}: {exc}"[:300])

        async def watch() -> None:
            assert until is not None
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline and not await until():
                await asyncio.sleep(0.2)
            stop.set()

        clients = [asyncio.create_task(client(self.rosters[i % len(self.rosters)])) for i in range(self.config.clients)]
        watcher = asyncio.create_task(watch()) if until is not None else None
        try:
            await asyncio.gather(*clients)
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)


@dataclass
class StateLoss:
    """The pool workflow terminated while its agents heartbeat, an acquire sent at once."""

    to_lease_s: float | None = None  # terminate -> the acquire's lease
    to_all_agents_s: float | None = None  # terminate -> the new run routes to every agent
    error: str | None = None


async def lose_pool_state(roster: AgentRoster, terminate: Callable[[], Awaitable[None]], agents: int, within_s: float) -> StateLoss:
    """Terminate the pool workflow (`terminate`), then acquire at once: the acquire starts a
    fresh run, which relearns its fleet from the agent workflows it finds running."""
    loss = StateLoss()
    await terminate()
    started = time.monotonic()
    try:
        lease = await roster.acquire(REF, timeout=within_s)
    except AgentRosterError as exc:
        loss.error = f"no lease within {within_s:g} s after the pool was terminated: {type(exc).__name__}: {exc}"[:300]
        return loss
    loss.to_lease_s = time.monotonic() - started
    await roster.release(lease)
    while time.monotonic() - started < within_s:
        status = await roster.status()
        if sum(1 for row in status.agents if not row.ejected) >= agents:
            loss.to_all_agents_s = time.monotonic() - started
            break
        await asyncio.sleep(0.2)
    return loss


def calls(path: Path) -> list[tuple[float, str]]:
    """The bad agent's log: (wall time, mode) of each task it started."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        when, _, mode = line.partition(" ")
        out.append((float(when), mode))
    return out


def ejections(warnings: list[str], agent_id: str, ejection_s: float) -> list[tuple[float, str]]:
    """(when, why) of each ejection of `agent_id` the pool's warnings still show."""
    pattern = re.compile(rf"^agent {re.escape(agent_id)} ejected until (\S+): (.*)$")
    out = []
    for warning in warnings:
        match = pattern.match(warning)
        if match:
            until = datetime.fromisoformat(match.group(1)).timestamp()
            out.append((until - ejection_s, match.group(2)))
    return out


async def run_phases(
    rosters: list[AgentRoster], bad_agent: str, mode_file: Path, calls_file: Path, config: OutlierConfig, say: Callable[[str], None]
) -> list[Phase]:
    """The six phases above, in order; each Phase filled in."""
    roster = rosters[0]
    traffic = Traffic(rosters, config)
    seen: list[tuple[float, str]] = []  # every ejection of the bad agent the warnings showed so far

    async def learn_ejections() -> None:
        for ejection in ejections((await roster.status()).warnings, bad_agent, config.ejection_s):
            if ejection not in seen:
                seen.append(ejection)

    async def back() -> bool:
        """In rotation again (its trial task succeeded)."""
        status = await roster.status()
        for ejection in ejections(status.warnings, bad_agent, config.ejection_s):
            if ejection not in seen:
                seen.append(ejection)
        row = next((r for r in status.agents if r.agent_id == bad_agent), None)
        return row is not None and not row.ejected

    phases: list[Phase] = []
    for name, mode in (("healthy", "ok"), ("broken", "fail"), ("recovery after broken", "ok"), ("hung", "hang"),
                       ("recovery after hung", "ok"), ("healthy again", "ok")):
        phase = Phase(name, mode)
        mode_file.write_text(mode + "\n")
        phase.started = time.time()
        if name.startswith("recovery"):
            switched = time.monotonic()

            async def back_and_served(phase: Phase = phase, switched: float = switched) -> bool:
                if phase.back_s is None and await back():
                    phase.back_s = time.monotonic() - switched
                served = any(t >= phase.started and m == "ok" for t, m in calls(calls_file))
                return phase.back_s is not None and served

            await traffic.run(phase, None, until=back_and_served, within_s=config.recovery_wait_s)
        else:
            await traffic.run(phase, config.tasks)
        phase.ended = time.time()
        phases.append(phase)
        say(f"outlier: {name}: {phase.tasks} tasks, {len(phase.failed)} failed, p50 {phase.p50_s * 1000:.0f} ms"
            + (f", back {phase.back_s:.2f} s after it turned healthy" if phase.back_s is not None else ""))
    # Ejections a bad phase's last tasks caused land up to a task timeout after it ended.
    await asyncio.sleep(config.task_timeout_s + 0.5)
    await learn_ejections()
    log = calls(calls_file)
    for i, phase in enumerate(phases):
        ends = phases[i + 1].started if i + 1 < len(phases) else phase.ended
        phase.reached = sum(1 for t, _ in log if phase.started <= t < ends)
        phase.first_bad_task = next((t for t, m in log if phase.started <= t < ends and m == phase.mode and m != "ok"), None)
        late = phase.ended + config.task_timeout_s + 0.5 if phase.mode != "ok" else ends
        phase.ejections = [(t, why) for t, why in seen if phase.started <= t < late]
    return phases


def judge(
    phases: list[Phase], threshold: int, state_loss: StateLoss | None = None, task_timeout_s: float = OutlierConfig.task_timeout_s
) -> tuple[list[str], dict[str, Any]]:
    """The row's broken invariants (counts, never timing) and its figures for the record. The
    first failure of a hung agent is known `task_timeout_s` after its first task started."""
    problems: list[str] = []
    by_name = {p.name: p for p in phases}
    baseline = statistics.mean([by_name["healthy"].p50_s, by_name["healthy again"].p50_s])
    facts: dict[str, Any] = {"threshold": threshold, "baseline_p50_s": baseline, "phases": {}}
    for phase in phases:
        fact: dict[str, Any] = {"tasks": phase.tasks, "failed": len(phase.failed), "reached": phase.reached, "p50_s": phase.p50_s}
        if phase.failed:
            problems.append(f"{phase.name}: {len(phase.failed)} tasks failed")
        if phase.mode != "ok":
            goal = threshold + len(phase.ejections)  # the threshold, then one trial task per ejection
            to_ejection = phase.to_ejection_s
            from_failure = None if to_ejection is None else to_ejection - (task_timeout_s if phase.mode == "hang" else 0.0)
            fact.update(goal=goal, ejections=len(phase.ejections), to_ejection_s=to_ejection, failure_to_ejection_s=from_failure,
                        p50_vs_healthy=phase.p50_s / baseline, reasons=sorted({why for _, why in phase.ejections}))
            if not phase.ejections:
                problems.append(f"{phase.name}: the bad agent was not ejected")
            if phase.reached > max(goal, threshold + 1):
                problems.append(f"{phase.name}: {phase.reached} tasks reached the bad agent (goal <= {goal})")
        if phase.name.startswith("recovery"):
            fact["back_s"] = phase.back_s
            if phase.back_s is None:
                problems.append(f"{phase.name}: the agent was not back in rotation after its trial task")
        facts["phases"][phase.name] = fact
    if state_loss is not None:
        facts["state_loss"] = {"to_lease_s": state_loss.to_lease_s, "to_all_agents_s": state_loss.to_all_agents_s, "goal_s": STATE_LOSS_GOAL_S}
        if state_loss.error is not None:
            problems.append(f"pool state lost: {state_loss.error}")
    return problems, facts


__all__ = ["OutlierConfig", "Phase", "STATE_LOSS_GOAL_S", "StateLoss", "Traffic", "calls", "ejections", "judge", "lose_pool_state", "run_phases"]
