"""The Kubernetes backend: agents are pods of Deployments, changed through the API server.

Three calls, all idempotent so that activity retries are safe:

- `scale`: merge-patch the Deployment's `/scale` subresource (`spec.replicas`).
- `delete_pod`: delete one agent's pod; a 404 means it is already gone = done.
- `mark_for_removal`: set `controller.kubernetes.io/pod-deletion-cost` to -1000
  on the pod, so the ReplicaSet removes it first on the next scale-down.

The official `kubernetes` client is blocking (urllib3), so every call runs in
a thread with `asyncio.to_thread`. API errors are sorted into two kinds for
Temporal: requests the server will never accept (bad request, RBAC, missing
Deployment, invalid object) raise a non-retryable `ApplicationError` of type
`KubernetesRequestRejected`; throttling, conflicts, server errors and
connection failures raise a retryable one (`KubernetesUnavailable`), and the
caller's retry policy (`agentroster.vocabulary.wire.BACKEND_RETRY`) backs off.

Event-driven liveness: while the worker runs (`start`/`stop`), a pod watch
(`list pods?watch=true` on the agents' label selector, from a daemon thread with
the official client's `kubernetes.watch.Watch`) reports a pod that is deleted
(`pod_deleted`), has ended (phase Failed or Succeeded: `pod_failed`) or whose
container waits in CrashLoopBackOff (`container_crashloop`, once per restart) to the
listener the worker gave (`on_agent_gone`), which signals the agent workflow
`pod_gone` with the pod's uid. The pod's name is the agent id; its pool is the
pod label `agentroster.dev/pool`, else the worker's pool. A pod being deleted
gracefully is left to drain (its preStop hook); only its final DELETED event
counts. The watch resumes from the last resourceVersion, and starts over on 410
Gone. Needs `list` and `watch` on pods (deploy/kubernetes/base/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import kubernetes.watch
import urllib3
from kubernetes.client.exceptions import ApiException
from temporalio.exceptions import ApplicationError

from agentroster.activities.liveness import AgentGoneListener
from agentroster.messages import POD_GONE_DETAIL_MAX, PodGone
from agentroster.vocabulary.wire import KUBERNETES_REJECTED, KUBERNETES_UNAVAILABLE

logger = logging.getLogger("agentroster.backend.kubernetes")

# The workflows' BACKEND_RETRY policy (agentroster.vocabulary.wire) backs off to a minute,
# forever, except for requests the API server rejected: retrying those cannot help.
REJECTED_ERROR_TYPE = KUBERNETES_REJECTED
UNAVAILABLE_ERROR_TYPE = KUBERNETES_UNAVAILABLE

NAMESPACE_ENV = "AGENTROSTER_K8S_NAMESPACE"
SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POD_DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
REMOVE_FIRST_DELETION_COST = "-1000"

# Sent explicitly rather than left to the client: the client's default for a
# dict body has changed between releases (v37 picks json-patch and rewrites it
# to strategic-merge), and RFC 7386 merge-patch means the same on every API
# server for both `/scale` and pod metadata.
MERGE_PATCH = "application/merge-patch+json"

# Statuses worth retrying: request timeout, optimistic-concurrency conflict
# (we send no resourceVersion, so a 409 is a race that resolves itself),
# throttling. Every other 4xx is the server saying "never".
_RETRYABLE_4XX = frozenset({408, 409, 429})

# The pods the watch follows (every agent Deployment's pods carry it, see
# deploy/kubernetes/base/math-agent.yaml), and the label naming an agent's pool.
AGENT_POD_SELECTOR = "app.kubernetes.io/component=agent"
POOL_LABEL = "agentroster.dev/pool"
WATCH_TIMEOUT_S = 300
WATCH_BACKOFF_MAX_S = 30.0
# Pod uids already reported (a Failed pod is deleted later: one report).
REPORTED_KEPT = 10_000

DEFAULT_REQUEST_TIMEOUT: tuple[float, float] = (5.0, 30.0)
"""(connect, read) seconds: a hung API server must not pin a worker thread."""

_MAX_RETRY_AFTER = timedelta(seconds=60)

CLIENT_RETRIES = urllib3.util.Retry(
    total=2,
    connect=2,
    read=0,
    redirect=0,
    status=0,
    other=0,
    respect_retry_after_header=False,
)
"""urllib3 retries for the API clients this module builds: only a refused or
dropped connect is retried in place. urllib3's default would also honour
Retry-After on a 429/503 for DELETE by sleeping inside the worker thread (three
times, uncapped), invisible to Temporal and past the activity's timeout;
instead the error surfaces and the activity retry policy waits."""


def default_namespace(
    environ: Mapping[str, str] | None = None,
    service_account_file: Path | None = None,
) -> str:
    """The namespace to act in: `AGENTROSTER_K8S_NAMESPACE`, else the pod's own
    service-account namespace, else "default"."""
    env = os.environ if environ is None else environ
    from_env = env.get(NAMESPACE_ENV, "").strip()
    if from_env:
        return from_env
    path = SERVICE_ACCOUNT_NAMESPACE_FILE if service_account_file is None else service_account_file
    try:
        from_file = path.read_text(encoding="utf-8").strip()
    except OSError:
        from_file = ""
    return from_file or "default"


def load_api_client() -> kubernetes.client.ApiClient:
    """An ApiClient from the in-cluster service account, else from a kubeconfig.

    Raises RuntimeError naming both attempts when neither is available.
    """
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException as incluster_exc:
        try:
            # KUBECONFIG is read now, not when `kubernetes.config` was first imported.
            kubernetes.config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG") or None,
                client_configuration=configuration,
            )
        except (kubernetes.config.ConfigException, OSError) as kubeconfig_exc:
            raise RuntimeError(
                "AGENTROSTER_BACKEND=kubernetes but no cluster credentials were found: "
                f"not in a cluster ({incluster_exc}) and no usable kubeconfig ({kubeconfig_exc})"
            ) from kubeconfig_exc
    # Must be set before ApiClient() builds its urllib3 pool from the configuration.
    configuration.retries = CLIENT_RETRIES
    return kubernetes.client.ApiClient(configuration)


def _status_message(exc: ApiException) -> str:
    """The human message of a Kubernetes `Status` error body, if it has one."""
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not body:
        return ""
    try:
        parsed = json.loads(body)
    except ValueError:
        return str(body)[:500]
    if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        return parsed["message"]
    return ""


def _retry_after(exc: ApiException) -> timedelta | None:
    """The server's Retry-After (seconds form), capped so one header can't stall us."""
    headers = exc.headers or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    if seconds < 0:
        return None
    return min(timedelta(seconds=seconds), _MAX_RETRY_AFTER)


def is_retryable_status(status: int | None) -> bool:
    """Whether an API response with this HTTP status may succeed if sent again.

    Status 0/None is the client's marker for a transport failure (e.g. TLS).
    """
    if not status:
        return True
    return status in _RETRYABLE_4XX or status >= 500


def api_error(exc: ApiException, *, verb: str, obj: str, namespace: str) -> ApplicationError:
    """Translate an ApiException into the ApplicationError Temporal should see."""
    status = exc.status or 0
    reason = (exc.reason or "").strip()
    detail = _status_message(exc)
    what = f"{verb} {obj} in namespace {namespace!r}"
    summary = f"HTTP {status} {reason}".rstrip() + (f": {detail}" if detail else "")
    if is_retryable_status(status):
        return ApplicationError(
            f"Kubernetes API could not complete {what} (will retry): {summary}",
            {"verb": verb, "object": obj, "namespace": namespace, "status": status, "reason": reason},
            type=UNAVAILABLE_ERROR_TYPE,
            non_retryable=False,
            next_retry_delay=_retry_after(exc),
        )
    return ApplicationError(
        f"Kubernetes API rejected {what}: {summary}",
        {"verb": verb, "object": obj, "namespace": namespace, "status": status, "reason": reason},
        type=REJECTED_ERROR_TYPE,
        non_retryable=True,
    )


def _log_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("kubernetes: reporting a pod gone failed: %r", future.exception())


def _release(response: Any) -> None:
    """Drain and return a raw urllib3 response's connection to the pool."""
    for method in ("drain_conn", "release_conn"):
        fn = getattr(response, method, None)
        if callable(fn):
            fn()


