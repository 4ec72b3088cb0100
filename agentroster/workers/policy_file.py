"""A file of deployments' policies, applied by the worker at start (`agentroster worker --policies FILE`).

For backends without a fleet file (Kubernetes): one TOML table per deployment,

    [policy.search-agent]
    min_replicas = 1
    max_replicas = 8
    target_in_flight_per_agent = 2
    downscale_delay_s = 300
    max_uses = 200

    [policy.math-agent.outliers]   # no max_replicas: this policy sizes nothing
    consecutive_failures = 5

(or the same shape as JSON). Every field is `PoolPolicy`'s; a bad value fails
with the deployment and the field named, before anything is applied.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentroster.errors import AgentRosterError
from agentroster.messages import SetPolicy
from agentroster.models import PoolPolicy


class PolicyFileError(AgentRosterError, ValueError):
    """A policy file that cannot be read or does not validate; the message names the field."""


def load_policies(path: str | Path) -> dict[str, PoolPolicy]:
    """Read `path` into {deployment: policy}; raises PolicyFileError naming what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
        data: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise PolicyFileError(f"{path}: cannot read: {exc}") from exc
    tables = data.get("policy") if isinstance(data, dict) else None
    if not isinstance(tables, dict):
        raise PolicyFileError(f"{path}: expected [policy.<deployment>] tables")
    out: dict[str, PoolPolicy] = {}
    for deployment, fields in tables.items():
        try:
            out[deployment] = SetPolicy(deployment=deployment, policy=fields).policy  # type: ignore[assignment]
        except ValidationError as exc:
            problems = "; ".join(
                f"policy.{deployment}.{'.'.join(str(p) for p in e['loc'] if p != 'policy') or '(table)'}: {e['msg']}"
                for e in exc.errors()
            )
            raise PolicyFileError(f"{path}: {problems}") from None
    return out
