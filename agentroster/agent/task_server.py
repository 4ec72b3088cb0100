"""The agent's task server: the capabilities it serves, their handlers, and `POST /tasks/{capability}`.

`AgentRuntime` (agentroster.agent.runtime) owns one and adds the lifecycle around it:
registering, heartbeats, readiness and drain. Status codes:

- 401 no lease token (a JWT, see agentroster.client.lease_tokens), a malformed one, one
  with another algorithm or an unknown `kid`, or one whose signature fails;
  checked before anything else,
- 409 a lease token for another agent (`aud`), pool, lease, capability or
  version, or an expired one (the task is not run),
- 400 malformed body, 404 unknown capability, 409 version mismatch,
- 422 input fails the input_schema (or the handler raised `TaskRefused`),
- 429 the capability's max_concurrency, or the agent's, is reached,
- 500 the handler failed (or its output breaks the output_schema),
- 503 starting up or draining.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
from aiohttp import web
from pydantic import ValidationError

from agentroster.messages import InvokeRequest
from agentroster.models import Capability, effective_total_concurrency
from agentroster.client.lease_tokens import (
    AUTH_HEADER,
    AUTH_SCHEME,
    DEFAULT_CLOCK_SKEW_S,
    UNKNOWN_KID,
    LeaseClaims,
    LeaseKeys,
    LeaseTokenError,
    check_claims,
    token_from_header,
)

logger = logging.getLogger("agentroster.agent.runtime")

Handler = Callable[[Any], Any]
"""A capability handler: `(payload) -> output`, async or sync (sync runs in a thread)."""
Hook = Callable[[], Any]
"""A start-up or reset hook: no arguments, async or sync (sync runs in a thread)."""


class TaskRefused(Exception):
    """Raise from a handler to refuse a task's input (HTTP 422): the caller does not fail over."""


@dataclass
class _Served:
    """One capability this agent serves: contract, handler and counters."""

    capability: Capability
    handler: Handler
    input_validator: jsonschema.protocols.Validator
    output_validator: jsonschema.protocols.Validator
    in_flight: int = 0
    served: int = 0
    failed: int = 0
    refused: int = 0


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Await an async callable; run a sync one in a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result


