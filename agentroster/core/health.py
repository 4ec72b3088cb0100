"""Active health checks and the per-capability circuit breaker.

Heartbeats say a process lives; they do not say it works (a hung event loop
can keep a heartbeat thread going, a model client can be broken). Idle agents
of deployments with a `PoolPolicy` are checked every `health_interval_s`
(`GET /healthz`, by one batched activity per round); `unhealthy_after`
consecutive failures make an agent unhealthy: unroutable, and replaced by its
deployment's policy. A passing check makes it healthy again.

The breaker watches each capability: when more than `breaker_threshold` of
the agents offering it are unhealthy it opens, and the policy's `breaker_mode`
says what acquires get (`fail_fast`: CircuitOpenError at once; `on_demand`:
they queue while fresh agents start; `route_anyway`: unhealthy agents are
routed to, as Envoy's panic routing). After `breaker_cooldown_s` it goes
half-open (the unhealthy agents are checked again at once) and closes once
the share is back under the threshold. Pure: `now` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentroster.models import PoolPolicy

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
HEALTH_BATCH_MAX = 200  # agents checked by one activity


@dataclass
class AgentHealth:
    failures: int = 0
    last_check: float = float("-inf")
    unhealthy: bool = False
    detail: str = ""


@dataclass
class Breaker:
    state: str = CLOSED
    since: float = 0.0
    mode: str = "on_demand"


@dataclass
class HealthTracker:
    agents: dict[str, AgentHealth] = field(default_factory=dict)
    breakers: dict[str, Breaker] = field(default_factory=dict)  # capability name -> breaker
    checking: set[str] = field(default_factory=set)  # checks in flight

    # ------------------------------------------------------------ checks
    def due(self, now: float, candidates: list[tuple[str, float]]) -> list[str]:
        """Of (agent id, interval) candidates, those whose next check is due and not already under way."""
        out = []
        for agent_id, interval in candidates:
            if agent_id in self.checking:
                continue
            health = self.agents.get(agent_id)
            if health is None or now >= health.last_check + interval:
                out.append(agent_id)
        self.checking.update(out)
        return out

    def next_due(self, candidates: list[tuple[str, float]]) -> float | None:
        moments = [
            (self.agents[a].last_check if a in self.agents else float("-inf")) + interval
            for a, interval in candidates
            if a not in self.checking
        ]
        return min(moments) if moments else None

    def record(self, agent_id: str, ok: bool, detail: str, now: float, unhealthy_after: int) -> str | None:
        """One check's result. Returns "unhealthy" or "recovered" when the agent's health flips."""
        self.checking.discard(agent_id)
        health = self.agents.setdefault(agent_id, AgentHealth())
        health.last_check = now
        health.detail = detail
        if ok:
            health.failures = 0
            if health.unhealthy:
                health.unhealthy = False
                return "recovered"
            return None
        health.failures += 1
        if not health.unhealthy and health.failures >= unhealthy_after:
            health.unhealthy = True
            return "unhealthy"
        return None

    def check_soon(self, agent_ids: list[str]) -> None:
        """Check these agents at the next chance (a half-open breaker's probes)."""
        for agent_id in agent_ids:
            self.agents.setdefault(agent_id, AgentHealth()).last_check = float("-inf")

    def is_unhealthy(self, agent_id: str) -> bool:
        health = self.agents.get(agent_id)
        return health is not None and health.unhealthy

    def unhealthy(self) -> list[str]:
        return sorted(a for a, h in self.agents.items() if h.unhealthy)

    def forget(self, agent_id: str) -> None:
        self.agents.pop(agent_id, None)
        self.checking.discard(agent_id)

    # ----------------------------------------------------------- breaker
    def evaluate_breaker(
        self, name: str, offering: list[str], policy: PoolPolicy, now: float
    ) -> tuple[str, str] | None:
        """Move `name`'s breaker given the agents offering it. Returns (new state, why) on a change."""
        breaker = self.breakers.setdefault(name, Breaker())
        breaker.mode = policy.breaker_mode
        sick = [a for a in offering if self.is_unhealthy(a)]
        share = len(sick) / len(offering) if offering else 0.0
        tripped = bool(offering) and share > policy.breaker_threshold
        why = f"{len(sick)} of {len(offering)} agent(s) offering {name} unhealthy (threshold {policy.breaker_threshold:.0%})"
        if breaker.state == CLOSED and tripped:
            breaker.state, breaker.since = OPEN, now
            return OPEN, why
        if breaker.state == OPEN and now >= breaker.since + policy.breaker_cooldown_s:
            breaker.state, breaker.since = HALF_OPEN, now
            self.check_soon(sick)
            return HALF_OPEN, f"cool-down of {policy.breaker_cooldown_s:g}s over: checking {len(sick)} agent(s) again"
        if breaker.state == HALF_OPEN and not (sick and any(a in self.checking or self.agents[a].last_check < breaker.since for a in sick)):
            # Every probe has answered.
            if tripped:
                breaker.state, breaker.since = OPEN, now
                return OPEN, why
            breaker.state, breaker.since = CLOSED, now
            return CLOSED, f"health returned: {why}"
        if breaker.state != CLOSED and not tripped and breaker.state == OPEN and not sick:
            breaker.state, breaker.since = CLOSED, now
            return CLOSED, f"health returned: {why}"
        return None

    def breaker_state(self, name: str) -> str:
        breaker = self.breakers.get(name)
        return breaker.state if breaker else CLOSED

    def open_mode(self, name: str) -> str | None:
        """The mode of `name`'s breaker when it is open, else None."""
        breaker = self.breakers.get(name)
        return breaker.mode if breaker is not None and breaker.state == OPEN else None

    def next_breaker_due(self, cooldowns: dict[str, float]) -> float | None:
        moments = [b.since + cooldowns[n] for n, b in self.breakers.items() if b.state == OPEN and n in cooldowns]
        return min(moments) if moments else None

    # ------------------------------------------------------- continue-as-new
    def state(self) -> dict[str, object]:
        return {
            "agents": {a: [h.failures, h.last_check if h.last_check != float("-inf") else None, h.unhealthy, h.detail]
                       for a, h in sorted(self.agents.items())},
            "breakers": {n: [b.state, b.since, b.mode] for n, b in sorted(self.breakers.items())},
        }

    @classmethod
    def from_state(cls, state: dict[str, object]) -> HealthTracker:
        tracker = cls()
        for agent_id, (failures, last, unhealthy, detail) in dict(state.get("agents", {})).items():  # type: ignore[call-overload]
            tracker.agents[agent_id] = AgentHealth(failures, float("-inf") if last is None else last, unhealthy, detail)
        for name, (st, since, mode) in dict(state.get("breakers", {})).items():  # type: ignore[call-overload]
            tracker.breakers[name] = Breaker(st, since, mode)
        return tracker
