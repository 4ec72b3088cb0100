"""deploy/Dockerfile, checked without a docker engine (none runs in this project's CI).

The Dockerfile is parsed into instructions (line continuations joined) and its
shape asserted: a build stage that makes wheels, a slim runtime stage that
installs them with no index and runs as the numeric non-root user the
Kubernetes manifests and the compose secret expect, `agentroster` as the
entrypoint, and a HEALTHCHECK. The HEALTHCHECK's command is run for real,
against local HTTP servers standing in for an agent and for the worker's
metrics endpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from tests.deploy_support import DEPLOY, K8S, ROOT

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "a continuation line runs off the end"
    return out


def stages() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(image, stage name, instructions) for every FROM."""
    out: list[tuple[str, str, list[tuple[str, str]]]] = []
    args = {}
    for keyword, rest in instructions():
        if keyword == "ARG" and not out:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert match, rest
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], match.group(1))
            out.append((image, match.group(2) or "", []))
        else:
            assert out, f"{keyword} before the first FROM"
            out[-1][2].append((keyword, rest))
    return out


def test_multi_stage_build_of_a_wheel() -> None:
    (build_image, build_name, build), (runtime_image, runtime_name, runtime) = stages()
    assert build_name == "build" and runtime_name == "runtime"
    # Both stages on the same slim Python, one the package supports.
    assert build_image == runtime_image
    match = re.fullmatch(r"python:(\d+\.\d+)-slim", runtime_image)
    assert match, runtime_image
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert match.group(1) + ".0" in SpecifierSet(requires)

    build_runs = [rest for keyword, rest in build if keyword == "RUN"]
    assert any(re.search(r'pip wheel --wheel-dir /wheels "\.\[worker\]"', run) for run in build_runs), "wheels for the worker's extra too"
    # The build copies only what building the wheel reads; those paths exist.
    for keyword, rest in build:
        if keyword == "COPY":
            sources = rest.split()[:-1]
            assert "." not in sources, "the build stage copies the sources it needs, not the whole context"
            for source in sources:
                assert (ROOT / source).exists(), source

    runtime_runs = [rest for keyword, rest in runtime if keyword == "RUN"]
    (install,) = [run for run in runtime_runs if "pip install" in run]
    assert "--no-index" in install and "--find-links=/wheels" in install
    assert "--mount=type=bind,from=build,source=/wheels,target=/wheels" in install, "the wheels stay out of the image's layers"
    assert re.search(r'pip install .* "agentroster\[worker\]"$', install), "the image runs the worker: its extra (kubernetes) is installed"
    copies = [rest for keyword, rest in runtime if keyword == "COPY"]
    assert copies == ["examples ./examples"], "the runtime stage holds no source tree: only the example agents"


def test_runs_as_a_numeric_non_root_user() -> None:
    runtime = stages()[-1][2]
    users = [rest for keyword, rest in runtime if keyword == "USER"]
    assert users == ["10001:10001"]
    uid, gid = (int(x) for x in users[0].split(":"))
    assert uid != 0 and gid != 0
    creates = " ".join(rest for keyword, rest in runtime if keyword == "RUN")
    assert f"--uid {uid}" in creates and f"--gid {gid}" in creates
    # The USER comes after every RUN (they need root), before the entrypoint.
    keywords = [keyword for keyword, _ in runtime]
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    # The manifests and the compose secret expect this very user.
    for path in (K8S / "base" / "worker.yaml", K8S / "base" / "math-agent.yaml"):
        deployment = next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "Deployment")
        security = deployment["spec"]["template"]["spec"]["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["x-agentroster"]["secrets"][0]["uid"] == str(uid)


def test_entrypoint_is_the_agentroster_command() -> None:
    runtime = stages()[-1][2]
    final = {keyword: rest for keyword, rest in runtime}
    assert json.loads(final["ENTRYPOINT"]) == ["agentroster"]
    assert json.loads(final["CMD"]) == ["worker"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["agentroster"] == "agentroster.workers.cli:main"
    assert [k for k, _ in runtime][-2:] == ["ENTRYPOINT", "CMD"]


def _healthcheck() -> tuple[dict[str, str], list[str]]:
    runtime = stages()[-1][2]
    (check,) = [rest for keyword, rest in runtime if keyword == "HEALTHCHECK"]
    options = dict(re.findall(r"--([\w-]+)=(\S+)", check))
    command = check[check.index("CMD") + 3 :].strip()
    return options, json.loads(command)


def test_healthcheck_declared() -> None:
    options, argv = _healthcheck()
    assert set(options) == {"interval", "timeout", "start-period", "retries"}
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "HEALTHCHECK", "exec")
    # The worker's metrics port: the same default as the manifests.
    assert "'9464'" in argv[2] and "'8080'" in argv[2]


class _Handler(BaseHTTPRequestHandler):
    statuses: dict[str, int] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status = self.statuses.get(self.path, 404)
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _server(statuses: dict[str, int]) -> Iterator[int]:
    handler = type("Handler", (_Handler,), {"statuses": statuses})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _run_check(env: dict[str, str]) -> int:
    _, argv = _healthcheck()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "AGENTROSTER_"))}
    result = subprocess.run([sys.executable, *argv[1:]], env={**clean, **env}, capture_output=True, timeout=30, check=False)
    return result.returncode


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_of_an_agent(status: int, healthy: bool) -> None:
    with _server({"/ready": status, "/metrics": 200}) as port:
        code = _run_check({"AGENT_DEPLOYMENT": "math-agent", "AGENT_PORT": str(port), "AGENTROSTER_METRICS_PORT": str(port)})
    assert (code == 0) is healthy


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (500, False)])
def test_healthcheck_of_the_worker(status: int, healthy: bool) -> None:
    with _server({"/metrics": status, "/ready": 200}) as port:
        code = _run_check({"AGENTROSTER_METRICS_PORT": str(port), "AGENT_PORT": str(port)})
    assert (code == 0) is healthy


def test_healthcheck_fails_when_nothing_listens() -> None:
    with _server({}) as port:
        pass  # closed: nothing listens on that port any more
    assert _run_check({"AGENTROSTER_METRICS_PORT": str(port)}) != 0


def test_dockerignore() -> None:
    patterns = [
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("pyproject.toml", "README.md", "agentroster", "examples"):
        assert needed not in patterns
    # Secrets never enter the build context.
    for secret in (".env", ".git"):
        assert secret in patterns
