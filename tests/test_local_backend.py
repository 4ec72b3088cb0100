"""The local backend: fleet files, a ReplicaSet of local processes, and a real agent replaced.

The unit tests run a tiny agent-like script (it prints its environment, sleeps,
exits 0 on SIGTERM; optionally crashes, ignores SIGTERM, or starts a child).
The last test runs the real math agent against the dev server.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import aiohttp
import pytest

from agentroster.activities.backend import Backend
from agentroster.activities.local_backend import (
    DeploymentSpec,
    Fleet,
    FleetDefaults,
    FleetError,
    LocalBackend,
    load_fleet,
)
from agentroster.errors import AgentNotFoundError
from agentroster.models import DEFAULT_HEARTBEAT_INTERVAL_S, AgentState, AgentStatus
from tests.conftest import Stack, eventually

REPO_ROOT = Path(__file__).resolve().parents[1]

FAKE_AGENT = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time

    if os.environ.get("IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    keys = ["AGENT_ID", "AGENT_DEPLOYMENT", "AGENT_PORT", "AGENT_HOST", "HEARTBEAT_INTERVAL_S",
            "TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "AGENTROSTER_POOL", "AGENTROSTER_TASK_QUEUE",
            "PYTHONUNBUFFERED", "DRAIN_TIMEOUT_S", "FROM_DEFAULTS", "FROM_DEPLOYMENT"]
    info = {key: os.environ.get(key) for key in keys}
    info["cwd"] = os.getcwd()
    if os.environ.get("SPAWN_CHILD") == "1":
        info["child"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid
    print(json.dumps(info), flush=True)
    crash_after = float(os.environ.get("CRASH_AFTER_S") or 0)
    started = time.monotonic()
    while True:
        time.sleep(0.02)
        if crash_after and time.monotonic() - started > crash_after:
            sys.exit(3)
    """
)


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie left for a non-reaping init counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "fake_agent.py"
    path.write_text(FAKE_AGENT)
    return path


def spec(script: Path, name: str = "fake", **fields: object) -> DeploymentSpec:
    return DeploymentSpec(name=name, command=["{python}", str(script)], **fields)  # type: ignore[arg-type]


def backend_for(tmp_path: Path, *specs: DeploymentSpec, **options: object) -> LocalBackend:
    fleet = Fleet(defaults=FleetDefaults(heartbeat_interval_s=2, env={"FROM_DEFAULTS": "d"}), deployments=list(specs), base_dir=tmp_path)
    options.setdefault("reconcile_interval_s", 0.1)
    options.setdefault("stop_grace_s", 5.0)
    return LocalBackend(
        fleet=fleet,
        temporal_address="127.0.0.1:1",
        namespace="ns",
        pool="p",
        task_queue="tq",
        log_dir=tmp_path / "logs",
        **options,  # type: ignore[arg-type]
    )


def running(backend: LocalBackend, deployment: str = "fake") -> list[str]:
    return [p.agent_id for p in backend.pods() if p.deployment == deployment and p.running and not p.terminating]


def started_info(backend: LocalBackend, agent_id: str) -> dict[str, object] | None:
    """What the fake agent printed at start-up, once it has."""
    pod = next(p for p in backend.pods(include_exited=True) if p.agent_id == agent_id)
    text = pod.log_file.read_text() if pod.log_file.exists() else ""
    return json.loads(text.splitlines()[0]) if text.strip() else None


async def all_started(backend: LocalBackend) -> None:
    """Wait until every pod has printed its start-up line (its SIGTERM handler is installed)."""
    await eventually(lambda: all(started_info(backend, p.agent_id) for p in backend.pods()), timeout=10)


