"""Picks per second: agentroster's pure core against the reference linear scan.

Two ways of exercising the core, each beside a baseline run in the same
process on the same fleet and the same sequence of refs:

* ``index.pick`` -- ``CapabilityIndex.pick(ref)``, then the matching
  ``add_load(+1)`` and ``add_load(-1)``, as a grant and a release move the
  index in real use. Baseline: the reference document's ``find_by_capability``
  (iterate the name's agent set, filter state / version with a ``packaging``
  SpecifierSet / in-flight < max_concurrency, sort by (cost rank, in-flight),
  take the first), then the same +1 / -1 on its in-flight counts.
* ``PoolCore`` -- a grant/release cycle through ``PoolCore.acquire`` /
  ``PoolCore.release`` (lease book, notices and all), holding a rolling window
  of outstanding leases (a quarter of the fleet) so agents carry load.
  Baseline: the reference scan, +1 on grant, -1 when the same window releases.

Each baseline is measured twice: *literal* (``_matches`` parses the specifier
and the version for every candidate, as the reference's helper is called) and
*pre-parsed* (specifier parsed once per call, versions parsed at
registration): the stronger of the two is the one the target is checked
against.

Each measurement runs for MAX_PICKS picks or ~1 s, whichever comes first.
Run: ``python benchmarks/bench_core.py`` (or ``python -m benchmarks.bench_core``).
"""

from __future__ import annotations

import itertools
import random
import re
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import COST_RANK, AgentState, CapabilityRef
from agentroster.core.index import CapabilityIndex
from agentroster.core.pool import PoolCore
from benchmarks.record import Record

MAX_PICKS = 200_000
MAX_SECONDS = 1.0
TARGET_RATIO = 20.0
TARGET_AGENTS = 10_000

NAMES = [
    "rag.search",
    "rag.rerank",
    "code.python.exec",
    "code.python.lint",
    "math.solve",
    "retrieval.vector",
    "image.gen",
    "web.fetch",
    "doc.summarise",
    "sql.query",
]
VERSION_POOL = ["1.0.0", "1.4.2", "2.0.0", "2.1.0", "2.3.1", "3.0.0", "3.1.0-rc.1"]
SPECS = ["", ">=2,<3", ">=1", "<3", ">=2", "==2.1.0", "!=2.0.0", ">=1,<2"]


# --------------------------------------------------------------------------- data


@dataclass
class FleetAgent:
    agent_id: str
    deployment: str
    capabilities: list[CapabilityDigest]


def make_fleet(n: int, seed: int = 7) -> list[FleetAgent]:
    """n agents, each with 1-3 of ~10 capability names, a few versions per name, random cost and concurrency."""
    rnd = random.Random(seed)
    versions_of = {name: sorted(rnd.sample(VERSION_POOL, 3), key=Version) for name in NAMES}
    fleet = []
    for i in range(n):
        names = rnd.sample(NAMES, rnd.randint(1, 3))
        caps = [
            CapabilityDigest(
                name=name,
                version=rnd.choice(versions_of[name]),
                max_concurrency=rnd.randint(1, 4),
                cost_class=rnd.choice("ABC"),
            )
            for name in names
        ]
        fleet.append(FleetAgent(f"agent-{rnd.getrandbits(32):08x}-{i}", f"{names[0].split('.')[0]}-agent", caps))
    return fleet


def make_refs(count: int, seed: int = 11) -> list[tuple[str, str]]:
    rnd = random.Random(seed)
    return [(rnd.choice(NAMES), rnd.choice(SPECS)) for _ in range(count)]


# --------------------------------------------------------------------------- baseline


