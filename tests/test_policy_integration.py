"""Sizing policies on the real dev server with the local backend and real agent processes.

A burst of 20 callers on `math.eval` with min=1, max=4 scales the deployment to
4 replicas; once the burst is over and `downscale_delay_s` has passed, it goes
back to 1, retiring idle agents only, and not a single task fails. An agent
that reaches `max_uses` is replaced before it is retired. The CLI sets and shows
policies (a deployment's outlier and health settings too, with or without sizing), and
refuses bad ones naming the field.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from agentroster.activities.local_backend import DeploymentSpec, Fleet, FleetDefaults, LocalBackend
from agentroster.models import AgentState, OutlierPolicy, PoolPolicy
from tests.conftest import Stack, eventually

REPO_ROOT = Path(__file__).resolve().parents[1]


async def _local_fleet(stack: Stack, tmp_path: Path, replicas: int, maximum: int) -> LocalBackend:
    fleet = Fleet(
        defaults=FleetDefaults(heartbeat_interval_s=2),
        deployments=[
            DeploymentSpec(name="math-agent", command=["{python}", "-m", "examples.math_agent"], replicas=replicas, min=0, max=maximum)
        ],
        base_dir=REPO_ROOT,
    )
    backend = LocalBackend(fleet=fleet, roster=stack.roster, reconcile_interval_s=0.2, stop_grace_s=15, log_dir=tmp_path / "logs")
    await stack.stop_worker()
    stack.backend = backend
    await stack.start_worker()
    await backend.start()
    return backend


async def _evaluate(stack: Stack, http: aiohttp.ClientSession, expression: str) -> str:
    """One real task: lease math.eval, POST it to the agent with the lease token, release."""
    async with stack.roster.borrow("math.eval@>=1,<2", timeout=90) as lease:
        body = {"lease_id": lease.lease_id, "capability": "math.eval", "version": lease.version, "input": {"expression": expression}}
        async with http.post(f"{lease.endpoint}/tasks/math.eval", json=body, headers=stack.roster.lease_headers(lease)) as response:
            assert response.status == 200, await response.text()
            await asyncio.sleep(0.6)  # the caller works with the answer while holding the lease
            return lease.agent_id


def _serving(status) -> list[str]:  # noqa: ANN001
    return sorted(a.agent_id for a in status.agents if a.deployment == "math-agent" and a.retiring is None and a.state != AgentState.DRAINING)


@pytest.mark.slow
async def test_a_burst_scales_up_to_max_and_back_down_to_min_without_a_failed_task(stack: Stack, tmp_path: Path) -> None:
    backend = await _local_fleet(stack, tmp_path, replicas=1, maximum=4)
    try:
        await eventually(lambda: stack.roster.find("math.eval"), timeout=30, interval=0.2)
        await stack.roster.set_policy(
            "math-agent",
            PoolPolicy(min_replicas=1, max_replicas=4, target_in_flight_per_agent=1, upscale_delay_s=0.5, downscale_delay_s=6),
        )
        peak = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, await backend.current_replicas("math-agent"))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        served: list[str] = []
        async with aiohttp.ClientSession() as http:

            async def caller(i: int) -> None:
                for j in range(4):
                    served.append(await _evaluate(stack, http, f"{i}*{j}"))

            await asyncio.gather(*(caller(i) for i in range(20)))  # any failure raises here
        assert len(served) == 80
        assert len(set(served)) >= 2, "the burst was served by one agent: no scale-up happened"
        assert await eventually(lambda: backend.current_replicas("math-agent"), timeout=5) >= 1
        # Back down to min once load stayed low for downscale_delay_s, idle agents retired.
        status = await eventually(
            lambda: _settled_at(stack, backend, 1), timeout=60, interval=0.5
        )
        stop.set()
        await watcher
        assert peak == 4
        assert status.active_leases == 0 and status.waiting == 0
        # The one left still serves.
        async with aiohttp.ClientSession() as http:
            await _evaluate(stack, http, "6*7")
    finally:
        await backend.stop()


async def _settled_at(stack: Stack, backend: LocalBackend, replicas: int):  # noqa: ANN202
    status = await stack.roster.status()
    if await backend.current_replicas("math-agent") == replicas and len(_serving(status)) == replicas and len(
        [p for p in backend.pods() if p.deployment == "math-agent" and p.running]
    ) == replicas:
        return status
    return None


@pytest.mark.slow
async def test_an_agent_reaching_max_uses_is_replaced_before_it_is_retired(stack: Stack, tmp_path: Path) -> None:
    # The fleet's own max leaves room for the surge of one over the policy's max.
    backend = await _local_fleet(stack, tmp_path, replicas=1, maximum=2)
    try:
        (first,) = await eventually(lambda: stack.roster.find("math.eval"), timeout=30, interval=0.2)
        await stack.roster.set_policy(
            "math-agent", PoolPolicy(min_replicas=1, max_replicas=1, target_in_flight_per_agent=1, max_uses=3, upscale_delay_s=0)
        )
        async with aiohttp.ClientSession() as http:
            for i in range(3):
                assert await _evaluate(stack, http, f"{i}+1") == first
            # Worn out: routed to no more, a replacement surges in (max + 1), then the worn one goes.
            second = await _evaluate(stack, http, "2+2")
        assert second != first
        await eventually(lambda: _terminated(stack, first), timeout=40, interval=0.5)
        assert await backend.current_replicas("math-agent") == 1
        pool = await stack.roster.status()
        assert _serving(pool) == [second]
        assert any(f"agent {first} retired from routing: worn" in w for w in pool.warnings)
    finally:
        await backend.stop()


async def _terminated(stack: Stack, agent_id: str) -> bool:
    return (await stack.roster.describe(agent_id)).state == AgentState.TERMINATED


async def _cli(*args: str) -> tuple[int, str, str]:
    """Run the agentroster CLI as a user does (a separate process; this loop keeps running the worker)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentroster.workers.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode or 0, out.decode(), err.decode()


