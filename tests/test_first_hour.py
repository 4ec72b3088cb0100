"""A new user's first hour, from the outside: their own scripts and agents in processes
of their own, beside a real server (the session's, or `agentroster dev`).

- A script that connects with `async with AgentRoster.connect()`, invokes a
  capability and prints exits 0, every time (no abort at interpreter exit).
- `agentroster dev 2>&1 | tee dev.log`, then Ctrl-C: `tee` dies with it, and dev
  still shuts the pool down and exits 0.
- Scripts and agents started by hand beside `agentroster dev` (in the folder that
  holds its `.agentroster`) find its server and lease key with no exports; dev prints
  the line to copy for anywhere else. When dev's pool shuts down, the hand-run agent
  says so and exits 0, and dev prints no traceback about its deployment.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import eventually, free_port

REPO = Path(__file__).resolve().parents[1]

ECHO_AGENT = '''\
from agentroster.agent.runtime import AgentRuntime, run_agent

agent = AgentRuntime.from_env(deployment="echo-agent")


@agent.capability("text.echo", "1.0.0", max_concurrency=4, cost_class="A",
                  input_schema={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
                  output_schema={"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]})
async def echo(payload: dict) -> dict:
    return {"echo": payload["text"]}


if __name__ == "__main__":
    run_agent(agent)
'''

# The README's call snippet, as a user's script: connect, invoke, print.
CALL = '''\
import asyncio
import uuid

from agentroster import AgentRoster, TaskInput
from agentroster.workflows.task import CapabilityTaskWorkflow


async def main() -> None:
    async with AgentRoster.connect() as roster:
        print(await roster.invoke("text.echo@^1", {"text": "hello"}, timeout=30))
        result = await roster.client.execute_workflow(
            CapabilityTaskWorkflow.run,
            TaskInput(ref="text.echo@^1", payload={"text": "hello"}, pool=roster.pool),
            id=f"echo-{uuid.uuid4().hex[:8]}", task_queue=roster.task_queue)
        print(result.agent_id, result.output, result.attempts)


asyncio.run(main())
'''

RUNS = 30


def _bare_env() -> dict[str, str]:
    """A user's shell: no roster settings at all, the package importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_", "KUBERNETES_"))}
    env["PYTHONPATH"] = str(REPO)
    return env


