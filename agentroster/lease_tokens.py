"""Lease tokens: proof that a task sent to an agent comes with a live lease on that agent.

Whoever holds a lease (the worker's invoke activity, or code that called
`roster.acquire` / `roster.borrow`) signs it just before posting the task; the
agent checks the token before running anything. The token travels in an HTTP
header, never in a workflow input, so neither it nor the key enters Temporal's
history:

    Authorization: Lease v1.<base64url payload>.<base64url HMAC-SHA256>

The payload is compact JSON: `pool`, `lease` (the lease id), `agent`, `cap`,
`ver` (capability and version) and `exp` (the lease's deadline when signed,
milliseconds since the epoch). The MAC covers `v1.<payload>` with a key shared
by the workers, the clients that call agents directly, and the agents.

An agent answers 401 when the token is missing, malformed or signed with
another key, and 409 when it is for another agent, pool, lease, capability or
version, or has expired (now > exp + a small clock-skew allowance). The token
is checked when a task starts: a task already running is not cut off when its
token expires (the lease is renewed while it runs; a renewed lease is simply
signed again for the next task).

Keys: `AGENTROSTER_LEASE_KEY` holds the signing key, as text of at least 32
bytes or `base64:<bytes>`; `AGENTROSTER_LEASE_KEY_PREVIOUS` optionally holds
older keys (comma-separated), still accepted by agents during a rotation.
`AGENTROSTER_LEASE_KEY=insecure-no-auth` turns the checks off (local
experiments only). `python -m agentroster.lease_tokens` prints a fresh key.
Instead of the values, `AGENTROSTER_LEASE_KEY_FILE` and
`AGENTROSTER_LEASE_KEY_PREVIOUS_FILE` may name files that hold them (a compose
secret, a mounted Kubernetes Secret), so the key is never in the environment.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from agentroster.contracts import AgentRosterError, Lease

TOKEN_VERSION = "v1"
AUTH_SCHEME = "Lease"
AUTH_HEADER = "Authorization"
INSECURE_NO_AUTH = "insecure-no-auth"
"""The value of AGENTROSTER_LEASE_KEY that turns lease checks off (agents accept any task)."""
MIN_KEY_BYTES = 32
DEFAULT_CLOCK_SKEW_S = 10.0
"""How long after a token's `exp` an agent still accepts it: clocks of signer and agent may differ."""
PLACEHOLDER_PREFIX = "REPLACE-ME"
"""Placeholder values in the deploy files start with this; they are refused as keys."""
LEASE_KEY_MISSING = "LeaseKeyMissing"
"""Error type of the invoke activity when its worker has no lease key (not retried, no failover)."""

KEY_VAR = "AGENTROSTER_LEASE_KEY"
PREVIOUS_KEYS_VAR = "AGENTROSTER_LEASE_KEY_PREVIOUS"
KEY_FILE_VAR = "AGENTROSTER_LEASE_KEY_FILE"
"""A file holding the value of AGENTROSTER_LEASE_KEY (e.g. /run/secrets/lease-key); set one or the other."""
PREVIOUS_KEYS_FILE_VAR = "AGENTROSTER_LEASE_KEY_PREVIOUS_FILE"
"""A file holding the value of AGENTROSTER_LEASE_KEY_PREVIOUS; a missing file means no previous keys."""

# Why a token was refused, and the HTTP status an agent answers with.
MISSING = "missing"
MALFORMED = "malformed"
BAD_SIGNATURE = "bad_signature"
WRONG_POOL = "wrong_pool"
WRONG_AGENT = "wrong_agent"
WRONG_LEASE = "wrong_lease"
WRONG_CAPABILITY = "wrong_capability"
WRONG_VERSION = "wrong_version"
EXPIRED = "expired"
REASON_STATUS = {
    MISSING: 401,
    MALFORMED: 401,
    BAD_SIGNATURE: 401,
    WRONG_POOL: 409,
    WRONG_AGENT: 409,
    WRONG_LEASE: 409,
    WRONG_CAPABILITY: 409,
    WRONG_VERSION: 409,
    EXPIRED: 409,
}


class LeaseKeyError(AgentRosterError, ValueError):
    """A lease key is missing, too short, a placeholder, or not valid base64."""


