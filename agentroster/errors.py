"""agentroster's errors: what callers of the client and the agent runtime catch.
"""

from __future__ import annotations

from typing import Any
import difflib

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    # NaN and infinities are refused everywhere: they break date arithmetic and
    # serialise as null, which the next run would refuse to read.
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


class PoolReport(_Model):
    """Counts behind a PoolExhaustedError, as the pool saw them."""

    ref: str
    matching: int = 0
    busy: int = 0
    draining: int = 0
    routable: int = 0
    excluded: int = Field(default=0, description="Matching agents the caller asked not to get (failed before)")
    waiting: int = 0
    total_agents: int = 0
    active_leases: int = 0
    # HikariCP-style slot figures for the ref (routable, not excluded agents): a slot is
    # one more lease an agent could take, within its capability's and its own cap.
    slots: int = Field(default=0, ge=0, description="Slots of routable matching agents (in use or idle)")
    idle_slots: int = Field(default=0, ge=0, description="Of those, slots free right now")
    max_cost_class: str | None = Field(default=None, description="The caller's cost cap: no agent of a dearer class")
    over_cost_cap: int = Field(default=0, ge=0, description="Matching agents of a dearer class than the cap, not offered")
# The largest argument of one signal or update (its JSON), far below the server's 2 MiB per
# payload: a refused update's reply carries its request again (the SDK echoes it), and no
# accepted message may make a reply or a history event too big.
MESSAGE_MAX_BYTES = 512 * 1024


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class AgentRosterError(Exception):
    """Base class of agentroster's own errors."""


class PoolExhaustedError(AgentRosterError):
    """No agent could serve a capability ref within the caller's timeout."""

    def __init__(self, ref: str, *, waited_s: float, report: PoolReport | None = None, pool: str = "") -> None:
        self.ref = ref
        self.waited_s = waited_s
        self.report = report or PoolReport(ref=ref)
        self.pool = pool
        r = self.report
        super().__init__(
            f"no agent free for {ref!r} in pool {pool!r} after waiting {waited_s:.2f}s: "
            f"{r.matching} agent(s) match, {r.busy} busy, {r.draining} draining, "
            f"{r.routable} routable"
            + (f", {r.excluded} excluded by the caller" if r.excluded else "")
            + (
                f", {r.over_cost_cap} excluded by the cost cap (cost class above {r.max_cost_class}: never spilled to)"
                if r.over_cost_cap
                else ""
            )
            + f"; {r.waiting} waiter(s) queued, "
            f"{r.active_leases} active lease(s), {r.total_agents} agent(s) in the pool"
            # HikariCP's figures, counted in slots of the agents that could serve the ref.
            f" (slots for it: total={r.slots}, active={r.slots - r.idle_slots}, idle={r.idle_slots}, waiting={r.waiting})"
        )

    @property
    def matching(self) -> int:
        return self.report.matching

    @property
    def busy(self) -> int:
        return self.report.busy

    @property
    def draining(self) -> int:
        return self.report.draining

    @property
    def waiting(self) -> int:
        """Callers queued in the pool when it gave up."""
        return self.report.waiting

    @property
    def total_slots(self) -> int:
        """Slots of the routable agents that match the ref (HikariCP's `total`)."""
        return self.report.slots

    @property
    def idle_slots(self) -> int:
        """Of those, slots free when the pool answered (HikariCP's `idle`)."""
        return self.report.idle_slots

    @property
    def active_slots(self) -> int:
        """Of those, slots held by leases (HikariCP's `active`)."""
        return self.report.slots - self.report.idle_slots


class CapabilityUnknownError(PoolExhaustedError):
    """No agent in the pool has ever offered the capability (and no known deployment serves it).

    Raised at once instead of after the timeout: waiting cannot help. A subclass
    of PoolExhaustedError, so handlers of that still catch it.
    """

    def __init__(self, ref: str, *, pool: str = "", report: PoolReport | None = None) -> None:
        super().__init__(ref, waited_s=0.0, report=report, pool=pool)
        name = ref.partition("@")[0].strip()
        self.args = (
            f"no agent in pool {pool!r} has ever offered {name!r} (asked for {ref!r}): check the capability name "
            "and the pool, or register an agent that serves it",
        )


class CircuitOpenError(PoolExhaustedError):
    """The capability's circuit breaker is open in `fail_fast` mode: most of its agents are unhealthy.

    Raised at once. A subclass of PoolExhaustedError, so handlers of that still catch it.
    """

    def __init__(self, ref: str, reason: str, *, pool: str = "", report: PoolReport | None = None) -> None:
        super().__init__(ref, waited_s=0.0, report=report, pool=pool)
        self.reason = reason
        self.args = (f"circuit open for {ref!r} in pool {pool!r}: {reason}",)


