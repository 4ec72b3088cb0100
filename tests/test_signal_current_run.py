"""`transport.signal_current_run`: a signal refused in a continue-as-new moment is sent again; one to an ended workflow is not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

import agentroster.client.transport as transport
from agentroster.client.transport import SIGNAL_NOT_FOUND_RETRIES, is_not_found, signal_current_run


def _not_found() -> RPCError:
    return RPCError("workflow execution already completed", RPCStatusCode.NOT_FOUND, b"")


class FakeHandle:
    """Refuses the first `refusals` signals with NOT_FOUND; describe reports `statuses` in turn."""

    def __init__(self, refusals: int, statuses: list[WorkflowExecutionStatus]) -> None:
        self.refusals = refusals
        self.statuses = statuses
        self.sent: list[tuple[Any, ...]] = []
        self.described = 0

    async def signal(self, signal: Any, *args: Any) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise _not_found()
        self.sent.append((signal, *args))

    async def describe(self) -> Any:
        status = self.statuses[min(self.described, len(self.statuses) - 1)]
        self.described += 1
        return SimpleNamespace(status=status)


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    async def instant(_: float) -> None:
        return None

    monkeypatch.setattr(transport.asyncio, "sleep", instant)


async def test_a_signal_refused_while_the_run_continues_as_new_is_sent_again() -> None:
    handle = FakeHandle(2, [WorkflowExecutionStatus.CONTINUED_AS_NEW, WorkflowExecutionStatus.RUNNING])
    await signal_current_run(handle, "drain", {"reason": "x"})  # type: ignore[arg-type]
    assert handle.sent == [("drain", {"reason": "x"})] and handle.described == 2


@pytest.mark.parametrize("status", [WorkflowExecutionStatus.COMPLETED, WorkflowExecutionStatus.TERMINATED])
async def test_a_signal_to_an_ended_workflow_raises_not_found_after_one_look(status: WorkflowExecutionStatus) -> None:
    handle = FakeHandle(1, [status])
    with pytest.raises(RPCError) as raised:
        await signal_current_run(handle, "heartbeat")  # type: ignore[arg-type]
    assert is_not_found(raised.value) and handle.described == 1 and not handle.sent
    assert f"latest run: {status.name}" in "\n".join(raised.value.__notes__)  # the failure says why


async def test_a_workflow_that_keeps_refusing_is_given_up_on() -> None:
    handle = FakeHandle(100, [WorkflowExecutionStatus.RUNNING])
    with pytest.raises(RPCError) as raised:
        await signal_current_run(handle, "heartbeat")  # type: ignore[arg-type]
    assert handle.described == SIGNAL_NOT_FOUND_RETRIES and not handle.sent
    assert f"{SIGNAL_NOT_FOUND_RETRIES + 1} attempt(s)" in "\n".join(raised.value.__notes__)


async def test_other_errors_are_not_retried() -> None:
    class Refusing(FakeHandle):
        async def signal(self, signal: Any, *args: Any) -> None:
            raise RPCError("bad", RPCStatusCode.INVALID_ARGUMENT, b"")

    handle = Refusing(0, [WorkflowExecutionStatus.RUNNING])
    with pytest.raises(RPCError):
        await signal_current_run(handle, "heartbeat")  # type: ignore[arg-type]
    assert handle.described == 0


async def test_a_describe_that_fails_on_a_busy_server_is_not_taken_for_the_end() -> None:
    class Busy(FakeHandle):
        async def describe(self) -> Any:
            self.described += 1
            if self.described == 1:
                raise RPCError("deadline", RPCStatusCode.DEADLINE_EXCEEDED, b"")
            return SimpleNamespace(status=WorkflowExecutionStatus.RUNNING)

    handle = Busy(2, [])
    await signal_current_run(handle, "heartbeat")  # type: ignore[arg-type]
    assert handle.sent == [("heartbeat",)] and handle.described == 2


async def test_a_workflow_that_does_not_exist_is_not_retried() -> None:
    class Missing(FakeHandle):
        async def describe(self) -> Any:
            self.described += 1
            raise _not_found()

    handle = Missing(100, [])
    with pytest.raises(RPCError) as raised:
        await signal_current_run(handle, "heartbeat")  # type: ignore[arg-type]
    assert handle.described == 1 and "latest run: NOT_FOUND" in "\n".join(raised.value.__notes__)
