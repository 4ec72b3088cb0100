"""Outlier ejection: agents whose tasks fail leave the rotation (Envoy's outlier detection).

Every release may say how its task went (`agentroster.messages.Outcome`). Per agent
the tracker keeps its failures in a row and a recent success rate (counts that halve
once they reach `WINDOW`, so old outcomes fade). An agent is ejected:

- after `consecutive_failures` failed tasks in a row (a timed-out task is a failure,
  so a hung agent leaves after a few tasks), or
- when, with at least `success_rate_min_volume` recent outcomes and at least
  `success_rate_min_peers` peers (agents sharing a capability) with as many, its
  success rate lies more than max(`success_rate_gap`, 1.9 standard deviations) below
  the peers' mean;

for `base_ejection_s` × the times it has been ejected (at most `max_ejection_s`); an
agent that stays in the rotation for `max_ejection_s` starts again from one. The pool
never ejects more than `max_ejection_percent` of a capability's agents (at least one
of two or more; never the only one). When the time is over the agent gets one trial
task (`probing`): a success brings it back, a failure ejects it again for longer.
Refusals (429, 503) and a lease released without an outcome neither count as
failures nor reset the count. Pure: `now` is passed in.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agentroster.models import OutlierPolicy

WINDOW = 100  # recent outcomes a success rate is read from (counts halve when they reach it)
FAILURES = frozenset({"failed_unreachable", "failed_5xx", "failed_timeout", "failed_bad_output"})
PEER_STATS_EVERY_S = 10.0  # how long the peers' success-rate figures are reused (Envoy's interval)
STDEV_FACTOR = 1.9  # Envoy's success_rate_stdev_factor (1900 / 1000)


@dataclass
class AgentOutcomes:
    consecutive: int = 0  # failures in a row
    ok: int = 0  # successes among the recent outcomes
    total: int = 0  # recent outcomes (successes and failures)
    times: int = 0  # ejections so far (the next one lasts times + 1 base ejections)
    until: float | None = None  # ejected until (None: routed)
    reason: str = ""  # why it is ejected
    probing: bool = False  # its ejection is over: one trial task decides
    probe_lease: str | None = None  # the trial task's lease, once granted
    back_at: float = 0.0  # when it came back into rotation

    @property
    def ejected(self) -> bool:
        return self.until is not None

    @property
    def rate(self) -> float:
        return self.ok / self.total if self.total else 1.0

    def row(self) -> list[object]:
        return [self.consecutive, self.ok, self.total, self.times, self.until, self.reason, self.probing, self.probe_lease, self.back_at]


@dataclass
class OutlierTracker:
    agents: dict[str, AgentOutcomes] = field(default_factory=dict)
    _ends: list[tuple[float, str]] = field(default_factory=list)  # (ejection end, agent): a heap
    _peer_stats: dict[str, tuple[float, dict[str, float]]] = field(default_factory=dict)  # capability -> (at, agent -> rate)

    # ------------------------------------------------------------ outcomes
    def record(self, agent_id: str, outcome: str, lease_id: str) -> str | None:
        """One task's outcome. Returns what follows: "restore" (its trial task succeeded),
        "eject" (failures in a row, or its trial failed), "judge_rate" (a failure the
        success-rate rule should look at), or None."""
        if outcome not in FAILURES and outcome != "succeeded":
            return None  # a refusal: the agent was busy or going, not broken
        agent = self.agents.setdefault(agent_id, AgentOutcomes())
        failed = outcome in FAILURES
        agent.total += 1
        agent.ok += not failed
        if agent.total >= WINDOW:
            agent.ok, agent.total = agent.ok // 2, agent.total // 2
        if agent.probing and agent.probe_lease == lease_id:
            agent.probe_lease = None
            if failed:
                agent.consecutive += 1
                agent.reason = f"its trial task failed ({outcome})"
                return "eject"
            agent.consecutive = 0
            return "restore"
        if not failed:
            agent.consecutive = 0
            return None
        agent.consecutive += 1
        return "judge_rate"

    def trips(self, agent_id: str, policy: OutlierPolicy) -> str | None:
        """Why the failures in a row eject the agent now, if they do."""
        agent = self.agents.get(agent_id)
        if agent is None or agent.ejected or agent.probing or agent.consecutive < policy.consecutive_failures:
            return None
        return f"{agent.consecutive} failed tasks in a row"

    def rate_trips(self, agent_id: str, peers: Callable[[], Iterable[str]], capability: str, policy: OutlierPolicy, now: float) -> str | None:
        """Why its success rate, far below its peers', ejects the agent now, if it does.
        `peers`: the agents sharing `capability` (read only when the cached figures are older
        than PEER_STATS_EVERY_S, so a burst of failures costs one pass over them)."""
        agent = self.agents.get(agent_id)
        if agent is None or agent.ejected or agent.probing or agent.total < policy.success_rate_min_volume:
            return None
        cached = self._peer_stats.get(capability)
        if cached is None or now - cached[0] >= PEER_STATS_EVERY_S:
            rates = {
                p: o.rate for p in peers() if (o := self.agents.get(p)) is not None and o.total >= policy.success_rate_min_volume and not o.ejected
            }
            cached = self._peer_stats[capability] = (now, rates)
        rates = [r for p, r in cached[1].items() if p != agent_id]  # its peers: the others
        if len(rates) < policy.success_rate_min_peers:
            return None
        mean = sum(rates) / len(rates)
        stdev = (sum((r - mean) ** 2 for r in rates) / len(rates)) ** 0.5
        threshold = mean - max(policy.success_rate_gap, STDEV_FACTOR * stdev)
        if agent.rate < threshold:
            return f"success rate {agent.rate:.0%} of its last {agent.total} tasks, below {threshold:.0%} (peers' mean {mean:.0%})"
        return None

    # ------------------------------------------------------------ ejection
    def eject(self, agent_id: str, reason: str, policy: OutlierPolicy, now: float) -> float:
        """Take the agent out of routing; returns until when."""
        agent = self.agents.setdefault(agent_id, AgentOutcomes())
        if not agent.probing and agent.back_at and now - agent.back_at >= policy.max_ejection_s:
            agent.times = 0  # long in rotation since its last ejection: a first offence again
        agent.times += 1
        agent.until = now + min(policy.base_ejection_s * agent.times, policy.max_ejection_s)
        agent.reason = reason
        agent.probing, agent.probe_lease = False, None
        heapq.heappush(self._ends, (agent.until, agent_id))
        return agent.until

    def ejection_over(self, now: float) -> list[str]:
        """Agents whose ejection time has passed: each now waits for its trial task."""
        out = []
        while self._ends and self._ends[0][0] <= now:
            until, agent_id = heapq.heappop(self._ends)
            agent = self.agents.get(agent_id)
            if agent is None or agent.until != until:
                continue  # forgotten, or ejected again since
            agent.until, agent.probing, agent.probe_lease = None, True, None
            out.append(agent_id)
        return out

    def next_end(self) -> float | None:
        while self._ends:
            until, agent_id = self._ends[0]
            agent = self.agents.get(agent_id)
            if agent is not None and agent.until == until:
                return until
            heapq.heappop(self._ends)
        return None

    def probe_granted(self, agent_id: str, lease_id: str) -> bool:
        """A lease went to an agent: True when it is the agent's trial task (route nothing more to it meanwhile)."""
        agent = self.agents.get(agent_id)
        if agent is None or not agent.probing or agent.probe_lease is not None:
            return False
        agent.probe_lease = lease_id
        return True

    def probe_ended(self, agent_id: str, lease_id: str) -> bool:
        """A lease ended with no outcome (expired, revoked, released bare): when it was the
        trial, the agent waits for another one. True when it did."""
        agent = self.agents.get(agent_id)
        if agent is None or agent.probe_lease != lease_id:
            return False
        agent.probe_lease = None
        return True

    def restore(self, agent_id: str, now: float) -> None:
        agent = self.agents.get(agent_id)
        if agent is not None:
            agent.until, agent.probing, agent.probe_lease, agent.reason = None, False, None, ""
            agent.consecutive, agent.ok, agent.total, agent.back_at = 0, 0, 0, now

    def is_out(self, agent_id: str) -> bool:
        """Not to be routed to: ejected, or probing with its trial task under way."""
        agent = self.agents.get(agent_id)
        return agent is not None and (agent.ejected or (agent.probing and agent.probe_lease is not None))

    def is_ejected(self, agent_id: str) -> bool:
        agent = self.agents.get(agent_id)
        return agent is not None and (agent.ejected or agent.probing)

    def ejected(self) -> list[str]:
        return sorted(a for a, o in self.agents.items() if o.ejected or o.probing)

    def forget(self, agent_id: str) -> None:
        self.agents.pop(agent_id, None)

    # ------------------------------------------------------- continue-as-new
    def state(self) -> dict[str, list[object]]:
        """Compact: one short row per agent that has a record worth keeping."""
        return {
            a: o.row()
            for a, o in sorted(self.agents.items())
            if o.consecutive or o.times or o.ejected or o.probing or o.total
        }

    @classmethod
    def from_state(cls, state: dict[str, list[object]]) -> OutlierTracker:
        tracker = cls()
        for agent_id, row in state.items():
            consecutive, ok, total, times, until, reason, probing, probe_lease, back_at = row
            agent = AgentOutcomes(
                int(consecutive), int(ok), int(total), int(times),  # type: ignore[call-overload]
                None if until is None else float(until),  # type: ignore[arg-type]
                str(reason), bool(probing), None if probe_lease is None else str(probe_lease), float(back_at),  # type: ignore[arg-type]
            )
            tracker.agents[agent_id] = agent
            if agent.until is not None:
                heapq.heappush(tracker._ends, (agent.until, agent_id))
        return tracker
