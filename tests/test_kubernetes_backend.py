"""KubernetesBackend against a local HTTP server that answers the Kubernetes REST paths.

No cluster exists on these machines, so a small aiohttp server plays the API
server: it records every request and answers with realistic objects (a
`Scale`, a `Pod`, a `Status`), or with the error we tell it to. The backend
talks to it through a real `kubernetes.client.ApiClient`, so the paths,
content-types and bodies asserted here are exactly what the client puts on
the wire. The pod watch (event-driven liveness) reads a watch stream from the
same stand-in: `GET .../pods?watch=true` answers chunked JSON lines, one event
each, as kube-apiserver does.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from aiohttp import web
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from agentroster.activities.backend import Backend, BackendActivities
from agentroster.activities.kubernetes_backend import (
    CLIENT_RETRIES,
    POD_DELETION_COST_ANNOTATION,
    REJECTED_ERROR_TYPE,
    UNAVAILABLE_ERROR_TYPE,
    POOL_LABEL,
    KubernetesBackend,
    default_namespace,
    pod_gone_from_event,
)
from agentroster.messages import PodGone, PodRef, ScaleRequest
from agentroster.vocabulary.wire import BACKEND_RETRY

NS = "agents"
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/math-agent/scale"
POD_PATH = f"/api/v1/namespaces/{NS}/pods/math-agent-7d4b9c-x2x9q"
POD_NAME = "math-agent-7d4b9c-x2x9q"


@dataclass
class Recorded:
    """One request as the fake API server received it."""

    method: str
    path: str
    query: str
    content_type: str | None
    body: Any


@dataclass
class FakeKubeApi:
    """A stand-in API server: records requests, answers like kube-apiserver."""

    requests: list[Recorded] = field(default_factory=list)
    failures: dict[tuple[str, str], tuple[int, dict[str, str]]] = field(default_factory=dict)
    base_url: str = ""
    # The pod watch: each `GET .../pods?watch=true` (its query) and the events to stream
    # to the open watch (or, while none is open, to the next one).
    watches: list[dict[str, str]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    current: asyncio.Queue[dict[str, Any] | None] | None = None

    def push(self, event_type: str, pod: dict[str, Any]) -> None:
        """Stream one watch event to the open (or next) watch."""
        event = {"type": event_type, "object": pod}
        if self.current is not None:
            self.current.put_nowait(event)
        else:
            self.pending.append(event)

    def end_watch(self) -> None:
        """Close the open watch stream, as the server does at `timeoutSeconds`."""
        if self.current is not None:
            self.current.put_nowait(None)
            self.current = None

    async def watch(self, request: web.Request) -> web.StreamResponse:
        self.watches.append(dict(request.query))
        if request.query.get("watch") != "true":
            return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": []})
        self.end_watch()  # one watch at a time, like one worker
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        for event in self.pending:
            queue.put_nowait(event)
        self.pending.clear()
        self.current = queue
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        timeout = float(request.query.get("timeoutSeconds", "30"))
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=left)
                except asyncio.TimeoutError:
                    break
                if event is None:
                    break
                await response.write(json.dumps(event).encode() + b"\n")
                if event["type"] == "ERROR":
                    break  # kube-apiserver ends the stream after an ERROR event
            await response.write_eof()
        except ConnectionError:
            pass  # the watcher went away
        finally:
            if self.current is queue:
                self.current = None
        return response

    def fail(self, method: str, path: str, status: int, headers: dict[str, str] | None = None) -> None:
        """Answer `method path` with `status` (and a Status body) from now on."""
        self.failures[(method, path)] = (status, headers or {})

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.requests.append(
            Recorded(
                method=request.method,
                path=request.path,
                query=request.query_string,
                content_type=request.headers.get("Content-Type"),
                body=json.loads(raw) if raw else None,
            )
        )
        key = (request.method, request.path)
        if key in self.failures:
            status, headers = self.failures[key]
            return web.json_response(_status_body(status, request.path), status=status, headers=headers)
        ns = request.match_info["ns"]
        name = request.match_info["name"]
        if request.method == "PATCH" and request.path.endswith("/scale"):
            body = json.loads(raw)
            return web.json_response(_scale(ns, name, body["spec"]["replicas"]))
        if request.method == "PATCH":
            body = json.loads(raw)
            return web.json_response(_pod(ns, name, annotations=body["metadata"]["annotations"]))
        if request.method == "DELETE":
            pod = _pod(ns, name)
            # A graceful delete answers 200 with the pod, now carrying a deletionTimestamp.
            pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:01:30Z"
            pod["metadata"]["deletionGracePeriodSeconds"] = 90
            return web.json_response(pod)
        return web.json_response(_status_body(405, request.path), status=405)  # pragma: no cover


_REASONS = {
    403: ("Forbidden", 'deployments.apps "math-agent" is forbidden: User '
          '"system:serviceaccount:agents:agentroster-worker" cannot patch resource "deployments/scale"'),
    404: ("NotFound", 'pods "math-agent-7d4b9c-x2x9q" not found'),
    409: ("Conflict", "the object has been modified; please apply your changes to the latest version"),
    422: ("Invalid", 'Scale.autoscaling "math-agent" is invalid: spec.replicas: Invalid value: -1: '
          "must be greater than or equal to 0"),
    429: ("TooManyRequests", "too many requests, please try again later"),
    500: ("InternalError", "Internal error occurred: etcdserver: request timed out"),
}


def _status_body(code: int, path: str) -> dict[str, Any]:
    reason, message = _REASONS.get(code, ("Unknown", f"error {code} for {path}"))
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _scale(ns: str, name: str, replicas: int) -> dict[str, Any]:
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": "6f1c3c1e-2a47-4b8e-9d1e-3c0f8e2f1a11",
            "resourceVersion": "48213",
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {"replicas": replicas},
        "status": {"replicas": 2, "selector": f"app={name}"},
    }


def _pod(ns: str, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": "0b8f5b0e-9a43-4f0e-8d54-6c1a0c9e7f22",
            "resourceVersion": "48250",
            "labels": {"app": "math-agent", "capability": "math.eval", "cap-version": "1.0.0"},
            "annotations": annotations or {},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "math-agent-7d4b9c",
                    "uid": "3d2e1f00-1111-4222-8333-444455556666",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "containers": [{"name": "agent", "image": "agentroster:dev", "ports": [{"containerPort": 8080}]}],
            "terminationGracePeriodSeconds": 90,
        },
        "status": {"phase": "Running", "podIP": "10.1.2.3"},
    }


@pytest.fixture
async def kube_api() -> AsyncIterator[FakeKubeApi]:
    """The fake API server on 127.0.0.1 at a random port."""
    api = FakeKubeApi()
    app = web.Application()
    app.router.add_route("PATCH", "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", api.handle)
    app.router.add_route("DELETE", "/api/v1/namespaces/{ns}/pods/{name}", api.handle)
    app.router.add_route("PATCH", "/api/v1/namespaces/{ns}/pods/{name}", api.handle)
    app.router.add_route("GET", "/api/v1/namespaces/{ns}/pods", api.watch)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    api.base_url = f"http://127.0.0.1:{port}"
    try:
        yield api
    finally:
        api.end_watch()
        await runner.cleanup()


def _api_client(host: str) -> kubernetes.client.ApiClient:
    """A client configured as `load_api_client` configures its own."""
    configuration = kubernetes.client.Configuration()
    configuration.host = host
    configuration.retries = CLIENT_RETRIES
    return kubernetes.client.ApiClient(configuration)


@pytest.fixture
def backend(kube_api: FakeKubeApi) -> Iterator[KubernetesBackend]:
    client = _api_client(kube_api.base_url)
    try:
        yield KubernetesBackend(namespace=NS, api_client=client)
    finally:
        client.close()


def _only(api: FakeKubeApi) -> Recorded:
    assert len(api.requests) == 1, api.requests
    return api.requests[0]


# --------------------------------------------------------------------------
# Requests on the wire
# --------------------------------------------------------------------------


async def test_is_a_backend(backend: KubernetesBackend) -> None:
    assert isinstance(backend, Backend)
    assert backend.name == "kubernetes"
    assert backend.namespace == NS


async def test_scale_patches_the_scale_subresource(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    await backend.scale("math-agent", 3)
    assert _only(kube_api) == Recorded(
        method="PATCH",
        path=SCALE_PATH,
        query="",
        content_type="application/merge-patch+json",
        body={"spec": {"replicas": 3}},
    )


async def test_scale_to_zero_is_allowed(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    await backend.scale("math-agent", 0)
    assert _only(kube_api).body == {"spec": {"replicas": 0}}


async def test_scale_below_zero_is_rejected_without_a_request(
    kube_api: FakeKubeApi, backend: KubernetesBackend
) -> None:
    with pytest.raises(ApplicationError) as info:
        await backend.scale("math-agent", -1)
    assert info.value.non_retryable
    assert kube_api.requests == []


async def test_delete_pod(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    await backend.delete_pod("math-agent", POD_NAME)
    # No body and no gracePeriodSeconds: the pod's own grace period (its drain) applies.
    assert _only(kube_api) == Recorded(method="DELETE", path=POD_PATH, query="", content_type=None, body=None)


async def test_delete_absent_pod_is_success(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    kube_api.fail("DELETE", POD_PATH, 404)
    await backend.delete_pod("math-agent", POD_NAME)
    assert _only(kube_api).method == "DELETE"


async def test_mark_for_removal_sets_deletion_cost(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    await backend.mark_for_removal("math-agent", POD_NAME)
    assert _only(kube_api) == Recorded(
        method="PATCH",
        path=POD_PATH,
        query="",
        content_type="application/merge-patch+json",
        body={"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1000"}}},
    )
    assert POD_DELETION_COST_ANNOTATION == "controller.kubernetes.io/pod-deletion-cost"


async def test_mark_absent_pod_is_fine(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    kube_api.fail("PATCH", POD_PATH, 404)
    await backend.mark_for_removal("math-agent", POD_NAME)
    assert _only(kube_api).method == "PATCH"


async def test_calls_are_idempotent(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    """Activities retry: the same call twice sends the same request twice, no error."""
    for _ in range(2):
        await backend.scale("math-agent", 2)
        await backend.mark_for_removal("math-agent", POD_NAME)
    assert [(r.method, r.path, r.body) for r in kube_api.requests[:2]] == [
        (r.method, r.path, r.body) for r in kube_api.requests[2:]
    ]


# --------------------------------------------------------------------------
# Error mapping
# --------------------------------------------------------------------------


@pytest.mark.parametrize("status", [403, 422])
async def test_rejections_are_non_retryable(
    kube_api: FakeKubeApi, backend: KubernetesBackend, status: int
) -> None:
    kube_api.fail("PATCH", SCALE_PATH, status)
    with pytest.raises(ApplicationError) as info:
        await backend.scale("math-agent", 3)
    err = info.value
    assert err.non_retryable
    assert err.type == REJECTED_ERROR_TYPE
    msg = str(err)
    assert "PATCH deployments/math-agent/scale" in msg
    assert f"HTTP {status}" in msg
    assert "'agents'" in msg
    # The server's own explanation (e.g. which RBAC verb is missing) reaches the operator.
    assert _REASONS[status][1] in msg
    assert _only(kube_api).path == SCALE_PATH


async def test_scale_of_missing_deployment_is_non_retryable(
    kube_api: FakeKubeApi, backend: KubernetesBackend
) -> None:
    kube_api.fail("PATCH", SCALE_PATH, 404)
    with pytest.raises(ApplicationError) as info:
        await backend.scale("math-agent", 1)
    assert info.value.non_retryable
    assert info.value.type == REJECTED_ERROR_TYPE


async def test_delete_forbidden_is_non_retryable(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    kube_api.fail("DELETE", POD_PATH, 403)
    with pytest.raises(ApplicationError) as info:
        await backend.delete_pod("math-agent", POD_NAME)
    assert info.value.non_retryable
    assert f"DELETE pods/{POD_NAME}" in str(info.value)


@pytest.mark.parametrize("status", [500, 409])
async def test_server_errors_are_retryable(kube_api: FakeKubeApi, backend: KubernetesBackend, status: int) -> None:
    kube_api.fail("PATCH", SCALE_PATH, status)
    with pytest.raises(ApplicationError) as info:
        await backend.scale("math-agent", 3)
    err = info.value
    assert not err.non_retryable
    assert err.type == UNAVAILABLE_ERROR_TYPE
    assert err.type not in (BACKEND_RETRY.non_retryable_error_types or [])
    assert f"HTTP {status}" in str(err)
    # The client itself must not retry a PATCH behind our back: one request only.
    assert _only(kube_api).path == SCALE_PATH


async def test_throttling_is_retryable_and_honours_retry_after(
    kube_api: FakeKubeApi, backend: KubernetesBackend
) -> None:
    kube_api.fail("DELETE", POD_PATH, 429, headers={"Retry-After": "7"})
    with pytest.raises(ApplicationError) as info:
        await backend.delete_pod("math-agent", POD_NAME)
    assert not info.value.non_retryable
    assert info.value.next_retry_delay == timedelta(seconds=7)
    # Not retried (and slept on) inside the client: Temporal does the waiting.
    assert _only(kube_api).method == "DELETE"


async def test_retry_after_is_capped(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    kube_api.fail("PATCH", SCALE_PATH, 429, headers={"Retry-After": "3600"})
    with pytest.raises(ApplicationError) as info:
        await backend.scale("math-agent", 1)
    assert info.value.next_retry_delay == timedelta(seconds=60)


async def test_unreachable_api_server_is_retryable() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    configuration = kubernetes.client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    configuration.retries = CLIENT_RETRIES
    client = kubernetes.client.ApiClient(configuration)
    try:
        with pytest.raises(ApplicationError) as info:
            await KubernetesBackend(namespace=NS, api_client=client).scale("math-agent", 1)
    finally:
        client.close()
    assert not info.value.non_retryable
    assert info.value.type == UNAVAILABLE_ERROR_TYPE


def test_retry_policy() -> None:
    assert BACKEND_RETRY.initial_interval == timedelta(seconds=1)
    assert BACKEND_RETRY.backoff_coefficient == 2
    assert BACKEND_RETRY.maximum_interval == timedelta(seconds=60)
    assert BACKEND_RETRY.maximum_attempts == 0
    assert list(BACKEND_RETRY.non_retryable_error_types or []) == ["KubernetesRequestRejected", "ValueError"]


# --------------------------------------------------------------------------
# Through the activities
# --------------------------------------------------------------------------


async def test_activities_drive_the_backend(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    acts = BackendActivities(backend)
    env = ActivityEnvironment()
    await env.run(acts.scale_deployment, ScaleRequest(deployment="math-agent", replicas=4, reason="queue depth"))
    # A scale-down's retiree: its pod is marked to go first, then the count is lowered.
    await env.run(acts.scale_deployment, ScaleRequest(deployment="math-agent", replicas=3, reason="idle", victims=[POD_NAME]))
    await env.run(acts.delete_pod, PodRef(deployment="math-agent", agent_id=POD_NAME, reason="heartbeat_lost"))
    assert [(r.method, r.path, r.content_type, r.body) for r in kube_api.requests] == [
        ("PATCH", SCALE_PATH, "application/merge-patch+json", {"spec": {"replicas": 4}}),
        (
            "PATCH",
            POD_PATH,
            "application/merge-patch+json",
            {"metadata": {"annotations": {POD_DELETION_COST_ANNOTATION: "-1000"}}},
        ),
        ("PATCH", SCALE_PATH, "application/merge-patch+json", {"spec": {"replicas": 3}}),
        ("DELETE", POD_PATH, None, None),
    ]

    kube_api.fail("PATCH", SCALE_PATH, 403)
    with pytest.raises(ApplicationError) as info:
        await env.run(acts.scale_deployment, ScaleRequest(deployment="math-agent", replicas=5))
    assert info.value.non_retryable


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


def test_default_namespace_order(tmp_path: Path) -> None:
    sa_file = tmp_path / "namespace"
    assert default_namespace({}, sa_file) == "default"
    sa_file.write_text("agentroster\n")
    assert default_namespace({}, sa_file) == "agentroster"
    assert default_namespace({"AGENTROSTER_K8S_NAMESPACE": "prod-agents"}, sa_file) == "prod-agents"


async def test_falls_back_to_kubeconfig(
    kube_api: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a cluster the backend reads a kubeconfig and uses its server."""
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": kube_api.base_url}}],
                "users": [{"name": "me", "user": {"token": "not-a-secret"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
                "current-context": "fake",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("AGENTROSTER_K8S_NAMESPACE", NS)
    backend = KubernetesBackend()
    try:
        assert backend.namespace == NS
        assert backend.api_client.configuration.retries is CLIENT_RETRIES
        await backend.scale("math-agent", 2)
    finally:
        backend.api_client.close()
    assert _only(kube_api).path == SCALE_PATH


# --------------------------------------------------------------------------
# A scale-down through the pool, against the stand-in API server
# --------------------------------------------------------------------------


async def test_pool_scale_down_sets_deletion_costs_before_it_patches_replicas(kube_api: FakeKubeApi, backend: KubernetesBackend, stack) -> None:  # noqa: ANN001
    """The chosen (idle) pods are marked first, so the Deployment removes exactly them."""
    from agentroster.models import PoolPolicy
    from tests.conftest import eventually, make_registration

    await stack.stop_worker()
    stack.backend = backend
    await stack.start_worker()
    names = [f"math-agent-7d4b9c-pod{i}" for i in range(3)]
    for name in names:
        await stack.roster.register(make_registration(name, [("math.eval", "1.0.0", 1, "A")], deployment="math-agent"))
    held = await stack.roster.acquire("math.eval")  # one agent is busy: it must not be chosen
    await stack.roster.set_policy("math-agent", PoolPolicy(min_replicas=1, max_replicas=3, target_in_flight_per_agent=1, downscale_delay_s=1))

    scale_path = f"/apis/apps/v1/namespaces/{NS}/deployments/math-agent/scale"
    await eventually(lambda: any(r.path == scale_path for r in kube_api.requests), timeout=20, interval=0.2)
    order = [(r.method, r.path.rsplit("/", 1)[-1], r.body) for r in kube_api.requests]
    scale_at = next(i for i, (_, last, _) in enumerate(order) if last == "scale")
    marked = [name for method, name, body in order[:scale_at] if method == "PATCH"]
    assert sorted(marked) == sorted(n for n in names if n != held.agent_id)
    assert all(body == {"metadata": {"annotations": {POD_DELETION_COST_ANNOTATION: "-1000"}}} for m, _, body in order[:scale_at] if m == "PATCH")
    assert order[scale_at][2] == {"spec": {"replicas": 1}}
    # The victims drain (idle: at once) and end; the busy agent keeps its lease.
    for name in marked:
        await eventually(lambda name=name: _ended(stack, name), timeout=20, interval=0.2)
    assert {a.agent_id: a.in_flight for a in (await stack.roster.status()).agents}[held.agent_id] == 1
    await stack.roster.release(held)


async def _ended(stack, agent_id: str) -> bool:  # noqa: ANN001
    from agentroster.models import AgentState

    return (await stack.roster.describe(agent_id)).state == AgentState.TERMINATED


# --------------------------------------------------------------------------
# The pod watch: event-driven liveness
# --------------------------------------------------------------------------


def _pod_event(name: str, *, uid: str, phase: str = "Running", pool: str | None = None, rv: str = "500", **status: Any) -> dict[str, Any]:
    pod = _pod(NS, name)
    pod["metadata"]["uid"] = uid
    pod["metadata"]["resourceVersion"] = rv
    pod["metadata"]["labels"]["app.kubernetes.io/component"] = "agent"
    if pool:
        pod["metadata"]["labels"][POOL_LABEL] = pool
    pod["status"] = {"phase": phase, **status}
    return pod


def test_which_events_mean_an_agent_is_gone() -> None:
    running = _pod_event("a-1", uid="u1")
    assert pod_gone_from_event("ADDED", running) is None
    assert pod_gone_from_event("MODIFIED", running) is None
    draining = _pod_event("a-1", uid="u1")
    draining["metadata"]["deletionTimestamp"] = "2025-01-01T00:01:30Z"  # graceful deletion: still draining
    assert pod_gone_from_event("MODIFIED", draining) is None
    assert pod_gone_from_event("BOOKMARK", {"metadata": {"resourceVersion": "9"}}) is None

    deleted = pod_gone_from_event(
        "DELETED",
        _pod_event("a-1", uid="u1", containerStatuses=[{"name": "agent", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]),
    )
    assert deleted == PodGone(agent_id="a-1", reason="pod_deleted", detail="pod deleted (phase Running); agent exit code 137 (Error)", pod_uid="u1")
    failed = pod_gone_from_event("MODIFIED", _pod_event("a-2", uid="u2", phase="Failed", reason="Evicted"))
    assert failed is not None and (failed.reason, failed.detail, failed.pod_uid) == ("pod_failed", "pod phase Failed: Evicted", "u2")
    crashing = _pod_event(
        "a-5", uid="u5", containerStatuses=[{"name": "agent", "restartCount": 4, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                             "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}],
    )
    looping = pod_gone_from_event("MODIFIED", crashing)
    assert looping is not None and looping.reason == "container_crashloop"
    assert looping.detail == "container agent in CrashLoopBackOff (restarts 4, last exit code 1)"
    restarting = _pod_event("a-5", uid="u5", containerStatuses=[{"name": "agent", "restartCount": 5, "state": {"running": {}}}])
    assert pod_gone_from_event("MODIFIED", restarting) is None  # running again: it registers again by itself
    # Not an agent id, or no name: ignored, never raised.
    assert pod_gone_from_event("DELETED", _pod_event("bad name!", uid="u3")) is None
    assert pod_gone_from_event("DELETED", {"metadata": {}}) is None
    huge = pod_gone_from_event("DELETED", _pod_event("a-4", uid="x" * 500, message="m" * 10_000))
    assert huge is not None and huge.pod_uid is None and len(huge.detail) <= 512


async def test_pod_watch_reports_deleted_and_failed_pods(kube_api: FakeKubeApi) -> None:
    client = _api_client(kube_api.base_url)
    backend = KubernetesBackend(namespace=NS, api_client=client, pool="prod", watch_timeout_s=2)
    seen: list[tuple[str, PodGone]] = []

    async def listener(pool: str, gone: PodGone) -> bool:
        seen.append((pool, gone))
        return True

    backend.on_agent_gone(listener)
    await backend.start()
    try:
        await _until(lambda: kube_api.watches)
        query = kube_api.watches[0]
        assert query["watch"] == "true" and query["labelSelector"] == "app.kubernetes.io/component=agent"
        assert "resourceVersion" not in query  # the first watch starts from now (ADDED for existing pods)

        kube_api.push("ADDED", _pod_event("math-agent-1", uid="u1", rv="501"))
        gracefully = _pod_event("math-agent-1", uid="u1", rv="502")
        gracefully["metadata"]["deletionTimestamp"] = "2025-01-01T00:01:30Z"
        kube_api.push("MODIFIED", gracefully)
        kube_api.push("DELETED", _pod_event("math-agent-1", uid="u1", rv="503"))
        kube_api.push("MODIFIED", _pod_event("math-agent-2", uid="u2", phase="Failed", reason="Evicted", pool="staging", rv="504"))
        kube_api.push("DELETED", _pod_event("math-agent-2", uid="u2", phase="Failed", pool="staging", rv="505"))  # reported once
        await _until(lambda: len(seen) >= 2 and backend.watch_events >= 5)
        assert [(pool, g.agent_id, g.reason, g.pod_uid) for pool, g in seen] == [
            ("prod", "math-agent-1", "pod_deleted", "u1"),
            ("staging", "math-agent-2", "pod_failed", "u2"),
        ]

        # The stream ends (timeoutSeconds): the watch resumes from the last resourceVersion.
        kube_api.end_watch()
        await _until(lambda: len(kube_api.watches) >= 2)
        assert kube_api.watches[1]["resourceVersion"] == "505"
        # 410 Gone (that version is too old): it starts over without one.
        kube_api.push("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "message": "too old resource version", "code": 410})
        await _until(lambda: len(kube_api.watches) >= 3)
        assert "resourceVersion" not in kube_api.watches[2]
        kube_api.push("DELETED", _pod_event("math-agent-3", uid="u3", rv="600"))
        await _until(lambda: len(seen) >= 3)
        assert seen[2][1].agent_id == "math-agent-3"
        # A crash loop: once per restart (the agent registers again between two crashes).
        def looping(restarts: int, rv: str) -> dict[str, Any]:
            return _pod_event("math-agent-4", uid="u4", rv=rv, containerStatuses=[
                {"name": "agent", "restartCount": restarts, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}])
        kube_api.push("MODIFIED", looping(2, "601"))
        kube_api.push("MODIFIED", looping(2, "602"))
        kube_api.push("MODIFIED", looping(3, "603"))
        await _until(lambda: len(seen) >= 5 and backend.watch_events >= 9)
        assert [(g.agent_id, g.reason) for _, g in seen[3:]] == [("math-agent-4", "container_crashloop")] * 2
        assert "restarts 3" in seen[4][1].detail
    finally:
        await backend.stop()
        client.close()


async def test_pod_watch_survives_an_unreachable_api_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = _api_client(f"http://127.0.0.1:{port}")
    backend = KubernetesBackend(namespace=NS, api_client=client, pool="prod", watch_timeout_s=1)

    async def listener(pool: str, gone: PodGone) -> bool:
        raise AssertionError("nothing can be gone")

    backend.on_agent_gone(listener)
    await backend.start()
    await asyncio.sleep(0.3)
    await backend.stop()  # returns although every connect failed
    client.close()


async def test_without_a_listener_there_is_no_watch(kube_api: FakeKubeApi, backend: KubernetesBackend) -> None:
    await backend.start()
    await asyncio.sleep(0.1)
    assert kube_api.watches == []
    await backend.stop()


async def test_deleted_pod_ends_its_agent_workflow_at_once(kube_api: FakeKubeApi, stack) -> None:  # noqa: ANN001
    """Through a real worker: the pod watch's DELETED event signals `pod_gone`; the agent (120 s
    heartbeat, so a 6 min window) is Terminated `pod_deleted`, the pool drops it, and the
    workflow's delete_pod reaches the API (404 there: already gone, success). A DELETED event
    for a pod of the same name but another uid (recreated) is refused by the agent workflow."""
    from agentroster.models import AgentState
    from tests.conftest import eventually, make_registration

    client = _api_client(kube_api.base_url)
    backend = KubernetesBackend(namespace=NS, api_client=client, pool=stack.pool, watch_timeout_s=5)
    await stack.stop_worker()
    stack.backend = backend
    await stack.start_worker()
    try:
        for name, uid in (("math-agent-7d4b9c-aaaaa", "uid-a"), ("math-agent-7d4b9c-bbbbb", "uid-b")):
            reg = make_registration(name, [("math.eval", "1.0.0", 1, "A")], deployment="math-agent", heartbeat_interval_s=120)
            await stack.roster.register(reg.model_copy(update={"metadata": {"pod_uid": uid}}))
        await eventually(lambda: kube_api.watches, timeout=10)
        kube_api.fail("DELETE", f"/api/v1/namespaces/{NS}/pods/math-agent-7d4b9c-aaaaa", 404)
        kube_api.push("DELETED", _pod_event("math-agent-7d4b9c-aaaaa", uid="uid-a", rv="700"))
        kube_api.push("DELETED", _pod_event("math-agent-7d4b9c-bbbbb", uid="uid-OLD", rv="701"))

        async def ended() -> Any:
            status = await stack.roster.describe("math-agent-7d4b9c-aaaaa")
            return status if status.state == AgentState.TERMINATED else None

        status = await eventually(ended, timeout=15, interval=0.1)
        assert status.terminated_reason == "pod_deleted"
        assert "uid" not in status.transitions[-1].reason and "pod deleted" in status.transitions[-1].reason
        await eventually(lambda: any(r.method == "DELETE" and r.path.endswith("aaaaa") for r in kube_api.requests), timeout=10)
        assert await stack.roster.find("math.eval") == ["math-agent-7d4b9c-bbbbb"]

        handle = stack.env.client.get_workflow_handle(f"agent/{stack.pool}/math-agent-7d4b9c-bbbbb")
        refusals = await eventually(lambda: handle.query("refusals"), timeout=10)
        assert any("pod uid" in r and "recreated" in r for r in refusals), refusals
        assert (await stack.roster.describe("math-agent-7d4b9c-bbbbb")).state == AgentState.READY
    finally:
        await stack.stop_worker()
        client.close()


async def _until(check: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
