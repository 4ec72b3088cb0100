"""Every piece of state a workflow carries across continue-as-new survives the data converter.

Hypothesis drives an agent lifecycle with values at the edges of what validation
admits (the largest intervals, counts, sequence numbers, odd but valid names), then
sends its carry inside `AgentWorkflowInput` through the worker's data converter, as
a real run does, and checks the next run starts from an equal lifecycle whose
deadlines are still representable dates. The pool's carried state gets the same
check at every step of the stateful test in `test_core_properties.py`.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.contrib.pydantic import pydantic_data_converter

from agentroster.messages import SEQ_MAX, LoadNotice
from agentroster.models import (
    HEARTBEAT_MAX_S,
    HEARTBEAT_MIN_S,
    MAX_CONCURRENCY_MAX,
    AgentRegistration,
    AgentState,
    Capability,
)
from agentroster.core.lifecycle import AgentLifecycle, TransitionRefused
from agentroster.vocabulary.wire import AgentWorkflowInput

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

names = st.from_regex(r"[a-z][a-z0-9_-]{0,20}(\.[a-z0-9_-]{1,10}){0,2}", fullmatch=True)
versions = st.builds(lambda a, b, c: f"{a}.{b}.{c}", *(st.integers(0, 10**6),) * 3)
capabilities = st.builds(
    Capability,
    name=names,
    version=versions,
    max_concurrency=st.integers(1, MAX_CONCURRENCY_MAX),
    cost_class=st.sampled_from(["A", "B", "C"]),
)
registrations = st.builds(
    AgentRegistration,
    agent_id=st.just("agent-1"),
    deployment=st.just("search-agent"),
    endpoint=st.sampled_from(["http://127.0.0.1:9000", "https://agent.example/a/b"]),
    capabilities=st.lists(capabilities, min_size=1, max_size=8, unique_by=lambda c: c.name),
    heartbeat_interval_s=st.floats(HEARTBEAT_MIN_S, HEARTBEAT_MAX_S, allow_nan=False),
    metadata=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=3),
)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("register"), registrations),
        st.tuples(st.just("indexed"), st.none()),
        st.tuples(st.just("heartbeat"), st.none()),
        st.tuples(
            st.just("load"),
            st.builds(
                LoadNotice,
                in_flight=st.integers(0, MAX_CONCURRENCY_MAX),
                saturated=st.booleans(),
                seq=st.integers(0, SEQ_MAX),
                epoch=st.sampled_from(["", "e1", "e2"]),
                draining=st.booleans(),
            ),
        ),
        st.tuples(st.just("drain"), st.floats(1e-3, 7 * 24 * 3600, allow_nan=False)),
        st.tuples(st.just("terminate"), st.sampled_from(["heartbeat_lost", "drained", "operator"])),
    ),
    max_size=30,
)


def through_converter(carry: dict) -> dict:
    payloads = asyncio.run(
        pydantic_data_converter.encode([AgentWorkflowInput(agent_id="agent-1", pool="prod", carried=carry)])
    )
    (received,) = asyncio.run(pydantic_data_converter.decode(payloads, [AgentWorkflowInput]))
    assert received.carried is not None
    return received.carried


@settings(max_examples=150, deadline=None)
@given(script=steps, gaps=st.lists(st.floats(0, 3600, allow_nan=False), min_size=30, max_size=30))
def test_agent_carry_round_trips_through_the_data_converter(script: list, gaps: list[float]) -> None:
    life = AgentLifecycle(agent_id="agent-1", pool="prod")
    now = T0
    life.spawn(now)
    for (kind, value), gap in zip(script, gaps):
        now += timedelta(seconds=gap)
        try:
            if kind == "register":
                life.register(value, now)
            elif kind == "indexed":
                life.indexed(now)
            elif kind == "heartbeat":
                life.heartbeat(now)
            elif kind == "load":
                if life.implausible(value) is None:
                    life.apply_load(value, now)
            elif kind == "drain":
                life.drain("scale-down", value, now)
            else:
                life.terminate(value, now)
        except TransitionRefused:
            pass
        restored = AgentLifecycle.from_carried(through_converter(life.to_carried()))
        assert restored == life
        # What the next run computes from the carry must be a date it can sleep until.
        for moment in (restored.next_wakeup(), restored.liveness_deadline(), restored.resync_due()):
            assert moment is None or moment.year < 9999
    if life.state == AgentState.TERMINATED:
        assert AgentLifecycle.from_carried(through_converter(life.to_carried())).terminated_reason
