"""The dev server honours the settings `agentroster dev`, the tests and the benchmarks start it with.

A dynamic-config key this server version does not read is ignored without a word (an
earlier try set `history.cacheMaxSize`, which this server's host-level cache never reads):
the server's own metrics say which settings took.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

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
