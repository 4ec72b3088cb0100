"""The local backend: a "deployment" is a set of agent processes on this machine.

    backend = LocalBackend("examples/fleet.toml", roster=roster)
    await backend.start()          # `replicas` processes per deployment
    await backend.scale("math-agent", 3)
    ...
    await backend.stop()           # SIGTERM (agents drain), then SIGKILL stragglers

A fleet file (TOML, parsed by `agentroster.activities.fleet`) lists the deployments:

    [defaults]                      # optional
    heartbeat_interval_s = 5
    env = { LOG_LEVEL = "info" }

    [[deployment]]
    name = "math-agent"
    command = ["{python}", "-m", "examples.math_agent"]   # {python} = sys.executable
    replicas = 2
    min = 1
    max = 4
    env = { }                       # optional
    cwd = "."                       # optional, relative to the fleet file's folder

It behaves like a Kubernetes ReplicaSet: a reconcile loop keeps the number of
live processes ("pods") equal to the desired replica count, so a crashed or
deleted agent is replaced; a scale-down stops the pods marked for removal
first, then the newest. Pods being stopped no longer count toward the
replicas (as terminating pods do not in Kubernetes), so a replacement starts
while the old pod drains. Each pod runs in its own process group with its
output in a log file (`log_dir`), and gets its identity and the roster's
settings through the environment `AgentRuntime.from_env` reads.

Event-driven liveness: the worker gives the backend a listener (`on_agent_gone`);
when a pod's process exits, the backend tells the agent's workflow at once
(`pod_gone`, reason `process_exited`, the exit code or signal in the detail), so a
crashed agent is Terminated in well under a second rather than after 3 missed
heartbeats. An exit the backend caused (a scale-down, `delete_pod`) is reported too:
its workflow has usually ended by then (the agent drains first) and nothing happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import string
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from agentroster.activities.fleet import PYTHON_PLACEHOLDER, DeploymentSpec, Fleet, FleetDefaults, FleetError, load_fleet
from agentroster.activities.liveness import AgentGoneListener
from agentroster.messages import PodGone
from agentroster.client.settings import Settings

logger = logging.getLogger("agentroster.backend.local")

_ID_ALPHABET = string.ascii_lowercase + string.digits
# Crash-loop backoff: a pod that dies within MIN_UPTIME_S of starting makes the
# next start of its deployment wait 1, 2, 4, ... up to MAX_BACKOFF_S seconds,
# so a broken command does not fork a process every reconcile tick.
MIN_UPTIME_S = 10.0
MAX_BACKOFF_S = 30.0
EXITED_KEPT = 50


# ------------------------------------------------------------------ pods
@dataclass(frozen=True)
class PodInfo:
    """A snapshot of one local agent process, for status displays."""

    agent_id: str
    deployment: str
    pid: int | None
    started_at: datetime
    running: bool
    exit_code: int | None
    log_file: Path
    terminating: bool = False
    marked_for_removal: bool = False


@dataclass(eq=False)
class _Pod:
    agent_id: str
    deployment: str
    process: asyncio.subprocess.Process
    started_at: datetime
    started_mono: float
    seq: int
    log_file: Path
    marked: bool = False
    terminating: bool = False
    exit_code: int | None = None
    watcher: asyncio.Task[int] | None = None
    stopper: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.exit_code is None and self.process.returncode is None

    def info(self) -> PodInfo:
        code = self.exit_code if self.exit_code is not None else self.process.returncode
        return PodInfo(
            agent_id=self.agent_id,
            deployment=self.deployment,
            pid=self.process.pid,
            started_at=self.started_at,
            running=code is None,
            exit_code=code,
            log_file=self.log_file,
            terminating=self.terminating,
            marked_for_removal=self.marked,
        )


@dataclass
class _Deployment:
    spec: DeploymentSpec
    cwd: Path
    desired: int
    pods: dict[str, _Pod] = field(default_factory=dict)
    crash_streak: int = 0
    not_before: float = 0.0  # monotonic time before which no pod starts (crash-loop backoff)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to the process group led by `pid`; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


# ------------------------------------------------------------------ backend
class LocalBackend:
    """Agent processes on this machine, kept at each deployment's replica count."""

    name = "local"

    def __init__(
        self,
        fleet_file: str | Path | None = None,
        *,
        fleet: Fleet | None = None,
        temporal_address: str | None = None,
        namespace: str | None = None,
        pool: str | None = None,
        task_queue: str | None = None,
        workdir: str | Path | None = None,
        roster: object | None = None,
        reconcile_interval_s: float = 1.0,
        stop_grace_s: float = 30.0,
        log_dir: Path | None = None,
    ) -> None:
        """Give a fleet file or a `Fleet` (without either: $AGENTROSTER_FLEET, else an empty fleet).

        Roster settings come from the arguments, then `roster` (an AgentRoster),
        then the environment (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE,
        AGENTROSTER_POOL, AGENTROSTER_TASK_QUEUE). `workdir` anchors relative
        `cwd`s of a `Fleet` that has no `base_dir`.
        """
        if fleet is not None and fleet_file is not None:
            raise ValueError("give fleet_file or fleet, not both")
        if reconcile_interval_s <= 0:
            raise ValueError(f"reconcile_interval_s must be > 0, got {reconcile_interval_s}")
        if stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {stop_grace_s}")
        settings = Settings.from_env()
        if fleet is None:
            fleet_file = fleet_file or settings.fleet
            fleet = load_fleet(fleet_file) if fleet_file else Fleet()
            if not fleet.deployments:
                logger.warning("local backend: the fleet has no deployments; scale requests will be refused")
        if fleet.base_dir is None and workdir is not None:
            fleet = fleet.model_copy(update={"base_dir": Path(workdir)})
        self.fleet = fleet

        client = getattr(roster, "client", None) if roster is not None else None
        roster_address = client.service_client.config.target_host if client is not None else None
        roster_namespace = client.namespace if client is not None else None
        self.temporal_address: str = temporal_address or roster_address or settings.address
        self.namespace: str = namespace or roster_namespace or settings.namespace
        self.pool: str = pool or getattr(roster, "pool", None) or settings.pool
        self.task_queue: str = task_queue or getattr(roster, "task_queue", None) or settings.task_queue
        self.reconcile_interval_s = reconcile_interval_s
        self.stop_grace_s = stop_grace_s
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="agentroster-local-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)

        self._deployments: dict[str, _Deployment] = {}
        for spec in fleet.deployments:
            cwd = fleet.resolve_cwd(spec)
            if not cwd.is_dir():
                raise FleetError(f"deployment {spec.name!r}: cwd {cwd} is not a folder")
            self._deployments[spec.name] = _Deployment(spec=spec, cwd=cwd, desired=spec.replicas)
        self._exited: deque[PodInfo] = deque(maxlen=EXITED_KEPT)
        self._seq = 0
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._running = False
        self._agent_gone: AgentGoneListener | None = None
        self._reports: set[asyncio.Task[bool]] = set()

    def on_agent_gone(self, listener: AgentGoneListener | None) -> None:
        """Call `listener(pool, PodGone)` whenever a pod's process exits (the worker sets it)."""
        self._agent_gone = listener

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start every deployment's replicas and the reconcile loop. A second call does nothing."""
        if self._running:
            return
        if self._stop_task is not None:
            await self._stop_task  # a stop in progress finishes before a restart
            self._stop_task = None
        self._running = True
        self._wake = asyncio.Event()
        await self.reconcile()
        self._loop_task = asyncio.create_task(self._reconcile_loop(), name="local-backend-reconcile")
        logger.info(
            "local backend: started %s (logs in %s)",
            ", ".join(f"{n}={d.desired}" for n, d in self._deployments.items()) or "no deployments",
            self.log_dir,
        )

    async def stop(self) -> None:
        """SIGTERM every pod (agents drain and exit 0), SIGKILL those left after `stop_grace_s`. Idempotent."""
        if self._stop_task is None:
            if not self._running and not any(d.pods for d in self._deployments.values()):
                return
            self._stop_task = asyncio.create_task(self._stop(), name="local-backend-stop")
        await asyncio.shield(self._stop_task)

    async def _stop(self) -> None:
        self._running = False  # before anything else: no replacement may start from here on
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._lock:
            pods = [pod for d in self._deployments.values() for pod in d.pods.values()]
            for pod in pods:
                self._begin_termination(pod)
        await asyncio.gather(*(pod.stopper for pod in pods if pod.stopper is not None), return_exceptions=True)
        for deployment in self._deployments.values():
            for pod in list(deployment.pods.values()):
                self._forget(deployment, pod)
        logger.info("local backend: stopped")

    async def __aenter__(self) -> LocalBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---------------------------------------------------------------- Backend
    async def scale(self, deployment: str, replicas: int) -> None:
        """Set the desired replicas, clamped to the deployment's [min, max]; reconcile at once.

        Raises ValueError for an unknown deployment (non-retryable in BACKEND_RETRY).
        """
        target = self._deployment(deployment)
        spec = target.spec
        clamped = max(spec.min, min(spec.max_replicas, replicas))
        if clamped != replicas:
            logger.warning(
                "local backend: %s asked for %d replicas; clamped to %d (min %d, max %d)",
                deployment, replicas, clamped, spec.min, spec.max_replicas,
            )
        if clamped != target.desired:
            logger.info("local backend: scaling %s from %d to %d replicas", deployment, target.desired, clamped)
        target.desired = clamped
        if self._running:
            await self.reconcile()

    async def scale_to_zero(self, deployment: str) -> None:
        """Stop every pod of `deployment`, below the fleet's `min` too: its pool shut down.

        A deployment outside the fleet (its agents were started by hand beside the stack)
        has no process here to stop: it is already at zero for this backend, and those
        agents end themselves when their pool shuts down (`agentroster.agent.runtime`).
        """
        target = self._deployments.get(deployment)
        if target is None:
            logger.info("local backend: %s is not in the fleet (agents started elsewhere): nothing to stop", deployment)
            return
        if target.desired:
            logger.info("local backend: scaling %s from %d to 0 replicas (its pool shut down)", deployment, target.desired)
        target.desired = 0
        if self._running:
            await self.reconcile()

    async def current_replicas(self, deployment: str) -> int:
        """The desired replica count of `deployment` (ValueError if unknown)."""
        return self._deployment(deployment).desired

    async def delete_pod(self, deployment: str, agent_id: str) -> None:
        """Start stopping that agent's process (SIGTERM, SIGKILL after `stop_grace_s`) and return.

        As a Kubernetes pod deletion does, this returns once the deletion is under
        way, not when the process is gone: a draining agent waits for its workflow
        to end, and its workflow waits for this activity, so waiting here would
        hold both until the grace period. An unknown or already-exited pod is
        success (activities retry). The reconcile loop starts a replacement right
        away, as a ReplicaSet does.
        """
        target = self._deployments.get(deployment)
        pod = target.pods.get(agent_id) if target is not None else None
        if pod is None or not pod.running:
            logger.info("local backend: pod %s of %s is already gone", agent_id, deployment)
            return
        logger.info("local backend: deleting pod %s of %s (pid %s)", agent_id, deployment, pod.process.pid)
        self._begin_termination(pod)  # runs on its own: a cancelled activity cannot leave it half-done
        self._wake.set()

    async def mark_for_removal(self, deployment: str, agent_id: str) -> None:
        """Stop this pod first on the next scale-down of `deployment`; an unknown pod is ignored."""
        target = self._deployments.get(deployment)
        pod = target.pods.get(agent_id) if target is not None else None
        if pod is None:
            logger.info("local backend: cannot mark %s of %s for removal: no such pod", agent_id, deployment)
            return
        pod.marked = True

    # ---------------------------------------------------------------- status
    def pods(self, *, include_exited: bool = False) -> list[PodInfo]:
        """Live pods (including ones being stopped), oldest first; with `include_exited`, recent exits too."""
        live = sorted((pod for d in self._deployments.values() for pod in d.pods.values()), key=lambda p: p.seq)
        infos = [pod.info() for pod in live]
        return [*self._exited, *infos] if include_exited else infos

    def desired(self) -> dict[str, int]:
        """Desired replicas per deployment."""
        return {name: d.desired for name, d in self._deployments.items()}

    @property
    def running(self) -> bool:
        """True between start() and stop()."""
        return self._running

    # ------------------------------------------------------------- reconcile
    async def _reconcile_loop(self) -> None:
        while self._running:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.reconcile_interval_s)
            self._wake.clear()
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad pass must not end the loop that keeps the fleet alive
                logger.exception("local backend: reconcile failed")

    async def reconcile(self) -> None:
        """One ReplicaSet pass over every deployment: reap exited pods, start or stop to match `desired`."""
        async with self._lock:
            for deployment in self._deployments.values():
                if not self._running:
                    return
                await self._reconcile_one(deployment)

    async def _reconcile_one(self, deployment: _Deployment) -> None:
        for pod in list(deployment.pods.values()):
            if not pod.running:
                self._reap(deployment, pod)
        active = [pod for pod in deployment.pods.values() if not pod.terminating]
        missing = deployment.desired - len(active)
        if missing > 0:
            if time.monotonic() < deployment.not_before:
                return  # crash-loop backoff: a later pass starts them
            for _ in range(missing):
                if not self._running or not await self._spawn(deployment):
                    break
        elif missing < 0:
            # Marked pods first, then the newest (they have the least warm state).
            victims = sorted(active, key=lambda p: (not p.marked, -p.seq))[:-missing]
            for pod in victims:
                logger.info(
                    "local backend: scale-down of %s stops %s%s",
                    deployment.spec.name, pod.agent_id, " (marked for removal)" if pod.marked else "",
                )
                self._begin_termination(pod)

    def _reap(self, deployment: _Deployment, pod: _Pod) -> None:
        code = pod.exit_code if pod.exit_code is not None else pod.process.returncode
        uptime = time.monotonic() - pod.started_mono
        if pod.terminating:
            logger.info("local backend: pod %s of %s stopped (exit code %s)", pod.agent_id, deployment.spec.name, code)
        else:
            # It died on its own: a crash (or an agent that gave up). Back off if it keeps happening.
            deployment.crash_streak = deployment.crash_streak + 1 if uptime < MIN_UPTIME_S else 1
            delay = 0.0 if deployment.crash_streak <= 1 else min(2.0 ** (deployment.crash_streak - 2), MAX_BACKOFF_S)
            deployment.not_before = time.monotonic() + delay
            logger.warning(
                "local backend: pod %s of %s exited with code %s after %.1fs; replacing it%s (log: %s)",
                pod.agent_id, deployment.spec.name, code, uptime,
                f" in {delay:.0f}s (crash loop)" if delay else "", pod.log_file,
            )
        self._forget(deployment, pod)

    def _forget(self, deployment: _Deployment, pod: _Pod) -> None:
        # Whatever the agent left in its group dies with it, as a container's processes do.
        _signal_group(pod.process.pid, signal.SIGKILL)
        deployment.pods.pop(pod.agent_id, None)
        self._exited.append(pod.info())

    async def _spawn(self, deployment: _Deployment) -> bool:
        """Start one pod of `deployment`; False (after logging) if the command cannot start."""
        spec = deployment.spec
        agent_id = self._new_agent_id(spec.name)
        log_file = self.log_dir / f"{agent_id}.log"
        command = [word.replace(PYTHON_PLACEHOLDER, sys.executable) for word in spec.command]
        try:
            with open(log_file, "ab") as log:
                process = await asyncio.create_subprocess_exec(
                    *command,
                    cwd=deployment.cwd,
                    env=self._pod_env(spec, agent_id),
                    stdin=subprocess.DEVNULL,
                    stdout=log,  # the child keeps its own descriptor; ours closes after the fork
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: SIGKILL reaches its children too
                )
        except OSError as exc:
            deployment.crash_streak += 1
            deployment.not_before = time.monotonic() + min(2.0 ** max(deployment.crash_streak - 1, 0), MAX_BACKOFF_S)
            logger.error("local backend: cannot start %s for %s (%s): %s", command, spec.name, deployment.cwd, exc)
            return False
        self._seq += 1
        pod = _Pod(
            agent_id=agent_id,
            deployment=spec.name,
            process=process,
            started_at=datetime.now(timezone.utc),
            started_mono=time.monotonic(),
            seq=self._seq,
            log_file=log_file,
        )
        pod.watcher = asyncio.create_task(self._watch(pod), name=f"local-pod-{agent_id}")
        deployment.pods[agent_id] = pod
        logger.info("local backend: started %s of %s (pid %d, log %s)", agent_id, spec.name, process.pid, log_file)
        return True

    async def _watch(self, pod: _Pod) -> int:
        code = await pod.process.wait()
        pod.exit_code = code
        self._wake.set()  # replace it now, not at the next tick
        self._report_gone(pod, code)
        return code

    def _report_gone(self, pod: _Pod, code: int) -> None:
        """Tell the agent's workflow its process exited (event-driven liveness), in the background."""
        listener = self._agent_gone
        if listener is None:
            return
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        detail = f"{how}" + (" while being stopped" if pod.terminating else "")
        try:
            gone = PodGone(agent_id=pod.agent_id, reason="process_exited", detail=detail)
        except ValueError as exc:  # pragma: no cover - ids are generated valid
            logger.warning("local backend: cannot report %s gone: %s", pod.agent_id, exc)
            return
        task = asyncio.create_task(self._tell(listener, gone), name=f"local-gone-{pod.agent_id}")
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _tell(self, listener: AgentGoneListener, gone: PodGone) -> bool:
        try:
            return await listener(self.pool, gone)
        except Exception:
            logger.exception("local backend: telling %s's workflow that its process exited failed", gone.agent_id)
            return False

    def _new_agent_id(self, deployment: str) -> str:
        taken = {agent_id for d in self._deployments.values() for agent_id in d.pods}
        while True:
            agent_id = f"{deployment}-{''.join(secrets.choice(_ID_ALPHABET) for _ in range(5))}"
            if agent_id not in taken:
                return agent_id

    def _pod_env(self, spec: DeploymentSpec, agent_id: str) -> dict[str, str]:
        env = dict(os.environ)
        # Set per pod by the runtime from its bound port; an inherited one would give every pod the same endpoint.
        env.pop("AGENT_ENDPOINT", None)
        env.update(self.fleet.defaults.env)
        env.update(spec.env)
        heartbeat = spec.heartbeat_interval_s or self.fleet.defaults.heartbeat_interval_s
        env.update(
            {
                "AGENT_ID": agent_id,
                "AGENT_DEPLOYMENT": spec.name,
                "AGENT_PORT": "0",
                "AGENT_HOST": "127.0.0.1",
                "HEARTBEAT_INTERVAL_S": f"{heartbeat:g}",
                "TEMPORAL_ADDRESS": self.temporal_address,
                "TEMPORAL_NAMESPACE": self.namespace,
                "AGENTROSTER_POOL": self.pool,
                "AGENTROSTER_TASK_QUEUE": self.task_queue,
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.stop_grace_s > 0:
            # The agent should give up draining before we SIGKILL it (like a drain time under
            # terminationGracePeriodSeconds), unless the fleet chose its own drain timeout.
            env.setdefault("DRAIN_TIMEOUT_S", f"{max(self.stop_grace_s * 0.8, 0.1):g}")
        return env

    # ------------------------------------------------------------ termination
    def _begin_termination(self, pod: _Pod) -> None:
        """Start stopping `pod` once; later callers share the same stopper task."""
        pod.terminating = True
        if pod.stopper is None:
            pod.stopper = asyncio.create_task(self._terminate(pod), name=f"local-stop-{pod.agent_id}")

    async def _terminate(self, pod: _Pod) -> None:
        assert pod.watcher is not None
        if pod.running:
            # SIGTERM to the agent only, not its group: it drains, and a task it runs in a
            # child process (e.g. the code runner) must be allowed to finish.
            with contextlib.suppress(ProcessLookupError):
                pod.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(pod.watcher), timeout=self.stop_grace_s)
            except asyncio.TimeoutError:
                logger.warning(
                    "local backend: %s did not exit within %.1fs of SIGTERM; killing its process group",
                    pod.agent_id, self.stop_grace_s,
                )
                _signal_group(pod.process.pid, signal.SIGKILL)
                await asyncio.shield(pod.watcher)
        _signal_group(pod.process.pid, signal.SIGKILL)
        self._wake.set()

    def _deployment(self, name: str) -> _Deployment:
        target = self._deployments.get(name)
        if target is None:
            known = ", ".join(sorted(self._deployments)) or "none"
            raise ValueError(f"local backend: unknown deployment {name!r} (known: {known})")
        return target


__all__ = ["DeploymentSpec", "Fleet", "FleetDefaults", "FleetError", "LocalBackend", "PodInfo", "load_fleet"]
