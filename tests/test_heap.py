"""The worker keeps its long-lived objects out of full collections (agentroster.ops.heap).

Each case runs in a fresh interpreter: freezing acts on the whole process, and this one's
other tests must not see it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import eventually


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_round_freezes_what_survives_so_collections_walk_only_what_is_younger() -> None:
    out = run_python(
        """
        import gc
        from agentroster.ops.heap import LongLivedFreezer

        class Node:
            def __init__(self, i): self.i, self.peers = i, [i]

        kept = [Node(i) for i in range(100_000)]  # three tracked objects each: node, its dict's list, ...
        freezer = LongLivedFreezer()
        freezer.step()
        assert freezer.frozen == gc.get_freeze_count() >= 200_000, freezer.frozen
        # A collection walks the generations, never the permanent one: what it tracks now is
        # only what was made since the round.
        young = [Node(i) for i in range(1_000)]
        assert len(gc.get_objects()) < 50_000, len(gc.get_objects())
        print(freezer.freezes, freezer.sweeps)
        """
    )
    assert out.split() == ["1", "1"]  # the first round walked everything: a sweep


def test_a_cycle_that_turns_into_garbage_after_it_was_frozen_is_freed_by_the_next_sweep() -> None:
    out = run_python(
        """
        import gc, weakref
        from agentroster.ops.heap import LongLivedFreezer

        class Node:
            pass

        freezer = LongLivedFreezer()
        assert freezer.step()  # the first round walks everything: a sweep, the baseline
        cycle = Node(); cycle.me = cycle
        alive = weakref.ref(cycle)
        assert not freezer.step()  # one object more: frozen, no sweep
        del cycle  # garbage now, but frozen: no collection reaches it
        gc.collect()
        assert not freezer.step()
        assert alive() is not None
        kept = [Node() for _ in range(freezer.frozen // 3)]  # the frozen set grows by a third
        assert freezer.step()  # swept: unfrozen, collected, the survivors frozen again
        assert alive() is None
        print(freezer.sweeps, freezer.swept == freezer.frozen == gc.get_freeze_count())
        """
    )
    assert out.split() == ["2", "True"]


def test_garbage_made_and_dropped_between_rounds_costs_no_sweep() -> None:
    out = run_python(
        """
        from agentroster.ops.heap import LongLivedFreezer

        class Node:
            pass

        freezer = LongLivedFreezer()
        kept = [Node() for _ in range(50_000)]
        assert freezer.step() and not freezer.step()
        swept = freezer.sweeps
        for _ in range(20):  # an idle worker: each round, objects made, held a while, dropped (some in cycles)
            batch = [Node() for _ in range(20_000)]
            for node in batch[::2]:
                node.me = node
            del batch
            freezer.step()
        print(freezer.sweeps - swept, freezer.freezes)
        """
    )
    assert out.split() == ["0", "22"]


def test_sweeps_that_find_little_garbage_wait_longer_and_garbage_brings_them_back() -> None:
    out = run_python(
        """
        import gc, weakref
        from agentroster.ops.heap import LongLivedFreezer

        class Node:
            pass

        freezer = LongLivedFreezer()
        kept = [Node() for _ in range(20_000)]
        assert freezer.step()
        growths, sweeps = [], []
        for _ in range(12):  # a fleet registering: the live set grows by 30 % a round
            kept += [Node() for _ in range(len(kept) * 3 // 10)]
            sweeps.append(freezer.step())
            growths.append(freezer.growth)
        print(sum(sweeps), growths[-1])
        # Churn: runs end, their cycles were frozen and are garbage now: the next sweep frees
        # them, and the one after waits for a quarter again.
        cycles = [Node() for _ in range(2 * len(kept))]
        for node in cycles:
            node.me = node
        first = weakref.ref(cycles[0])
        freezer.step()
        del cycles
        while not freezer.step():
            kept += [Node() for _ in range(len(kept) // 10)]
        print(first() is None, freezer.growth)
        """
    )
    sweeps, growth, freed, after = out.split()
    # With a quarter each time, 12 rounds of 30 % would sweep 12 times.
    assert int(sweeps) <= 5 and float(growth) == 1.0
    assert freed == "True" and float(after) == 0.25


def test_the_thread_runs_while_a_worker_uses_it_and_the_last_to_stop_unfreezes() -> None:
    out = run_python(
        """
        import gc, time
        from agentroster.ops.heap import LongLivedFreezer

        freezer = LongLivedFreezer(every_s=0.05)
        freezer.start(); freezer.start()  # two workers in one process
        deadline = time.monotonic() + 60
        while freezer.freezes < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert freezer.freezes >= 2 and gc.get_freeze_count() > 0
        freezer.stop()
        assert freezer.running and gc.get_freeze_count() > 0  # one still runs
        freezer.stop()
        assert not freezer.running and gc.get_freeze_count() == 0 and freezer.frozen == 0
        freezer.stop()  # one stop too many changes nothing
        print("ok")
        """
    )
    assert out.split() == ["ok"]


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [("every_s", 0, "every_s: must be > 0"), ("sweep_growth", -1, "sweep_growth: must be > 0"),
     ("sweep_growth_max", 0.1, "sweep_growth_max: must be >= sweep_growth")],
)
def test_a_freezer_refuses_settings_it_cannot_keep(option: str, value: float, reason: str) -> None:
    from agentroster.ops.heap import LongLivedFreezer

    with pytest.raises(ValueError, match=reason):
        LongLivedFreezer(**{option: value})


def test_the_frozen_objects_and_sweeps_are_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from agentroster.ops.heap import LongLivedFreezer

    freezer = LongLivedFreezer()
    freezer.frozen, freezer.sweeps = 1234, 3  # set directly: this process's collector is left alone
    registry = CollectorRegistry()
    registry.register(freezer)
    text = generate_latest(registry).decode()
    assert "agentroster_worker_gc_frozen_objects 1234.0" in text
    assert "agentroster_worker_gc_sweeps_total 3.0" in text
    assert "agentroster_worker_gc_sweep_growth 0.25" in text


async def test_a_worker_runs_the_process_freezer_while_it_runs_unless_told_not_to(stack) -> None:  # noqa: ANN001
    import gc

    from agentroster.ops.heap import long_lived_freezer

    freezer = long_lived_freezer()
    await eventually(lambda: freezer.running, timeout=30)  # run() starts it once the backend has started
    assert stack.worker.freezer is freezer
    await stack.stop_worker()
    assert not freezer.running and gc.get_freeze_count() == 0  # the last worker in the process stopped
    await stack.start_worker(freeze_long_lived=False)
    await stack.roster.ensure_pool()  # the worker serves its pool: it runs
    assert stack.worker.freezer is None and not freezer.running
