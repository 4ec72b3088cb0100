"""Scale-demand coalescing: misses become at most one scale request per window.

A burst of misses for a deployment opens a window (default 5 s); when it
closes, one request asks for one more replica than are registered plus already
requested. Replicas requested but not yet registered count as pending until
they register or `pending_ttl_s` passes, so misses while pods boot do not cause
a scale-up storm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentroster.messages import ScaleRequest


@dataclass
class DeploymentDemand:
    window_opened: float | None = None
    misses: int = 0
    pending: list[float] = field(default_factory=list)  # when each pending replica was requested


class ScaleCoalescer:
    def __init__(self, window_s: float = 5.0, pending_ttl_s: float = 120.0, max_replicas: dict[str, int] | None = None) -> None:
        self.window_s = window_s
        self.pending_ttl_s = pending_ttl_s
        self.max_replicas = dict(max_replicas or {})
        self._demand: dict[str, DeploymentDemand] = {}

    def record_miss(self, deployment: str, now: float) -> None:
        demand = self._demand.setdefault(deployment, DeploymentDemand())
        if demand.window_opened is None:
            demand.window_opened = now
        demand.misses += 1

    def registered(self, deployment: str) -> None:
        """A new replica of `deployment` registered: one pending replica has arrived."""
        demand = self._demand.get(deployment)
        if demand and demand.pending:
            demand.pending.pop(0)

    def pending(self, deployment: str, now: float) -> int:
        demand = self._demand.get(deployment)
        if not demand:
            return 0
        demand.pending = [t for t in demand.pending if now - t < self.pending_ttl_s]
        return len(demand.pending)

    def due(self, now: float, registered: dict[str, int]) -> list[ScaleRequest]:
        """Close every window that has run its length; return the scale requests it yields."""
        requests: list[ScaleRequest] = []
        for deployment in sorted(self._demand):
            demand = self._demand[deployment]
            if demand.window_opened is None or now - demand.window_opened < self.window_s:
                continue
            misses, demand.window_opened, demand.misses = demand.misses, None, 0
            pending = self.pending(deployment, now)
            if pending:
                continue  # replicas already on their way absorb this demand
            current = registered.get(deployment, 0)
            target = current + 1
            cap = self.max_replicas.get(deployment)
            if cap is not None and target > cap:
                continue
            demand.pending.append(now)
            requests.append(
                ScaleRequest(deployment=deployment, replicas=target, at_least=True, reason=f"{misses} miss(es) in {self.window_s:g}s, {current} registered")
            )
        return requests

    def next_due(self) -> float | None:
        opened = [d.window_opened for d in self._demand.values() if d.window_opened is not None]
        return min(opened) + self.window_s if opened else None

    def state(self) -> dict[str, list[float]]:
        return {
            name: [d.window_opened if d.window_opened is not None else -1.0, float(d.misses), *d.pending]
            for name, d in sorted(self._demand.items())
            if d.window_opened is not None or d.pending
        }

    def load_state(self, state: dict[str, list[float]]) -> None:
        for name, row in state.items():
            opened, misses, *pending = row
            self._demand[name] = DeploymentDemand(window_opened=None if opened < 0 else opened, misses=int(misses), pending=list(pending))
