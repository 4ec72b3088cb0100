"""A Python snippet runner: capability `code.python.exec@1.0.0` (cost C, one at a time).

Each snippet runs in a fresh subprocess (`sys.executable -I -c CODE`: isolated
mode, no user site-packages, PYTHON* variables ignored) with a stripped
environment, in an empty temporary directory, in its own process group, under a
timeout that kills the whole group. stdout and stderr are capped.

This is process isolation, not a security sandbox: run it in a container.

    python -m examples.code_agent      # AGENT_ID, AGENT_PORT, TEMPORAL_ADDRESS, ...
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from agentroster.agent.runtime import AgentRuntime, run_agent

MAX_OUTPUT_BYTES = 64 * 1024
MAX_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_S = 5.0
EXIT_POLL_S = 0.02
PIPE_GRACE_S = 0.5  # how long to wait for pipes after the snippet exits (a child may hold them)
CLEAN_ENV = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass
class RunResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> str:
    """Read a stream to its end, keeping at most `limit` bytes."""
    kept = bytearray()
    dropped = 0
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        kept += chunk[:room]
        dropped += max(0, len(chunk) - room)
    text = kept.decode("utf-8", errors="replace")
    return text + (f"\n[... {dropped} more bytes truncated]" if dropped else "")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_python(code: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, max_output_bytes: int = MAX_OUTPUT_BYTES) -> RunResult:
    """Run `code` in an isolated Python subprocess; kill it (and its children) after `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="code-agent-") as workdir:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            code,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=CLEAN_ENV,
            cwd=workdir,
            start_new_session=True,
        )
        try:
            return await _collect(proc, timeout_s, max_output_bytes)
        finally:
            _kill_group(proc.pid)  # nothing the snippet started outlives it, even if we are cancelled


async def _collect(proc: asyncio.subprocess.Process, timeout_s: float, max_output_bytes: int) -> RunResult:
    assert proc.stdout is not None and proc.stderr is not None
    readers = asyncio.gather(_read_capped(proc.stdout, max_output_bytes), _read_capped(proc.stderr, max_output_bytes))
    # Poll the exit status: `proc.wait()` also waits for the pipes, which a background child may hold.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while proc.returncode is None and loop.time() < deadline:
        await asyncio.sleep(EXIT_POLL_S)
    timed_out = proc.returncode is None
    if timed_out:
        _kill_group(proc.pid)
        await proc.wait()
    try:
        stdout, stderr = await asyncio.wait_for(asyncio.shield(readers), timeout=PIPE_GRACE_S)
    except asyncio.TimeoutError:
        # A background child of the snippet still holds the pipes: end it.
        _kill_group(proc.pid)
        stdout, stderr = await readers
    assert proc.returncode is not None
    return RunResult(stdout=stdout, stderr=stderr, exit_code=proc.returncode, timed_out=timed_out)


INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 1, "maxLength": 100_000},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S, "default": DEFAULT_TIMEOUT_S},
    },
    "required": ["code"],
    "additionalProperties": False,
}
OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "stdout": {"type": "string"},
        "stderr": {"type": "string"},
        "exit_code": {"type": "integer"},
        "timed_out": {"type": "boolean"},
    },
    "required": ["stdout", "stderr", "exit_code", "timed_out"],
}


def build_agent(env: Mapping[str, str] | None = None, **defaults: Any) -> AgentRuntime:
    """The code agent, configured from `env` (default: the process environment)."""
    defaults.setdefault("deployment", "code-agent")
    agent = AgentRuntime.from_env(env, **defaults)

    @agent.capability("code.python.exec", "1.0.0", input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA, max_concurrency=1, cost_class="C")
    async def execute(payload: dict[str, Any]) -> dict[str, Any]:
        result = await run_python(payload["code"], float(payload.get("timeout_s", DEFAULT_TIMEOUT_S)))
        return asdict(result)

    return agent


if __name__ == "__main__":
    run_agent(build_agent())
