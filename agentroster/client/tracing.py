"""Optional OpenTelemetry tracing through `temporalio.contrib.opentelemetry`.

Off by default. With `AGENTROSTER_OTEL=1` (and `pip install 'agentroster[otel]'`),
`AgentRoster.connect` (so the `agentroster` commands and the worker's client)
puts the SDK's `TracingInterceptor` on its client; workers built on that client
inherit it. A task then appears as one trace: the client's start of
`CapabilityTaskWorkflow`, the workflow, its `request_lease` activity (with the
pool update it sends), `invoke_agent` (whose POST carries the W3C `traceparent`
header to the agent) and `release_lease`.

Where spans go is the standard OpenTelemetry configuration: `OTEL_TRACES_EXPORTER`
(`otlp`, the default, over HTTP/protobuf; `console`; `none`), `OTEL_EXPORTER_OTLP_ENDPOINT`
or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`,
`OTEL_SERVICE_NAME` (default `agentroster`), `OTEL_RESOURCE_ATTRIBUTES`. A
process that set its own global tracer provider keeps it.

Workflow spans are created only under a span the caller started (the SDK's
default): the client's `StartWorkflow` span, or a parent workflow's. Long-running
pool and agent workflows started by the worker itself therefore make no spans
of their own; updates and signals sent to them from a traced caller do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from agentroster.errors import AgentRosterError

logger = logging.getLogger("agentroster.client.tracing")

OTEL_VAR = "AGENTROSTER_OTEL"
INSTALL_HINT = "pip install 'agentroster[otel]'"
DEFAULT_SERVICE_NAME = "agentroster"

_provider: Any = None  # the tracer provider this module installed, flushed by shutdown_tracing()


def tracing_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether AGENTROSTER_OTEL asks for tracing (1/true/yes/on)."""
    from agentroster.client.settings import flag_from_env

    return flag_from_env(os.environ if env is None else env, OTEL_VAR)


def tracing_interceptor(tracer: Any = None) -> Any:
    """A `TracingInterceptor` for a client (workers built on the client get it too).

    `tracer` defaults to the global tracer provider's. Raises AgentRosterError
    when OpenTelemetry is not installed.
    """
    try:
        from temporalio.contrib.opentelemetry import TracingInterceptor
    except ImportError as exc:
        raise AgentRosterError(f"{OTEL_VAR} is on but OpenTelemetry is not installed: {INSTALL_HINT}") from exc
    return TracingInterceptor(tracer)


def configure_tracing(env: Mapping[str, str] | None = None) -> Any:
    """Install a global tracer provider from the OTEL_* variables, unless the process has one. Idempotent.

    Returns the provider in use.
    """
    global _provider
    env = os.environ if env is None else env
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        raise AgentRosterError(f"{OTEL_VAR} is on but OpenTelemetry is not installed: {INSTALL_HINT}") from exc
    current = trace.get_tracer_provider()
    if _provider is not None or isinstance(current, TracerProvider):
        return current  # ours, or one the application set up
    exporter_name = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME})
    provider = TracerProvider(resource=resource)
    if exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise AgentRosterError(f"OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: {INSTALL_HINT}") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint, headers: OTEL_EXPORTER_OTLP_*
    elif exporter_name == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter_name != "none":
        raise AgentRosterError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: agentroster supports otlp, console or none")
    trace.set_tracer_provider(provider)
    _provider = provider
    logger.info("tracing: spans exported with %s (service %s)", exporter_name, resource.attributes.get("service.name"))
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the tracer provider this module installed (the commands call it before they exit)."""
    global _provider
    if _provider is not None:
        try:
            _provider.shutdown()
        except Exception as exc:  # an exporter that cannot reach its collector must not fail the command
            logger.warning("tracing: flushing spans failed: %s", exc)
        _provider = None


def client_interceptors(env: Mapping[str, str] | None = None) -> list[Any]:
    """The interceptors `AgentRoster.connect` adds: the tracing one when AGENTROSTER_OTEL is on, else none."""
    if not tracing_enabled(env):
        return []
    configure_tracing(env)
    return [tracing_interceptor()]


def inject_trace_context(headers: dict[str, str]) -> dict[str, str]:
    """`headers` with the current span's W3C trace context (traceparent), when there is one."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return headers
    propagate.inject(headers)
    return headers


__all__ = [
    "client_interceptors",
    "configure_tracing",
    "inject_trace_context",
    "shutdown_tracing",
    "tracing_enabled",
    "tracing_interceptor",
]
