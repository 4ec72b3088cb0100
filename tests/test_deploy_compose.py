"""docker-compose.yml, checked without a docker engine (none runs in this project's CI).

- The file is interpolated the way Compose does (`${VAR}`, `${VAR:-default}`,
  `${VAR:?error}`), then validated against the compose-spec JSON schema that
  Docker Compose itself embeds (compose-go v2.13.0, vendored in
  deploy/schemas/compose-spec.json), with the consistency checks Compose runs
  after the schema (compose-go's loader/validate.go: services have an image or
  a build, healthcheck tests start with CMD/CMD-SHELL/NONE, depends_on,
  secrets and volumes refer to defined ones, no dependency cycle), for the
  default profile and for `--profile grafana`.
- The start-up order is asserted on the depends_on graph and its conditions,
  images are pinned, the lease key travels as a compose secret, the worker
  and the agents get the settings they need, Prometheus scrapes the worker's
  /metrics, Grafana is provisioned with the dashboard, and the Temporal
  set-up scripts are valid shell that registers agentroster's search attributes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agentroster.client.lease_tokens import KEY_FILE_VAR, KEY_VAR
from agentroster.client.search_attributes import _type_name
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES
from tests.deploy_support import DEPLOY, ROOT, SCHEMAS


COMPOSE_FILE = ROOT / "docker-compose.yml"
OWN_SERVICES = {"worker", "math-agent", "search-agent"}  # built from deploy/Dockerfile
ONE_SHOT = {"temporal-schema", "temporal-namespace"}
DOCKERFILE_UID = "10001"
TEMPORAL_RELEASE = "1.32.0"


# --------------------------------------------------------------------------
# Interpolation as Compose does it
# --------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


class MissingVariable(Exception):
    pass


def interpolate(value: Any, environment: dict[str, str], used: set[str] | None = None) -> Any:
    """Compose's variable substitution over every string of the file (extension fields included)."""
    if isinstance(value, dict):
        return {k: interpolate(v, environment, used) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environment, used) for v in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        expression = match.group("braced") if match.group("braced") is not None else match.group("named")
        name_match = re.match(r"[A-Za-z_][A-Za-z0-9_]*", expression)
        assert name_match, f"bad variable expression {expression!r}"
        name, rest = name_match.group(0), expression[name_match.end() :]
        if used is not None:
            used.add(name)
        current = environment.get(name)
        for operator in (":-", "-", ":?", "?", ":+", "+"):
            if rest.startswith(operator):
                argument = rest[len(operator) :]
                unset = current is None or (operator.startswith(":") and current == "")
                if operator in (":-", "-"):
                    return argument if unset else current  # type: ignore[return-value]
                if operator in (":?", "?"):
                    if unset:
                        raise MissingVariable(f"{name}: {argument}")
                    return current  # type: ignore[return-value]
                return "" if unset else argument
        assert rest == "", f"bad variable expression {expression!r}"
        return current or ""

    return _VARIABLE.sub(replace, value)


def test_interpolation_helper() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET}-${UNSET:-d}-${EMPTY:-e}-${EMPTY-f}-$$SET-$SET", env) == "x-d-e--$SET-x"
    with pytest.raises(MissingVariable, match="UNSET: needed"):
        interpolate("${UNSET:?needed}", env)
    assert interpolate("${SET:+yes}${UNSET:+no}", env) == "yes"


# --------------------------------------------------------------------------
# The file as Compose sees it
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    """The model after interpolation with an empty environment (no .env), as `docker compose config` would see it."""
    return interpolate(raw, {})


@pytest.fixture(scope="module")
def schema_validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)


def test_compose_file_is_valid_for_the_compose_spec(compose: dict[str, Any], schema_validator: jsonschema.protocols.Validator) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in schema_validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_the_schema_refuses_what_compose_refuses(compose: dict[str, Any], schema_validator: jsonschema.protocols.Validator) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["depends_on"]["temporal-namespace"]["condition"] = "service_finished"
    broken["services"]["worker"]["healtcheck"] = {}
    messages = " ".join(e.message for e in schema_validator.iter_errors(broken))
    assert "service_finished" in messages and "healtcheck" in messages


def test_variables(raw: dict[str, Any]) -> None:
    """Only optional variables are interpolated; the lease key is a secret's source, not a substitution."""
    used: set[str] = set()
    interpolate(raw, {}, used)
    assert used == {"GRAFANA_ADMIN_PASSWORD"}
    assert "${AGENTROSTER_LEASE_KEY" not in COMPOSE_FILE.read_text()


