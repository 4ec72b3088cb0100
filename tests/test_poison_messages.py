"""Raw, wrong and hostile messages through a plain temporalio client, to every signal,
update and query of the agent, pool and task workflows: each is refused with a reason,
and no workflow task ever fails (WorkflowTaskFailed events counted in the histories)."""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from agentroster import AgentRegistration, AgentState
from agentroster.models import MAX_CAPABILITIES_PER_AGENT, TaskInput
from agentroster.client.transport import is_transient
from agentroster.vocabulary.wire import agent_workflow_id, pool_workflow_id
from tests.conftest import eventually, make_registration

HUGE = "x" * (600 * 1024)  # over the 512 KiB message limit, under the server's 2 MiB
# What a careless or hostile sender passes: (description, args).
BAD_ARGS: list[tuple[str, list[Any]]] = [
    ("no argument", []),
    ("two arguments", [{"a": 1}, {"b": 2}]),
    ("null", [None]),
    ("a string", ["garbage"]),
    ("a number", [42]),
    ("NaN", [math.nan]),
    ("infinity", [{"in_flight": 1, "saturated": True, "seq": math.inf}]),
    ("a list", [[1, 2, 3]]),
    ("huge", [{"blob": HUGE}]),
    ("a protobuf", [WorkflowExecution(workflow_id="proto")]),
]


async def _task_failures(client: Client, workflow_id: str) -> int:
    """WorkflowTaskFailed events across every run of `workflow_id`."""
    failures = 0
    async for wf in client.list_workflows(f'WorkflowId="{workflow_id}"'):
        history = await client.get_workflow_handle(workflow_id, run_id=wf.run_id).fetch_history()
        failures += sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
    return failures


async def _signal_all(handle: WorkflowHandle[Any, Any], names: list[str]) -> int:
    sent = 0
    for name in names:
        for _, args in BAD_ARGS:
            try:
                await handle.signal(name, args=args)
                sent += 1
            except RPCError as exc:  # the server itself may refuse a payload (never the workflow)
                assert exc.status in (RPCStatusCode.INVALID_ARGUMENT, RPCStatusCode.RESOURCE_EXHAUSTED), exc
    return sent


