"""Readable logs while the Temporal server is away: one line when contact is lost, one when it is back.

An agent heartbeats every few seconds and its client retries every gRPC call,
so an outage of the server used to fill the agent's log with a warning per
heartbeat and an SDK retry warning per attempt. Two pieces keep it to one
line per outage:

- `Outage`, a failure streak: the first failure logs a warning (and a change
  of cause, e.g. from "no answer" to "refused"), later ones log at DEBUG (with
  a reminder every `remind_every_s`, 10 minutes by default), and the first
  success logs how long it lasted and how many attempts failed.
- `quiet_core_runtime()`, a temporalio Runtime whose Rust core logs go through
  Python logging (logger `temporalio.core`, in the process's own format) minus
  the client's per-attempt retry warnings (`temporalio_client::retry`), which
  are counted instead (`core_retry_warnings()`); everything else the core says
  still comes through.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

CORE_LOGGER = "temporalio.core"
RETRY_TARGET = "temporalio_client::retry"
REMIND_EVERY_S = 600.0

_runtime_lock = threading.Lock()
_runtime: object | None = None
_dropped = 0


class _DropRetryWarnings(logging.Filter):
    """Drops the Rust client's "gRPC call ... retried N times" warnings (an outage is logged once by `Outage`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        global _dropped
        entry = getattr(record, "temporal_log", None)
        target = getattr(entry, "target", "") or ""
        if target.startswith(RETRY_TARGET):
            _dropped += 1
            return False
        return True


def core_retry_warnings() -> int:
    """How many of the SDK's retry warnings were kept out of the log by the quiet runtime."""
    return _dropped


def quiet_core_runtime() -> object:
    """A temporalio Runtime (one per process, made on first use) with the quiet logging above.

    Pass it as `runtime=` to `Client.connect` (or `AgentRoster.connect`).
    """
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

            core = logging.getLogger(CORE_LOGGER)
            if not any(isinstance(f, _DropRetryWarnings) for f in core.filters):
                core.addFilter(_DropRetryWarnings())
            _runtime = Runtime(
                telemetry=TelemetryConfig(
                    logging=LoggingConfig(
                        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
                        forwarding=LogForwardingConfig(logger=core, append_target_to_name=False),
                    )
                )
            )
        return _runtime


class Outage:
    """A streak of failures to reach the server, logged as one line when it begins and one when it ends."""

    def __init__(
        self,
        logger: logging.Logger,
        who: str,
        *,
        remind_every_s: float = REMIND_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.who = who
        self.remind_every_s = remind_every_s
        self._clock = clock
        self.since: float | None = None
        self.failures = 0
        self.outages = 0
        self._reminded_at = 0.0
        self._kind: str | None = None

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, what: str, exc: BaseException, *, retry: str = "retrying quietly") -> None:
        """Record a failed call (`what`: "heartbeat", "registration", ...)."""
        now = self._clock()
        kind = "unreachable" if is_unreachable(exc) else type(exc).__name__
        reason = _short(f"{type(exc).__name__}: {exc}".strip().rstrip(":"))
        self.failures += 1
        if self.since is None or kind != self._kind:
            if self.since is None:
                self.since = now
                self.outages += 1
            self._kind = kind
            self._reminded_at = now
            cause = "cannot reach the Temporal server" if kind == "unreachable" else "refused"
            self.logger.warning(
                "%s: %s failed, %s (%s); %s, one line when it goes through again", self.who, what, cause, reason, retry
            )
        elif now - self._reminded_at >= self.remind_every_s:
            self._reminded_at = now
            self.logger.warning(
                "%s: still failing after %s (%d attempt(s)); last: %s (%s)", self.who, _duration(now - self.since), self.failures, what, reason
            )
        else:
            self.logger.debug("%s: %s failed again (%s)", self.who, what, reason)

    def ok(self, what: str) -> None:
        """Record a call that went through: ends the streak (and says so) if there was one."""
        if self.since is None:
            return
        lasted = self._clock() - self.since
        self.logger.warning(
            "%s: %s went through again after %s; %d attempt(s) failed meanwhile",
            self.who,
            what,
            _duration(lasted),
            self.failures,
        )
        self.since = None
        self._kind = None
        self.failures = 0


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the server did not answer (rather than answered no)."""
    if isinstance(exc, (TimeoutError, ConnectionError, OSError)):
        return True
    try:
        from temporalio.service import RPCError, RPCStatusCode
    except ImportError:  # pragma: no cover
        return False
    if isinstance(exc, RPCError):
        return exc.status in (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED) or "timeout" in exc.message.lower()
    # Client.connect raises RuntimeError("Failed client connect: ...") when nothing answers.
    return isinstance(exc, RuntimeError) and "connect" in str(exc).lower()


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


__all__ = ["Outage", "core_retry_warnings", "is_unreachable", "quiet_core_runtime"]
