"""The reliability harness (benchmarks/chaos.py), reduced, as a test: its own dev server
(a process killed with SIGKILL and restarted on the same port and database), the worker
CLI in its own process (killed with SIGKILL and restarted), three agent runtime
processes, 16 clients; ~440 malformed messages; a lease theft attempt; a 2,000-agent
continue-as-new; one of four agents broken, then hung, then healthy under `roster.invoke`,
then its pool's workflow terminated. The harness runs once for the module; each test reads its row.

Invariants only: timing (recovery, continue-as-new) is printed by the harness, never
asserted here (the machines are shared and noisy).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from benchmarks.chaos import Config, Row, format_table, run_chaos

pytestmark = pytest.mark.slow


# One harness run per process, even if pytest sets the module fixture up again.
_RUN: dict[str, Row] = {}


@pytest_asyncio.fixture(scope="module")
async def rows() -> AsyncIterator[dict[str, Row]]:
    if not _RUN:
        result = await run_chaos(Config.quick(scenarios=("worker", "server", "poison", "theft", "can", "outlier")))
        print("\n" + format_table(result))
        _RUN.update({row.scenario.split(".")[0]: row for row in result})
    yield _RUN


def _row(rows: dict[str, Row], key: str) -> Row:
    """The scenario's row; a scenario that aborted fails its tests with where and why."""
    aborted = [problem for row in rows.values() if "(aborted)" in row.scenario for problem in row.problems]
    assert key in rows, aborted
    row = rows[key]
    assert "(aborted)" not in row.scenario, row.problems
    return row


def _held(row: Row) -> None:
    assert row.double == 0, row.details or row.problems
    assert row.leases and row.leases > 0
    assert row.leaked == 0, row.problems
    assert row.errors == 0, row.problems + row.details
    assert row.wft_failed == 0 and row.replay_failed == 0, row.details
    assert row.recovery and all(math.isfinite(r) for r in row.recovery), "a lease was granted after every restart"
    assert row.ok, row.problems + row.details  # a stuck client's details say where it waits


async def test_worker_kill_loses_and_doubles_nothing(rows: dict[str, Row]) -> None:
    _held(_row(rows, "1"))


async def test_server_kill_loses_and_doubles_nothing(rows: dict[str, Row]) -> None:
    _held(_row(rows, "2"))


async def test_malformed_messages_fail_no_workflow_task(rows: dict[str, Row]) -> None:
    row = _row(rows, "3")
    assert row.facts["sent"] >= 300 and set(row.facts["by_target"]) == {"pool", "agent", "task"}
    assert row.wft_failed == 0 and row.replay_failed == 0 and row.leaked == 0
    assert row.facts["task_completed"]
    assert row.ok, row.problems  # the pool still grants, every agent is still routable


async def test_guessing_ids_steals_nothing(rows: dict[str, Row]) -> None:
    row = _row(rows, "4a")
    # The attacker's arithmetic is right (the random half of the victim's lease id was one of
    # its guesses), so "no theft" means the caller's secret is what protects the lease.
    assert row.facts["guess_index_of_random_half"] is not None
    assert row.thefts == 0 and row.double == 0, row.details
    assert row.wft_failed == 0 and row.replay_failed == 0


async def test_forged_agent_snapshots_steal_nothing(rows: dict[str, Row]) -> None:
    # Fixed by the pool's snapshot-as-hint patch: it applies what the agent workflow itself reports.
    row = _row(rows, "4b")
    assert row.thefts == 0 and row.double == 0, row.details
    assert row.facts["extra_leases"] == 0 and row.facts["refused"] >= 1, row.notes


async def test_continue_as_new_carries_every_agent_and_lease(rows: dict[str, Row]) -> None:
    row = _row(rows, "5")
    assert row.facts["continued"] and row.facts["agents"] == 2_000
    assert row.wft_failed == 0 and row.replay_failed == 0
    assert row.ok, row.problems


def test_an_unknown_scenario_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.chaos import main

    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--scenarios", "worker,1"])
    assert exit_.value.code == 2
    assert "--scenarios: unknown '1'; choose from worker, server, poison, theft, can" in capsys.readouterr().err


def test_each_kill_rows_slowest_recovery_is_printed_beside_its_target() -> None:
    from benchmarks.chaos import recovery_lines

    rows = [
        Row("1. worker kill -9 x2", recovery=[0.4, 2.9]),
        Row("2. server kill -9 x1", recovery=[3.2]),
        Row("3. malformed messages"),
        Row("1. worker kill -9 x1", recovery=[float("inf")]),  # no lease came after the restart
    ]
    assert recovery_lines(rows) == [
        "1. worker kill -9 x2: first lease at most 2.90 s after the restart (target < 3 s): met",
        "2. server kill -9 x1: first lease at most 3.20 s after the restart (target < 3 s): MISSED",
        "1. worker kill -9 x1: first lease at most inf s after the restart (target < 3 s): MISSED",
    ]