def pod_gone_from_event(event_type: str, pod: Mapping[str, Any]) -> PodGone | None:
    """What a pod watch event says about the agent in it: gone (and why), or None.

    DELETED: the pod object is gone (after its graceful termination, preStop drain
    included). ADDED/MODIFIED in phase Failed or Succeeded: its containers have
    ended and will not restart. A pod merely marked for deletion is still draining: None.
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = metadata.get("name")
    if not isinstance(name, str):
        return None
    phase = status.get("phase") or "Unknown"
    crashloop = _crashloop(status) if event_type in ("ADDED", "MODIFIED") and phase in ("Running", "Pending") else None
    if event_type == "DELETED":
        reason = "pod_deleted"
        detail = f"pod deleted (phase {phase})"
    elif event_type in ("ADDED", "MODIFIED") and phase in ("Failed", "Succeeded"):
        reason = "pod_failed"
        detail = f"pod phase {phase}" + (f": {status['reason']}" if status.get("reason") else "")
    elif crashloop is not None:
        # The container keeps crashing and waits (10 s, 20 s, ... up to 5 min) before its next
        # start: not running now. When it starts, the agent registers again (a new run).
        reason = "container_crashloop"
        detail = crashloop
    else:
        return None
    exits = []
    for container in status.get("containerStatuses") or []:
        terminated = ((container or {}).get("state") or {}).get("terminated") or {}
        if terminated:
            code = terminated.get("exitCode")
            why = terminated.get("reason") or ""
            exits.append(f"{container.get('name', '?')} exit code {code}" + (f" ({why})" if why else ""))
    if exits:
        detail += "; " + ", ".join(exits)
    uid = metadata.get("uid")
    try:
        return PodGone(
            agent_id=name,
            reason=reason,  # type: ignore[arg-type]
            detail=detail[:POD_GONE_DETAIL_MAX],
            pod_uid=uid if isinstance(uid, str) and 0 < len(uid) <= 128 else None,
        )
    except ValueError:
        logger.warning("kubernetes: pod %r is not an agent id; its %s event is ignored", name, event_type)
        return None


def _crashloop(status: Mapping[str, Any]) -> str | None:
    """`container X in CrashLoopBackOff (...)` when a container of the pod waits to be restarted after crashes."""
    for container in status.get("containerStatuses") or []:
        container = container or {}
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            last = ((container.get("lastState") or {}).get("terminated")) or {}
            exit_code = f", last exit code {last.get('exitCode')}" if last else ""
            return f"container {container.get('name', '?')} in CrashLoopBackOff (restarts {container.get('restartCount', '?')}{exit_code})"
    return None


def _restarts(pod: Mapping[str, Any]) -> int:
    total = 0
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        count = (container or {}).get("restartCount")
        total += count if isinstance(count, int) else 0
    return total


class _RawWatch(kubernetes.watch.Watch):
    """A Watch that hands over plain dicts: no model deserialisation that a newer
    server's pod could break (the resourceVersion is tracked by the caller)."""

    def get_return_type(self, func: Any) -> Any:
        return None


