"""Python's cyclic garbage collector in a worker that caches thousands of workflow runs.

A worker serving a large fleet holds every agent's run in its workflow cache: at 10,000
agents about three million objects the collector tracks, nearly all of them long-lived.
CPython collects its oldest generation whenever the objects promoted into it since the last
full collection reach a quarter of it, and a full collection walks every tracked object
with the interpreter stopped: measured here at 10,000 agents, 2.4-2.9 s every 100 s or so
while the fleet idles. No workflow task, activity or query is served meanwhile, so a pool's
next task waits out the sticky timeout and `status` waits for the pause.

`install()` freezes what survives each full collection (`gc.freeze`): the survivors are the
long-lived runs, and every later collection walks only what was created since, which takes
milliseconds. Frozen objects are still freed by reference counting the moment nothing
refers to them; what freezing delays is only garbage in reference cycles (a workflow run the
worker has dropped, with the state it held). So once the frozen population has doubled since
the last complete collection, the next full collection thaws everything first (`gc.unfreeze`)
and collects it all: one full pause per doubling of the heap (a handful while a fleet
registers, rarely once it idles), and cyclic garbage that waits for it never outgrows the
live heap.

The policy is process-wide, so the processes that run a worker install it (`agentroster
worker`, `agentroster dev`, unless AGENTROSTER_GC_FREEZE=0); a program that embeds a worker
with a large cache calls `install()` itself.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FreezingCollector:
    """The policy `install()` puts in `gc.callbacks`; its counters say what it did."""

    growth: float = 2.0  # thaw once the frozen population is this many times the live heap
    full_collections: int = 0  # complete collections (everything thawed first)
    partial_collections: int = 0  # oldest-generation collections that walked only what is new
    live_after_full: int = 0  # objects alive after the last complete collection
    longest_pause_s: float = 0.0
    _thawing: bool = field(default=False, repr=False)
    _started: float = field(default=0.0, repr=False)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the interpreter around every collection, in whichever thread triggered it.
        # Only the oldest generation's matter: a young collection never reaches frozen objects.
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
            frozen = gc.get_freeze_count()
            # Before the walk: thawed objects join the oldest generation and this collection
            # covers them. The first collection after install() finds nothing frozen and is
            # complete by itself.
            self._thawing = frozen == 0 or frozen >= self.growth * max(self.live_after_full, 1)
            if self._thawing and frozen:
                gc.unfreeze()
            return
        pause = time.perf_counter() - self._started
        self.longest_pause_s = max(self.longest_pause_s, pause)
        # After the walk the young generations are empty and the oldest holds only survivors.
        gc.freeze()
        # Inside a collection this only counts and moves generations: no logging, no locks.
        if self._thawing:
            self.full_collections += 1
            self.live_after_full = gc.get_freeze_count()
        else:
            self.partial_collections += 1


_installed: FreezingCollector | None = None


def install(growth: float = 2.0) -> FreezingCollector:
    """Install the policy in this process (once; later calls return the same one)."""
    global _installed
    if growth <= 1.0:
        raise ValueError(f"growth: {growth:g} must be above 1 (the frozen heap is compared with the live one)")
    if _installed is None:
        _installed = FreezingCollector(growth=growth)
        gc.callbacks.append(_installed)
    return _installed


__all__ = ["FreezingCollector", "install"]
