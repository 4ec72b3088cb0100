"""The deployment files: Kubernetes manifests, docker-compose.yml and the Dockerfile.

Every Kubernetes document is checked against the API schema of a release that
`kubernetes-validate` ships (strict: unknown fields fail), then the facts the
runtime depends on are asserted: labels, downward-API env, probes, the drain
hook and grace period, a Role that grants exactly what the backend uses, and
the lease key: a Secret (a placeholder that no process accepts) injected into
the worker and the agents, and a compose variable that must be set.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agentroster.lease_tokens import INSECURE_NO_AUTH, LeaseKeyError, parse_key

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
# Oldest still-maintained minor at the time of writing; kubernetes-validate ships 1.25 onwards.
K8S_VERSION = "1.30"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _all_docs() -> list[dict[str, Any]]:
    return [doc for path in _manifest_files() for doc in _documents(path)]


def _find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in _all_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _service_deps(service: dict[str, Any]) -> set[str]:
    deps = service.get("depends_on", [])
    return set(deps if isinstance(deps, list) else deps.keys())


def _service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


# --------------------------------------------------------------------------
# Kubernetes manifests
# --------------------------------------------------------------------------


def test_kubernetes_validate_ships_the_version() -> None:
    assert kubernetes_validate.utils.major_minor(K8S_VERSION) in {
        kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()
    }


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: p.name)
def test_manifest_is_schema_valid(path: Path, version: str) -> None:
    """Valid on the oldest release we support and on the newest one shipped (no removed fields)."""
    docs = _documents(path)
    assert docs, f"{path.name} has no documents"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, desired_version=version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            # kubernetes-validate's error copies the jsonschema error's fields.
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == "agentroster"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in _manifest_files())


def test_everything_lives_in_the_agentroster_namespace() -> None:
    assert _find("Namespace", "agentroster")
    for doc in _all_docs():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "agentroster", doc["metadata"]["name"]


def test_agent_deployment() -> None:
    deployment = _find("Deployment", "math-agent")
    labels = {"app": "math-agent", "capability": "math.eval", "cap-version": "1.0.0"}
    pod = deployment["spec"]["template"]
    for where in (deployment["metadata"]["labels"], pod["metadata"]["labels"]):
        assert labels.items() <= where.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()

    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "examples.math_agent"]
    assert {"containerPort": 8080}.items() <= container["ports"][0].items()

    env = _env(container)
    assert env["AGENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["AGENT_ENDPOINT"]["value"] == "http://$(POD_IP):8080"
    # $(VAR) expands only variables defined earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("AGENT_ENDPOINT")
    expected = {
        "AGENT_DEPLOYMENT": "math-agent",
        "AGENT_PORT": "8080",
        "HEARTBEAT_INTERVAL_S": "10",
        "DRAIN_TIMEOUT_S": "60",
        "AGENTROSTER_POOL": "prod",
    }
    for name, value in expected.items():
        assert env[name]["value"] == value, name
    assert env["TEMPORAL_ADDRESS"]["value"]

    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8080}

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["python", "-c"]
    assert "http://127.0.0.1:8080/drain" in pre_stop[2]
    assert "method='POST'" in pre_stop[2]
    compile(pre_stop[2], "preStop", "exec")  # the hook's script is valid Python

    drain_timeout = float(env["DRAIN_TIMEOUT_S"]["value"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain_timeout
    # The hook's own timeout must cover the drain too, or it gives up first.
    hook_timeout = float(re.search(r"timeout=(\d+)", pre_stop[2]).group(1))  # type: ignore[union-attr]
    assert hook_timeout >= drain_timeout


def test_worker_deployment() -> None:
    deployment = _find("Deployment", "agentroster-worker")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "agentroster-worker"
    (container,) = pod["containers"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    env = _env(container)
    expected = {
        "TEMPORAL_ADDRESS": "temporal-frontend:7233",
        "TEMPORAL_NAMESPACE": "default",
        "AGENTROSTER_POOL": "prod",
        "AGENTROSTER_TASK_QUEUE": "agentroster",
        "AGENTROSTER_BACKEND": "kubernetes",
    }
    for name, value in expected.items():
        assert env[name]["value"] == value, name
    assert env["AGENTROSTER_K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_lease_key_secret_holds_a_placeholder_no_process_accepts() -> None:
    secret = _find("Secret", "agentroster-lease-key")
    assert secret["type"] == "Opaque"
    placeholder = secret["stringData"]["lease-key"]
    assert placeholder.startswith("REPLACE-ME")
    with pytest.raises(LeaseKeyError, match="placeholder"):
        parse_key(placeholder)
    assert "previous" not in secret["stringData"]  # optional, set only while keys rotate


@pytest.mark.parametrize(("name", "container"), [("agentroster-worker", "worker"), ("math-agent", "agent")])
def test_lease_key_is_injected_from_the_secret(name: str, container: str) -> None:
    pod = _find("Deployment", name)["spec"]["template"]["spec"]
    (spec,) = [c for c in pod["containers"] if c["name"] == container]
    env = _env(spec)
    assert env["AGENTROSTER_LEASE_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "agentroster-lease-key", "key": "lease-key"}
    assert env["AGENTROSTER_LEASE_KEY_PREVIOUS"]["valueFrom"]["secretKeyRef"] == {
        "name": "agentroster-lease-key",
        "key": "previous",
        "optional": True,
    }


def test_every_deployment_gets_the_lease_key() -> None:
    for doc in _all_docs():
        if doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                assert "AGENTROSTER_LEASE_KEY" in _env(container), f"{doc['metadata']['name']}/{container['name']}"


def test_role_grants_exactly_what_the_backend_uses() -> None:
    role = _find("Role", "agentroster-worker")
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
    }
    assert not {"ClusterRole", "ClusterRoleBinding"} & {d["kind"] for d in _all_docs()}


def test_role_binding_binds_the_worker_account() -> None:
    _find("ServiceAccount", "agentroster-worker")
    binding = _find("RoleBinding", "agentroster-worker")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "agentroster-worker",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "agentroster-worker", "namespace": "agentroster"}
    ]


# --------------------------------------------------------------------------
# docker-compose.yml
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {
        "postgresql",
        "temporal",
        "temporal-ui",
        "worker",
        "math-agent",
        "search-agent",
    }


def test_compose_temporal(compose: dict[str, Any]) -> None:
    services = compose["services"]
    postgres = services["postgresql"]
    assert postgres["image"] == "postgres:16"
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD"} <= _service_env(postgres).keys()

    temporal = services["temporal"]
    assert temporal["image"].startswith("temporalio/auto-setup")
    env = _service_env(temporal)
    assert env["DB"] == "postgres12"
    assert env["DB_PORT"] == "5432"
    assert env["POSTGRES_SEEDS"] == "postgresql"
    assert env["POSTGRES_USER"] == _service_env(postgres)["POSTGRES_USER"]
    assert env["POSTGRES_PWD"] == _service_env(postgres)["POSTGRES_PASSWORD"]
    assert temporal["ports"] == ["7233:7233"]
    assert _service_deps(temporal) == {"postgresql"}

    ui = services["temporal-ui"]
    assert ui["image"].startswith("temporalio/ui")
    assert _service_env(ui)["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert ui["ports"] == ["8233:8080"]
    assert _service_deps(ui) == {"temporal"}


def test_compose_worker(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    assert worker["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    assert worker["command"] in (["agentroster", "worker"], "agentroster worker")
    env = _service_env(worker)
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert env["AGENTROSTER_BACKEND"] == "none"
    assert env["AGENTROSTER_POOL"] == "default"
    assert _service_deps(worker) == {"temporal"}


def test_compose_requires_a_lease_key(compose: dict[str, Any]) -> None:
    """`${VAR:?message}`: compose refuses to start until the key (or the explicit opt-out) is set."""
    services = compose["services"]
    values = {name: _service_env(services[name]).get("AGENTROSTER_LEASE_KEY") for name in ("worker", "math-agent", "search-agent")}
    assert len(set(values.values())) == 1, values  # one key for the worker and every agent
    value = values["worker"]
    assert value is not None and re.fullmatch(r"\$\{AGENTROSTER_LEASE_KEY:\?[^}]+\}", value), value
    assert INSECURE_NO_AUTH in value  # the error names the opt-out for local experiments
    for name, service in services.items():
        if name not in values:
            assert "AGENTROSTER_LEASE_KEY" not in _service_env(service), name


@pytest.mark.parametrize(
    ("name", "module", "agent_id"),
    [("math-agent", "examples.math_agent", "math-agent-1"), ("search-agent", "examples.search_agent", "search-agent-1")],
)
def test_compose_agents(compose: dict[str, Any], name: str, module: str, agent_id: str) -> None:
    agent = compose["services"][name]
    assert agent["command"] in (["python", "-m", module], f"python -m {module}")
    assert agent["build"] == compose["services"]["worker"]["build"]
    env = _service_env(agent)
    assert env["AGENT_ID"] == agent_id
    assert env["AGENT_DEPLOYMENT"] == name
    assert env["AGENT_ENDPOINT"] == f"http://{name}:8080"
    assert env["AGENT_PORT"] == "8080"
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    # An agent must join the pool the worker serves.
    assert env.get("AGENTROSTER_POOL", "default") == _service_env(compose["services"]["worker"])["AGENTROSTER_POOL"]
    assert _service_deps(agent) == {"worker"}
    check = " ".join(agent["healthcheck"]["test"])
    assert "/ready" in check and ":8080" in check


# --------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------


def test_dockerfile_installs_the_package() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    instructions = [line.strip() for line in dockerfile.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert instructions[0] == "FROM python:3.11-slim"
    assert re.search(r"^RUN pip install \.(\s|$)", dockerfile, re.MULTILINE)
    assert instructions[-1] == 'CMD ["agentroster", "worker"]'


def test_dockerignore_keeps_what_the_build_needs() -> None:
    patterns = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("pyproject.toml", "README.md", "agentroster", "examples"):
        assert needed not in patterns