def _active(compose: dict[str, Any], profiles: set[str]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if not s.get("profiles") or set(s["profiles"]) & profiles}


def _deps(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return {name: {"condition": "service_started", "required": True} for name in deps}
    return {name: {"required": True, **(cfg or {})} for name, cfg in deps.items()}


@pytest.mark.parametrize("profiles", [set(), {"grafana"}], ids=["default", "grafana"])
def test_compose_consistency(compose: dict[str, Any], profiles: set[str]) -> None:
    """What compose-go's checkConsistency refuses after the schema, for the services a profile runs."""
    services = _active(compose, profiles)
    for name, service in services.items():
        assert service.get("image") or service.get("build"), f"{name} has neither an image nor a build"
        test = service.get("healthcheck", {}).get("test")
        if test:
            assert test[0] in ("CMD", "CMD-SHELL", "NONE"), name
        for dependency, cfg in _deps(service).items():
            assert dependency in services or not cfg["required"], f"{name} depends on {dependency}, not run with profiles {profiles}"
        for secret in service.get("secrets", []):
            source = secret if isinstance(secret, str) else secret["source"]
            assert source in compose.get("secrets", {}), f"{name}: undefined secret {source}"
        targets = set()
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            assert target not in targets, f"{name}: {target} mounted twice"
            targets.add(target)
            if not source.startswith((".", "/")):
                assert source in compose.get("volumes", {}), f"{name}: undefined volume {source}"
    for name, secret in compose.get("secrets", {}).items():
        assert bool(secret.get("file")) != bool(secret.get("environment")), name
    # No dependency cycle (compose refuses one): a topological order exists.
    assert len(_start_order(services)) == len(services)


def _start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    order: list[str] = []
    remaining = dict(services)
    while remaining:
        ready = sorted(n for n, s in remaining.items() if set(_deps(s)) <= set(order))
        if not ready:
            break
        order += ready
        for name in ready:
            del remaining[name]
    return order


def test_published_ports_are_unique(compose: dict[str, Any]) -> None:
    published = [p.split(":")[0] for s in compose["services"].values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), published


# --------------------------------------------------------------------------
# Start-up order
# --------------------------------------------------------------------------


def _condition(compose: dict[str, Any], service: str, dependency: str) -> str:
    return _deps(compose["services"][service])[dependency]["condition"]


def test_start_up_order(compose: dict[str, Any]) -> None:
    """PostgreSQL -> schema -> server -> namespace -> worker -> agents; the UI and Prometheus after what they watch."""
    expected = {
        ("temporal-schema", "postgresql"): "service_healthy",
        ("temporal", "temporal-schema"): "service_completed_successfully",
        ("temporal-namespace", "temporal"): "service_healthy",
        ("temporal-ui", "temporal"): "service_healthy",
        ("worker", "temporal-namespace"): "service_completed_successfully",
        ("math-agent", "temporal-namespace"): "service_completed_successfully",
        ("search-agent", "temporal-namespace"): "service_completed_successfully",
        ("math-agent", "worker"): "service_started",
        ("search-agent", "worker"): "service_started",
        ("prometheus", "worker"): "service_started",
        ("grafana", "prometheus"): "service_healthy",
    }
    actual = {(name, dep): cfg["condition"] for name, s in compose["services"].items() for dep, cfg in _deps(s).items()}
    assert actual == expected
    order = _start_order(compose["services"])
    for before, after in [("postgresql", "temporal-schema"), ("temporal-schema", "temporal"), ("temporal", "temporal-namespace"), ("temporal-namespace", "worker"), ("worker", "math-agent")]:
        assert order.index(before) < order.index(after)


def test_conditions_fit_the_services(compose: dict[str, Any]) -> None:
    """service_healthy only on services with a healthcheck; service_completed_successfully only on one-shot steps."""
    services = compose["services"]
    for name, service in services.items():
        for dependency, cfg in _deps(service).items():
            target = services[dependency]
            if cfg["condition"] == "service_healthy":
                assert target.get("healthcheck", {}).get("test"), f"{name} waits for {dependency} to be healthy; it has no healthcheck"
            if cfg["condition"] == "service_completed_successfully":
                assert dependency in ONE_SHOT, f"{name} waits for {dependency} to exit"
    for name in ONE_SHOT:
        # A one-shot step is retried on failure, and is not restarted once it has succeeded.
        assert services[name]["restart"].startswith("on-failure"), name
    for name, service in services.items():
        if name not in ONE_SHOT:
            assert service.get("restart") == "unless-stopped", name
    for name in OWN_SERVICES | {"temporal", "postgresql", "prometheus", "grafana"}:
        assert services[name]["healthcheck"]["test"], name


# --------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------


def test_images_are_pinned_and_supported(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        if name in OWN_SERVICES:
            assert service["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
            assert service["image"] == "agentroster:dev"
            continue
        image = service["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest", image
    assert services["temporal"]["image"] == f"temporalio/server:{TEMPORAL_RELEASE}"
    # The schema steps must come from the server's own release.
    for name in ONE_SHOT:
        assert services[name]["image"] == f"temporalio/admin-tools:{TEMPORAL_RELEASE}", name
    assert services["temporal-ui"]["image"].startswith("temporalio/ui:2.")
    assert not [s for s in services.values() if "auto-setup" in s.get("image", "")], "temporalio/auto-setup is no longer built"


def test_temporal_server_on_postgresql(compose: dict[str, Any]) -> None:
    services = compose["services"]
    postgres = services["postgresql"]["environment"]
    server = services["temporal"]["environment"]
    assert server["DB"] == "postgres12" and server["POSTGRES_SEEDS"] == "postgresql" and server["DB_PORT"] == "5432"
    assert server["POSTGRES_USER"] == postgres["POSTGRES_USER"] and server["POSTGRES_PWD"] == postgres["POSTGRES_PASSWORD"]
    schema = services["temporal-schema"]["environment"]
    assert schema["POSTGRES_USER"] == postgres["POSTGRES_USER"] and schema["SQL_PASSWORD"] == postgres["POSTGRES_PASSWORD"]
    assert services["temporal"]["ports"] == ["7233:7233"]
    assert services["temporal-ui"]["environment"]["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert services["temporal-ui"]["ports"] == ["8233:8080"]
    # The dynamic config file the server is told to read is the one mounted.
    path = server["DYNAMIC_CONFIG_FILE_PATH"]
    mounts = dict(v.split(":")[1::-1] for v in services["temporal"]["volumes"])
    source = mounts[f"/etc/temporal/{path}"]
    config = yaml.safe_load((ROOT / source).read_text())
    for key, entries in config.items():
        assert isinstance(entries, list) and all(set(e) == {"value", "constraints"} for e in entries), key


# --------------------------------------------------------------------------
# The lease key secret
# --------------------------------------------------------------------------


def test_lease_key_is_a_compose_secret(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert compose["secrets"] == {"lease-key": {"environment": KEY_VAR}}
    for name, service in services.items():
        environment = service.get("environment", {})
        assert KEY_VAR not in environment and "AGENTROSTER_LEASE_KEY_PREVIOUS" not in environment, f"{name}: the key stays out of the environment"
        if name not in OWN_SERVICES:
            assert not service.get("secrets"), f"{name} needs no lease key"
            continue
        (secret,) = service["secrets"]
        assert secret["source"] == "lease-key"
        # Copied in owned by the image's user (compose makes env-sourced secrets root's otherwise), readable by it only.
        assert (secret["uid"], secret["gid"], secret["mode"]) == (DOCKERFILE_UID, DOCKERFILE_UID, 0o400)
        assert environment[KEY_FILE_VAR] == f"/run/secrets/{secret['target']}"


# --------------------------------------------------------------------------
# The worker and the agents
# --------------------------------------------------------------------------


def test_worker(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    assert worker.get("entrypoint") is None and worker["command"] == ["worker"]  # the image's entrypoint is `agentroster`
    env = worker["environment"]
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert env["TEMPORAL_NAMESPACE"] == compose["services"]["temporal-namespace"]["environment"]["TEMPORAL_NAMESPACE"]
    assert env["AGENTROSTER_BACKEND"] == "none"
    assert env["AGENTROSTER_POOL"] == "default"
    port = env["AGENTROSTER_METRICS_PORT"]
    assert port in worker["expose"]
    check = " ".join(worker["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/metrics" in check
    compile(worker["healthcheck"]["test"][2], "healthcheck", "exec")
    assert worker["cap_drop"] == ["ALL"] and "no-new-privileges:true" in worker["security_opt"]


@pytest.mark.parametrize(
    ("name", "module", "agent_id"),
    [("math-agent", "examples.math_agent", "math-agent-1"), ("search-agent", "examples.search_agent", "search-agent-1")],
)
def test_agents(compose: dict[str, Any], name: str, module: str, agent_id: str) -> None:
    agent = compose["services"][name]
    assert agent["entrypoint"] + agent.get("command", []) == ["python", "-m", module]
    assert agent["build"] == compose["services"]["worker"]["build"]
    env = agent["environment"]
    assert env["AGENT_ID"] == agent_id
    assert env["AGENT_DEPLOYMENT"] == name
    assert env["AGENT_ENDPOINT"] == f"http://{name}:8080"
    assert env["AGENT_PORT"] == "8080" and "8080" in agent["expose"]
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    # An agent must join the pool the worker serves, in its namespace.
    worker_env = compose["services"]["worker"]["environment"]
    for key in ("AGENTROSTER_POOL", "TEMPORAL_NAMESPACE"):
        assert env[key] == worker_env[key], key
    check = " ".join(agent["healthcheck"]["test"])
    assert "127.0.0.1:8080/ready" in check
    compile(agent["healthcheck"]["test"][2], "healthcheck", "exec")


def test_example_modules_exist(compose: dict[str, Any]) -> None:
    for name in ("math-agent", "search-agent"):
        module = compose["services"][name]["entrypoint"][2]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module


# --------------------------------------------------------------------------
# Prometheus and Grafana
# --------------------------------------------------------------------------


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path of a service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = source
    return out


def test_prometheus_scrapes_the_worker(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = _mounts(prometheus)
    config_arg = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_path = ROOT / mounts[config_arg.split("=", 1)[1]]
    config = yaml.safe_load(config_path.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    worker_env = compose["services"]["worker"]["environment"]
    worker_job = jobs["agentroster-worker"]
    assert worker_job["metrics_path"] == "/metrics"
    assert worker_job["static_configs"] == [{"targets": [f"worker:{worker_env['AGENTROSTER_METRICS_PORT']}"]}]
    server_port = compose["services"]["temporal"]["environment"]["PROMETHEUS_ENDPOINT"].rsplit(":", 1)[1]
    assert jobs["temporal-server"]["static_configs"] == [{"targets": [f"temporal:{server_port}"]}]
    # The alert rules of deploy/prometheus/alerts.yml, through the mounted folder.
    (rule_file,) = config["rule_files"]
    folder, _, filename = rule_file.rpartition("/")
    assert mounts[folder] == "./deploy/prometheus" and filename == "alerts.yml"


def test_grafana_is_optional_and_provisioned(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    assert grafana["profiles"] == ["grafana"]
    mounts = _mounts(grafana)
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[1]
    assert datasource["type"] == "prometheus" and datasource["url"] == f"http://prometheus:{prometheus_port}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "agentroster.yml").read_text())["providers"]
    dashboards_path = provider["options"]["path"]
    # The dashboard of deploy/grafana/agentroster-dashboard.json, through the mounted folder.
    assert mounts[dashboards_path] == "./deploy/grafana"


def test_mounted_files_exist(compose: dict[str, Any]) -> None:
    """Every host path a service mounts is in the repository; deploy/prometheus and deploy/grafana come with the metrics work."""
    from_metrics_work = {"./deploy/prometheus", "./deploy/grafana"}
    for name, service in compose["services"].items():
        for source in _mounts(service).values():
            if source not in from_metrics_work:
                assert (ROOT / source).exists(), f"{name}: {source}"


# --------------------------------------------------------------------------
# The Temporal set-up scripts
# --------------------------------------------------------------------------

SCRIPTS = DEPLOY / "compose" / "temporal"


@pytest.mark.parametrize("script", ["setup-postgres.sh", "setup-namespace.sh"])
def test_setup_scripts_are_valid_shell(compose: dict[str, Any], script: str) -> None:
    shell = shutil.which("sh")
    assert shell, "a POSIX shell is needed to check the scripts"
    result = subprocess.run([shell, "-n", str(SCRIPTS / script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    text = (SCRIPTS / script).read_text()
    assert text.startswith("#!/bin/sh\n") and "set -eu" in text
    # The one-shot services run them from the mounted folder.
    runners = [s for s in compose["services"].values() if s.get("command") == [f"/scripts/{script}"]]
    assert len(runners) == 1 and _mounts(runners[0])["/scripts"] == "./deploy/compose/temporal"


def test_namespace_step_registers_the_search_attributes() -> None:
    text = (SCRIPTS / "setup-namespace.sh").read_text()
    (listing,) = re.findall(r"for attribute in ([^;]+); do", text)
    declared = dict(item.split(":") for item in listing.split())
    expected = {key.name: _type_name(int(key.indexed_value_type)) for key in SEARCH_ATTRIBUTES}
    assert declared == expected


def test_schema_step_covers_both_databases() -> None:
    text = (SCRIPTS / "setup-postgres.sh").read_text()
    assert "for pair in temporal:temporal temporal_visibility:visibility; do" in text
    for step in ("create", "setup-schema -v 0.0", "update-schema -d"):
        assert step in text
