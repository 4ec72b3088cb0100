"""What the workflows share: ids, search attributes, inputs, retry policies."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field
from temporalio.common import RetryPolicy, SearchAttributeKey

AGENT_STATE = SearchAttributeKey.for_keyword("AgentState")
AGENT_CAPABILITIES = SearchAttributeKey.for_keyword_list("AgentCapabilities")
AGENT_DEPLOYMENT = SearchAttributeKey.for_keyword("AgentDeployment")
AGENT_POOL = SearchAttributeKey.for_keyword("AgentPool")
SEARCH_ATTRIBUTES = (AGENT_STATE, AGENT_CAPABILITIES, AGENT_DEPLOYMENT, AGENT_POOL)

# Side effects on a cluster: keep trying with backoff; the activity marks
# errors no retry can fix (403, 422) non-retryable itself.
BACKEND_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=60),
    maximum_attempts=0,
    non_retryable_error_types=["KubernetesRequestRejected", "ValueError"],
)
MESSAGE_RETRY = RetryPolicy(
    initial_interval=timedelta(milliseconds=100),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=0,
)


def agent_workflow_id(agent_id: str) -> str:
    return f"agent/{agent_id}"


def pool_workflow_id(pool: str) -> str:
    return f"pool/{pool}"


class AgentWorkflowInput(BaseModel):
    agent_id: str
    pool: str = "default"
    # Continue-as-new once this many signals were received in one run (the
    # server's hard limit is 10,000 and signals do not count toward its hint).
    max_signals_per_run: int = Field(default=5000, ge=2)
    carried: dict[str, Any] | None = None
    refused: list[str] = Field(default_factory=list)


class PoolInput(BaseModel):
    pool: str = "default"
    max_updates_per_run: int = Field(default=1500, ge=2)
    max_signals_per_run: int = Field(default=8000, ge=2)
    max_history_events: int = Field(default=20000, ge=100)
    scale_window_s: float = Field(default=5.0, gt=0)
    state: dict[str, Any] | None = None
    # Scale requests still being carried out when the previous run continued as
    # new: issued again (they are idempotent) rather than waited for.
    pending_scale: list[dict[str, Any]] = Field(default_factory=list)
    refused: list[str] = Field(default_factory=list)
    runs: int = 0


def refusal_reason(exc: Exception) -> str:
    """A one-line reason from a validation error, naming the fields."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            parts = [f"{'.'.join(str(p) for p in e.get('loc', ())) or 'message'}: {e.get('msg')}" for e in errors()]
            return "; ".join(parts)
        except Exception:  # pragma: no cover - fall back to str below
            pass
    return str(exc)
