"""`workers.collector`: a worker process's full collections walk only new objects, and cyclic
garbage among frozen objects is still freed once the frozen heap has doubled.

Each check runs in a fresh interpreter: the policy is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from agentroster.client.settings import Settings, gc_freeze_from_env
from agentroster.errors import AgentRosterError


def run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_survivors_of_a_full_collection_are_frozen_and_later_collections_walk_only_new_objects() -> None:
    found = run(
        """
        import gc, json, time
        from agentroster.workers import collector
        gc.disable()  # only the collections below run, in this order
        policy = collector.install()
        assert collector.install() is policy  # once per process
        live = [[i] for i in range(300_000)]  # long-lived objects, like cached workflow runs
        gc.collect()  # the first full collection is complete, and its survivors are frozen
        frozen = gc.get_freeze_count()
        young = [[i] for i in range(1_000)]
        t = time.perf_counter(); gc.collect(); partial_s = time.perf_counter() - t
        gc.unfreeze(); t = time.perf_counter(); gc.collect(); full_s = time.perf_counter() - t
        print(json.dumps({"frozen": frozen, "full": policy.full_collections, "partial": policy.partial_collections,
                          "partial_s": partial_s, "full_s": full_s}))
        """
    )
    assert found["frozen"] >= 300_000
    assert found["partial"] >= 1  # the second collection walked what was new, not the 300,000
    assert found["full"] >= 1
    # Not a timing assertion about the machine: the partial walk covers ~1/300 of the objects.
    assert found["partial_s"] < found["full_s"]


def test_cyclic_garbage_among_frozen_objects_is_freed_once_the_frozen_heap_doubles() -> None:
    found = run(
        """
        import gc, json, weakref
        from agentroster.workers import collector

        class Run:  # a dropped workflow run: a reference cycle holding its state
            def __init__(self):
                self.me = self
                self.state = [[i] for i in range(1_000)]

        gc.disable()  # only the collections below run, in this order
        policy = collector.install(growth=2.0)
        keep = [[i] for i in range(100_000)]
        runs = [Run() for _ in range(20)]
        probe = weakref.ref(runs[0])
        gc.collect()  # complete: everything alive is frozen
        live = policy.live_after_full
        del runs  # now garbage, but frozen: partial collections do not reach it
        gc.collect()
        kept_while_frozen = probe() is not None
        more = [[i] for i in range(live + 10_000)]  # the frozen heap doubles
        gc.collect()  # partial: freezes the new survivors
        gc.collect()  # the frozen heap is past twice the live one: this one thaws everything first
        print(json.dumps({"kept_while_frozen": kept_while_frozen, "freed": probe() is None,
                          "full": policy.full_collections}))
        """
    )
    assert found["kept_while_frozen"], "a partial collection must not walk frozen objects"
    assert found["freed"], "cyclic garbage among frozen objects must be freed by the thawing collection"
    assert found["full"] == 2


def test_a_growth_that_never_thaws_is_refused() -> None:
    found = run(
        """
        import json
        from agentroster.workers import collector
        try:
            collector.install(growth=1.0)
        except ValueError as exc:
            print(json.dumps({"error": str(exc)}))
        """
    )
    assert "growth" in found["error"]


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("0", False), ("off", False), ("1", True), ("on", True)])
def test_the_switch_is_on_unless_turned_off(value: str | None, expected: bool) -> None:
    env = {} if value is None else {"AGENTROSTER_GC_FREEZE": value}
    assert gc_freeze_from_env(env) is expected
    assert Settings.from_env({**env, "TEMPORAL_ADDRESS": "localhost:7233"}).gc_freeze is expected


def test_a_bad_switch_names_the_variable() -> None:
    with pytest.raises(AgentRosterError, match="AGENTROSTER_GC_FREEZE"):
        gc_freeze_from_env({"AGENTROSTER_GC_FREEZE": "sometimes"})
