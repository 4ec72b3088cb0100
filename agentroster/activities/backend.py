"""The backend interface: where agents physically run, and the activities over it.

A backend carries out the two side effects the workflows decide on: setting a
deployment's replica count and deleting one agent's pod (or process). The
`none` backend does nothing but log, for setups where something else (a human,
an HPA) owns the replicas. `local` and `kubernetes` live in their own modules.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from agentroster.messages import PodRef, ScaleDone, ScaleRequest
from agentroster.vocabulary.metrics import POD_DELETIONS, SCALE_REPLICAS, SCALE_REQUESTS, pool_of_workflow
from agentroster.vocabulary.wire import BACKEND_ATTEMPTS, BACKEND_RETRY, DELETE_POD, SCALE_DEPLOYMENT

logger = logging.getLogger("agentroster.backend")


@runtime_checkable
class Backend(Protocol):
    """Where agents run. Every method must be idempotent: activities retry."""

    name: str

    async def scale(self, deployment: str, replicas: int) -> None:
        """Set `deployment`'s desired replica count."""

    async def delete_pod(self, deployment: str, agent_id: str) -> None:
        """Delete the pod (or process) of `agent_id`; one already gone is success."""

    async def mark_for_removal(self, deployment: str, agent_id: str) -> None:
        """Prefer this pod when the deployment next scales down."""

    # Optional: `async def current_replicas(self, deployment) -> int`, used so a
    # demand-driven scale-up never lowers a deployment's count.
    # Optional: `async def scale_to_zero(self, deployment)`, for a pool that shuts
    # down, where `scale` keeps a minimum of the backend's own (local: the fleet's `min`).
    # Optional: `async def start()` / `async def stop()`, run by the worker.
    # Optional: `def on_agent_gone(listener)`: the worker passes a listener
    # (`agentroster.activities.liveness.AgentGoneListener`: `await listener(pool, PodGone)`)
    # to call the moment an agent's process exits or its pod goes; its workflow then
    # ends at once (`pod_gone`) instead of after 3 missed heartbeats.


class NoneBackend:
    """Changes nothing: logs what it was asked, for clusters scaled by others."""

    name = "none"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []

    async def scale(self, deployment: str, replicas: int) -> None:
        self.calls.append(("scale", deployment, replicas))
        logger.info("backend none: would scale %s to %d replicas", deployment, replicas)

    async def delete_pod(self, deployment: str, agent_id: str) -> None:
        self.calls.append(("delete_pod", deployment, agent_id))
        logger.info("backend none: would delete pod %s of %s", agent_id, deployment)

    async def mark_for_removal(self, deployment: str, agent_id: str) -> None:
        self.calls.append(("mark_for_removal", deployment, agent_id))


class BackendActivities:
    """Activities that carry out scaling decisions on a backend.

    `report(kind, result)` tells the pool workflow that started an activity what came of it
    (the pool's `report` update; `RosterActivities.report`): the pool never waits for these."""

    def __init__(self, backend: Backend, report: Callable[[str, Any], Awaitable[None]] | None = None) -> None:
        self.backend = backend
        self._report = report

    @activity.defn(name=SCALE_DEPLOYMENT)
    async def scale_deployment(self, request: ScaleRequest) -> None:
        """Set a deployment's replicas (retried by the caller's retry policy), then report it to the pool.

        A scale-down's `victims` have their pods marked to go first, before the count is
        lowered. A demand-driven request (`at_least`) never lowers the count: replicas
        still booting are not yet registered, and must not be scaled away.
        Counted in agentroster_scale_requests_total by outcome.
        """
        error: str | None = None
        try:
            await self._scale(request)
        except Exception as exc:
            if activity.info().attempt < BACKEND_ATTEMPTS and not _final(exc):
                raise
            error = f"{type(exc).__name__}: {exc}"[:1024]  # the last attempt's word reaches the pool
        if self._report is not None:
            await self._report("scaled", ScaleDone(request=request, error=error).model_dump(mode="json"))
        if error is not None:
            raise ApplicationError(error, non_retryable=True)

    async def _scale(self, request: ScaleRequest) -> None:
        for victim in request.victims:
            await self.backend.mark_for_removal(request.deployment, victim)
        pool = _pool()
        SCALE_REPLICAS.labels(pool, request.deployment).set(request.replicas)
        try:
            if request.at_least:
                current_replicas = getattr(self.backend, "current_replicas", None)
                if current_replicas is not None:
                    current = await current_replicas(request.deployment)
                    if current >= request.replicas:
                        logger.info(
                            "scale %s: already %d replica(s) >= %d asked (%s)", request.deployment, current, request.replicas, request.reason
                        )
                        SCALE_REQUESTS.labels(pool, request.deployment, "skipped").inc()
                        return
            to_zero = getattr(self.backend, "scale_to_zero", None) if request.shutdown else None
            if to_zero is not None:
                # The pool shuts down: zero, even where the backend keeps a minimum of its own (a fleet's `min`).
                await to_zero(request.deployment)
            else:
                await self.backend.scale(request.deployment, request.replicas)
        except Exception:
            SCALE_REQUESTS.labels(pool, request.deployment, "failed").inc()
            raise
        SCALE_REQUESTS.labels(pool, request.deployment, "done").inc()

    @activity.defn(name=DELETE_POD)
    async def delete_pod(self, pod: PodRef) -> None:
        """Delete one agent's pod; a pod already gone counts as done."""
        try:
            await self.backend.delete_pod(pod.deployment, pod.agent_id)
        except Exception:
            POD_DELETIONS.labels(_pool(), pod.deployment, "failed").inc()
            raise
        POD_DELETIONS.labels(_pool(), pod.deployment, "done").inc()


def _final(exc: Exception) -> bool:
    """Whether Temporal would not retry `exc` (BACKEND_RETRY's non-retryable types)."""
    if isinstance(exc, ApplicationError):
        return exc.non_retryable or (exc.type or "") in BACKEND_RETRY.non_retryable_error_types
    return type(exc).__name__ in BACKEND_RETRY.non_retryable_error_types


def _pool() -> str:
    """The pool whose workflow runs this activity (the metrics' `pool` label)."""
    try:
        return pool_of_workflow(activity.info().workflow_id or "")
    except RuntimeError:  # called outside an activity (tests)
        return ""


def make_backend(kind: str, **options: object) -> Backend:
    """Build the backend named `kind` (`none`, `local`, `kubernetes`)."""
    if kind == "none":
        return NoneBackend()
    if kind == "local":
        from agentroster.activities.local_backend import LocalBackend

        return LocalBackend(**options)  # type: ignore[arg-type]
    if kind == "kubernetes":
        try:
            from agentroster.activities.kubernetes_backend import KubernetesBackend
        except ModuleNotFoundError as exc:
            if exc.name != "kubernetes":
                raise
            raise ModuleNotFoundError(
                "AGENTROSTER_BACKEND=kubernetes needs the Kubernetes client: pip install 'agentroster[worker]'", name="kubernetes"
            ) from exc

        return KubernetesBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"AGENTROSTER_BACKEND={kind!r} is not one of: none, local, kubernetes")
