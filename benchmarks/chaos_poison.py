"""Malformed and hostile messages for the reliability harness, sent raw through a plain
`temporalio.client.Client` (the default data converter, not agentroster's client) to
every signal and update of the pool, agent and task workflows.

Generic kinds (every message): no argument, two arguments, null, a string, a number,
a bool, NaN, +/-infinity, a list, empty object/list, a payload over the 512 KiB
message limit, a protobuf, raw bytes, a payload in an unknown encoding, invalid JSON,
JSON nested 5,000 deep, a lone surrogate, a 400-digit integer, a list of 100,000 ids.
Per-message kinds: a valid-looking message with one field wrong (wrong type, name
with a trailing newline, 1e12 intervals, negative or NaN numbers, over-long strings,
too many items, ...).

Messages that the workflow would rightly apply (a bare `drain`, a valid registration
of the same agent, a valid acquire, ...) are never sent: they are not malformed and
would change the system under test. Unknown-but-well-formed ids are sent (answered,
not refused).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from temporalio.api.common.v1 import Payload, WorkflowExecution
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import RawValue
from temporalio.service import RPCError

from agentroster.messages import AcquireBatch, AgentSnapshot, DrainRequest, LoadNotice, RenewRequest
from agentroster.models import AgentRegistration

HUGE = "x" * (600 * 1024)  # over the 512 KiB message limit, under the server's 2 MiB


def _raw(encoding: bytes, data: bytes) -> RawValue:
    return RawValue(Payload(metadata={"encoding": encoding}, data=data))


def generic_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    """What a careless or hostile sender passes to any message. `variant` changes the values."""
    rnd = random.Random(variant)
    word = f"garbage-{rnd.randrange(10**6)}"
    return [
        ("no argument", []),
        ("two arguments", [{"a": variant}, {"b": word}]),
        ("null", [None]),
        ("a string", [word]),
        ("a number", [rnd.randrange(-(10**9), 10**9)]),
        ("a bool", [bool(variant % 2)]),
        ("NaN", [math.nan]),
        ("infinity", [{"in_flight": 1, "saturated": True, "seq": math.inf, "ttl_s": math.inf}]),
        ("-infinity", [-math.inf]),
        ("a list", [[1, 2, variant]]),
        ("an empty object", [{}]),
        ("an empty list", [[]]),
        ("a protobuf", [WorkflowExecution(workflow_id=f"proto-{variant}")]),
        ("raw bytes", [bytes([0, 255, 254, variant % 256])]),
        ("unknown encoding", [_raw(b"binary/evil", b"\x00\x01" * 8)]),
        ("invalid JSON", [_raw(b"json/plain", b'{"not": json' + str(variant).encode())]),
        ("JSON nested 5,000 deep", [_raw(b"json/plain", b"[" * 5000 + b"]" * 5000)]),
        ("a lone surrogate", [f"x\ud800{variant}"]),
        ("a 400-digit integer", [10**400 + variant]),
        ("100,000 ids", [[f"id-{i}" for i in range(100_000)]]),
    ]


HUGE_KIND = ("over 512 KiB", [{"blob": HUGE}])


def _mutations(base: dict[str, Any], changes: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, list[Any]]]:
    return [(what, [{**base, **change}]) for what, change in changes]


def acquire_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    base = {"ref": "chaos.hold", "lease_ttl_s": 60, "wait_s": 0, "request_id": f"{variant:032x}"}
    return _mutations(base, [
        ("ref of the wrong type", {"ref": 5}),
        ("ref with a trailing newline", {"ref": "chaos.hold\n"}),
        ("range with a trailing newline", {"ref": "chaos.hold@>=1\n"}),
        ("unparsable range", {"ref": "chaos.hold@>=1,<"}),
        ("over-long ref", {"ref": "chaos." + "x" * 10_000}),
        ("TTL of 1e12 s", {"lease_ttl_s": 1e12}),
        ("negative TTL", {"lease_ttl_s": -1}),
        ("TTL as a string", {"lease_ttl_s": "sixty"}),
        ("wait of 1e12 s", {"wait_s": 1e12}),
        ("short request id", {"request_id": "short"}),
        ("request id of the wrong type", {"request_id": 1e12}),
        ("holder of the wrong type", {"holder": 5}),
        ("over-long holder", {"holder": "h" * 10_000}),
        ("exclude_agents not a list", {"exclude_agents": "everyone"}),
        ("1,000 exclude_agents", {"exclude_agents": [f"a{i}" for i in range(1000)]}),
        ("unknown field", {"admin": True}),
    ])


def renew_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    base = {"lease_id": f"{variant:032x}", "ttl_s": 60}
    return _mutations(base, [
        ("lease id of the wrong type", {"lease_id": 5}),
        ("TTL of 1e12 s", {"ttl_s": 1e12}),
        ("negative TTL", {"ttl_s": -5}),
        ("zero TTL", {"ttl_s": 0}),
        ("over-long lease id", {"lease_id": "l" * 1000}),
        ("unknown field", {"steal": True}),
    ])


def release_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    return [
        ("lease id of the wrong type", [{"lease_id": 5}]),
        ("numbers for ids", [[5, 6, variant]]),
        ("257 ids in one batch", [[f"{i:032x}" for i in range(257)]]),
        ("an empty id", [""]),
        ("an over-long id", ["l" * 1000]),
        ("object without an id", [{"nope": variant}]),
    ]


def release_leases_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    return [
        *release_kinds(variant),
        ("one id, not a list", [f"{variant:032x}"]),
        ("an empty list", [[]]),
        ("null in the list", [[None]]),
        ("an over-long id in the list", [["l" * 129]]),
    ]


def acquire_batch_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    """The `acquire` update's argument: requests (each one of `acquire_kinds`) and releases riding along."""
    ids = [f"{variant:032x}"]
    good = {"ref": "chaos.hold", "wait_s": 0, "request_id": f"{variant:032x}"}
    return [
        *[(f"requests: {what}", [{"releases": ids, "requests": args}]) for what, args in acquire_kinds(variant)],
        *[(f"releases: {what}", [{"releases": args[0], "requests": [good]}])
          for what, args in release_leases_kinds(variant) if what != "an empty list"],
        ("no requests", [{"releases": ids, "requests": []}]),
        ("requests missing", [{"releases": ids}]),
        ("an extra key", [{"releases": ids, "requests": [good], "steal": True}]),
    ]