class ReferenceScanPool:
    """The reference document's manager, reduced to what a pick needs.

    `_cap_index` maps a name to its set of agent ids; `find_by_capability`
    walks that set, filters, sorts and returns the candidates.
    """

    def __init__(self, fleet: Sequence[FleetAgent], *, preparsed: bool) -> None:
        self.preparsed = preparsed
        self._caps: dict[str, dict[str, CapabilityDigest]] = {}
        self._parsed: dict[tuple[str, str], Version] = {}
        self._state: dict[str, str] = {}
        self._inflight: dict[str, int] = defaultdict(int)  # per agent, as the reference keeps it
        self._inflight_cap: dict[tuple[str, str], int] = defaultdict(int)
        self._cap_index: dict[str, set[str]] = defaultdict(set)
        for agent in fleet:
            self._caps[agent.agent_id] = {c.name: c for c in agent.capabilities}
            self._state[agent.agent_id] = "Ready"
            for cap in agent.capabilities:
                self._cap_index[cap.name].add(agent.agent_id)
                self._parsed[(agent.agent_id, cap.name)] = Version(cap.version)

    @staticmethod
    def _names_prerelease(spec: SpecifierSet) -> bool:
        # Our rule (PEP 440's): a pre-release matches only a range that names one.
        return not str(spec) or any(Version(s.version.rstrip(".*")).is_prerelease for s in spec if s.operator not in ("!=",))

    @classmethod
    def _matches(cls, version: str, version_spec: str) -> bool:
        spec = SpecifierSet(version_spec)
        return spec.contains(Version(version), prereleases=cls._names_prerelease(spec))

    def find_by_capability(self, name: str, version_spec: str = "") -> list[str]:
        candidates = []
        spec = SpecifierSet(version_spec) if self.preparsed else None
        pre = self._names_prerelease(spec) if spec is not None else False
        for aid in self._cap_index.get(name, set()):
            if self._state.get(aid) not in ("Ready", "Busy"):
                continue
            cap = self._caps[aid][name]
            if spec is not None:
                ok = spec.contains(self._parsed[(aid, name)], prereleases=pre)
            else:
                ok = self._matches(cap.version, version_spec)
            agent_cap = max(c.max_concurrency for c in self._caps[aid].values())
            if ok and self._inflight_cap[(aid, name)] < cap.max_concurrency and self._inflight[aid] < agent_cap:
                candidates.append(aid)
        # cheapest first, then least loaded
        candidates.sort(key=lambda a: (COST_RANK[self._caps[a][name].cost_class], self._inflight[a]))
        return candidates

    def add_load(self, agent_id: str, name: str, delta: int) -> None:
        self._inflight[agent_id] += delta
        self._inflight_cap[(agent_id, name)] += delta

    def sort_key(self, agent_id: str, name: str) -> tuple[int, int]:
        return (COST_RANK[self._caps[agent_id][name].cost_class], self._inflight[agent_id])


# --------------------------------------------------------------------------- timing


def _measure(step: Callable[[int], None], every: int = 1) -> tuple[int, float]:
    """Call step(i) until MAX_PICKS or ~MAX_SECONDS; return (picks, seconds)."""
    start = time.perf_counter()
    deadline = start + MAX_SECONDS
    i = 0
    while i < MAX_PICKS:
        step(i)
        i += 1
        if i % every == 0 and time.perf_counter() >= deadline:
            break
    return i, time.perf_counter() - start


def bench_index_pick(fleet: Sequence[FleetAgent], refs: Sequence[tuple[str, str]]) -> tuple[int, float]:
    index = CapabilityIndex()
    for agent in fleet:
        index.upsert(agent.agent_id, agent.deployment, "http://bench", AgentState.READY, agent.capabilities)
    parsed = [CapabilityRef(name=n, specifier=s) for n, s in refs]
    count = len(parsed)

    def step(i: int) -> None:
        ref = parsed[i % count]
        picked = index.pick(ref)
        if picked is not None:
            agent_id = picked[0].agent_id
            index.add_load(agent_id, ref.name, +1)
            index.add_load(agent_id, ref.name, -1)

    return _measure(step, every=64)


def bench_baseline_pick(fleet: Sequence[FleetAgent], refs: Sequence[tuple[str, str]], *, preparsed: bool) -> tuple[int, float]:
    pool = ReferenceScanPool(fleet, preparsed=preparsed)
    count = len(refs)

    def step(i: int) -> None:
        name, spec = refs[i % count]
        candidates = pool.find_by_capability(name, spec)
        if candidates:
            pool.add_load(candidates[0], name, +1)
            pool.add_load(candidates[0], name, -1)

    return _measure(step)