async def test_a_users_script_exits_0_every_time(stack: Any, tmp_path: Path) -> None:
    (tmp_path / "echo_agent.py").write_text(ECHO_AGENT)
    (tmp_path / "call.py").write_text(CALL)
    env = {
        **_bare_env(),
        "TEMPORAL_ADDRESS": stack.env.client.service_client.config.target_host,
        "AGENTROSTER_POOL": stack.pool,
        "AGENTROSTER_TASK_QUEUE": stack.task_queue,
        "AGENTROSTER_LEASE_KEY": os.environ["AGENTROSTER_LEASE_KEY"],
    }
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "echo_agent.py", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        assert await eventually(lambda: stack.roster.find("text.echo@^1"), timeout=60, interval=0.5)
        for run in range(RUNS):
            call = await asyncio.to_thread(
                subprocess.run, [sys.executable, "call.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            assert call.returncode == 0, f"run {run + 1}/{RUNS}: exit {call.returncode}\n{call.stdout}{call.stderr}"[-4000:]
            assert call.stdout.splitlines()[0] == "{'echo': 'hello'}", call.stdout
            assert call.stdout.splitlines()[1].endswith(" {'echo': 'hello'} 1"), call.stdout
        # Every lease went back: the last script's release was sent before it exited.
        status = await stack.roster.status()
        assert status.active_leases == 0 and status.leases_granted == status.leases_released == 2 * RUNS
    finally:
        agent.send_signal(signal.SIGTERM)
        log, _ = await asyncio.wait_for(agent.communicate(), timeout=90)
    assert agent.returncode == 0, log.decode()[-4000:]


def _terminal_sigint() -> None:
    """A terminal's job takes SIGINT's default action, even when this test runs in a background
    job (which starts with SIGINT ignored, and a child inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(path: Path, pattern: str, timeout: float, *also: subprocess.Popen[bytes]) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if found := re.search(pattern, text):
            return found
        for process in also:
            assert process.poll() is None, f"{process.args} exited {process.returncode}:\n{text[-4000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout:g}s:\n{text[-4000:]}")


def test_dev_with_a_dead_pipe_reader_and_a_hand_run_agent_shuts_down_cleanly(tmp_path: Path) -> None:
    """`agentroster dev 2>&1 | tee dev.log` in one terminal, an agent and a script by hand
    in another (the same folder, no exports), then Ctrl-C on dev."""
    (tmp_path / "echo_agent.py").write_text(ECHO_AGENT)
    (tmp_path / "call.py").write_text(CALL)
    env = _bare_env()
    ports = ["--port", str(free_port()), "--ui-port", str(free_port())]
    dev_log, agent_log = tmp_path / "dev.log", tmp_path / "agent.log"
    # The terminal's foreground job: dev and tee in one process group, as a shell runs a pipeline.
    dev = subprocess.Popen(
        [sys.executable, "-m", "agentroster.workers.cli", "dev", *ports], cwd=tmp_path, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0,
        preexec_fn=_terminal_sigint,
    )
    assert dev.stdout is not None
    tee = subprocess.Popen(
        ["tee", str(dev_log)], stdin=dev.stdout, stdout=subprocess.DEVNULL, process_group=dev.pid, preexec_fn=_terminal_sigint
    )
    dev.stdout.close()  # tee is the pipe's only reader
    agent: subprocess.Popen[bytes] | None = None
    try:
        line = _wait_for(dev_log, r"find this stack by themselves; elsewhere: (export .*)\n", 120, dev)
        state = tmp_path / ".agentroster"
        assert line.group(1) == f"export TEMPORAL_ADDRESS=localhost:{ports[1]} AGENTROSTER_LEASE_KEY_FILE={state / 'lease-key'}"
        _wait_for(dev_log, r"plan ok in ", 180, dev)

        # By hand, in the folder of the stack's state, with no exports: they find its server and key.
        with open(agent_log, "wb") as out:
            agent = subprocess.Popen([sys.executable, "echo_agent.py"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        _wait_for(agent_log, r"registered in pool default", 90, agent)
        call = subprocess.run([sys.executable, "call.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert call.returncode == 0, (call.stdout + call.stderr)[-4000:]
        assert call.stdout.splitlines()[0] == "{'echo': 'hello'}", call.stdout

        # Ctrl-C: the terminal sends SIGINT to the pipeline's group; tee dies of it.
        os.killpg(dev.pid, signal.SIGINT)
        assert tee.wait(timeout=10) != 0
        dev.wait(timeout=240)
        assert dev.returncode == 0, dev_log.read_text()[-4000:]
        # The agent started by hand heard that its pool shut down, and left by itself.
        assert agent.wait(timeout=60) == 0, agent_log.read_text()[-4000:]
    finally:
        for process in (dev, tee, agent):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    log = agent_log.read_text()
    assert re.search(r"agent echo-agent-\w+: its pool default shut down; stopping", log), log[-4000:]
    assert '"drained": true' in log and "Traceback" not in log, log[-4000:]
    # What dev wrote before tee died holds no traceback either (the rest went nowhere, harmlessly).
    assert "Traceback" not in dev_log.read_text()
    # The lock is released: scripts started here no longer take the stopped stack's settings.
    check = subprocess.run(
        [sys.executable, "-c", "from agentroster.client.settings import running_dev_stack; print(running_dev_stack())"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert check.stdout.strip() == "None", check.stdout + check.stderr


async def test_a_pool_shutdown_scales_a_deployment_outside_the_fleet_to_zero_without_error() -> None:
    """The agents of a deployment the local backend does not run (started by hand) are not
    its to stop: scaling it to zero is already done, and says so."""
    from agentroster.activities.fleet import load_fleet
    from agentroster.activities.local_backend import LocalBackend

    backend = LocalBackend(fleet=load_fleet(REPO / "examples" / "fleet.toml"))
    await backend.scale_to_zero("upper-agent")
    await backend.scale_to_zero("math-agent")
    assert await backend.current_replicas("math-agent") == 0
