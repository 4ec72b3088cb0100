"""The example agents' own logic (no server), and the example plan end to end."""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import pytest
from temporalio.worker import Worker

from agentroster.agent.runtime import AgentRuntime
from agentroster.workflows import workflow_runner
from examples import code_agent, math_agent, search_agent
from examples.code_agent import run_python
from examples.math_agent import ExpressionError, evaluate
from examples.search_agent import BM25Index, tokenize
from examples.supervisor import EXAMPLE_WORKFLOWS, run_plan

# ----------------------------------------------------------------- math.eval


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 10", 1024),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("10 / 4", 2.5),
        ("+-3", -3),
        ("sqrt(16) + 1", 5.0),
        ("log(8, 2)", 3.0),
        ("cos(0) + sin(0)", 1.0),
        ("2 * pi", math.tau),
        ("e ** 0", 1.0),
        ("1.5e3", 1500.0),
    ],
)
def test_math_evaluates(expression: str, expected: float) -> None:
    assert evaluate(expression) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("x + 1", "unknown name 'x'"),
        ("open('/etc/passwd')", "calling 'open' is not allowed"),
        ("math.sqrt(4)", "not allowed"),
        ("9 ** 9 ** 9", "more than 4096 bits"),
        ("10 ** 5000", "more than 4096 bits"),
        ("2.0 ** 100000", "too large"),
        ("exp(1000)", "too large"),
        ("1 / 0", "division by zero"),
        ("sqrt(-1)", "cannot evaluate"),
        ("'abc'", "only numbers"),
        ("True + 1", "only numbers"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 << 100", "LShift is not allowed"),
        ("1 +", "not an expression"),
        ("", "non-empty"),
        ("1+" * 600 + "1", "over the 1000 limit"),
    ],
)
def test_math_refuses(expression: str, reason: str) -> None:
    with pytest.raises(ExpressionError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expression)


def test_math_huge_power_refused_quickly() -> None:
    started = time.monotonic()
    with pytest.raises(ExpressionError):
        evaluate("(2 ** 4000) ** 4000")
    assert time.monotonic() - started < 1.0  # refused before computing, not after


# ---------------------------------------------------------------- rag.search


def test_bm25_obvious_document_ranks_first() -> None:
    index = BM25Index.from_file()
    assert index.search("pod deletion cost", 3)[0].id == "k8s-deletion-cost"
    assert index.search("continue-as-new history", 3)[0].id == "continue-as-new"
    assert index.search("preStop SIGTERM grace period", 3)[0].id == "k8s-termination"
    assert index.search("agent heartbeats liveness", 3)[0].id == "agent-heartbeats"


def test_bm25_scores_descend_and_k_caps() -> None:
    hits = BM25Index.from_file().search("temporal workflow activity retries", 4)
    assert len(hits) == 4
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert BM25Index.from_file().search("zzz qqq", 5) == []


def test_bm25_rare_terms_weigh_more() -> None:
    docs = [
        {"id": "a", "title": "one", "text": "agent agent agent common"},
        {"id": "b", "title": "two", "text": "agent common rare"},
        {"id": "c", "title": "three", "text": "agent common"},
    ]
    index = BM25Index(docs)
    assert [h.id for h in index.search("agent rare")][0] == "b"
    assert tokenize("The Heartbeats of agents") == ["heartbeat", "agent"]


# ------------------------------------------------------------ code.python.exec


async def test_code_runner_stdout_and_stderr() -> None:
    result = await run_python("import sys\nprint('hello', 6 * 7)\nprint('warn', file=sys.stderr)")
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("hello 42\n", "warn\n", 0, False)


async def test_code_runner_nonzero_exit_and_exception() -> None:
    assert (await run_python("import sys; sys.exit(3)")).exit_code == 3
    failed = await run_python("raise ValueError('boom')")
    assert failed.exit_code == 1 and "ValueError: boom" in failed.stderr


async def test_code_runner_timeout_kills_it() -> None:
    started = time.monotonic()
    result = await run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=0.5)
    assert result.timed_out and result.exit_code != 0
    assert result.stdout == "started\n"
    assert time.monotonic() - started < 10


async def test_code_runner_isolated_env_and_capped_output() -> None:
    env = await run_python("import os; print(sorted(os.environ))")
    assert env.stdout.strip() == "['LANG', 'LC_ALL', 'PATH']"
    big = await run_python("print('x' * 200_000)", max_output_bytes=1000)
    assert big.stdout.startswith("x" * 1000) and "truncated" in big.stdout and len(big.stdout) < 1100


async def test_code_runner_background_child_does_not_hang_it() -> None:
    code = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nprint('parent done')"
    result = await run_python(code, timeout_s=20)
    assert result.stdout == "parent done\n" and not result.timed_out


# ------------------------------------------------------------ the example plan


async def test_example_plan_runs_by_capability_refs(stack) -> None:
    env = {"AGENT_PORT": "0", "AGENT_HOST": "127.0.0.1", "HEARTBEAT_INTERVAL_S": "5"}
    agents: list[AgentRuntime] = [
        module.build_agent(env, agent_id=f"{module.__name__.split('.')[-1].replace('_', '-')}-{uuid.uuid4().hex[:6]}", roster=stack.roster)
        for module in (math_agent, search_agent, code_agent)
    ]
    # A small worker of its own for the plan, on its own queue (so the stack's worker, which
    # does not know ExamplePlanWorkflow, never picks it up); the children run on the stack's queue.
    plan_queue = f"{stack.task_queue}-plans"
    worker = Worker(stack.env.client, task_queue=plan_queue, workflows=EXAMPLE_WORKFLOWS, workflow_runner=workflow_runner())
    async with worker:
        for agent in agents:
            await agent.start()
        try:
            await asyncio.gather(*(agent.wait_ready(20) for agent in agents))
            summary = await run_plan(stack.roster, query="agent heartbeats", expression="sqrt(16) + 2**10", task_queue=plan_queue)
        finally:
            await asyncio.gather(*(agent.stop(drain=False) for agent in agents))
    assert summary.top_document == "Agent heartbeats and liveness in the roster"
    assert summary.value == 1028.0
    assert summary.code_stdout == f"{summary.hits} 2056.0"
    assert set(summary.agents) == {"rag.search@2.1.0", "math.eval@1.0.0", "code.python.exec@1.0.0"}
    assert summary.attempts == 3
