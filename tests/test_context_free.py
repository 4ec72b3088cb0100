"""Serialization contexts answered outside the sandbox only when the data converter ignores them."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import PayloadCodec, SerializationContext, WithSerializationContext, WorkflowSerializationContext

from agentroster.activities.backend import NoneBackend
from agentroster.client.roster import AgentRoster
from agentroster.workers.context_free import ContextFreeRunner, converter_ignores_context
from agentroster.workers.worker import create_worker
from agentroster.vocabulary.wire import agent_workflow_id
from tests.conftest import make_registration


class ContextRecordingCodec(PayloadCodec, WithSerializationContext):
    """Passes payloads through; remembers the workflow ids of the contexts it was given."""

    def __init__(self, seen: list[str], context: SerializationContext | None = None) -> None:
        self.seen = seen
        self.context = context

    def with_context(self, context: SerializationContext) -> ContextRecordingCodec:
        return ContextRecordingCodec(self.seen, context)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if isinstance(self.context, WorkflowSerializationContext):
            self.seen.append(self.context.workflow_id)
        return list(payloads)

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return list(payloads)


def _answers_contexts_itself(worker: Any) -> bool:
    runner = worker.config()["workflow_runner"]
    return isinstance(runner, ContextFreeRunner)


def test_only_a_converter_that_returns_itself_for_every_context_is_context_free() -> None:
    assert converter_ignores_context(pydantic_data_converter)
    aware = dataclasses.replace(pydantic_data_converter, payload_codec=ContextRecordingCodec([]))
    assert not converter_ignores_context(aware)


async def test_a_context_aware_codec_still_gets_each_workflows_context(dev_env) -> None:
    seen: list[str] = []
    config = dev_env.client.config()
    client = await Client.connect(
        dev_env.client.service_client.config.target_host,
        namespace=config["namespace"],
        data_converter=dataclasses.replace(pydantic_data_converter, payload_codec=ContextRecordingCodec(seen)),
    )
    suffix = uuid.uuid4().hex[:8]
    worker = create_worker(client, task_queue=f"ctx-{suffix}", backend=NoneBackend())
    assert not _answers_contexts_itself(worker)
    plain = create_worker(dev_env.client, task_queue=f"ctx-plain-{suffix}", backend=NoneBackend())
    assert _answers_contexts_itself(plain)

    async with worker:
        roster = AgentRoster(client, pool=f"ctx-{suffix}", task_queue=f"ctx-{suffix}")
        status = await roster.register(make_registration("ctx-1"))
        assert status.state.value == "Ready"
    # The agent workflow's own commands (its notify_pool activity's input) were encoded in its context.
    assert agent_workflow_id(f"ctx-{suffix}", "ctx-1") in seen