def _validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def _schema_error(validator: jsonschema.protocols.Validator, instance: Any, what: str) -> str | None:
    """The most relevant schema violation of `instance`, as one sentence, or None."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or what
    return f"{what} does not match the schema at {where}: {error.message}"


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class TaskServer:
    """Runs tasks for the capabilities an agent serves, within their caps and the agent's."""

    def __init__(
        self,
        agent_id: str,
        *,
        max_concurrency: int | None = None,
        refusal: Callable[[], str | None] = lambda: None,
        lease_keys: LeaseKeys | None = None,
        pool: str | None = None,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
        on_reset_failed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        """`refusal()` returns why no task is taken right now (503), or None. `on_reset_failed(reason)`
        is called once, when a reset hook first raises.

        Tasks need a lease token signed with one of `lease_keys` for this agent (and
        `pool`, once known); without `lease_keys` every task is refused (401), with
        `LeaseKeys.disabled()` none is checked.
        """
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if clock_skew_s < 0:
            raise ValueError(f"clock_skew_s must be >= 0, got {clock_skew_s}")
        self.agent_id = agent_id
        self.lease_keys = lease_keys
        self.pool = pool
        self.clock_skew_s = clock_skew_s
        self.lease_refusals: dict[str, int] = {}
        self.max_concurrency = max_concurrency
        self._refusal = refusal
        self.served: dict[str, _Served] = {}
        self.reset_hooks: list[Hook] = []
        # Set when a reset hook raised: the agent's state may be dirty, so it refuses every
        # new task (503: the task fails over), `/healthz` fails, and `on_reset_failed` has the
        # agent replaced.
        self.reset_failed: str | None = None
        self._on_reset_failed = on_reset_failed
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def capabilities(self) -> list[Capability]:
        return [s.capability for s in self.served.values()]

    @property
    def total_concurrency(self) -> int:
        """Tasks at once across capabilities: `max_concurrency`, or the largest capability's."""
        return effective_total_concurrency(self.max_concurrency, self.capabilities)

    def add(self, capability: Capability, handler: Handler) -> None:
        if capability.name in self.served:
            raise ValueError(f"capability {capability.name!r} is declared twice")
        self.served[capability.name] = _Served(
            capability=capability,
            handler=handler,
            input_validator=_validator(capability.input_schema),
            output_validator=_validator(capability.output_schema),
        )

    def counters(self) -> dict[str, Any]:
        """Per capability: version, caps, in flight, served, failed, refused."""
        return {
            name: {
                "version": s.capability.version,
                "max_concurrency": s.capability.max_concurrency,
                "in_flight": s.in_flight,
                "served": s.served,
                "failed": s.failed,
                "refused": s.refused,
            }
            for name, s in self.served.items()
        }

    async def handle_task(self, request: web.Request) -> web.Response:
        """`POST /tasks/{capability}` with an `InvokeRequest` body; answers `{"output": ...}`."""
        name = request.match_info["capability"]
        claims: LeaseClaims | None = None
        if self.lease_keys is None or self.lease_keys.enabled:
            try:
                claims = self._verified(request)
            except LeaseTokenError as exc:
                return self.lease_refused(exc, name)
        try:
            body = InvokeRequest.model_validate(await request.json())
        except (ValueError, ValidationError) as exc:
            return error_response(400, f"the body is not an InvokeRequest: {exc}")
        return await self.invoke(name, body, claims)

    async def invoke(self, name: str, body: InvokeRequest, claims: LeaseClaims | None) -> web.Response:
        """Run one task whose lease token gave `claims` (None: checks are off); the answer as
        `POST /tasks/{capability}` gives it (A2A `message/send` comes here too, see `agent.a2a`)."""
        served = self.served.get(name)
        if served is None:
            return error_response(404, f"agent {self.agent_id} does not serve {name!r}; it serves {sorted(self.served)}")
        refusal = self._refusal()
        if refusal:
            return error_response(503, refusal)
        cap = served.capability
        if body.capability != name:
            return error_response(400, f"the body names capability {body.capability!r} but was posted to /tasks/{name}")
        if claims is not None:
            try:
                check_claims(claims, pool=self.pool, lease_id=body.lease_id, capability=name, version=body.version)
            except LeaseTokenError as exc:
                return self.lease_refused(exc, name)
        if body.version != cap.version:
            return error_response(409, f"agent {self.agent_id} serves {cap.key}, the lease is for version {body.version}")
        problem = _schema_error(served.input_validator, body.input, "input")
        if problem:
            served.refused += 1
            return error_response(422, f"{cap.key}: {problem}")
        if served.in_flight >= cap.max_concurrency:
            return error_response(429, f"{cap.key} already runs {served.in_flight} task(s), its max_concurrency")
        if self.in_flight >= self.total_concurrency:
            return error_response(
                429, f"agent {self.agent_id} already runs {self.in_flight} task(s), its max_concurrency across capabilities"
            )
        served.in_flight += 1
        self.in_flight += 1
        self.idle.clear()
        try:
            return await self._run_task(served, body)
        finally:
            await self._run_reset_hooks(cap.key, body.lease_id)
            served.in_flight -= 1
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    def _verified(self, request: web.Request) -> LeaseClaims:
        """The claims of the request's lease token if one of our keys signed it for this agent and it is live."""
        return self.verified_header(request.headers.get(AUTH_HEADER))

    def verified_header(self, authorization: str | None) -> LeaseClaims:
        """The claims of the lease token in an `Authorization` header value (LeaseTokenError if refused)."""
        if self.lease_keys is None:
            raise LeaseTokenError(UNKNOWN_KID, f"agent {self.agent_id} has no lease key configured and refuses every task")
        token = token_from_header(authorization)
        return self.lease_keys.verify(token, audience=self.agent_id, clock_skew_s=self.clock_skew_s)

    def lease_refused(self, exc: LeaseTokenError, capability: str) -> web.Response:
        self.lease_refusals[exc.reason] = self.lease_refusals.get(exc.reason, 0) + 1
        logger.warning("agent %s: refused a task for %s: %s", self.agent_id, capability, exc)
        response = error_response(exc.status, f"agent {self.agent_id}: {exc}")
        if exc.status == 401:
            response.headers["WWW-Authenticate"] = AUTH_SCHEME
        return response

    async def _run_task(self, served: _Served, body: InvokeRequest) -> web.Response:
        cap = served.capability
        try:
            output = await call(served.handler, body.input)
        except TaskRefused as exc:
            served.refused += 1
            return error_response(422, f"{cap.key} refused the task: {exc}")
        except Exception as exc:
            served.failed += 1
            logger.exception("agent %s: %s failed on lease %s", self.agent_id, cap.key, body.lease_id)
            return error_response(500, f"{cap.key} failed: {type(exc).__name__}: {exc}")
        problem = _schema_error(served.output_validator, output, "output")
        if problem:
            served.failed += 1
            logger.error("agent %s: %s returned a bad output: %s", self.agent_id, cap.key, problem)
            return error_response(500, f"{cap.key}: {problem}")
        try:
            text = json.dumps({"output": output}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            served.failed += 1
            return error_response(500, f"{cap.key}: the output is not JSON: {exc}")
        served.served += 1
        return web.Response(text=text, content_type="application/json")

    async def _run_reset_hooks(self, key: str, lease_id: str) -> None:
        for hook in self.reset_hooks:
            try:
                await call(hook)
            except Exception as exc:
                logger.exception("agent %s: reset hook failed after %s (lease %s)", self.agent_id, key, lease_id)
                first = self.reset_failed is None
                self.reset_failed = f"reset hook {getattr(hook, '__name__', 'hook')} failed after {key}: {exc!r}"[:400]
                if first:
                    self._on_reset_failed(self.reset_failed)
