"""Temporal workflows: thin shells over `agentroster.core`.

`workflow_classes()` and `workflow_runner()` are what every worker and replayer of
ours runs them with (`workers.worker`, `agentroster replay`, the recorded-history
tests), so a history that replays in one replays in all. `workflow_classes()` imports
lazily: a process that only replays one workflow needs only its module.
"""

from __future__ import annotations

from typing import Any

# Deterministic modules shared by workflows and the host: passed through the
# sandbox so a model class is one class everywhere (and is imported once). The
# workflow modules themselves too: the sandbox would import a run's module again for
# every run (~110 objects each, kept while the run is cached: at 10,000 cached agents
# that is a third of what every full garbage collection walks). The sandbox then checks
# none of this code; tests/test_core_determinism.py's static guard does, module by module.
PASSTHROUGH_MODULES = (
    "agentroster.workflows",
    "agentroster.errors",
    "agentroster.models",
    "agentroster.messages",
    "agentroster.core",
    "agentroster.vocabulary",
    "pydantic",
    "pydantic_core",
    "jsonschema",
    "sortedcontainers",
    "packaging",
)


def workflow_classes() -> list[type]:
    """Every workflow a worker of ours serves: the agent, the pool and the capability task."""
    from agentroster.workflows.agent import AgentWorkflow
    from agentroster.workflows.pool import PoolWorkflow
    from agentroster.workflows.task import CapabilityTaskWorkflow

    return [AgentWorkflow, PoolWorkflow, CapabilityTaskWorkflow]


def workflow_runner() -> Any:
    """The sandbox the worker and every replayer of our histories run workflows in."""
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSTHROUGH_MODULES))


__all__ = ["PASSTHROUGH_MODULES", "workflow_classes", "workflow_runner"]
