"""The table of input limits in docs/limits.md is what the code enforces.

Each row is checked at its edges: the limit itself is accepted and the first
value past it is refused (with the field named), so neither the table nor the
code can drift without this test failing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentroster.messages import (
    AcquireRequest,
    AgentSnapshot,
    CapabilityDigest,
    ConfirmEvictions,
    DrainRequest,
    EvictionAsk,
    LoadNotice,
    ScaleRequest,
    ShutdownRequest,
)
from agentroster.models import (
    AgentRegistration,
    AgentState,
    Capability,
    EvictionPolicy,
    RoutingTable,
    TaskInput,
    check_pool_name,
)
from agentroster.workflows.messages import MAX_MESSAGE_BYTES
from agentroster.messages import MAX_BATCH

LIMITS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "limits.md"


def table() -> dict[str, str]:
    text = LIMITS_PAGE.read_text()
    body = text.split("<!-- limits-table -->", 1)[1].split("<!-- /limits-table -->", 1)[0]
    rows = {}
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1]
    return rows


def reg(**overrides: Any) -> AgentRegistration:
    data: dict[str, Any] = {
        "agent_id": "a-1",
        "deployment": "d",
        "endpoint": "http://127.0.0.1:9000",
        "capabilities": [{"name": "rag.search", "version": "1.0.0"}],
    }
    data.update(overrides)
    return AgentRegistration.model_validate(data)


def caps(n: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"name": f"cap.n{i}", "version": "1.0.0", **fields} for i in range(n)]


def acquire(**overrides: Any) -> AcquireRequest:
    return AcquireRequest.model_validate({"ref": "rag.search", "request_id": "r" * 32, **overrides})


def snapshot(**overrides: Any) -> AgentSnapshot:
    return AgentSnapshot.model_validate(
        {"agent_id": "a-1", "deployment": "d", "endpoint": "http://h:1", "state": AgentState.READY, **overrides}
    )


def task(**overrides: Any) -> TaskInput:
    return TaskInput.model_validate({"ref": "rag.search", **overrides})


def routes(entries: dict[str, Any]) -> RoutingTable:
    return RoutingTable.model_validate({"routes": entries})


LONGEST_REF = "a" * 128 + "@>=1" + ",>=1" * 31  # 256 characters
assert len(LONGEST_REF) == 256

# row -> (text the docs row must contain, accepted values, refused values, build(value), field named in errors)
ROWS: list[tuple[str, str, list[Any], list[Any], Callable[[Any], Any], str]] = [
    ("`heartbeat_interval_s`", "1 s – 3600 s", [1, 3600], [0.99, 3600.01, math.inf, math.nan, 1e12],
     lambda v: reg(heartbeat_interval_s=v), "heartbeat_interval_s"),
    ("capabilities per agent", "64", [64], [65], lambda n: reg(capabilities=caps(n)), "capabilities"),
    ("capability name", "128 characters", ["a" * 128], ["a" * 129, "rag.search\n", "rag..search"],
     lambda v: Capability(name=v, version="1.0.0"), "name"),
    ("capability version", "64 characters", ["1.0.0-beta." + "1" * 53], ["1.0.0-beta." + "1" * 54, "1.0.0\n"],
     lambda v: Capability(name="a", version=v), "version"),
    ("`max_concurrency` (capability or agent)", "1 – 10000", [1, 10_000], [0, 10_001],
     lambda v: Capability(name="a", version="1.0.0", max_concurrency=v), "max_concurrency"),
    ("agent endpoint", "512 characters", ["http://h:1/" + "p" * 500], ["http://h:1/" + "p" * 502, "ftp://h", "http://h\n"],
     lambda v: reg(endpoint=v), "endpoint"),
    ("agent id, deployment", "253 characters", ["a" * 253], ["a" * 254, "a-1\n", "-a"], lambda v: reg(agent_id=v), "agent_id"),
    ("pool name", "128 characters", ["p" * 128], ["p" * 129, "a/b", "p\n"], check_pool_name, "pool"),
    ("capability schemas (each)", "65536 bytes", [{"d": "x" * 65_000}], [{"d": "x" * 65_600}],
     lambda v: Capability(name="a", version="1.0.0", input_schema=v), "input_schema"),
    ("registration metadata", "16384 bytes", [{"d": "x" * 16_000}], [{"d": "x" * 16_400}], lambda v: reg(metadata=v), "metadata"),
    ("registration (all of it)", "262144 bytes", [4], [5],
     lambda n: reg(capabilities=caps(n, input_schema={"d": "x" * 60_000})), "registration"),
    ("capability reference (`name@range`)", "256 characters", [LONGEST_REF], [LONGEST_REF + "0", "rag search", "@>=1"],
     lambda v: acquire(ref=v), "ref"),
    ("`lease_ttl_s`", "604800 s", [604_800, 0.001], [0, 604_801, math.inf], lambda v: acquire(lease_ttl_s=v), "lease_ttl_s"),
    ("`wait_s` (time in the queue)", "0 – 86400 s", [0, 86_400], [-1, 86_401, math.nan], lambda v: acquire(wait_s=v), "wait_s"),
    ("`request_id` (the caller's secret)", "16 – 128 characters", ["r" * 16, "r" * 128], ["r" * 15, "r" * 129],
     lambda v: acquire(request_id=v), "request_id"),
    ("`exclude_agents`", "100 agent ids", [100], [101], lambda n: acquire(exclude_agents=[f"a{i}" for i in range(n)]), "exclude_agents"),
    ("drain `deadline_s`", "604800 s", [604_800], [0, 604_801, math.inf], lambda v: DrainRequest(deadline_s=v), "deadline_s"),
    ("shutdown `deadline_s`", "0 – 604800 s", [0, 604_800], [-0.001, 604_801, math.inf, math.nan],
     lambda v: ShutdownRequest(deadline_s=v), "deadline_s"),
    ("snapshot `resync_interval_s`", "1 s – 86400 s", [1, 86_400], [0.5, 86_401, math.inf],
     lambda v: snapshot(resync_interval_s=v), "resync_interval_s"),
    ("load notice `seq`", "9007199254740992", [0, 2**53], [-1, 2**53 + 1], lambda v: LoadNotice(in_flight=0, saturated=False, seq=v), "seq"),
    ("task `task_timeout_s`", "86400 s", [86_400], [0, 86_401], lambda v: task(task_timeout_s=v), "task_timeout_s"),
    ("task `max_attempts`", "1 – 20", [1, 20], [0, 21], lambda v: task(max_attempts=v), "max_attempts"),
    ("task `lease_ttl_s` (renewed every third of it)", "3 s – 86400 s", [3, 86_400], [2.9, 86_401],
     lambda v: task(lease_ttl_s=v), "lease_ttl_s"),
    ("`replicas` of a scale request", "0 – 10000", [0, 10_000], [-1, 10_001], lambda v: ScaleRequest(deployment="d", replicas=v), "replicas"),
    ("task type (routing table)", "128 characters", ["a" * 128, "docs.translate", "code-review"],
     ["a" * 129, "summarize\n", "two words", "1st", "a..b"], lambda v: routes({v: {"pool": "p", "ref": "x"}}), "task type"),
    ("routes in a routing table", "1 – 1000", [1, 1000], [0, 1001],
     lambda n: routes({f"t{i}": {"pool": "p", "ref": "x"} for i in range(n)}), "routes"),
    ("eviction `threshold`, `cap_fraction`", "more than 0, at most 1", [1, 0.001], [0, 1.001, math.nan],
     lambda v: EvictionPolicy(threshold=v), "threshold"),
    ("eviction `threshold`, `cap_fraction`", "more than 0, at most 1", [1, 0.001], [0, 1.001, math.inf],
     lambda v: EvictionPolicy(cap_fraction=v), "cap_fraction"),
    ("eviction `window_s` (3 × the heartbeat interval)", "1 s – 10800 s", [1, 10_800], [0.99, 10_800.01, math.nan],
     lambda v: EvictionAsk(agent_id="a-1", window_s=v), "window_s"),
    ("agents in one `confirm_evictions`", "256", [256], [257], lambda n: ConfirmEvictions(agents=[f"a{i}" for i in range(n)]), "agents"),
]


@pytest.mark.parametrize(("row", "text", "accepted", "refused", "build", "field"), ROWS, ids=[r[0] for r in ROWS])
def test_each_limit_in_the_readme_is_enforced_at_its_edges(
    row: str, text: str, accepted: list[Any], refused: list[Any], build: Callable[[Any], Any], field: str
) -> None:
    rows = table()
    assert row in rows, f"docs/limits.md's limits table has no row {row!r}"
    assert text in rows[row], (row, rows[row])
    for value in accepted:
        build(value)
    for value in refused:
        with pytest.raises((ValidationError, ValueError)) as caught:
            build(value)
        assert field in str(caught.value) or field == "registration", (row, value, str(caught.value)[:300])


def test_message_and_batch_rows_match_the_code() -> None:
    rows = table()
    assert str(MAX_MESSAGE_BYTES) in rows["any one signal, update or query argument"]
    assert str(MAX_BATCH) in rows["acquires or releases in one batch"]
    assert re.search(r"\d", rows["pool size carried across continue-as-new"])


def test_capability_digest_has_the_same_bounds_as_the_capability() -> None:
    with pytest.raises(ValidationError):
        CapabilityDigest(name="a\n", version="1", max_concurrency=1, cost_class="A")
    with pytest.raises(ValidationError):
        CapabilityDigest(name="a", version="1", max_concurrency=10_001, cost_class="A")
