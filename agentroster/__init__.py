"""agentroster: a durable agent pool manager on Temporal."""

from agentroster.contracts import (
    AgentRegistration,
    AgentState,
    AgentStatus,
    AgentTaskFailedError,
    AgentUnreachableError,
    Capability,
    CapabilityRef,
    CapabilityUnknownError,
    CircuitOpenError,
    InvalidAgentOutputError,
    InvalidTaskInputError,
    Lease,
    LeaseLostError,
    PoolExhaustedError,
    PoolPolicy,
    RoutingTable,
    PoolShutdownError,
    TaskError,
    TaskFailedError,
    TaskInput,
    TaskResult,
    TaskRoute,
    Transition,
    UnknownTaskTypeError,
)

__all__ = [
    "AgentRoster",
    "AgentRegistration",
    "AgentState",
    "AgentStatus",
    "AgentTaskFailedError",
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
        from agentroster.client import AgentRoster

        return AgentRoster
    if name == "Router":
        from agentroster.router import Router

        return Router
    raise AttributeError(name)