async def test_every_pool_signal_update_and_query_survives_bad_arguments(stack) -> None:
    client = stack.env.client
    await stack.roster.register(make_registration("steady", [("rag.search", "2.1.0", 1, "A")]))
    pool = client.get_workflow_handle(pool_workflow_id(stack.pool))

    sent = await _signal_all(pool, ["agent_snapshots"])
    await _signal_all(pool, ["release", "renew", "lease_granted"])  # no such signal: nothing happens, nothing fails
    for name in ("acquire", "release", "cancel", "renew", "set_policy", "may_evict", "confirm_evictions"):
        for what, args in BAD_ARGS:
            with pytest.raises((WorkflowUpdateFailedError, RPCError)) as refused:
                await pool.execute_update(name, args=args)
            if isinstance(refused.value, WorkflowUpdateFailedError):
                cause = str(refused.value.cause)
                assert name in cause and len(cause) < 1024, (name, what)  # named, and never an echo of the argument
    for what, args in BAD_ARGS[:5]:
        if what != "a string":  # (an unknown ticket: a plain answer)
            with pytest.raises((WorkflowQueryFailedError, RPCError)):
                await pool.query("tickets", args=args)

    bad_policies = [
        {"deployment": "d", "policy": {"min_replicas": 5, "max_replicas": 2}},
        {"deployment": "d", "policy": {"downscale_delay_s": -1}},
        {"deployment": "d", "policy": {"target_in_flight_per_agent": math.nan}},
        {"deployment": "d", "policy": {"max_uses": 0}},
        {"deployment": "d\n", "policy": {}},
        {"deployment": "d", "policy": {"breaker_mode": "panic"}},
        {"deployment": "d", "policy": {"surprise": 1}},
    ]
    for bad in bad_policies:
        with pytest.raises((WorkflowUpdateFailedError, RPCError)) as refused:
            await pool.execute_update("set_policy", bad)
        if isinstance(refused.value, WorkflowUpdateFailedError):
            assert "set_policy" in str(refused.value.cause), bad
    assert (await stack.roster.status()).policies == {}  # nothing changed
    bad_eviction_messages = [
        ("may_evict", {"agent_id": "steady", "window_s": 0}),
        ("may_evict", {"agent_id": "steady", "window_s": 1e9}),
        ("may_evict", {"agent_id": "steady\n", "window_s": 3}),
        ("may_evict", {"agent_id": "steady", "window_s": 3, "pool": "elsewhere"}),
        ("may_evict", {"agent_id": "x" * 300, "window_s": 3}),
        ("confirm_evictions", {"agents": "steady"}),
        ("confirm_evictions", {"agents": [""]}),
        ("confirm_evictions", {"agents": [f"a{i}" for i in range(1000)]}),
        ("confirm_evictions", {"everyone": True}),
        ("set_policy", {"eviction": {"threshold": 0}}),
        ("set_policy", {"eviction": {"threshold": 1.5}}),
        ("set_policy", {"eviction": {"cap_fraction": -0.1}}),
        ("set_policy", {"eviction": {"enabled": "maybe"}}),
        ("set_policy", {"eviction": {"surprise": 1}}),
        ("set_policy", {"eviction": {}, "deployment": "d"}),
        ("set_policy", {}),
    ]
    for name, bad in bad_eviction_messages:
        with pytest.raises((WorkflowUpdateFailedError, RPCError)) as refused:
            await pool.execute_update(name, bad)
        if isinstance(refused.value, WorkflowUpdateFailedError):
            assert name in str(refused.value.cause), (name, bad)
    evictions = await stack.roster.evictions()
    assert evictions.policy.enabled and evictions.silent == [] and evictions.evictions_allowed == 0  # nothing changed

    # Still serving, and every refusal has a reason.
    lease = await stack.roster.acquire("rag.search", timeout=5)
    await stack.roster.release(lease)
    refusals = (await stack.roster.status()).refusals
    # The last 20 are kept; the list [1, 2, 3] is three malformed snapshots, each refused alone.
    assert sent >= 5 and len(refusals) == min(sent + 2, 20)
    assert all(r.startswith("agent_snapshots refused:") for r in refusals)
    assert await _task_failures(client, pool_workflow_id(stack.pool)) == 0


async def test_every_agent_signal_and_update_survives_bad_arguments(stack) -> None:
    client = stack.env.client
    await stack.roster.register(make_registration("target", [("rag.search", "2.1.0", 2, "A")]))
    agent = client.get_workflow_handle(agent_workflow_id(stack.pool, "target"))

    await _signal_all(agent, ["register", "heartbeat", "acquire", "release", "drain"][:1] + ["acquire", "release", "retry_eviction"])
    # heartbeat and drain take no argument or one: anything else is refused, never raised.
    for _, args in BAD_ARGS:
        if args == [] or args == [None]:
            continue  # a bare heartbeat / drain is legitimate
        await agent.signal("drain", args=args)
    await agent.signal("heartbeat", args=[1, 2, 3])
    for _, args in BAD_ARGS[1:4]:
        with pytest.raises((WorkflowUpdateFailedError, RPCError)):
            await agent.execute_update("wait_routable", args=args)
    # A real notice first (the agent saturated, then free again), then forged ones:
    # a count past the agent's capacity, an absurd sequence number.
    held = [await stack.roster.acquire("rag.search", timeout=5) for _ in range(2)]
    assert await eventually(lambda: _state(stack, "target", AgentState.BUSY))
    for lease in held:
        await stack.roster.release(lease)
    assert await eventually(lambda: _state(stack, "target", AgentState.READY))
    await agent.signal("acquire", {"in_flight": 999, "saturated": True, "seq": 5})
    await agent.signal("release", {"in_flight": 0, "saturated": False, "seq": 2**52, "draining": True})

    status = await stack.roster.describe("target")
    assert status.state == AgentState.READY
    refusals = await agent.query("refusals")
    assert any("max_concurrency" in r for r in refusals) and any("implausibly far ahead" in r for r in refusals)
    # The agent still works: a lease, a drain that ends on a real zero.
    lease = await stack.roster.acquire("rag.search", timeout=5)
    await stack.roster.release(lease)
    assert (await stack.roster.drain("target", deadline_s=30)).terminated_reason == "drain"
    assert await _task_failures(client, agent_workflow_id(stack.pool, "target")) == 0