def ticket_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    return [
        ("an empty ticket", [""]),
        ("an over-long ticket", ["t" * 129]),
        ("a ticket in a list", [[f"{variant:032x}"]]),
        ("a ticket in an object", [{"ticket": f"{variant:032x}"}]),
        ("an unknown ticket with a newline", [f"{variant:031x}\n"]),
    ]


def snapshot_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    cap = {"name": "chaos.hold", "version": "1.0.0", "max_concurrency": 1, "cost_class": "A"}
    base = {"agent_id": f"ghost-{variant}", "deployment": "ghost", "endpoint": "http://127.0.0.1:1", "state": "Ready",
            "capabilities": [cap], "resync_interval_s": 30}
    return _mutations(base, [
        ("resync interval of 1e12 s", {"resync_interval_s": 1e12}),
        ("negative resync interval", {"resync_interval_s": -1}),
        ("max_concurrency 1e12", {"capabilities": [{**cap, "max_concurrency": 10**12}]}),
        ("max_concurrency 0", {"capabilities": [{**cap, "max_concurrency": 0}]}),
        ("max_concurrency as a string", {"capabilities": [{**cap, "max_concurrency": "2"}]}),
        ("capability with a trailing newline", {"capabilities": [{**cap, "name": "chaos.hold\n"}]}),
        ("version with a trailing newline", {"capabilities": [{**cap, "version": "1.0.0\n"}]}),
        ("agent id with a trailing newline", {"agent_id": f"ghost-{variant}\n"}),
        ("unknown state", {"state": "Exploded"}),
        ("not a URL", {"endpoint": "javascript:alert(1)"}),
        ("10,000 capabilities", {"capabilities": [{**cap, "name": f"c{i}.x"} for i in range(10_000)]}),
        ("cost class Z", {"capabilities": [{**cap, "cost_class": "Z"}]}),
    ])


