"""The worker's Prometheus endpoint, scraped over HTTP and parsed with the Prometheus text parser.

A real dev server and worker: agents registered, leases taken, a caller
queued, an agent lost and one drained; the scrape must say what the pool's
`status` query says.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentroster.client.roster import AgentRoster
from agentroster.errors import PoolExhaustedError
from agentroster.models import PoolPolicy, PoolStatus
from agentroster.ops.metrics_exporter import OTHER_CAPABILITY, eviction_state
from agentroster.ops.ports import free_port
from tests.conftest import TEST_LEASE_KEY, eventually, make_registration
from tests.test_deploy_observability import dashboard_names

REPO = Path(__file__).resolve().parents[1]


class Scrape:
    """One parsed scrape: samples by name, with helpers to pick and sum them."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[str, list[Any]] = defaultdict(list)
        for family in self.families.values():
            for sample in family.samples:
                self.samples[sample.name].append(sample)

    def values(self, name: str, **labels: str) -> list[float]:
        return [s.value for s in self.samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        found = self.values(name, **labels)
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
        return found[0]

    def total(self, name: str, **labels: str) -> float:
        return sum(self.values(name, **labels))


async def scrape(url: str) -> Scrape:
    async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return Scrape(await response.text())


def assert_matches(s: Scrape, pool: str, status: PoolStatus) -> None:
    """Every pool figure in the scrape equals the pool's own status."""
    assert s.value("agentroster_pool_up", pool=pool) == 1
    assert s.total("agentroster_leases_active", pool=pool) == status.active_leases
    assert s.total("agentroster_waiters", pool=pool) == status.waiting
    for state in ("Ready", "Busy", "Draining"):
        assert s.value("agentroster_pool_agents", pool=pool, state=state.lower()) == sum(1 for a in status.agents if a.state.value == state)
    for metric, field in [
        ("agentroster_leases_granted_total", "leases_granted"),
        ("agentroster_leases_released_total", "leases_released"),
        ("agentroster_leases_expired_total", "leases_expired"),
        ("agentroster_leases_revoked_total", "leases_revoked"),
        ("agentroster_leases_renewed_total", "leases_renewed"),
        ("agentroster_pool_exhausted_total", "exhausted"),
    ]:
        assert s.total(metric, pool=pool) == getattr(status, field), metric
    assert s.value("agentroster_agents_terminated_total", pool=pool, cause="lost") == status.agents_lost
    assert s.value("agentroster_agents_terminated_total", pool=pool, cause="drained") == status.agents_drained
    for name, cap in status.capabilities.items():
        assert s.value("agentroster_slots", pool=pool, capability=name) == cap.slots
        assert s.value("agentroster_slots_available", pool=pool, capability=name) == cap.idle_slots
        assert s.value("agentroster_waiters", pool=pool, capability=name) == cap.waiting
        assert s.value("agentroster_leases_active", pool=pool, capability=name) == cap.in_flight
        for state, count in cap.agents.items():
            assert s.value("agentroster_agents", pool=pool, capability=name, state=state.lower()) == count


async def test_the_endpoint_reports_what_the_pool_status_says(stack) -> None:  # noqa: ANN001
    # The fixture's worker, again with an endpoint on a free port. No pool is
    # configured: the exporter finds this test's pool by a visibility query on its task queue.
    await stack.stop_worker()
    await stack.start_worker(metrics_port=0, metrics_options={"host": "127.0.0.1", "max_age_s": 0, "discover_every_s": 0})
    exporter = stack.worker.metrics
    await exporter.start()
    roster: AgentRoster = stack.roster
    pool = stack.pool

    await roster.register(make_registration("search-a", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=60))
    await roster.register(
        make_registration("search-b", [("rag.search", "2.2.0", 1, "A"), ("math.eval", "1.0.0", 1, "A")], deployment="mixed", heartbeat_interval_s=60)
    )
    await roster.set_policy("mixed", PoolPolicy(min_replicas=1, max_replicas=3, health_interval_s=3600))
    leases = [await roster.acquire("rag.search@^2", timeout=5) for _ in range(3)]  # every rag.search slot
    await roster.renew(leases[0], 120)
    with pytest.raises(PoolExhaustedError):
        await roster.acquire("rag.search", timeout=0)  # nothing free: exhausted at once
    with pytest.raises(PoolExhaustedError):
        await roster.acquire("never.offered", timeout=0)  # unknown: counted for the pool, not a capability
    waiter = asyncio.create_task(roster.acquire("rag.search", timeout=60))
    await eventually(lambda: _status(roster, lambda s: s.waiting == 1), timeout=20)

    s = await eventually(lambda: _scrape_with(exporter.url, pool), timeout=20)
    status = await roster.status()
    assert status.waiting == 1 and status.active_leases == 3
    assert_matches(s, pool, status)
    assert s.value("agentroster_slots", pool=pool, capability="rag.search") == 3
    assert s.value("agentroster_slots_available", pool=pool, capability="rag.search") == 0
    assert s.value("agentroster_utilization_ratio", pool=pool, capability="rag.search") == 1.0
    assert s.value("agentroster_waiters", pool=pool, capability="rag.search") == 1
    assert s.value("agentroster_leases_renewed_total", pool=pool, capability="rag.search") == 1
    assert s.value("agentroster_pool_exhausted_total", pool=pool, capability="rag.search") == 1
    assert s.value("agentroster_pool_exhausted_total", pool=pool, capability=OTHER_CAPABILITY) == 1  # never.offered
    assert s.value("agentroster_acquires_queued_total", pool=pool, capability="rag.search") >= 1
    assert s.value("agentroster_breaker_state", pool=pool, capability="rag.search", state="closed") == 1
    assert s.value("agentroster_policy_replicas", pool=pool, deployment="mixed", bound="max") == 3
    assert s.value("agentroster_pool_self_preservation", pool=pool) == 0
    assert s.value("agentroster_deployment_agents", pool=pool, deployment="search-agent") == 1
    # The client's own histogram (this process): one exhausted acquire of rag.search in this pool.
    assert s.value("agentroster_acquire_wait_seconds_count", pool=pool, capability="rag.search", outcome="exhausted") == 1
    assert s.value("agentroster_acquire_wait_seconds_count", pool=pool, capability="rag.search", outcome="granted") == 3

    # A release serves the waiter; an agent that stops heartbeating is lost; one drains.
    await roster.release(leases[1])
    leases.append(await waiter)
    for lease in leases:
        await roster.release(lease)
    await roster.register(make_registration("ghost", [("ghost.work", "1.0.0", 1, "C")], deployment="ghosts", heartbeat_interval_s=1))
    await roster.register(make_registration("leaver", [("math.eval", "1.0.0", 1, "B")], deployment="leavers", heartbeat_interval_s=60))
    await roster.drain("leaver", reason="test")
    await eventually(lambda: _status(roster, lambda s: s.agents_lost == 1 and s.agents_drained == 1 and s.active_leases == 0), timeout=30)
    s = await scrape(exporter.url)
    status = await roster.status()
    assert_matches(s, pool, status)
    assert s.total("agentroster_leases_granted_total", pool=pool) == 4
    assert s.total("agentroster_leases_released_total", pool=pool) == 4
    assert s.value("agentroster_agents_terminated_total", pool=pool, cause="lost") == 1
    assert s.value("agentroster_agents_terminated_total", pool=pool, cause="drained") == 1
    assert s.value("agentroster_slots_available", pool=pool, capability="rag.search") == 3
    uses = {row.agent_id: row.uses for row in status.agents}
    assert uses["search-a"] + uses["search-b"] == 4
    assert s.value("agentroster_agent_uses_max", pool=pool, deployment="search-agent") == uses["search-a"]
    assert s.value("agentroster_agent_uses_mean", pool=pool, deployment="mixed") == uses["search-b"]

    # A pool that does not answer is reported down, not with stale figures.
    exporter.pools.append("no-such-pool")
    s = await scrape(exporter.url)
    assert s.value("agentroster_pool_up", pool="no-such-pool") == 0
    assert s.values("agentroster_leases_active", pool="no-such-pool") == []


async def _status(roster: AgentRoster, check: Any) -> PoolStatus | None:
    status = await roster.status()
    return status if check(status) else None


async def _scrape_with(url: str, pool: str) -> Scrape | None:
    s = await scrape(url)
    return s if s.values("agentroster_pool_up", pool=pool) == [1.0] else None


def test_pool_metrics_without_a_status_field_for_eviction_safety() -> None:
    # A pool of a version without eviction safety has no such field: never on, nothing held.
    plain = PoolStatus(pool="p")
    assert eviction_state(plain) == (False, 0)
    # Read defensively from a status that carries it.
    reporting = SimpleNamespace(eviction=SimpleNamespace(self_preservation=True, silent=["a", "b"]), agents=[])
    assert eviction_state(reporting) == (True, 2)  # type: ignore[arg-type]


async def test_the_worker_command_serves_metrics_with_the_sdk_metrics_bridged(stack) -> None:  # noqa: ANN001
    """`agentroster worker` with AGENTROSTER_METRICS_PORT: pool metrics and the Temporal SDK's `temporal_*` on one endpoint.

    Its AGENTROSTER_WORKFLOW_CACHE (2 here: the pool and two agents do not fit) reaches the SDK's sticky cache.
    """
    port = free_port()
    suffix = uuid.uuid4().hex[:8]
    pool, task_queue = f"cli-{suffix}", f"cli-tq-{suffix}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_", "TEMPORAL_"))}
    env.update(
        TEMPORAL_ADDRESS=stack.env.client.service_client.config.target_host,
        AGENTROSTER_POOL=pool,
        AGENTROSTER_TASK_QUEUE=task_queue,
        AGENTROSTER_LEASE_KEY=TEST_LEASE_KEY,
        AGENTROSTER_METRICS_PORT=str(port),
        AGENTROSTER_WORKFLOW_CACHE="2",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "agentroster.workers.cli", "worker", env=env, cwd=str(REPO))
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        roster = AgentRoster(stack.env.client, pool=pool, task_queue=task_queue)
        await roster.register(make_registration("cli-agent", [("rag.search", "2.1.0", 2, "B")], heartbeat_interval_s=60), timeout=60)
        await roster.register(make_registration("cli-agent-2", [("other.cap", "1.0.0", 1, "B")], heartbeat_interval_s=60), timeout=60)
        lease = await roster.acquire("rag.search", timeout=10)

        async def scraped() -> Scrape | None:
            assert proc.returncode is None, f"the worker exited with {proc.returncode}"
            try:
                s = await scrape(url)
            except aiohttp.ClientError:
                return None
            ready = s.values("agentroster_leases_active", pool=pool, capability="rag.search") == [1.0]
            return s if ready and any(name.startswith("temporal_") for name in s.samples) else None

        s = await eventually(scraped, timeout=60, interval=0.5)
        assert_matches(s, pool, await roster.status())
        # The SDK's own metrics, appended: its workers' task slots and workflow task latencies,
        # and every one the Grafana dashboard queries.
        assert s.values("temporal_worker_task_slots_available", task_queue=task_queue)
        sdk_names = {n for n in dashboard_names() if n.startswith("temporal_")}
        assert sdk_names and sdk_names <= set(s.samples), sorted(sdk_names - set(s.samples))
        # Three workflows ran on a cache of two: never more than two cached, some evicted to make room.
        assert 0 < max(s.values("temporal_sticky_cache_size")) <= 2, s.values("temporal_sticky_cache_size")
        assert sum(s.values("temporal_sticky_cache_total_forced_eviction_total")) > 0
        # How long the worker's garbage collections stopped it, per generation: young ones have run by now.
        assert s.values("agentroster_worker_gc_pause_seconds_count", generation="0")[0] > 0
        assert s.values("agentroster_worker_gc_pause_seconds_bucket", generation="2", le="+Inf")
        # What the worker keeps out of full collections (ops.heap; its first round comes a minute in).
        assert len(s.values("agentroster_worker_gc_frozen_objects")) == 1
        assert len(s.values("agentroster_worker_gc_sweeps_total")) == 1
        await roster.release(lease)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=30)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


