"""A big pool's `status` reply stays under the server's 2 MiB message limit.

Found by the reliability harness (row 5, 10,000 agents + 10,000 leases): the reply was
2.5 MB, every `status` query failed (`[TMPRL1103] ... size=2514512`), and with it the
CLI, the dev view and the metrics exporter.
"""

from __future__ import annotations

from temporalio.contrib.pydantic import pydantic_data_converter

from agentroster.models import STATUS_REPLY_MAX_BYTES, AgentState, PoolAgentRow, PoolStatus, fit_status
from agentroster.client.shard_status import merge_statuses


def _status(agents: int) -> PoolStatus:
    rows = [
        PoolAgentRow(agent_id=f"chaos-agent-{i:05d}", deployment="chaos-agent", state=AgentState.BUSY, in_flight=1,
                     capabilities=["chaos.hold@1.0.0", "rag.search@2.1.0"], uses=7)
        for i in range(agents)
    ]
    return PoolStatus(pool="big", agents=rows, active_leases=agents, leases_granted=3 * agents)


def _size(status: PoolStatus) -> int:
    return len(pydantic_data_converter.payload_converter.to_payloads([status])[0].data)


def test_rows_are_left_out_and_counted_until_the_reply_fits() -> None:
    status = _status(12_000)
    assert _size(status) > STATUS_REPLY_MAX_BYTES
    fitted = fit_status(status, _size(status), _size)
    assert _size(fitted) <= STATUS_REPLY_MAX_BYTES
    assert fitted.agent_count == 12_000 and fitted.agents_omitted == 12_000 - len(fitted.agents) > 0
    assert fitted.agents == status.agents[: len(fitted.agents)]  # the rows it keeps, as they were
    assert (fitted.active_leases, fitted.leases_granted) == (12_000, 36_000)


def test_a_reply_that_fits_is_sent_as_it_was() -> None:
    status = _status(100)
    assert fit_status(status, _size(status), _size) is status
    assert "agents_omitted" not in status.model_dump(mode="json")  # a process of the previous version reads it


def test_shards_add_up_what_they_left_out() -> None:
    shards = [fit_status(s, _size(s), _size) for s in (_status(12_000), _status(12_000))]
    merged = merge_statuses(shards)
    assert merged.agent_count == 24_000


def test_a_row_leaves_out_what_holds_its_default_and_reads_back_whole() -> None:
    idle = PoolAgentRow(agent_id="a1", deployment="d", state=AgentState.READY, in_flight=0, capabilities=["x@1.0.0"])
    assert idle.model_dump(mode="json") == {
        "agent_id": "a1", "deployment": "d", "state": "Ready", "in_flight": 0, "capabilities": ["x@1.0.0"],
    }
    worn = idle.model_copy(update={"uses": 3, "retiring": "worn", "health_failures": 2, "silent": True})
    sent = worn.model_dump(mode="json")
    assert (sent["uses"], sent["retiring"], sent["health_failures"], sent["silent"]) == (3, "worn", 2, True)
    for row in (idle, worn):
        assert PoolAgentRow.model_validate_json(row.model_dump_json()) == row
