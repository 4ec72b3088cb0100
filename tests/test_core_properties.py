"""Properties of the pool's pure core, checked against brute force.

`PoolMachine` drives `PoolCore` with random sequences of registrations,
re-registrations, acquires (immediate and queued), releases (including unknown
and double releases), cancellations, drains, terminations, clock ticks and
continue-as-new round trips, and keeps its own simple model of the truth (the
agents, their capabilities, the active leases, the queued waiters). After
every step it checks the core against that model and against a linear scan:

* in-flight per agent and capability == active leases on it <= max_concurrency;
* every pick equals the brute-force minimum by (cost class, total in-flight,
  agent id) over agents in range with a free slot; find() is the full ranking;
* Draining and terminated agents are never picked or found; a terminated agent
  leaves no trace in the index internals or the lease book;
* waiters for the same ref are granted oldest first, and never dropped before
  their wait ran out;
* to_state() -> JSON -> from_state() keeps find(), the leases and the waiters.

Plain unit tests for LeaseBook, DriftDetector and ScaleCoalescer follow.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import COST_RANK, AgentState, CapabilityRef
from agentroster.core.drift import DriftDetector
from agentroster.core.leases import LeaseBook, LeaseRecord
from agentroster.core.pool import WAITER_GRACE_S, PoolCore, PoolCoreState
from agentroster.core.state_codec import decode_state, encode_state
from agentroster.vocabulary.wire import PoolInput
from temporalio.contrib.pydantic import pydantic_data_converter
from agentroster.core.scaling import ScaleCoalescer

S = AgentState

NAMES = ["rag.search", "code.exec", "math.solve"]
UNSERVED = "image.gen"
VERSIONS = ["1.0.0", "1.5.0", "2.0.0", "2.1.0-rc.1", "2.4.1", "3.0.0"]
SPECS = ["", ">=2,<3", ">=1,<2", "==1.5.0", ">=2", "<2", "!=2.0.0", ">=3", ">=9"]
ALL_REFS = [f"{n}@{s}" if s else n for n in [*NAMES, UNSERVED] for s in SPECS]
LETTERS = "abcdefghij"


@lru_cache(maxsize=None)
def _spec(specifier: str) -> SpecifierSet:
    return SpecifierSet(specifier)


@lru_cache(maxsize=None)
def _version(version: str) -> Version:
    return Version(version)


def in_range(specifier: str, version: str) -> bool:
    # No SPECS entry names a pre-release, so only a bare name takes 2.1.0-rc.1
    # (agentroster.vocabulary.versions: a range matches a pre-release only when it names one).
    return _spec(specifier).contains(_version(version), prereleases=not specifier)


def norm(ref: str) -> str:
    return str(CapabilityRef.parse(ref))


def brute_ranked_index(index, ref: CapabilityRef, exclude: frozenset[str]) -> list[str]:
    """Linear scan over the index's agents (not its sorted lists)."""
    rows = []
    for agent in list(index.agents()):
        if agent.state not in (S.READY, S.BUSY) or agent.agent_id in exclude:
            continue
        cap = agent.capabilities.get(ref.name)
        if cap is None or not in_range(ref.specifier, cap.version):
            continue
        if agent.in_flight.get(ref.name, 0) >= cap.max_concurrency:
            continue
        # The agent-wide cap: by default the largest capability's max_concurrency.
        if sum(agent.in_flight.values()) >= max(c.max_concurrency for c in agent.capabilities.values()):
            continue
        rows.append((COST_RANK[cap.cost_class], sum(agent.in_flight.values()), agent.agent_id))
    return [r[2] for r in sorted(rows)]


@dataclass
class ModelWaiter:
    ticket: str
    key: tuple[str, tuple[str, ...]]  # (normalised ref, exclude)
    expires_at: float
    workflow_holder: bool = False
    ttl: float = 300.0