def registration_kinds(agent_id: str, endpoint: str, variant: int) -> list[tuple[str, list[Any]]]:
    cap = {"name": "chaos.hold", "version": "1.0.0", "max_concurrency": 2, "cost_class": "A",
           "input_schema": {"type": "object"}, "output_schema": {}}
    base = {"agent_id": agent_id, "deployment": "chaos-agent", "endpoint": endpoint, "heartbeat_interval_s": 10,
            "capabilities": [cap]}
    return _mutations(base, [
        ("heartbeat interval of 1e12 s", {"heartbeat_interval_s": 1e12}),
        ("heartbeat interval of 0.2 s", {"heartbeat_interval_s": 0.2}),
        ("negative heartbeat interval", {"heartbeat_interval_s": -10}),
        ("capability with a trailing newline", {"capabilities": [{**cap, "name": "chaos.hold\n"}]}),
        ("version with a trailing newline", {"capabilities": [{**cap, "version": "1.0.0\n"}]}),
        ("deployment with a trailing newline", {"deployment": "chaos-agent\n"}),
        ("agent id with a trailing newline", {"agent_id": agent_id + "\n"}),
        ("another agent's id", {"agent_id": f"impostor-{variant}"}),
        ("max_concurrency 1e12", {"capabilities": [{**cap, "max_concurrency": 10**12}]}),
        ("negative max_concurrency", {"capabilities": [{**cap, "max_concurrency": -1}]}),
        ("not a URL", {"endpoint": "ftp://nowhere"}),
        ("schema that is not a schema", {"capabilities": [{**cap, "input_schema": {"type": 5}}]}),
        ("metadata over the limit", {"metadata": {"blob": "m" * 100_000}}),
        ("no capabilities", {"capabilities": []}),
        ("cost class Z", {"capabilities": [{**cap, "cost_class": "Z"}]}),
    ])


def notice_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    base = {"in_flight": 1, "saturated": False, "seq": 1 + variant}
    return _mutations(base, [
        ("negative in_flight", {"in_flight": -1}),
        ("in_flight beyond the agent's capacity", {"in_flight": 999, "saturated": True}),
        ("seq 2**52 ahead", {"seq": 2**52}),
        ("in_flight as a float", {"in_flight": 1.5}),
        ("saturated as a string", {"saturated": "yes"}),
        ("epoch of the wrong type", {"epoch": 5}),
    ])


def drain_kinds(variant: int) -> list[tuple[str, list[Any]]]:
    return [
        ("deadline of 1e12 s", [{"deadline_s": 1e12}]),
        ("negative deadline", [{"deadline_s": -1}]),
        ("reason of the wrong type", [{"reason": variant}]),
        ("over-long reason", [{"reason": "r" * 100_000}]),
        ("unknown field", [{"force": True}]),
    ]


def task_kinds(endpoint: str, variant: int) -> list[tuple[str, list[Any]]]:
    lease = {"lease_id": f"{variant:032x}", "pool": "chaos", "agent_id": "chaos-agent-0", "deployment": "chaos-agent",
             "capability": "chaos.hold", "version": "1.0.0", "endpoint": "http://attacker.invalid:1",
             "granted_at": "2026-01-01T00:00:00Z", "deadline": "2030-01-01T00:00:00Z"}
    return [
        ("a grant for a ticket it never had", [{"ticket": "0" * 32, "lease": lease}]),
        ("a grant with a lease of the wrong type", [{"ticket": "0" * 32, "lease": "all of them"}]),
        ("a revocation of a lease it does not hold", [{"lease_id": "f" * 32, "agent_id": "chaos-agent-0", "reason": "forged"}]),
        ("a revocation with the wrong types", [{"lease_id": 5, "agent_id": None, "reason": []}]),
    ]


@dataclass
class Target:
    """A workflow and its messages: name -> (signal?, specific kinds, legit(args) -> would be applied)."""

    label: str
    workflow_id: str
    messages: dict[str, tuple[bool, Callable[[int], list[tuple[str, list[Any]]]], Callable[[list[Any]], bool]]]


def _valid(model: Any, args: list[Any]) -> bool:
    if len(args) != 1 or isinstance(args[0], RawValue):
        return False
    try:
        model.model_validate(args[0])
        return True
    except (ValidationError, TypeError, ValueError):
        return False


def _valid_list(model: Any, args: list[Any]) -> bool:
    return len(args) == 1 and isinstance(args[0], list) and 1 <= len(args[0]) <= 256 and all(_valid(model, [a]) for a in args[0])


def _never(args: list[Any]) -> bool:
    return False


