"""Snapshots as hints in the pool's core (`verify_known_agents`, the `snapshot-as-hint` patch).

`HintMachine` drives `PoolCore` with genuine agents (each with its workflow's own
truth: capabilities, cap, endpoint, state), genuine changes (registration,
re-registration with more slots or another capability, drain, termination, resync),
forged snapshots for known and unknown agents (out-of-range capacity, another
endpoint, Terminated, Draining, Spawning, no capabilities), acquires and releases,
and the reads the core asks for, answered late and in any order with what the
agent workflow reports *when the read runs* (sometimes not at all: a failed read),
and continue-as-new round trips (a read in flight when a run continues as new still
reports to the next runs, with what it found before, as a late reading: `agent_read_late`;
the next run asks again). After every step:

* no indexed agent ever holds a value only a forged snapshot carried;
* in-flight per agent and capability <= what the agent workflow itself allows;
* a lease ends only by release, or because the agent's workflow ended it
  (termination, a capability withdrawn): never because of a forged word;
* once every read is answered, the index is exactly the agents' truth.

Plain unit tests follow: the resync path costs no read; refusals name what differed.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import AgentState
from agentroster.core.pool import PoolCore, PoolCoreState

S = AgentState
ATTACKER = "http://attacker.invalid:1"
NAMES = ["rag.search", "code.exec"]
RESYNC_S = 60.0


def _caps(spec: dict[str, int]) -> list[CapabilityDigest]:
    return [CapabilityDigest(name=n, version="2.1.0", max_concurrency=m, cost_class="B") for n, m in sorted(spec.items())]


class Truth:
    """What one agent's workflow reports about itself (its `snapshot` query)."""

    def __init__(self, agent_id: str, caps: dict[str, int]) -> None:
        self.agent_id = agent_id
        self.caps = dict(caps)
        self.state = S.READY
        self.ended_reason = ""

    def snapshot(self, state: AgentState | None = None, reason: str = "") -> AgentSnapshot:
        return AgentSnapshot(
            agent_id=self.agent_id,
            deployment="dep",
            endpoint=f"http://{self.agent_id}.local:8080",
            state=state or self.state,
            capabilities=_caps(self.caps),
            reason=reason or self.ended_reason,
            resync_interval_s=RESYNC_S,
        )


class HintMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1_700_000_000.0
        self._ids = itertools.count()
        self._seq = itertools.count()
        self.core = self._new_core(PoolCore("hints"))
        self.truth: dict[str, Truth] = {}  # every agent that ever registered
        self.pending: list[str] = []  # reads the core asked for, not answered yet
        # Reads an earlier run asked for that still report to this one: (agent, what it found,
        # at the latest when that run continued as new; None: it found no agent workflow).
        self.late: list[tuple[str, AgentSnapshot | None]] = []
        self.stale: set[str] = set()  # a read failed: the pool may lag until the agent's next resync
        self.leases: dict[str, tuple[str, str]] = {}  # lease id -> (agent, capability)
        self.requests = itertools.count()

    @staticmethod
    def _new_core(core: PoolCore) -> PoolCore:
        core.verify_known_agents = True
        return core

    def new_id(self) -> str:
        return f"id-{next(self._ids):05d}"

    def _collect(self) -> None:
        self.pending.extend(self.core.take_verifications())

    def _hint(self, snap: AgentSnapshot) -> None:
        self.core.agent_snapshot(snap, self.now, self.new_id)
        self._collect()

    def _live(self) -> list[str]:
        return sorted(a for a, t in self.truth.items() if t.state != S.TERMINATED)

    # ----------------------------------------------------------- genuine
    @initialize(caps=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 3), min_size=1))
    def first_agent(self, caps: dict[str, int]) -> None:
        self.register(caps)

    @rule(caps=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 3), min_size=1))
    def register(self, caps: dict[str, int]) -> None:
        truth = Truth(f"agent-{next(self._seq)}", caps)
        self.truth[truth.agent_id] = truth
        self._hint(truth.snapshot(S.REGISTERING, "registered"))

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 99), more=st.integers(0, 2), add=st.booleans())
    def reregister(self, i: int, more: int, add: bool) -> None:
        """The agent registers again through the real path: more slots, maybe another capability (never fewer slots)."""
        truth = self.truth[self._live()[i % len(self._live())]]
        if truth.state == S.DRAINING:
            return
        truth.caps = {n: min(m + more, 9) for n, m in truth.caps.items()}
        missing = [n for n in NAMES if n not in truth.caps]
        if add and missing:
            truth.caps[missing[0]] = 1
        truth.state = S.READY
        self._hint(truth.snapshot(S.REGISTERING, "registered"))

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 99))
    def drain(self, i: int) -> None:
        truth = self.truth[self._live()[i % len(self._live())]]
        truth.state = S.DRAINING
        self._hint(truth.snapshot(reason="drain"))

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 99), reason=st.sampled_from(["drain", "heartbeat_lost"]))
    def terminate(self, i: int, reason: str) -> None:
        truth = self.truth[self._live()[i % len(self._live())]]
        truth.state, truth.ended_reason = S.TERMINATED, reason
        self._hint(truth.snapshot())

    @precondition(lambda self: self._live())
    @rule(i=st.integers(0, 99))
    def resync(self, i: int) -> None:
        """The agent workflow re-sends its snapshot (Ready/Busy only, as it does)."""
        truth = self.truth[self._live()[i % len(self._live())]]
        if truth.state == S.READY:
            self._hint(truth.snapshot(reason="resync"))
            self.stale.discard(truth.agent_id)

    # ----------------------------------------------------------- forged
    @precondition(lambda self: self.truth)
    @rule(
        i=st.integers(0, 99),
        change=st.sampled_from(["capacity", "endpoint", "terminated", "draining", "spawning", "empty", "ready", "resync"]),
    )
    def forge(self, i: int, change: str) -> None:
        """Anyone signals the pool a snapshot built from the agent's queries, changed."""
        truth = self.truth[sorted(self.truth)[i % len(self.truth)]]
        snap = truth.snapshot(S.READY if truth.state == S.TERMINATED else truth.state)
        data = snap.model_dump(mode="json")
        if change == "capacity":
            data["max_concurrency"] = 50
            data["capabilities"] = [{**c, "max_concurrency": 50} for c in data["capabilities"]]
        elif change == "endpoint":
            data["endpoint"] = ATTACKER
        elif change == "terminated":
            data["state"], data["reason"] = "Terminated", "forged"
        elif change == "draining":
            data["state"] = "Draining"
        elif change == "spawning":
            data["state"] = "Spawning"
        elif change == "empty":
            data["capabilities"] = []
        elif change == "ready":
            data["state"] = "Ready"  # a drained or ended agent made to look routable
        else:
            data["resync_interval_s"] = 1.0  # would get it dropped as silent within 3 s
        self._hint(AgentSnapshot.model_validate(data))

    @rule(caps=st.dictionaries(st.sampled_from(NAMES), st.just(50), min_size=1))
    def forge_ghost(self, caps: dict[str, int]) -> None:
        """A snapshot for an agent no workflow speaks for."""
        ghost = Truth(f"ghost-{next(self._seq)}", caps)
        snap = ghost.snapshot()
        self._hint(AgentSnapshot.model_validate({**snap.model_dump(mode="json"), "endpoint": ATTACKER}))

    # ----------------------------------------------------------- reads
    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 99), fail=st.sampled_from([False] * 5 + [True]), ended_as_none=st.booleans())
    def answer_read(self, i: int, fail: bool, ended_as_none: bool) -> None:
        """The read_agent activity runs now: what the agent workflow reports at this moment."""
        agent_id = self.pending.pop(i % len(self.pending))
        if fail:
            self.core.agent_read_failed(agent_id, "retries ran out")
            self.stale.add(agent_id)
        else:
            self._report(agent_id, self._found(agent_id, ended_as_none))
        self._collect()

    def _found(self, agent_id: str, ended_as_none: bool) -> AgentSnapshot | None:
        """What a read of the agent workflow finds now (None: no agent workflow)."""
        truth = self.truth.get(agent_id)
        if truth is None or (truth.state == S.TERMINATED and ended_as_none):
            return None
        return truth.snapshot()

    def _report(self, agent_id: str, found: AgentSnapshot | None) -> None:
        if found is None:
            self.core.agent_read(agent_id, None, "no agent workflow", self.now, self.new_id)
        else:
            self.core.agent_read(agent_id, found, "", self.now, self.new_id)

    @precondition(lambda self: self.late)
    @rule(i=st.integers(0, 99))
    def answer_late_read(self, i: int) -> None:
        """A read the run before asked for reports to this run, with what it found then."""
        agent_id, found = self.late.pop(i % len(self.late))
        self.core.agent_read_late(agent_id, found, self.now, self.new_id)
        self._collect()

    # ----------------------------------------------------------- leases
    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        if not self.core.ever_offered(name):
            return
        reply = self.core.acquire(
            AcquireRequest(ref=name, wait_s=0, lease_ttl_s=3600, request_id=f"secret-{next(self.requests):012d}"),
            self.now,
            self.new_id,
        )
        if reply.lease is not None:
            agent_id = reply.lease.agent_id
            assert reply.lease.endpoint != ATTACKER
            truth = self.truth[agent_id]
            if agent_id not in self.pending and agent_id not in self.stale:  # else the pool has not read it yet
                assert truth.state == S.READY, f"granted on {agent_id}, which its workflow reports {truth.state}"
            self.leases[reply.lease.lease_id] = (agent_id, name)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 999))
    def release(self, i: int) -> None:
        lease_id = sorted(self.leases)[i % len(self.leases)]
        del self.leases[lease_id]
        self.core.release(lease_id, self.now, self.new_id)

    @rule(dt=st.sampled_from([0.1, 1.0, 3.0]))  # 40 steps stay inside 3 resync intervals
    def tick(self, dt: float) -> None:
        self.now += dt
        self.core.tick(self.now, self.new_id)
        self._collect()

    @rule()
    def continue_as_new(self) -> None:
        """The run continues as new: reads in flight are asked again by the new run, and may
        still report to it with what they found (at the latest) as the run before ended."""
        self.late += [(agent_id, self._found(agent_id, ended_as_none=False)) for agent_id in self.pending]
        state = PoolCoreState.model_validate(json.loads(self.core.to_state().model_dump_json()))
        self.core = self._new_core(PoolCore.from_state(state))
        self.pending = self.core.take_verifications()

    # ----------------------------------------------------------- invariants
    @invariant()
    def nothing_forged_is_indexed(self) -> None:
        for agent in self.core.index.agents():
            assert agent.agent_id in self.truth, f"{agent.agent_id}: no agent workflow ever spoke for it"
            assert agent.endpoint != ATTACKER
            assert agent.max_concurrency <= 9 and all(c.max_concurrency <= 9 for c in agent.capabilities.values())
            assert agent.capabilities, agent.agent_id

    @invariant()
    def load_within_what_the_workflow_allows(self) -> None:
        for agent in self.core.index.agents():
            truth = self.truth[agent.agent_id]
            assert agent.total_in_flight <= max(truth.caps.values()), (agent.agent_id, agent.in_flight, truth.caps)
            for name, count in agent.in_flight.items():
                assert count <= truth.caps.get(name, 0), (agent.agent_id, name, count, truth.caps)

    @invariant()
    def leases_end_only_for_a_genuine_reason(self) -> None:
        for lease_id, (agent_id, name) in list(self.leases.items()):
            if self.core.leases.get(lease_id) is not None:
                continue
            truth = self.truth[agent_id]
            assert truth.state == S.TERMINATED or name not in truth.caps, (
                f"lease {lease_id} on {agent_id} ({name}) ended, yet its workflow reports {truth.state.value} with {truth.caps}"
            )
            del self.leases[lease_id]

    @invariant()
    def index_is_the_truth_once_every_read_is_answered(self) -> None:
        if self.pending or self.late:
            return
        for agent_id, truth in self.truth.items():
            if agent_id in self.stale:
                continue
            agent = self.core.index.get(agent_id)
            if truth.state == S.TERMINATED:
                assert agent is None, f"{agent_id} ended, still indexed"
                continue
            assert agent is not None, f"{agent_id} is {truth.state.value}, not indexed"
            assert agent.endpoint == truth.snapshot().endpoint
            assert {n: c.max_concurrency for n, c in agent.capabilities.items()} == truth.caps
            assert (agent.state == S.DRAINING) == (truth.state == S.DRAINING), (agent_id, agent.state, truth.state)


