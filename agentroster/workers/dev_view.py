"""What `agentroster dev` shows, and what it checks before it starts anything.

- `PlanLog`: the demo plan's results; a run that gives the same result as the
  one before adds to a counter on that line instead of a new line.
- `ChangeLog`: for output that is not a terminal (a file, a pipe, CI): the
  table once, then one line per change (an agent appears, changes state or
  in-flight count, or goes; the lease counters move; a new warning), never
  the whole table again.
- `claim_state_dir` / `busy_ports`: a second `agentroster dev` on the same
  state directory or ports stops at once with a clear message, before it
  starts a server, a worker or a fleet.
- `ReaderGoneSafe`: output whose reader went away (`agentroster dev | tee`,
  and Ctrl-C killed `tee`) is dropped, so the stack still shuts down.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from agentroster.client.settings import DEV_LOCK_NAME as LOCK_NAME

REPEAT_LINE_EVERY_S = 60.0


# ------------------------------------------------------------------ the demo plan's results
@dataclass
class PlanEntry:
    """One result of the demo plan, and how many runs in a row gave it."""

    ok: bool
    text: str  # the result itself: what makes two runs "the same"
    detail: str  # the last run's circumstances (agents, attempts): not compared
    first_at: float
    last_at: float
    last_took_s: float
    count: int = 1
    printed_count: int = 0  # ChangeLog: the count last written out

    def line(self) -> str:
        status = "plan ok" if self.ok else "plan FAILED"
        when = time.strftime("%H:%M:%S", time.localtime(self.last_at))
        if self.count == 1:
            return f"{when} {status} in {self.last_took_s:.2f}s: {self.text}" + (f" ({self.detail})" if self.detail else "")
        since = time.strftime("%H:%M:%S", time.localtime(self.first_at))
        return (
            f"{when} {status} x{self.count} (same result since {since}, last in {self.last_took_s:.2f}s): {self.text}"
            + (f" ({self.detail})" if self.detail else "")
        )


class PlanLog:
    """The demo plan's results, newest last; identical results in a row share one entry."""

    def __init__(self, keep: int = 50) -> None:
        self.entries: list[PlanEntry] = []
        self.keep = keep
        self.runs = 0

    def add(self, ok: bool, text: str, *, detail: str = "", took_s: float, at: float | None = None) -> PlanEntry:
        at = time.time() if at is None else at
        self.runs += 1
        last = self.entries[-1] if self.entries else None
        if last is not None and last.ok == ok and last.text == text:
            last.count += 1
            last.last_at = at
            last.last_took_s = took_s
            last.detail = detail
            return last
        entry = PlanEntry(ok=ok, text=text, detail=detail, first_at=at, last_at=at, last_took_s=took_s)
        self.entries = (self.entries + [entry])[-self.keep :]
        return entry

    def lines(self, last: int = 5) -> list[str]:
        return [e.line() for e in self.entries[-last:]]


def plan_result_text(summary: Any) -> tuple[str, str]:
    """(result, detail) of an example plan summary: the answer, then which agents gave it."""
    value = summary.value
    result = (
        f"top document {summary.top_document!r}, {summary.hits} hit(s); value {value:g}; "
        f"code printed {summary.code_stdout!r}"
    )
    agents = ", ".join(sorted(set(summary.agents.values())))
    return result, f"{summary.attempts} attempt(s) on {agents}" if agents else ""


# ------------------------------------------------------------------ output that is not a terminal
def _clock() -> str:
    return time.strftime("%H:%M:%S")