def _core_with_agent() -> Any:
    import itertools

    from agentroster.messages import AgentSnapshot, CapabilityDigest
    from agentroster.models import AgentState
    from agentroster.core.pool import PoolCore

    ids = itertools.count()
    new_id = lambda: f"id-{next(ids)}"  # noqa: E731
    core = PoolCore("p")
    core.verify_new_agents = False
    for agent_id, deployment in (("a1", "d1"), ("a2", "d2")):
        core.agent_snapshot(
            AgentSnapshot(agent_id=agent_id, deployment=deployment, endpoint="http://127.0.0.1:9", state=AgentState.READY,
                          capabilities=[CapabilityDigest(name="rag.search", version="2.0.0", max_concurrency=1)]),
            0.0, new_id,
        )
    return core, new_id


def test_the_pool_counts_per_capability_and_carries_the_counts_across_continue_as_new() -> None:
    from agentroster.messages import AcquireRequest, RenewRequest
    from agentroster.core.pool import PoolCore
    from agentroster.core.state_codec import decode_state, encode_state

    core, new_id = _core_with_agent()
    first = core.acquire(AcquireRequest(ref="rag.search", request_id="r" * 16), 1.0, new_id).lease
    second = core.acquire(AcquireRequest(ref="rag.search", request_id="s" * 16), 1.0, new_id).lease
    assert first and second
    core.renew(RenewRequest(lease_id=first.lease_id, ttl_s=60), 2.0)
    core.release(first.lease_id, 3.0, new_id)
    core.acquire(AcquireRequest(ref="nobody.offers", request_id="u" * 16), 3.0, new_id)  # unknown: the pool's count only
    caps = core.status().capabilities
    assert caps["rag.search"].counters == {"granted": 2, "released": 1, "renewed": 1}
    assert caps["rag.search"].slots == 2 and caps["rag.search"].idle_slots == 1 and caps["rag.search"].in_flight == 1
    assert "nobody.offers" not in caps and core.status().exhausted == 1

    restored = PoolCore.from_state(decode_state(encode_state(core.to_state())))
    assert restored.status().capabilities == core.status().capabilities
    # An agent lost takes its lease with it (revoked); one that drained counts apart.
    restored.agent_gone(second.agent_id, "heartbeat_lost", 4.0, new_id)
    other = "a2" if second.agent_id == "a1" else "a1"
    restored.agent_gone(other, "drain", 4.0, new_id)
    restored.agent_gone(other, "its workflow is gone", 4.0, new_id)  # gone already: not counted twice
    status = restored.status()
    assert (status.agents_lost, status.agents_drained) == (1, 1)
    assert status.capabilities["rag.search"].counters["revoked"] == 1
    assert status.capabilities["rag.search"].slots == 0


