"""A2A agents in the roster: joining by their Agent Card, tasks over `message/send`, liveness by card.

An agent that speaks the Agent2Agent protocol (A2A, served with `a2a-sdk` or any other
implementation) runs no code of ours. It joins a pool by its card:

- `registration_from_card` turns an Agent Card into an `AgentRegistration`: one
  capability per skill (name = the skill's id, version = the card's `version`), the
  JSON-RPC interface's URL as the endpoint, concurrency and cost class from the
  caller (cards do not carry them), and `metadata` = `{"protocol": "a2a", "card_url": ...}`.
  A skill's version and input/output schemas come from the card's
  `urn:agentroster:skill-schemas` extension when it has one (our own runtime's cards
  do); else the card's version and permissive schemas (`{}` both ways: a text reply
  is a string, not an object).
- `add_a2a_agent` fetches the card (`A2ACardResolver`) and registers the agent; the
  `agentroster a2a add` command and the fleet file's `[[a2a]]` entries call it.
- `send_a2a_task` serves one lease with `message/send` (the `invoke_leased` branch for
  registrations whose `metadata.protocol` is `a2a`): the payload as one data part (a
  JSON object or any JSON value) or a text part (a string), the lease token as
  `Authorization: Bearer` on every call (signed afresh for each, so a `GetTask` past the
  lease's first deadline carries the renewed one's), long tasks followed with `GetTask`
  until they end or the task's timeout passes (then cancelled, best effort, and counted
  as a timeout: `AgentTimeoutError`).
- `card_answers` is the liveness check the agent's workflow runs every heartbeat
  interval (the `check_a2a_agent` activity in `activities/a2a.py`).

A2A task states and our outcomes: completed is success; failed, rejected, canceled and
input-required are the agent's failure (`AgentTaskFailedError`, fails over);
auth-required is the agent refusing the lease token (`AgentTaskFailedError` with
status 401, as an HTTP agent's 401); no answer is `AgentUnreachableError`, none within
the task's timeout `AgentTimeoutError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from google.protobuf import json_format, struct_pb2
from pydantic import ValidationError

from agentroster.vocabulary.a2a import (
    CARD_PATH,
    CARD_URL_KEY,
    JSONRPC,
    PROTOCOL,
    PROTOCOL_KEY,
    SCHEMAS_EXTENSION,
)
from agentroster.errors import AgentTaskFailedError, AgentTimeoutError, AgentUnreachableError
from agentroster.models import AgentRegistration, Capability, Lease, check_capability_name

# How often a long A2A task is asked for its state (`GetTask`) while it runs.
POLL_S = 0.25


class A2ACardError(ValueError):
    """A card that cannot be fetched, is not an Agent Card, or does not fit a registration.

    `field` names the card field at fault (`card_url` when it could not be fetched)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def split_card_url(card_url: str) -> tuple[str, str]:
    """(base URL, card path): a URL that names a `.json` file is the card itself, any other
    is the agent's base URL with the card at `/.well-known/agent-card.json`."""
    parts = urlsplit(card_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise A2ACardError("card_url", f"{card_url!r} is not an http(s) URL")
    if parts.path.endswith(".json"):
        return f"{parts.scheme}://{parts.netloc}", parts.path
    return card_url.rstrip("/"), CARD_PATH


def card_location(card_url: str) -> str:
    """The full URL the card is read from."""
    base, path = split_card_url(card_url)
    return base + path


async def fetch_card(card_url: str, *, timeout_s: float = 10.0) -> Any:
    """The Agent Card at `card_url` (an `a2a.types.AgentCard`), read with `A2ACardResolver`."""
    httpx = _httpx()
    from a2a.client import A2ACardResolver, AgentCardResolutionError

    base, path = split_card_url(card_url)
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        try:
            return await A2ACardResolver(http, base, agent_card_path=path).get_agent_card()
        except AgentCardResolutionError as exc:
            raise A2ACardError("card_url", f"no Agent Card at {base + path}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise A2ACardError("card_url", f"no Agent Card at {base + path}: {type(exc).__name__}: {exc}") from exc


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    return slug[:60].strip("-._") or "a2a-agent"


def jsonrpc_url(card: Any) -> str:
    """The URL of the card's JSON-RPC interface (the endpoint leases carry)."""
    for iface in card.supported_interfaces:
        if iface.protocol_binding.upper() == JSONRPC and iface.url:
            return iface.url
    raise A2ACardError("supportedInterfaces", "the card declares no JSONRPC interface with a url")


def _skill_schemas(card: Any) -> dict[str, Any]:
    for ext in card.capabilities.extensions:
        if ext.uri == SCHEMAS_EXTENSION:
            params = json_format.MessageToDict(ext.params)
            return params if isinstance(params, dict) else {}
    return {}


def registration_from_card(
    card: Any,
    card_url: str,
    *,
    deployment: str | None = None,
    agent_id: str | None = None,
    max_concurrency: int = 1,
    cost_class: str = "B",
    heartbeat_interval_s: float = 120.0,
) -> AgentRegistration:
    """The registration for the agent the card describes; A2ACardError names the field at fault."""
    if not card.name:
        raise A2ACardError("name", "the card has no name: not an Agent Card")
    if not card.version:
        raise A2ACardError("version", "the card has no version")
    if not card.skills:
        raise A2ACardError("skills", "the card lists no skill, so the agent would serve no capability")
    endpoint = jsonrpc_url(card)
    schemas = _skill_schemas(card)
    capabilities = []
    for i, skill in enumerate(card.skills):
        try:
            check_capability_name(skill.id)
        except ValueError as exc:
            raise A2ACardError(f"skills[{i}].id", f"{exc}: capability names are dotted lowercase words") from exc
        given = schemas.get(skill.id) or {}
        where = {  # the card field each Capability field comes from (or the option that set it)
            "version": f"capabilities.extensions[{SCHEMAS_EXTENSION}].{skill.id}.version" if given.get("version") else "version",
            "input_schema": f"capabilities.extensions[{SCHEMAS_EXTENSION}].{skill.id}.input_schema",
            "output_schema": f"capabilities.extensions[{SCHEMAS_EXTENSION}].{skill.id}.output_schema",
        }
        try:
            capabilities.append(
                Capability(
                    name=skill.id,
                    version=str(given.get("version") or card.version),
                    input_schema=given.get("input_schema") or {},
                    output_schema=given.get("output_schema") or {},
                    max_concurrency=max_concurrency,
                    cost_class=cost_class,  # type: ignore[arg-type]
                )
            )
        except ValidationError as exc:
            raise _refusal(exc, where) from exc
    host = urlsplit(endpoint).netloc
    where = {
        "endpoint": "supportedInterfaces",
        "agent_id": "agent_id" if agent_id else "name",
        "deployment": "deployment" if deployment else "name",
    }
    try:
        return AgentRegistration(
            agent_id=agent_id or _slug(f"{card.name}-{host}"),
            deployment=deployment or _slug(card.name),
            endpoint=endpoint,
            capabilities=capabilities,
            heartbeat_interval_s=heartbeat_interval_s,
            max_concurrency=max_concurrency,
            metadata={PROTOCOL_KEY: PROTOCOL, CARD_URL_KEY: card_location(card_url)},
        )
    except ValidationError as exc:
        raise _refusal(exc, where) from exc


def _refusal(exc: ValidationError, where: dict[str, str]) -> A2ACardError:
    """The first validation error, named by the card field (or the option) it came from."""
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else "card"
    return A2ACardError(where.get(field, field), str(first["msg"]).removeprefix("Value error, "))


async def add_a2a_agent(
    roster: Any,
    card_url: str,
    *,
    deployment: str | None = None,
    agent_id: str | None = None,
    max_concurrency: int = 1,
    cost_class: str = "B",
    heartbeat_interval_s: float = 120.0,
    timeout_s: float = 10.0,
) -> AgentRegistration:
    """Fetch the card at `card_url` and register its agent in `roster`'s pool; the registration made."""
    card = await fetch_card(card_url, timeout_s=timeout_s)
    registration = registration_from_card(
        card, card_url, deployment=deployment, agent_id=agent_id, max_concurrency=max_concurrency,
        cost_class=cost_class, heartbeat_interval_s=heartbeat_interval_s,
    )
    await roster.register(registration)
    return registration


async def card_answers(card_url: str, *, timeout_s: float) -> str | None:
    """None when the card at `card_url` answers as an Agent Card, else why not (the liveness check)."""
    try:
        await fetch_card(card_url, timeout_s=timeout_s)
    except A2ACardError as exc:
        return exc.reason
    return None


# ------------------------------------------------------------------ tasks
def payload_part(payload: Any) -> Any:
    """One A2A Part for the payload: text for a string, data for any other JSON value."""
    from a2a.types import Part

    if isinstance(payload, str):
        return Part(text=payload)
    value = struct_pb2.Value()
    json_format.ParseDict(payload, value)
    return Part(data=value)


def output_of(parts_lists: list[Any]) -> Any:
    """The data of the first data part, else the text of the text parts, else None."""
    for parts in parts_lists:
        for part in parts:
            if part.HasField("data"):
                return json_format.MessageToDict(part.data)
    texts = [part.text for parts in parts_lists for part in parts if part.HasField("text")]
    return "\n".join(texts) if texts else None


def _card_for(endpoint: str) -> Any:
    from a2a.types import AgentCapabilities, AgentCard, AgentInterface

    return AgentCard(
        name="leased",
        version="0",
        supported_interfaces=[AgentInterface(url=endpoint, protocol_binding=JSONRPC, protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=False),
    )


async def send_a2a_task(lease: Lease, payload: Any, *, timeout_s: float, headers: Callable[[], dict[str, str]]) -> Any:
    """`message/send` the payload to the leased A2A agent; its output (unchecked), or a TaskError.

    `headers()` gives each call's headers (the lease token, signed at that moment): an agent
    may check the token of every call, the `GetTask` polls of a long task too."""
    httpx = _httpx()
    from a2a.client import A2AClientError, ClientCallContext, ClientConfig, ClientFactory
    from a2a.types import CancelTaskRequest, GetTaskRequest, Message, Role, SendMessageRequest, TaskState

    who = {"agent_id": lease.agent_id, "capability": lease.capability}
    deadline = time.monotonic() + timeout_s
    message = Message(message_id=uuid.uuid4().hex, role=Role.ROLE_USER, parts=[payload_part(payload)])
    message.metadata.update({"capability": lease.capability, "version": lease.version, "lease_id": lease.lease_id})
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        # polling: the agent answers at once with its task (or its reply), and a long task is followed with GetTask.
        client = ClientFactory(ClientConfig(streaming=False, polling=True, httpx_client=http)).create(_card_for(lease.endpoint))
        def context() -> Any:
            return ClientCallContext(service_parameters=headers(), timeout=timeout_s)

        try:
            reply = None
            async for event in client.send_message(SendMessageRequest(message=message), context=context()):
                reply = event
            if reply is None:
                raise AgentTaskFailedError(f"A2A agent {lease.agent_id} sent no reply", **who)
            if reply.HasField("message"):
                return output_of([reply.message.parts])
            task = reply.task
            while task.status.state in (TaskState.TASK_STATE_SUBMITTED, TaskState.TASK_STATE_WORKING, TaskState.TASK_STATE_UNSPECIFIED):
                left = deadline - time.monotonic()
                if left <= 0:
                    with contextlib.suppress(Exception):  # best effort: the agent may stop the work it would waste
                        await asyncio.wait_for(client.cancel_task(CancelTaskRequest(id=task.id), context=context()), 2.0)
                    raise AgentTimeoutError(
                        f"A2A agent {lease.agent_id}: task {task.id} still {TaskState.Name(task.status.state)} after {timeout_s:g}s", **who
                    )
                await asyncio.sleep(min(POLL_S, left))
                task = await client.get_task(GetTaskRequest(id=task.id), context=context())
        except A2AClientError as exc:
            raise _client_error(lease, exc) from exc
        except httpx.HTTPStatusError as exc:
            raise _http_error(lease, exc.response.status_code, str(exc)) from exc
        except (httpx.TimeoutException, asyncio.TimeoutError) as exc:
            raise AgentTimeoutError(f"A2A agent {lease.agent_id} gave no answer within {timeout_s:g}s at {lease.endpoint}: {type(exc).__name__}", **who) from exc
        except httpx.RequestError as exc:
            raise AgentUnreachableError(f"A2A agent {lease.agent_id} unreachable at {lease.endpoint}: {type(exc).__name__}: {exc}", **who) from exc
    state = task.status.state
    if state == TaskState.TASK_STATE_COMPLETED:
        return output_of([a.parts for a in task.artifacts] + [task.status.message.parts])
    said = output_of([task.status.message.parts])
    if state == TaskState.TASK_STATE_AUTH_REQUIRED:
        raise AgentTaskFailedError(f"A2A agent {lease.agent_id} refused the lease token (auth-required): {said}", status=401, **who)
    raise AgentTaskFailedError(f"A2A agent {lease.agent_id} ended task {task.id} {TaskState.Name(state)}: {said}", **who)


def _httpx() -> Any:
    """httpx, which comes with a2a-sdk (the `a2a` extra); a clear error without it."""
    try:
        import a2a  # noqa: F401
        import httpx
    except ImportError as exc:
        raise ImportError("A2A agents need the a2a-sdk package: pip install 'agentroster[a2a]'") from exc
    return httpx


def _http_error(lease: Lease, status: int, text: str) -> Exception:
    who = {"agent_id": lease.agent_id, "capability": lease.capability}
    if status == 401:
        return AgentTaskFailedError(f"A2A agent {lease.agent_id} refused the lease token (401) at {lease.endpoint}: {text[:300]}", status=401, **who)
    return AgentTaskFailedError(f"A2A agent {lease.agent_id} answered {status} at {lease.endpoint}: {text[:300]}", status=status, **who)


def _client_error(lease: Lease, exc: Exception) -> Exception:
    """An a2a-sdk client error as our TaskError: no answer is unreachable, any other the agent's failure."""
    who = {"agent_id": lease.agent_id, "capability": lease.capability}
    httpx = _httpx()
    from a2a.client import A2AClientTimeoutError

    cause = exc.__cause__
    if isinstance(exc, A2AClientTimeoutError) or isinstance(cause, (httpx.TimeoutException, asyncio.TimeoutError)):
        return AgentTimeoutError(f"A2A agent {lease.agent_id} gave no answer in time at {lease.endpoint}: {exc}", **who)
    if isinstance(cause, httpx.RequestError):
        return AgentUnreachableError(f"A2A agent {lease.agent_id} unreachable at {lease.endpoint}: {exc}", **who)
    if isinstance(cause, httpx.HTTPStatusError):
        return _http_error(lease, cause.response.status_code, cause.response.text)
    return AgentTaskFailedError(f"A2A agent {lease.agent_id} at {lease.endpoint}: {type(exc).__name__}: {exc}", **who)


__all__ = [
    "A2ACardError",
    "add_a2a_agent",
    "card_answers",
    "fetch_card",
    "output_of",
    "payload_part",
    "registration_from_card",
    "send_a2a_task",
]