def _window(n_agents: int) -> int:
    return max(1, n_agents // 4)


def bench_pool_cycle(fleet: Sequence[FleetAgent], refs: Sequence[tuple[str, str]]) -> tuple[int, float]:
    core = PoolCore("bench")
    ids = itertools.count()

    def new_id() -> str:
        return f"id-{next(ids)}"

    for agent in fleet:
        core.agent_snapshot(
            AgentSnapshot(
                agent_id=agent.agent_id,
                deployment=agent.deployment,
                endpoint="http://bench",
                state=AgentState.READY,
                capabilities=agent.capabilities,
            ),
            0.0,
            new_id,
        )
    core.take_notices()
    core.take_warnings()
    requests = [AcquireRequest(ref=f"{n}@{s}" if s else n, wait_s=0, lease_ttl_s=300, request_id=f"bench-request-{i:08d}") for i, (n, s) in enumerate(refs)]
    count = len(requests)
    held: deque[str] = deque()
    window = _window(len(fleet))
    now = 1.0

    def step(i: int) -> None:
        reply = core.acquire(requests[i % count], now, new_id)
        if reply.lease is not None:
            held.append(reply.lease.lease_id)
        if len(held) > window:
            core.release(held.popleft(), now, new_id)
        core.take_notices()  # the workflow sends these on, batched

    return _measure(step, every=16)


def bench_baseline_cycle(fleet: Sequence[FleetAgent], refs: Sequence[tuple[str, str]], *, preparsed: bool) -> tuple[int, float]:
    pool = ReferenceScanPool(fleet, preparsed=preparsed)
    count = len(refs)
    held: deque[tuple[str, str]] = deque()
    window = _window(len(fleet))

    def step(i: int) -> None:
        name, spec = refs[i % count]
        candidates = pool.find_by_capability(name, spec)
        if candidates:
            pool.add_load(candidates[0], name, +1)
            held.append((candidates[0], name))
        if len(held) > window:
            agent_id, held_name = held.popleft()
            pool.add_load(agent_id, held_name, -1)

    return _measure(step)


def check_same_choices(fleet: Sequence[FleetAgent], refs: Sequence[tuple[str, str]], picks: int = 300) -> None:
    """Core and baseline agree on the (cost, in-flight) of the best agent under the same load."""
    index = CapabilityIndex()
    for agent in fleet:
        index.upsert(agent.agent_id, agent.deployment, "http://bench", AgentState.READY, agent.capabilities)
    pool = ReferenceScanPool(fleet, preparsed=True)
    for name, spec in refs[:picks]:
        picked = index.pick(CapabilityRef(name=name, specifier=spec))
        candidates = pool.find_by_capability(name, spec)
        assert (picked is None) == (not candidates), (name, spec)
        if picked is None:
            continue
        agent = picked[0]
        assert pool.sort_key(agent.agent_id, name) == pool.sort_key(candidates[0], name), (name, spec)
        index.add_load(agent.agent_id, name, +1)  # keep load on both, so later picks differ
        pool.add_load(agent.agent_id, name, +1)


# --------------------------------------------------------------------------- driver


def run_core_benchmark(sizes: Sequence[int] = (100, 1000, 10000)) -> list[dict]:
    """Measure every size; one row per (size, mode) with core and baseline picks/s and the ratio."""
    refs = make_refs(4096)
    rows: list[dict] = []
    for n in sizes:
        fleet = make_fleet(n)
        check_same_choices(fleet, refs)
        modes = [
            ("index.pick +1/-1", lambda: bench_index_pick(fleet, refs), bench_baseline_pick),
            ("PoolCore acquire/release", lambda: bench_pool_cycle(fleet, refs), bench_baseline_cycle),
        ]
        for mode, core_run, baseline in modes:
            core_picks, core_s = core_run()
            literal_picks, literal_s = baseline(fleet, refs, preparsed=False)
            parsed_picks, parsed_s = baseline(fleet, refs, preparsed=True)
            core_rate = core_picks / core_s
            literal_rate = literal_picks / literal_s
            parsed_rate = parsed_picks / parsed_s
            rows.append(
                {
                    "agents": n,
                    "mode": mode,
                    "core_picks": core_picks,
                    "core_per_s": core_rate,
                    "baseline_literal_per_s": literal_rate,
                    "baseline_preparsed_per_s": parsed_rate,
                    "ratio_vs_literal": core_rate / literal_rate,
                    "ratio_vs_preparsed": core_rate / parsed_rate,
                    # the target is checked against the stronger (faster) baseline
                    "ratio": core_rate / max(literal_rate, parsed_rate),
                }
            )
    return rows


def format_table(rows: Sequence[dict]) -> str:
    header = (
        f"{'agents':>7} | {'mode':<25} | {'core picks/s':>13} | {'ref literal/s':>13} | "
        f"{'ref pre-parsed/s':>16} | {'x literal':>9} | {'x pre-parsed':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['agents']:>7,} | {r['mode']:<25} | {r['core_per_s']:>13,.0f} | {r['baseline_literal_per_s']:>13,.0f} | "
            f"{r['baseline_preparsed_per_s']:>16,.0f} | {r['ratio_vs_literal']:>8,.1f}x | {r['ratio_vs_preparsed']:>11,.1f}x"
        )
    return "\n".join(lines)


def verdict(rows: Sequence[dict], rec: Record | None = None) -> tuple[bool, list[str]]:
    """PASS when, at TARGET_AGENTS agents, every mode is at least TARGET_RATIO x the stronger baseline.

    With `rec`, every row's rates go into it as figures and each mode's ratio as a target."""
    if rec is not None:
        for r in rows:
            key = f"{_slug(r['mode'])}_{r['agents']}_agents"
            rec.figure(f"{key}_core_per_s", round(r["core_per_s"]), unit="1/s")
            rec.figure(f"{key}_reference_per_s", round(max(r["baseline_literal_per_s"], r["baseline_preparsed_per_s"])), unit="1/s")
    lines = []
    ok = True
    at_target = [r for r in rows if r["agents"] == TARGET_AGENTS]
    if not at_target:
        return False, [f"FAIL: no measurement at {TARGET_AGENTS:,} agents"]
    for r in at_target:
        passed = r["ratio"] >= TARGET_RATIO
        if rec is not None:
            rec.target(f"{_slug(r['mode'])}_vs_reference_scan", value=round(r["ratio"], 1), goal=TARGET_RATIO, op=">=", unit="x")
        ok &= passed
        lines.append(
            f"{'PASS' if passed else 'FAIL'}: {r['mode']} at {TARGET_AGENTS:,} agents is {r['ratio']:,.1f}x "
            f"the reference scan (target >= {TARGET_RATIO:g}x)"
        )
    return ok, lines


_SLUGS = {"index.pick +1/-1": "index_pick", "PoolCore acquire/release": "pool_acquire_release"}


def _slug(mode: str) -> str:
    """A mode's name in the record."""
    return _SLUGS.get(mode) or re.sub(r"[^a-z0-9]+", "_", mode.lower()).strip("_")


def main(argv: Sequence[str] | None = None, rec: Record | None = None) -> int:
    """Run, print the table and the verdict, and write the run's record (or fill `rec`, which the caller writes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sizes = tuple(int(a) for a in argv) or (100, 1000, 10000)
    print(f"python {sys.version.split()[0]}; each measurement: {MAX_PICKS:,} picks or ~{MAX_SECONDS:g}s, whichever first")
    own = rec is None
    rec = rec or Record("core")
    rec.load = f"PoolCore in one process, agents {', '.join(f'{n:,}' for n in sizes)}; {MAX_PICKS:,} picks or ~{MAX_SECONDS:g} s per measurement"
    rows = run_core_benchmark(sizes)
    print(format_table(rows))
    ok, lines = verdict(rows, rec)
    print("\n".join(lines))
    print("PASS" if ok else "FAIL")
    if own:
        rec.write()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
