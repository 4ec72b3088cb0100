"""A burst of registrations through the public API: every agent becomes routable, the pool
reads the new agents in batches (at most READS_IN_FLIGHT at once, every agent once), and the
worker's pollers follow the backlog (each new agent workflow's first task comes from the
normal queue)."""

from __future__ import annotations

import asyncio

from temporalio.api.enums.v1 import EventType
from temporalio.worker import PollerBehaviorAutoscaling

from agentroster.vocabulary.wire import READ_AGENTS, pool_workflow_id
from agentroster.workflows.pool import READS_IN_FLIGHT
from tests.conftest import make_registration

AGENTS = 120


async def test_a_burst_of_registrations_is_routable_and_read_in_bounded_batches(stack) -> None:
    config = stack.worker.config()
    assert isinstance(config["workflow_task_poller_behavior"], PollerBehaviorAutoscaling)
    assert isinstance(config["activity_task_poller_behavior"], PollerBehaviorAutoscaling)

    ids = [f"burst-{i:03d}" for i in range(AGENTS)]
    statuses = await asyncio.gather(
        *(stack.roster.register(
            # (a liveness window longer than the burst on a loaded machine: they send no heartbeat)
            make_registration(a, [("rag.search", "2.1.0", 1, "A")], heartbeat_interval_s=600.0), timeout=120
        ) for a in ids)
    )
    assert {s.state.value for s in statuses} <= {"Ready", "Busy"}
    status = await stack.roster.status()
    assert status.capabilities["rag.search"].agents.get("Ready", 0) == AGENTS

    # The pool's history: every read_agents batch with its moments, none overlapping more than allowed.
    events = (await stack.env.client.get_workflow_handle(pool_workflow_id(stack.pool)).fetch_history()).events
    scheduled: dict[int, int] = {}  # scheduled event id -> agents in the batch
    open_reads = peak = 0
    read: list[str] = []
    for event in events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attributes = event.activity_task_scheduled_event_attributes
            if attributes.activity_type.name == READ_AGENTS:
                batch = await stack.env.client.data_converter.decode(attributes.input.payloads)
                ids_read = batch[0]["agent_ids"] if isinstance(batch[0], dict) else batch[0].agent_ids
                scheduled[event.event_id] = len(ids_read)
                read += ids_read
                open_reads += 1
                peak = max(peak, open_reads)
        elif event.event_type in (
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
            EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
        ):
            attributes = (
                event.activity_task_completed_event_attributes
                if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                else event.activity_task_failed_event_attributes
                if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
                else event.activity_task_timed_out_event_attributes
                if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT
                else event.activity_task_canceled_event_attributes
            )
            if attributes.scheduled_event_id in scheduled:
                open_reads -= 1
    assert 1 <= peak <= READS_IN_FLIGHT
    assert sorted(set(read)) == ids  # every new agent read, by its own workflow's snapshot
