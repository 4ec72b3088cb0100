"""How large a pool fits in one continue-as-new payload.

Builds pools of N agents (ten deployments, each with its own capability set, as
real fleets look) holding N active leases with distinct holders, then measures,
side by side in one run, the plain JSON state older versions carried and the
packed state (`agentroster.core.state_codec`) the pool carries now, against the
server's 2 MiB payload limit. It then searches for the largest pool (agents =
leases) whose packed state stays under 1.5 MiB, the room we keep for the rest
of the continue-as-new input and for growth within a run.

Run: ``python benchmarks/bench_state.py``. Exits non-zero if 10,000 agents with
10,000 leases do not fit within 1.5 MiB.
"""

from __future__ import annotations

import itertools
import json
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import AgentState  # noqa: E402
from agentroster.core.pool import PoolCore  # noqa: E402
from agentroster.core.state_codec import decode_state, encode_state, packed_size  # noqa: E402

SERVER_LIMIT = 2 * 1024 * 1024
BUDGET = int(1.5 * 1024 * 1024)
DEPLOYMENTS = 10
CAPABILITIES_PER_DEPLOYMENT = 4


def capability_set(deployment: int) -> list[CapabilityDigest]:
    return [
        CapabilityDigest(
            name=f"cap{deployment}.skill{j}",
            version=f"{1 + j}.{deployment}.0",
            max_concurrency=4,
            cost_class="ABC"[j % 3],
        )
        for j in range(CAPABILITIES_PER_DEPLOYMENT)
    ]


def big_pool(agents: int, leases: int, *, pool: str = "big", now: float = 1_767_225_600.0) -> PoolCore:
    """A verified pool of `agents` agents over ten deployments, `leases` of them leased (random holders' secrets)."""
    core = PoolCore(pool, epoch="bench")
    ids = itertools.count()
    new_id = lambda: f"{next(ids):032x}"  # noqa: E731
    sets = [capability_set(d) for d in range(DEPLOYMENTS)]
    for i in range(agents):
        d = i % DEPLOYMENTS
        agent_id = f"deploy-{d}-{secrets.token_hex(5)}-{i}"
        core.agent_snapshot(
            AgentSnapshot(
                agent_id=agent_id,
                deployment=f"deploy-{d}",
                endpoint=f"http://10.{d}.{i // 250 % 250}.{i % 250}:8080",
                state=AgentState.READY,
                capabilities=sets[d],
                resync_interval_s=300.0,
            ),
            now,
            new_id,
        )
        for pending in core.take_verifications():
            core.agent_verified(pending, True, now, new_id)
    for n in range(leases):
        d, j = n % DEPLOYMENTS, (n // DEPLOYMENTS) % CAPABILITIES_PER_DEPLOYMENT
        reply = core.acquire(
            AcquireRequest(
                ref=f"cap{d}.skill{j}",
                lease_ttl_s=3600,
                wait_s=0,
                holder=f"client-{secrets.token_hex(4)}",
                request_id=secrets.token_hex(16),
            ),
            now,
            new_id,
        )
        if reply.lease is None:
            raise RuntimeError(f"lease {n} not granted: {reply}")
    core.take_notices()
    return core


def measure(agents: int, leases: int) -> dict[str, float]:
    core = big_pool(agents, leases)
    state = core.to_state()
    plain = len(json.dumps(state.model_dump(mode="json"), separators=(",", ":")))
    started = time.perf_counter()
    packed = encode_state(state)
    encode_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    restored = PoolCore.from_state(decode_state(packed))
    decode_ms = (time.perf_counter() - started) * 1000
    assert restored.to_state() == state
    return {"agents": agents, "leases": leases, "plain": plain, "packed": packed_size(packed),
            "encode_ms": encode_ms, "decode_ms": decode_ms}


def largest_fitting(start: int = 10_000) -> tuple[int, int]:
    """The largest n (to the nearest 500) such that n agents with n leases pack within BUDGET."""
    low, high = start, start
    while measure(high, high)["packed"] <= BUDGET:
        low, high = high, high * 2
    while high - low > 500:
        mid = (low + high) // 2
        if measure(mid, mid)["packed"] <= BUDGET:
            low = mid
        else:
            high = mid
    return low, measure(low, low)["packed"]


def main(argv: list[str] | None = None) -> int:
    kib = lambda b: f"{b / 1024:,.0f} KiB"  # noqa: E731
    print(f"{'agents':>7} {'leases':>7} {'plain JSON':>11} {'packed':>10} {'ratio':>6} {'of 2 MiB':>8} {'pack ms':>8} {'unpack ms':>9}")
    rows = [(1_000, 1_000), (2_000, 5_000), (9_000, 0), (10_000, 10_000)]
    results = [measure(a, l) for a, l in rows]
    for r in results:
        print(
            f"{r['agents']:>7,} {r['leases']:>7,} {kib(r['plain']):>11} {kib(r['packed']):>10} "
            f"{r['plain'] / r['packed']:>5.1f}x {r['packed'] / SERVER_LIMIT:>7.0%} {r['encode_ms']:>8.0f} {r['decode_ms']:>9.0f}"
        )
    target = results[-1]
    n, size = largest_fitting()
    print(f"largest pool within 1.5 MiB (agents = leases, ten deployments): ~{n:,} agents with {n:,} leases ({kib(size)})")
    ok = target["packed"] <= BUDGET
    print(f"target: 10,000 agents + 10,000 leases within 1.5 MiB: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