class LeaseTokenError(Exception):
    """A token an agent refuses: `reason` is one of the reason constants, `status` its HTTP status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = REASON_STATUS[reason]


# ------------------------------------------------------------------- keys
def _b64decode(text: str) -> bytes:
    """Standard or URL-safe base64, padding optional."""
    cleaned = "".join(text.split()).replace("-", "+").replace("_", "/")
    cleaned += "=" * (-len(cleaned) % 4)
    return base64.b64decode(cleaned, validate=True)


def parse_key(text: str, *, name: str = KEY_VAR) -> bytes:
    """One key: raw text (its UTF-8 bytes) or `base64:<...>`; at least MIN_KEY_BYTES bytes."""
    value = text.strip()
    if not value:
        raise LeaseKeyError(f"{name}: empty key")
    if value.upper().startswith(PLACEHOLDER_PREFIX):
        raise LeaseKeyError(f"{name}: still the placeholder from the deploy files; replace it with a key of your own ({_HOW_TO_GENERATE})")
    if value == INSECURE_NO_AUTH:
        raise LeaseKeyError(f"{name}: {INSECURE_NO_AUTH!r} turns checks off; it cannot be used as a key")
    if value.startswith("base64:"):
        try:
            key = _b64decode(value[len("base64:") :])
        except (binascii.Error, ValueError) as exc:
            raise LeaseKeyError(f"{name}: not valid base64 after 'base64:': {exc}") from exc
    else:
        key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise LeaseKeyError(f"{name}: the key is {len(key)} bytes; use at least {MIN_KEY_BYTES} ({_HOW_TO_GENERATE})")
    return key


def _read_key_file(var: str, path: str, *, missing_ok: bool) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        if missing_ok:
            return ""
        raise LeaseKeyError(f"{var}={path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LeaseKeyError(f"{var}={path}: cannot read the file: {exc}") from exc


def key_values_from_env(env: Mapping[str, str]) -> tuple[str, str]:
    """The raw values of the signing key and the previous keys, from the variables or the files they name.

    AGENTROSTER_LEASE_KEY_FILE is read whole (a trailing newline is ignored); an
    empty file is an error, not "no key". A missing AGENTROSTER_LEASE_KEY_PREVIOUS_FILE
    means no previous keys (a mounted Secret has the file only while keys rotate).
    Setting a variable and its _FILE twin together is refused: which one wins would be a guess.
    """
    values = []
    for var, file_var, missing_ok in ((KEY_VAR, KEY_FILE_VAR, False), (PREVIOUS_KEYS_VAR, PREVIOUS_KEYS_FILE_VAR, True)):
        value = env.get(var, "").strip()
        path = env.get(file_var, "").strip()
        if value and path:
            raise LeaseKeyError(f"set {var} or {file_var}, not both")
        if path:
            value = _read_key_file(file_var, path, missing_ok=missing_ok).strip()
            if not value and not missing_ok:
                raise LeaseKeyError(f"{file_var}={path}: the file is empty ({_HOW_TO_GENERATE})")
        values.append(value)
    return values[0], values[1]


_HOW_TO_GENERATE = "e.g. `python -m agentroster.lease_tokens` or `echo base64:$(openssl rand -base64 32)`"


def generate_key() -> str:
    """A fresh random key, in the `base64:` form the environment variable takes."""
    return "base64:" + base64.b64encode(secrets.token_bytes(32)).decode()


@dataclass(frozen=True, repr=False)
class LeaseKeys:
    """The keys a process signs and verifies with: the first signs, all verify.

    `insecure=True` (AGENTROSTER_LEASE_KEY=insecure-no-auth) means no checks at all:
    agents accept any task and signers send no token.
    """

    keys: tuple[bytes, ...] = ()
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.insecure:
            if self.keys:
                raise LeaseKeyError("insecure lease keys hold no key")
            return
        if not self.keys:
            raise LeaseKeyError("at least one lease key is needed (or the explicit insecure opt-out)")
        for key in self.keys:
            if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
                raise LeaseKeyError(f"a lease key must be at least {MIN_KEY_BYTES} bytes")

    def __repr__(self) -> str:  # never print a key
        return "LeaseKeys(insecure)" if self.insecure else f"LeaseKeys({len(self.keys)} key(s))"

    @classmethod
    def parse(cls, key: str, previous: str | Iterable[str] | None = None) -> LeaseKeys:
        """From the variables' values: `key` signs (or is `insecure-no-auth`), `previous` also verify."""
        if key.strip() == INSECURE_NO_AUTH:
            return cls.disabled()
        keys = [parse_key(key)]
        olds = previous.split(",") if isinstance(previous, str) else list(previous or ())
        keys += [parse_key(old, name=PREVIOUS_KEYS_VAR) for old in olds if old.strip()]
        return cls(tuple(keys))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LeaseKeys | None:
        """From AGENTROSTER_LEASE_KEY and AGENTROSTER_LEASE_KEY_PREVIOUS; None when the key is unset.

        Either variable may instead be given as a file (`..._FILE`, see `key_values_from_env`).
        """
        key, previous = key_values_from_env(env)
        if not key:
            return None
        return cls.parse(key, previous)

    @classmethod
    def disabled(cls) -> LeaseKeys:
        return cls(insecure=True)

    @classmethod
    def of(cls, value: LeaseKeys | str | bytes) -> LeaseKeys:
        """A LeaseKeys, a key as the variable takes it (or `insecure-no-auth`), or raw key bytes."""
        if isinstance(value, LeaseKeys):
            return value
        if isinstance(value, bytes):
            return cls((value,))
        return cls.parse(value)

    @property
    def enabled(self) -> bool:
        return not self.insecure

    def sign(self, lease: Lease | LeaseClaims) -> str:
        """The token for `lease` (its deadline is the token's expiry). Raises when checks are off."""
        if self.insecure:
            raise LeaseKeyError(f"{KEY_VAR}={INSECURE_NO_AUTH}: there is no key to sign with")
        claims = lease if isinstance(lease, LeaseClaims) else LeaseClaims.for_lease(lease)
        return sign_token(self.keys[0], claims)

    def headers(self, lease: Lease | LeaseClaims) -> dict[str, str]:
        """The HTTP headers that carry `lease`'s token; none when checks are off."""
        if self.insecure:
            return {}
        return {AUTH_HEADER: f"{AUTH_SCHEME} {self.sign(lease)}"}

    def verify(self, token: str | None) -> LeaseClaims:
        """The token's claims if one of our keys signed it (raises LeaseTokenError, 401 reasons)."""
        if self.insecure:
            raise LeaseKeyError("lease checks are off: nothing to verify")
        return verify_token(token, self.keys)


