"""The query rule (`transport.query_workflow`): every query our code sends gives up before the
workers' sticky timeout and is asked again, so none reaches a restarted worker with events no
workflow task has handled (the trigger of temporalio/sdk-python#1591 found here;
benchmarks/repro_cold_start_nde.py shows it without the rule)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from agentroster.client.transport import query_workflow
from agentroster.vocabulary.wire import QUERY_RPC_TIMEOUT, STICKY_TIMEOUT

PACKAGE = Path(__file__).resolve().parent.parent / "agentroster"


def test_a_query_gives_up_before_the_sticky_queue_hands_it_on() -> None:
    from agentroster.client.roster import TICKET_POLL_GIVE_UP_S, TICKET_POLL_HEDGE_S, TICKET_POLLS_IN_FLIGHT

    assert QUERY_RPC_TIMEOUT < STICKY_TIMEOUT
    # Ticket polls go through the rule too; the watcher gives the oldest up no later...
    assert TICKET_POLL_GIVE_UP_S <= QUERY_RPC_TIMEOUT.total_seconds()
    # ...and a full set of hedges fits before it does.
    assert TICKET_POLL_HEDGE_S * (TICKET_POLLS_IN_FLIGHT - 1) < TICKET_POLL_GIVE_UP_S


async def test_the_worker_hands_tasks_on_at_the_sticky_timeout_the_rule_is_measured_against(dev_env) -> None:
    from agentroster.workers.worker import create_worker

    worker = create_worker(dev_env.client, task_queue="query-rule", check_search_attributes=False)
    assert worker.config()["sticky_queue_schedule_to_start_timeout"] == STICKY_TIMEOUT
    # A shorter sticky timeout would hand queries on before they give up: refused.
    with pytest.raises(ValueError, match="sticky_queue_schedule_to_start_timeout: 1 s must be longer than the queries' deadline"):
        create_worker(dev_env.client, task_queue="query-rule", check_search_attributes=False,
                      sticky_queue_schedule_to_start_timeout=timedelta(seconds=1))


def _query_calls(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing function) of every `<x>.query(...)` call in `path`, decorators aside."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for part in (node.args, *node.body):  # not its decorators (`@workflow.query`)
                visit(part, node.name)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "query":
            found.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text(), str(path)), "<module>")
    return found


def _all_query_calls() -> list[str]:
    return sorted(
        f"{path.relative_to(PACKAGE.parent)}:{line} in {function}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, function in _query_calls(path)
    )


def test_every_query_of_the_package_goes_through_query_workflow() -> None:
    # Parsed in a process of its own: CPython 3.11's AST constructor keeps one recursion
    # counter per interpreter, and a worker's sandbox compiling in another thread of this
    # one makes `ast.parse` fail with "AST constructor recursion depth mismatch".
    script = "import json, tests.test_query_rule as t; print(json.dumps(t._all_query_calls()))"
    done = subprocess.run([sys.executable, "-c", script], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    calls = set(json.loads(done.stdout))
    allowed = {c for c in calls if c.startswith("agentroster/client/transport.py:") and c.endswith(" in once")}
    assert len(allowed) == 1, calls  # the one call, inside query_workflow
    assert calls == allowed, f"queries sent without transport.query_workflow: {sorted(calls - allowed)}"


async def test_a_caller_cannot_lengthen_a_querys_deadline() -> None:
    with pytest.raises(TypeError, match="rpc_timeout is always wire.QUERY_RPC_TIMEOUT"):
        await query_workflow(object(), "status", rpc_timeout=STICKY_TIMEOUT)  # type: ignore[arg-type]
