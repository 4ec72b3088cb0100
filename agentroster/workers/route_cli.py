"""`agentroster route show|resolve`: read a routing table file, no server needed.

    agentroster route show --table routes.toml           # every task type, its pool and ref
    agentroster route resolve summarize --table routes.toml

`--table` defaults to AGENTROSTER_ROUTES.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

ROUTES_ENV = "AGENTROSTER_ROUTES"


def add_route_parser(sub: Any) -> None:
    """The `route` command and its subcommands, on the CLI's subparsers."""
    route = sub.add_parser("route", help="the routing table: task types -> (pool, capability ref)")
    commands = route.add_subparsers(dest="route_command", required=True)
    default = os.environ.get(ROUTES_ENV)
    show = commands.add_parser("show", help="validate a routing table file and print its routes")
    resolve = commands.add_parser("resolve", help="where one task type goes")
    resolve.add_argument("task_type")
    for parser in (show, resolve):
        parser.add_argument("--table", default=default, required=default is None, help=f"routing table file, TOML or .json ({ROUTES_ENV})")
        parser.add_argument("--json", action="store_true", help="print JSON")


def run_route(args: argparse.Namespace) -> int:
    """Run `route show` or `route resolve`; errors (bad file, unknown type) are AgentRosterErrors for the caller."""
    from agentroster.client.router import format_routing_table, load_routing_table

    table = load_routing_table(args.table)
    if args.route_command == "show":
        print(json.dumps(table.model_dump(mode="json"), indent=2) if args.json else format_routing_table(table))
        return 0
    route = table.resolve(args.task_type)
    if args.json:
        print(json.dumps({"task_type": args.task_type, **route.model_dump(mode="json")}))
    else:
        print(f"{args.task_type} -> pool {route.pool}, {route.ref}")
    return 0


__all__ = ["add_route_parser", "run_route"]
