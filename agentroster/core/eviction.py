"""Eviction safety: may a pool's silent agent be terminated now?

An agent workflow that missed its heartbeats asks its pool before it
terminates itself and deletes its pod (`may_evict`). The pool answers with an
`EvictionGuard`:

- **Self-preservation** (Netflix Eureka's): when more than `threshold` (50 %)
  of the pool's agents are silent -- those held now plus those terminated
  within their last heartbeat window -- it is likelier that the agents cannot
  reach us (a network partition, a broken heartbeat path, a paused worker)
  than that they all died at once. Nothing more is terminated while the share
  stays above the threshold: until enough heartbeats return, or an operator
  confirms. A single silent agent never turns it on.
- **A cap per window** (etcd's limit on lease revocations): at most
  max(1, cap_fraction x agents) terminations per heartbeat window (the
  asking agent's: 3 x its heartbeat interval); the others wait, unroutable,
  until a slot frees.
- An operator's confirmation (`confirm`) lets the named silent agents (or all)
  go, outside the cap and the count.

A single dead agent in a healthy fleet is allowed at once. Pure and
deterministic: `now` (seconds since the epoch) and the pool's size are passed
in; the pool tells the guard when an agent leaves its index (`forget`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from agentroster.messages import EvictionVerdict
from agentroster.models import EvictionPolicy, EvictionRecord, EvictionStatus

# A held agent asks again at most this often, whatever its window.
MIN_RETRY_S = 1.0
RECENT_KEPT = 20


def cap_for(policy: EvictionPolicy, population: int) -> int:
    """Terminations allowed per heartbeat window in a pool of `population` agents."""
    return max(1, math.floor(policy.cap_fraction * population))


@dataclass
class _Silent:
    window_s: float  # its heartbeat window, as it last asked
    confirmed: bool = False  # by an operator: let it go when it asks


@dataclass
class _Eviction:
    agent_id: str
    at: float
    window_s: float
    confirmed: bool  # by an operator: outside the cap and the count
    member: bool = True  # still in the pool's index (until its Terminated snapshot)


class _Window:
    """Terminations allowed and still inside their heartbeat window, with running counts,
    so a mass silence in a big pool costs O(log n) per ask, not a scan."""

    def __init__(self) -> None:
        self.records: dict[str, _Eviction] = {}
        self._ends: list[tuple[float, float, str]] = []  # (window end, allowed at, agent): a heap
        self.counted = 0  # not confirmed: what the cap and the count see
        self.counted_gone = 0  # of those, no longer in the pool's index
        self.confirmed_members = 0  # confirmed ones still in the index (left out of the pool's size)

    def __contains__(self, agent_id: str) -> bool:
        return agent_id in self.records

    def __bool__(self) -> bool:
        return bool(self.records)

    def values(self) -> Iterable[_Eviction]:
        return self.records.values()

    def _count(self, e: _Eviction, sign: int) -> None:
        if e.confirmed:
            self.confirmed_members += sign * e.member
        else:
            self.counted += sign
            self.counted_gone += sign * (not e.member)

    def add(self, e: _Eviction) -> None:
        self.pop(e.agent_id)
        self.records[e.agent_id] = e
        heapq.heappush(self._ends, (e.at + e.window_s, e.at, e.agent_id))
        self._count(e, +1)

    def pop(self, agent_id: str) -> _Eviction | None:
        e = self.records.pop(agent_id, None)
        if e is not None:
            self._count(e, -1)
        return e

    def left(self, agent_id: str) -> None:
        """The agent left the pool's index (terminated): it still counts, as one gone."""
        e = self.records.get(agent_id)
        if e is not None and e.member:
            self._count(e, -1)
            e.member = False
            self._count(e, +1)

    def prune(self, now: float) -> None:
        while self._ends and self._ends[0][0] <= now:
            _, at, agent_id = heapq.heappop(self._ends)
            e = self.records.get(agent_id)
            if e is not None and e.at == at:
                self.pop(agent_id)


def _dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc)