class KubernetesBackend:
    """Scales Deployments and removes pods through the Kubernetes API."""

    name = "kubernetes"

    def __init__(
        self,
        namespace: str | None = None,
        api_client: kubernetes.client.ApiClient | None = None,
        request_timeout: tuple[float, float] = DEFAULT_REQUEST_TIMEOUT,
        *,
        pool: str | None = None,
        watch_pods: bool = True,
        pod_selector: str = AGENT_POD_SELECTOR,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        """Act in `namespace` (see `default_namespace`) through `api_client`
        (default: `load_api_client()`). A caller-supplied client is used as is;
        give its Configuration `retries=CLIENT_RETRIES` for the same behaviour.

        With `watch_pods` and a listener (`on_agent_gone`), `start()` watches the pods
        matching `pod_selector` and reports those that go; `pool` (default:
        AGENTROSTER_POOL) is the pool of pods without the `agentroster.dev/pool` label.
        """
        self.namespace = namespace or default_namespace()
        self.api_client = api_client if api_client is not None else load_api_client()
        self.request_timeout = request_timeout
        self._apps = kubernetes.client.AppsV1Api(self.api_client)
        self._core = kubernetes.client.CoreV1Api(self.api_client)
        if pool is None:
            from agentroster.client.settings import Settings

            pool = Settings.from_env().pool
        self.pool = pool
        self.watch_pods = watch_pods
        self.pod_selector = pod_selector
        self.watch_timeout_s = watch_timeout_s
        self._agent_gone: AgentGoneListener | None = None
        self._watch_thread: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._watch: kubernetes.watch.Watch | None = None
        self._reported: OrderedDict[str, None] = OrderedDict()
        self.watch_events = 0  # events the watch read (for tests and status)

    # ------------------------------------------------------------------ pod watch
    def on_agent_gone(self, listener: AgentGoneListener | None) -> None:
        """Report deleted or ended agent pods to `listener(pool, PodGone)` (the worker sets it)."""
        self._agent_gone = listener

    async def start(self) -> None:
        """Start the pod watch (when there is a listener and `watch_pods`). A second call does nothing."""
        if not self.watch_pods or self._agent_gone is None or self._watch_thread is not None:
            return
        loop = asyncio.get_running_loop()
        self._watch_stop.clear()
        self._watch_thread = threading.Thread(
            target=self._watch_loop, args=(loop,), name=f"kubernetes-pod-watch-{self.namespace}", daemon=True
        )
        self._watch_thread.start()
        logger.info("kubernetes: watching pods %r in %s for agents that go", self.pod_selector, self.namespace)

    async def stop(self) -> None:
        """Stop the pod watch; its thread ends at the next event or read timeout (it is a daemon)."""
        thread, self._watch_thread = self._watch_thread, None
        if thread is None:
            return
        self._watch_stop.set()
        watch = self._watch
        if watch is not None:
            watch.stop()
        await asyncio.to_thread(thread.join, 2.0)

    def _watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        resource_version: str | None = None
        backoff = 0.5
        while not self._watch_stop.is_set():
            watch = _RawWatch()
            self._watch = watch
            kwargs: dict[str, Any] = {
                "label_selector": self.pod_selector,
                "timeout_seconds": self.watch_timeout_s,
                "allow_watch_bookmarks": True,
                "_request_timeout": (self.request_timeout[0], self.watch_timeout_s + 15),
            }
            if resource_version:
                kwargs["resource_version"] = resource_version
            opened = time.monotonic()
            try:
                for event in watch.stream(self._core.list_namespaced_pod, self.namespace, **kwargs):
                    if self._watch_stop.is_set():
                        break
                    if not isinstance(event, dict):
                        continue
                    pod = event.get("raw_object") or {}
                    version = ((pod.get("metadata") or {}) if isinstance(pod, dict) else {}).get("resourceVersion")
                    if isinstance(version, str) and version:
                        resource_version = version
                    self.watch_events += 1
                    if isinstance(pod, dict):
                        self._on_event(str(event.get("type")), pod, loop)
                if time.monotonic() - opened < 1.0 and not self._watch_stop.is_set():
                    self._watch_stop.wait(backoff)  # a server that closes at once: no busy loop
                    backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)
                else:
                    backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    logger.info("kubernetes: pod watch expired (410 Gone); watching again from now")
                    resource_version = None
                    continue
                logger.warning("kubernetes: pod watch failed: HTTP %s %s; retrying in %.1fs", exc.status, exc.reason, backoff)
                self._watch_stop.wait(backoff)
                backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)
            except Exception as exc:  # connection refused, read timeout, a closed socket on stop
                if self._watch_stop.is_set():
                    break
                logger.warning("kubernetes: pod watch interrupted: %s: %s; retrying in %.1fs", type(exc).__name__, exc, backoff)
                self._watch_stop.wait(backoff)
                backoff = min(backoff * 2, WATCH_BACKOFF_MAX_S)
        logger.info("kubernetes: pod watch stopped")

    def _on_event(self, event_type: str, pod: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
        gone = pod_gone_from_event(event_type, pod)
        listener = self._agent_gone
        if gone is None or listener is None:
            return
        key = gone.pod_uid or f"name:{gone.agent_id}"
        if gone.reason == "container_crashloop":
            key += f"/restarts:{_restarts(pod)}"  # once per crash: the agent registers again in between
        if key in self._reported:
            return
        self._reported[key] = None
        while len(self._reported) > REPORTED_KEPT:
            self._reported.popitem(last=False)
        labels = (pod.get("metadata") or {}).get("labels") or {}
        pool = labels.get(POOL_LABEL) if isinstance(labels.get(POOL_LABEL), str) else None
        logger.info("kubernetes: pod %s/%s is gone (%s: %s)", self.namespace, gone.agent_id, gone.reason, gone.detail)
        future = asyncio.run_coroutine_threadsafe(listener(pool or self.pool, gone), loop)
        future.add_done_callback(_log_failure)

    async def scale(self, deployment: str, replicas: int) -> None:
        """Set `deployment`'s desired replica count via its `/scale` subresource."""
        if replicas < 0:
            raise ApplicationError(
                f"cannot scale deployment {deployment!r} to {replicas} replicas: must be >= 0",
                type=REJECTED_ERROR_TYPE,
                non_retryable=True,
            )
        await self._call(
            "PATCH",
            f"deployments/{deployment}/scale",
            self._apps.patch_namespaced_deployment_scale,
            deployment,
            self.namespace,
            {"spec": {"replicas": replicas}},
            _content_type=MERGE_PATCH,
        )
        logger.info("kubernetes: scaled %s/%s to %d replicas", self.namespace, deployment, replicas)

    async def current_replicas(self, deployment: str) -> int:
        """The Deployment's desired replica count, read from its `/scale` subresource."""
        call = functools.partial(
            self._apps.read_namespaced_deployment_scale,
            deployment,
            self.namespace,
            _preload_content=False,
            _request_timeout=self.request_timeout,
        )
        try:
            response = await asyncio.to_thread(call)
        except ApiException as exc:
            raise api_error(exc, verb="GET", obj=f"deployments/{deployment}/scale", namespace=self.namespace) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApplicationError(
                f"Kubernetes API unreachable for GET deployments/{deployment}/scale (will retry): {exc}",
                type=UNAVAILABLE_ERROR_TYPE,
            ) from exc
        try:
            return int(json.loads(response.data).get("spec", {}).get("replicas", 0))
        finally:
            _release(response)

    async def delete_pod(self, deployment: str, agent_id: str) -> None:
        """Delete `agent_id`'s pod; one already gone (404) counts as success.

        No grace period is sent, so the pod's own terminationGracePeriodSeconds
        (and its preStop drain) applies.
        """
        deleted = await self._call(
            "DELETE",
            f"pods/{agent_id}",
            self._core.delete_namespaced_pod,
            agent_id,
            self.namespace,
            absent_ok=True,
        )
        if deleted:
            logger.info("kubernetes: deleted pod %s/%s of %s", self.namespace, agent_id, deployment)
        else:
            logger.info("kubernetes: pod %s/%s of %s already gone", self.namespace, agent_id, deployment)

    async def mark_for_removal(self, deployment: str, agent_id: str) -> None:
        """Give `agent_id`'s pod the lowest deletion cost so a scale-down takes it first."""
        body = {"metadata": {"annotations": {POD_DELETION_COST_ANNOTATION: REMOVE_FIRST_DELETION_COST}}}
        marked = await self._call(
            "PATCH",
            f"pods/{agent_id}",
            self._core.patch_namespaced_pod,
            agent_id,
            self.namespace,
            body,
            _content_type=MERGE_PATCH,
            absent_ok=True,
        )
        if not marked:
            logger.info("kubernetes: pod %s/%s of %s already gone, nothing to mark", self.namespace, agent_id, deployment)

    async def _call(
        self,
        verb: str,
        obj: str,
        fn: Callable[..., Any],
        *args: Any,
        absent_ok: bool = False,
        **kwargs: Any,
    ) -> bool:
        """Run one blocking API call in a thread; False if absent and `absent_ok`.

        The response body is not deserialised (`_preload_content=False`): we
        need only the status, and a model that fails to parse a newer server's
        object must not turn a completed change into an endless retry.
        """
        call = functools.partial(
            fn,
            *args,
            _preload_content=False,
            _request_timeout=self.request_timeout,
            **kwargs,
        )
        try:
            response = await asyncio.to_thread(call)
        except ApiException as exc:
            if absent_ok and exc.status == 404:
                return False
            raise api_error(exc, verb=verb, obj=obj, namespace=self.namespace) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApplicationError(
                f"Kubernetes API unreachable for {verb} {obj} in namespace {self.namespace!r} "
                f"(will retry): {type(exc).__name__}: {exc}",
                type=UNAVAILABLE_ERROR_TYPE,
                non_retryable=False,
            ) from exc
        _release(response)
        return True