def test_gc_pauses_count_each_collection_in_its_generation_and_bucket() -> None:
    """`agentroster_worker_gc_pause_seconds`: what the collector callback measured, as a Prometheus histogram."""
    import gc

    from prometheus_client import CollectorRegistry, generate_latest

    from agentroster.ops.metrics_exporter import GcPauses, gc_pauses

    pauses = GcPauses()
    pauses("start", {"generation": 2})
    pauses("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    for generation, seconds in ((0, 0.002), (1, 0.07), (2, 3.0)):  # fed directly: no timing of this machine
        pauses._started = time.perf_counter() - seconds
        pauses("stop", {"generation": generation})
    registry = CollectorRegistry()
    registry.register(pauses)
    text = generate_latest(registry).decode()
    assert 'agentroster_worker_gc_pause_seconds_count{generation="2"} 2.0' in text
    assert 'agentroster_worker_gc_pause_seconds_bucket{generation="2",le="2.0"} 1.0' in text  # the 3 s one is above 2 s
    assert 'agentroster_worker_gc_pause_seconds_bucket{generation="2",le="5.0"} 2.0' in text
    assert 'agentroster_worker_gc_pause_seconds_bucket{generation="1",le="0.05"} 0.0' in text
    assert 'agentroster_worker_gc_pause_seconds_bucket{generation="1",le="0.1"} 1.0' in text
    assert 'agentroster_worker_gc_pause_seconds_count{generation="0"} 1.0' in text
    # The process's one instance is in gc.callbacks once, however many exporters ask for it.
    assert gc_pauses() is gc_pauses() and gc.callbacks.count(gc_pauses()) == 1
    before = gc_pauses()._counts[2][:]
    gc.collect()
    assert sum(gc_pauses()._counts[2]) == sum(before) + 1


def test_metrics_settings() -> None:
    from agentroster.errors import AgentRosterError
    from agentroster.client.settings import Settings

    assert Settings.from_env({}).metrics_port is None
    assert Settings.from_env({"AGENTROSTER_METRICS_PORT": "on"}).metrics_port == 9464
    assert Settings.from_env({"AGENTROSTER_METRICS_PORT": "9999"}).metrics_port == 9999
    assert Settings.from_env({"AGENTROSTER_METRICS_PORT": "off"}).metrics_port is None
    assert Settings.from_env({"AGENTROSTER_METRICS_POOLS": "a, b"}).metrics_pools == ("a", "b")
    assert Settings.from_env({}).sdk_metrics == "bridge"
    assert Settings.from_env({"AGENTROSTER_SDK_METRICS": "0.0.0.0:9465"}).sdk_metrics == "0.0.0.0:9465"
    for bad in ({"AGENTROSTER_METRICS_PORT": "70000"}, {"AGENTROSTER_METRICS_POOLS": "a/b"},
                {"AGENTROSTER_SDK_METRICS": "somewhere"}, {"AGENTROSTER_OTEL": "maybe"}):
        with pytest.raises(AgentRosterError):
            Settings.from_env(bad)
