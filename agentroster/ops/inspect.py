"""`agentroster describe | agents | replay`: reading the fleet.

    agentroster describe math-agent-x          # state, load and the transitions its workflow recorded
    agentroster describe math-agent-x --json
    agentroster agents --state Ready --capability rag.search [--deployment search-agent] [--json]
    agentroster replay history.json            # or a workflow id: agent/default/math-agent-x [--run-id R]

`describe` is `AgentRoster.describe`: a running agent answers its workflow's `status`
query (a worker runs it), an ended one is read from its run's result (no worker
needed, within the namespace's retention). `agents` reads visibility only. `replay`
needs no server for a file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agentroster.models import AgentState, CapabilityRef, check_semver
from agentroster.vocabulary.wire import agent_workflow_id

STATES = [s.value for s in AgentState]
# How long `describe` waits for an answer (AgentRoster.describe asks again for up to 30 s while a worker refuses).
DESCRIBE_WAIT_S = 45.0


def add_inspect_parsers(sub: Any, common: Any, settings: Any) -> None:
    """`describe`, `agents` and `replay`, on the CLI's subparsers."""
    describe = sub.add_parser(
        "describe",
        help="an agent's state, load and the transitions its workflow recorded (with their reasons), running or ended",
    )
    common(describe, settings)
    describe.add_argument("agent_id")
    describe.add_argument("--json", action="store_true", help="print the agent's status as JSON")

    agents = sub.add_parser("agents", help="list agents by visibility query (state, capability, deployment)")
    common(agents, settings)
    agents.add_argument("--state", choices=STATES, help="only agents in this state")
    agents.add_argument(
        "--capability",
        help="name (any version), name@version, or name@range (e.g. rag.search, rag.search@2.1.0, 'rag.search@>=2,<3')",
    )
    agents.add_argument("--deployment", help="only this deployment's agents")
    agents.add_argument("--ended", action="store_true", help="include agents whose workflow has closed (within retention)")
    agents.add_argument("--limit", type=int, default=1000, help="at most this many (default %(default)s)")
    agents.add_argument("--json", action="store_true", help="print JSON")

    replay = sub.add_parser(
        "replay",
        help="replay a recorded history (a JSON file or a workflow id) against this code; exit 1 on divergence",
    )
    replay.add_argument("source", help="a history file (temporal workflow show -o json, the UI's download) or a workflow id")
    replay.add_argument("--run-id", help="with a workflow id: this run (default: the latest)")
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    replay.add_argument("--address", default=settings.address, help="Temporal frontend, for a workflow id (TEMPORAL_ADDRESS)")
    replay.add_argument("--namespace", default=settings.namespace, help="Temporal namespace (TEMPORAL_NAMESPACE)")


INSPECT_COMMANDS = ("describe", "agents", "replay")


async def run_inspect(args: argparse.Namespace) -> int:
    if args.command == "describe":
        return await run_describe(args)
    if args.command == "agents":
        return await run_agents(args)
    return await run_replay(args)


async def _roster(args: argparse.Namespace) -> Any:
    from agentroster.ops.session import connect_roster

    return await connect_roster(args)


async def _client(args: argparse.Namespace) -> Any:
    return (await _roster(args)).client