def pool_target(pool: str) -> Target:
    return Target("pool", f"pool/{pool}", {
        "agent_snapshots": (True, lambda v: [(w, [args]) for w, args in snapshot_kinds(v)], lambda a: _valid_list(AgentSnapshot, a)),
        "acquire": (False, acquire_batch_kinds, lambda a: _valid(AcquireBatch, a)),
        "release": (False, release_leases_kinds, _never),
        "cancel": (False, lambda v: [(w, [args]) for w, args in ticket_kinds(v)], _never),
        "renew": (False, lambda v: [(w, [args]) for w, args in renew_kinds(v)], lambda a: _valid_list(RenewRequest, a)),
    })


def agent_target(pool: str, agent_id: str, endpoint: str) -> Target:
    def legit_register(args: list[Any]) -> bool:
        return _valid(AgentRegistration, args) and args[0].get("agent_id") == agent_id

    def legit_drain(args: list[Any]) -> bool:
        return args in ([], [None]) or _valid(DrainRequest, args)

    def legit_notice(args: list[Any]) -> bool:
        return _valid(LoadNotice, args) and args[0]["in_flight"] <= 2 and args[0]["seq"] < 1000

    return Target("agent", f"agent/{pool}/{agent_id}", {
        "register": (True, lambda v: registration_kinds(agent_id, endpoint, v), legit_register),
        "heartbeat": (True, lambda v: [], _never),  # any argument is ignored: a heartbeat is its arrival
        "acquire": (True, notice_kinds, legit_notice),
        "release": (True, notice_kinds, legit_notice),
        "drain": (True, drain_kinds, legit_drain),
        "wait_routable": (False, lambda v: [], lambda a: a == []),
    })


def task_target(workflow_id: str, endpoint: str) -> Target:
    return Target("task", workflow_id, {
        "lease_revoked": (True, lambda v: task_kinds(endpoint, v), lambda a: False),
    })


@dataclass
class PoisonReport:
    sent: int = 0
    server_refused: int = 0  # RPC error: the server would not take the payload (never the workflow)
    update_rejected: int = 0  # an update's validator (or the SDK's decoding) refused it
    update_answered: int = 0  # an update took a well-formed but unknown id and answered
    signals_delivered: int = 0  # in history; the workflow refuses them in its handler (`refusals` query)
    unexpected: list[str] = field(default_factory=list)
    by_target: dict[str, int] = field(default_factory=dict)

    @property
    def refused(self) -> int:
        return self.server_refused + self.update_rejected


def plan(targets: list[Target], rounds: int) -> list[tuple[Target, str, bool, str, list[Any]]]:
    """Every (target, message, kind) for `rounds` rounds; the over-512-KiB payload once per message."""
    out: list[tuple[Target, str, bool, str, list[Any]]] = []
    for variant in range(rounds):
        for target in targets:
            for name, (is_signal, specific, legit) in target.messages.items():
                kinds = generic_kinds(variant) + specific(variant) + ([HUGE_KIND] if variant == 0 else [])
                for what, args in kinds:
                    if not legit(args):
                        out.append((target, name, is_signal, what, args))
    return out


async def send_all(client: Client, messages: list[tuple[Target, str, bool, str, list[Any]]], *, concurrency: int = 8) -> PoisonReport:
    """Send every message raw; count how each was answered. Never raises for a refusal."""
    report = PoisonReport()
    gate = asyncio.Semaphore(concurrency)
    order = list(messages)
    random.Random(7).shuffle(order)

    async def one(target: Target, name: str, is_signal: bool, what: str, args: list[Any]) -> None:
        handle = client.get_workflow_handle(target.workflow_id)
        async with gate:
            report.sent += 1
            report.by_target[target.label] = report.by_target.get(target.label, 0) + 1
            try:
                if is_signal:
                    await handle.signal(name, args=args)
                    report.signals_delivered += 1
                else:
                    await asyncio.wait_for(handle.execute_update(name, args=args), timeout=30)
                    report.update_answered += 1
            except WorkflowUpdateFailedError:
                report.update_rejected += 1
            except RPCError:
                report.server_refused += 1
            except Exception as exc:  # the client itself could not encode it (e.g. NaN where JSON forbids it)
                report.unexpected.append(f"{target.label}.{name} ({what}): {type(exc).__name__}: {exc}"[:300])

    await asyncio.gather(*(one(*m) for m in order))
    return report
