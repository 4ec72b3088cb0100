"""The custom search attributes: make sure they exist before anything uses them.

Both the client (`AgentRoster.connect` starts the pool workflow with
`AgentPool`) and the worker (agent workflows upsert theirs, task workflows
`AgentsServed`) need them. On a
plain `temporal server start-dev` they are missing; the dev server lets us add
them, a production cluster or Temporal Cloud may not, and then the error says
exactly what an operator must run.
"""

from __future__ import annotations

import asyncio
import logging
import time

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from agentroster.errors import AgentRosterError
from agentroster.vocabulary.wire import SEARCH_ATTRIBUTES

logger = logging.getLogger("agentroster")

# Namespaces (per server) already checked by this process: once is enough.
_checked: set[tuple[str, str]] = set()


class MissingSearchAttributesError(AgentRosterError):
    """The namespace lacks search attributes and the server would not add them."""


def _type_name(value: int) -> str:
    """`Keyword`, `KeywordList`: the spelling `temporal operator search-attribute create --type` takes."""
    return IndexedValueType.Name(value).removeprefix("INDEXED_VALUE_TYPE_").title().replace("_", "")


def operator_commands(namespace: str, names: list[str] | None = None) -> str:
    """The commands an operator runs to create the search attributes (all, or `names`)."""
    return " && ".join(
        f"temporal operator search-attribute create --namespace {namespace} --name {key.name} "
        f"--type {_type_name(int(key.indexed_value_type))}"
        for key in SEARCH_ATTRIBUTES
        if names is None or key.name in names
    )


def is_missing_search_attribute(exc: BaseException) -> bool:
    """The server refused a start or an upsert because a search attribute is not registered (yet)."""
    return isinstance(exc, RPCError) and "no mapping defined for search attribute" in exc.message


async def ensure_search_attributes(client: Client) -> None:
    """Register every one of SEARCH_ATTRIBUTES (AgentState, AgentCapabilities, AgentDeployment,
    AgentPool, AgentEndReason, AgentsServed) where missing.

    Raises MissingSearchAttributesError (with the operator's commands) when the
    server refuses to add them, or when one exists with another type.
    """
    config = getattr(getattr(client, "service_client", None), "config", None)
    key = (getattr(config, "target_host", None) or str(id(client)), client.namespace)
    if key in _checked:
        return
    namespace = client.namespace
    try:
        existing = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
        present = dict(existing.custom_attributes)
    except RPCError as exc:
        if exc.status != RPCStatusCode.UNIMPLEMENTED:
            raise
        present = {}  # the time-skipping test server cannot list, but can add
    missing = {
        k.name: IndexedValueType.ValueType(int(k.indexed_value_type)) for k in SEARCH_ATTRIBUTES if k.name not in present
    }
    wrong = [
        f"{k.name} is {IndexedValueType.Name(present[k.name])}, expected {IndexedValueType.Name(int(k.indexed_value_type))}"
        for k in SEARCH_ATTRIBUTES
        if k.name in present and present[k.name] != int(k.indexed_value_type)
    ]
    if wrong:
        raise MissingSearchAttributesError(f"namespace {namespace!r} has search attributes of the wrong type: " + "; ".join(wrong))
    if missing:
        try:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
            )
        except RPCError as exc:
            names = ", ".join(f"{n} ({_type_name(v)})" for n, v in sorted(missing.items()))
            raise MissingSearchAttributesError(
                f"namespace {namespace!r} lacks the search attributes {names} and the server refused to add them "
                f"({exc.message}); ask an operator to run: {operator_commands(namespace, sorted(missing))}"
            ) from exc
        logger.info("registered search attributes %s in namespace %s", ", ".join(sorted(missing)), namespace)
    _checked.add(key)


async def until_accepted(call, *, timeout: float = 30.0, what: str = "the server"):  # type: ignore[no-untyped-def]
    """Await `call()` until the server stops refusing it for an unregistered search attribute.

    A server may take a moment to serve attributes it has just added.
    """
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return await call()
        except RPCError as exc:
            if not is_missing_search_attribute(exc):
                raise
            if time.monotonic() + delay > deadline:
                raise MissingSearchAttributesError(
                    f"{what} still refuses the search attributes after {timeout:g}s ({exc.message}); "
                    "make sure they exist in the namespace"
                ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
