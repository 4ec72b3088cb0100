"""PoolCore's `recover_only` acquire: how a task workflow finds the lease its `lease_and_invoke`
activity took but could not report (the activity was stopped, or its worker died)."""

from __future__ import annotations

from typing import Any

from agentroster.messages import AcquireReply, AcquireRequest
from tests.conftest import one_agent_core


def test_recover_only_gives_back_what_a_request_got_and_never_grants() -> None:
    """The lease or place an earlier request with the id got, or nothing; never a new lease."""
    core, new_id = one_agent_core("recover")

    def ask(request_id: str, recover_only: bool) -> Any:
        return core.acquire(AcquireRequest(ref="math.eval", request_id=request_id, wait_s=5, recover_only=recover_only), 1.0, new_id)

    assert ask("never-asked-0000000", True) == AcquireReply()  # nothing granted, nothing queued
    assert core.status().active_leases == 0 and core.status().waiting == 0
    granted = ask("first-request-000000", False).lease
    assert granted is not None
    assert ask("first-request-000000", True).lease == granted  # the same lease, not a second one
    queued = ask("second-request-00000", False).ticket  # the one slot is taken
    assert queued is not None and ask("second-request-00000", True).ticket == queued
    core.release(granted.lease_id, 2.0, new_id)  # the queue moves: the second request is granted
    assert ask("first-request-000000", True) == AcquireReply()  # released: nothing left to give back
    assert ask("second-request-00000", True).lease is not None
    assert core.status().active_leases == 1


def test_recover_only_is_left_off_the_wire_unless_set() -> None:
    """An ordinary acquire is written as before the field existed (a pool run by an older worker refuses unknown fields)."""
    plain = AcquireRequest(ref="math.eval", request_id="r" * 16).model_dump(mode="json")
    assert "recover_only" not in plain
    assert AcquireRequest(ref="math.eval", request_id="r" * 16, recover_only=True).model_dump(mode="json")["recover_only"] is True
