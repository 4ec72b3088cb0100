"""All benchmarks, one command: `python benchmarks/run.py`.

(a) core picks/s at 100, 1,000, 10,000 agents vs the reference linear scan;
(b) acquire latency and leases/s through one pool with 1, 8 and 32 clients,
    beside a no-op update floor on the same tuned dev server;
(c) the supervisor path: CapabilityTaskWorkflow children against a real echo
    agent beside a child that runs one HTTP activity to it (no pool), at
    concurrency 1 and 8, interleaved in one run;
(d) pools in shards: leases/s with 1, 2 and 4 shards in alternating rounds,
    against 0.8 * N * one shard until the machine saturates (bench_shards.py).
Exits non-zero when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_core import main as core_main  # noqa: E402
from benchmarks.bench_pool import report, run_pool_benchmark  # noqa: E402
from benchmarks.bench_shards import parse_args as shards_args  # noqa: E402
from benchmarks.bench_shards import run as run_shards  # noqa: E402
from benchmarks.bench_supervisor import report as supervisor_report  # noqa: E402
from benchmarks.bench_supervisor import run_benchmark as run_supervisor_benchmark  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per server row")
    parser.add_argument("--skip-server", action="store_true", help="only the core benchmark")
    args = parser.parse_args()
    print("== (a) core selection ==")
    core_ok = core_main([]) in (0, None)
    if args.skip_server:
        return 0 if core_ok else 1
    print("\n== (b) one pool on the tuned dev server ==")
    server_ok = report(asyncio.run(run_pool_benchmark(args.seconds)))
    print("\n== (c) the supervisor path beside its floor ==")
    supervisor_ok = supervisor_report(asyncio.run(run_supervisor_benchmark(seconds=max(2.0, args.seconds / 2))))
    print("\n== (d) pools in shards: leases/s with 1, 2 and 4 shards ==")
    shards_ok = asyncio.run(run_shards(shards_args(["--seconds", str(args.seconds)]))) == 0
    return 0 if core_ok and server_ok and supervisor_ok and shards_ok else 1


if __name__ == "__main__":
    sys.exit(main())
