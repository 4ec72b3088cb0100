"""OpenTelemetry tracing: a CapabilityTaskWorkflow run is one trace (acquire -> invoke -> release).

Spans go to an in-memory exporter through a tracer handed to the SDK's
TracingInterceptor, so the test changes no global tracer provider.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from aiohttp import web

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from temporalio.client import Client  # noqa: E402

from agentroster.activities.backend import NoneBackend  # noqa: E402
from agentroster.client.roster import AgentRoster  # noqa: E402
from agentroster.models import AgentRegistration, Capability, TaskInput, TaskResult  # noqa: E402
from agentroster.client.tracing import (
    client_interceptors,
    inject_trace_context,
    tracing_enabled,
    tracing_interceptor,
)  # noqa: E402
from agentroster.vocabulary.wire import LEASE_AND_INVOKE  # noqa: E402
from tests.conftest import eventually  # noqa: E402
from agentroster.workers.worker import create_worker  # noqa: E402


class TracedAgent:
    """An agent endpoint that answers math and remembers the trace context it was sent."""

    def __init__(self) -> None:
        self.traceparents: list[str | None] = []
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/tasks/{capability}", self._task)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def _task(self, request: web.Request) -> web.Response:
        self.traceparents.append(request.headers.get("traceparent"))
        body = await request.json()
        return web.json_response({"output": {"value": sum(int(x) for x in body["input"]["expression"].split("+"))}})


async def test_a_task_workflow_run_is_one_trace(stack) -> None:  # noqa: ANN001
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # A client like AgentRoster.connect makes with AGENTROSTER_OTEL=1, on the test server's connection;
    # the worker built on it inherits the interceptor.
    traced = Client(**{**stack.env.client.config(), "interceptors": [tracing_interceptor(provider.get_tracer("agentroster-test"))]})
    await stack.stop_worker()
    agent = TracedAgent()
    endpoint = await agent.start()
    try:
        async with create_worker(traced, task_queue=stack.task_queue, backend=NoneBackend()):
            roster = AgentRoster(traced, pool=stack.pool, task_queue=stack.task_queue)
            await roster.register(
                AgentRegistration(
                    agent_id="traced-math",
                    deployment="math-agent",
                    endpoint=endpoint,
                    heartbeat_interval_s=60,
                    capabilities=[Capability(name="math.eval", version="1.0.0", max_concurrency=2,
                                             input_schema={"type": "object"}, output_schema={"type": "object"})],
                )
            )
            exporter.clear()
            result: TaskResult = await traced.execute_workflow(
                "CapabilityTaskWorkflow",
                TaskInput(ref="math.eval@>=1", payload={"expression": "2+3"}, pool=stack.pool, acquire_timeout_s=10),
                id=f"traced-task-{uuid.uuid4().hex[:8]}",
                task_queue=stack.task_queue,
                result_type=TaskResult,
            )
            assert result.output == {"value": 5}

            async def released() -> bool:  # the activity's release lands just after it completed
                return (await roster.status()).leases_released == 1

            await eventually(released)
    finally:
        await agent.stop()
    provider.force_flush()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    start = by_name["StartWorkflow:CapabilityTaskWorkflow"][0]
    trace_id = start.context.trace_id
    # One activity per attempt: lease_and_invoke asks the pool (its `acquire` update), posts
    # the task and sends the `release` update itself.
    expected = [
        "RunWorkflow:CapabilityTaskWorkflow",
        f"StartActivity:{LEASE_AND_INVOKE}",
        f"RunActivity:{LEASE_AND_INVOKE}",
        "StartWorkflowUpdate:acquire",  # the activity's update to the pool
        "StartWorkflowUpdate:release",  # its release to the pool
        "CompleteWorkflow:CapabilityTaskWorkflow",
    ]
    for name in expected:
        assert name in by_name, f"no {name} span; got {sorted(by_name)}"
        assert any(s.context.trace_id == trace_id for s in by_name[name]), f"{name} is in another trace"
    # The spans hang together: each has a parent in the trace, up to the client's start.
    ids = {s.context.span_id for s in spans if s.context.trace_id == trace_id}
    for span in spans:
        if span.context.trace_id == trace_id and span is not start:
            assert span.parent is not None and span.parent.span_id in ids, span.name
    # Acquire before invoke before release, in time.
    first = {name: min(s.start_time for s in by_name[name]) for name in expected}
    assert first[f"RunActivity:{LEASE_AND_INVOKE}"] <= first["StartWorkflowUpdate:acquire"] <= first["StartWorkflowUpdate:release"]
    # The agent got the trace context with the task (W3C traceparent: version-traceid-spanid-flags).
    assert agent.traceparents and agent.traceparents[0] is not None
    assert agent.traceparents[0].split("-")[1] == format(trace_id, "032x")


def test_tracing_is_off_by_default() -> None:
    assert not tracing_enabled({})
    assert client_interceptors({}) == []
    assert tracing_enabled({"AGENTROSTER_OTEL": "1"})
    assert inject_trace_context({"a": "b"}) == {"a": "b"}  # no span: nothing added


async def test_agentroster_otel_traces_the_clients_connect_makes(stack) -> None:  # noqa: ANN001
    """AGENTROSTER_OTEL=1 with the standard OTEL_* variables: AgentRoster.connect's client traces (console exporter here)."""
    import asyncio
    import os
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    script = (
        "import asyncio\n"
        "from agentroster.client.roster import AgentRoster\n"
        "from agentroster.client.tracing import shutdown_tracing\n"
        "async def main():\n"
        f"    await AgentRoster.connect(pool='otel-{uuid.uuid4().hex[:8]}', task_queue='otel-unpolled')\n"
        "asyncio.run(main())\n"
        "shutdown_tracing()\n"
        "import os, sys; sys.stdout.flush(); os._exit(0)  # no interpreter teardown (temporalio/sdk-python#300)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTROSTER_", "TEMPORAL_", "OTEL_"))}
    env.update(
        TEMPORAL_ADDRESS=stack.env.client.service_client.config.target_host,
        AGENTROSTER_OTEL="1",
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="otel-test",
        PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env, cwd=str(repo), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()
    assert '"name": "StartWorkflow:PoolWorkflow"' in out.decode(), out.decode()[-2000:]
    assert '"service.name": "otel-test"' in out.decode()
