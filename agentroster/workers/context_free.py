"""Serialization contexts answered outside the sandbox when the data converter ignores them.

temporalio 1.35.0's worker asks the workflow instance for a serialization context and
an external-store context for every payload sequence it decodes or encodes, and the
sandbox answers each one by running a snippet inside the sandbox (`exec` of a source
string, compiled on each call, under the sandbox's importer). While 400 agents register,
that was 15 % of the worker process's busy CPU (py-spy; figures in the README's
"Registration cost"). When the data converter returns itself for any context (no
payload converter, codec or failure converter that takes one, no external storage),
no answer can change what is encoded, so the worker's instances answer at once: no
context (the worker then uses its data converter as it is) and the SDK's default store
context. The answering is done by the partial-task guard's instance wrapper (one wrapper
on the activation path, not two): `GuardedWorkflowRunner(..., context_free=True)`.
"""

from __future__ import annotations

from temporalio.converter import (
    ActivitySerializationContext,
    DataConverter,
    StorageDriverStoreContext,
    WorkflowSerializationContext,
)

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


__all__ = ["NO_STORE_CONTEXT", "converter_ignores_context"]
