"""Client settings from the environment (TLS, mTLS) and backend refusals the agent survives."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.service import TLSConfig

from agentroster import AgentState
from agentroster.client.settings import tls_from_env
from agentroster.client.transport import query_workflow
from agentroster.errors import AgentRosterError
from tests.conftest import make_registration


def test_tls_settings_from_the_environment(tmp_path: Path) -> None:
    assert tls_from_env({}) is False
    assert tls_from_env({"TEMPORAL_TLS": "true"}) is True
    (tmp_path / "client.pem").write_bytes(b"CERT")
    (tmp_path / "client.key").write_bytes(b"KEY")
    (tmp_path / "ca.pem").write_bytes(b"CA")
    config = tls_from_env(
        {
            "TEMPORAL_TLS_CERT": str(tmp_path / "client.pem"),
            "TEMPORAL_TLS_KEY": str(tmp_path / "client.key"),
            "TEMPORAL_TLS_CA": str(tmp_path / "ca.pem"),
            "TEMPORAL_TLS_SERVER_NAME": "prod.tmprl.cloud",
        }
    )
    assert isinstance(config, TLSConfig)
    assert (config.client_cert, config.client_private_key, config.server_root_ca_cert, config.domain) == (
        b"CERT",
        b"KEY",
        b"CA",
        "prod.tmprl.cloud",
    )
    with pytest.raises(AgentRosterError, match="TEMPORAL_TLS_CERT and TEMPORAL_TLS_KEY"):
        tls_from_env({"TEMPORAL_TLS_CERT": str(tmp_path / "client.pem")})
    with pytest.raises(AgentRosterError, match="TEMPORAL_TLS_CA=/no/such/file"):
        tls_from_env({"TEMPORAL_TLS_CA": "/no/such/file"})


class ForbiddingBackend:
    """A backend whose API server refuses pod deletion (RBAC), as the Kubernetes backend reports it."""

    name = "forbidding"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []

    async def scale(self, deployment: str, replicas: int) -> None:
        self.calls.append(("scale", deployment, replicas))

    async def delete_pod(self, deployment: str, agent_id: str) -> None:
        self.calls.append(("delete_pod", deployment, agent_id))
        raise ApplicationError("DELETE pods/x: HTTP 403 Forbidden", type="KubernetesRequestRejected", non_retryable=True)

    async def mark_for_removal(self, deployment: str, agent_id: str) -> None:
        self.calls.append(("mark_for_removal", deployment, agent_id))


async def test_a_refused_pod_deletion_still_ends_the_agent_terminated(stack) -> None:
    await stack.stop_worker()
    stack.backend = ForbiddingBackend()
    await stack.start_worker()
    await stack.roster.register(make_registration("rbac-victim", [("rag.search", "2.1.0", 1, "A")]))
    final = await stack.roster.drain("rbac-victim", reason="rollout")
    assert final.state == AgentState.TERMINATED and final.terminated_reason == "drain"
    assert ("delete_pod", "search-agent", "rbac-victim") in stack.backend.calls
    # Through the one way the client queries (a query that reaches a busy worker's ended run
    # late is asked again, as every caller of ours does).
    handle = stack.env.client.get_workflow_handle(f"agent/{stack.pool}/rbac-victim")
    refusals = await query_workflow(handle, "refusals", result_type=list[str], deadline=time.monotonic() + 60)
    assert any("delete_pod" in r and "403" in r for r in refusals)
    assert await stack.roster.find("rag.search") == []


def test_workflow_cache_setting() -> None:
    from agentroster.client.settings import Settings, workflow_cache_from_env

    assert Settings.from_env({}).workflow_cache is None  # the SDK's default
    assert workflow_cache_from_env({"AGENTROSTER_WORKFLOW_CACHE": "5,000"}) == 5000
    assert workflow_cache_from_env({"AGENTROSTER_WORKFLOW_CACHE": " 20_000 "}) == 20000
    for bad in ("0", "-5", "lots", "1.5", "nan", "2000000"):
        with pytest.raises(AgentRosterError, match=r"AGENTROSTER_WORKFLOW_CACHE=.*from 1 to 1,000,000"):
            workflow_cache_from_env({"AGENTROSTER_WORKFLOW_CACHE": bad})


def test_gc_freeze_setting() -> None:
    from agentroster.client.settings import Settings

    assert Settings.from_env({}).gc_freeze is True  # on unless turned off
    assert Settings.from_env({"AGENTROSTER_GC_FREEZE": "off"}).gc_freeze is False
    assert Settings.from_env({"AGENTROSTER_GC_FREEZE": "0"}).gc_freeze is False
    assert Settings.from_env({"AGENTROSTER_GC_FREEZE": "on"}).gc_freeze is True
    with pytest.raises(AgentRosterError, match=r"AGENTROSTER_GC_FREEZE='sometimes': expected 1/true/yes/on or 0/false/no/off"):
        Settings.from_env({"AGENTROSTER_GC_FREEZE": "sometimes"})
