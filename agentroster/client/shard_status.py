"""A sharded pool's figures, added up over its shards: what `AgentRoster.status()`, the
CLI's tables and the metrics exporter read for a pool of N shards (one status per shard in,
one `PoolStatus` out). An unsharded pool's status passes through untouched."""

from __future__ import annotations

from collections.abc import Sequence

from agentroster.models import CapabilityStatus, EvictionStatus, PoolStatus

_SUMMED = (
    "active_leases", "waiting", "leases_granted", "leases_released", "leases_expired", "leases_revoked",
    "leases_renewed", "exhausted", "agents_lost", "agents_drained", "agents_omitted",
)
_SHUTDOWN_SUMMED = ("leases_at_start", "leases_revoked", "waiters_ended", "agents_drained", "agents_left")
_PHASE_ORDER = ("finishing-leases", "draining-agents", "done")
RECENTLY_ENDED_KEPT = 50
WARNINGS_KEPT = 20
RECENT_EVICTIONS_KEPT = 20


def merge_capability(into: CapabilityStatus, more: CapabilityStatus) -> None:
    for state, count in more.agents.items():
        into.agents[state] = into.agents.get(state, 0) + count
    into.slots += more.slots
    into.idle_slots += more.idle_slots
    into.in_flight += more.in_flight
    into.waiting += more.waiting
    for name, count in more.counters.items():
        into.counters[name] = into.counters.get(name, 0) + count
    into.free.extend(more.free)  # each shard's best first, shard by shard


def merge_evictions(statuses: Sequence[EvictionStatus]) -> EvictionStatus:
    first = statuses[0]
    merged = first.model_copy(deep=True)
    for more in statuses[1:]:
        merged.self_preservation = merged.self_preservation or more.self_preservation
        if more.since is not None and (merged.since is None or more.since < merged.since):
            merged.since = more.since
        merged.warning = merged.warning or more.warning
        merged.silent = sorted({*merged.silent, *more.silent})
        merged.confirmed = sorted({*merged.confirmed, *more.confirmed})
        merged.recent = sorted([*merged.recent, *more.recent], key=lambda r: r.at)[-RECENT_EVICTIONS_KEPT:]
        for name in ("evictions_allowed", "evictions_denied", "evictions_confirmed", "self_preservation_activations"):
            setattr(merged, name, getattr(merged, name) + getattr(more, name))
    return merged


def merge_statuses(statuses: Sequence[PoolStatus]) -> PoolStatus:
    """One status for the whole pool from its shards' (in shard order; shard 0 first)."""
    if len(statuses) == 1:
        return statuses[0]
    first = statuses[0]
    # A shallow copy with its own lists and dicts (what the loop below extends) and its own
    # capability entries (what it adds into): the agent rows are shared, never changed.
    merged = first.model_copy(
        update={
            "agents": list(first.agents),
            "capabilities": {name: cap.model_copy(deep=True) for name, cap in first.capabilities.items()},
            "warnings": list(first.warnings),
            "policies": dict(first.policies),
            "breakers": dict(first.breakers),
            "recently_ended": list(first.recently_ended),
            "refusals": list(first.refusals),
        }
    )
    for more in statuses[1:]:
        merged.agents.extend(more.agents)
        for name in _SUMMED:
            setattr(merged, name, getattr(merged, name) + getattr(more, name))
        for name, cap in more.capabilities.items():
            if name in merged.capabilities:
                merge_capability(merged.capabilities[name], cap)
            else:
                merged.capabilities[name] = cap.model_copy(deep=True)
        merged.warnings.extend(more.warnings)
        merged.policies.update(more.policies)
        merged.breakers.update(more.breakers)
        merged.recently_ended.extend(more.recently_ended)
        merged.refusals.extend(more.refusals)
    merged.agents.sort(key=lambda a: a.agent_id)
    merged.capabilities = dict(sorted(merged.capabilities.items()))
    merged.warnings = merged.warnings[-WARNINGS_KEPT:]
    merged.refusals = merged.refusals[-WARNINGS_KEPT:]
    merged.recently_ended = sorted(merged.recently_ended, key=lambda r: r.ended_at)[-RECENTLY_ENDED_KEPT:]
    merged.eviction = merge_evictions([s.eviction for s in statuses])
    shutdowns = [s.shutdown for s in statuses if s.shutdown is not None]
    if shutdowns:
        # The pool's shutdown is as far as its slowest shard; the counts add up.
        slowest = min(shutdowns, key=lambda p: _PHASE_ORDER.index(p.phase) if p.phase in _PHASE_ORDER else -1)
        shutdown = slowest.model_copy(deep=True)
        for name in _SHUTDOWN_SUMMED:
            setattr(shutdown, name, sum(getattr(p, name) for p in shutdowns))
        shutdown.deployments_scaled = sorted({d for p in shutdowns for d in p.deployments_scaled})
        shutdown.scale_failures = {k: v for p in shutdowns for k, v in p.scale_failures.items()}
        if len(shutdowns) < len(statuses):
            shutdown.phase = "finishing-leases"  # a shard has not heard of it yet
            shutdown.finished_at = None
        merged.shutdown = shutdown
    return merged