async def _state(stack, agent_id: str, state: AgentState) -> bool:
    return (await stack.roster.describe(agent_id)).state == state


async def test_task_workflow_signals_from_strangers_are_refused(stack) -> None:
    client = stack.env.client
    await stack.roster.register(make_registration("busy-slot", [("rag.search", "2.1.0", 1, "A")]))
    held = await stack.roster.acquire("rag.search", timeout=5)
    task_id = f"task-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="rag.search", payload={}, pool=stack.pool, acquire_timeout_s=20),
        id=task_id,
        task_queue=stack.task_queue,
    )
    await asyncio.sleep(0.5)  # queued behind `held`, inside its activity
    sent = await _signal_all(handle, ["lease_revoked"])
    # A grant by signal is no road of the task's: a forged one (it would send the payload to a
    # stranger's endpoint) finds no handler and changes nothing.
    forged = {**held.model_dump(mode="json"), "endpoint": "http://attacker.invalid:1", "lease_id": "f" * 32}
    await handle.signal("lease_granted", {"ticket": "0" * 32, "lease": forged})
    refusals = await handle.query("refusals")
    assert sum(r.startswith("lease_revoked refused") for r in refusals) == sent
    await stack.roster.release(held)  # now the real grant arrives; the (unreachable) agent fails the task
    with pytest.raises(Exception):
        await handle.result()
    assert await _task_failures(client, task_id) == 0


async def test_unbounded_numbers_and_names_are_refused(stack) -> None:
    base = make_registration("bounded").model_dump(mode="json")
    for field, value in (("heartbeat_interval_s", 1e12), ("heartbeat_interval_s", math.inf), ("heartbeat_interval_s", math.nan), ("heartbeat_interval_s", 0.2)):
        with pytest.raises(ValueError, match="heartbeat_interval_s"):
            AgentRegistration.model_validate({**base, field: value})
    for name in ("rag.search\n", "rag.search ", "x" * 200):
        with pytest.raises(ValueError, match="name"):
            AgentRegistration.model_validate({**base, "capabilities": [{**base["capabilities"][0], "name": name}]})
    with pytest.raises(ValueError, match="version"):
        AgentRegistration.model_validate({**base, "capabilities": [{**base["capabilities"][0], "version": "2.1.0\n"}]})

    # Raw, through a plain client: refused inside the workflow, which carries on.
    client = stack.env.client
    handle = await client.start_workflow(
        "AgentWorkflow",
        {"agent_id": "bounded", "pool": stack.pool},
        id=agent_workflow_id(stack.pool, "bounded"),
        task_queue=stack.task_queue,
        start_signal="register",
        start_signal_args=[{**base, "heartbeat_interval_s": 1e12}],
    )
    pool = client.get_workflow_handle(pool_workflow_id(stack.pool))
    snapshot = {"agent_id": "ghosty", "deployment": "d", "endpoint": "http://127.0.0.1:1", "state": "Ready",
                "capabilities": [{"name": "rag.search", "version": "2.1.0", "max_concurrency": 1}], "resync_interval_s": math.inf}
    await pool.signal("agent_snapshots", [snapshot])
    await handle.signal("register", base)  # a good registration after the bad one
    assert await eventually(lambda: _routable(stack, "bounded"), timeout=15)
    assert any("heartbeat_interval_s" in r for r in await handle.query("refusals"))
    assert any("resync_interval_s" in r or "NaN" in r or "inf" in r.lower() for r in (await stack.roster.status()).refusals)
    assert await _task_failures(client, agent_workflow_id(stack.pool, "bounded")) == 0


async def _routable(stack, agent_id: str) -> bool:
    return agent_id in await stack.roster.find("rag.search")