# ----------------------------------------------------------------- tokens
@dataclass(frozen=True)
class LeaseClaims:
    """What a token says: this lease, on this agent, for this capability and version, until `expires_at`."""

    pool: str
    lease_id: str
    agent_id: str
    capability: str
    version: str
    expires_at: datetime

    @classmethod
    def for_lease(cls, lease: Lease) -> LeaseClaims:
        return cls(
            pool=lease.pool,
            lease_id=lease.lease_id,
            agent_id=lease.agent_id,
            capability=lease.capability,
            version=lease.version,
            expires_at=lease.deadline,
        )

    def _payload(self) -> dict[str, Any]:
        expires = self.expires_at if self.expires_at.tzinfo else self.expires_at.replace(tzinfo=timezone.utc)
        return {
            "pool": self.pool,
            "lease": self.lease_id,
            "agent": self.agent_id,
            "cap": self.capability,
            "ver": self.version,
            "exp": (expires - _EPOCH) // timedelta(milliseconds=1),  # exact: no float rounding
        }


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    """Strict: unpadded URL-safe base64 in its one canonical spelling (no two tokens mean the same)."""
    if not text or any(c not in _URLSAFE for c in text):
        raise ValueError("not base64url")
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64url(data) != text:
        raise ValueError("not canonical base64url")
    return data


_URLSAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _mac(key: bytes, signed: str) -> bytes:
    return hmac.new(key, signed.encode("ascii"), hashlib.sha256).digest()


