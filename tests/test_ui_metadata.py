"""What an operator sees in the Temporal UI (issue 9, item 1), read the way the UI reads it.

Static summaries and details come from `describe`; current details from the
`__temporal_workflow_metadata` query the UI calls; activity and timer summaries
from the history's user metadata; a dead agent and a drained one end with
different `AgentEndReason` values that `temporal workflow list --query` filters on.
"""

from __future__ import annotations

from temporalio.api.sdk.v1 import WorkflowMetadata

from agentroster.models import AgentState
from agentroster.vocabulary.wire import agent_workflow_id, pool_workflow_id
from tests.conftest import eventually, make_registration


async def _metadata(stack, workflow_id: str) -> WorkflowMetadata:  # noqa: ANN001
    return await stack.env.client.get_workflow_handle(workflow_id).query("__temporal_workflow_metadata", result_type=WorkflowMetadata)


async def _summaries(stack, workflow_id: str) -> list[str]:  # noqa: ANN001
    client = stack.env.client
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    out = []
    for event in history.events:
        if event.HasField("user_metadata") and event.user_metadata.HasField("summary"):
            out.append(client.data_converter.payload_converter.from_payload(event.user_metadata.summary, str))
    return out


async def test_agent_and_pool_tell_their_story_in_the_ui(stack) -> None:  # noqa: ANN001
    reg = make_registration("ui-agent", [("rag.search", "2.1.0", 2, "B"), ("rag.rerank", "1.0.0", 1, "A")])
    await stack.roster.register(reg)
    handle = stack.env.client.get_workflow_handle(agent_workflow_id(stack.pool, "ui-agent"))
    described = await handle.describe()
    assert await described.static_summary() == "agent ui-agent of search-agent: rag.search@2.1.0, rag.rerank@1.0.0"
    assert "| `rag.rerank` | 1.0.0 | 1 | A |" in (await described.static_details() or "")

    meta = await _metadata(stack, agent_workflow_id(stack.pool, "ui-agent"))
    assert meta.current_details.startswith("**Ready**")
    assert "free slots (capacity 2)" in meta.current_details and "`rag.search@2.1.0`" in meta.current_details
    user_queries = sorted(q.name for q in meta.definition.query_definitions if not q.name.startswith("__"))
    # One status query; the UI opens the Queries tab on the first name in sorted order (`refusals`).
    assert user_queries == ["refusals", "snapshot", "status"]
    assert all(q.description for q in meta.definition.query_definitions if not q.name.startswith("__"))

    lease = await stack.roster.acquire("rag.search", timeout=5)
    pool_meta = await _metadata(stack, pool_workflow_id(stack.pool))
    assert "**1 agent(s)**" in pool_meta.current_details and "1 active lease(s)" in pool_meta.current_details
    await stack.roster.release(lease)

    await stack.roster.drain("ui-agent", reason="operator-maintenance", deadline_s=30)
    summaries = await _summaries(stack, agent_workflow_id(stack.pool, "ui-agent"))
    assert "delete pod ui-agent of search-agent (drain)" in summaries
    assert any(s.startswith("tell pool ") for s in summaries)
    assert "liveness check" in summaries


async def test_dead_and_drained_agents_end_with_different_reasons_the_list_filters_on(stack) -> None:  # noqa: ANN001
    await stack.roster.register(make_registration("ui-drained", heartbeat_interval_s=30))
    await stack.roster.register(make_registration("ui-dead", heartbeat_interval_s=1))  # no heartbeats come
    await stack.roster.drain("ui-drained", deadline_s=30)
    status = await eventually(lambda: _ended(stack, "ui-dead"), timeout=20, interval=0.3)
    assert status.terminated_reason == "heartbeat_lost"

    async def listed(reason: str) -> list[str]:
        query = f'AgentPool="{stack.pool}" AND AgentEndReason="{reason}"'
        return [wf.id async for wf in stack.env.client.list_workflows(query)]

    assert await eventually(lambda: listed("heartbeat_lost"), timeout=15) == [agent_workflow_id(stack.pool, "ui-dead")]
    assert await eventually(lambda: listed("drain"), timeout=15) == [agent_workflow_id(stack.pool, "ui-drained")]


async def _ended(stack, agent_id: str):  # noqa: ANN001, ANN202
    status = await stack.roster.describe(agent_id)
    return status if status.state == AgentState.TERMINATED else None
