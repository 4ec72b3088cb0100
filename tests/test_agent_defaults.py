"""The agent runtime's defaults: nothing collides on one machine (a free port, a unique id),
nothing is guessed in Kubernetes (AGENT_ID and AGENT_PORT must be set there)."""

from __future__ import annotations

import re

import pytest

from agentroster.agent.runtime import AgentRuntime
from tests.conftest import TEST_LEASE_KEY

BASE = {"AGENT_DEPLOYMENT": "echo-agent", "AGENTROSTER_LEASE_KEY": TEST_LEASE_KEY}


def test_defaults_pick_a_free_port_and_a_unique_id() -> None:
    agents = [AgentRuntime.from_env(BASE) for _ in range(20)]
    assert all(a.port == 0 and a.endpoint is None for a in agents)  # bound at start, endpoint from the bound port
    ids = {a.agent_id for a in agents}
    assert len(ids) == 20 and all(re.fullmatch(r"echo-agent-[a-z0-9]{5}", i) for i in ids)
    assert AgentRuntime.from_env({"AGENTROSTER_LEASE_KEY": TEST_LEASE_KEY}, deployment="d").agent_id.startswith("d-")
    explicit = AgentRuntime.from_env({**BASE, "AGENT_ID": "echo-1", "AGENT_PORT": "9100"})
    assert (explicit.agent_id, explicit.port, explicit.endpoint) == ("echo-1", 9100, "http://127.0.0.1:9100")


def test_a_deployment_is_required() -> None:
    with pytest.raises(ValueError, match="set AGENT_DEPLOYMENT"):
        AgentRuntime.from_env({"AGENTROSTER_LEASE_KEY": TEST_LEASE_KEY})


def test_kubernetes_needs_an_explicit_id_and_port() -> None:
    k8s = {**BASE, "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    with pytest.raises(ValueError, match=r"in Kubernetes, set AGENT_ID and AGENT_PORT: AGENT_ID to the pod's name"):
        AgentRuntime.from_env(k8s)
    with pytest.raises(ValueError, match=r"set AGENT_PORT:"):
        AgentRuntime.from_env({**k8s, "AGENT_ID": "math-agent-7d9f-abcde"})
    agent = AgentRuntime.from_env({**k8s, "AGENT_ID": "math-agent-7d9f-abcde", "AGENT_PORT": "8080"})
    assert (agent.agent_id, agent.port) == ("math-agent-7d9f-abcde", 8080)
    assert AgentRuntime.from_env(k8s, agent_id="a-1", port=8080).agent_id == "a-1"  # given in code: explicit too


def test_the_default_heartbeat_is_slow_and_the_pod_uid_is_registered() -> None:
    """Heartbeats only catch hangs (the backend reports exits at once); POD_UID names the pod in pod_gone."""
    from agentroster.models import DEFAULT_HEARTBEAT_INTERVAL_S

    agent = AgentRuntime.from_env({**BASE, "AGENT_ID": "math-agent-7d9f-abcde", "AGENT_ENDPOINT": "http://10.0.0.1:8080", "POD_UID": "0b8f5b0e"})
    assert agent.heartbeat_interval_s == DEFAULT_HEARTBEAT_INTERVAL_S == 240.0
    assert agent.metadata == {"pod_uid": "0b8f5b0e"}
    kept = AgentRuntime.from_env({**BASE, "POD_UID": "u-2"}, metadata={"team": "math"}, endpoint="http://10.0.0.1:8080")
    assert kept.metadata == {"team": "math", "pod_uid": "u-2"}
    assert AgentRuntime.from_env({**BASE, "HEARTBEAT_INTERVAL_S": "10"}).heartbeat_interval_s == 10.0
