"""Event-driven liveness: the backend saw an agent's process exit, or its pod go; tell its workflow.

Heartbeats catch hangs and partitions; a crash is seen sooner by whoever runs the
agent. The local backend watches its processes and the Kubernetes backend watches
pods; either calls the listener the worker gave it (`on_agent_gone`), and this one
signals the agent workflow `pod_gone` (a `contracts.PodGone`): it ends Terminated
at once with the backend's reason (`process_exited`, `pod_deleted`, `pod_failed`),
tells its pool and deletes the pod, instead of waiting 3 heartbeat intervals.

An agent workflow that has already ended (a drained agent exits after its run
ended) or never started answers NOT_FOUND: nothing to do. Other errors are retried
a few times with backoff; if the signal still cannot be sent, the heartbeat window
decides, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from temporalio.client import Client
from temporalio.service import RPCError

from agentroster.messages import PodGone
from agentroster.client.transport import is_not_found, signal_current_run
from agentroster.vocabulary.wire import POD_GONE_SIGNAL, agent_workflow_id

logger = logging.getLogger("agentroster.liveness")

# (pool, what the backend saw) -> True when an agent workflow was told.
AgentGoneListener = Callable[[str, PodGone], Awaitable[bool]]


class AgentGoneNotifier:
    """Signals `pod_gone` to `agent/{pool}/{agent_id}`; counts what it did (for tests and metrics)."""

    def __init__(self, client: Client, *, attempts: int = 5, first_backoff_s: float = 0.2) -> None:
        self.client = client
        self.attempts = max(1, attempts)
        self.first_backoff_s = first_backoff_s
        self.told = 0
        self.already_gone = 0
        self.failed = 0

    async def __call__(self, pool: str, gone: PodGone) -> bool:
        handle = self.client.get_workflow_handle(agent_workflow_id(pool, gone.agent_id))
        delay = self.first_backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                await signal_current_run(handle, POD_GONE_SIGNAL, gone)  # (not lost to a continue-as-new moment)
            except RPCError as exc:
                if is_not_found(exc):
                    self.already_gone += 1
                    logger.debug("agent %s of pool %s: no running workflow to tell (%s)", gone.agent_id, pool, gone.reason)
                    return False
                if attempt == self.attempts:
                    self.failed += 1
                    logger.warning(
                        "agent %s of pool %s is gone (%s) but its workflow could not be told: %s; its heartbeat window decides",
                        gone.agent_id, pool, gone.reason, exc,
                    )
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            else:
                self.told += 1
                logger.info("agent %s of pool %s: told its workflow it is gone (%s: %s)", gone.agent_id, pool, gone.reason, gone.detail)
                return True
        return False  # pragma: no cover - the loop returns


__all__ = ["AgentGoneListener", "AgentGoneNotifier"]
