"""The agent-side runtime: serve capabilities over HTTP, register, heartbeat, drain.

    agent = AgentRuntime.from_env(deployment="math-agent")

    @agent.capability("math.eval", "1.0.0", input_schema={...}, max_concurrency=4, cost_class="A")
    async def evaluate(payload: dict) -> dict:
        return {"value": ...}

    run_agent(agent)            # serves until SIGTERM/SIGINT, drains, exits 0

Lifecycle as the runtime sees it: Spawning (HTTP up, start-up hooks run, e.g.
loading a model) -> Registering (`roster.register` until acknowledged) ->
Ready (heartbeats every `heartbeat_interval_s`, default 240 s, with +/-10% jitter:
they only have to catch hangs and partitions, since the worker's backend reports a
process exit or a pod deletion at once) ->
Draining (no new tasks, in-flight ones finish) -> Terminated.

If a heartbeat finds the agent's workflow gone (the server lost its state, or
the agent was declared Terminated, e.g. `heartbeat_lost`), the runtime
registers again by itself; while the server is unreachable it retries with
backoff, and logs one line when contact is lost and one when it is back (not
a warning per heartbeat, nor the SDK's per-attempt retry warnings: see
`agentroster.client.outage`). The exception: a run the roster ended by *draining* the agent (an
operator's `agentroster drain`, a scale-down, its pool shutting down, e.g. Ctrl-C
on `agentroster dev`) is respected - the runtime watches its run, and the moment it
ends so, `serve()` returns (`run_agent` exits 0) with one line saying why, rather
than coming back. Its backend has already been asked to delete its pod by then.

Lease tokens (JWTs, `Authorization: Bearer ...`): the runtime refuses to start
without a lease key (`AGENTROSTER_LEASE_KEY`, or `lease_key=`; LeaseKeyMissingError),
unless checks are turned off explicitly with `insecure-no-auth` (it then warns loudly).

HTTP endpoints (aiohttp):

- `POST /tasks/{capability}`: body `InvokeRequest`; answers `{"output": ...}`
  (served by `agentroster.agent.task_server.TaskServer`, which lists the status codes;
  401/409 without a valid lease token for this agent, see
  `agentroster.client.lease_tokens`; 429 once the capability's or the agent's
  max_concurrency is reached).
- `GET /ready`: 200 once registration is acknowledged; 503 before and while draining.
- `GET /healthz`: 200 while the process runs and every `on_health` check passes
  (a check returning False or raising answers 503 with its reason), 503 for
  good once a reset hook raised (its state may be dirty); the pool calls it on
  idle agents of every deployment, and replaces failing ones. An agent whose
  reset hook raised also refuses every new task (503: the task fails over) and
  drains at once, so its backend starts a fresh process in its place.
- `POST /drain` (also `GET`, since a Kubernetes `preStop` `httpGet` hook can
  only send GET): drain and block until done or `drain_timeout_s`; JSON outcome.
- `GET /status`: state, in-flight and counters per capability.
- `GET /.well-known/agent-card.json` and `POST /a2a` (with a2a-sdk installed, the `a2a`
  extra): the agent's A2A Agent Card and A2A `message/send`, with the same lease token
  (see `agentroster.agent.a2a`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

from aiohttp import web

import agentroster.agent.a2a as agent_a2a
from agentroster.agent.task_server import Handler, Hook, TaskRefused, TaskServer, call
from agentroster.client.roster import AgentRoster
from agentroster.errors import AgentNotFoundError, LeaseKeyMissingError
from agentroster.models import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    AgentRegistration,
    AgentState,
    AgentStatus,
    Capability,
    CostClass,
    POOL_SHUTDOWN_REASON,
)
from agentroster.client.outage import Outage, quiet_core_runtime
from agentroster.client.lease_tokens import DEFAULT_CLOCK_SKEW_S, INSECURE_NO_AUTH, KEY_VAR, LeaseKeys
from agentroster.client.settings import LEASE_KEY_HELP, lease_keys_from_env, resolve_lease_keys

logger = logging.getLogger("agentroster.agent.runtime")

F = TypeVar("F", bound=Callable[..., Any])

# Terminated reasons of a run the roster ended by draining the agent on purpose.
ROSTER_DRAIN_REASONS = frozenset({"drain", "drain_deadline"})
MAX_BACKOFF_S = 10.0


def unique_agent_id(deployment: str) -> str:
    """`{deployment}-{5 random characters}`, like a Kubernetes pod name: unique per process on one machine."""
    suffix = "".join(random.SystemRandom().choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
    return f"{deployment}-{suffix}"


def _jittered(seconds: float, spread: float = 0.1) -> float:
    return seconds * random.uniform(1 - spread, 1 + spread)


class AgentRuntime:
    """An agent process: its capabilities, its HTTP server and its life in the roster."""

    def __init__(
        self,
        agent_id: str,
        deployment: str,
        endpoint: str | None = None,
        *,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        metadata: dict[str, Any] | None = None,
        roster: AgentRoster | None = None,
        port: int = 0,
        host: str = "0.0.0.0",
        drain_timeout_s: float = 60.0,
        reset: Hook | None = None,
        temporal_address: str | None = None,
        namespace: str | None = None,
        pool: str | None = None,
        task_queue: str | None = None,
        register_timeout_s: float = 30.0,
        max_concurrency: int | None = None,
        lease_key: LeaseKeys | str | bytes | None = None,
        lease_clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
    ) -> None:
        """`endpoint` defaults to `http://127.0.0.1:{bound port}`; `port` 0 (the default) binds any free port.

        Without `roster`, the runtime connects with `AgentRoster.connect(temporal_address,
        namespace=..., pool=..., task_queue=...)`; unset values come from the environment.
        `max_concurrency` caps tasks at once across capabilities (default: the largest capability's).
        `lease_key` (default: AGENTROSTER_LEASE_KEY) verifies the lease tokens tasks must carry;
        `insecure-no-auth` turns the checks off. Tokens are accepted up to `lease_clock_skew_s`
        past their expiry.
        """
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        if drain_timeout_s <= 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {drain_timeout_s}")
        self.agent_id = agent_id
        self.deployment = deployment
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.metadata = dict(metadata or {})
        self.port = port
        self.host = host
        self.drain_timeout_s = drain_timeout_s
        self.register_timeout_s = register_timeout_s
        self._connect_options = {"target_host": temporal_address, "namespace": namespace, "pool": pool, "task_queue": task_queue}
        self._roster = roster
        self._tasks = TaskServer(
            agent_id,
            max_concurrency=max_concurrency,
            refusal=self._task_refusal,
            lease_keys=resolve_lease_keys(lease_key),
            pool=roster.pool if roster is not None else None,
            clock_skew_s=lease_clock_skew_s,
            on_reset_failed=self._reset_failed,
        )
        self._startup_hooks: list[Hook] = []
        self._health_checks: list[Hook] = []
        if reset:
            self._tasks.reset_hooks.append(reset)

        self._state = AgentState.SPAWNING
        self._runner: web.AppRunner | None = None
        self._a2a: agent_a2a.A2AEndpoint | None = None  # the A2A card and message/send, with a2a-sdk installed
        self._lifecycle: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[dict[str, Any]] | None = None
        self._reset_drain: asyncio.Task[dict[str, Any]] | None = None  # the drain a failed reset started
        self._ready = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._stop_reason = "shutdown"
        self._draining = False
        self._drained_by: str | None = None  # the drain reason, once the roster drained this agent and its run ended
        self._ended: AgentStatus | None = None  # that run's final status
        self._owns_roster = roster is None
        self._registrations = 0
        self._last_heartbeat: datetime | None = None
        self._heartbeat_failures = 0
        # Server outages: one log line when calls start failing, one when they go through again.
        self._outage = Outage(logger, f"agent {agent_id}")

    # ----------------------------------------------------------- declaring
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **defaults: Any) -> AgentRuntime:
        """Build a runtime from the environment; keyword arguments are defaults the environment overrides.

        AGENT_DEPLOYMENT (or `deployment=`), AGENT_ID (default: `{deployment}-{5 random
        characters}`, unique per process), AGENT_PORT (default 0: a free port, picked when the
        server binds), AGENT_ENDPOINT (default http://127.0.0.1:{bound port}), AGENT_HOST
        (0.0.0.0), AGENT_MAX_CONCURRENCY, HEARTBEAT_INTERVAL_S (240), DRAIN_TIMEOUT_S (60),
        TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, AGENTROSTER_POOL, AGENTROSTER_TASK_QUEUE,
        AGENTROSTER_LEASE_KEY (and AGENTROSTER_LEASE_KEY_PREVIOUS), POD_UID (registered as
        `metadata.pod_uid`: the Kubernetes pod watch's `pod_gone` must name it). Like the Temporal settings,
        a lease key that is neither in `env` nor passed is read from the process environment.

        The defaults let any number of agents start on one machine without colliding.
        In Kubernetes (KUBERNETES_SERVICE_HOST is set) nothing is guessed: AGENT_ID (the
        pod's name, which the Kubernetes backend deletes the pod by) and AGENT_PORT (the
        port the probes and the endpoint use) must be set, or given as arguments.
        """
        source = os.environ if env is None else env

        def pick(var: str, name: str, convert: Callable[[str], Any], fallback: Any) -> Any:
            raw = source.get(var, "").strip()
            if not raw:
                return defaults.pop(name, fallback)
            defaults.pop(name, None)
            try:
                return convert(raw)
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from exc

        in_kubernetes = bool(source.get("KUBERNETES_SERVICE_HOST", "").strip())
        if in_kubernetes:
            missing = [var for var, name in (("AGENT_ID", "agent_id"), ("AGENT_PORT", "port")) if not source.get(var, "").strip() and name not in defaults]
            if missing:
                raise ValueError(
                    f"in Kubernetes, set {' and '.join(missing)}: AGENT_ID to the pod's name (downward API, "
                    "fieldRef metadata.name: the Kubernetes backend deletes the pod by it) and AGENT_PORT to the "
                    "containerPort the probes and AGENT_ENDPOINT use (see deploy/kubernetes/math-agent.yaml)"
                )
        port = pick("AGENT_PORT", "port", int, 0)
        deployment = pick("AGENT_DEPLOYMENT", "deployment", str, None)
        if not deployment:
            raise ValueError("set AGENT_DEPLOYMENT (or pass deployment=...): the deployment this agent belongs to")
        options: dict[str, Any] = {
            "agent_id": pick("AGENT_ID", "agent_id", str, None) or unique_agent_id(deployment),
            "deployment": deployment,
            "endpoint": pick("AGENT_ENDPOINT", "endpoint", str, None),
            "port": port,
            "host": pick("AGENT_HOST", "host", str, "0.0.0.0"),
            "heartbeat_interval_s": pick("HEARTBEAT_INTERVAL_S", "heartbeat_interval_s", float, DEFAULT_HEARTBEAT_INTERVAL_S),
            "drain_timeout_s": pick("DRAIN_TIMEOUT_S", "drain_timeout_s", float, 60.0),
            "max_concurrency": pick("AGENT_MAX_CONCURRENCY", "max_concurrency", int, None),
            "temporal_address": pick("TEMPORAL_ADDRESS", "temporal_address", str, None),
            "namespace": pick("TEMPORAL_NAMESPACE", "namespace", str, None),
            "pool": pick("AGENTROSTER_POOL", "pool", str, None),
            "task_queue": pick("AGENTROSTER_TASK_QUEUE", "task_queue", str, None),
        }
        pod_uid = source.get("POD_UID", "").strip()
        if pod_uid:
            metadata = dict(defaults.pop("metadata", None) or {})
            metadata.setdefault("pod_uid", pod_uid)
            options["metadata"] = metadata
        env_keys = lease_keys_from_env(source)
        if env_keys is not None:
            defaults.pop("lease_key", None)
            options["lease_key"] = env_keys
        if options["endpoint"] is None and port:
            options["endpoint"] = f"http://127.0.0.1:{port}"
        return cls(**options, **defaults)

    def capability(
        self,
        name: str,
        version: str,
        *,
        input_schema: dict[str, Any] | None = None,
        output_schema: dict[str, Any] | None = None,
        max_concurrency: int = 1,
        cost_class: CostClass = "B",
    ) -> Callable[[F], F]:
        """Decorator: serve `name@version` with the decorated `(payload) -> output` function."""
        cap = Capability(
            name=name,
            version=version,
            input_schema=input_schema or {},
            output_schema=output_schema or {},
            max_concurrency=max_concurrency,
            cost_class=cost_class,
        )

        def decorate(fn: F) -> F:
            self.add_capability(cap, fn)
            return fn

        return decorate

    def add_capability(self, capability: Capability, handler: Handler) -> None:
        """Serve `capability` with `handler` (the non-decorator form)."""
        if self._runner is not None:
            raise RuntimeError("declare capabilities before the agent starts")
        self._tasks.add(capability, handler)

    def on_startup(self, fn: F) -> F:
        """Register start-up work (e.g. loading a model), run while Spawning, in order. Decorator-friendly."""
        self._startup_hooks.append(fn)
        return fn

    def on_health(self, fn: F) -> F:
        """Register a check `GET /healthz` runs (sync or async): False or an exception makes it answer 503.

        Use it for what a heartbeat cannot show: a broken model client, a stuck worker pool.
        """
        self._health_checks.append(fn)
        return fn

    def on_reset(self, fn: F) -> F:
        """Register a hook called after every task (success or failure), before its slot is freed."""
        self._tasks.reset_hooks.append(fn)
        return fn

    # ---------------------------------------------------------- inspecting
    @property
    def state(self) -> AgentState:
        """The runtime's own view of its lifecycle phase."""
        return self._state

    @property
    def roster(self) -> AgentRoster | None:
        return self._roster

    @property
    def capabilities(self) -> list[Capability]:
        return self._tasks.capabilities

    def registration(self) -> AgentRegistration:
        """What this agent registers with (validated)."""
        if self.endpoint is None:
            raise RuntimeError("the endpoint is known once the HTTP server is bound; call start() first or pass endpoint=")
        return AgentRegistration(
            agent_id=self.agent_id,
            deployment=self.deployment,
            endpoint=self.endpoint,
            capabilities=self.capabilities,
            heartbeat_interval_s=self.heartbeat_interval_s,
            max_concurrency=self._tasks.max_concurrency,
            metadata=self.metadata,
        )

    def status(self) -> dict[str, Any]:
        """What `GET /status` answers."""
        return {
            "agent_id": self.agent_id,
            "deployment": self.deployment,
            "endpoint": self.endpoint,
            "state": self._state.value,
            "ready": self.is_ready,
            "in_flight": {name: s.in_flight for name, s in self._tasks.served.items()},
            "max_concurrency": self._tasks.total_concurrency,
            "tasks_served": sum(s.served for s in self._tasks.served.values()),
            "capabilities": self._tasks.counters(),
            "registrations": self._registrations,
            "lease_refusals": dict(self._tasks.lease_refusals),
            "last_heartbeat": self._last_heartbeat.isoformat() if self._last_heartbeat else None,
            "heartbeat_failures": self._heartbeat_failures,
        }

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._draining

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Return once registration is acknowledged (raises TimeoutError after `timeout`)."""
        waiting = asyncio.ensure_future(self._ready.wait())
        watched = [waiting] + ([self._lifecycle] if self._lifecycle else [])
        done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if waiting not in done:
            waiting.cancel()
            if self._lifecycle in done and self._lifecycle is not None:
                self._lifecycle.result()  # re-raise a start-up failure
                raise RuntimeError(f"agent {self.agent_id} stopped before it was ready")
            raise TimeoutError(f"agent {self.agent_id} not ready after {timeout}s (state {self._state.value})")

    # ------------------------------------------------------------- running
    async def start(self) -> None:
        """Bind the HTTP server, then run start-up hooks, register and heartbeat in the background."""
        if self._runner is not None:
            raise RuntimeError("the agent is already started")
        if not self._tasks.served:
            raise RuntimeError("declare at least one capability before starting the agent")
        keys = self._tasks.lease_keys
        if keys is None:
            raise LeaseKeyMissingError(f"agent {self.agent_id} will not take tasks from whoever reaches it: {LEASE_KEY_HELP}")
        if not keys.enabled:
            logger.warning(
                "agent %s: %s=%s: LEASE CHECKS ARE OFF, this agent runs tasks for anyone who reaches its port "
                "(local experiments only; never in a shared network)",
                self.agent_id,
                KEY_VAR,
                INSECURE_NO_AUTH,
            )
        app = web.Application()
        app.add_routes(
            [
                web.post("/tasks/{capability}", self._tasks.handle_task),
                web.get("/ready", self._handle_ready),
                web.get("/healthz", self._handle_healthz),
                web.post("/drain", self._handle_drain),
                web.get("/drain", self._handle_drain),
                web.get("/status", self._handle_status),
            ]
        )
        if agent_a2a.available():
            self._a2a = agent_a2a.A2AEndpoint(self._tasks, name=self.deployment, endpoint=lambda: self.endpoint or "")
            app.add_routes(self._a2a.routes())
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        if self.endpoint is None:
            host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
            self.endpoint = f"http://{host}:{self.port}"
        try:
            self.registration()  # fail now, not in the background, on a bad id or schema
        except BaseException:
            await self._close_http()
            raise
        logger.info("agent %s: serving %s on %s:%s", self.agent_id, ", ".join(c.key for c in self.capabilities), self.host, self.port)
        self._lifecycle = asyncio.create_task(self._live(), name=f"agent-{self.agent_id}-lifecycle")

    async def stop(self, *, drain: bool = True, reason: str = "shutdown") -> dict[str, Any] | None:
        """Drain (unless `drain=False`), then stop the HTTP server. Returns the drain outcome."""
        outcome = await self.drain(reason) if drain else None
        await self._cancel_lifecycle()
        await self._close_http()
        if self._owns_roster and self._roster is not None:
            await self._roster.close()  # the process may exit next (see AgentRoster.close)
        self._state = AgentState.TERMINATED
        self._stop_requested.set()
        return outcome

    def request_stop(self, reason: str = "shutdown") -> None:
        """Ask `serve()` to drain and return (what SIGTERM/SIGINT do)."""
        if self._stop_requested.is_set():
            logger.info("agent %s: stop already requested", self.agent_id)
            return
        self._stop_reason = reason
        self._stop_requested.set()

    async def serve(self, *, handle_signals: bool = True) -> None:
        """Start, run until SIGTERM/SIGINT (or `request_stop`), drain, stop.

        Raises if a start-up hook fails.
        """
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(sig, self.request_stop, sig.name.lower())
                    installed.append(sig)
        try:
            await self.start()
            assert self._lifecycle is not None
            stop = asyncio.ensure_future(self._stop_requested.wait())
            await asyncio.wait([stop, self._lifecycle], return_when=asyncio.FIRST_COMPLETED)
            if not stop.done():
                stop.cancel()
                failure = self._lifecycle.exception() if not self._lifecycle.cancelled() else None
                if failure is not None:
                    await self.stop(drain=True, reason="startup_failed")
                    raise failure
                # The lifecycle ends only when the roster drained this agent: nothing left to do.
                self._stop_reason = f"drained by the roster: {self._drained_by}"
            logger.info("agent %s: stopping (%s), draining", self.agent_id, self._stop_reason)
            outcome = await self.stop(reason=self._stop_reason)
            logger.info("agent %s: stopped: %s", self.agent_id, json.dumps(outcome))
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def run(self) -> int:
        """Serve in a fresh event loop with signal handling; the process exit code (0 = clean)."""
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            asyncio.run(self.serve())
        except Exception:
            logger.exception("agent %s failed", self.agent_id)
            return 1
        return 0

    async def __aenter__(self) -> AgentRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------- lifecycle
    async def _live(self) -> None:
        """Spawning -> Registering -> Ready, then heartbeat and watch the run until the roster drains the agent."""
        for hook in self._startup_hooks:
            await call(hook)
        await self._register("registered")
        beating = asyncio.create_task(self._heartbeat_loop())
        watching = asyncio.create_task(self._watch_run())
        try:
            done, _ = await asyncio.wait({beating, watching}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure of either ends the lifecycle with it
        finally:
            for task in (beating, watching):
                task.cancel()
            await asyncio.gather(beating, watching, return_exceptions=True)

    async def _connect(self) -> AgentRoster:
        if self._roster is None:
            options = self._connect_options
            self._roster = await AgentRoster.connect(
                options["target_host"],
                namespace=options["namespace"],
                pool=options["pool"],
                task_queue=options["task_queue"],
                runtime=quiet_core_runtime(),  # no SDK retry warning per attempt while the server is away
            )
        self._tasks.pool = self._roster.pool  # lease tokens must name this agent's pool
        return self._roster

    async def _register(self, why: str) -> None:
        """Register until the roster acknowledges it, retrying with backoff."""
        self._ready.clear()
        self._state = AgentState.REGISTERING
        delay = 0.5
        while True:
            try:
                roster = await self._connect()
                # The agent is alive while the roster acknowledges it (the pool checks a
                # new agent before routing to it): keep heartbeating meanwhile, or a slow
                # acknowledgement would outlast the liveness window.
                beating = asyncio.create_task(self._beat_while_registering(roster))
                try:
                    status = await roster.register(self.registration(), timeout=self.register_timeout_s)
                finally:
                    beating.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await beating
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._outage.failed("registration", exc, retry=f"retrying with backoff (up to {MAX_BACKOFF_S:g}s)")
                await asyncio.sleep(_jittered(delay, 0.5))
                delay = min(delay * 2, MAX_BACKOFF_S)
        self._outage.ok("registration")
        self._registrations += 1
        self._last_heartbeat = datetime.now(timezone.utc)
        self._state = AgentState.READY
        self._ready.set()
        logger.info("agent %s: %s in pool %s (%s)", self.agent_id, why, roster.pool, status.state.value)

    async def _beat_while_registering(self, roster: AgentRoster) -> None:
        while True:
            await asyncio.sleep(_jittered(self.heartbeat_interval_s))
            with contextlib.suppress(Exception):  # not started yet, or the server is busy: next time
                await roster.heartbeat(self.agent_id)

    async def _heartbeat_loop(self) -> None:
        roster = await self._connect()
        failures = 0
        while True:
            pause = self.heartbeat_interval_s if failures == 0 else min(self.heartbeat_interval_s, 0.5 * 2 ** (failures - 1))
            await asyncio.sleep(_jittered(pause))
            try:
                await asyncio.wait_for(roster.heartbeat(self.agent_id), timeout=max(self.heartbeat_interval_s, 5.0))
            except AgentNotFoundError:
                self._outage.ok("heartbeat")  # the server answered: contact is back, the workflow is not
                ended = await self._ended_run()
                if ended is not None and ended.terminated_reason in ROSTER_DRAIN_REASONS:
                    self._drained_by_roster(ended)
                    return
                logger.warning(
                    "agent %s: its workflow is gone (%s); registering again",
                    self.agent_id,
                    f"ended: {ended.terminated_reason}" if ended else "the server has no record of it",
                )
                await self._register("re-registered")
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self._heartbeat_failures += 1
                self._outage.failed("heartbeat", exc)
            else:
                self._outage.ok("heartbeat")
                failures = 0
                self._last_heartbeat = datetime.now(timezone.utc)

    async def _ended_run(self) -> AgentStatus | None:
        """The agent's last run's status if it ended Terminated, or None if unknown."""
        assert self._roster is not None
        try:
            status = await self._roster.describe(self.agent_id)
        except Exception:
            return None
        return status if status.state == AgentState.TERMINATED else None

    async def _watch_run(self) -> None:
        """Return as soon as the roster ends this agent's run by draining it.

        Waits on the run's result (a long poll, no billed action): a drain is heard of
        at once, not at the next heartbeat, which may come after the server is gone (a
        dev stack stops its server right after its pool shut down). A run that ended
        otherwise (heartbeat_lost, ...) is the heartbeat loop's to register again; the
        watch then waits for that registration and watches the new run.
        """
        roster = await self._connect()
        delay = 0.5
        while True:
            registrations = self._registrations
            try:
                status = await roster.wait_ended(self.agent_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # the server is away, or no run: the heartbeat loop reports and recovers
                await asyncio.sleep(_jittered(delay, 0.5))
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            delay = 0.5
            if status.terminated_reason in ROSTER_DRAIN_REASONS:
                self._drained_by_roster(status)
                return
            while self._registrations == registrations:
                await asyncio.sleep(1.0)

    def _drained_by_roster(self, status: AgentStatus) -> None:
        """The roster drained this agent and its run ended: take no more tasks, do not register again."""
        why = next((t.reason for t in reversed(status.transitions) if t.to_state == AgentState.DRAINING), status.terminated_reason)
        if why == POOL_SHUTDOWN_REASON:
            logger.warning("agent %s: its pool %s shut down; stopping", self.agent_id, status.pool)
        else:
            logger.warning("agent %s: the roster drained this agent (%s); stopping, not registering again", self.agent_id, why)
        self._drained_by = why or "drain"
        self._ended = status
        self._draining = True
        self._ready.clear()
        self._state = AgentState.TERMINATED

    async def _cancel_lifecycle(self) -> None:
        task, self._lifecycle = self._lifecycle, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _close_http(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if self._a2a is not None:
            await self._a2a.close()

    # ------------------------------------------------------------- drain
    async def drain(self, reason: str = "drain") -> dict[str, Any]:
        """Stop taking tasks, tell the roster, wait for in-flight tasks and the Terminated run.

        Idempotent: later calls wait for the first drain. Bounded by `drain_timeout_s`.
        """
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(reason), name=f"agent-{self.agent_id}-drain")
        return await asyncio.shield(self._drain_task)

    async def _drain(self, reason: str) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + self.drain_timeout_s
        self._draining = True
        self._ready.clear()
        self._state = AgentState.DRAINING
        await self._cancel_lifecycle()  # no more heartbeats: a drained run must not be re-registered
        logger.info("agent %s: draining (%s), %d task(s) in flight", self.agent_id, reason, self._tasks.in_flight)
        told = False
        if self._roster is not None and self._drained_by is None:  # drained by the roster: its run has ended
            try:
                await asyncio.wait_for(
                    self._roster.drain(self.agent_id, reason, deadline_s=self.drain_timeout_s, wait=False),
                    timeout=max(0.1, deadline - time.monotonic()),
                )
                told = True
            except Exception as exc:  # not registered yet, or the server is unreachable
                logger.warning("agent %s: could not tell the roster about the drain: %s: %s", self.agent_id, type(exc).__name__, exc)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._tasks.idle.wait(), timeout=max(0.0, deadline - time.monotonic()))
        idle = self._tasks.idle.is_set()
        run_state = self._ended.state.value if self._ended is not None else None
        run_reason = self._ended.terminated_reason if self._ended is not None else None
        if told:
            # Wait for the run to *end*, not just to reach Terminated: its last steps
            # (telling the pool, deleting the pod) run on the worker, which must not be
            # stopped under them (e.g. by `agentroster dev` once its agents exited).
            try:
                status = await asyncio.wait_for(
                    self._roster.wait_ended(self.agent_id),  # type: ignore[union-attr]
                    timeout=max(0.1, deadline - time.monotonic()),
                )
                run_state, run_reason = status.state.value, status.terminated_reason
            except AgentNotFoundError:
                run_state = None
            except Exception as exc:  # the deadline passed, or the server is unreachable
                logger.warning("agent %s: its run did not end while draining: %s: %s", self.agent_id, type(exc).__name__, exc)
                with contextlib.suppress(Exception):
                    described = await self._roster.describe(self.agent_id)  # type: ignore[union-attr]
                    run_state, run_reason = described.state.value, described.terminated_reason
        terminated = not told or run_state in (None, AgentState.TERMINATED.value)
        self._state = AgentState.TERMINATED
        outcome = {
            "agent_id": self.agent_id,
            "reason": reason,
            "drained": idle and terminated,
            "timed_out": not (idle and terminated),
            "in_flight": self._tasks.in_flight,
            "roster_told": told,
            "workflow_state": run_state,
            "terminated_reason": run_reason,
            "waited_s": round(time.monotonic() - started, 3),
        }
        log = logger.info if outcome["drained"] else logger.warning
        log("agent %s: drain finished: %s", self.agent_id, json.dumps(outcome))
        return outcome

    # --------------------------------------------------------------- HTTP
    def _reset_failed(self, reason: str) -> None:
        """A reset hook raised: the agent's state may leak into the next task. It refuses new tasks
        at once (`_task_refusal`) and drains, so its process ends and its backend starts a fresh one."""
        logger.error("agent %s: %s; refusing new tasks and draining to be replaced", self.agent_id, reason)
        self.request_stop("reset_failed")  # `serve()` drains and returns: the process exits
        if self._lifecycle is not None and self._drain_task is None:
            # (started with `start()`, nobody waits on the stop request: drained here; idempotent)
            self._reset_drain = asyncio.get_running_loop().create_task(self.drain("reset_failed"))

    def _task_refusal(self) -> str | None:
        if self._tasks.reset_failed:
            return f"agent {self.agent_id} takes no tasks: {self._tasks.reset_failed}"
        if self._draining:
            return f"agent {self.agent_id} is draining and takes no new tasks"
        if self._state == AgentState.SPAWNING:
            return f"agent {self.agent_id} is still starting up"
        return None

    async def _handle_ready(self, request: web.Request) -> web.Response:
        body = {"agent_id": self.agent_id, "state": self._state.value, "ready": self.is_ready}
        return web.json_response(body, status=200 if self.is_ready else 503)

    async def _handle_healthz(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {"agent_id": self.agent_id, "state": self._state.value}
        if self._tasks.reset_failed:
            return web.json_response({**body, "healthy": False, "reason": self._tasks.reset_failed}, status=503)
        for check in self._health_checks:
            try:
                result = check()
                if inspect.isawaitable(result):
                    result = await asyncio.wait_for(result, timeout=5.0)
            except Exception as exc:  # a failing check is an answer, not a crash
                return web.json_response({**body, "healthy": False, "reason": f"{getattr(check, '__name__', 'check')}: {exc!r}"}, status=503)
            if result is False:
                return web.json_response({**body, "healthy": False, "reason": f"{getattr(check, '__name__', 'check')} returned False"}, status=503)
        return web.json_response({**body, "healthy": True})

    async def _handle_drain(self, request: web.Request) -> web.Response:
        reason = request.query.get("reason", "prestop")
        return web.json_response(await self.drain(reason))

    async def _handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())



def run_agent(agent: AgentRuntime) -> NoReturn:
    """Serve `agent` until SIGTERM/SIGINT or until the roster drains it, drain it, and exit
    the process (0 when clean)."""
    sys.exit(agent.run())


__all__ = ["AgentRuntime", "Handler", "Hook", "TaskRefused", "run_agent"]