class ChangeLog:
    """Writes what changed since the last look, one line per change (for a file or a pipe)."""

    def __init__(self, write: Callable[[str], None], clock: Callable[[], str] = _clock, now: Callable[[], float] = time.monotonic) -> None:
        self._write = write
        self._clock = clock
        self._now = now
        self._agents: dict[str, tuple[str, str, str, int]] | None = None
        self._counters: tuple[int, ...] | None = None
        self._warnings: set[str] = set()
        self._entries: dict[int, float] = {}  # id(entry) -> when its counter line was last written
        self._last_entry: PlanEntry | None = None
        self.lines_written = 0

    def _emit(self, text: str) -> None:
        self.lines_written += 1
        self._write(f"{self._clock()} {text}")

    def agents(self, status: Any, table: str | None = None) -> None:
        """Compare the pool's agents and counters (a PoolStatus) with the last look; write the differences.

        `table` (the full status table) is written the first time only.
        """
        now = {
            a.agent_id: (a.deployment, ",".join(a.capabilities), a.state.value, a.in_flight) for a in status.agents
        }
        first = self._agents is None
        if first and table is not None:
            self.lines_written += 1
            self._write(table)  # it shows the counters and warnings too
            self._counters = self._counter_values(status)
            self._warnings.update(status.warnings)
        elif not first:
            assert self._agents is not None
            for agent_id in sorted(now.keys() - self._agents.keys()):
                deployment, caps, state, in_flight = now[agent_id]
                self._emit(f"+ agent {agent_id} ({deployment}: {caps}) {state}, {in_flight} in flight")
            for agent_id in sorted(self._agents.keys() - now.keys()):
                self._emit(f"- agent {agent_id} is gone (was {self._agents[agent_id][2]})")
            for agent_id in sorted(now.keys() & self._agents.keys()):
                (_, _, old_state, old_in), (_, _, state, in_flight) = self._agents[agent_id], now[agent_id]
                changes = []
                if state != old_state:
                    changes.append(f"{old_state} -> {state}")
                if in_flight != old_in:
                    changes.append(f"in flight {old_in} -> {in_flight}")
                if changes:
                    self._emit(f"~ agent {agent_id}: {', '.join(changes)}")
        self._agents = now
        counters = self._counter_values(status)
        if counters != self._counters:
            self._counters = counters
            self._emit(
                f"leases: {status.active_leases} active, {status.waiting} waiting; granted {status.leases_granted}, "
                f"released {status.leases_released}, expired {status.leases_expired}, revoked {status.leases_revoked}"
            )
        for warning in status.warnings:
            if warning not in self._warnings:
                self._warnings.add(warning)
                self._emit(f"warning: {warning}")

    @staticmethod
    def _counter_values(status: Any) -> tuple[int, ...]:
        return (
            status.active_leases,
            status.waiting,
            status.leases_granted,
            status.leases_released,
            status.leases_expired,
            status.leases_revoked,
        )

    def plan(self, entry: PlanEntry, *, final: bool = False) -> None:
        """A plan result: a new result is written; a repeat writes its counter line (x2 at once, then at most once a minute)."""
        if entry is not self._last_entry:
            self._flush_repeats()
            self._last_entry = entry
            self._entries = {id(entry): self._now()}
            entry.printed_count = entry.count
            self.lines_written += 1
            self._write(entry.line())
            return
        # The first repeat is written at once (the run you asked for happened), later ones once a minute.
        due = entry.printed_count == 1 or self._now() - self._entries.get(id(entry), 0.0) >= REPEAT_LINE_EVERY_S
        if (due or final) and entry.count != entry.printed_count:
            self._entries[id(entry)] = self._now()
            entry.printed_count = entry.count
            self.lines_written += 1
            self._write(entry.line())

    def _flush_repeats(self) -> None:
        last = self._last_entry
        if last is not None and last.count != last.printed_count:
            last.printed_count = last.count
            self.lines_written += 1
            self._write(last.line())

    def flush(self) -> None:
        """Write the counter of a result still being repeated (at the end)."""
        self._flush_repeats()


# ------------------------------------------------------------------ one dev stack per state dir and ports
class StackBusyError(Exception):
    """Another `agentroster dev` (or another server) holds the state directory or a port."""


def claim_state_dir(state_dir: Path, info: dict[str, Any]) -> IO[str]:
    """Lock `state_dir/dev.lock` for this process (released when it exits, even by a crash).

    Raises StackBusyError naming the holder when another process has it. Keep the
    returned file open for as long as the stack runs.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_NAME
    handle = open(path, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            handle.close()
            raise
        handle.seek(0)
        try:
            holder = json.loads(handle.read() or "{}")
        except ValueError:
            holder = {}
        handle.close()
        who = f"pid {holder.get('pid', '?')}"
        if holder.get("port"):
            who += f", Temporal on localhost:{holder['port']}, web UI on http://localhost:{holder.get('ui_port', '?')}"
        raise StackBusyError(
            f"another agentroster dev ({who}) already runs on the state in {state_dir} (lock {path}). "
            f"Stop it first (Ctrl-C in its terminal, or `kill -INT {holder.get('pid', '<pid>')}`), "
            "or give this one a state of its own with --db (and its own --port and --ui-port)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({**info, "pid": os.getpid()}) + "\n")
    handle.flush()
    return handle


class ReaderGoneSafe:
    """A text stream (stdout, stderr) whose writes never raise because its reader is gone.

    Ctrl-C on `agentroster dev 2>&1 | tee dev.log` kills `tee` as well: the next write
    to the pipe raises BrokenPipeError, which would end dev before it shuts the pool
    down. On that error the stream's descriptor is pointed at /dev/null (the way the
    Python docs advise for SIGPIPE), so this write, later ones, and every other writer
    of the same descriptor (logging handlers, the final flush at exit) go nowhere.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        with contextlib.suppress(BrokenPipeError):
            self._stream.flush()  # what was buffered for the pipe goes to /dev/null

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on `port` (or holds it so a server could not bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        with contextlib.suppress(OSError):
            if probe.connect_ex((host, port)) == 0:
                return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no obstacle
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def busy_ports(ports: dict[str, int]) -> str | None:
    """A message naming the ports (by flag) something already uses, or None when all are free."""
    busy = [f"{port} ({flag})" for flag, port in ports.items() if port_in_use(port)]
    if not busy:
        return None
    flags = " and ".join(flag for flag, port in ports.items() if f"{port} ({flag})" in busy)
    what = f"port {busy[0]} is" if len(busy) == 1 else f"ports {' and '.join(busy)} are"
    return f"{what} already in use on this machine: another agentroster dev or Temporal server? Stop it, or pick free ports with {flags}"


__all__ = [
    "ChangeLog",
    "PlanEntry",
    "PlanLog",
    "StackBusyError",
    "busy_ports",
    "claim_state_dir",
    "plan_result_text",
    "port_in_use",
]