caps_strategy = st.lists(
    st.tuples(
        st.sampled_from(NAMES),
        st.sampled_from(VERSIONS),
        st.integers(1, 3),
        st.sampled_from(["A", "B", "C"]),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda c: c[0],
)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1_700_000_000.0
        self._ids = itertools.count()
        self._agent_seq = itertools.count()
        self.core = self._wrap(PoolCore("prop", scale_window_s=5.0))
        self.live: dict[str, dict[str, CapabilityDigest]] = {}
        self.draining: dict[str, dict[str, CapabilityDigest]] = {}
        self.deployment: dict[str, str] = {}
        self.removed: set[str] = set()
        self.leases: dict[str, tuple[str, str, float]] = {}  # lease id -> (agent, capability, deadline)
        self.ended: list[str] = []
        self.waiters: list[ModelWaiter] = []
        self.workflow_held: set[str] = set()  # leases whose holder is a workflow (told on revocation/expiry)
        self.expected_revocations: set[str] = set()
        self.picks_checked = 0
        self.offered: set[str] = set()  # capability names any agent ever offered in this pool
        self._requests = itertools.count()
        self.forged: set[str] = set()  # snapshots no agent workflow sent (the check says so)

    # ----------------------------------------------------------- plumbing
    def new_id(self) -> str:
        return f"id-{next(self._ids):05d}"

    def _wrap(self, core: PoolCore) -> PoolCore:
        """Check every pick the core makes (direct or for a waiter) against a linear scan;
        answer the pool's checks of new agents as the workflow's activity would (they run)."""
        original = core.index.pick
        original_snapshot = core.agent_snapshot

        def snapshot_then_verify(snap: AgentSnapshot, now: float, new_id) -> None:  # noqa: ANN001
            original_snapshot(snap, now, new_id)
            for agent_id in core.take_verifications():
                core.agent_verified(agent_id, snap.agent_id not in self.forged, now, new_id)

        core.agent_snapshot = snapshot_then_verify  # type: ignore[method-assign]

        def checked_pick(ref: CapabilityRef, exclude: frozenset[str] = frozenset(), max_cost: str | None = None):
            assert max_cost is None  # (this machine sends no cost caps; test_supervisor_decides checks them)
            expected = brute_ranked_index(core.index, ref, exclude)
            got = original(ref, exclude, max_cost)
            assert (got[0].agent_id if got else None) == (expected[0] if expected else None), (str(ref), expected, got)
            if got is not None:
                agent, cap = got
                assert agent.state in (S.READY, S.BUSY)
                assert agent.agent_id not in self.removed and agent.agent_id not in self.draining
                assert cap is agent.capabilities[ref.name] and in_range(ref.specifier, cap.version)
            self.picks_checked += 1
            return got

        core.index.pick = checked_pick  # type: ignore[method-assign]
        return core

    def _known(self) -> dict[str, dict[str, CapabilityDigest]]:
        return {**self.live, **self.draining}

    def _grant_seen(self, lease_id: str, key: tuple[str, tuple[str, ...]], workflow_holder: bool, ttl: float) -> None:
        record = self.core.leases.get(lease_id)
        assert record is not None
        assert record.granted_at == self.now and record.deadline == self.now + ttl
        assert record.holder_is_workflow is workflow_holder
        if workflow_holder:
            self.workflow_held.add(lease_id)
        assert lease_id not in self.leases and lease_id not in self.ended
        ref = CapabilityRef.parse(key[0])
        assert record.capability == ref.name
        assert in_range(ref.specifier, record.version), (key, record.version)
        assert record.agent_id in self.live, record.agent_id
        assert record.agent_id not in key[1]
        assert self.live[record.agent_id][ref.name].version == record.version
        self.leases[lease_id] = (record.agent_id, record.capability, record.deadline)

    def _sync_waiters(self) -> None:
        """Learn which queued callers were granted or dropped, and check FIFO order."""
        still: list[ModelWaiter] = []
        granted: list[tuple[int, ModelWaiter]] = []
        for position, waiter in enumerate(self.waiters):
            status = self.core.ticket_status(waiter.ticket)
            if status.pending:
                still.append(waiter)
            elif status.lease is not None:
                self._grant_seen(status.lease.lease_id, waiter.key, waiter.workflow_holder, waiter.ttl)
                granted.append((position, waiter))
            else:
                assert waiter.expires_at <= self.now, "a waiter was dropped before its wait ran out"
        pending_pos = {w.ticket: i for i, w in enumerate(self.waiters) if w in still}
        for position, waiter in granted:
            older_pending = [
                w.ticket for w in still if w.key == waiter.key and pending_pos[w.ticket] < position
            ]
            assert not older_pending, f"{waiter.ticket} granted before older {older_pending} for {waiter.key}"
        self.waiters = still
        # a ticket maps to a lease only while that lease lives
        assert set(self.core.granted_tickets.values()) <= set(self.leases)
        # workflow holders are told about every revoked or expired lease, and about nothing else
        told = self.core.take_revocations()
        assert {notice.lease_id for _, notice in told} == self.expected_revocations
        assert all(holder == "supervisor/wf" for holder, _ in told)
        self.expected_revocations = set()

    def _revoke_model(self, agent_id: str, names: set[str] | None = None) -> None:
        for lease_id, (agent, cap, _) in list(self.leases.items()):
            if agent == agent_id and (names is None or cap in names):
                del self.leases[lease_id]
                self.ended.append(lease_id)
                if lease_id in self.workflow_held:
                    self.expected_revocations.add(lease_id)

    def _snapshot(self, agent_id: str, state: AgentState, caps: list[CapabilityDigest]) -> AgentSnapshot:
        return AgentSnapshot(
            agent_id=agent_id,
            deployment=self.deployment.get(agent_id, "dep-a"),
            endpoint=f"http://{agent_id}.local:8080",
            state=state,
            capabilities=caps,
        )

    # ----------------------------------------------------------- rules
    @initialize(
        fleet=st.lists(
            st.tuples(st.sampled_from(LETTERS), caps_strategy, st.sampled_from(["dep-a", "dep-b"])), min_size=1, max_size=6
        )
    )
    def start_fleet(self, fleet) -> None:
        for letter, caps, deployment in fleet:
            self.register(letter, caps, deployment, S.READY)

    @rule(
        letter=st.sampled_from(LETTERS),
        caps=caps_strategy,
        deployment=st.sampled_from(["dep-a", "dep-b"]),
        state=st.sampled_from([S.REGISTERING, S.READY]),
    )
    def register(self, letter: str, caps, deployment: str, state: AgentState) -> None:
        agent_id = f"{letter}-agent-{next(self._agent_seq)}"
        digests = [CapabilityDigest(name=n, version=v, max_concurrency=m, cost_class=c) for n, v, m, c in caps]
        self.deployment[agent_id] = deployment
        self.core.agent_snapshot(self._snapshot(agent_id, state, digests), self.now, self.new_id)
        self.live[agent_id] = {d.name: d for d in digests}
        self.offered.update(d.name for d in digests)
        self._sync_waiters()

    @rule(caps=caps_strategy)
    def forged_snapshot(self, caps) -> None:
        """A well-formed snapshot from nobody: never indexed, never routable."""
        agent_id = f"ghost-{next(self._agent_seq)}"
        self.forged.add(agent_id)
        digests = [CapabilityDigest(name=n, version=v, max_concurrency=m, cost_class=c) for n, v, m, c in caps]
        self.core.agent_snapshot(self._snapshot(agent_id, S.READY, digests), self.now, self.new_id)
        assert agent_id not in self.core.index
        self.removed.add(agent_id)
        self._sync_waiters()

    @precondition(lambda self: self.live)
    @rule(
        i=st.integers(0, 1000),
        keep=st.lists(st.booleans(), min_size=3, max_size=3),
        new_version=st.sampled_from([None, *VERSIONS]),
        new_cost=st.sampled_from([None, "A", "B", "C"]),
        extra=st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(VERSIONS), st.integers(1, 3)), max_size=1),
    )
    def reregister(self, i: int, keep, new_version, new_cost, extra) -> None:
        """The same agent registers again: it may drop, add or re-version capabilities (same max_concurrency)."""
        agent_id = sorted(self.live)[i % len(self.live)]
        old = self.live[agent_id]
        caps: dict[str, CapabilityDigest] = {}
        for flag, (name, digest) in zip(keep, sorted(old.items()), strict=False):
            if flag:
                caps[name] = CapabilityDigest(
                    name=name,
                    version=new_version or digest.version,
                    max_concurrency=digest.max_concurrency,
                    cost_class=new_cost or digest.cost_class,
                )
        for name, version, m in extra:
            if name not in caps and name not in old:
                caps[name] = CapabilityDigest(name=name, version=version, max_concurrency=m, cost_class="B")
        if not caps:
            name, digest = sorted(old.items())[0]
            caps[name] = digest
        self.core.agent_snapshot(self._snapshot(agent_id, S.REGISTERING, list(caps.values())), self.now, self.new_id)
        self.offered.update(caps)
        self._revoke_model(agent_id, set(old) - set(caps))
        self.live[agent_id] = caps
        self._sync_waiters()

    @rule(
        name=st.sampled_from([*NAMES, *NAMES, UNSERVED]),
        spec=st.sampled_from(SPECS),
        wait_s=st.sampled_from([0.0, 0.0, 2.0, 10.0]),
        ttl=st.sampled_from([5.0, 30.0, 300.0]),
        exclude_one=st.one_of(st.none(), st.integers(0, 1000)),
        workflow_holder=st.booleans(),
    )
    def acquire(self, name: str, spec: str, wait_s: float, ttl: float, exclude_one, workflow_holder: bool = False) -> None:
        ref = f"{name}@{spec}" if spec else name
        known = sorted(self._known())
        exclude: tuple[str, ...] = ()
        if exclude_one is not None and known:
            exclude = (known[exclude_one % len(known)],)
        key = (norm(ref), exclude)
        request = AcquireRequest(
            ref=ref,
            wait_s=wait_s,
            lease_ttl_s=ttl,
            exclude_agents=list(exclude),
            holder="supervisor/wf" if workflow_holder else "plain-caller",
            holder_is_workflow=workflow_holder,
            request_id=f"request-secret-{next(self._requests):08d}",
        )
        reply = self.core.acquire(request, self.now, self.new_id)
        if reply.lease is not None:
            assert reply.ticket is None
            assert reply.lease.deadline.timestamp() == pytest.approx(self.now + ttl)
            self._grant_seen(reply.lease.lease_id, key, workflow_holder, ttl)
            self._sync_waiters()
            # whether granted at once or through the queue, no older caller for the same ref is still waiting
            assert not [w for w in self.waiters if w.key == key]
        elif reply.ticket is not None:
            assert wait_s > 0
            self._sync_waiters()
            self.waiters.append(ModelWaiter(reply.ticket, key, self.now + wait_s + WAITER_GRACE_S, workflow_holder, ttl))
            assert self.core.ticket_status(reply.ticket).pending
        else:
            # Refused at once: nobody ever offered the name (waiting cannot help), or the caller would not wait.
            assert reply.unknown_capability == (name not in self.offered)
            assert reply.unknown_capability or wait_s == 0
            assert reply.report is not None and reply.report.ref == norm(ref)
            self._sync_waiters()

    @rule(
        name=st.sampled_from(NAMES),
        spec=st.sampled_from(["", "", ">=2", "<2"]),
        wait_s=st.sampled_from([0.0, 10.0, 60.0]),
        n=st.integers(1, 4),
    )
    def acquire_burst(self, name: str, spec: str, wait_s: float, n: int) -> None:
        """Several callers for the same ref in a row: the queue and FIFO order get exercised."""
        for _ in range(n):
            self.acquire(name, spec, wait_s, 300.0, None, workflow_holder=True)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        lease_id = sorted(self.leases)[i % len(self.leases)]
        assert self.core.release(lease_id, self.now, self.new_id) is True
        del self.leases[lease_id]
        self.ended.append(lease_id)
        self._sync_waiters()

    @rule(i=st.integers(0, 1000), unknown=st.booleans())
    def release_unknown_or_twice(self, i: int, unknown: bool) -> None:
        lease_id = "never-granted" if unknown or not self.ended else self.ended[i % len(self.ended)]
        before = {r.lease_id for r in self.core.leases.all()}
        assert self.core.release(lease_id, self.now, self.new_id) is False
        assert {r.lease_id for r in self.core.leases.all()} == before
        self._sync_waiters()

    @precondition(lambda self: self.waiters)
    @rule(i=st.integers(0, 1000))
    def cancel(self, i: int) -> None:
        waiter = self.waiters[i % len(self.waiters)]
        status = self.core.cancel_ticket(waiter.ticket, self.now)
        assert not status.pending and status.lease is None and status.report is not None
        # A retried cancel (the client's retry is a new update when the first answer was lost)
        # still gets the pool's figures.
        again = self.core.cancel_ticket(waiter.ticket, self.now)
        assert not again.pending and again.lease is None and again.report == status.report
        self.waiters.remove(waiter)
        self._sync_waiters()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000), with_caps=st.booleans())
    def drain(self, i: int, with_caps: bool) -> None:
        agent_id = sorted(self.live)[i % len(self.live)]
        caps = list(self.live[agent_id].values()) if with_caps else []
        self.core.agent_snapshot(self._snapshot(agent_id, S.DRAINING, caps), self.now, self.new_id)
        self.draining[agent_id] = self.live.pop(agent_id)
        self._sync_waiters()

    @rule(i=st.integers(0, 1000), by_snapshot=st.booleans(), which=st.sampled_from(["live", "draining", "gone"]))
    def terminate(self, i: int, by_snapshot: bool, which: str) -> None:
        pool = {"live": sorted(self.live), "draining": sorted(self.draining), "gone": sorted(self.removed)}[which]
        agent_id = pool[i % len(pool)] if pool else "nobody-0"
        if by_snapshot:
            self.core.agent_snapshot(self._snapshot(agent_id, S.TERMINATED, []), self.now, self.new_id)
        else:
            revoked = self.core.agent_gone(agent_id, "heartbeat_lost", self.now, self.new_id)
            assert {r.lease_id for r in revoked} == {lid for lid, (a, _, _) in self.leases.items() if a == agent_id}
        self._revoke_model(agent_id)
        self.live.pop(agent_id, None)
        self.draining.pop(agent_id, None)
        self.removed.add(agent_id)
        self._sync_waiters()

    @rule(dt=st.sampled_from([0.0, 1.0, 3.0, 7.0, 31.0, 400.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        expired = self.core.tick(self.now, self.new_id)
        expected = {lid for lid, (_, _, deadline) in self.leases.items() if deadline <= self.now}
        assert {r.lease_id for r in expired} == expected
        for lease_id in expected:
            del self.leases[lease_id]
            self.ended.append(lease_id)
            if lease_id in self.workflow_held:
                self.expected_revocations.add(lease_id)
        self._sync_waiters()
        assert all(w.expires_at > self.now for w in self.waiters)

    @precondition(lambda self: self.leases or self.waiters)
    @rule(just_before=st.booleans())
    def tick_to_next_deadline(self, just_before: bool) -> None:
        """Jump to the next moment the pool must act (a lease deadline, a waiter's end), or a hair before it."""
        wakeup = self.core.next_wakeup()
        assert wakeup is not None
        moments = [d for _, _, d in self.leases.values()] + [w.expires_at for w in self.waiters]
        scale_due = self.core.scaler.next_due()
        # Idle agents are checked on rounds of their own, policy or none (the rounds are not taken here).
        health_round = [self.core._next_health_round] if len(self.core.index) else []
        assert wakeup == min([*moments, *([scale_due] if scale_due is not None else []), *health_round])
        target = min(moments)
        self.tick(max(0.0, target - self.now - (0.001 if just_before else 0.0)))

    @rule()
    def scale(self) -> None:
        """Take the coalesced scale requests: at most one per deployment, one above its live count."""
        registered: dict[str, int] = {}
        for agent_id in self.live:
            registered[self.deployment[agent_id]] = registered.get(self.deployment[agent_id], 0) + 1
        requests = self.core.take_scale_requests(self.now)
        assert len({r.deployment for r in requests}) == len(requests)
        for request in requests:
            assert request.replicas == registered.get(request.deployment, 0) + 1
        self._sync_waiters()

    @rule()
    def continue_as_new(self) -> None:
        state = self.core.to_state()
        # The way a real run carries it: packed, inside PoolInput, through the worker's data converter.
        carried = PoolInput(pool="prop", state=encode_state(state))
        payloads = asyncio.run(pydantic_data_converter.encode([carried]))
        (received,) = asyncio.run(pydantic_data_converter.decode(payloads, [PoolInput]))
        assert received.state is not None
        restored = PoolCore.from_state(decode_state(received.state))
        assert PoolCore.from_state(PoolCoreState.model_validate_json(state.model_dump_json())).to_state() == state
        for ref in ALL_REFS:
            assert restored.find(ref) == self.core.find(ref), ref
        fields = lambda r: (r.lease_id, r.agent_id, r.capability, r.version, r.deadline, r.ticket, r.holder)  # noqa: E731
        assert sorted(map(fields, restored.leases.all())) == sorted(map(fields, self.core.leases.all()))
        assert list(restored.waiters.items()) == list(self.core.waiters.items())
        assert restored.granted_tickets == self.core.granted_tickets
        assert restored.to_state().model_dump() == state.model_dump()
        self.core = self._wrap(restored)

    # ----------------------------------------------------------- invariants
    @invariant()
    def load_matches_leases(self) -> None:
        known = self._known()
        index_agents = {a.agent_id: a for a in self.core.index.agents()}
        assert set(index_agents) == set(known)
        per_slot: dict[tuple[str, str], int] = {}
        for agent_id, name, _ in self.leases.values():
            per_slot[(agent_id, name)] = per_slot.get((agent_id, name), 0) + 1
        for agent_id, caps in known.items():
            agent = index_agents[agent_id]
            assert agent.state == (S.DRAINING if agent_id in self.draining else S.READY)
            assert agent.capabilities == caps
            assert set(agent.in_flight) <= set(caps) and all(v > 0 for v in agent.in_flight.values())
            for name, cap in caps.items():
                in_flight = agent.in_flight.get(name, 0)
                assert in_flight == per_slot.get((agent_id, name), 0)
                assert in_flight <= cap.max_concurrency
        book = {r.lease_id: (r.agent_id, r.capability, r.deadline) for r in self.core.leases.all()}
        assert book == self.leases
        assert len(self.core.leases) == len(self.leases)

    @invariant()
    def waiters_match(self) -> None:
        assert list(self.core.waiters) == [w.ticket for w in self.waiters]

    @invariant()
    def no_stranded_waiter(self) -> None:
        """A caller still queued after any step has no agent it could be given right now."""
        for waiter in self.waiters:
            ref = CapabilityRef.parse(waiter.key[0])
            assert brute_ranked_index(self.core.index, ref, frozenset(waiter.key[1])) == [], waiter

    @invariant()
    def no_ghosts(self) -> None:
        index = self.core.index
        gone = self.removed - set(self._known())
        unroutable = gone | set(self.draining)
        members = {a for versions in index._members.values() for holders in versions.values() for a in holders}
        listed = {a for (a, _name) in index._listed}
        free = {key[2] for versions in index._free.values() for lst in versions.values() for key in lst}
        assert not (members & gone)
        assert not (listed & unroutable) and not (free & unroutable)
        assert listed == free
        counted: dict[S, int] = {}
        for agent in index.agents():
            counted[agent.state] = counted.get(agent.state, 0) + 1
        assert index.state_counts() == counted
        assert not (set(self.core.leases._by_agent) & gone)
        assert not ({r.agent_id for r in self.core.leases.all()} & gone)
        assert not (set(self.core._sent_load) & gone) and not (set(self.core._notices) & gone)
        for agent_id in gone:
            assert agent_id not in index and index.get(agent_id) is None
            assert self.core.lease_ids_of(agent_id) == []

    @invariant()
    def find_is_brute_force_ranking(self) -> None:
        """find() over the model (not the index): routable, in range, free slot; by (cost, total in-flight, id)."""
        total: dict[str, int] = {}
        per_slot: dict[tuple[str, str], int] = {}
        for agent_id, name, _ in self.leases.values():
            total[agent_id] = total.get(agent_id, 0) + 1
            per_slot[(agent_id, name)] = per_slot.get((agent_id, name), 0) + 1
        for ref_text in ALL_REFS:
            ref = CapabilityRef.parse(ref_text)
            rows = []
            for agent_id, caps in self.live.items():
                cap = caps.get(ref.name)
                agent_cap = max(c.max_concurrency for c in caps.values())
                if (
                    cap
                    and in_range(ref.specifier, cap.version)
                    and per_slot.get((agent_id, ref.name), 0) < cap.max_concurrency
                    and total.get(agent_id, 0) < agent_cap
                ):
                    rows.append((COST_RANK[cap.cost_class], total.get(agent_id, 0), agent_id))
            expected = [r[2] for r in sorted(rows)]
            assert self.core.find(ref_text) == expected, ref_text


TestPoolCoreProperties = PoolMachine.TestCase
TestPoolCoreProperties.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# ====================================================================== LeaseBook


def record(lease_id: str, agent: str = "a1", deadline: float = 100.0, capability: str = "rag.search") -> LeaseRecord:
    return LeaseRecord(
        lease_id=lease_id,
        agent_id=agent,
        deployment="dep",
        capability=capability,
        version="2.1.0",
        endpoint="http://a",
        granted_at=0.0,
        deadline=deadline,
    )


def test_lease_release_is_idempotent() -> None:
    book = LeaseBook()
    book.grant(record("L1"))
    assert "L1" in book and len(book) == 1
    released = book.release("L1")
    assert released is not None and released.lease_id == "L1"
    assert book.release("L1") is None
    assert book.release("never") is None
    assert len(book) == 0 and book.of_agent("a1") == [] and book._by_agent == {}


def test_lease_grant_twice_refused() -> None:
    book = LeaseBook()
    book.grant(record("L1"))
    with pytest.raises(ValueError, match="already exists"):
        book.grant(record("L1", deadline=5))
    assert book.get("L1").deadline == 100.0


def test_lease_expiry_at_deadline() -> None:
    book = LeaseBook()
    book.grant(record("L1", deadline=10))
    book.grant(record("L2", deadline=20))
    book.grant(record("L3", deadline=20, agent="a2"))
    book.grant(record("L4", deadline=5))
    book.release("L4")
    assert book.next_deadline() == 10  # the released lease's deadline is skipped
    assert book.expire(9.999) == []
    assert [r.lease_id for r in book.expire(10)] == ["L1"]
    assert book.next_deadline() == 20
    assert sorted(r.lease_id for r in book.expire(25)) == ["L2", "L3"]
    assert len(book) == 0 and book.next_deadline() is None
    assert book.expire(1000) == []


def test_lease_regranted_id_keeps_its_new_deadline() -> None:
    book = LeaseBook()
    book.grant(record("L1", deadline=10))
    book.release("L1")
    book.grant(record("L1", deadline=50))
    assert book.expire(20) == []
    assert book.next_deadline() == 50
    assert [r.lease_id for r in book.expire(50)] == ["L1"]


def test_lease_revoke_agent() -> None:
    book = LeaseBook()
    for lease_id, agent in [("L3", "a1"), ("L1", "a1"), ("L2", "a2"), ("L4", "a1")]:
        book.grant(record(lease_id, agent=agent))
    revoked = book.revoke_agent("a1")
    assert [r.lease_id for r in revoked] == ["L1", "L3", "L4"]
    assert [r.lease_id for r in book.all()] == ["L2"]
    assert book.of_agent("a1") == [] and "a1" not in book._by_agent
    assert book.revoke_agent("a1") == []
    assert book.revoke_agent("nobody") == []
    # revoked leases do not come back through expiry
    assert [r.lease_id for r in book.expire(1000)] == ["L2"]


# ====================================================================== DriftDetector


def test_drift_warns_only_when_the_version_set_changes_with_several_versions() -> None:
    drift = DriftDetector()
    assert drift.observe("rag.search", frozenset({"2.1.0"})) is None
    warning = drift.observe("rag.search", frozenset({"2.1.0", "2.2.0"}))
    assert warning is not None and "rag.search" in warning and "2.1.0" in warning and "2.2.0" in warning
    assert "2 versions" in warning
    # the same set again: already reported
    assert drift.observe("rag.search", frozenset({"2.2.0", "2.1.0"})) is None
    # a third version joins: the set changed and still has several
    assert drift.observe("rag.search", frozenset({"2.1.0", "2.2.0", "3.0.0"})) is not None
    assert drift.observe("rag.search", frozenset({"2.2.0", "3.0.0"})) is not None
    # rollout done: one version is not drift
    assert drift.observe("rag.search", frozenset({"3.0.0"})) is None
    assert drift.observe("rag.search", frozenset({"3.0.0"})) is None
    # other names are independent
    assert drift.observe("code.exec", frozenset({"1.0.0"})) is None
    assert drift.state() == {"code.exec": ["1.0.0"], "rag.search": ["3.0.0"]}
    # nobody serves it any more: forgotten, no warning
    assert drift.observe("code.exec", frozenset()) is None
    assert "code.exec" not in drift.state()


def test_drift_state_round_trip() -> None:
    drift = DriftDetector()
    drift.observe("rag.search", frozenset({"2.1.0", "2.2.0"}))
    restored = DriftDetector.from_state(drift.state())
    assert restored.state() == drift.state()
    assert restored.observe("rag.search", frozenset({"2.1.0", "2.2.0"})) is None
    assert restored.observe("rag.search", frozenset({"2.1.0", "2.3.0"})) is not None


# ====================================================================== ScaleCoalescer


def test_many_misses_in_one_window_make_one_request() -> None:
    scaler = ScaleCoalescer(window_s=5.0)
    for i in range(50):
        scaler.record_miss("search-agent", 100.0 + i * 0.09)
    assert scaler.next_due() == 105.0
    assert scaler.due(104.99, {"search-agent": 2}) == []
    requests = scaler.due(105.0, {"search-agent": 2})
    assert [(r.deployment, r.replicas) for r in requests] == [("search-agent", 3)]
    assert "50 miss(es)" in requests[0].reason
    assert scaler.due(200.0, {"search-agent": 2}) == []
    assert scaler.next_due() is None


def test_pending_replicas_suppress_requests_until_they_register() -> None:
    scaler = ScaleCoalescer(window_s=5.0, pending_ttl_s=120.0)
    scaler.record_miss("search-agent", 0.0)
    assert len(scaler.due(5.0, {"search-agent": 1})) == 1
    assert scaler.pending("search-agent", 5.0) == 1
    # the pod is booting: more misses, more windows, no more requests
    for window in range(1, 5):
        start = 5.0 + window * 10
        for j in range(10):
            scaler.record_miss("search-agent", start + j * 0.1)
        assert scaler.due(start + 5.0, {"search-agent": 1}) == []
    scaler.registered("search-agent")
    assert scaler.pending("search-agent", 60.0) == 0
    scaler.record_miss("search-agent", 60.0)
    requests = scaler.due(65.0, {"search-agent": 2})
    assert [(r.deployment, r.replicas) for r in requests] == [("search-agent", 3)]


def test_pending_replica_expires_after_ttl() -> None:
    scaler = ScaleCoalescer(window_s=5.0, pending_ttl_s=60.0)
    scaler.record_miss("d", 0.0)
    assert len(scaler.due(5.0, {"d": 1})) == 1
    scaler.record_miss("d", 55.0)
    assert scaler.due(60.0, {"d": 1}) == []  # 55 s after the request: still pending
    assert scaler.pending("d", 64.99) == 1
    assert scaler.pending("d", 65.0) == 0  # the replica never came: no longer pending
    scaler.record_miss("d", 70.0)
    requests = scaler.due(75.0, {"d": 1})
    assert [(r.deployment, r.replicas) for r in requests] == [("d", 2)]


def test_max_replicas_respected() -> None:
    scaler = ScaleCoalescer(window_s=5.0, max_replicas={"gpu-agent": 3})
    scaler.record_miss("gpu-agent", 0.0)
    assert scaler.due(5.0, {"gpu-agent": 3}) == []
    assert scaler.pending("gpu-agent", 5.0) == 0
    scaler.record_miss("gpu-agent", 10.0)
    requests = scaler.due(15.0, {"gpu-agent": 2})
    assert [(r.deployment, r.replicas) for r in requests] == [("gpu-agent", 3)]
    # no cap on other deployments
    scaler.record_miss("cpu-agent", 20.0)
    assert [(r.deployment, r.replicas) for r in scaler.due(25.0, {"cpu-agent": 40})] == [("cpu-agent", 41)]


def test_deployments_have_independent_windows_and_state_round_trips() -> None:
    scaler = ScaleCoalescer(window_s=5.0)
    scaler.record_miss("a", 0.0)
    scaler.record_miss("b", 3.0)
    assert [r.deployment for r in scaler.due(5.0, {})] == ["a"]
    restored = ScaleCoalescer(window_s=5.0)
    restored.load_state(scaler.state())
    assert restored.state() == scaler.state()
    assert restored.pending("a", 6.0) == 1
    assert [(r.deployment, r.replicas) for r in restored.due(8.0, {})] == [("b", 1)]


def test_a_waiter_dropped_in_one_run_gets_its_figures_when_it_cancels_in_the_next() -> None:
    """The pool gives up on a waiter at its deadline, then continues as new before the caller's
    cancel arrives: the cancel still gets the pool's figures (a PoolExhaustedError names them),
    not an empty report (seen once in CI: test_saturation[short-timeouts], 2026-12-05)."""
    from agentroster.messages import AcquireRequest
    from tests.conftest import one_agent_core

    core, new_id = one_agent_core("carry")
    assert core.acquire(AcquireRequest(ref="math.eval", request_id="h" * 32, wait_s=0), 1.0, new_id).lease is not None
    ticket = core.acquire(AcquireRequest(ref="math.eval", request_id="w" * 32, wait_s=1), 1.0, new_id).ticket
    assert ticket is not None
    core.tick(10.0, new_id)  # past its wait: dropped, its figures kept
    assert core.status().waiting == 0
    next_run = PoolCore.from_state(PoolCoreState.model_validate_json(core.to_state().model_dump_json()))
    status = next_run.cancel_ticket(ticket, 11.0)
    assert status.report is not None and (status.report.matching, status.report.busy, status.report.slots) == (1, 1, 1)
    assert next_run.ticket_status(ticket).report == status.report
