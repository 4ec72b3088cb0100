"""Sizing decisions for deployments whose `PoolPolicy` sizes them: up fast, down slowly, recycle worn agents.

Desired replicas = clamp(ceil((in-flight + waiting) / target_in_flight_per_agent),
min_replicas, max_replicas). Demand above supply for `upscale_delay_s` asks for
the difference at once (replicas requested and not yet registered count as
pending, so booting pods do not cause a storm). Supply above demand for
`downscale_delay_s` picks idle victims, most used first, never a busy agent.
An agent that reached `max_uses` is replaced first (a surge of one, within
max_replicas + 1), then retired.

Pure and deterministic: `now` and the deployments' load are passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agentroster.messages import ScaleRequest
from agentroster.models import PoolPolicy

PENDING_TTL_S = 120.0  # a requested replica that has not registered by then is not coming


@dataclass
class DeploymentLoad:
    """One deployment as the pool sees it now (agents draining or on their way out excluded)."""

    registered: int = 0  # agents that hold a pod: serving ones and worn ones not yet retired
    serving: int = 0  # of those, the ones that take leases
    in_flight: int = 0
    waiting: int = 0
    idle: list[tuple[int, str]] = field(default_factory=list)  # (uses, agent id) of serving agents with nothing in flight
    worn: list[str] = field(default_factory=list)  # reached max_uses, still holding a pod


@dataclass
class ScaleDown:
    """Retire `victims` (set their deletion cost, patch replicas, drain them)."""

    deployment: str
    replicas: int
    victims: list[str]
    reason: str


@dataclass
class _Window:
    high_since: float | None = None
    low_since: float | None = None
    pending: list[float] = field(default_factory=list)  # when each pending replica was asked for
    replacing: str | None = None  # the worn agent whose replacement is on its way
    replacing_since: float = 0.0
    replacement_arrived: bool = False


def desired_replicas(policy: PoolPolicy, in_flight: int, waiting: int) -> int:
    assert policy.max_replicas is not None  # (a policy that sizes)
    wanted = math.ceil((in_flight + waiting) / policy.target_in_flight_per_agent)
    return max(policy.min_replicas, min(policy.max_replicas, wanted))


class Autoscaler:
    """Every deployment's policy (`policies`); those that size (`sizing`) are sized here."""

    def __init__(self) -> None:
        self.policies: dict[str, PoolPolicy] = {}
        self._windows: dict[str, _Window] = {}  # one per sizing policy

    @property
    def sizing(self) -> dict[str, PoolPolicy]:
        """The policies that size their deployment (those with max_replicas)."""
        return {d: p for d, p in self.policies.items() if p.sizes}

    def set_policy(self, deployment: str, policy: PoolPolicy | None) -> None:
        self.policies.pop(deployment, None)
        if policy is not None:
            self.policies[deployment] = policy
        if policy is not None and policy.sizes:
            self._windows.setdefault(deployment, _Window())
        else:
            self._windows.pop(deployment, None)

    def sizes(self, deployment: str) -> bool:
        """Whether `deployment` has a policy that sizes it."""
        policy = self.policies.get(deployment)
        return policy is not None and policy.sizes

    def registered(self, deployment: str, now: float) -> None:
        """A new replica of `deployment` registered: one pending replica has arrived."""
        window = self._windows.get(deployment)
        if window is None:
            return
        if window.pending:
            window.pending.pop(0)
        if window.replacing is not None and now >= window.replacing_since:
            window.replacement_arrived = True

    def forget_agent(self, agent_id: str) -> None:
        for window in self._windows.values():
            if window.replacing == agent_id:
                window.replacing = None
                window.replacement_arrived = False

    def evaluate(self, now: float, loads: dict[str, DeploymentLoad]) -> tuple[list[ScaleRequest], list[ScaleDown]]:
        """What to do now for every deployment whose policy sizes it."""
        ups: list[ScaleRequest] = []
        downs: list[ScaleDown] = []
        for deployment, policy in sorted(self.sizing.items()):
            assert policy.max_replicas is not None
            load = loads.get(deployment, DeploymentLoad())
            window = self._windows.setdefault(deployment, _Window())
            window.pending = [t for t in window.pending if now - t < PENDING_TTL_S]
            pending = len(window.pending)
            target = desired_replicas(policy, load.in_flight, load.waiting)
            supply = load.serving + pending

            # Recycling: replace one worn agent at a time, then retire it.
            if window.replacing is not None and window.replacing not in load.worn:
                window.replacing, window.replacement_arrived = None, False  # gone meanwhile
            if window.replacing is None and load.worn:
                window.replacing, window.replacing_since, window.replacement_arrived = load.worn[0], now, False
                if load.registered + pending + 1 <= policy.max_replicas + 1:
                    window.pending.append(now)
                    ups.append(ScaleRequest(
                        deployment=deployment,
                        replicas=load.registered + pending + 1,
                        at_least=True,
                        reason=f"replacing {load.worn[0]} (reached max_uses {policy.max_uses})",
                    ))
                    continue
            if window.replacing is not None and (
                window.replacement_arrived or now - window.replacing_since >= PENDING_TTL_S
            ):
                worn = window.replacing
                window.replacing, window.replacement_arrived = None, False
                downs.append(ScaleDown(
                    deployment=deployment,
                    replicas=max(0, load.registered + pending - 1),
                    victims=[worn],
                    reason=f"recycled: reached max_uses {policy.max_uses}",
                ))
                continue

            if target > supply or load.serving + pending < policy.min_replicas:
                window.low_since = None
                if window.high_since is None:
                    window.high_since = now
                below_min = load.serving + pending < policy.min_replicas
                if below_min or now - window.high_since >= policy.upscale_delay_s:
                    window.high_since = None
                    extra = target - supply
                    window.pending.extend([now] * extra)
                    ups.append(ScaleRequest(
                        deployment=deployment,
                        replicas=load.registered + pending + extra,
                        at_least=True,
                        reason=(
                            f"desired {target} (in flight {load.in_flight}, waiting {load.waiting}, "
                            f"target {policy.target_in_flight_per_agent:g}/agent), {load.serving} serving, {pending} pending"
                        ),
                    ))
            elif target < load.serving and pending == 0 and window.replacing is None:
                window.high_since = None
                if window.low_since is None:
                    window.low_since = now
                if now - window.low_since >= policy.downscale_delay_s:
                    window.low_since = None
                    victims = [agent for _, agent in sorted(load.idle, key=lambda u: (-u[0], u[1]))][: load.serving - target]
                    if victims:
                        downs.append(ScaleDown(
                            deployment=deployment,
                            replicas=load.registered - len(victims),
                            victims=victims,
                            reason=(
                                f"desired {target} for {policy.downscale_delay_s:g}s "
                                f"(in flight {load.in_flight}, waiting {load.waiting}), {load.serving} serving"
                            ),
                        ))
            else:
                window.high_since = window.low_since = None
        return ups, downs

    def ask(self, deployment: str, load: DeploymentLoad, extra: int, now: float, reason: str) -> ScaleRequest | None:
        """A scale-up asked for outside the policy's own rhythm (a caller's `scale_up`, or a
        breaker open in `on_demand` mode): up to `extra` more replicas now, within max_replicas,
        counted as pending like the policy's own (no storm). None when there is no room."""
        policy = self.policies[deployment]
        assert policy.max_replicas is not None
        window = self._windows.setdefault(deployment, _Window())
        window.pending = [t for t in window.pending if now - t < PENDING_TTL_S]
        pending = len(window.pending)
        add = min(extra, policy.max_replicas - (load.registered + pending))
        if add <= 0:
            return None
        window.pending.extend([now] * add)
        return ScaleRequest(deployment=deployment, replicas=load.registered + pending + add, at_least=True, reason=reason)

    def next_due(self) -> float | None:
        """The earliest moment a window closes on its own (no message needed)."""
        moments: list[float] = []
        for deployment, window in self._windows.items():
            policy = self.policies.get(deployment)
            if policy is None or not policy.sizes:
                continue
            if window.high_since is not None:
                moments.append(window.high_since + policy.upscale_delay_s)
            if window.low_since is not None:
                moments.append(window.low_since + policy.downscale_delay_s)
            if window.replacing is not None:
                moments.append(window.replacing_since + PENDING_TTL_S)
            if window.pending:
                moments.append(window.pending[0] + PENDING_TTL_S)
        return min(moments) if moments else None

    # ------------------------------------------------------- continue-as-new
    def state(self) -> dict[str, dict]:
        """Every policy, and the sizing windows of those that size."""
        out: dict[str, dict] = {}
        for d, policy in sorted(self.policies.items()):
            row: dict = {"policy": policy.model_dump(mode="json")}
            w = self._windows.get(d)
            if w is not None:
                row.update(
                    high_since=w.high_since,
                    low_since=w.low_since,
                    pending=list(w.pending),
                    replacing=w.replacing,
                    replacing_since=w.replacing_since,
                    replacement_arrived=w.replacement_arrived,
                )
            out[d] = row
        return out

    @classmethod
    def from_state(cls, state: dict[str, dict]) -> Autoscaler:
        scaler = cls()
        for deployment, row in state.items():
            scaler.set_policy(deployment, PoolPolicy.model_validate(row["policy"]))
            if scaler.sizes(deployment):
                scaler._windows[deployment] = _Window(
                    high_since=row.get("high_since"),
                    low_since=row.get("low_since"),
                    pending=list(row.get("pending", [])),
                    replacing=row.get("replacing"),
                    replacing_since=row.get("replacing_since", 0.0),
                    replacement_arrived=row.get("replacement_arrived", False),
                )
        return scaler
