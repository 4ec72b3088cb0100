"""agentroster: a durable agent pool manager on Temporal."""

from agentroster.contracts import (
    AgentRegistration,
    AgentState,
    AgentStatus,
    Capability,
    CapabilityRef,
    CapabilityUnknownError,
    Lease,
    LeaseLostError,
    PoolExhaustedError,
    PoolShutdownError,
    TaskInput,
    TaskResult,
    Transition,
)

__all__ = [
    "AgentRoster",
    "AgentRegistration",
    "AgentState",
    "AgentStatus",
    "Capability",
    "CapabilityRef",
    "CapabilityUnknownError",
    "Lease",
    "LeaseLostError",
    "PoolExhaustedError",
    "PoolShutdownError",
    "TaskInput",
    "TaskResult",
    "Transition",
]


def __getattr__(name: str):  # the client pulls in temporalio: import it on first use
    if name == "AgentRoster":
        from agentroster.client import AgentRoster

        return AgentRoster
    raise AttributeError(name)
