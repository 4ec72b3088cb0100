"""The `agentroster` command line: worker, status, agents, describe, drain, policy, evictions, route, replay, shutdown, dev, mcp, a2a.

Settings come from the environment (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE,
AGENTROSTER_POOL, AGENTROSTER_TASK_QUEUE, AGENTROSTER_BACKEND) and can be
overridden by flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import json
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel

from agentroster.ops.session import closing, connect_roster
from agentroster.errors import AgentNotFoundError, AgentRosterError, PoolShutdownError
from agentroster.messages import ShutdownRequest
from agentroster.models import EvictionStatus, OutlierPolicy, PoolPolicy
from agentroster.client.settings import BACKENDS, Settings
from agentroster.ops.status_table import format_shutdown, format_status_table, status_rows
from agentroster.workers.route_cli import add_route_parser, run_route
from agentroster.ops.inspect import INSPECT_COMMANDS, add_inspect_parsers, run_inspect
from agentroster.workers.a2a_cli import add_a2a_parser, join_fleet_a2a, run_a2a


# PoolPolicy's fields that are settings of their own: `policy set` takes one flag per field of them.
NESTED_POLICY_FIELDS: dict[str, type[BaseModel]] = {"outliers": OutlierPolicy}


def _common(parser: argparse.ArgumentParser, settings: Settings) -> None:
    parser.add_argument("--address", default=settings.address, help="Temporal frontend (TEMPORAL_ADDRESS)")
    parser.add_argument("--namespace", default=settings.namespace, help="Temporal namespace (TEMPORAL_NAMESPACE)")
    parser.add_argument("--pool", default=settings.pool, help="pool name (AGENTROSTER_POOL)")
    parser.add_argument("--task-queue", default=settings.task_queue, help="task queue (AGENTROSTER_TASK_QUEUE)")


def build_parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    settings = settings or Settings.from_env()
    parser = argparse.ArgumentParser(prog="agentroster", description="A durable agent pool manager on Temporal.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="run the worker (workflows and activities)")
    _common(worker, settings)
    worker.add_argument(
        "--backend",
        default=settings.backend,
        choices=list(BACKENDS),
        help="where agents run (AGENTROSTER_BACKEND)",
    )
    worker.add_argument("--fleet", default=settings.fleet, help="fleet file for the local backend (AGENTROSTER_FLEET)")
    worker.add_argument("--policies", default=os.environ.get("AGENTROSTER_POLICIES"), help="deployments' policies to apply at start (AGENTROSTER_POLICIES)")
    worker.add_argument("--restart-pool", action="store_true", help="start the pool again if it was shut down (else it stays down)")
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=settings.metrics_port,
        help="serve Prometheus metrics on this port's /metrics (AGENTROSTER_METRICS_PORT; `on` there means 9464; default off)",
    )

    status = sub.add_parser("status", help="a table of the pool's agents, and those that recently ended")
    _common(status, settings)
    status.add_argument(
        "--ended-within", type=float, default=3600.0, metavar="SECONDS", help="show agents that ended this recently (0: none)"
    )

    drain = sub.add_parser("drain", help="drain an agent and wait until it is Terminated")
    _common(drain, settings)
    drain.add_argument("agent_id")
    drain.add_argument("--reason", default="operator")
    drain.add_argument("--deadline", type=float, default=300.0, help="seconds before in-flight tasks are abandoned")
    drain.add_argument("--no-wait", action="store_true")

    shutdown = sub.add_parser(
        "shutdown", help="shut the pool down: stop granting, let leases finish, drain every agent, scale to zero, end"
    )
    _common(shutdown, settings)
    shutdown.add_argument("--deadline", type=float, default=60.0, help="seconds leases in flight may still run; then they are revoked")
    shutdown.add_argument("--reason", default="agentroster shutdown", help="why, shown to callers and in status")
    shutdown.add_argument("--no-wait", action="store_true", help="return once the shutdown began")

    policy = sub.add_parser("policy", help="show or set deployments' policies: sizing (with --max-replicas), health checks, outlier ejection")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    show = policy_sub.add_parser("show", help="every deployment's policy")
    _common(show, settings)
    setp = policy_sub.add_parser("set", help="set one deployment's policy (fields not given keep their defaults; without --max-replicas it sizes nothing)")
    _common(setp, settings)
    setp.add_argument("deployment")
    setp.add_argument("--file", help="a JSON or TOML file with the policy's fields")
    for name, field in PoolPolicy.model_fields.items():
        if name in NESTED_POLICY_FIELDS:  # one flag per field of the nested settings: --outliers-consecutive-failures
            for key, subfield in NESTED_POLICY_FIELDS[name].model_fields.items():
                flag = f"--{name}-{key}".replace("_", "-")
                setp.add_argument(flag, dest=f"{name}.{key}", metavar=key.upper(), default=None, help=f"{field.description}: {subfield.description or key}")
            continue
        setp.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=field.description or None)
    setp.add_argument("--remove", action="store_true", help="remove the policy (back to the defaults and demand-driven scale-ups)")
    up = policy_sub.add_parser("scale-up", help="ask for more agents of a deployment now (within its policy; kept in the pool's history)")
    _common(up, settings)
    up.add_argument("deployment")
    up.add_argument("--add", type=int, default=1, help="how many more agents (default 1)")
    up.add_argument("--reason", default=None, help="why, kept with the ask in the pool's history")

    evictions = sub.add_parser("evictions", help="eviction safety: show, confirm silent agents are gone, set the policy")
    evictions_sub = evictions.add_subparsers(dest="evictions_command", required=True)
    eshow = evictions_sub.add_parser("show", help="self-preservation, held (silent) agents, counters")
    _common(eshow, settings)
    confirm = evictions_sub.add_parser("confirm", help="confirm that silent agents are gone: they are terminated, pods deleted")
    _common(confirm, settings)
    confirm.add_argument("agent_ids", nargs="*", metavar="AGENT_ID", help="the silent agents to let go")
    confirm.add_argument("--all", action="store_true", help="every silent agent")
    eset = evictions_sub.add_parser("set", help="change the pool's eviction policy (fields not given keep their value)")
    _common(eset, settings)
    eset.add_argument("--threshold", type=float, default=None, help="self-preservation above this share of silent agents (0-1]")
    eset.add_argument("--cap-fraction", type=float, default=None, help="terminations per heartbeat window: max(1, share x agents)")
    toggle = eset.add_mutually_exclusive_group()
    toggle.add_argument("--on", dest="enabled", action="store_const", const=True, default=None, help="turn eviction safety on")
    toggle.add_argument("--off", dest="enabled", action="store_const", const=False, help="turn it off: silent agents are terminated at once")

    dev = sub.add_parser("dev", help="the whole stack on this machine: server, worker, example fleet, demo plan")
    dev.add_argument("--once", action="store_true", help="run the demo plan once, then stop everything (exit 0 on success)")
    dev.add_argument(
        "--plan-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="run the demo plan again every SECONDS (default: at start, then on demand: Enter, or SIGUSR1)",
    )
    dev.add_argument("--port", type=int, default=7233, help="Temporal frontend port")
    dev.add_argument("--ui-port", type=int, default=8233, help="Temporal web UI port")
    dev.add_argument("--db", default=os.environ.get("AGENTROSTER_DEV_DB", ".agentroster/temporal.db"), help="file that keeps the dev server's state")
    dev.add_argument("--fleet", default=None, help="fleet file (default: the bundled examples/fleet.toml)")
    dev.add_argument("--pool", default=settings.pool)
    dev.add_argument("--task-queue", default=settings.task_queue)

    mcp = sub.add_parser("mcp", help="serve the pool's capabilities as MCP tools (stdio, or streamable HTTP with --http)")
    _common(mcp, settings)
    mcp.add_argument("--http", type=int, default=None, metavar="PORT", help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="address --http listens on")
    mcp.add_argument("--wait", type=float, default=30.0, metavar="SECONDS", help="how long a call waits for a free agent")
    mcp.add_argument("--task-timeout", type=float, default=60.0, metavar="SECONDS", help="how long an agent may take to answer")
    mcp.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS", help="how long the tool list is kept before the pool is read again")

    add_route_parser(sub)
    add_inspect_parsers(sub, _common, settings)
    add_a2a_parser(sub, _common, settings)
    return parser


async def run_worker(args: argparse.Namespace) -> int:
    from agentroster.client.search_attributes import MissingSearchAttributesError
    from agentroster.workers.worker import create_worker

    from agentroster.activities.fleet import load_fleet
    from agentroster.workers.policy_file import load_policies

    from agentroster.activities.fleet import FleetError

    policies = {}
    fleet = None
    try:
        if args.backend == "local" and args.fleet:
            fleet = load_fleet(args.fleet)
            policies.update({s.name: p for s in fleet.deployments if (p := s.pool_policy()) is not None})
        if args.policies:
            policies.update(load_policies(args.policies))
    except (FleetError, ValueError) as exc:
        print(f"agentroster worker: {exc}", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    runtime_options: dict[str, Any] = {}
    metrics_options: dict[str, Any] = {}
    if args.metrics_port and settings.sdk_metrics != "off":
        # The Temporal SDK's own metrics: its Prometheus exporter on a loopback port,
        # appended to our /metrics (the bridge), or served at an address of the operator's.
        from agentroster.ops.metrics_exporter import sdk_runtime
        from agentroster.ops.ports import free_port

        bridged = settings.sdk_metrics == "bridge"
        address = f"127.0.0.1:{free_port()}" if bridged else settings.sdk_metrics
        runtime_options["runtime"] = sdk_runtime(address)
        if bridged:
            metrics_options["sdk_metrics_url"] = f"http://{address}/metrics"
    roster = await connect_roster(args, **runtime_options)
    options = {"fleet_file": args.fleet, "roster": roster} if args.backend == "local" else {}
    worker = create_worker(
        roster.client,
        task_queue=args.task_queue,
        backend=args.backend,
        backend_options=options,
        metrics_port=args.metrics_port or None,
        metrics_pools=[args.pool, *settings.metrics_pools],
        metrics_options=metrics_options,
        freeze_long_lived=settings.gc_freeze,
        **({"max_cached_workflows": settings.workflow_cache} if settings.workflow_cache else {}),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with worker:
            try:
                await roster.ensure_pool(restart=args.restart_pool)
            except PoolShutdownError as exc:
                # Stays down: a worker restarted by its supervisor must not undo an operator's shutdown.
                print(f"agentroster worker: {exc}; serving what is left of it", file=sys.stderr, flush=True)
                policies = {}
            for deployment, policy in sorted(policies.items()):
                await roster.set_policy(deployment, policy)
                print(f"agentroster worker: policy of {deployment}: {policy.model_dump(exclude_defaults=True) or 'defaults'}", flush=True)
            if fleet is not None and fleet.a2a:
                await join_fleet_a2a(roster, fleet)
            print(f"agentroster worker: task queue {args.task_queue!r}, pool {args.pool!r}, backend {args.backend!r} on {args.address}", flush=True)
            if worker.metrics is not None:
                print(f"agentroster worker: metrics at {worker.metrics.url}", flush=True)
            await stop.wait()
    except MissingSearchAttributesError as exc:
        print(f"agentroster worker: {exc}", file=sys.stderr)
        return 2
    return 0


async def run_mcp(args: argparse.Namespace) -> int:
    try:
        from agentroster.workers.mcp_server import FleetTools, serve_http, serve_stdio
    except ModuleNotFoundError as exc:
        print(f"agentroster mcp: {exc}: pip install 'agentroster[mcp]'", file=sys.stderr)
        return 2
    checks = (("--refresh", args.refresh, "> 0"), ("--wait", args.wait, ">= 0"), ("--task-timeout", args.task_timeout, "> 0"))
    for flag, value, rule in checks:
        if not (value > 0 or (rule == ">= 0" and value == 0)):
            print(f"agentroster mcp: {flag} must be {rule} seconds, got {value:g}", file=sys.stderr)
            return 2
    fleet = FleetTools(await connect_roster(args), refresh_s=args.refresh, wait_s=args.wait, task_timeout_s=args.task_timeout)
    if args.http is None:
        await serve_stdio(fleet)  # stdout is the MCP channel: nothing else is printed there
    else:
        url = f"http://{args.host}:{args.http}/mcp"
        await serve_http(fleet, args.http, args.host, on_ready=lambda: print(f"agentroster mcp: pool {args.pool!r} at {url}", file=sys.stderr, flush=True))
    return 0


async def run_status(args: argparse.Namespace) -> int:
    roster = await connect_roster(args)
    pool = await roster.status()
    print(format_status_table(await status_rows(roster, pool=pool, ended_within_s=args.ended_within)))
    print(
        f"\npool {pool.pool}: {pool.agent_count} agent(s)"
        + (f" ({pool.agents_omitted} not listed: the reply stays under 2 MiB)" if pool.agents_omitted else "")
        + f", {pool.active_leases} active lease(s), "
        f"{pool.waiting} waiting; granted {pool.leases_granted}, released {pool.leases_released}, "
        f"expired {pool.leases_expired}, revoked {pool.leases_revoked}, exhausted {pool.exhausted}"
    )
    if pool.shutdown is not None:
        print(format_shutdown(pool))
    for warning in pool.warnings:
        print(f"warning: {warning}")
    if pool.eviction.self_preservation:
        print(f"SELF-PRESERVATION: {pool.eviction.warning} (held: {', '.join(pool.eviction.silent) or '-'})")
    return 0


async def run_shutdown(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        ShutdownRequest(deadline_s=args.deadline, reason=args.reason)
    except ValidationError as exc:
        print(f"agentroster shutdown: {exc}", file=sys.stderr)
        return 2
    roster = await connect_roster(args)
    if not args.no_wait:
        print(f"pool {args.pool}: shutting down (leases in flight may run {args.deadline:g}s)...", flush=True)
    status = await roster.shutdown(deadline_s=args.deadline, reason=args.reason, wait=not args.no_wait)
    print(format_shutdown(status))
    return 0


async def run_drain(args: argparse.Namespace) -> int:
    roster = await connect_roster(args)
    try:
        status = await roster.drain(args.agent_id, reason=args.reason, deadline_s=args.deadline, wait=not args.no_wait)
    except AgentNotFoundError as exc:
        print(f"agentroster drain: {exc}", file=sys.stderr)
        return 1
    print(f"{status.agent_id}: {status.state.value}" + (f" ({status.terminated_reason})" if status.terminated_reason else ""))
    return 0


def policy_from_args(args: argparse.Namespace) -> PoolPolicy | None:
    """The policy `policy set` asks for: the file's fields, then the flags' (ValidationError names a bad one)."""
    if args.remove:
        return None
    fields: dict[str, Any] = {}
    if args.file:
        text = Path(args.file).read_text()
        fields.update(tomllib.loads(text) if args.file.endswith(".toml") else json.loads(text))
    for name in PoolPolicy.model_fields:
        if name in NESTED_POLICY_FIELDS:
            for sub in NESTED_POLICY_FIELDS[name].model_fields:
                value = getattr(args, f"{name}.{sub}", None)
                if value is not None:
                    fields.setdefault(name, {})[sub] = value
            continue
        value = getattr(args, name, None)
        if value is not None:
            fields[name] = None if value.lower() in ("none", "null") else value
    return PoolPolicy.model_validate(fields)


def _policy_cell(value: Any) -> str:
    """A policy field for the table; nested settings show what differs from their defaults."""
    if isinstance(value, BaseModel):
        changed = value.model_dump(exclude_defaults=True)
        return ",".join(f"{k}={v}" for k, v in changed.items()) or "defaults"
    return str(value)


def format_policies(policies: dict[str, PoolPolicy]) -> str:
    if not policies:
        return "no policies (every deployment has the defaults and only scales up on demand)"
    names = list(PoolPolicy.model_fields)
    header = ["deployment", *names]
    rows = [[d, *(_policy_cell(getattr(p, n)) for n in names)] for d, p in sorted(policies.items())]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


async def run_policy(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        policy = policy_from_args(args) if args.policy_command == "set" else None
    except (ValidationError, ValueError, OSError) as exc:
        print(f"agentroster policy set: {exc}", file=sys.stderr)
        return 2
    roster = await connect_roster(args)
    if args.policy_command == "scale-up":
        try:
            await roster.scale_up(args.deployment, args.add, reason=args.reason)
        except ValidationError as exc:
            print(f"agentroster policy scale-up: {exc}", file=sys.stderr)
            return 2
        except AgentRosterError as exc:
            print(f"agentroster policy scale-up: {exc}", file=sys.stderr)
            return 1
        print(f"asked for {args.add} more agent(s) of {args.deployment}")
        return 0
    if args.policy_command == "set":
        try:
            await roster.set_policy(args.deployment, policy)
        except ValidationError as exc:
            print(f"agentroster policy set: {exc}", file=sys.stderr)
            return 2
    print(format_policies(await roster.policies()))
    return 0


def format_evictions(status: EvictionStatus) -> str:
    policy = status.policy
    lines = [
        f"self-preservation: ON since {status.since.isoformat() if status.since else '?'}: {status.warning}"
        if status.self_preservation
        else "self-preservation: off",
        f"policy: {'on' if policy.enabled else 'OFF (silent agents are terminated at once)'}, threshold "
        f"{policy.threshold:.0%}, cap max(1, {policy.cap_fraction:.0%} of the agents) per heartbeat window",
        f"silent (held, unroutable): {', '.join(status.silent) or '-'}",
        f"confirmed (terminated when they ask): {', '.join(status.confirmed) or '-'}",
        f"evictions: {status.evictions_allowed} allowed, {status.evictions_denied} refused, "
        f"{status.evictions_confirmed} confirmed; self-preservation came on {status.self_preservation_activations} time(s)",
    ]
    if status.recent:
        recent = ", ".join(f"{r.agent_id} at {r.at.isoformat()}" + (" (confirmed)" if r.confirmed else "") for r in status.recent)
        lines.append(f"recent: {recent}")
    return "\n".join(lines)


async def run_evictions(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    roster = await connect_roster(args)
    if args.evictions_command == "confirm":
        if bool(args.agent_ids) == bool(args.all):
            print("agentroster evictions confirm: name the silent agents, or give --all", file=sys.stderr)
            return 2
        before = await roster.evictions()
        status = await roster.confirm_evictions(None if args.all else args.agent_ids)
        unknown = [a for a in args.agent_ids if a not in before.silent and a not in before.confirmed]
        for agent_id in unknown:
            print(f"agentroster evictions confirm: {agent_id} is not a silent agent of pool {args.pool}", file=sys.stderr)
        print(format_evictions(status))
        return 1 if unknown else 0
    if args.evictions_command == "set":
        current = (await roster.evictions()).policy
        fields = {k: v for k, v in (("threshold", args.threshold), ("cap_fraction", args.cap_fraction), ("enabled", args.enabled)) if v is not None}
        try:
            status = await roster.set_eviction_policy({**current.model_dump(), **fields})
        except ValidationError as exc:
            print(f"agentroster evictions set: {exc}", file=sys.stderr)
            return 2
        print(format_evictions(status))
        return 0
    print(format_evictions(await roster.evictions()))
    return 0




def main(argv: list[str] | None = None) -> NoReturn:
    """The console script: run a command and exit with its code."""
    from agentroster.client.tracing import shutdown_tracing

    code = run_command(argv)
    shutdown_tracing()  # spans still buffered are sent before the process ends
    sys.exit(code)


def run_command(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the command; returns the exit code."""
    try:
        settings = Settings.from_env()
    except AgentRosterError as exc:
        print(f"agentroster: {exc}", file=sys.stderr)
        return 2
    args = build_parser(settings).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("temporalio").setLevel(logging.WARNING if not args.verbose else logging.INFO)
    try:
        if args.command == "worker":
            return asyncio.run(closing(run_worker(args)))
        if args.command == "status":
            return asyncio.run(closing(run_status(args)))
        if args.command == "drain":
            return asyncio.run(closing(run_drain(args)))
        if args.command == "policy":
            return asyncio.run(closing(run_policy(args)))
        if args.command == "mcp":
            return asyncio.run(closing(run_mcp(args)))
        if args.command == "route":
            return run_route(args)
        if args.command in INSPECT_COMMANDS:
            return asyncio.run(closing(run_inspect(args)))
        if args.command == "shutdown":
            return asyncio.run(closing(run_shutdown(args)))
        if args.command == "evictions":
            return asyncio.run(closing(run_evictions(args)))
        if args.command == "a2a":
            return asyncio.run(closing(run_a2a(args, connect_roster)))
        if args.command == "dev":
            from agentroster.workers.dev import run_dev

            return asyncio.run(closing(run_dev(args)))
    except AgentRosterError as exc:
        print(f"agentroster {args.command}: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        if "client connect" not in str(exc):
            raise
        where = getattr(args, "address", None) or f"localhost:{getattr(args, 'port', 7233)}"
        print(f"agentroster {args.command}: cannot reach the Temporal server at {where}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    main()
