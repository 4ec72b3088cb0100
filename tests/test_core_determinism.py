"""`agentroster.core` and `agentroster.workflows` stay deterministic: no clocks,
randomness, I/O or environment but the workflow API's own.

Both are passed through Temporal's sandbox (`workflows.PASSTHROUGH_MODULES`: each run
would otherwise import its workflow module again, ~110 objects per cached run), so the
sandbox checks none of their code; a replay that diverges because one read a clock is
only found in production. Two guards:

* static (ast): every module under agentroster/core and agentroster/workflows may
  import only what is on an allowlist (a new import must be added here,
  consciously), and may not call or reference clocks, randomness, I/O, the
  environment or process-dependent values; a workflow module reads the time and
  randomness through `workflow.now()`, `workflow.uuid4()`, `workflow.random()`,
  uses asyncio only for the names listed, and keeps no mutable module-level
  state (the module is shared by every run in the worker);
* runtime: a PoolCore and an AgentLifecycle scenario run with clocks and
  randomness patched to raise give identical state dumps twice, and in two
  processes with different hash seeds (set iteration order must not leak).
"""

from __future__ import annotations

import ast
import datetime as dt
import importlib
import json
import os
import random
import secrets
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import agentroster.core
import agentroster.workflows

CORE_DIR = Path(agentroster.core.__file__).parent
WORKFLOWS_DIR = Path(agentroster.workflows.__file__).parent
REPO_ROOT = CORE_DIR.parent.parent

# Top-level modules core may import: pure, deterministic libraries only.
# `datetime` is for types and arithmetic; its clock reads are forbidden below.
ALLOWED_LIBRARIES = frozenset({
    "__future__", "abc", "base64", "bisect", "collections", "dataclasses", "datetime", "enum", "functools",
    "hashlib", "heapq", "itertools", "json", "math", "re", "typing",
    "packaging", "pydantic", "sortedcontainers", "zlib",
})
# agentroster modules core may import (and everything under agentroster.core).
ALLOWED_AGENTROSTER = frozenset({"agentroster.errors", "agentroster.models", "agentroster.messages", "agentroster.vocabulary", "agentroster.core"})

# Builtins that do I/O or depend on the process (id: an address; hash: salted per process).
FORBIDDEN_BUILTINS = frozenset({
    "open", "print", "input", "exec", "eval", "compile", "__import__", "breakpoint", "id", "hash",
})
# Attributes that read a clock, randomness or the environment, whatever they are reached through
# (also as references: `default_factory=datetime.now` is a clock read too).
FORBIDDEN_ATTRIBUTES = frozenset({
    "now", "utcnow", "today", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
    "process_time", "time_ns", "environ", "getenv", "urandom", "uuid1", "uuid4", "getrandbits",
})
# Modules not to be used at all: a second line behind the allowlist, for one reached without
# its own import (e.g. re-exported by an allowed module).
FORBIDDEN_ROOTS = frozenset({"time", "random", "secrets", "os", "sys", "uuid", "socket", "asyncio", "threading"})


@dataclass(frozen=True)
class Rules:
    """What one layer's modules may import and use."""

    libraries: frozenset[str]
    agentroster: frozenset[str]
    roots: frozenset[str]  # module names not to be used at all
    allowed: frozenset[str] = frozenset()  # dotted names allowed although a part of them is forbidden
    only: frozenset[str] = frozenset()  # modules of which only the `allowed` names may be used
    module_state: bool = True  # mutable module-level values allowed


CORE = Rules(ALLOWED_LIBRARIES, ALLOWED_AGENTROSTER, FORBIDDEN_ROOTS)
# A workflow module reads the clock and randomness through the workflow API (replayed from
# history), and uses asyncio's names for the workflow's own event loop (deterministic).
WORKFLOW_ASYNCIO = frozenset({
    "asyncio.TimeoutError", "asyncio.CancelledError", "asyncio.Future", "asyncio.ensure_future",
    "asyncio.FIRST_COMPLETED", "asyncio.wait", "asyncio.gather", "asyncio.sleep", "asyncio.Event",
})
WORKFLOWS = Rules(
    libraries=ALLOWED_LIBRARIES | {"asyncio", "temporalio"},
    agentroster=ALLOWED_AGENTROSTER | {"agentroster.workflows"},
    roots=FORBIDDEN_ROOTS - {"asyncio"},
    allowed=WORKFLOW_ASYNCIO | {"workflow.now", "workflow.uuid4", "workflow.random"},
    only=frozenset({"asyncio"}),
    module_state=False,
)
# The temporalio modules a workflow module may import: the workflow API and its types.
WORKFLOW_TEMPORALIO = ("temporalio.workflow", "temporalio.common", "temporalio.exceptions", "temporalio.worker.workflow_sandbox")