TestSnapshotHints = HintMachine.TestCase
TestSnapshotHints.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------- unit tests
def _core_with(truth: Truth) -> PoolCore:
    core = HintMachine._new_core(PoolCore("unit"))
    ids = itertools.count()
    core.agent_snapshot(truth.snapshot(S.REGISTERING, "registered"), 0.0, lambda: f"id-{next(ids)}")
    (agent_id,) = core.take_verifications()
    core.agent_read(agent_id, truth.snapshot(), "", 0.0, lambda: f"id-{next(ids)}")
    assert core.is_indexed(agent_id)
    return core


def test_a_resync_that_confirms_costs_no_read() -> None:
    truth = Truth("a", {"rag.search": 2})
    core = _core_with(truth)
    for state in (S.READY, S.BUSY, S.REGISTERING):  # Ready and Busy route alike; a re-registration of the same
        core.agent_snapshot(truth.snapshot(state, "resync"), 10.0, lambda: "x")
        assert core.take_verifications() == []
    assert core._last_seen["a"][0] == 10.0  # still heard from: not dropped as silent
    assert core.take_refusals() == []


def test_a_change_is_read_and_the_workflow_word_applied() -> None:
    truth = Truth("a", {"rag.search": 2})
    core = _core_with(truth)
    forged = AgentSnapshot.model_validate(
        {**truth.snapshot().model_dump(mode="json"), "max_concurrency": 50, "endpoint": ATTACKER, "state": "Terminated"}
    )
    core.agent_snapshot(forged, 1.0, lambda: "x")
    assert core.take_verifications() == ["a"]
    assert core.index.get("a").max_concurrency == 2  # nothing applied before the read
    assert core.find("rag.search") == []  # it said it stops serving: held until the read
    core.agent_read("a", truth.snapshot(), "", 2.0, lambda: "y")
    agent = core.index.get("a")
    assert (agent.max_concurrency, agent.endpoint, agent.state) == (2, "http://a.local:8080", S.READY)
    assert core.find("rag.search") == ["a"]  # routed again: the forged word cost one read's time
    (refusal,) = core.take_refusals()
    assert "state Ready, not Terminated" in refusal and "max_concurrency 2, not 50" in refusal and ATTACKER in refusal