# ---------------------------------------------------------------- fleet files
def test_example_fleet_describes_the_three_example_agents() -> None:
    fleet = load_fleet(REPO_ROOT / "examples" / "fleet.toml")
    got = {s.name: (s.replicas, s.min, s.max, s.command) for s in fleet.deployments}
    assert got == {
        "math-agent": (2, 1, 4, ["{python}", "-m", "examples.math_agent"]),
        "search-agent": (1, 1, 3, ["{python}", "-m", "examples.search_agent"]),
        "code-agent": (1, 0, 2, ["{python}", "-m", "examples.code_agent"]),
    }
    assert fleet.defaults.heartbeat_interval_s == DEFAULT_HEARTBEAT_INTERVAL_S  # crashes are reported by the backend
    assert {fleet.resolve_cwd(s) for s in fleet.deployments} == {REPO_ROOT}


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[[deployment]]\nname = "Math_Agent"\ncommand = ["x"]', "deployment[0] (Math_Agent).name"),
        ('[[deployment]]\nname = "m"\ncommand = []', "deployment[0] (m).command"),
        ('[[deployment]]\nname = "m"', "deployment[0] (m).command: Field required"),
        ('[[deployment]]\nname = "m"\ncommand = ["x", 3]', "deployment[0] (m).command[1]"),
        ('[[deployment]]\nname = "m"\ncommand = ["x", ""]', "every word of the command"),
        ('[[deployment]]\nname = "m"\ncommand = ["x"]\nreplicas = -1', "deployment[0] (m).replicas"),
        ('[[deployment]]\nname = "m"\ncommand = ["x"]\nreplicas = 1\nmin = 2\nmax = 3', "min=2, replicas=1, max=3"),
        ('[[deployment]]\nname = "m"\ncommand = ["x"]\nreplicas = 5\nmax = 4', "min <= replicas <= max"),
        ('[[deployment]]\nname = "m"\ncommand = ["x"]\nreplica = 2', "deployment[0] (m).replica: Extra inputs"),
        ('[[deployment]]\nname = "m"\ncommand = ["x"]\n[[deployment]]\nname = "m"\ncommand = ["y"]', "'m' is used twice"),
        ('[defaults]\nheartbeat_interval_s = 0', "defaults.heartbeat_interval_s"),
        ('[[deploymnt]]\nname = "m"', "unknown top-level key(s) ['deploymnt']"),
        ('[[deployment]\nname = "m"', "not valid TOML"),
    ],
)
def test_fleet_validation_names_the_field(tmp_path: Path, toml: str, expected: str) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(toml)
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    assert expected in str(caught.value)
    assert str(path) in str(caught.value)


