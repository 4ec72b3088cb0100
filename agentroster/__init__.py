"""agentroster: a durable agent pool manager on Temporal."""

from agentroster.errors import (
    AgentTaskFailedError,
    AgentTimeoutError,
    AgentUnreachableError,
    CapabilityUnknownError,
    CircuitOpenError,
    InvalidAgentOutputError,
    InvalidTaskInputError,
    LeaseLostError,
    PoolExhaustedError,
    PoolShutdownError,
    TaskError,
    TaskFailedError,
    UnknownTaskTypeError,
)
from agentroster.models import (
    AgentRegistration,
    AgentState,
    AgentStatus,
    Capability,
    CapabilityRef,
    Lease,
    PoolPolicy,
    RoutingTable,
    TaskInput,
    TaskResult,
    TaskRoute,
    Transition,
)

__all__ = [
    "AgentRoster",
    "AgentRegistration",
    "AgentState",
    "AgentStatus",
    "AgentTaskFailedError",
    "AgentTimeoutError",
    "AgentUnreachableError",
    "Capability",
    "CapabilityRef",
    "CapabilityUnknownError",
    "CircuitOpenError",
    "InvalidAgentOutputError",
    "InvalidTaskInputError",
    "Lease",
    "LeaseLostError",
    "PoolExhaustedError",
    "PoolPolicy",
    "Router",
    "RoutingTable",
    "PoolShutdownError",
    "TaskError",
    "TaskFailedError",
    "TaskInput",
    "TaskResult",
    "TaskRoute",
    "Transition",
    "UnknownTaskTypeError",
]


def __getattr__(name: str):  # the client pulls in temporalio: import it on first use
    if name == "AgentRoster":
        from agentroster.client.roster import AgentRoster

        return AgentRoster
    if name == "Router":
        from agentroster.client.router import Router

        return Router
    raise AttributeError(name)
