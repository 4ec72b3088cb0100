"""The worker process's long-lived objects, kept out of the garbage collector's full collections.

A worker caching thousands of workflow runs holds millions of objects the collector
tracks: about 190 per cached agent run, nearly all of them the SDK's own structures. A
full (generation 2) collection walks every one of them with all threads stopped: about
2 s for 10,000 cached agents, longer than a workflow task's timeout and the sticky
queue's wait (2 s each, `vocabulary.wire`), so a pool's task times out and a `status`
query waits. CPython starts one whenever the objects promoted to the oldest generation
since the last one reach a quarter of its survivors: in an idle fleet of 10,000 about
every 90 s, from objects that reference counting frees soon after.

`LongLivedFreezer` collects every `FREEZE_EVERY_S` and then moves every object still alive
into the permanent generation (`gc.freeze()`), which no collection walks: after the first
time, the collection before each freeze walks only what was allocated since the last
one, and CPython's own full collections only what is not frozen. Reference counting still
frees a frozen object nothing refers to. What it cannot free is a frozen object in a
reference cycle that turns into garbage later (the coroutines and frames of a run the
cache evicts, or that ends). A sweep bounds those: when the frozen set has grown by a
quarter (`SWEEP_GROWTH`, CPython's own factor) since the last sweep, everything is
unfrozen and collected once and the survivors frozen again. That is the one long pause
left, as long as the frozen set is large: while a fleet registers, not while it idles.
A sweep that found little garbage (under half its growth) says the set grows with live
objects, as while a fleet registers: the next waits for twice the growth, up to
`SWEEP_GROWTH_MAX`; one that found more brings it back to a quarter. While 10,000 agents
register there are then fewer sweeps, and fewer objects walked in all, though the last
still walks between half and all of the final set; the price is frozen garbage of at
most that growth of the live set, and only where the garbage is scarce.

The policy is process-wide (the collector is): every worker in a process shares one
freezer (`long_lived_freezer()`), whose thread runs while at least one of them does;
when the last stops, everything is unfrozen.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# How often the objects alive are frozen: each freeze's collection walks what was
# allocated since the last one and is still tracked (the fleet benchmark's worker with
# 10,000 idle agents: its full collections take under 0.1 s on average).
FREEZE_EVERY_S = 60.0
# A sweep runs when the frozen set has grown by this fraction since the last sweep...
SWEEP_GROWTH = 0.25
# ... doubled after each sweep that freed less than half of it, up to this.
SWEEP_GROWTH_MAX = 1.0
# How long `stop()` waits for a round in progress.
JOIN_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


class LongLivedFreezer(Collector):
    """Freezes the objects that outlive a collection; sweeps the frozen set as it grows.

    `start()` and `stop()` count users; the thread runs while the count is above zero.
    `step()` is one round of the policy (what the thread does every `every_s`), there for
    callers that drive it themselves. As a Prometheus collector it reports the frozen
    objects and the sweeps so far."""

    def __init__(
        self,
        *,
        every_s: float = FREEZE_EVERY_S,
        sweep_growth: float = SWEEP_GROWTH,
        sweep_growth_max: float = SWEEP_GROWTH_MAX,
    ) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s: must be > 0, got {every_s}")
        if not sweep_growth > 0:
            raise ValueError(f"sweep_growth: must be > 0, got {sweep_growth}")
        if not sweep_growth_max >= sweep_growth:
            raise ValueError(f"sweep_growth_max: must be >= sweep_growth ({sweep_growth}), got {sweep_growth_max}")
        self.every_s = every_s
        self.sweep_growth = sweep_growth
        self.sweep_growth_max = sweep_growth_max
        self.growth = sweep_growth  # what the next sweep waits for (see the module's doc)
        self.frozen = 0  # objects in the permanent generation after the last round
        self.swept = 0  # ... right after the last sweep
        self.freezes = 0
        self.sweeps = 0
        self._users = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """One more user: the thread starts with the first."""
        with self._lock:
            self._users += 1
            if self._thread is None:
                self._wake.clear()
                self._thread = threading.Thread(target=self._run, name="agentroster-heap", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """One user fewer: with the last, the thread ends and every frozen object is unfrozen."""
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._wake.set()
        # A round in progress ends first. Bounded: a finalizer the collection runs (it runs
        # them in this thread) that blocks must not hold up the worker's shutdown.
        thread.join(timeout=JOIN_TIMEOUT_S)
        if thread.is_alive():
            logger.warning("the heap's thread did not end within %g s (a finalizer blocks in its collection)", JOIN_TIMEOUT_S)
        with self._lock:
            if self._thread is None:  # no user came back meanwhile
                gc.unfreeze()
                self.frozen = self.swept = 0

    @property
    def running(self) -> bool:
        return self._thread is not None

    def step(self) -> bool:
        """Collect, then freeze what survived; when that has grown the frozen set enough
        since the last sweep (`growth`), sweep it. Returns whether this round swept (the
        first round does: nothing was frozen, so its collection walked everything)."""
        first = self.frozen == 0
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self.freezes += 1
        if first or self.frozen > self.swept * (1 + self.growth):
            if not first:
                grown = self.frozen - self.swept
                gc.unfreeze()  # everything back in the oldest generation: this collection walks it all
                gc.collect()
                gc.freeze()
                freed, self.frozen = self.frozen - gc.get_freeze_count(), gc.get_freeze_count()
                scarce = freed < grown / 2
                self.growth = min(self.growth * 2, self.sweep_growth_max) if scarce else self.sweep_growth
            self.swept = self.frozen
            self.sweeps += 1
            return True
        return False

    def _run(self) -> None:
        thread = threading.current_thread()
        next_round = time.monotonic()
        while True:
            next_round += self.every_s
            if self._wake.wait(max(0.0, next_round - time.monotonic())) or self._thread is not thread:
                return
            self.step()

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "agentroster_worker_gc_frozen_objects",
            "Objects this process keeps out of garbage collections (gc.freeze), after the last round",
            value=self.frozen,
        )
        yield GaugeMetricFamily(
            "agentroster_worker_gc_sweep_growth",
            "How much the frozen set grows before the next sweep (a fraction of it after the last; doubled while sweeps find little garbage)",
            value=self.growth,
        )
        yield CounterMetricFamily(
            "agentroster_worker_gc_sweeps",
            "Times the frozen objects were unfrozen and collected once (the frozen set had grown by the sweep growth)",
            value=self.sweeps,
        )


_freezer: LongLivedFreezer | None = None


def long_lived_freezer() -> LongLivedFreezer:
    """The process's one `LongLivedFreezer`."""
    global _freezer
    if _freezer is None:
        _freezer = LongLivedFreezer()
    return _freezer