def test_one_read_in_flight_per_agent_and_a_flood_cannot_loop() -> None:
    truth = Truth("a", {"rag.search": 2})
    core = _core_with(truth)
    forged = AgentSnapshot.model_validate({**truth.snapshot().model_dump(mode="json"), "state": "Draining"})
    for _ in range(100):
        core.agent_snapshot(forged, 1.0, lambda: "x")
    assert core.take_verifications() == ["a"]  # one read for the flood so far
    core.agent_read("a", truth.snapshot(), "", 2.0, lambda: "y")
    assert core.take_verifications() == ["a"]  # hints came after the read was asked: once more
    core.agent_read("a", truth.snapshot(), "", 3.0, lambda: "y")
    assert core.take_verifications() == []  # and no more without new hints
    assert len(core.take_refusals()) == 1


def test_no_workflow_speaks_for_a_known_agent_it_leaves() -> None:
    truth = Truth("a", {"rag.search": 2})
    core = _core_with(truth)
    lease = core.acquire(AcquireRequest(ref="rag.search", request_id="s" * 16), 1.0, lambda: "z").lease
    assert lease is not None
    core.agent_snapshot(truth.snapshot(S.TERMINATED, "drain"), 2.0, lambda: "x")
    assert core.leases.get(lease.lease_id) is not None  # not before the read
    assert core.find("rag.search") == []  # but no new lease on it while it is read
    core.agent_read("a", truth.snapshot(S.TERMINATED, "drain"), "", 3.0, lambda: "y")
    assert not core.is_indexed("a") and core.leases.get(lease.lease_id) is None
    assert core.counters["drained"] == 1 and core.counters["revoked"] == 1
    assert core.take_refusals() == []  # it said what its workflow says