async def test_the_most_capabilities_an_agent_may_have_stay_within_search_attribute_limits(stack) -> None:
    caps = [(f"capability-with-a-rather-long-name-{i:03d}.{'x' * 60}", "1.0.0", 1, "B") for i in range(MAX_CAPABILITIES_PER_AGENT)]
    reg = make_registration("many-caps", caps)
    status = await stack.roster.register(reg)  # was: ~95 caps got the workflow terminated by the server
    assert status.state == AgentState.READY
    first = caps[0][0]
    found = [wf.id async for wf in stack.env.client.list_workflows(f'AgentCapabilities="{first}" AND AgentPool="{stack.pool}"')]
    assert await eventually(lambda: _listed(stack, first), timeout=15)
    assert len(found) <= 1
    with pytest.raises(ValueError, match=f"at most {MAX_CAPABILITIES_PER_AGENT}"):
        make_registration("too-many", caps + [("one.more", "1.0.0", 1, "B")])


async def _listed(stack, name: str) -> bool:
    query = f'AgentCapabilities="{name}" AND AgentPool="{stack.pool}"'
    return [wf.id async for wf in stack.env.client.list_workflows(query)] == [agent_workflow_id(stack.pool, "many-caps")]


async def test_a_forged_snapshot_never_becomes_routable(stack) -> None:
    pool = stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool))
    ghost = {"agent_id": "ghost", "deployment": "d", "endpoint": "http://attacker.invalid:1", "state": "Ready",
             "capabilities": [{"name": "rag.search", "version": "2.1.0", "max_concurrency": 9, "cost_class": "A"}]}
    await pool.signal("agent_snapshots", [ghost])
    await stack.roster.register(make_registration("real", [("rag.search", "2.1.0", 1, "C")]))
    status = await eventually(lambda: _warned(stack, "ghost"), timeout=15)
    assert [a.agent_id for a in status.agents] == ["real"]
    assert await stack.roster.find("rag.search") == ["real"]  # the cheaper ghost is not routable


async def _warned(stack, agent_id: str):  # noqa: ANN202
    status = await stack.roster.status()
    return status if any(agent_id in w and "refused" in w for w in status.warnings) else None


async def test_lease_and_ticket_ids_come_from_the_callers_secret(stack) -> None:
    import hashlib

    await stack.roster.register(make_registration("only", [("rag.search", "2.1.0", 1, "A")]))
    held = await stack.roster.acquire("rag.search", timeout=5)
    secret = uuid.uuid4().hex
    from agentroster.messages import AcquireRequest

    reply = await stack.roster.request(AcquireRequest(ref="rag.search", wait_s=10, request_id=secret))
    assert reply.ticket == hashlib.sha256(f"ticket:{secret}".encode()).hexdigest()[:32]
    # A stranger who does not know the secret cannot name the ticket, nor release what it does not hold.
    pool = stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool))
    assert [t["pending"] for t in await pool.query("tickets", [uuid.uuid4().hex])] == [False]
    assert await pool.execute_update("release", [uuid.uuid4().hex for _ in range(50)]) == 0
    assert (await stack.roster.status()).active_leases == 1
    await stack.roster.release(held)
    await stack.roster.cancel_ticket(reply.ticket)


def test_a_failing_workflow_task_is_retried_by_the_client() -> None:
    assert is_transient(RPCError("Workflow Task in failed state.", RPCStatusCode.FAILED_PRECONDITION, b""))
    assert not is_transient(RPCError("Workflow Task in failed state.", RPCStatusCode.INVALID_ARGUMENT, b""))


def test_an_update_the_server_rejected_unprocessed_is_retried_and_a_handler_failure_is_not() -> None:
    # What the server answered two acquires right after a worker kill -9 (benchmarks/chaos.py, worker row):
    # the retried workflow task no longer carried them, so no worker said anything of them.
    unprocessed = ApplicationError("Workflow Update is rejected because it wasn't processed by worker.", type="UnprocessedUpdate")
    assert is_transient(WorkflowUpdateFailedError(unprocessed))
    assert not is_transient(WorkflowUpdateFailedError(ApplicationError("acquire: bad ref", type="ValueError")))


def test_a_query_rejected_by_a_run_that_just_continued_as_new_is_asked_again() -> None:
    # roster.describe() met an agent's run closing by continue-as-new and raised
    # WorkflowContinuedAsNewError (found by 2,000 heartbeats against a run that continues every 10 signals).
    assert is_transient(WorkflowQueryRejectedError(WorkflowExecutionStatus.CONTINUED_AS_NEW))
    assert not is_transient(WorkflowQueryRejectedError(WorkflowExecutionStatus.TERMINATED))