class EvictionGuard:
    """The pool's memory of silent agents and recent terminations, and its answers."""

    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        self.policy = policy or EvictionPolicy()
        # Agents held (or about to ask again). Always agents of the pool: the pool
        # forgets them when they leave its index.
        self.silent: dict[str, _Silent] = {}
        self._confirmed_silent = 0  # of those, how many an operator confirmed
        # Terminations allowed, kept while inside their window (never also in `silent`).
        self._window = _Window()
        self._recent: deque[_Eviction] = deque(maxlen=RECENT_KEPT)
        self.active = False  # self-preservation
        self.active_since: float | None = None
        self.warning: str | None = None
        self.counters: dict[str, int] = {"allowed": 0, "denied": 0, "confirmed": 0, "activations": 0}
        self._new_warnings: list[str] = []

    # ------------------------------------------------------------ questions
    def ask(self, agent_id: str, window_s: float, now: float, size: int, known: bool) -> EvictionVerdict:
        """An agent silent for its whole window asks to be terminated.

        `size` is how many agents the pool has now, `known` whether the asker is one
        of them; agents terminated within their window still count (as silent ones).
        """
        self._prune(now)
        if agent_id in self._window:
            return EvictionVerdict(allow=True, reason="already allowed")  # a retried ask
        if not known:
            # Nothing to route to, nothing to protect: a pool that lost its state
            # (the agent falls back to terminating), or an ask nobody should have sent.
            self.counters["allowed"] += 1
            return EvictionVerdict(allow=True, reason="not an agent of this pool")
        entry = self.silent.get(agent_id)
        if entry is None:
            entry = self.silent[agent_id] = _Silent(window_s=window_s)
        entry.window_s = window_s
        if not self.policy.enabled:
            return self._allow(agent_id, entry, now, "eviction safety is off")
        if entry.confirmed:
            return self._allow(agent_id, entry, now, "confirmed by an operator")
        _, population = self._evaluate(now, size, "")
        if self.active:
            return self._deny(window_s, f"self-preservation: {self.warning}")
        cap = cap_for(self.policy, population)
        if self._window.counted >= cap:
            retry = min(e.at + e.window_s for e in self._window.values() if not e.confirmed) - now
            return self._deny(
                retry,
                f"eviction cap reached: {self._window.counted} of {cap} termination(s) per heartbeat window in a pool of {population}",
            )
        return self._allow(agent_id, entry, now, "")

    def _allow(self, agent_id: str, entry: _Silent, now: float, reason: str) -> EvictionVerdict:
        self._drop_silent(agent_id)
        record = _Eviction(agent_id=agent_id, at=now, window_s=entry.window_s, confirmed=entry.confirmed)
        self._window.add(record)
        self._recent.append(record)
        self.counters["allowed"] += 1
        if entry.confirmed:
            self.counters["confirmed"] += 1
        return EvictionVerdict(allow=True, reason=reason, self_preservation=self.active)

    def _deny(self, retry_after_s: float, reason: str) -> EvictionVerdict:
        self.counters["denied"] += 1
        return EvictionVerdict(
            allow=False, retry_after_s=max(MIN_RETRY_S, retry_after_s), reason=reason[:1024], self_preservation=self.active
        )

    # --------------------------------------------------------------- events
    def concerns(self, agent_id: str) -> bool:
        """Whether a word from this agent's workflow would change anything here (it is silent, or allowed to go)."""
        return agent_id in self.silent or agent_id in self._window

    def heard_from(self, agent_id: str, now: float, size: int) -> bool:
        """The agent's workflow spoke for it (a snapshot): it is not silent. Whether it was."""
        if not self.silent and not self._window:
            return False  # the common case, on every snapshot
        was = self._drop_silent(agent_id)
        # Allowed, then a heartbeat came after all: it stays, and frees its slot of the cap.
        was = self._window.pop(agent_id) is not None or was
        if was:
            self._evaluate(now, size, "heartbeats returned")
        return was

    def forget(self, agent_id: str, now: float, size: int) -> None:
        """The agent left the pool (terminated, drained, dropped): it is no longer held."""
        self._window.left(agent_id)
        if self._drop_silent(agent_id):
            self._evaluate(now, size, f"agent {agent_id} left the pool")

    def _drop_silent(self, agent_id: str) -> bool:
        entry = self.silent.pop(agent_id, None)
        if entry is not None and entry.confirmed:
            self._confirmed_silent -= 1
        return entry is not None

    def confirm(self, agent_ids: Iterable[str] | None, now: float, size: int) -> list[str]:
        """An operator says these silent agents (None: all) are really gone: let them go when they ask."""
        wanted = sorted(self.silent) if agent_ids is None else [a for a in dict.fromkeys(agent_ids) if a in self.silent]
        for agent_id in wanted:
            if not self.silent[agent_id].confirmed:
                self.silent[agent_id].confirmed = True
                self._confirmed_silent += 1
        if wanted:
            self._warn(f"an operator confirmed the eviction of {len(wanted)} silent agent(s): {', '.join(wanted[:10])}"
                       + (" ..." if len(wanted) > 10 else ""))
            self._evaluate(now, size, "an operator confirmed evictions")
        return wanted

    def set_policy(self, policy: EvictionPolicy, now: float, size: int) -> None:
        self.policy = policy
        self._evaluate(now, size, "eviction policy changed")

    def releasable(self) -> list[str]:
        """Held agents whose next ask will be allowed whatever the count (confirmed, or safety off)."""
        return sorted(a for a, s in self.silent.items() if s.confirmed or not self.policy.enabled)

    # ------------------------------------------------------------- counting
    def _prune(self, now: float) -> None:
        """Forget terminations whose window has passed."""
        self._window.prune(now)

    def lost_and_population(self, size: int) -> tuple[int, int]:
        """(silent agents, agents): held ones and those terminated within their window, of the pool's
        `size` agents plus those; agents an operator confirmed are left out of both.

        O(1) (running counts): a mass silence in a big pool asks thousands of times.
        """
        w = self._window
        lost = len(self.silent) - self._confirmed_silent + w.counted
        # Held agents are agents of the pool (forgotten when they leave its index).
        population = size - self._confirmed_silent + w.counted_gone - w.confirmed_members
        return lost, max(population, lost)

    def engaged(self, lost: int, population: int) -> bool:
        """Self-preservation: more than `threshold` of the pool silent (and more than one agent)."""
        return self.policy.enabled and lost >= 2 and lost > self.policy.threshold * population

    def _evaluate(self, now: float, size: int, why: str) -> tuple[int, int]:
        self._prune(now)
        lost, population = self.lost_and_population(size)
        engaged = self.engaged(lost, population)
        if engaged and not self.active:
            self.active, self.active_since = True, now
            self.counters["activations"] += 1
            self.warning = (
                f"{lost} of {population} agents went silent within a heartbeat window "
                f"(more than {self.policy.threshold:.0%}); terminations are held until heartbeats return "
                "or an operator confirms (agentroster evictions confirm)"
            )
            self._warn(f"self-preservation on: {self.warning}")
        elif engaged:
            self.warning = (
                f"{lost} of {population} agents silent (more than {self.policy.threshold:.0%}); terminations are held "
                "until heartbeats return or an operator confirms (agentroster evictions confirm)"
            )
        elif self.active:
            self.active, self.warning = False, None
            self._warn(f"self-preservation off: {lost} of {population} agents silent" + (f" ({why})" if why else ""))
        return lost, population

    def _warn(self, text: str) -> None:
        self._new_warnings.append(text)

    def take_warnings(self) -> list[str]:
        out, self._new_warnings = self._new_warnings, []
        return out

    # -------------------------------------------------------------- reading
    def status(self) -> EvictionStatus:
        return EvictionStatus(
            policy=self.policy,
            self_preservation=self.active,
            since=_dt(self.active_since) if self.active else None,
            warning=self.warning,
            silent=sorted(a for a, s in self.silent.items() if not s.confirmed),
            confirmed=sorted(a for a, s in self.silent.items() if s.confirmed),
            recent=[EvictionRecord(agent_id=e.agent_id, at=_dt(e.at), confirmed=e.confirmed) for e in self._recent],
            evictions_allowed=self.counters["allowed"],
            evictions_denied=self.counters["denied"],
            evictions_confirmed=self.counters["confirmed"],
            self_preservation_activations=self.counters["activations"],
        )

    def unroutable(self) -> list[str]:
        """Agents the pool must not route to: held ones and those allowed to go."""
        return sorted({*self.silent, *self._window.records})

    @property
    def idle(self) -> bool:
        """Nothing silent and nothing recent: the guard has nothing to carry or check."""
        return not self.silent and not self._window

    # ------------------------------------------------------- continue-as-new
    def state(self) -> dict[str, Any]:
        return {
            "policy": self.policy.model_dump(mode="json"),
            "silent": {a: [s.window_s, s.confirmed] for a, s in sorted(self.silent.items())},
            "window": [[e.agent_id, e.at, e.window_s, e.confirmed, e.member] for e in self._window.values()],
            "recent": [[e.agent_id, e.at, e.window_s, e.confirmed] for e in self._recent],
            "active": self.active,
            "active_since": self.active_since,
            "warning": self.warning,
            "counters": dict(self.counters),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EvictionGuard:
        guard = cls(EvictionPolicy.model_validate(state["policy"]) if state.get("policy") else None)
        for agent_id, (window_s, confirmed) in (state.get("silent") or {}).items():
            guard.silent[agent_id] = _Silent(window_s, confirmed)
            guard._confirmed_silent += bool(confirmed)
        for row in state.get("window") or []:
            guard._window.add(_Eviction(*row))
        guard._recent.extend(_Eviction(*row) for row in state.get("recent") or [])
        guard.active = bool(state.get("active"))
        guard.active_since = state.get("active_since")
        guard.warning = state.get("warning")
        guard.counters.update(state.get("counters") or {})
        return guard