def test_an_ended_agent_read_from_its_result_is_not_taken_for_a_forgery() -> None:
    # `agentroster dev --once` warned "agent code-agent-... not updated as sent: its workflow reports
    # resync_interval_s 720.0, not 1800.0 (forged, ...)" for every drained agent: its last snapshot carried the
    # slow-resync rhythm, the read of its ended run (its result) the old formula. An ended run's reading has none.
    truth = Truth("a", {"rag.search": 2})
    core = _core_with(truth)
    core.agent_snapshot(truth.snapshot(S.TERMINATED, "drain"), 1.0, lambda: "x")
    assert core.take_verifications() == ["a"]
    ended = truth.snapshot(S.TERMINATED, "drain").model_copy(update={"resync_interval_s": None})
    core.agent_read("a", ended, "its agent workflow ended", 2.0, lambda: "y")
    assert core.take_refusals() == [] and not core.is_indexed("a")


def test_a_read_of_the_run_before_answered_late_cannot_hide_the_end_it_predates() -> None:
    """A read in flight when the run continues as new reports to the next run, which reads
    again. The old read ran before the agent's end: it must not use up the end's hint."""
    truth = Truth("a", {"rag.search": 2})
    core = _core_with(truth)
    ids = itertools.count(100)

    def new_id() -> str:
        return f"id-{next(ids)}"

    truth.state = S.DRAINING
    core.agent_snapshot(truth.snapshot(reason="drain"), 1.0, new_id)
    assert core.take_verifications() == ["a"]  # the read runs now, and sees Draining
    stale = truth.snapshot(reason="drain")
    truth.state, truth.ended_reason = S.TERMINATED, "drain"
    core.agent_snapshot(truth.snapshot(), 2.0, new_id)  # the end, while that read is in flight
    assert core.take_verifications() == []
    core = HintMachine._new_core(PoolCore.from_state(PoolCoreState.model_validate(json.loads(core.to_state().model_dump_json()))))
    assert core.take_verifications() == ["a"]  # the new run reads again
    core.agent_read_late("a", stale, 3.0, new_id)  # the old read reports late, to the new run: ignored
    assert core.take_verifications() == [] and core.index.get("a") is not None
    core.agent_read("a", truth.snapshot(), "its agent workflow ended", 4.0, new_id)
    assert not core.is_indexed("a")
    assert core.index.get("a") is None


def test_a_late_reading_with_no_read_out_is_a_hint() -> None:
    """A previous run's read reporting after this run settled the agent: what changes nothing
    is applied without a read; what would change routing is read again, never applied as is."""
    truth = Truth("a", {"rag.search": 2})
    core = _core_with(truth)
    ids = itertools.count(100)

    def new_id() -> str:
        return f"id-{next(ids)}"

    core.agent_read_late("a", truth.snapshot(), 1.0, new_id)
    assert core.take_verifications() == []
    old = Truth("a", {"rag.search": 1}).snapshot()
    core.agent_read_late("a", old, 2.0, new_id)
    assert core.take_verifications() == ["a"]
    assert core.index.get("a").capabilities["rag.search"].max_concurrency == 2  # not applied as is
    core.agent_read_late("a", old, 2.5, new_id)  # another while that read is out: ignored
    assert core.take_verifications() == []
    core.agent_read("a", truth.snapshot(), "", 3.0, new_id)
    assert core.index.get("a").capabilities["rag.search"].max_concurrency == 2
    assert core.take_verifications() == []
    core.agent_read_late("a", None, 4.0, new_id)  # "no agent workflow", back then: nothing
    assert core.take_verifications() == [] and core.is_indexed("a")