def test_fleet_defaults_and_env_values(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('[defaults]\nenv = { PORT = 8080, DEBUG = true }\n[[deployment]]\nname = "m"\ncommand = ["x"]\nreplicas = 2\ncwd = "sub"')
    fleet = load_fleet(path)
    only = fleet.deployments[0]
    assert (only.min, only.replicas, only.max) == (0, 2, 2)  # max defaults to replicas
    assert fleet.defaults.env == {"PORT": "8080", "DEBUG": "true"}
    assert fleet.resolve_cwd(only) == tmp_path / "sub"
    with pytest.raises(FleetError, match="cwd .* is not a folder"):
        LocalBackend(fleet=fleet, log_dir=tmp_path / "logs")


def test_local_backend_is_a_backend(tmp_path: Path) -> None:
    assert isinstance(LocalBackend(fleet=Fleet(), log_dir=tmp_path), Backend)
    assert LocalBackend.name == "local"


# ---------------------------------------------------------------- processes
async def test_pod_gets_its_identity_and_the_roster_settings(tmp_path: Path, script: Path) -> None:
    backend = backend_for(tmp_path, spec(script, env={"FROM_DEPLOYMENT": "x"}, heartbeat_interval_s=1.5))
    await backend.start()
    try:
        (agent_id,) = running(backend)
        info = await eventually(lambda: started_info(backend, agent_id), timeout=10)
    finally:
        await backend.stop()
    assert agent_id.startswith("fake-") and len(agent_id) == len("fake-") + 5
    assert info == {
        "AGENT_ID": agent_id,
        "AGENT_DEPLOYMENT": "fake",
        "AGENT_PORT": "0",
        "AGENT_HOST": "127.0.0.1",
        "HEARTBEAT_INTERVAL_S": "1.5",
        "TEMPORAL_ADDRESS": "127.0.0.1:1",
        "TEMPORAL_NAMESPACE": "ns",
        "AGENTROSTER_POOL": "p",
        "AGENTROSTER_TASK_QUEUE": "tq",
        "PYTHONUNBUFFERED": "1",
        # Under stop_grace_s, so the agent gives up draining before it is killed (unless set already).
        "DRAIN_TIMEOUT_S": os.environ.get("DRAIN_TIMEOUT_S", "4"),
        "FROM_DEFAULTS": "d",
        "FROM_DEPLOYMENT": "x",
        "cwd": str(tmp_path),
    }


async def test_scale_starts_and_stops_processes_within_min_and_max(tmp_path: Path, script: Path) -> None:
    backend = backend_for(tmp_path, spec(script, replicas=1, min=1, max=3))
    await backend.start()
    try:
        assert len(running(backend)) == 1
        await backend.scale("fake", 3)
        assert len(running(backend)) == 3 and await backend.current_replicas("fake") == 3
        pids = {p.agent_id: p.pid for p in backend.pods()}
        await all_started(backend)

        await backend.scale("fake", 10)  # clamped to max
        assert await backend.current_replicas("fake") == 3 and backend.desired() == {"fake": 3}
        assert len(running(backend)) == 3

        await backend.scale("fake", 0)  # clamped to min
        assert await backend.current_replicas("fake") == 1
        await eventually(lambda: len(backend.pods()) == 1, timeout=10)
        (survivor,) = running(backend)
        gone = [pid for agent_id, pid in pids.items() if agent_id != survivor]
        assert gone and not any(alive(pid) for pid in gone if pid is not None)
        exited = [p for p in backend.pods(include_exited=True) if not p.running]
        assert sorted(p.exit_code for p in exited) == [0, 0]  # SIGTERM: a clean exit

        with pytest.raises(ValueError, match="unknown deployment 'nope'"):
            await backend.scale("nope", 2)
        with pytest.raises(ValueError, match="'nope'"):
            await backend.current_replicas("nope")
    finally:
        await backend.stop()


async def test_scale_down_removes_the_marked_pod_then_the_newest(tmp_path: Path, script: Path) -> None:
    backend = backend_for(tmp_path, spec(script, replicas=3, min=0, max=3))
    await backend.start()
    try:
        oldest, middle, newest = running(backend)  # pods() is oldest first
        await backend.mark_for_removal("fake", oldest)
        await backend.mark_for_removal("fake", "fake-nobody")  # unknown: ignored
        await backend.scale("fake", 2)
        assert running(backend) == [middle, newest]
        await backend.scale("fake", 1)
        assert running(backend) == [middle]
    finally:
        await backend.stop()


async def test_a_crashed_process_is_replaced(tmp_path: Path, script: Path) -> None:
    backend = backend_for(tmp_path, spec(script, replicas=1, env={"CRASH_AFTER_S": "0.5"}))
    await backend.start()
    try:
        (first,) = running(backend)
        replacement = await eventually(lambda: [a for a in running(backend) if a != first], timeout=10)
        assert len(replacement) == 1 and len(running(backend)) == 1
        crashed = next(p for p in backend.pods(include_exited=True) if p.agent_id == first)
        assert (crashed.running, crashed.exit_code) == (False, 3)
    finally:
        await backend.stop()


async def test_every_exit_is_reported_to_the_listener(tmp_path: Path, script: Path) -> None:
    """Event-driven liveness: a crash, a SIGKILL and a stop each reach the listener the worker gives."""
    from agentroster.messages import PodGone

    reports: list[tuple[str, PodGone]] = []

    async def listener(pool: str, gone: PodGone) -> bool:
        reports.append((pool, gone))
        return True

    backend = backend_for(tmp_path, spec(script, replicas=1, env={"CRASH_AFTER_S": "0.5"}), spec(script, name="steady", replicas=1))
    backend.on_agent_gone(listener)
    await backend.start()
    try:
        (crasher,) = running(backend)
        await eventually(lambda: any(g.agent_id == crasher for _, g in reports), timeout=10)
        (steady,) = running(backend, "steady")
        pid = next(p.pid for p in backend.pods() if p.agent_id == steady)
        os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
        await eventually(lambda: any(g.agent_id == steady for _, g in reports), timeout=10)
    finally:
        await backend.stop()
    by_agent = {g.agent_id: (pool, g.reason, g.detail) for pool, g in reports}
    assert by_agent[crasher] == ("p", "process_exited", "exit code 3")
    assert by_agent[steady] == ("p", "process_exited", "killed by SIGKILL")
    # Pods the backend stopped are reported too (their workflows have usually ended by then).
    stopped = [g for _, g in reports if g.agent_id not in (crasher, steady)]
    assert stopped and all(g.detail.endswith("while being stopped") for g in stopped)


async def test_delete_pod_kills_it_and_the_replica_is_replaced(tmp_path: Path, script: Path) -> None:
    backend = backend_for(tmp_path, spec(script, replicas=2, max=2))
    await backend.start()
    try:
        victim, other = backend.pods()
        await backend.delete_pod("fake", victim.agent_id)
        # Like a Kubernetes DELETE, it returns once the deletion is under way; the process goes soon after.
        assert victim.pid is not None
        await eventually(lambda: not alive(victim.pid), timeout=15)
        await eventually(lambda: len(running(backend)) == 2 and victim.agent_id not in running(backend), timeout=10)
        assert other.agent_id in running(backend)
        assert await backend.current_replicas("fake") == 2

        # Already gone, never existed, unknown deployment: all success (activities retry).
        await backend.delete_pod("fake", victim.agent_id)
        await backend.delete_pod("fake", "fake-zzzzz")
        await backend.delete_pod("elsewhere", "x-1")
    finally:
        await backend.stop()


async def test_stop_terminates_everything_and_kills_stragglers(tmp_path: Path, script: Path) -> None:
    backend = backend_for(
        tmp_path,
        spec(script, replicas=2),
        spec(script, name="stubborn", replicas=1, env={"IGNORE_SIGTERM": "1", "SPAWN_CHILD": "1"}),
        stop_grace_s=0.5,
    )
    await backend.start()
    (stubborn,) = running(backend, "stubborn")
    await all_started(backend)
    info = started_info(backend, stubborn)
    assert info is not None
    pids = [p.pid for p in backend.pods()] + [info["child"]]
    assert len(pids) == 4 and all(alive(pid) for pid in pids)  # type: ignore[arg-type]

    await backend.stop()
    await backend.stop()  # idempotent

    assert not backend.pods() and not backend.running
    await eventually(lambda: not any(alive(pid) for pid in pids), timeout=5)  # type: ignore[arg-type]
    codes = {p.deployment: [] for p in backend.pods(include_exited=True)}
    for p in backend.pods(include_exited=True):
        codes[p.deployment].append(p.exit_code)
    assert codes == {"fake": [0, 0], "stubborn": [-signal.SIGKILL]}

    # After stop nothing restarts; a scale only records the wish.
    await backend.scale("fake", 2)
    assert not backend.pods()


# ---------------------------------------------------------------- with Temporal
async def _terminated(stack: Stack, agent_id: str) -> AgentStatus | None:
    try:
        status = await stack.roster.describe(agent_id)
    except AgentNotFoundError:
        return None
    return status if status.state == AgentState.TERMINATED else None


async def _other_agents(stack: Stack, old: str) -> list[str]:
    return [a for a in await stack.roster.find("math.eval") if a != old]


@pytest.mark.slow
async def test_killed_agent_is_reported_gone_at_once_and_replaced(stack: Stack, tmp_path: Path) -> None:
    """kill -9 of a real agent: its workflow ends `process_exited` from the backend's report
    (event-driven), long before its heartbeat window (3 x 30 s) could have ended it."""
    fleet = Fleet(
        defaults=FleetDefaults(heartbeat_interval_s=30),
        deployments=[
            DeploymentSpec(name="math-agent", command=["{python}", "-m", "examples.math_agent"], replicas=1, min=1, max=2)
        ],
        base_dir=REPO_ROOT,
    )
    backend = LocalBackend(fleet=fleet, roster=stack.roster, reconcile_interval_s=0.2, stop_grace_s=15, log_dir=tmp_path / "logs")
    assert backend.temporal_address == stack.env.client.service_client.config.target_host
    # The worker gives the backend its listener (pod_gone) and carries out delete_pod on it, as `agentroster dev` does.
    await stack.stop_worker()
    stack.backend = backend
    await stack.start_worker()
    await backend.start()
    try:
        (first,) = await eventually(lambda: stack.roster.find("math.eval"), timeout=20, interval=0.2)
        pod = next(p for p in backend.pods() if p.agent_id == first)
        assert pod.pid is not None
        os.killpg(pod.pid, signal.SIGKILL)

        status = await eventually(lambda: _terminated(stack, first), timeout=20, interval=0.1)
        # Only the backend's report can give this reason: a heartbeat window would say heartbeat_lost.
        assert status.terminated_reason == "process_exited"
        assert status.transitions[-1].reason == "process_exited: killed by SIGKILL"
        assert stack.worker.agent_gone is not None and stack.worker.agent_gone.told >= 1
        (second,) = await eventually(lambda: _other_agents(stack, first), timeout=25, interval=0.2)
        assert await backend.current_replicas("math-agent") == 1
        assert [p.agent_id for p in backend.pods()] == [second]

        # Routable for real: a lease on it, and the task served over HTTP.
        async with stack.roster.borrow("math.eval@>=1,<2", timeout=5) as lease:
            assert lease.agent_id == second
            body = {"lease_id": lease.lease_id, "capability": "math.eval", "version": lease.version, "input": {"expression": "6*7"}}
            async with aiohttp.ClientSession() as http:
                # A direct call carries the lease token, signed with the key the agent inherited.
                async with http.post(f"{lease.endpoint}/tasks/math.eval", json=body, headers=stack.roster.lease_headers(lease)) as response:
                    assert response.status == 200, await response.text()
                    assert await response.json() == {"output": {"value": 42}}
    finally:
        await backend.stop()
    # SIGTERM drained the agent: it exited 0 and its workflow ended.
    exits = {p.agent_id: p.exit_code for p in backend.pods(include_exited=True)}
    assert exits == {first: -signal.SIGKILL, second: 0}, [p.log_file.read_text()[-2000:] for p in backend.pods(include_exited=True)]
    assert await eventually(lambda: _terminated(stack, second), timeout=10)