def core_modules() -> list[Path]:
    """Every Python file under agentroster/core, discovered rather than listed."""
    found = sorted(CORE_DIR.rglob("*.py"))
    assert len(found) >= 6, f"expected the core modules under {CORE_DIR}, found {found}"
    return found


def workflow_modules() -> list[Path]:
    """Every Python file under agentroster/workflows."""
    found = sorted(WORKFLOWS_DIR.rglob("*.py"))
    assert len(found) >= 5, f"expected the workflow modules under {WORKFLOWS_DIR}, found {found}"
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Absolute names of the modules an import statement reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join([*base, node.module] if node.module else base)
    else:
        module = node.module or ""
    if module in ("agentroster", "temporalio"):  # `from agentroster import models` reaches agentroster.models
        return [f"{module}.{alias.name}" for alias in node.names]
    return [module]


def _under(module: str, packages: Any) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _import_allowed(module: str, rules: Rules) -> bool:
    root = module.split(".")[0]
    if root == "agentroster":
        return _under(module, rules.agentroster)
    if root == "temporalio":
        return "temporalio" in rules.libraries and _under(module, WORKFLOW_TEMPORALIO)
    return root in rules.libraries


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of names and attributes, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


MUTABLE_DISPLAYS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
MUTABLE_FACTORIES = frozenset({"list", "dict", "set", "bytearray", "deque", "defaultdict", "OrderedDict", "Counter"})