async def test_cli_sets_and_shows_policies_and_refuses_bad_ones(stack: Stack) -> None:
    address = stack.env.client.service_client.config.target_host
    where = ["--address", address, "--pool", stack.pool, "--task-queue", stack.task_queue]
    code, _, err = await _cli("policy", "set", "search-agent", *where, "--min-replicas", "5", "--max-replicas", "2")
    assert code == 2 and "min_replicas 5 is greater than max_replicas 2" in err
    code, _, err = await _cli("policy", "set", "search-agent", *where, "--downscale-delay-s", "-3")
    assert code == 2 and "downscale_delay_s" in err
    code, _, err = await _cli("policy", "set", "search-agent", *where, "--min-replicas", "1", "--max-replicas", "6", "--max-uses", "200")
    assert code == 0, err
    code, out, err = await _cli("policy", "show", *where)
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith("search-agent"))
    assert line.split()[:3] == ["search-agent", "1", "6"] and "200" in line.split()
    assert (await stack.roster.policies())["search-agent"].max_uses == 200
    code, out, _ = await _cli("policy", "set", "search-agent", *where, "--remove")
    assert code == 0 and "no policies" in out


async def test_cli_sets_a_deployments_outlier_settings_and_refuses_bad_ones(stack: Stack) -> None:
    address = stack.env.client.service_client.config.target_host
    where = ["--address", address, "--pool", stack.pool, "--task-queue", stack.task_queue]
    code, _, err = await _cli("policy", "set", "workers", *where, "--outliers-base-ejection-s", "60", "--outliers-max-ejection-s", "30")
    assert code == 2 and "max_ejection_s 30 is less than base_ejection_s 60" in err
    code, _, err = await _cli("policy", "set", "workers", *where, "--outliers-consecutive-failures", "0")
    assert code == 2 and "outliers.consecutive_failures" in err
    # A sizing field without max_replicas is refused, naming it.
    code, _, err = await _cli("policy", "set", "workers", *where, "--min-replicas", "2", "--outliers-consecutive-failures", "5")
    assert code == 2 and "min_replicas: sizing needs max_replicas" in err
    assert await stack.roster.policies() == {}
    # Outlier ejection and idle health checks for a deployment that nothing sizes: the same verb.
    code, out, err = await _cli(
        "policy", "set", "workers", *where, "--health-interval-s", "120", "--outliers-consecutive-failures", "5", "--outliers-base-ejection-s", "10"
    )
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith("workers"))
    assert line.split()[2] == "None"  # max_replicas: unsized
    assert line.split()[-1] == "consecutive_failures=5,base_ejection_s=10.0"  # what differs from the defaults
    policy = (await stack.roster.policies())["workers"]
    assert policy.outliers == OutlierPolicy(consecutive_failures=5, base_ejection_s=10)
    assert policy.health_interval_s == 120 and not policy.sizes
    code, out, err = await _cli("policy", "set", "workers", *where, "--max-replicas", "4", "--outliers-consecutive-failures", "5")
    assert code == 0, err
    assert (await stack.roster.policies())["workers"].max_replicas == 4  # now it sizes too
