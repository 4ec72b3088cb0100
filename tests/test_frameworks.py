"""The OpenAI Agents SDK supervisor example (examples/openai_agents_supervisor.py), run durably
by Temporal with the scripted model (no network, no key), against a real pool and a real HTTP agent."""

from __future__ import annotations

import uuid

from temporalio.api.enums.v1 import EventType

from examples import math_agent
from examples.openai_agents_supervisor import ScriptedModelProvider, ask, supervisor_client


async def test_openai_agents_supervisor_uses_a_capability(stack) -> None:
    env = {"AGENT_PORT": "0", "AGENT_HOST": "127.0.0.1", "HEARTBEAT_INTERVAL_S": "5"}
    agent = math_agent.build_agent(env, agent_id=f"math-agent-{uuid.uuid4().hex[:6]}", roster=stack.roster)
    await agent.start()
    try:
        await agent.wait_ready(20)
        client = await supervisor_client(stack.env.client.service_client.config.target_host, model_provider=ScriptedModelProvider())
        task_queue = f"{stack.task_queue}-supervisor"
        workflow_id = f"supervisor-{uuid.uuid4().hex}"
        answer = await ask(client, stack.roster, "What is sqrt(16) + 2**10?", task_queue=task_queue, workflow_id=workflow_id)
        assert answer == 'The math.eval capability answered: {"value": 1028.0}'
        refused = await ask(client, stack.roster, "What is x + 1?", task_queue=task_queue)
        assert "InvalidTaskInputError" in refused and "unknown name 'x'" in refused
    finally:
        await agent.stop(drain=False)
    # The task went through the pool: one lease granted and released per question.
    status = await stack.roster.status()
    assert status.leases_granted == 2 and status.leases_released == 2
    # Durably: the model's turns and the tool call are activities in the supervisor's history.
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    activities = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    assert activities.count("use_capability") == 1 and len(activities) == 3, activities
