"""Serialization contexts answered outside the sandbox when the data converter ignores them.

temporalio's worker asks the workflow instance for a serialization context and an
external-store context for every payload sequence it decodes or encodes, and the
sandbox answers each one by running a snippet inside the sandbox (`exec` of a source
string, compiled on each call, under the sandbox's importer). While 400 agents register,
that is 15 % of the worker process's busy CPU (py-spy). When the data converter returns
itself for any context (no payload converter, codec or failure converter that takes
one, no external storage), no answer can change what is encoded, so the worker's
instances answer at once: no context (the worker then uses its data converter as it is)
and the SDK's default store context. Everything else goes to the sandbox's instance
untouched: `ContextFreeRunner` is a `temporalio.worker.WorkflowRunner` (the SDK's
public interface for runners) around the sandbox's.
"""

from __future__ import annotations

from typing import Any

from temporalio.converter import (
    ActivitySerializationContext,
    DataConverter,
    StorageDriverStoreContext,
    WorkflowSerializationContext,
)
from temporalio.worker import WorkflowInstance, WorkflowInstanceDetails, WorkflowRunner

_SAMPLE_CONTEXTS = (
    WorkflowSerializationContext(namespace="default", workflow_id="sample"),
    ActivitySerializationContext(
        namespace="default",
        activity_id="1",
        activity_type="sample",
        activity_task_queue="sample",
        workflow_id="sample",
        workflow_type="Sample",
        is_local=False,
    ),
)
# What the SDK answers when a workflow gives no store context.
NO_STORE_CONTEXT = StorageDriverStoreContext(target=None)


def converter_ignores_context(converter: DataConverter) -> bool:
    """Whether `converter` encodes the same whatever serialization context it is given."""
    if converter.external_storage is not None:
        return False
    return all(converter.with_context(context) is converter for context in _SAMPLE_CONTEXTS)


class _ContextFreeInstance(WorkflowInstance):
    def __init__(self, inner: WorkflowInstance) -> None:
        self._inner = inner

    def activate(self, act: Any) -> Any:
        return self._inner.activate(act)

    def get_serialization_context(self, command_info: Any) -> Any:
        return None

    def get_external_store_context(self, command_info: Any) -> Any:
        return NO_STORE_CONTEXT

    def get_info(self) -> Any:
        return self._inner.get_info()

    def get_thread_id(self) -> int | None:
        return self._inner.get_thread_id()


class ContextFreeRunner(WorkflowRunner):
    """`inner` (the sandbox), whose instances answer serialization contexts themselves.
    Only for a worker whose data converter `converter_ignores_context`."""

    def __init__(self, inner: WorkflowRunner) -> None:
        self.inner = inner

    def prepare_workflow(self, defn: Any) -> None:
        self.inner.prepare_workflow(defn)

    def create_instance(self, det: WorkflowInstanceDetails) -> WorkflowInstance:
        return _ContextFreeInstance(self.inner.create_instance(det))

    def set_worker_level_failure_exception_types(self, types: Any) -> None:
        self.inner.set_worker_level_failure_exception_types(types)


__all__ = ["NO_STORE_CONTEXT", "ContextFreeRunner", "converter_ignores_context"]
