"""The routing table as data (model, files, errors naming the field), the Router's
answers that need no server, TaskInput by task type, and `agentroster route`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.contrib.pydantic import pydantic_data_converter

from agentroster import Router, RoutingTable, TaskInput, TaskRoute, UnknownTaskTypeError
from agentroster.errors import PoolExhaustedError, PoolReport
from agentroster.models import ROUTES_MAX, TaskResult
from agentroster.client.router import (
    RoutingTableError,
    format_routing_table,
    load_routing_table,
    parse_routing_table,
)
from agentroster.workers.cli import run_command

ROUTER_PAGE = Path(__file__).resolve().parent.parent / "docs" / "concepts" / "router.md"

TOML = """
[routes.summarize]
pool = "prod"
ref = "text.summarize@^2.1"

[routes.translate]
pool = "staging"
ref = " text.translate @ ~1.4 "
"""


class NoNetwork:
    """A client that fails the test if anything touches it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the router used its client ({name}) for an unknown task type")


def write(tmp_path: Path, text: str, name: str = "routes.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_table_file_loads_and_routes(tmp_path: Path) -> None:
    table = load_routing_table(write(tmp_path, TOML))
    assert table.task_types == ["summarize", "translate"] and table.pools == ["prod", "staging"]
    assert table.resolve("summarize") == TaskRoute(pool="prod", ref="text.summarize@^2.1")
    assert table.resolve("translate").ref == "text.translate@~1.4"  # spaces around the parts dropped
    as_json = write(tmp_path, json.dumps(table.model_dump(mode="json")), "routes.json")
    assert load_routing_table(as_json) == table
    assert format_routing_table(table).splitlines() == [
        "TASK TYPE  POOL     CAPABILITY REF",
        "summarize  prod     text.summarize@^2.1",
        "translate  staging  text.translate@~1.4",
    ]


def test_the_same_table_through_the_api() -> None:
    built = RoutingTable(routes={"summarize": TaskRoute(pool="prod", ref="text.summarize@^2.1")})
    from_dict = parse_routing_table({"routes": {"summarize": {"pool": "prod", "ref": "text.summarize@^2.1"}}})
    assert built == from_dict
    assert Router(NoNetwork(), built).route("summarize") == ("prod", "text.summarize@^2.1")  # type: ignore[arg-type]
    assert Router(NoNetwork(), {"routes": {"a.b": {"pool": "p", "ref": "x"}}}).route("a.b") == ("p", "x")  # type: ignore[arg-type]
    assert built.only("summarize") == built
    with pytest.raises(UnknownTaskTypeError):
        built.only("translate")


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        ('[routes.summarize]\npool = "a/b"\nref = "x"\n', "routes.summarize.pool", "pool 'a/b'"),
        ('[routes.summarize]\npool = "prod"\nref = "text.summarize@>>2"\n', "routes.summarize.ref", "not a version specifier"),
        ('[routes.summarize]\npool = "prod"\nref = "text summarize"\n', "routes.summarize.ref", "capability name"),
        ('[routes.summarize]\nref = "x"\n', "routes.summarize.pool", "Field required"),
        ('[routes.summarize]\npool = "prod"\n', "routes.summarize.ref", "Field required"),
        ('[routes.summarize]\npol = "prod"\npool = "prod"\nref = "x"\n', "routes.summarize.pol", "Extra inputs are not permitted"),
        ('[routes."two words"]\npool = "prod"\nref = "x"\n', "routes.two words (the task type)", "task type 'two words'"),
        ('[routes]\n', "routes", "at least one route"),
        ('[route.summarize]\npool = "prod"\nref = "x"\n', "unknown top-level key(s) ['route']", ""),
        ('pool = "prod"\n', "unknown top-level key(s) ['pool']", ""),
        ("", "routes: missing", ""),
        ("[routes.summarize\n", "not valid TOML", ""),
    ],
)
def test_a_bad_table_file_names_the_field(tmp_path: Path, text: str, field: str, reason: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(RoutingTableError) as caught:
        load_routing_table(path)
    message = str(caught.value)
    assert message.startswith(f"routing table {path}: "), message
    assert field in message and reason in message, message


def test_bad_json_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(RoutingTableError, match="not valid JSON"):
        load_routing_table(write(tmp_path, "{routes", "r.json"))
    with pytest.raises(RoutingTableError, match=r"routes\.x\.pool: pool ''"):
        load_routing_table(write(tmp_path, '{"routes": {"x": {"pool": "", "ref": "a"}}}', "r.json"))
    with pytest.raises(RoutingTableError, match="cannot read it"):
        load_routing_table(tmp_path / "missing.toml")
    with pytest.raises(RoutingTableError, match="cannot read it"):
        Router(NoNetwork(), tmp_path / "missing.toml")  # type: ignore[arg-type]
    with pytest.raises(RoutingTableError, match=r"routes\.s\.pool"):
        Router(NoNetwork(), {"routes": {"s": {"pool": "a/b", "ref": "x"}}})  # type: ignore[arg-type]


def test_routes_are_bounded() -> None:
    def table(n: int) -> RoutingTable:
        return RoutingTable.model_validate({"routes": {f"t{i}": {"pool": "p", "ref": "x"} for i in range(n)}})

    assert len(table(ROUTES_MAX).routes) == ROUTES_MAX
    with pytest.raises(ValidationError, match="routes"):
        table(ROUTES_MAX + 1)


async def test_an_unknown_task_type_raises_at_once_without_the_network() -> None:
    router = Router(NoNetwork(), {"routes": {"summarize": {"pool": "prod", "ref": "x"}, "translate": {"pool": "staging", "ref": "y"}}})  # type: ignore[arg-type]
    for call in (
        lambda: router.route("summarise"),
        lambda: router.borrow("summarise"),
        lambda: router.roster_for("summarise"),
        lambda: router.task_input("summarise", {}),
    ):
        with pytest.raises(UnknownTaskTypeError) as caught:
            call()
        assert caught.value.task_type == "summarise" and caught.value.known == ["summarize", "translate"]
        assert str(caught.value) == (
            "unknown task type 'summarise' (did you mean 'summarize'?): the routing table knows 'summarize', 'translate'"
        )
    with pytest.raises(UnknownTaskTypeError):
        await router.acquire("nope")
    with pytest.raises(UnknownTaskTypeError):
        await router.find("nope")
    with pytest.raises(UnknownTaskTypeError):
        async with router.borrow("nope"):
            pass


def test_unknown_task_type_lists_a_bounded_number_of_known_ones() -> None:
    error = UnknownTaskTypeError("zzz", [f"t{i:02}" for i in range(30)])
    assert "'t19'" in str(error) and "'t20'" not in str(error) and "and 10 more" in str(error)


def test_task_input_by_task_type() -> None:
    table = RoutingTable.model_validate({"routes": {"summarize": {"pool": "prod", "ref": "text.summarize@^2"}}})
    task = TaskInput(task_type="summarize", routing_table=table, payload={"text": "x"}, pool="ignored")
    routed = task.routed()
    assert (routed.ref, routed.pool, routed.task_type, routed.routing_table) == ("text.summarize@^2", "prod", None, None)
    assert routed.payload == {"text": "x"}
    by_ref = TaskInput(ref="rag.search")
    assert by_ref.routed() is by_ref
    # The table's answer is the workflow's to give: an unknown type still makes a valid input.
    with pytest.raises(UnknownTaskTypeError):
        TaskInput(task_type="translate", routing_table=table).routed()
    with pytest.raises(ValidationError, match="give a capability `ref`"):
        TaskInput()
    with pytest.raises(ValidationError, match="not both"):
        TaskInput(ref="rag.search", task_type="summarize", routing_table=table)
    with pytest.raises(ValidationError, match="needs a `routing_table`"):
        TaskInput(task_type="summarize")
    with pytest.raises(ValidationError, match="task_type"):
        TaskInput(task_type="two words", routing_table=table)


def test_task_input_and_result_cross_the_data_converter() -> None:
    converter = pydantic_data_converter.payload_converter
    table = RoutingTable.model_validate({"routes": {"summarize": {"pool": "prod", "ref": "text.summarize@^2"}}})
    task = TaskInput(task_type="summarize", routing_table=table, payload={"text": "x"})
    [payload] = converter.to_payloads([task])
    assert converter.from_payloads([payload], [TaskInput]) == [task]
    # What workflows started before task types existed carry still decodes.
    [old] = converter.to_payloads([{"ref": "rag.search", "payload": {}, "pool": "default"}])
    assert converter.from_payloads([old], [TaskInput])[0].ref == "rag.search"
    [old_result] = converter.to_payloads([{"ref": "r", "agent_id": "a", "capability": "c", "version": "1.0.0"}])
    assert converter.from_payloads([old_result], [TaskResult])[0].pool is None


def test_pool_exhausted_reports_hikari_style_figures() -> None:
    report = PoolReport(ref="sat.work", matching=5, busy=5, routable=0, waiting=40, total_agents=5, active_leases=10, slots=10, idle_slots=0)
    error = PoolExhaustedError("sat.work", waited_s=0.5, report=report, pool="prod")
    assert (error.total_slots, error.active_slots, error.idle_slots, error.waiting) == (10, 10, 0, 40)
    assert "(slots for it: total=10, active=10, idle=0, waiting=40)" in str(error)


def test_route_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, TOML)
    assert run_command(["route", "show", "--table", str(path)]) == 0
    assert "summarize  prod     text.summarize@^2.1" in capsys.readouterr().out
    assert run_command(["route", "show", "--json", "--table", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["routes"]["translate"] == {"pool": "staging", "ref": "text.translate@~1.4"}
    assert run_command(["route", "resolve", "translate", "--table", str(path)]) == 0
    assert capsys.readouterr().out.strip() == "translate -> pool staging, text.translate@~1.4"
    assert run_command(["route", "resolve", "summarise", "--table", str(path)]) == 1
    assert "unknown task type 'summarise' (did you mean 'summarize'?)" in capsys.readouterr().err
    bad = write(tmp_path, '[routes.summarize]\npool = "a/b"\nref = "x"\n', "bad.toml")
    assert run_command(["route", "show", "--table", str(bad)]) == 1
    assert "routes.summarize.pool: pool 'a/b'" in capsys.readouterr().err


def test_route_table_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AGENTROSTER_ROUTES", str(write(tmp_path, TOML)))
    assert run_command(["route", "resolve", "summarize"]) == 0
    assert "pool prod" in capsys.readouterr().out


def test_the_documented_table_example_is_a_valid_table(tmp_path: Path) -> None:
    text = ROUTER_PAGE.read_text()
    match = re.search(r"<!-- snippet: routing-table -->\s*```toml\n(.*?)```", text, re.S)
    assert match, "docs/concepts/router.md has no routing-table snippet"
    table = load_routing_table(write(tmp_path, match.group(1)))
    assert "summarize" in table.task_types and len(table.pools) >= 2
