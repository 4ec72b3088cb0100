"""Sharded pools: which pool workflow (shard) holds an agent, and where an acquire asks first.

Pure functions, no Temporal and no clock: the client, the workers' activities,
the agent workflow and the pool workflow all call them and must agree, so every
hash here is a stable digest (never Python's per-process `hash()`).

A pool of N shards is N pool workflows, `pool/{pool}` (shard 0, the id an
unsharded pool has always had) and `pool/{pool}/shard-{k}` for k = 1..N-1. Every
agent has exactly one *home shard*, which holds all of its capabilities:
an agent's `max_concurrency` caps its leases across capabilities
(`core.index`: `total_in_flight < max_concurrency`), so registering its
capabilities in several shards would let each shard hand out the whole cap.

The home shard is chosen by the pool's `by` key:
- `deployment` (default): every replica of a deployment lands in one shard, so
  that shard's sizing policy, scale demand and recycling see the whole
  deployment (a deployment is one specialised agent kind: in effect this
  shards by capability, at the granularity that keeps caps and sizing right).
- `agent`: by agent id, for one hot capability served by more agents than one
  shard carries; a deployment is then spread over every shard, so sizing
  policies are refused (each shard would size it from its own part).

An acquire asks one shard first (`acquire_order`) and falls back to the others
when that one has no match or is exhausted. Lease ids and tickets granted by
shard k > 0 carry the shard (`s{k}~...`), so a release, renewal or cancel goes
back to the shard that granted it, from any process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SHARD_KEYS = ("deployment", "agent")
DEFAULT_SHARD_KEY = "deployment"
MAX_SHARDS = 64
_TAG = "s"
_SEP = "~"


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that every process and every replay agrees on."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class ShardLayout:
    """How one pool is split: `shards` pool workflows, agents placed by `by`."""

    shards: int = 1
    by: str = DEFAULT_SHARD_KEY

    def __post_init__(self) -> None:
        if not isinstance(self.shards, int) or not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards: must be 1-{MAX_SHARDS}, got {self.shards!r}")
        if self.by not in SHARD_KEYS:
            raise ValueError(f"shard key: expected one of {', '.join(SHARD_KEYS)}, got {self.by!r}")

    @classmethod
    def parse(cls, text: str | int | None) -> ShardLayout:
        """`4`, `4:agent` or `4:deployment` (the AGENTROSTER_POOL_SHARDS form); None or '' is 1."""
        if text is None or text == "":
            return cls()
        if isinstance(text, int):
            return cls(shards=text)
        count, _, by = str(text).strip().partition(":")
        if not count.strip().isdigit():
            raise ValueError(f"shards {text!r}: expected a count (1-{MAX_SHARDS}), optionally ':agent' or ':deployment'")
        return cls(shards=int(count), by=by.strip() or DEFAULT_SHARD_KEY)

    def __str__(self) -> str:
        return str(self.shards) if self.by == DEFAULT_SHARD_KEY else f"{self.shards}:{self.by}"

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def home_shard(self, agent_id: str, deployment: str) -> int:
        """The one shard that holds this agent (all of its capabilities)."""
        if self.shards == 1:
            return 0
        key = deployment if self.by == "deployment" else agent_id
        return stable_hash(f"{self.by}:{key}") % self.shards

    def deployment_shard(self, deployment: str) -> int | None:
        """The shard that holds every agent of `deployment`, or None when they are spread (`agent` key)."""
        if self.shards == 1:
            return 0
        return self.home_shard("", deployment) if self.by == "deployment" else None

    def acquire_order(self, request_key: str, preferred: int | None = None) -> list[int]:
        """Every shard once, in the order an acquire tries them.

        `preferred` (e.g. where this capability was last granted) goes first; the
        rest follow in a rotation that starts at a shard picked by `request_key`,
        so concurrent callers of one hot capability spread over the shards.
        """
        if self.shards == 1:
            return [0]
        start = stable_hash(request_key) % self.shards
        order = [(start + i) % self.shards for i in range(self.shards)]
        if preferred is not None and 0 <= preferred < self.shards:
            order.remove(preferred)
            order.insert(0, preferred)
        return order


def tag_id(shard: int, ident: str) -> str:
    """A lease id or ticket made by shard `shard`: untouched for shard 0 (every unsharded pool)."""
    return ident if shard == 0 else f"{_TAG}{shard}{_SEP}{ident}"


def shard_of_id(ident: str) -> int:
    """The shard that made a lease id or ticket (0 when it carries none)."""
    if not ident.startswith(_TAG) or _SEP not in ident:
        return 0
    head = ident[len(_TAG):ident.index(_SEP)]
    return int(head) if head.isdigit() and 0 < int(head) < MAX_SHARDS else 0


def shard_suffix(shard: int) -> str:
    """What follows `pool/{pool}` in a shard's workflow id: '' for shard 0, `/shard-{k}` otherwise."""
    return "" if shard == 0 else f"/shard-{shard}"
