"""The local backend's fleet file: which agent deployments run on this machine.

A fleet file (TOML) lists the deployments:

    [defaults]                      # optional
    heartbeat_interval_s = 5
    env = { LOG_LEVEL = "info" }

    [[deployment]]
    name = "math-agent"
    command = ["{python}", "-m", "examples.math_agent"]   # {python} = sys.executable
    replicas = 2
    min = 1
    max = 4
    env = { }                       # optional
    cwd = "."                       # optional, relative to the fleet file's folder
    [deployment.policy]             # optional: a sizing policy, applied when the worker starts
    target_in_flight_per_agent = 2  # min_replicas/max_replicas default to min/max above
    downscale_delay_s = 300

    [[a2a]]                         # optional: an A2A agent that joins by its Agent Card
    card_url = "http://localhost:9999"   # (`agentroster a2a add`, done when the worker starts)
    max_concurrency = 4
    cost_class = "A"

Parsing and validation only; `local_backend` runs the processes.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentroster.models import DEFAULT_HEARTBEAT_INTERVAL_S, PoolPolicy

PYTHON_PLACEHOLDER = "{python}"
# A DNS-1123 label, as Kubernetes requires of the names our deployments mirror.
_DEPLOYMENT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


class FleetError(ValueError):
    """A fleet file that cannot be read or does not validate; the message names the field."""


class _FleetModel(BaseModel):
    # Forbid unknown keys: a typo such as `replica = 2` must fail, not be ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _env_strings(value: Any) -> Any:
    """TOML env values may be numbers or booleans; processes only take strings."""
    if not isinstance(value, dict):
        return value
    out: dict[Any, Any] = {}
    for key, item in value.items():
        if isinstance(item, bool):
            out[key] = "true" if item else "false"
        elif isinstance(item, (int, float)):
            out[key] = str(item)
        else:
            out[key] = item
    return out


class FleetDefaults(_FleetModel):
    """Settings every deployment inherits."""

    heartbeat_interval_s: float = Field(default=DEFAULT_HEARTBEAT_INTERVAL_S, gt=0)
    env: dict[str, str] = Field(default_factory=dict)

    _coerce_env = field_validator("env", mode="before")(_env_strings)


class DeploymentSpec(_FleetModel):
    """One deployment: a command run `replicas` times, scalable within [min, max]."""

    name: str
    command: list[str] = Field(min_length=1)
    replicas: int = Field(default=1, ge=0)
    min: int = Field(default=0, ge=0)
    max: int | None = Field(default=None, ge=0, description="default: replicas")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    heartbeat_interval_s: float | None = Field(default=None, gt=0, description="default: [defaults]")
    policy: dict[str, Any] | None = Field(default=None, description="a PoolPolicy's fields; min/max default to the deployment's")

    _coerce_env = field_validator("env", mode="before")(_env_strings)

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if not _DEPLOYMENT_NAME.match(value):
            raise ValueError(
                f"{value!r} is not a DNS-1123 label (lowercase letters, digits and '-', "
                "starting and ending with a letter or digit, at most 63 characters)"
            )
        return value

    @field_validator("command")
    @classmethod
    def _command_words(cls, value: list[str]) -> list[str]:
        if any(not word for word in value):
            raise ValueError("every word of the command must be a non-empty string")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> DeploymentSpec:
        if self.max is None:
            self.max = self.replicas
        if not self.min <= self.replicas <= self.max:
            raise ValueError(
                f"deployment {self.name!r}: need 0 <= min <= replicas <= max, "
                f"got min={self.min}, replicas={self.replicas}, max={self.max}"
            )
        self.pool_policy()  # a bad policy table fails with the fleet file, naming its field
        return self

    def pool_policy(self) -> PoolPolicy | None:
        """The sizing policy the worker applies at start (None: no [deployment.policy] table)."""
        if self.policy is None:
            return None
        return PoolPolicy.model_validate({"min_replicas": self.min, "max_replicas": self.max_replicas, **self.policy})

    @property
    def max_replicas(self) -> int:
        """`max`, resolved (never None after validation)."""
        return self.max if self.max is not None else self.replicas


class A2AEntry(_FleetModel):
    """An A2A agent the worker registers by its Agent Card when it starts (see `agentroster.client.a2a`)."""

    card_url: str = Field(pattern=r"^https?://")
    deployment: str | None = None
    agent_id: str | None = None
    max_concurrency: int = Field(default=1, ge=1)
    cost_class: Literal["A", "B", "C"] = "B"
    heartbeat_interval_s: float | None = Field(default=None, gt=0, description="default: [defaults]")


class Fleet(_FleetModel):
    """A fleet: defaults and deployments. `base_dir` anchors relative `cwd`s (None: the current folder)."""

    defaults: FleetDefaults = Field(default_factory=FleetDefaults)
    deployments: list[DeploymentSpec] = Field(default_factory=list, alias="deployment")
    a2a: list[A2AEntry] = Field(default_factory=list)
    base_dir: Path | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _unique_names(self) -> Fleet:
        seen: set[str] = set()
        for spec in self.deployments:
            if spec.name in seen:
                raise ValueError(f"deployment name {spec.name!r} is used twice; names must be unique")
            seen.add(spec.name)
        return self

    def get(self, name: str) -> DeploymentSpec | None:
        """The deployment called `name`, or None."""
        return next((spec for spec in self.deployments if spec.name == name), None)

    def resolve_cwd(self, spec: DeploymentSpec) -> Path:
        """The folder `spec`'s processes start in, as an absolute path."""
        base = self.base_dir if self.base_dir is not None else Path.cwd()
        return (base / spec.cwd).resolve() if spec.cwd else base.resolve()


def _describe_errors(error: ValidationError, data: dict[str, Any]) -> str:
    """Pydantic errors as `deployment[0] (math-agent).replicas: message` lines."""
    lines = []
    for item in error.errors():
        parts: list[str] = []
        loc = list(item["loc"])
        for i, key in enumerate(loc):
            if isinstance(key, int) and parts:
                parts[-1] += f"[{key}]"
                # Name the deployment too: an index is hard to find in a long file.
                if loc[:i] == ["deployment"]:
                    entries = data.get("deployment")
                    if isinstance(entries, list) and key < len(entries) and isinstance(entries[key], dict):
                        name = entries[key].get("name")
                        if isinstance(name, str):
                            parts[-1] += f" ({name})"
            else:
                parts.append(str(key))
        where = ".".join(parts) or "fleet"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {message}")
    return "; ".join(lines)


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet file. Raises FleetError naming the file and the field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FleetError(f"fleet file {path}: cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise FleetError(f"fleet file {path}: not valid TOML: {exc}") from exc
    unknown = set(data) - {"defaults", "deployment", "a2a"}
    if unknown:
        raise FleetError(f"fleet file {path}: unknown top-level key(s) {sorted(unknown)}; expected [defaults], [[deployment]] and [[a2a]]")
    try:
        fleet = Fleet.model_validate(data)
    except ValidationError as exc:
        raise FleetError(f"fleet file {path}: {_describe_errors(exc, data)}") from exc
    fleet.base_dir = path.resolve().parent
    return fleet
