"""`agentroster dev` behaves: the demo plan at start then on demand, repeated results
counted on one line, only changes printed when stdout is not a terminal, and a second
stack on the same state directory or ports refused before it starts anything.

The outside test runs `agentroster dev` as a user would (a process, its output to a
pipe), on free ports and a state directory of its own. `dev --once` is checked by
tests/test_cli.py and Ctrl-C by tests/test_pool_shutdown.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentroster.models import AgentState
from agentroster.workers.dev_view import ChangeLog, PlanLog, StackBusyError, busy_ports, claim_state_dir, port_in_use
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the pieces


def test_identical_plan_results_share_one_counter_line() -> None:
    log = PlanLog()
    first = log.add(True, "value 1028", detail="3 attempt(s) on a, b", took_s=0.5, at=1000.0)
    again = log.add(True, "value 1028", detail="3 attempt(s) on a, c", took_s=0.4, at=1010.0)
    assert again is first and first.count == 2 and len(log.entries) == 1
    assert " plan ok x2 (same result since " in first.line() and "last in 0.40s): value 1028 (3 attempt(s) on a, c)" in first.line()
    failed = log.add(False, "boom", took_s=0.1, at=1020.0)
    log.add(True, "value 1028", took_s=0.5, at=1030.0)  # not the same as the run before: a new line
    assert [e.count for e in log.entries] == [2, 1, 1] and failed.line().split(" ", 1)[1].startswith("plan FAILED in 0.10s: boom")
    assert log.runs == 4 and len(log.lines(2)) == 2


def _status(agents: list[tuple[str, str, int]], granted: int = 0, warnings: tuple[str, ...] = ()) -> Any:
    return SimpleNamespace(
        agents=[SimpleNamespace(agent_id=a, deployment="d", capabilities=["c@1"], state=AgentState(s), in_flight=n) for a, s, n in agents],
        active_leases=0,
        waiting=0,
        leases_granted=granted,
        leases_released=granted,
        leases_expired=0,
        leases_revoked=0,
        warnings=list(warnings),
    )


def test_change_log_writes_the_table_once_then_only_changes() -> None:
    out: list[str] = []
    now = [0.0]
    changes = ChangeLog(out.append, clock=lambda: "12:00:00", now=lambda: now[0])
    changes.agents(_status([("a1", "Ready", 0)]), table="THE TABLE")
    for _ in range(100):  # nothing changes: nothing written
        changes.agents(_status([("a1", "Ready", 0)]))
    assert out == ["THE TABLE"]
    changes.agents(_status([("a1", "Busy", 1), ("a2", "Ready", 0)], granted=1, warnings=("w1",)))
    changes.agents(_status([("a2", "Ready", 0)], granted=1, warnings=("w1",)))
    assert out[1:] == [
        "12:00:00 + agent a2 (d: c@1) Ready, 0 in flight",
        "12:00:00 ~ agent a1: Ready -> Busy, in flight 0 -> 1",
        "12:00:00 leases: 0 active, 0 waiting; granted 1, released 1, expired 0, revoked 0",
        "12:00:00 warning: w1",
        "12:00:00 - agent a1 is gone (was Busy)",
    ]

    log = PlanLog()
    out.clear()
    entry = log.add(True, "same", took_s=0.1)
    changes.plan(entry)
    for _ in range(5):  # repeats: x2 at once, then at most once a minute
        changes.plan(log.add(True, "same", took_s=0.1))
    assert [line.split(" ", 1)[1][:11] for line in out] == ["plan ok in ", "plan ok x2 "]
    now[0] += 61
    changes.plan(log.add(True, "same", took_s=0.1))
    changes.plan(log.add(True, "different", took_s=0.1))  # a new result: the old counter is brought up to date first
    changes.plan(log.add(True, "different", took_s=0.1))
    changes.flush()
    assert [line.split(" ", 1)[1][:11] for line in out] == ["plan ok in ", "plan ok x2 ", "plan ok x7 ", "plan ok in ", "plan ok x2 "]


def test_the_state_dir_lock_names_its_holder(tmp_path: Path) -> None:
    held = claim_state_dir(tmp_path / "state", {"port": 7233, "ui_port": 8233})
    try:
        # flock is per open file: a second claim, even from this process, is refused like another process's.
        with pytest.raises(StackBusyError, match=rf"another agentroster dev \(pid {os.getpid()}, Temporal on localhost:7233"):
            claim_state_dir(tmp_path / "state", {"port": 1, "ui_port": 2})
        assert json.loads((tmp_path / "state" / "dev.lock").read_text())["pid"] == os.getpid()
    finally:
        held.close()
    claim_state_dir(tmp_path / "state", {}).close()  # released with the file: free again


def test_busy_ports_are_named_with_their_flags() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        with socket.socket() as spare:
            spare.bind(("127.0.0.1", 0))
            free = spare.getsockname()[1]
        assert port_in_use(taken) and not port_in_use(free)
        message = busy_ports({"--port": free, "--ui-port": taken})
        assert message is not None and message.startswith(f"port {taken} (--ui-port) is already in use") and message.endswith("--ui-port")
        assert busy_ports({"--port": free}) is None


# ------------------------------------------------------------------ the dev stack, from the outside


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}


def _dev(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentroster.workers.cli", "dev", *args],
        cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )


async def test_dev_runs_the_plan_on_demand_prints_only_changes_and_refuses_a_second_stack(tmp_path: Path) -> None:
    output: list[str] = []

    async def read_until(text: str) -> None:
        while not any(text in line for line in output):
            line = await process.stdout.readline()  # type: ignore[union-attr]
            assert line, "".join(output)[-4000:]
            output.append(line.decode())

    db = tmp_path / "state" / "temporal.db"
    for attempt in range(3):
        # Free when picked, but another process (a parallel test's server) may bind one first.
        port, ui_port = free_port(), free_port()
        ports = ["--port", str(port), "--ui-port", str(ui_port)]
        output.clear()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentroster.workers.cli", "dev", *ports, "--db", str(db),
            cwd=REPO, env=_env(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        assert process.stdout is not None
        try:
            await asyncio.wait_for(read_until("plan ok in "), timeout=180)  # once, at start
            break
        except AssertionError:
            await process.wait()
            server_log = db.parent / "temporal-server.log"
            lost_a_port = "already in use on this machine" in "".join(output) or (
                server_log.exists() and "address already in use" in server_log.read_text()
            )
            if not lost_a_port or attempt == 2:
                raise
            server_log.unlink(missing_ok=True)

    try:

        # A second stack on the same state and ports stops at once, before starting anything.
        same = await asyncio.to_thread(_dev, *ports, "--db", str(db))
        assert same.returncode == 1, same.stdout + same.stderr
        assert f"another agentroster dev (pid {process.pid}, Temporal on localhost:{port}" in same.stderr
        assert "--db" in same.stderr and same.stdout == ""  # no server, worker or fleet was started
        # Its own state but the same ports: the ports are named.
        ports_only = await asyncio.to_thread(_dev, *ports, "--db", str(tmp_path / "other" / "temporal.db"))
        assert ports_only.returncode == 1, ports_only.stderr
        assert f"ports {port} (--port) and {ui_port} (--ui-port) are already in use" in ports_only.stderr, ports_only.stderr
        assert ports_only.stdout == "" and not (tmp_path / "other" / "temporal.db").exists()
        # Its own ports but the same state: the lock holder is named.
        state_only = await asyncio.to_thread(_dev, "--port", str(free_port()), "--ui-port", str(free_port()), "--db", str(db))
        assert state_only.returncode == 1 and "another agentroster dev" in state_only.stderr, state_only.stderr

        # On demand: SIGUSR1 runs the plan again; the same result counts on one line.
        process.send_signal(signal.SIGUSR1)
        await asyncio.wait_for(read_until("plan ok x2 (same result since"), timeout=120)
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(read_until("stopped."), timeout=180)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0, "".join(output)[-4000:]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = "".join(output)
    # Not a terminal: the table once, then changes only (never the same line twice in a row).
    assert text.count("LAST HEARTBEAT") == 1, text[-4000:]
    assert "\x1b[" not in text
    changes = [line.split(" ", 1)[1] for line in output if line[:2].isdigit() and line[2:3] == ":" and " leases: " in line]
    assert changes and all(a != b for a, b in zip(changes, changes[1:])), changes
    assert text.count("example-plan") == 0  # plan results are summaries, not workflow ids
    assert "pool default shut down (agentroster dev stopped)" in text
    # The stack's lease key stays with its state, readable only by its owner.
    key_file = tmp_path / "state" / "lease-key"
    assert key_file.read_text().startswith("base64:") and (key_file.stat().st_mode & 0o077) == 0


async def test_plan_requests_during_a_run_make_one_more_run_and_plan_every_repeats() -> None:
    from agentroster.workers.dev import PlanRunner
    from tests.conftest import eventually

    runs = 0
    gate = asyncio.Event()

    async def run() -> tuple[bool, str, str]:
        nonlocal runs
        runs += 1
        await gate.wait()
        return True, "same result", ""

    results: list[Any] = []
    runner = PlanRunner(run, PlanLog(), None, results.append)
    task = asyncio.create_task(runner.loop())
    try:
        runner.request()
        await eventually(lambda: runs == 1)
        for _ in range(3):  # Enter pressed three times while the plan runs
            runner.request()
        gate.set()
        await eventually(lambda: len(results) == 2)
        await asyncio.sleep(0.2)
        assert runs == 2 and results[-1].count == 2  # coalesced into one more run, counted on one line
        runner.every_s = 0.05  # --plan-every: each run schedules the next
        runner.request()
        await eventually(lambda: runs >= 5)
    finally:
        task.cancel()


def test_plan_every_below_a_second_is_refused() -> None:
    result = _dev("--plan-every", "0.1", "--port", "1", "--ui-port", "2", "--db", "/nonexistent/never/temporal.db")
    assert result.returncode == 2 and "--plan-every must be at least 1 second" in result.stderr
