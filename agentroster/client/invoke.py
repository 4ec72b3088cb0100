"""Sending one task to a leased agent: the rules `CapabilityTaskWorkflow`'s invoke
activity and `AgentRoster.invoke` share (one implementation, two callers).

1. The capability's schemas come from the agent's own registration (the
   `registration` query of its workflow): the contract of the version leased.
   With a `SchemaCache` (the worker's invoke activities have one), they are
   asked once per (pool, agent, capability, version) and kept a minute; a
   payload or an output that breaks a cached schema is checked again against
   the agent's current one before it is refused.
2. The payload is checked against `input_schema`; nothing is sent when it
   breaks it (`InvalidTaskInputError`).
3. `POST {endpoint}/tasks/{capability}` with an `InvokeRequest` body and the
   lease's token (a JWT, `Authorization: Bearer ...`), signed just before the POST;
   or, for an agent registered from its Agent Card (`metadata.protocol` `a2a`), the
   A2A `message/send` of `agentroster.client.a2a.send_a2a_task` with the same token,
   signed again for each `GetTask` of a long task (`a2a_headers`).
4. The answer: 2xx gives `{"output": ...}`; 401 (token refused), 404, 409, 429,
   503 and 5xx are the agent's failure (`AgentTaskFailedError`); any other 4xx
   is the agent refusing the input (`InvalidTaskInputError`); no answer at all
   (connection refused or reset) is `AgentUnreachableError`, none within
   `task_timeout_s` its subclass `AgentTimeoutError`.
5. The output is checked against `output_schema` (`InvalidAgentOutputError`).

`is_failover` says which of these another agent may succeed at: the types in
`agentroster.vocabulary.wire.FAILOVER_ERRORS` (unreachable, failed, bad output), the rule
the child workflow follows too. `error_type` names each error as the
ApplicationError type the activity raises.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import aiohttp
import jsonschema
from temporalio.client import Client

from agentroster.client.a2a import send_a2a_task  # (a2a-sdk imported on first use)
from agentroster.vocabulary.a2a import is_a2a
from agentroster.errors import (
    AgentTaskFailedError,
    AgentTimeoutError,
    AgentUnreachableError,
    InvalidAgentOutputError,
    InvalidTaskInputError,
    LeaseKeyMissingError,
    TaskError,
)
from agentroster.messages import InvokeRequest, Outcome
from agentroster.models import AgentRegistration, Lease
from agentroster.client.tracing import inject_trace_context
from agentroster.client.transport import query_workflow
from agentroster.client.lease_tokens import KEY_VAR, LEASE_KEY_MISSING, LeaseKeys
from agentroster.client.settings import LEASE_KEY_HELP
from agentroster.vocabulary.wire import (
    AGENT_FAILED,
    AGENT_UNREACHABLE,
    CAPABILITY_TASK_FAILED,
    FAILOVER_ERRORS,
    INVALID_AGENT_OUTPUT,
    INVALID_TASK_INPUT,
    agent_workflow_id,
)

# The ApplicationError type of each error, as the invoke activity raises it.
ERROR_TYPES: dict[type[Exception], str] = {
    AgentUnreachableError: AGENT_UNREACHABLE,
    AgentTaskFailedError: AGENT_FAILED,
    InvalidTaskInputError: INVALID_TASK_INPUT,
    InvalidAgentOutputError: INVALID_AGENT_OUTPUT,
    LeaseKeyMissingError: LEASE_KEY_MISSING,
}


def error_type(exc: Exception) -> str:
    """The ApplicationError type that names `exc` in a workflow's history."""
    for cls, name in ERROR_TYPES.items():
        if isinstance(exc, cls):
            return name
    return CAPABILITY_TASK_FAILED


def is_failover(exc: Exception) -> bool:
    """Whether another agent may succeed where this one failed (the child workflow's rule)."""
    return error_type(exc) in FAILOVER_ERRORS


def outcome_of(exc: BaseException | None) -> Outcome | None:
    """What a task's end says of its agent, for the lease's release (None: nothing, e.g. the
    caller's own input was refused, the lease was lost, the worker could not sign)."""
    if exc is None:
        return "succeeded"
    if isinstance(exc, AgentTaskFailedError):
        status = exc.status or 0
        if status == 429:
            return "refused_429"
        if status == 503:
            return "refused_503"
        if status >= 500:
            return "failed_5xx"
        if status in (404, 409):
            return "failed_unreachable"  # no such task route: not the agent that registered
        return None  # 401: this worker's key, not the agent
    if isinstance(exc, AgentTimeoutError):
        return "failed_timeout"
    if isinstance(exc, AgentUnreachableError):
        return "failed_unreachable"
    if isinstance(exc, InvalidAgentOutputError):
        return "failed_bad_output"
    return None