def _module_state(tree: ast.Module, name: str) -> list[str]:
    """Module-level and class-level assignments of mutable values (shared by every run of a
    passed-through module)."""
    found = []
    bodies = [tree.body, *(n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]
    for node in (statement for body in bodies for statement in body):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if value is None or any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        factory = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
        if isinstance(value, MUTABLE_DISPLAYS) or factory in MUTABLE_FACTORIES:
            found.append(f"{name}:{node.lineno}: module-level mutable state")
    return found


def violations(source: str, name: str, is_package: bool = False, rules: Rules = CORE) -> list[str]:
    """Every determinism rule `source` (module `name`) breaks, with its line."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found: list[str] = [] if rules.module_state else _module_state(tree, name)
    # A parameter of that name (a workflow's `input`) is not the builtin.
    parameters = {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    # Allowed dotted names are checked whole: their parts are not reported on their own.
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _dotted(node) in rules.allowed:
            exempt.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for module in _imported(node, package):
                if not _import_allowed(module, rules):
                    found.append(f"{where}: imports {module} (not on the allowlist)")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_BUILTINS:
                found.append(f"{where}: calls {func.id}()")
            elif isinstance(func, ast.Attribute) and func.attr == "fromtimestamp" and not any(
                k.arg == "tz" for k in node.keywords
            ) and len(node.args) < 2:
                found.append(f"{where}: fromtimestamp() without tz= depends on the machine's time zone")
            elif isinstance(func, ast.Attribute) and func.attr == "astimezone" and not node.args and not node.keywords:
                found.append(f"{where}: astimezone() without a zone depends on the machine's time zone")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in rules.only:
            found.append(f"{where}: uses {_dotted(node)} (only {', '.join(sorted(n for n in rules.allowed if n.startswith(node.value.id + '.')))})")
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
            found.append(f"{where}: uses {_dotted(node) or '.' + node.attr}")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in rules.roots:
                found.append(f"{where}: uses {node.id}")
            elif node.id in FORBIDDEN_BUILTINS - {"id", "hash"} - parameters:  # e.g. `key=print`; `id` is a common local
                found.append(f"{where}: refers to {node.id}")
    return sorted(set(found))


# ------------------------------------------------------------------ static


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.name)
def test_core_module_is_deterministic(path: Path) -> None:
    assert violations(path.read_text(), module_name(path), is_package=path.name == "__init__.py") == []


@pytest.mark.parametrize("path", workflow_modules(), ids=lambda p: p.name)
def test_workflow_module_is_deterministic(path: Path) -> None:
    assert violations(path.read_text(), module_name(path), is_package=path.name == "__init__.py", rules=WORKFLOWS) == []


def test_the_workflow_package_is_passed_through_the_sandbox() -> None:
    """What the static guard above stands in for: the sandbox does not check this code."""
    from agentroster.workflows import PASSTHROUGH_MODULES

    assert "agentroster.workflows" in PASSTHROUGH_MODULES and "agentroster.core" in PASSTHROUGH_MODULES


BAD_SNIPPETS = {
    "import time": "import time",
    "import time as clock": "import time as clock",
    "from time import monotonic": "from time import monotonic",
    "import random": "import random\n",
    "from os import environ": "from os import environ",
    "import logging": "import logging",
    "import temporalio": "from temporalio import workflow",
    "workflows": "from agentroster.workflows.agent import AgentWorkflow",
    "from agentroster import client": "from agentroster import client",
    "relative escape": "from ..activities import roster",
    "import in a function": "def f():\n    import uuid\n    return uuid",
    "datetime.now": "from datetime import datetime\nx = datetime.now()",
    "datetime.utcnow": "import datetime\nx = datetime.datetime.utcnow()",
    "date.today": "from datetime import date\nx = date.today()",
    "default_factory=datetime.now": "from datetime import datetime\nf = dict(default_factory=datetime.now)",
    "fromtimestamp without tz": "from datetime import datetime\nx = datetime.fromtimestamp(0)",
    "open": "open('state.json')",
    "print": "print('hi')",
    "key=print": "x = sorted([1], key=print)",
    "input": "input()",
    "hash": "x = hash('a')",
    "os.environ via import": "import os\nx = os.environ['A']",
    "getenv": "import os\nx = os.getenv('A')",
    "uuid4": "from uuid import uuid4\nx = uuid4()",
    "random.choice": "import random\nx = random.choice([1])",
}


BAD_WORKFLOW_SNIPPETS = {
    **{k: v for k, v in BAD_SNIPPETS.items() if k not in ("import temporalio", "workflows")},
    "time.monotonic": "import time\nx = time.monotonic()",
    "asyncio.get_event_loop().time": "import asyncio\nx = asyncio.get_event_loop().time()",
    "asyncio.run": "import asyncio\nasyncio.run(f())",
    "a client": "from temporalio.client import Client",
    "activities": "from agentroster.activities.roster import RosterActivities",
    "module-level dict": "SEEN = {}",
    "module-level list": "SEEN: list[str] = []",
    "module-level set()": "SEEN = set()",
    "module-level deque": "from collections import deque\nQ = deque()",
    "class-level list": "class W:\n    seen: list[str] = []",
    "datetime.now beside workflow.now": "from datetime import datetime\nfrom temporalio import workflow\nx = workflow.now()\ny = datetime.now()",
}


CAUGHT = [
    *(pytest.param(CORE, "agentroster.core.example", source, id=f"core: {name}") for name, source in BAD_SNIPPETS.items()),
    *(pytest.param(WORKFLOWS, "agentroster.workflows.example", source, id=f"workflows: {name}")
      for name, source in BAD_WORKFLOW_SNIPPETS.items()),
]


@pytest.mark.parametrize(("rules", "name", "source"), CAUGHT)
def test_the_checker_catches(rules: Rules, name: str, source: str) -> None:
    """The static guard itself: each of these must be reported, under its layer's rules."""
    assert violations(source, name, rules=rules) != []


def test_the_workflow_checker_lets_the_workflow_api_through() -> None:
    source = """
from __future__ import annotations
import asyncio
from datetime import timedelta
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
with workflow.unsafe.imports_passed_through():
    from agentroster.core.pool import PoolCore
    import agentroster.workflows.messages as messages
RETRY = RetryPolicy(maximum_attempts=2)
KINDS = ("deliver", "told")

async def run() -> None:
    now = workflow.now().timestamp()
    key = workflow.uuid4().hex
    pick = workflow.random().random()
    try:
        await workflow.wait_condition(lambda: False, timeout=timedelta(seconds=1))
    except asyncio.TimeoutError:
        pass
"""
    assert violations(source, "agentroster.workflows.example", rules=WORKFLOWS) == []


def test_the_checker_lets_pure_code_through() -> None:
    source = """
from __future__ import annotations
import heapq
from collections import OrderedDict
from datetime import datetime, timedelta, timezone
from pydantic import BaseModel
from agentroster.models import AgentState
from agentroster.core.leases import LeaseBook
from . import drift
from .index import CapabilityIndex

def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc) + timedelta(seconds=1)
"""
    assert violations(source, "agentroster.core.example") == []


# ------------------------------------------------------------------ runtime


def scenario() -> dict[str, Any]:
    """A PoolCore and an AgentLifecycle driven through a fixed script; every output, as JSON data."""
    from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest, LoadNotice
    from agentroster.models import AgentRegistration, AgentState, Capability
    from agentroster.core.lifecycle import AgentLifecycle
    from agentroster.core.pool import PoolCore, PoolCoreState

    S = AgentState
    counter = iter(range(1_000_000))

    def new_id() -> str:
        return f"id-{next(counter):06d}"

    out: dict[str, Any] = {"pool": [], "life": []}
    core = PoolCore("prod", scale_window_s=5.0, epoch="e1")
    t = 1_767_225_600.0  # 2026-01-01, in seconds since the epoch
    agents = [(f"agent-{i}", f"deploy-{i % 3}", "ABC"[i % 3], f"2.{i % 4}.0") for i in range(12)]
    for agent_id, deployment, cost, version in agents:
        core.agent_snapshot(
            AgentSnapshot(
                agent_id=agent_id, deployment=deployment, endpoint=f"http://{agent_id}:9000", state=S.REGISTERING,
                capabilities=[
                    CapabilityDigest(name="rag.search", version=version, max_concurrency=2, cost_class=cost),
                    CapabilityDigest(name="math.eval", version="1.0.0", max_concurrency=1, cost_class=cost),
                ],
                resync_interval_s=30.0,
            ),
            t, new_id,
        )
    for agent_id in core.take_verifications():  # as the workflow's check would answer: they run
        core.agent_verified(agent_id, True, t, new_id)
    leases = []
    for i in range(40):
        t += 0.5
        reply = core.acquire(
            AcquireRequest(ref="rag.search@>=2.1" if i % 2 else "math.eval", lease_ttl_s=20 + i, wait_s=3, request_id=f"request-secret-{i:06d}"),
            t, new_id,
        )
        out["pool"].append(reply.model_dump(mode="json"))
        if reply.lease is not None:
            leases.append(reply.lease.lease_id)
    for lease_id in leases[::3]:
        t += 0.25
        out["pool"].append(core.release(lease_id, t, new_id))
    core.agent_snapshot(AgentSnapshot(agent_id="agent-4", deployment="deploy-1", endpoint="http://agent-4:9000", state=S.DRAINING), t, new_id)
    core.agent_gone("agent-7", "heartbeat_lost", t, new_id)
    from agentroster.messages import EvictionAsk

    for agent_id in ("agent-0", "agent-2", "agent-3", "agent-5", "agent-6", "agent-8", "agent-9"):  # a mass silence
        t += 0.1
        out["pool"].append(core.may_evict(EvictionAsk(agent_id=agent_id, window_s=30.0), t).model_dump(mode="json"))
    out["pool"].append(core.confirm_evictions(["agent-9", "agent-3"], t))
    core.agent_snapshot(AgentSnapshot(agent_id="agent-0", deployment="deploy-0", endpoint="http://agent-0:9000", state=S.TERMINATED), t, new_id)
    out["pool"].append(core.to_state().model_dump(mode="json"))  # with leases, waiters and pending notices
    for _ in range(24):  # lease expiries, abandoned waiters, scale windows, agents gone silent
        t += 5.0
        out["pool"].append([r.lease_id for r in core.tick(t, new_id)])
        out["pool"].append([r.model_dump(mode="json") for r in core.take_scale_requests(t)])
        out["pool"].append([[a, s, n.model_dump(mode="json")] for a, s, n in core.take_notices()])
        out["pool"].append([[h, r.model_dump(mode="json")] for h, r in core.take_revocations()])
        out["pool"].append(core.take_warnings())
    out["pool"].append(core.status().model_dump(mode="json"))
    state = core.to_state().model_dump(mode="json")
    out["pool"].append(state)
    out["pool"].append(PoolCore.from_state(PoolCoreState.model_validate(state)).to_state().model_dump(mode="json"))
    from agentroster.core.state_codec import encode_state

    out["pool"].append(encode_state(core.to_state()))  # packed bytes must not depend on the process

    now = core_time = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    out["life"].append([s.model_dump(mode="json") for s in life.spawn(now)])
    reg = AgentRegistration(
        agent_id="agent-1", deployment="d", endpoint="http://agent-1:9000",
        capabilities=[Capability(name="rag.search", version="2.1.0", max_concurrency=1)],
    )
    out["life"].append([s.model_dump(mode="json") for s in life.register(reg, now + dt.timedelta(seconds=1))])
    out["life"].append([s.model_dump(mode="json") for s in life.indexed(now + dt.timedelta(seconds=2))])
    for seq in range(1, 40):
        core_time = now + dt.timedelta(seconds=2 + seq)
        life.heartbeat(core_time)
        notice = LoadNotice(in_flight=seq % 2, saturated=bool(seq % 2), seq=seq, epoch="e1")
        out["life"].append([s.model_dump(mode="json") for s in life.apply_load(notice, core_time)])
        out["life"].append(life.next_wakeup().isoformat())
    life.hold_eviction("self-preservation", 3.0, core_time)
    out["life"].append([life.next_wakeup().isoformat(), life.eviction_retry_due(core_time + dt.timedelta(seconds=4)), life.to_carried()])
    out["life"].append([s.model_dump(mode="json") for s in life.drain("rollout", 30, core_time)])
    out["life"].append(life.drain_finished(core_time + dt.timedelta(seconds=31)))
    out["life"].append([s.model_dump(mode="json") for s in life.terminate("drain", core_time + dt.timedelta(seconds=31))])
    out["life"].append(life.status().model_dump(mode="json"))
    out["life"].append(life.to_carried())
    out["life"].append(AgentLifecycle.from_carried(json.loads(json.dumps(life.to_carried()))) == life)
    return out


REAL_DATETIME, REAL_DATE = dt.datetime, dt.date


def _refuse(*_: Any, **__: Any) -> Any:
    raise AssertionError("agentroster.core read a clock, randomness or the environment")


class _NoClockDatetime(dt.datetime):
    """datetime for types and arithmetic; reading the clock raises."""

    now = classmethod(_refuse)  # type: ignore[assignment]
    utcnow = classmethod(_refuse)  # type: ignore[assignment]
    today = classmethod(_refuse)  # type: ignore[assignment]


class _NoClockDate(dt.date):
    today = classmethod(_refuse)  # type: ignore[assignment]


def _patch_sources_of_nondeterminism(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, names in (
        (time, ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "process_time")),
        (random, ("random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform", "getrandbits")),
        (secrets, ("token_bytes", "token_hex", "token_urlsafe", "randbits", "choice")),
        (uuid, ("uuid1", "uuid4")),
        (os, ("urandom", "getenv")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, _refuse)
    monkeypatch.setattr(dt, "datetime", _NoClockDatetime)
    monkeypatch.setattr(dt, "date", _NoClockDate)
    # Modules that did `from datetime import datetime` hold the real class: swap it there too.
    for name in [module_name(p) for p in core_modules()] + ["agentroster.models"]:
        module = importlib.import_module(name)
        if getattr(module, "datetime", None) is REAL_DATETIME:
            monkeypatch.setattr(module, "datetime", _NoClockDatetime)
        if getattr(module, "date", None) is REAL_DATE:
            monkeypatch.setattr(module, "date", _NoClockDate)


def test_core_scenario_runs_without_clocks_and_gives_the_same_result_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_sources_of_nondeterminism(monkeypatch)
    with pytest.raises(AssertionError):  # the patches bite
        dt.datetime.now()
    first = scenario()
    second = scenario()
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert first["life"][-1] is True  # the carry round trip held
    assert any(isinstance(r, dict) and r.get("lease") for r in first["pool"])  # leases were granted
    assert any(isinstance(r, dict) and r.get("ticket") for r in first["pool"])  # and callers queued


def test_core_scenario_does_not_depend_on_the_hash_seed() -> None:
    """Two processes, two hash seeds: iteration over sets of strings must not leak into results."""
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run(
            [sys.executable, "-c", "import json; from tests.test_core_determinism import scenario; print(json.dumps(scenario(), sort_keys=True))"],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
        )
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout)
    assert outputs[0] == outputs[1]