def test_a_run_is_recorded_with_its_kills_and_invariants_as_targets(tmp_path) -> None:
    import json

    from benchmarks.chaos import fill_record
    from benchmarks.record import Record

    config = Config(scenarios=("worker", "server"), worker_kills=3, server_kills=2)
    rows = [
        Row("1. worker kill -9 x3", leases=90, double=0, leaked=0, errors=0, recovery=[0.4, 0.9, 0.5], wft_failed=0,
            replay_failed=0, facts={"kills": 3, "wedged": 0, "lost": 0}),
        # The server's pool came back once, then never: one kill short, one wedged pool.
        Row("2. server kill -9 x2", leases=40, double=1, leaked=0, errors=0, recovery=[1.1, float("inf")], wft_failed=0,
            replay_failed=1, facts={"kills": 2, "wedged": 1, "lost": 2}, problems=["no lease was granted after a restart"]),
    ]
    record = Record("chaos")
    fill_record(record, rows, config)
    saved = json.loads(record.write(tmp_path).read_text())
    targets = {name: (t["value"], t["met"]) for name, t in saved["targets"].items()}
    assert targets["worker_kills"] == (3, True) and targets["server_kills"] == (2, True)
    assert targets["replay_failures"] == (1, False) and targets["wedged_pools"] == (1, False)
    assert targets["double_leases"] == (1, False) and targets["lost_leases"] == (2, False)
    assert targets["broken_scenarios"] == (1, False) and not saved["met"]
    assert saved["figures"]["worker_kill_recovery_max_s"] == {"value": 0.9, "unit": "s"}
    assert saved["figures"]["server_kill_recovery_max_s"] == {"value": 1.1, "unit": "s"}  # the finite ones


async def test_a_broken_then_hung_agent_is_ejected_costs_no_task_and_comes_back_and_a_lost_pool_leases_again(rows: dict[str, Row]) -> None:
    row = _row(rows, "6")
    phases = row.facts["phases"]
    threshold = row.facts["threshold"]
    for name in ("broken", "hung"):
        bad = phases[name]
        # ejected, after at most the threshold's tasks and one trial task per ejection
        assert bad["ejections"] >= 1 and bad["reached"] <= threshold + bad["ejections"], bad
    assert all(p["failed"] == 0 for p in phases.values()), row.details
    assert phases["recovery after broken"]["back_s"] is not None and phases["recovery after hung"]["back_s"] is not None
    assert phases["healthy again"]["reached"] >= 1  # routed to again
    # The pool's state lost (its workflow terminated): a fresh run leases again (timing is the record's).
    assert row.facts["state_loss"]["to_lease_s"] is not None, row.problems
    assert row.wft_failed == 0 and row.replay_failed == 0, row.details
    assert row.ok, row.problems


def test_the_outlier_row_records_its_goals_and_the_pool_state_loss(tmp_path) -> None:
    import json

    from benchmarks.chaos import fill_outlier_record
    from benchmarks.chaos_outliers import Phase, StateLoss, judge
    from benchmarks.record import Record

    phases = []
    for name, mode, reached in (("healthy", "ok", 15), ("broken", "fail", 4), ("recovery after broken", "ok", 2),
                                ("hung", "hang", 3), ("recovery after hung", "ok", 2), ("healthy again", "ok", 15)):
        phase = Phase(name, mode, latencies=[0.25] * 60, reached=reached, back_s=2.0 if name.startswith("recovery") else None)
        if mode != "ok":
            phase.first_bad_task, phase.ejections = 100.0, [(103.5, "3 failed tasks in a row")]
        phases.append(phase)
    problems, facts = judge(phases, 3, StateLoss(to_lease_s=1.5, to_all_agents_s=2.5))
    assert problems == []
    record = Record("chaos")
    fill_outlier_record(record, Row("6. outlier", facts=facts))
    saved = json.loads(record.write(tmp_path).read_text())
    assert saved["targets"]["outlier_pool_state_loss_to_lease_s"] == {"value": 1.5, "goal": 20.0, "op": "<=", "unit": "s", "met": True}
    assert saved["targets"]["outlier_hung_ejected"]["met"] and saved["figures"]["outlier_hung_first_bad_task_to_ejection_s"]["value"] == 3.5
    assert saved["figures"]["outlier_hung_first_failure_to_ejection_s"]["value"] == 2.5  # a timeout is known 1 s after the task began
    assert saved["figures"]["outlier_broken_first_failure_to_ejection_s"]["value"] == 3.5  # a 500 at once
    # No lease after the pool's state was lost: a broken invariant and an unmet target.
    problems, facts = judge(phases, 3, StateLoss(error="no lease within 60 s"))
    assert problems == ["pool state lost: no lease within 60 s"]
    record = Record("chaos")
    fill_outlier_record(record, Row("6. outlier", facts=facts))
    assert record.targets["outlier_pool_state_loss_leased"]["met"] is False and "outlier_pool_state_loss_to_lease_s" not in record.targets