# How long the agent workflow's `registration` query is asked (again, while it gets no answer).
SCHEMA_QUERY_S = 10.0


async def capability_schemas(client: Client, lease: Lease) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The leased capability's (input_schema, output_schema) and the agent's protocol
    (`a2a` for an agent registered from its Agent Card, else `http`), from its registration."""
    from agentroster.workflows.agent import AgentWorkflow

    handle = client.get_workflow_handle(agent_workflow_id(lease.pool, lease.agent_id))
    reg: AgentRegistration | None = (await query_workflow(handle, AgentWorkflow.status, deadline=time.monotonic() + SCHEMA_QUERY_S)).registration
    cap = reg.capability(lease.capability) if reg else None
    if cap is None or cap.version != lease.version:
        raise AgentUnreachableError(
            f"agent {lease.agent_id} no longer advertises {lease.capability}@{lease.version}",
            agent_id=lease.agent_id,
            capability=lease.capability,
        )
    return cap.input_schema, cap.output_schema, "a2a" if reg is not None and is_a2a(reg.metadata) else "http"


class SchemaCache:
    """Capability schemas by (pool, agent, capability, version), for one process.

    A version is a contract, so its schemas do not change; an agent that registers
    the same version again with other schemas is seen within `ttl_s`, or at once
    when a payload or an output breaks the cached schema (`invoke_leased` checks it
    again against fresh ones before any refusal). The agent's own task server
    checks both schemas too. Replaces a query to the agent workflow per task.
    """

    def __init__(self, ttl_s: float = 60.0, max_entries: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.queries = 0  # how often an agent workflow was asked (tests and benchmarks read it)
        self._entries: OrderedDict[tuple[str, str, str, str], tuple[float, dict[str, Any], dict[str, Any], str]] = OrderedDict()

    async def get(self, client: Client, lease: Lease, *, fresh: bool = False) -> tuple[dict[str, Any], dict[str, Any], str, bool]:
        """(input_schema, output_schema, protocol, came_from_the_cache); `fresh` asks the agent workflow."""
        key = (lease.pool, lease.agent_id, lease.capability, lease.version)
        now = time.monotonic()
        cached = self._entries.get(key)
        if cached is not None and not fresh and cached[0] > now:
            self._entries.move_to_end(key)
            return cached[1], cached[2], cached[3], True
        self.queries += 1
        try:
            input_schema, output_schema, protocol = await capability_schemas(client, lease)
        except AgentUnreachableError:
            self._entries.pop(key, None)
            raise
        self._entries[key] = (now + self.ttl_s, input_schema, output_schema, protocol)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return input_schema, output_schema, protocol, False


_VALIDATORS: OrderedDict[str, Any] = OrderedDict()
_VALIDATORS_KEPT = 256


def _validate(instance: Any, schema: dict[str, Any]) -> None:
    """`jsonschema.validate` with the checked validator kept per schema: a task pays no schema
    check and no validator build (~0.5 ms each time here), only the validation."""
    key = json.dumps(schema, sort_keys=True, default=str)
    validator = _VALIDATORS.get(key)
    if validator is None:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        validator = _VALIDATORS[key] = cls(schema)
        while len(_VALIDATORS) > _VALIDATORS_KEPT:
            _VALIDATORS.popitem(last=False)
    else:
        _VALIDATORS.move_to_end(key)
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is not None:
        raise error


def check_input(payload: Any, input_schema: dict[str, Any], lease: Lease) -> None:
    """Raise InvalidTaskInputError when `payload` breaks the capability's input_schema."""
    try:
        _validate(payload, input_schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "payload"
        raise InvalidTaskInputError(
            f"payload does not match {lease.capability}@{lease.version} input_schema at {where}: {exc.message}",
            agent_id=lease.agent_id,
            capability=lease.capability,
        ) from exc


def check_output(output: Any, output_schema: dict[str, Any], lease: Lease) -> None:
    """Raise InvalidAgentOutputError when `output` breaks the capability's output_schema."""
    try:
        _validate(output, output_schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "output"
        raise InvalidAgentOutputError(
            f"agent {lease.agent_id} output does not match {lease.capability}@{lease.version} output_schema at {where}: {exc.message}",
            agent_id=lease.agent_id,
            capability=lease.capability,
        ) from exc


async def post_task(
    session: aiohttp.ClientSession, lease: Lease, payload: Any, *, timeout_s: float, headers: dict[str, str]
) -> Any:
    """POST the task to the leased agent and return the `output` of its answer (unchecked)."""
    body = InvokeRequest(lease_id=lease.lease_id, capability=lease.capability, version=lease.version, input=payload)
    url = f"{lease.endpoint}/tasks/{lease.capability}"
    who = {"agent_id": lease.agent_id, "capability": lease.capability}
    try:
        async with session.post(
            url, json=body.model_dump(mode="json"), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            text = await resp.text()
            if resp.status == 401:
                raise AgentTaskFailedError(
                    f"agent {lease.agent_id} refused the lease token (401) at {url}: {text[:500]} "
                    f"(do this worker and the agent share {KEY_VAR}?)",
                    status=401,
                    **who,
                )
            if resp.status >= 500 or resp.status in (404, 409, 429, 503):
                raise AgentTaskFailedError(f"agent {lease.agent_id} answered {resp.status} at {url}: {text[:500]}", status=resp.status, **who)
            if resp.status >= 400:
                raise InvalidTaskInputError(f"agent {lease.agent_id} refused the task ({resp.status}): {text[:500]}", status=resp.status, **who)
            try:
                answer = await resp.json(content_type=None)
            except ValueError as exc:
                raise InvalidAgentOutputError(f"agent {lease.agent_id} answered non-JSON: {text[:200]}", status=resp.status, **who) from exc
    except asyncio.TimeoutError as exc:
        raise AgentTimeoutError(f"agent {lease.agent_id} gave no answer within {timeout_s:g}s at {url}: TimeoutError", **who) from exc
    except aiohttp.ClientConnectionError as exc:
        raise AgentUnreachableError(f"agent {lease.agent_id} unreachable at {url}: {type(exc).__name__}: {exc}", **who) from exc
    return answer.get("output") if isinstance(answer, dict) else None


def a2a_headers(lease: Lease, keys: LeaseKeys) -> Callable[[], dict[str, str]]:
    """Each A2A call's headers: the lease token signed at that moment, valid until two thirds of
    the lease's term from then (its first deadline at the earliest). The holder renews the lease
    every third of its term while the task runs, so a held lease lasts at least that long: a
    `GetTask` past the lease's first deadline carries a token that has not expired."""
    term = lease.deadline - lease.granted_at
    first = lease.deadline if lease.deadline.tzinfo else lease.deadline.replace(tzinfo=timezone.utc)

    def headers() -> dict[str, str]:
        held = max(first, datetime.now(timezone.utc) + term * 2 / 3)
        return inject_trace_context(keys.headers(lease.model_copy(update={"deadline": held})))

    return headers


async def invoke_leased(
    client: Client,
    session: aiohttp.ClientSession,
    lease: Lease,
    payload: Any,
    *,
    timeout_s: float,
    keys: LeaseKeys | None,
    schemas: SchemaCache | None = None,
) -> Any:
    """Steps 1-5 above for one lease: the checked output, or a TaskError (LeaseKeyMissingError without `keys`)."""
    if schemas is None:
        input_schema, output_schema, protocol = await capability_schemas(client, lease)
        check_input(payload, input_schema, lease)
    else:
        input_schema, output_schema, protocol, cached = await schemas.get(client, lease)
        try:
            check_input(payload, input_schema, lease)
        except InvalidTaskInputError:
            if not cached:
                raise
            input_schema, output_schema, protocol, cached = await schemas.get(client, lease, fresh=True)
            check_input(payload, input_schema, lease)
    if keys is None:
        raise LeaseKeyMissingError(f"this worker cannot sign lease tokens: {LEASE_KEY_HELP}")
    # Signed at send time, here: in the activity, the token never enters the workflow's history.
    if protocol == "a2a":  # an agent registered from its Agent Card: `message/send` (agentroster.client.a2a)
        output = await send_a2a_task(lease, payload, timeout_s=timeout_s, headers=a2a_headers(lease, keys))
    else:
        output = await post_task(session, lease, payload, timeout_s=timeout_s, headers=inject_trace_context(keys.headers(lease)))
    try:
        check_output(output, output_schema, lease)
    except InvalidAgentOutputError:
        if schemas is None or not cached:
            raise
        _, output_schema, _, _ = await schemas.get(client, lease, fresh=True)
        check_output(output, output_schema, lease)
    return output


__all__ = [
    "ERROR_TYPES",
    "a2a_headers",
    "outcome_of",
    "SchemaCache",
    "TaskError",
    "capability_schemas",
    "check_input",
    "check_output",
    "error_type",
    "invoke_leased",
    "is_failover",
    "post_task",
]
