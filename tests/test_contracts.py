"""Validation of the public models: every rejection names the field and the reason."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from pydantic import ValidationError

from agentroster.errors import PoolExhaustedError, PoolReport
from agentroster.messages import AcquireRequest
from agentroster.models import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    METADATA_MAX_BYTES,
    AgentRegistration,
    Capability,
    CapabilityRef,
)
from agentroster.vocabulary.versions import parse_semver


def cap(name: str = "rag.search", version: str = "2.1.0", **kw: Any) -> dict[str, Any]:
    return {"name": name, "version": version, **kw}


def reg(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "agent_id": "search-agent-7f9c",
        "deployment": "search-agent",
        "endpoint": "http://10.0.0.7:8080",
        "capabilities": [cap()],
    }
    data.update(overrides)
    return data


def single_error(exc: pytest.ExceptionInfo[ValidationError]) -> tuple[tuple[Any, ...], str]:
    errors = exc.value.errors()
    assert len(errors) == 1, errors
    return tuple(errors[0]["loc"]), errors[0]["msg"]


# ----------------------------------------------------------------- versions


@pytest.mark.parametrize("version", ["2.1.0", "1.0.0-rc.1", "0.0.1", "10.20.30", "1.0.0+build.5"])
def test_semver_versions_accepted(version: str) -> None:
    assert Capability(**cap(version=version)).version == version


@pytest.mark.parametrize("version", ["2.1", "v2.1.0", "2", "2.1.0.0", "02.1.0", "", "latest"])
def test_non_semver_version_rejected_naming_field_and_reason(version: str) -> None:
    with pytest.raises(ValidationError) as exc:
        Capability(**cap(version=version))
    loc, msg = single_error(exc)
    assert loc == ("version",)
    assert "not a semantic version" in msg
    assert repr(version) in msg


def test_non_semver_version_inside_registration_names_the_path() -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(capabilities=[cap(), cap(name="code.exec", version="v2.1.0")]))
    loc, msg = single_error(exc)
    assert loc == ("capabilities", 1, "version")
    assert "not a semantic version" in msg


def test_parse_semver_orders_prereleases_before_release() -> None:
    assert parse_semver("1.0.0-rc.1") < parse_semver("1.0.0") < parse_semver("1.0.1")
    with pytest.raises(ValueError, match="not a semantic version"):
        parse_semver("2.1")


def test_bad_capability_name_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        Capability(**cap(name="rag search"))
    loc, msg = single_error(exc)
    assert loc == ("name",)
    assert "dotted capability name" in msg


# ----------------------------------------------------------------- refs


def test_ref_with_unparsable_specifier_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        CapabilityRef.parse("rag.search@>>2")
    loc, msg = single_error(exc)
    assert loc == ("specifier",)
    assert "'>>2'" in msg and "not a version specifier set" in msg
    # the same reason reaches a caller building an AcquireRequest
    with pytest.raises(ValidationError) as exc2:
        AcquireRequest(ref="rag.search@>>2", request_id="r" * 32)
    assert exc2.value.errors()[0]["loc"][0] == "ref"
    assert "not a version specifier set" in exc2.value.errors()[0]["msg"]


@pytest.mark.parametrize("ref", ["", "   ", "@>=2"])
def test_empty_or_nameless_ref_rejected(ref: str) -> None:
    with pytest.raises(ValueError):
        CapabilityRef.parse(ref)


@pytest.mark.parametrize("version", ["0.0.1", "1.9.9", "2.0.0", "3.0.0", "1.0.0-rc.1", "99.0.0"])
def test_bare_name_ref_matches_any_version(version: str) -> None:
    ref = CapabilityRef.parse("rag.search")
    assert ref.name == "rag.search" and ref.specifier == ""
    assert ref.matches(version)
    assert str(ref) == "rag.search"


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.0.0", True), ("2.9.1", True), ("2.5.0", True), ("3.0.0", False), ("1.9.9", False)],
)
def test_range_ref_matches(version: str, expected: bool) -> None:
    ref = CapabilityRef.parse("rag.search@>=2,<3")
    assert ref.name == "rag.search" and ref.specifier == ">=2,<3"
    assert ref.matches(version) is expected
    assert str(ref) == "rag.search@>=2,<3"


def test_ref_parse_strips_whitespace_and_is_idempotent() -> None:
    ref = CapabilityRef.parse("  rag.search @ >=2,<3 ")
    assert (ref.name, ref.specifier) == ("rag.search", ">=2,<3")
    assert CapabilityRef.parse(ref) is ref


# ----------------------------------------------------------------- registration


def test_valid_registration() -> None:
    r = AgentRegistration(**reg())
    assert r.heartbeat_interval_s == DEFAULT_HEARTBEAT_INTERVAL_S == 240.0
    assert r.capability("rag.search") is not None
    assert r.capability_keys == ["rag.search@2.1.0"]


def test_empty_capability_list_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(capabilities=[]))
    loc, msg = single_error(exc)
    assert loc == ("capabilities",)
    assert "at least one capability" in msg


def test_duplicated_capability_names_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(capabilities=[cap(version="2.1.0"), cap(name="code.exec"), cap(version="2.2.0")]))
    loc, msg = single_error(exc)
    assert loc == ("capabilities",)
    assert "'rag.search'" in msg and "more than once" in msg


@pytest.mark.parametrize("value", [0, -1])
def test_max_concurrency_below_one_rejected(value: int) -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(capabilities=[cap(max_concurrency=value)]))
    loc, msg = single_error(exc)
    assert loc == ("capabilities", 0, "max_concurrency")
    assert "greater than or equal to 1" in msg


@pytest.mark.parametrize("value", [0, 0.0, -5, 0.5])
def test_heartbeat_interval_under_a_second_rejected(value: float) -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(heartbeat_interval_s=value))
    loc, msg = single_error(exc)
    assert loc == ("heartbeat_interval_s",)
    assert "greater than or equal to 1" in msg


def test_short_heartbeat_interval_accepted_with_a_warning_text() -> None:
    r = AgentRegistration(**reg(heartbeat_interval_s=1))
    assert r.heartbeat_interval_s == 1
    text = r.short_heartbeat_warning()
    assert text is not None
    assert "search-agent-7f9c" in text and "heartbeat_interval_s=1" in text and "5s" in text
    assert AgentRegistration(**reg(heartbeat_interval_s=5)).short_heartbeat_warning() is None
    assert AgentRegistration(**reg()).short_heartbeat_warning() is None


class _Refused(Exception):
    pass


class _StubClient:
    """Stands in for a temporalio Client: every call is refused (no server needed)."""

    def __getattr__(self, name: str) -> Any:
        async def refuse(*args: Any, **kwargs: Any) -> Any:
            raise _Refused(name)

        return refuse


async def test_short_heartbeat_interval_logs_a_warning_on_register(caplog: pytest.LogCaptureFixture) -> None:
    from agentroster.client.roster import AgentRoster

    roster = AgentRoster(_StubClient(), pool="p", task_queue="tq")  # type: ignore[arg-type]
    roster._pool_started = True  # straight to the (refused) agent workflow start
    with caplog.at_level(logging.WARNING, logger="agentroster"):
        with pytest.raises(_Refused):
            await roster.register(reg(heartbeat_interval_s=1))
    warnings = [rec for rec in caplog.records if rec.name == "agentroster" and rec.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "search-agent-7f9c" in warnings[0].getMessage()
    assert "heartbeat_interval_s=1" in warnings[0].getMessage()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentroster"):
        with pytest.raises(_Refused):
            await roster.register(reg(heartbeat_interval_s=5))
    assert not [rec for rec in caplog.records if rec.name == "agentroster"]


def _metadata_of_size(size: int) -> dict[str, Any]:
    overhead = len(json.dumps({"k": ""}, separators=(",", ":")).encode())
    data = {"k": "x" * (size - overhead)}
    assert len(json.dumps(data, separators=(",", ":")).encode()) == size
    return data


def test_metadata_exactly_at_limit_accepted() -> None:
    r = AgentRegistration(**reg(metadata=_metadata_of_size(METADATA_MAX_BYTES)))
    assert len(r.metadata["k"]) == METADATA_MAX_BYTES - 8


def test_metadata_over_limit_rejected() -> None:
    assert METADATA_MAX_BYTES == 16 * 1024
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(metadata=_metadata_of_size(METADATA_MAX_BYTES + 1)))
    loc, msg = single_error(exc)
    assert loc == ("metadata",)
    assert f"{METADATA_MAX_BYTES + 1} bytes" in msg and f"{METADATA_MAX_BYTES}-byte limit" in msg


def test_invalid_json_schema_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        Capability(**cap(input_schema={"type": "nonsense"}))
    loc, msg = single_error(exc)
    assert loc == ("input_schema",)
    assert "not a valid JSON Schema" in msg
    with pytest.raises(ValidationError) as exc2:
        Capability(**cap(output_schema={"type": "object", "properties": {"q": {"minLength": -1}}}))
    loc2, msg2 = single_error(exc2)
    assert loc2 == ("output_schema",)
    assert "not a valid JSON Schema" in msg2


def test_valid_json_schema_accepted() -> None:
    schema = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    assert Capability(**cap(input_schema=schema)).input_schema == schema


@pytest.mark.parametrize("agent_id", ["", "-leading-dash", "trailing-", "has space", "a/b", "x" * 254])
def test_bad_agent_id_rejected(agent_id: str) -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(agent_id=agent_id))
    loc, msg = single_error(exc)
    assert loc == ("agent_id",)
    assert "letters, digits" in msg


@pytest.mark.parametrize("endpoint", ["", "10.0.0.7:8080", "ftp://10.0.0.7", "http://", "http:// spaced"])
def test_bad_endpoint_rejected(endpoint: str) -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(endpoint=endpoint))
    loc, msg = single_error(exc)
    assert loc == ("endpoint",)
    assert "not an http(s) URL" in msg


def test_endpoint_trailing_slash_stripped() -> None:
    assert AgentRegistration(**reg(endpoint="https://agent.local:8443/")).endpoint == "https://agent.local:8443"


def test_unknown_fields_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        AgentRegistration(**reg(colour="blue"))
    loc, _ = single_error(exc)
    assert loc == ("colour",)


# ----------------------------------------------------------------- errors


def test_pool_exhausted_error_message_reports_counts() -> None:
    report = PoolReport(ref="rag.search@>=2,<3", matching=4, busy=3, draining=1, routable=0, waiting=2)
    err = PoolExhaustedError("rag.search@>=2,<3", waited_s=2.5, report=report, pool="prod")
    text = str(err)
    assert "'rag.search@>=2,<3'" in text
    assert "4 agent(s) match" in text
    assert "3 busy" in text
    assert "1 draining" in text
    assert "2.50s" in text
    assert "'prod'" in text
    assert (err.matching, err.busy, err.draining, err.waited_s) == (4, 3, 1, 2.5)


def test_pool_exhausted_error_without_report() -> None:
    err = PoolExhaustedError("code.exec", waited_s=0)
    assert "'code.exec'" in str(err) and "0 agent(s) match" in str(err) and "0.00s" in str(err)
