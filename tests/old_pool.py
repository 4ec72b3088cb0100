"""A PoolWorkflow as a worker from long ago runs it: `acquire_many` (no lease ever) and the
`release` signal only, no newer update. For tests of the client's fallbacks, and of `replay`:
its first workflow task starts a timer, a command today's pool does not give, so its
history does not replay with this code."""

from __future__ import annotations

import uuid
from datetime import timedelta
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError
from temporalio.worker import Worker

from agentroster.client.roster import AgentRoster
from agentroster.vocabulary.wire import pool_workflow_id


@workflow.defn(name="PoolWorkflow", sandboxed=False)
class OldPoolWorkflow:
    def __init__(self) -> None:
        self.released: list[str] = []

    @workflow.run
    async def run(self, _input: Any) -> None:
        await workflow.sleep(timedelta(hours=1))

    @workflow.update(name="acquire_many")
    def acquire_many(self, requests: list[Any]) -> list[dict[str, Any]]:
        return [{} for _ in requests]

    @workflow.signal(name="release")
    def release(self, lease_ids: list[str]) -> None:
        self.released.extend(lease_ids)

    @workflow.query(name="released")
    def released_ids(self) -> list[str]:
        return self.released


@workflow.defn(name="PoolWorkflow", sandboxed=False)
class OldPoolWithReleases(OldPoolWorkflow):
    """OldPoolWorkflow that also takes the `release_leases` and `release_and_acquire` updates, as
    every pool has for a while."""

    @workflow.run
    async def run(self, _input: Any) -> None:
        await super().run(_input)

    @workflow.update(name="release_leases")
    def release_leases(self, lease_ids: list[str]) -> int:
        self.released.extend(lease_ids)
        return 0

    @workflow.update(name="release_and_acquire")
    def release_and_acquire(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        self.released.extend(request["releases"])
        return [{} for _ in request["acquires"]]


@asynccontextmanager
async def old_pool(client: Client) -> AsyncIterator[tuple[WorkflowHandle[Any, Any], AgentRoster]]:
    """An `OldPoolWorkflow` run on a worker of its own, and a client of that pool."""
    pool, queue = f"old-{uuid.uuid4().hex[:6]}", f"old-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[OldPoolWorkflow]):
        handle = await client.start_workflow("PoolWorkflow", {"pool": pool}, id=pool_workflow_id(pool), task_queue=queue)
        roster = AgentRoster(client, pool=pool, task_queue=queue)
        roster._pool_started = True
        try:
            yield handle, roster
        finally:
            await handle.terminate("test over")


async def released(handle: WorkflowHandle[Any, Any], count: int) -> list[str] | None:
    """What the old pool was sent to release, once it holds `count` ids."""
    try:
        ids = await handle.query("released", result_type=list)
    except RPCError:
        return None
    return ids if len(ids) == count else None
