"""The capability index: name -> version -> agents, and selection from it.

Every (name, version) keeps a sorted list of the agents that could take a
lease for it right now (routable state, free slot), ordered by
(cost class, total in-flight, agent id). A pick is therefore the head of one
sorted list per matching version: O(V log n) for V versions of a name, never a
scan of every agent. Removing an agent prunes it from every structure, so no
ghost is ever routed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from agentroster.errors import PoolReport
from agentroster.messages import CapabilityDigest
from agentroster.models import (
    COST_RANK,
    ROUTABLE_STATES,
    AgentState,
    CapabilityRef,
    effective_total_concurrency,
)
from agentroster.vocabulary.versions import matches as version_matches

SortKey = tuple[int, int, str]


@dataclass
class IndexedAgent:
    """What the pool knows about one agent: routing facts and load."""

    agent_id: str
    deployment: str
    endpoint: str
    state: AgentState
    capabilities: dict[str, CapabilityDigest]
    in_flight: dict[str, int] = field(default_factory=dict)
    # Agent-wide cap across capabilities (the registration's, else the largest capability's).
    max_concurrency: int = 1
    # Stopped heartbeating (it asked its pool to be terminated): never routed until it recovers.
    silent: bool = False
    # A snapshot said it stops serving (Draining, Terminated): not routed while the pool reads its workflow.
    held: bool = False
    # Out of routing for its tasks' outcomes (`core.outliers`): alive, back after a trial task.
    ejected: bool = False

    @property
    def total_in_flight(self) -> int:
        return sum(self.in_flight.values())

    def has_free_slot(self, name: str) -> bool:
        """A lease for `name` fits both the capability's and the agent's cap."""
        cap = self.capabilities.get(name)
        return (
            cap is not None
            and self.in_flight.get(name, 0) < cap.max_concurrency
            and self.total_in_flight < self.max_concurrency
        )

    @property
    def saturated(self) -> bool:
        """Busy: no free slot at all (the agent's cap is reached, or every capability's)."""
        return all(not self.has_free_slot(name) for name in self.capabilities)

    @property
    def routable(self) -> bool:
        return self.state in ROUTABLE_STATES and not self.silent and not self.held and not self.ejected


class CapabilityIndex:
    """Multimap of capability name -> version -> agents, with O(log n) picks."""

    def __init__(self) -> None:
        self._agents: dict[str, IndexedAgent] = {}
        # name -> version -> every agent advertising it (for reports and drift)
        self._members: dict[str, dict[str, set[str]]] = {}
        # name -> version -> agents that can take a lease now, best first
        self._free: dict[str, dict[str, SortedList]] = {}
        # (agent, name) -> the key it is listed under in _free
        self._listed: dict[tuple[str, str], SortKey] = {}
        self._match_cache: dict[tuple[str, str], bool] = {}
        # name -> version -> deployment -> how many of its agents advertise it
        self._deployments: dict[str, dict[str, dict[str, int]]] = {}
        # state -> how many agents are in it (the pool's current details read it on every wake)
        self._states: dict[AgentState, int] = {}
        # While a pool is rebuilt from carried state: free-list keys gathered per
        # (name, version), sorted once at the end instead of inserted one by one.
        self._bulk: dict[tuple[str, str], list[SortKey]] | None = None

    # -- membership ------------------------------------------------------------
    def __contains__(self, agent_id: str) -> bool:
        return agent_id in self._agents

    def __len__(self) -> int:
        return len(self._agents)

    def get(self, agent_id: str) -> IndexedAgent | None:
        return self._agents.get(agent_id)

    def agents(self) -> Iterable[IndexedAgent]:
        return self._agents.values()

    def upsert(
        self,
        agent_id: str,
        deployment: str,
        endpoint: str,
        state: AgentState,
        capabilities: Iterable[CapabilityDigest],
        max_concurrency: int | None = None,
        in_flight: dict[str, int] | None = None,
    ) -> IndexedAgent:
        """Add an agent or replace its capabilities, keeping in-flight counts of capabilities it still has.

        `max_concurrency` caps the agent across capabilities (None: the largest capability's).
        `in_flight` seeds a new agent's counts (a pool rebuilt from carried leases lists
        each agent once instead of once per lease).
        """
        old = self._agents.get(agent_id)
        in_flight = dict(old.in_flight) if old else dict(in_flight or {})
        if old:
            self.remove(agent_id)
        caps = {c.name: c for c in capabilities}
        agent = IndexedAgent(
            agent_id=agent_id,
            deployment=deployment,
            endpoint=endpoint,
            state=state,
            capabilities=caps,
            in_flight={n: v for n, v in in_flight.items() if n in caps and v > 0},
            max_concurrency=effective_total_concurrency(max_concurrency, list(caps.values())),
            ejected=old.ejected if old else False,
        )
        self._agents[agent_id] = agent
        self._states[state] = self._states.get(state, 0) + 1
        for cap in caps.values():
            self._members.setdefault(cap.name, {}).setdefault(cap.version, set()).add(agent_id)
            counts = self._deployments.setdefault(cap.name, {}).setdefault(cap.version, {})
            counts[deployment] = counts.get(deployment, 0) + 1
        self._relist(agent)
        return agent

    def remove(self, agent_id: str) -> IndexedAgent | None:
        """Prune the agent from every structure. Returns what was removed."""
        agent = self._agents.pop(agent_id, None)
        if agent is None:
            return None
        self._count_out(agent.state)
        for cap in agent.capabilities.values():
            self._unlist(agent_id, cap)
            versions = self._members.get(cap.name, {})
            holders = versions.get(cap.version)
            if holders is not None:
                holders.discard(agent_id)
                if not holders:
                    del versions[cap.version]
            if not versions:
                self._members.pop(cap.name, None)
            by_version = self._deployments.get(cap.name, {})
            counts = by_version.get(cap.version, {})
            if agent.deployment in counts:
                counts[agent.deployment] -= 1
                if counts[agent.deployment] == 0:
                    del counts[agent.deployment]
                if not counts:
                    del by_version[cap.version]
                if not by_version:
                    del self._deployments[cap.name]
        return agent

    def set_state(self, agent_id: str, state: AgentState) -> None:
        agent = self._agents[agent_id]
        self._count_out(agent.state)
        self._states[state] = self._states.get(state, 0) + 1
        agent.state = state
        self._relist(agent)

    def _count_out(self, state: AgentState) -> None:
        left = self._states[state] - 1
        if left:
            self._states[state] = left
        else:
            del self._states[state]

    def state_counts(self) -> dict[AgentState, int]:
        """How many agents are in each state (only states some agent is in); O(states)."""
        return dict(self._states)

    def set_silent(self, agent_id: str, silent: bool) -> None:
        """Mark an agent silent (unroutable whatever its state) or heard from again."""
        agent = self._agents[agent_id]
        if agent.silent != silent:
            agent.silent = silent
            self._relist(agent)

    def set_held(self, agent_id: str, held: bool) -> None:
        """Stop routing to an agent while a word that it stops serving is checked (or route to it again)."""
        agent = self._agents.get(agent_id)
        if agent is not None and agent.held != held:
            agent.held = held
            self._relist(agent)

    def set_ejected(self, agent_id: str, ejected: bool) -> None:
        """Take an agent out of routing for its tasks' outcomes (or put it back)."""
        agent = self._agents.get(agent_id)
        if agent is not None and agent.ejected != ejected:
            agent.ejected = ejected
            self._relist(agent)

    def add_load(self, agent_id: str, name: str, delta: int) -> IndexedAgent:
        """Change the agent's in-flight count for `name` by `delta` (never below zero)."""
        agent = self._agents[agent_id]
        agent.in_flight[name] = max(0, agent.in_flight.get(name, 0) + delta)
        if agent.in_flight[name] == 0:
            del agent.in_flight[name]
        self._relist(agent)
        return agent

    # -- sorted free lists ----------------------------------------------------
    def _key(self, agent: IndexedAgent, cap: CapabilityDigest) -> SortKey:
        return (COST_RANK[cap.cost_class], agent.total_in_flight, agent.agent_id)

    def _unlist(self, agent_id: str, cap: CapabilityDigest) -> None:
        key = self._listed.pop((agent_id, cap.name), None)
        if key is None:
            return
        if self._bulk is not None:
            self.end_bulk()  # listed during a rebuild (a repeated row): sort first, then change it
        versions = self._free[cap.name]
        lst = versions[cap.version]
        lst.remove(key)
        if not lst:
            del versions[cap.version]
            if not versions:
                del self._free[cap.name]

    def _relist(self, agent: IndexedAgent) -> None:
        for cap in agent.capabilities.values():
            self._unlist(agent.agent_id, cap)
            if agent.routable and agent.has_free_slot(cap.name):
                key = self._key(agent, cap)
                if self._bulk is not None:
                    self._bulk.setdefault((cap.name, cap.version), []).append(key)
                else:
                    self._free.setdefault(cap.name, {}).setdefault(cap.version, SortedList()).add(key)
                self._listed[(agent.agent_id, cap.name)] = key

    def begin_bulk(self) -> None:
        """Gather free-list entries until `end_bulk` (a rebuild adding thousands of agents at once)."""
        self.end_bulk()
        self._bulk = {}

    def end_bulk(self) -> None:
        """Sort what `begin_bulk` gathered into the free lists (picks read only those)."""
        bulk, self._bulk = self._bulk, None
        for (name, version), keys in (bulk or {}).items():
            versions = self._free.setdefault(name, {})
            if version in versions:
                versions[version].update(keys)
            else:
                versions[version] = SortedList(keys)

    # -- selection ------------------------------------------------------------
    def _matches(self, ref: CapabilityRef, version: str) -> bool:
        cache_key = (ref.specifier, version)
        hit = self._match_cache.get(cache_key)
        if hit is None:
            try:
                hit = version_matches(ref.specifier, version)
            except ValueError:
                hit = False  # contracts keep such versions out; never let one break a pick
            if len(self._match_cache) > 4096:
                self._match_cache.clear()
            self._match_cache[cache_key] = hit
        return hit

    def version_matches(self, ref: CapabilityRef, version: str) -> bool:
        return self._matches(ref, version)

    def agents_offering(self, name: str) -> set[str]:
        """Every agent advertising `name`, any version."""
        return set().union(*self._members.get(name, {}).values())

    def offers(self, name: str) -> bool:
        """Whether any indexed agent advertises some version of `name`."""
        return name in self._members

    def has_free_slot_for(self, name: str) -> bool:
        """Whether any routable agent has a free slot for some version of `name`: O(1)."""
        return name in self._free

    def matching_versions(self, ref: CapabilityRef) -> list[str]:
        """Versions of `ref.name` advertised by any agent that lie in the ref's range."""
        return [v for v in self._members.get(ref.name, {}) if self._matches(ref, v)]

    def pick(
        self, ref: CapabilityRef, exclude: frozenset[str] = frozenset(), max_cost: str | None = None
    ) -> tuple[IndexedAgent, CapabilityDigest] | None:
        """The best agent for `ref`: cheapest cost class, then fewest in flight, then agent id;
        none of a cost class above `max_cost` (a caller's cap: never a silent spill upward)."""
        best: SortKey | None = None
        cap_rank = COST_RANK[max_cost] if max_cost is not None else None
        for version, lst in self._free.get(ref.name, {}).items():
            if not self._matches(ref, version):
                continue
            for key in lst:
                if cap_rank is not None and key[0] > cap_rank:
                    break  # sorted by cost first: the rest cost more still
                if key[2] not in exclude:
                    if best is None or key < best:
                        best = key
                    break
        if best is None:
            return None
        agent = self._agents[best[2]]
        return agent, agent.capabilities[ref.name]

    def ranked(self, ref: CapabilityRef, exclude: frozenset[str] = frozenset()) -> Iterator[str]:
        """All agents that could take a lease for `ref` now, best first."""
        lists = [lst for v, lst in self._free.get(ref.name, {}).items() if self._matches(ref, v)]
        for key in heapq.merge(*lists):
            if key[2] not in exclude:
                yield key[2]

    def free_of(self, name: str) -> list[str]:
        """`agent_id@version` of every agent that could take a lease for `name` now (any version), best first."""
        lists = [[(key, version) for key in lst] for version, lst in self._free.get(name, {}).items()]
        return [f"{key[2]}@{version}" for key, version in heapq.merge(*lists)]

    def report(self, ref: CapabilityRef, exclude: frozenset[str] = frozenset(), max_cost: str | None = None) -> PoolReport:
        """Counts for a PoolExhaustedError: matching, busy, draining, routable, excluded by the caller
        or by its cost cap (`max_cost`)."""
        matching = busy = draining = routable = excluded = slots = idle_slots = over_cap = 0
        cap_rank = COST_RANK[max_cost] if max_cost is not None else None
        for version in self.matching_versions(ref):
            for agent_id in self._members[ref.name][version]:
                agent = self._agents[agent_id]
                matching += 1
                capped = cap_rank is not None and COST_RANK[agent.capabilities[ref.name].cost_class] > cap_rank
                if agent_id in exclude:
                    excluded += 1
                elif capped:
                    over_cap += 1
                elif agent.state == AgentState.DRAINING:
                    draining += 1
                elif agent.routable and agent.has_free_slot(ref.name):
                    routable += 1
                elif agent.routable:
                    busy += 1
                if agent_id not in exclude and not capped and agent.routable:
                    cap = agent.capabilities[ref.name]
                    slots += min(cap.max_concurrency, agent.max_concurrency)
                    idle_slots += max(0, min(cap.max_concurrency - agent.in_flight.get(ref.name, 0), agent.max_concurrency - agent.total_in_flight))
        return PoolReport(
            ref=str(ref), matching=matching, busy=busy, draining=draining, routable=routable, excluded=excluded,
            total_agents=len(self._agents), slots=slots, idle_slots=idle_slots,
            max_cost_class=max_cost, over_cost_cap=over_cap,
        )

    def versions_served(self, name: str) -> frozenset[str]:
        """Versions of `name` advertised by live (not draining) agents right now."""
        return frozenset(
            v
            for v, holders in self._members.get(name, {}).items()
            if any(self._agents[a].state != AgentState.DRAINING for a in holders)
        )

    def deployments_serving(self, ref: CapabilityRef) -> set[str]:
        """Deployments with an agent on a version in the ref's range: O(versions × deployments)."""
        return {d for v in self.matching_versions(ref) for d in self._deployments[ref.name][v]}
