"""The dev server honours the settings `agentroster dev`, the tests and the benchmarks start it with.

A dynamic-config key this server version does not read is ignored without a word (an
earlier try set `history.cacheMaxSize`, which this server's host-level cache never reads):
the server's own metrics say which settings took.
"""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from agentroster.ops.ports import ephemeral_floor
from agentroster.workers.devserver import DEV_SERVER_CACHED_WORKFLOWS, DEV_SERVER_DYNAMIC_CONFIG, temporal_cli_path
from tests.conftest import eventually, free_port


def _mutable_state_cache_size(metrics_port: int) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cache_size" and sample.labels.get("cache_type") == "mutablestate":
                return sample.value
    return None


async def test_the_dev_server_keeps_as_many_workflows_in_memory_as_we_set() -> None:
    metrics_port = free_port()
    env = await WorkflowEnvironment.start_local(
        port=free_port(),
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=[*DEV_SERVER_DYNAMIC_CONFIG, "--metrics-port", str(metrics_port)],
        dev_server_log_level="error",
        data_converter=pydantic_data_converter,
    )
    async with env:
        # The history service reports its cache's size a moment after it has served a workflow.
        await env.client.start_workflow("Nobody", id="cache-probe", task_queue="nobody-polls-this")
        await eventually(lambda: _mutable_state_cache_size(metrics_port) not in (None, 0), timeout=20)
        assert _mutable_state_cache_size(metrics_port) == DEV_SERVER_CACHED_WORKFLOWS


def test_free_ports_lie_below_the_range_a_dev_server_takes_its_own_from() -> None:
    """A dev server's internal services bind ports the kernel picks from its ephemeral range;
    a frontend port from that range could be taken by one of them first (the server then dies
    as it starts). `free_port` answers below that range, with a port nobody holds."""
    low = ephemeral_floor()
    ports = {free_port() for _ in range(50)}
    assert all(1024 <= port < low for port in ports)
    assert len(ports) > 40  # spread out: two harnesses starting together rarely pick the same
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