class UnknownTaskTypeError(AgentRosterError):
    """The routing table has no route for a task type. Raised at once, before any network call."""

    KNOWN_SHOWN = 20

    def __init__(self, task_type: str, known: list[str]) -> None:
        self.task_type = task_type
        self.known = sorted(known)
        shown = ", ".join(repr(t) for t in self.known[: self.KNOWN_SHOWN])
        if len(self.known) > self.KNOWN_SHOWN:
            shown += f" and {len(self.known) - self.KNOWN_SHOWN} more"
        close = difflib.get_close_matches(str(task_type), self.known, n=1) if isinstance(task_type, str) else []
        super().__init__(
            f"unknown task type {task_type!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f": the routing table knows {shown or 'no task types'}"
        )


class MessageTooLargeError(AgentRosterError, ValueError):
    """An argument too big for one message to a workflow: refused before it is sent."""

    def __init__(self, message: str, size: int, limit: int = MESSAGE_MAX_BYTES) -> None:
        self.message, self.size, self.limit = message, size, limit
        super().__init__(
            f"{message}: the argument is {size:,} bytes encoded, over the {limit:,}-byte limit of one message; send fewer items at once"
        )


class LeaseLostError(AgentRosterError):
    """The lease has ended (released, expired or revoked): its slot may be someone else's."""


class PoolShutdownError(AgentRosterError):
    """The pool is shutting down, or has shut down: it grants no new leases.

    Raised at once (never retried): waiting cannot help. `finished` tells the two
    apart; `status` is the pool's final status when it is known.
    """

    def __init__(self, pool: str, reason: str = "", *, finished: bool = False, status: Any = None) -> None:  # the pool's final PoolStatus
        self.pool = pool
        self.reason = reason
        self.finished = finished
        self.status = status
        why = f": {reason}" if reason else ""
        if finished:
            text = (
                f"pool {pool!r} has shut down{why}; it grants no leases. Start it again with "
                "`agentroster worker --restart-pool` or `roster.ensure_pool(restart=True)`"
            )
        else:
            text = f"pool {pool!r} is shutting down{why}; it grants no new leases"
        super().__init__(text)


class AgentNotFoundError(AgentRosterError):
    """The agent has no workflow (never registered, or its run ended)."""


# ---------------------------------------------------------------- tasks sent to agents
# Raised by `AgentRoster.invoke` (code outside workflows); the invoke activity turns the
# same errors into ApplicationErrors of the types in `agentroster.vocabulary.wire` (see
# `agentroster.client.invoke`), so both follow one set of rules.


class TaskError(AgentRosterError):
    """A task sent to an agent did not give a checked output. `agent_id` is the agent that was tried."""

    def __init__(self, message: str, *, agent_id: str | None = None, capability: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.agent_id = agent_id
        self.capability = capability
        self.status = status  # the agent's HTTP status, when it answered


class InvalidTaskInputError(TaskError):
    """The payload breaks the capability's input_schema, or the agent refused it (400/422): no other agent is tried."""


class InvalidAgentOutputError(TaskError):
    """The agent's answer is not JSON or breaks the capability's output_schema (another agent is tried)."""


class AgentUnreachableError(TaskError):
    """The agent could not be reached (connection refused, reset, timed out), or no longer offers the capability."""


class AgentTimeoutError(AgentUnreachableError):
    """The agent gave no answer within the task's `task_timeout_s` (a hung agent): the release says `failed_timeout`."""


class AgentTaskFailedError(TaskError):
    """The agent answered with a failure: 5xx, 404, 409 or 401 (lease token refused), 429, 503 (another agent is tried)."""


class LeaseKeyMissingError(AgentRosterError):
    """No lease key is configured (AGENTROSTER_LEASE_KEY): lease tokens can be neither signed nor checked."""


class TaskFailedError(TaskError):
    """No agent completed the task in the attempts allowed. `failures` holds each attempt's error, in order."""

    def __init__(self, ref: str, failures: list[TaskError], *, note: str = "") -> None:
        self.ref = ref
        self.failures = list(failures)
        lines = "; ".join(f"attempt {i} on {f.agent_id}: {f}" for i, f in enumerate(self.failures, 1))
        last = self.failures[-1] if self.failures else None
        super().__init__(
            f"{ref}: no agent completed the task in {len(self.failures)} attempt(s): {lines}{note}",
            agent_id=last.agent_id if last else None,
            capability=last.capability if last else None,
            status=last.status if last else None,
        )
