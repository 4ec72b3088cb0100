"""Settings and their defaults, read from the environment in one place.

| variable | default |
|---|---|
| TEMPORAL_ADDRESS | localhost:7233 |
| TEMPORAL_NAMESPACE | default |
| TEMPORAL_API_KEY | (none; turns TLS on) |
| TEMPORAL_TLS | off (`true` for TLS with the system roots) |
| TEMPORAL_TLS_CERT / TEMPORAL_TLS_KEY | mTLS client pair (PEM files) |
| TEMPORAL_TLS_CA / TEMPORAL_TLS_SERVER_NAME | server CA (PEM file) and name |
| AGENTROSTER_POOL | default |
| AGENTROSTER_TASK_QUEUE | agentroster |
| AGENTROSTER_POOL_SHARDS | 1: pool workflows per pool (`4`, `4:agent`, or per pool `prod=4,staging=2:agent`; see docs/concepts/shards.md) |
| AGENTROSTER_BACKEND | none |
| AGENTROSTER_FLEET | (none) fleet file of the local backend |
| AGENTROSTER_LEASE_KEY | (none) key of the lease tokens: text of >= 32 bytes, `base64:...`, or `insecure-no-auth` |
| AGENTROSTER_LEASE_KEY_PREVIOUS | (none) older keys agents still accept while keys rotate (comma-separated) |
| AGENTROSTER_LEASE_KEY_FILE, AGENTROSTER_LEASE_KEY_PREVIOUS_FILE | (none) files holding those values instead (secrets mounted as files) |
| AGENTROSTER_METRICS_PORT | off; `on` = 9464: the worker's Prometheus `/metrics` port |
| AGENTROSTER_METRICS_POOLS | (none) more pools to export beside AGENTROSTER_POOL and the discovered ones (comma-separated) |
| AGENTROSTER_SDK_METRICS | `bridge`: the Temporal SDK's metrics on a loopback port, appended to `/metrics`; `off`; or HOST:PORT to serve them there instead |
| AGENTROSTER_OTEL | off; `1` traces workflows and activities with OpenTelemetry (standard OTEL_* exporter variables) |
| AGENTROSTER_WORKFLOW_CACHE | 2000: workflows a worker keeps in memory (~250 KiB each); one evicted is replayed at its next task |
| AGENTROSTER_GC_FREEZE | on: the worker keeps its cached runs' objects out of Python's full garbage collections (agentroster.ops.heap); `off` leaves the collector as it is |
| AGENTROSTER_LEASE_PREFETCH_S | 0.25: how long a worker keeps a lease prefetched for a stream's next supervisor task; 0: off |

An agent refuses to start without AGENTROSTER_LEASE_KEY; a worker without it
starts, but fails every task it would send to an agent (see agentroster.client.lease_tokens).

Beside a running `agentroster dev` (its state folder `.agentroster` in the working
directory or a parent), TEMPORAL_ADDRESS and the lease key default to that stack's
(`running_dev_stack`): scripts and agents started by hand need no exports.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from temporalio.service import TLSConfig

from agentroster.errors import AgentRosterError
from agentroster.models import check_pool_name
from agentroster.vocabulary.shards import ShardLayout
from agentroster.client.lease_tokens import KEY_FILE_VAR, KEY_VAR, LeaseKeys

DEFAULT_ADDRESS = "localhost:7233"
DEFAULT_NAMESPACE = "default"
DEFAULT_POOL = "default"
DEFAULT_TASK_QUEUE = "agentroster"
DEFAULT_BACKEND = "none"
BACKENDS = ("none", "local", "kubernetes")
DEFAULT_METRICS_PORT = 9464
# `agentroster dev`'s state folder (default `--db .agentroster/temporal.db`) and the lock its
# process holds there, which records where its server listens (see agentroster.workers.dev_view).
DEV_STATE_DIR = ".agentroster"
DEV_LOCK_NAME = "dev.lock"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")

def _env(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def tls_from_env(env: Mapping[str, str] | None = None) -> bool | TLSConfig:
    """TLS settings from the environment: False, True (system roots) or a TLSConfig."""
    env = os.environ if env is None else env

    def read(var: str) -> bytes | None:
        path = _env(env, var)
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise AgentRosterError(f"{var}={path}: cannot read the file: {exc.strerror}") from exc

    cert, key, ca = read("TEMPORAL_TLS_CERT"), read("TEMPORAL_TLS_KEY"), read("TEMPORAL_TLS_CA")
    server_name = _env(env, "TEMPORAL_TLS_SERVER_NAME")
    if (cert is None) != (key is None):
        raise AgentRosterError("TEMPORAL_TLS_CERT and TEMPORAL_TLS_KEY must be set together (an mTLS client pair)")
    if cert or ca or server_name:
        return TLSConfig(client_cert=cert, client_private_key=key, server_root_ca_cert=ca, domain=server_name)
    return (_env(env, "TEMPORAL_TLS") or "").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Settings:
    """Where the roster lives: the Temporal connection, the pool, the task queue, the backend."""

    address: str = DEFAULT_ADDRESS
    namespace: str = DEFAULT_NAMESPACE
    pool: str = DEFAULT_POOL
    task_queue: str = DEFAULT_TASK_QUEUE
    backend: str = DEFAULT_BACKEND
    api_key: str | None = None
    fleet: str | None = None
    metrics_port: int | None = None  # None: no /metrics endpoint
    metrics_pools: tuple[str, ...] = ()
    sdk_metrics: str = "bridge"  # "bridge", "off" or HOST:PORT
    otel: bool = False
    workflow_cache: int | None = None  # None: create_worker's default (worker.WORKFLOW_CACHE)
    gc_freeze: bool = True  # create_worker's freeze_long_lived
    # AGENTROSTER_POOL_SHARDS: pool -> layout ("" is every pool not named)
    pool_shards: tuple[tuple[str, ShardLayout], ...] = ()

    def shards_for(self, pool: str) -> ShardLayout:
        """The shard layout this process assumes for `pool` (1 shard unless AGENTROSTER_POOL_SHARDS says otherwise)."""
        layouts = dict(self.pool_shards)
        return layouts.get(pool) or layouts.get("") or ShardLayout()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the environment; unset or empty variables take the defaults (TEMPORAL_ADDRESS: a
        running dev stack's, see `running_dev_stack`, when `env` is the process environment)."""
        dev = running_dev_stack() if env is None and not _env(os.environ, "TEMPORAL_ADDRESS") else None
        env = os.environ if env is None else env
        backend = _env(env, "AGENTROSTER_BACKEND") or DEFAULT_BACKEND
        if backend not in BACKENDS:
            raise AgentRosterError(f"AGENTROSTER_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
        pool = _env(env, "AGENTROSTER_POOL") or DEFAULT_POOL
        try:
            check_pool_name(pool)
        except ValueError as exc:
            raise AgentRosterError(f"AGENTROSTER_POOL: {exc}") from exc
        return cls(
            address=_env(env, "TEMPORAL_ADDRESS") or (dev.address if dev is not None else DEFAULT_ADDRESS),
            namespace=_env(env, "TEMPORAL_NAMESPACE") or DEFAULT_NAMESPACE,
            pool=pool,
            task_queue=_env(env, "AGENTROSTER_TASK_QUEUE") or DEFAULT_TASK_QUEUE,
            backend=backend,
            api_key=_env(env, "TEMPORAL_API_KEY"),
            fleet=_env(env, "AGENTROSTER_FLEET"),
            metrics_port=metrics_port_from_env(env),
            metrics_pools=_pools_from_env(env, "AGENTROSTER_METRICS_POOLS"),
            sdk_metrics=_sdk_metrics_from_env(env),
            otel=flag_from_env(env, "AGENTROSTER_OTEL"),
            pool_shards=pool_shards_from_env(env),
            workflow_cache=workflow_cache_from_env(env),
            gc_freeze=flag_from_env(env, "AGENTROSTER_GC_FREEZE", default=True),
        )

    def tls(self, env: Mapping[str, str] | None = None) -> bool | TLSConfig:
        """TLS from the environment; an API key alone turns TLS on with the system roots."""
        return tls_from_env(env) or (True if self.api_key else False)


def flag_from_env(env: Mapping[str, str], name: str, *, default: bool = False) -> bool:
    """An on/off variable: 1/true/yes/on or 0/false/no/off (unset: `default`); anything else is an error."""
    value = (_env(env, name) or ("on" if default else "off")).lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise AgentRosterError(f"{name}={value!r}: expected 1/true/yes/on or 0/false/no/off")


def pool_shards_from_env(env: Mapping[str, str] | None = None) -> tuple[tuple[str, ShardLayout], ...]:
    """AGENTROSTER_POOL_SHARDS: `4` / `4:agent` for every pool, or `prod=4,staging=2:agent` per pool (both may mix)."""
    env = os.environ if env is None else env
    value = _env(env, "AGENTROSTER_POOL_SHARDS") or ""
    out: list[tuple[str, ShardLayout]] = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        pool, sep, layout = part.rpartition("=")
        try:
            if sep:
                check_pool_name(pool.strip())
            if not layout.strip():
                raise ValueError(f"{part!r}: expected a shard count after '='")
            out.append((pool.strip(), ShardLayout.parse(layout)))
        except ValueError as exc:
            raise AgentRosterError(f"AGENTROSTER_POOL_SHARDS={value!r}: {exc}") from exc
    return tuple(out)


def metrics_port_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """AGENTROSTER_METRICS_PORT: a port (1-65535), `on` for 9464, or unset/`off`/`0` for no endpoint."""
    env = os.environ if env is None else env
    value = (_env(env, "AGENTROSTER_METRICS_PORT") or "off").lower()
    if value in _OFF:
        return None
    if value in ("true", "yes", "on"):
        return DEFAULT_METRICS_PORT
    if value.isdigit() and 1 <= int(value) <= 65535:
        return int(value)
    raise AgentRosterError(f"AGENTROSTER_METRICS_PORT={value!r}: expected a port (1-65535), on ({DEFAULT_METRICS_PORT}) or off")


MAX_WORKFLOW_CACHE = 1_000_000


def workflow_cache_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """AGENTROSTER_WORKFLOW_CACHE: how many workflows a worker keeps cached (1 to 1,000,000); unset: create_worker's default."""
    env = os.environ if env is None else env
    value = _env(env, "AGENTROSTER_WORKFLOW_CACHE")
    if value is None:
        return None
    try:
        count = int(value.replace("_", "").replace(",", ""))
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_WORKFLOW_CACHE:
        raise AgentRosterError(
            f"AGENTROSTER_WORKFLOW_CACHE={value!r}: expected a whole number of workflows from 1 to {MAX_WORKFLOW_CACHE:,} "
            "(each cached workflow holds ~250 KiB of the worker's memory)"
        )
    return count


MAX_LEASE_PREFETCH_S = 5.0


def lease_prefetch_from_env(env: Mapping[str, str] | None = None) -> float | None:
    """AGENTROSTER_LEASE_PREFETCH_S: how long a worker keeps a lease prefetched for a stream's
    next supervisor task (0 to 5 s; 0: no prefetching); unset: create_worker's default."""
    env = os.environ if env is None else env
    value = _env(env, "AGENTROSTER_LEASE_PREFETCH_S")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0.0 <= seconds <= MAX_LEASE_PREFETCH_S:  # (NaN fails both)
        raise AgentRosterError(
            f"AGENTROSTER_LEASE_PREFETCH_S={value!r}: expected seconds from 0 (off) to {MAX_LEASE_PREFETCH_S:g} "
            "(a prefetched lease holds an agent's slot that long before its task comes)"
        )
    return seconds


def _pools_from_env(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    pools = tuple(p.strip() for p in (_env(env, name) or "").split(",") if p.strip())
    for pool in pools:
        try:
            check_pool_name(pool)
        except ValueError as exc:
            raise AgentRosterError(f"{name}: {exc}") from exc
    return pools


def _sdk_metrics_from_env(env: Mapping[str, str]) -> str:
    value = _env(env, "AGENTROSTER_SDK_METRICS") or "bridge"
    if value.lower() in ("bridge", "off"):
        return value.lower()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AgentRosterError(f"AGENTROSTER_SDK_METRICS={value!r}: expected bridge, off, or HOST:PORT (e.g. 0.0.0.0:9465)")
    return value


@dataclass(frozen=True)
class DevStack:
    """A running `agentroster dev`, as its lock file describes it."""

    pid: int
    address: str
    lease_key_file: Path | None  # the stack's own key, when it made one (no key was given to it)


def running_dev_stack(start: Path | None = None) -> DevStack | None:
    """The `agentroster dev` whose state folder (`.agentroster`) is in `start` (default: the
    working directory) or a parent, if its process still runs; None otherwise."""
    folder = (start or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        lock = candidate / DEV_STATE_DIR / DEV_LOCK_NAME
        try:
            info = json.loads(lock.read_text() or "{}")
            pid, port = int(info["pid"]), int(info["port"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None  # the stack of this folder has stopped
        except PermissionError:
            pass  # another user's process: it runs
        key_file = info.get("lease_key_file")
        return DevStack(pid=pid, address=f"localhost:{port}", lease_key_file=Path(key_file) if key_file else None)
    return None


def lease_keys_from_env(env: Mapping[str, str] | None = None) -> LeaseKeys | None:
    """The lease keys of AGENTROSTER_LEASE_KEY (and _PREVIOUS); None when unset.

    When neither AGENTROSTER_LEASE_KEY nor AGENTROSTER_LEASE_KEY_FILE is set in the
    process environment, a running dev stack's key file is read (`running_dev_stack`).
    Raises LeaseKeyError (an AgentRosterError) for a key that is too short, a
    placeholder, or bad base64.
    """
    if env is None:
        env = os.environ
        if not _env(env, KEY_VAR) and not _env(env, KEY_FILE_VAR):
            dev = running_dev_stack()
            if dev is not None and dev.lease_key_file is not None:
                env = {**env, KEY_FILE_VAR: str(dev.lease_key_file)}
    return LeaseKeys.from_env(env)


def resolve_lease_keys(value: LeaseKeys | str | bytes | None, env: Mapping[str, str] | None = None) -> LeaseKeys | None:
    """`value` as LeaseKeys (a key string, `insecure-no-auth`, raw bytes), or the environment's when None."""
    if value is None:
        return lease_keys_from_env(env)
    return LeaseKeys.of(value)


LEASE_KEY_HELP = (
    f"set {KEY_VAR} to the key shared by the workers and the agents (text of at least 32 bytes, "
    f"or base64:...; `python -m agentroster.client.lease_tokens` prints a fresh one) or {KEY_FILE_VAR} to a file holding it, "
    f"or {KEY_VAR}=insecure-no-auth to run without lease checks (local experiments only)"
)