# ------------------------------------------------------------------ describe
async def run_describe(args: argparse.Namespace) -> int:
    from agentroster.errors import AgentNotFoundError
    from agentroster.ops.timeline import format_status

    roster = await _roster(args)
    try:
        status = await asyncio.wait_for(roster.describe(args.agent_id), DESCRIBE_WAIT_S)
    except AgentNotFoundError as exc:
        print(f"agentroster describe: {exc}", file=sys.stderr)
        return 1
    except asyncio.TimeoutError:
        print(
            f"agentroster describe: agent {args.agent_id} did not answer in {DESCRIBE_WAIT_S:g}s "
            "(a running agent, or a run terminated by hand, is answered by a worker: is one running?)",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(status.model_dump_json(indent=2))
    else:
        print(format_status(status, datetime.now(timezone.utc)))
    return 0


# ------------------------------------------------------------------ agents
@dataclass
class AgentsQuery:
    """A visibility query for agent workflows, and what visibility cannot filter (a version range)."""

    query: str
    ref: CapabilityRef | None = None  # filter `name@version` values by its range, client side


def agents_query(
    pool: str, *, state: str | None = None, capability: str | None = None, deployment: str | None = None, ended: bool = False
) -> AgentsQuery:
    """`WorkflowType="AgentWorkflow" AND AgentPool="..." AND ...`; raises ValueError for a bad capability or state."""
    parts = ['WorkflowType="AgentWorkflow"', f"AgentPool={_quoted(pool)}"]
    if state is not None:
        parts.append(f"AgentState={_quoted(AgentState(state).value)}")
    if deployment:
        parts.append(f"AgentDeployment={_quoted(deployment)}")
    ref: CapabilityRef | None = None
    if capability:
        name, at, spec = capability.strip().partition("@")
        spec = spec.strip()
        if at and _is_version(spec):
            CapabilityRef.parse(name)  # the name's rules
            parts.append(f"AgentCapabilities={_quoted(f'{name.strip()}@{spec}')}")
        else:
            parsed = CapabilityRef.parse(capability)
            parts.append(f"AgentCapabilities={_quoted(parsed.name)}")  # bare names are indexed too
            ref = parsed if parsed.specifier else None
    if not ended and state != AgentState.TERMINATED.value:
        parts.append('ExecutionStatus="Running"')
    return AgentsQuery(query=" AND ".join(parts), ref=ref)


def _is_version(text: str) -> bool:
    try:
        check_semver(text)
    except ValueError:
        return False
    return True


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class AgentListing:
    agent_id: str
    deployment: str
    state: str
    capabilities: list[str]
    status: str
    started: datetime | None
    closed: datetime | None
    end_reason: str | None
    workflow_id: str
    run_id: str

    def to_json(self) -> dict[str, Any]:
        data = dict(vars(self))
        data["started"] = self.started.isoformat() if self.started else None
        data["closed"] = self.closed.isoformat() if self.closed else None
        return data


def listing_from_execution(execution: Any, pool: str) -> AgentListing:
    from agentroster.vocabulary.wire import (
        AGENT_CAPABILITIES,
        AGENT_DEPLOYMENT,
        AGENT_END_REASON,
        AGENT_STATE,
    )

    attrs = execution.typed_search_attributes
    prefix = agent_workflow_id(pool, "")
    values = attrs.get(AGENT_CAPABILITIES) or []
    return AgentListing(
        agent_id=execution.id.removeprefix(prefix),
        deployment=attrs.get(AGENT_DEPLOYMENT) or "-",
        state=attrs.get(AGENT_STATE) or "-",
        capabilities=[v for v in values if "@" in v],  # `name@version`; the bare names are for filtering
        status=execution.status.name.capitalize() if execution.status is not None else "-",
        started=execution.start_time,
        closed=execution.close_time,
        end_reason=attrs.get(AGENT_END_REASON),
        workflow_id=execution.id,
        run_id=execution.run_id,
    )


def keep_listing(listing: AgentListing, ref: CapabilityRef | None) -> bool:
    if ref is None:
        return True
    for value in listing.capabilities:
        name, _, version = value.partition("@")
        if name == ref.name and _is_version(version) and ref.matches(version):
            return True
    return False


def format_agents(listings: list[AgentListing], now: datetime) -> str:
    header = ["AGENT", "DEPLOYMENT", "STATE", "CAPABILITIES", "WORKFLOW", "SINCE", "END REASON"]
    rows = [
        [
            a.agent_id,
            a.deployment,
            a.state,
            ",".join(a.capabilities) or "-",
            a.status,
            _since(a.closed or a.started, now),
            a.end_reason or "-",
        ]
        for a in listings
    ]
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def _since(moment: datetime | None, now: datetime) -> str:
    from agentroster.ops.timeline import ago

    return f"{ago((now - moment).total_seconds())} ago" if moment else "-"


async def run_agents(args: argparse.Namespace) -> int:
    try:
        query = agents_query(args.pool, state=args.state, capability=args.capability, deployment=args.deployment, ended=args.ended)
    except ValueError as exc:
        print(f"agentroster agents: {exc}", file=sys.stderr)
        return 2
    client = await _client(args)
    listings: list[AgentListing] = []
    async for execution in client.list_workflows(query.query, limit=args.limit if query.ref is None else None):
        listing = listing_from_execution(execution, args.pool)
        if keep_listing(listing, query.ref):
            listings.append(listing)
        if len(listings) >= args.limit:
            break
    listings.sort(key=lambda a: (a.agent_id, a.started or datetime.min.replace(tzinfo=timezone.utc)))
    if args.json:
        print(json.dumps({"query": query.query, "agents": [a.to_json() for a in listings]}, indent=2))
    else:
        print(format_agents(listings, datetime.now(timezone.utc)) if listings else f"no agents match: {query.query}")
    return 0


# ------------------------------------------------------------------ replay
async def run_replay(args: argparse.Namespace) -> int:
    from agentroster.ops.replay import (
        RESET_ADVICE,
        HistoryFileError,
        format_report,
        load_history_file,
        replay_history,
        reset_command,
    )

    source = args.source
    from_file = Path(source).is_file()
    run_id: str | None = None
    if from_file:
        try:
            history = load_history_file(source)
        except HistoryFileError as exc:
            print(f"agentroster replay: {exc}", file=sys.stderr)
            return 2
        label = source
    else:
        from temporalio.service import RPCError

        from agentroster.client.transport import is_not_found

        if source.endswith(".json"):
            print(f"agentroster replay: no such file: {source}", file=sys.stderr)
            return 2
        client = await _client(args)
        try:
            run_id = args.run_id or (await client.get_workflow_handle(source).describe()).run_id
            history = await client.get_workflow_handle(source, run_id=run_id).fetch_history()
        except RPCError as exc:
            if not is_not_found(exc):
                raise
            print(f"agentroster replay: no workflow {source!r}" + (f" run {args.run_id}" if args.run_id else "") + " on the server (and no such file)", file=sys.stderr)
            return 2
        started = history.events[0].workflow_execution_started_event_attributes if history.events else None
        label = f"{source} (run {args.run_id or 'latest'}" + (f", continued from {started.continued_execution_run_id}" if started and started.continued_execution_run_id else "") + ")"
    report = await replay_history(history)
    # A run on the server can be unstuck by a reset to the workflow task that diverged; a file may be long gone.
    command = reset_command(report, run_id) if not from_file and run_id else None
    if args.json:
        print(json.dumps({"source": label, **report.to_json(), "reset_command": command}, indent=2))
    else:
        print(format_report(report, label))
        if command:
            print(RESET_ADVICE.format(command=command, task=report.task_event_id))
    return 0 if report.ok else 1


__all__ = ["INSPECT_COMMANDS", "add_inspect_parsers", "agents_query", "keep_listing", "run_inspect"]
