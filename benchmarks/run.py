"""All benchmarks, one command: `python benchmarks/run.py`.

(a) core picks/s at 100, 1,000, 10,000 agents vs the reference linear scan;
(b) acquire latency and leases/s through one pool with 1, 8 and 32 clients,
    beside a no-op update floor on the same tuned dev server;
(c) the supervisor path: CapabilityTaskWorkflow children against a real echo
    agent beside a child that runs one HTTP activity to it (no pool), at
    concurrency 1 and 8, interleaved in one run (issue 10, goal 3);
(d) pools in shards: leases/s with 1, 2 and 4 shards in alternating rounds,
    beside the bare server's floor with 1, 2 and 4 no-op workflows: 0.8 * N * one
    shard until the server saturates, then 0.8 times the server's own scaling
    (bench_shards.py; issue 10, goal 4);
(e) what an idle agent costs: Temporal actions per agent-hour at the defaults
    beside the old 10 s heartbeat in the same run, and the seconds from a
    SIGKILL to Terminated, before and after (bench_cost.py; issue 10, goal 1);
(f) a fleet (1,000 agents; --fleet N) on one worker process and one dev server:
    seconds until all are routable, then while they idle: CPU of the server and
    of the worker, actions per agent-hour, `status` latency over the shards,
    acquire latency, the worker's memory (bench_cost.py --fleet; issue 30).

Every section prints its figures beside its floor or target, measured in the same
run, and writes them as one JSON record under benchmarks/results/ (benchmarks/record.py;
`python benchmarks/render_results.py` turns the records into docs/benchmarks.md).
`--only c,e` runs some sections; (e) and (f) take ~10 and ~15 min.
Exits non-zero when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_core import main as core_main  # noqa: E402
from benchmarks.bench_cost import main as cost_main  # noqa: E402
from benchmarks.bench_pool import report, run_pool_benchmark  # noqa: E402
from benchmarks.bench_shards import parse_args as shards_args  # noqa: E402
from benchmarks.bench_shards import run as run_shards  # noqa: E402
from benchmarks.bench_supervisor import report as supervisor_report  # noqa: E402
from benchmarks.bench_supervisor import run_benchmark as run_supervisor_benchmark  # noqa: E402
from benchmarks.record import Record  # noqa: E402

SECTIONS = "abcdef"

# The record name of each section: render_results.py shows the newest record of each name.
RECORD_NAMES = {"a": "core", "b": "pool", "c": "supervisor", "d": "shards", "e": "cost", "f": "fleet"}


def sections(seconds: float, fleet: int) -> dict[str, tuple[str, Callable[[Record], bool]]]:
    """Each section: its title and a call that runs it, fills the section's record and says whether its targets were met."""
    return {
        "a": ("core selection", lambda rec: core_main([], rec) == 0),
        "b": ("one pool on the tuned dev server", lambda rec: report(asyncio.run(run_pool_benchmark(seconds)), rec)),
        "c": (
            "the supervisor path beside its floor",
            lambda rec: supervisor_report(asyncio.run(run_supervisor_benchmark(seconds=max(2.0, seconds / 2))), rec),
        ),
        "d": (
            "pools in shards: leases/s with 1, 2 and 4 shards",
            lambda rec: asyncio.run(run_shards(shards_args(["--seconds", str(seconds)]), rec)) == 0,
        ),
        "e": ("an idle agent's cost in Temporal actions, and crash detection", lambda rec: cost_main([], rec) == 0),
        "f": (f"{fleet:,} agents on one worker and one dev server", lambda rec: cost_main(["--fleet", str(fleet)], rec) == 0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per server row in (b)-(d)")
    parser.add_argument("--only", default=SECTIONS, help="sections to run, e.g. 'a,c' (default: all)")
    parser.add_argument("--fleet", type=int, default=1000, help="agents in section (f)")
    parser.add_argument("--skip-server", action="store_true", help="only the core benchmark (a)")
    args = parser.parse_args(argv)
    chosen = "a" if args.skip_server else "".join(c for c in args.only.lower() if c.isalpha())
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(unknown)}; sections are {', '.join(SECTIONS)}")
    results: dict[str, tuple[bool, float]] = {}
    for key, (title, run) in sections(args.seconds, args.fleet).items():
        if key not in chosen:
            continue
        print(f"\n== ({key}) {title} ==", flush=True)
        started = time.monotonic()
        rec = Record(RECORD_NAMES[key])
        rec.notes.append(f"benchmarks/run.py section ({key}): {title}")
        ok = run(rec)
        rec.write()
        results[key] = (ok, time.monotonic() - started)
    print("\n== summary ==")
    for key, (ok, took) in results.items():
        print(f"({key}) {'met' if ok else 'MISSED'}  ({took:.0f} s)")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