def sign_token(key: bytes, claims: LeaseClaims) -> str:
    """`v1.<payload>.<mac>` for `claims`, signed with `key`."""
    payload = json.dumps(claims._payload(), separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    signed = f"{TOKEN_VERSION}.{_b64url(payload.encode())}"
    return f"{signed}.{_b64url(_mac(key, signed))}"


def verify_token(token: str | None, keys: Iterable[bytes]) -> LeaseClaims:
    """The claims of a token one of `keys` signed; raises LeaseTokenError (missing, malformed, bad_signature)."""
    if not token:
        raise LeaseTokenError(MISSING, f"no lease token: send `{AUTH_HEADER}: {AUTH_SCHEME} <token>` signed with the shared lease key")
    parts = token.split(".")
    if len(parts) != 3:
        raise LeaseTokenError(MALFORMED, "malformed lease token: expected three dot-separated parts")
    version, payload_b64, mac_b64 = parts
    if version != TOKEN_VERSION:
        raise LeaseTokenError(MALFORMED, f"malformed lease token: unsupported version {version[:10]!r} (expected {TOKEN_VERSION!r})")
    try:
        mac = _unb64url(mac_b64)
        raw = _unb64url(payload_b64)
    except (ValueError, binascii.Error) as exc:
        raise LeaseTokenError(MALFORMED, "malformed lease token: a part is not base64url") from exc
    signed = f"{version}.{payload_b64}"
    # Every key is tried (no early exit), so timing tells nothing about which one matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(_mac(key, signed), mac)
    if not matched:
        raise LeaseTokenError(BAD_SIGNATURE, "lease token signature does not verify: it was not signed with this agent's lease key")
    try:
        data = json.loads(raw.decode("utf-8"))
        fields = {name: data[name] for name in ("pool", "lease", "agent", "cap", "ver")}
        exp = data["exp"]
        if not all(isinstance(v, str) for v in fields.values()) or type(exp) is not int:
            raise TypeError("wrong field types")
        expires_at = _EPOCH + timedelta(milliseconds=exp)
    except (ValueError, TypeError, KeyError, OverflowError, OSError, UnicodeDecodeError) as exc:
        raise LeaseTokenError(MALFORMED, f"malformed lease token payload: {type(exc).__name__}") from exc
    return LeaseClaims(
        pool=fields["pool"],
        lease_id=fields["lease"],
        agent_id=fields["agent"],
        capability=fields["cap"],
        version=fields["ver"],
        expires_at=expires_at,
    )


def check_claims(
    claims: LeaseClaims,
    *,
    agent_id: str,
    capability: str,
    version: str | None = None,
    lease_id: str | None = None,
    pool: str | None = None,
    now: float | None = None,
    clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
) -> None:
    """Raise LeaseTokenError (409 reasons) unless the claims are for this agent and task, and not expired.

    `pool`, `version` and `lease_id` are checked when given. `now` is seconds since the epoch.
    """
    if claims.agent_id != agent_id:
        raise LeaseTokenError(WRONG_AGENT, f"the lease token is for agent {claims.agent_id!r}, not {agent_id!r}")
    if pool is not None and claims.pool != pool:
        raise LeaseTokenError(WRONG_POOL, f"the lease token is for pool {claims.pool!r}; agent {agent_id} is in pool {pool!r}")
    if lease_id is not None and claims.lease_id != lease_id:
        raise LeaseTokenError(WRONG_LEASE, f"the lease token is for lease {claims.lease_id!r}, the task names lease {lease_id!r}")
    if claims.capability != capability:
        raise LeaseTokenError(WRONG_CAPABILITY, f"the lease token is for capability {claims.capability!r}, not {capability!r}")
    if version is not None and claims.version != version:
        raise LeaseTokenError(WRONG_VERSION, f"the lease token is for {claims.capability}@{claims.version}, the task names version {version}")
    current = time.time() if now is None else now
    late = current - claims.expires_at.timestamp()
    if late > clock_skew_s:
        raise LeaseTokenError(
            EXPIRED,
            f"lease {claims.lease_id} expired at {claims.expires_at.isoformat()} ({late:.1f}s ago, "
            f"beyond the {clock_skew_s:g}s clock-skew allowance); acquire a new lease",
        )


def token_from_header(value: str | None) -> str | None:
    """The token of an `Authorization: Lease <token>` header value; None when absent.

    Raises LeaseTokenError (malformed) for another scheme.
    """
    if value is None or not value.strip():
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != AUTH_SCHEME.lower() or not token.strip():
        raise LeaseTokenError(MALFORMED, f"expected `{AUTH_HEADER}: {AUTH_SCHEME} <token>`, got the {scheme[:20]!r} scheme")
    return token.strip()


__all__ = [
    "AUTH_HEADER",
    "AUTH_SCHEME",
    "DEFAULT_CLOCK_SKEW_S",
    "INSECURE_NO_AUTH",
    "LEASE_KEY_MISSING",
    "LeaseClaims",
    "LeaseKeyError",
    "LeaseKeys",
    "LeaseTokenError",
    "check_claims",
    "generate_key",
    "key_values_from_env",
    "parse_key",
    "sign_token",
    "token_from_header",
    "verify_token",
]


if __name__ == "__main__":
    print(generate_key())
