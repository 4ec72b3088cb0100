"""Lease tokens: proof that a task sent to an agent comes with a live lease on that agent.

A lease token is a standard JWT (RFC 7519), signed with HS256 (PyJWT) by
whoever holds the lease (the worker's invoke activity, or code that called
`roster.acquire`) just before posting the task, and checked by the agent before
it runs anything. It travels in an HTTP header, never in a workflow input, so
neither the token nor the key enters Temporal's history:

    Authorization: Bearer <JWT>

    header  {"alg": "HS256", "typ": "JWT", "kid": <key id>}
    claims  {"aud": <agent id>, "jti": <lease id>, "exp": <lease deadline>,
             "pool": ..., "capability": ..., "version": ...}

`exp` is the lease's deadline in whole seconds, rounded down: a token never
outlives its lease. `kid` is the first 16 hex digits of the SHA-256 of the
signing key's bytes, so a verifier holding several keys (a rotation) picks the
one that signed. An agent written in another language checks a token with its
own JWT library: HS256 only, its key bytes, audience = its agent id; then it
compares `jti`, `pool`, `capability` and `version` with the task it was sent.

An agent answers 401 when the token is missing or malformed, names another
algorithm, has a `kid` none of its keys has, or fails the signature check; and
409 when the token is for another agent (`aud`), pool, lease, capability or
version, or has expired (now > exp + a small clock-skew allowance). The token
is checked when a task starts: a task already running is not cut off when its
token expires (a renewed lease is signed again for the next task).

Keys: `AGENTROSTER_LEASE_KEY` holds the signing key, as text of at least 32
bytes or `base64:<bytes>`; `AGENTROSTER_LEASE_KEY_PREVIOUS` optionally holds
older keys (comma-separated), still accepted by agents during a rotation.
`AGENTROSTER_LEASE_KEY=insecure-no-auth` turns the checks off (local
experiments only). `python -m agentroster.client.lease_tokens` prints a fresh key.
Instead of the values, `AGENTROSTER_LEASE_KEY_FILE` and
`AGENTROSTER_LEASE_KEY_PREVIOUS_FILE` may name files that hold them (a compose
secret, a mounted Kubernetes Secret), so the key is never in the environment.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import jwt

from agentroster.errors import AgentRosterError
from agentroster.models import Lease

ALGORITHM = "HS256"
AUTH_HEADER = "Authorization"
AUTH_SCHEME = "Bearer"
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

# Why a token was refused. An agent answers 401 for a token that is not ours, 409 for one of ours that is for
# another task or has expired.
MISSING = "missing"
MALFORMED = "malformed"
WRONG_ALGORITHM = "wrong_algorithm"
UNKNOWN_KID = "unknown_kid"
BAD_SIGNATURE = "bad_signature"
WRONG_AUDIENCE = "wrong_audience"
WRONG_POOL = "wrong_pool"
WRONG_LEASE = "wrong_lease"
WRONG_CAPABILITY = "wrong_capability"
WRONG_VERSION = "wrong_version"
EXPIRED = "expired"
UNAUTHENTICATED = frozenset({MISSING, MALFORMED, WRONG_ALGORITHM, UNKNOWN_KID, BAD_SIGNATURE})


class LeaseKeyError(AgentRosterError, ValueError):
    """A lease key is too short, a placeholder, not valid base64, or unreadable."""


class LeaseTokenError(Exception):
    """A token an agent refuses: `reason` is one of the reason constants, `status` its HTTP status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = 401 if reason in UNAUTHENTICATED else 409


# ------------------------------------------------------------------- keys
_HOW_TO_GENERATE = "e.g. `python -m agentroster.client.lease_tokens` or `echo base64:$(openssl rand -base64 32)`"


def parse_key(text: str, *, name: str = KEY_VAR) -> bytes:
    """One key: raw text (its UTF-8 bytes) or `base64:<...>` (standard or URL-safe); at least MIN_KEY_BYTES bytes."""
    value = text.strip()
    if not value:
        raise LeaseKeyError(f"{name}: empty key")
    if value.upper().startswith(PLACEHOLDER_PREFIX):
        raise LeaseKeyError(f"{name}: still the placeholder from the deploy files; replace it with a key of your own ({_HOW_TO_GENERATE})")
    if value == INSECURE_NO_AUTH:
        raise LeaseKeyError(f"{name}: {INSECURE_NO_AUTH!r} turns checks off; it cannot be used as a key")
    if value.startswith("base64:"):
        encoded = "".join(value[len("base64:") :].split()).replace("-", "+").replace("_", "/")
        try:
            key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
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


def generate_key() -> str:
    """A fresh random key, in the `base64:` form the environment variable takes."""
    return "base64:" + base64.b64encode(secrets.token_bytes(32)).decode()


def key_id(key: bytes) -> str:
    """The `kid` of tokens signed with `key`: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:16]


@dataclass(frozen=True, repr=False)
class LeaseKeys:
    """The keys a process signs and verifies with: the first signs, all verify (found by `kid`).

    `insecure=True` (AGENTROSTER_LEASE_KEY=insecure-no-auth) means no checks at all:
    agents accept any task and signers send no token.
    """

    keys: tuple[bytes, ...] = ()
    insecure: bool = False
    _by_kid: dict[str, bytes] = field(init=False, compare=False, default_factory=dict)

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
        self._by_kid.update((key_id(key), key) for key in reversed(self.keys))

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
        """From AGENTROSTER_LEASE_KEY and AGENTROSTER_LEASE_KEY_PREVIOUS (or their _FILE twins); None when unset."""
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
        """The JWT for `lease` (its deadline is the token's `exp`). Raises when checks are off."""
        if self.insecure:
            raise LeaseKeyError(f"{KEY_VAR}={INSECURE_NO_AUTH}: there is no key to sign with")
        claims = lease if isinstance(lease, LeaseClaims) else LeaseClaims.for_lease(lease)
        key = self.keys[0]
        return jwt.encode(claims.to_jwt(), key, algorithm=ALGORITHM, headers={"kid": key_id(key)})

    def headers(self, lease: Lease | LeaseClaims) -> dict[str, str]:
        """The HTTP headers that carry `lease`'s token; none when checks are off."""
        if self.insecure:
            return {}
        return {AUTH_HEADER: f"{AUTH_SCHEME} {self.sign(lease)}"}

    def verify(self, token: str | None, *, audience: str, clock_skew_s: float = DEFAULT_CLOCK_SKEW_S) -> LeaseClaims:
        """The claims of a token one of our keys signed for agent `audience`, not expired.

        Raises LeaseTokenError: 401 reasons for a token that is not ours, 409 for
        one of ours that is for another agent or has expired.
        """
        if self.insecure:
            raise LeaseKeyError("lease checks are off: nothing to verify")
        if not token:
            raise LeaseTokenError(MISSING, f"no lease token: send `{AUTH_HEADER}: {AUTH_SCHEME} <token>` signed with the shared lease key")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError as exc:
            raise LeaseTokenError(MALFORMED, f"malformed lease token: {exc}") from exc
        if header.get("alg") != ALGORITHM:
            raise LeaseTokenError(WRONG_ALGORITHM, f"the lease token names alg {header.get('alg')!r}; lease tokens are signed {ALGORITHM}")
        key = self._by_kid.get(header.get("kid", ""))
        if key is None:
            raise LeaseTokenError(
                UNKNOWN_KID,
                f"the lease token's kid {header.get('kid')!r} is none of this agent's lease keys: "
                f"it was signed with another {KEY_VAR}",
            )
        try:
            payload = jwt.decode(
                token,
                key,
                algorithms=[ALGORITHM],
                audience=audience,
                leeway=clock_skew_s,
                options={"require": ["aud", "exp", "jti"], "strict_aud": True},
            )
        except jwt.InvalidSignatureError as exc:
            raise LeaseTokenError(BAD_SIGNATURE, "lease token signature does not verify: the token was altered") from exc
        except jwt.ExpiredSignatureError as exc:
            raise _expired(token, clock_skew_s) from exc
        except jwt.InvalidAudienceError as exc:
            aud = jwt.decode(token, options={"verify_signature": False}).get("aud")  # the signature verified
            raise LeaseTokenError(WRONG_AUDIENCE, f"the lease token is for agent {aud!r} (aud), not {audience!r}") from exc
        except jwt.InvalidTokenError as exc:
            raise LeaseTokenError(MALFORMED, f"malformed lease token: {exc}") from exc
        return LeaseClaims.from_jwt(payload)


def _expired(token: str, clock_skew_s: float) -> LeaseTokenError:
    payload = jwt.decode(token, options={"verify_signature": False})  # called once the signature verified
    expires_at = datetime.fromtimestamp(int(payload["exp"]), tz=timezone.utc)
    return LeaseTokenError(
        EXPIRED,
        f"lease {payload.get('jti')} expired at {expires_at.isoformat()} "
        f"(beyond the {clock_skew_s:g}s clock-skew allowance); acquire a new lease",
    )


# ----------------------------------------------------------------- claims
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

    def to_jwt(self) -> dict[str, Any]:
        expires = self.expires_at if self.expires_at.tzinfo else self.expires_at.replace(tzinfo=timezone.utc)
        return {
            "aud": self.agent_id,
            "jti": self.lease_id,
            "exp": math.floor(expires.timestamp()),
            "pool": self.pool,
            "capability": self.capability,
            "version": self.version,
        }

    @classmethod
    def from_jwt(cls, payload: Mapping[str, Any]) -> LeaseClaims:
        """From a verified payload; raises LeaseTokenError (malformed) for a missing or non-string claim."""
        names = ("aud", "jti", "pool", "capability", "version")
        wrong = [name for name in names if not isinstance(payload.get(name), str)]
        if wrong:
            raise LeaseTokenError(MALFORMED, f"malformed lease token: claim(s) {', '.join(wrong)} missing or not a string")
        return cls(
            pool=payload["pool"],
            lease_id=payload["jti"],
            agent_id=payload["aud"],
            capability=payload["capability"],
            version=payload["version"],
            expires_at=datetime.fromtimestamp(int(payload["exp"]), tz=timezone.utc),
        )


def check_claims(
    claims: LeaseClaims,
    *,
    capability: str,
    version: str | None = None,
    lease_id: str | None = None,
    pool: str | None = None,
) -> None:
    """Raise LeaseTokenError (409 reasons) unless the claims are for this task; `pool`, `version`, `lease_id` when given."""
    if pool is not None and claims.pool != pool:
        raise LeaseTokenError(WRONG_POOL, f"the lease token is for pool {claims.pool!r}; agent {claims.agent_id} is in pool {pool!r}")
    if lease_id is not None and claims.lease_id != lease_id:
        raise LeaseTokenError(WRONG_LEASE, f"the lease token is for lease {claims.lease_id!r}, the task names lease {lease_id!r}")
    if claims.capability != capability:
        raise LeaseTokenError(WRONG_CAPABILITY, f"the lease token is for capability {claims.capability!r}, not {capability!r}")
    if version is not None and claims.version != version:
        raise LeaseTokenError(WRONG_VERSION, f"the lease token is for {claims.capability}@{claims.version}, the task names version {version}")


def token_from_header(value: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value; None when absent.

    Raises LeaseTokenError (malformed) for another scheme.
    """
    if value is None or not value.strip():
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != AUTH_SCHEME.lower() or not token.strip():
        raise LeaseTokenError(MALFORMED, f"expected `{AUTH_HEADER}: {AUTH_SCHEME} <token>`, got the {scheme[:20]!r} scheme")
    return token.strip()


if __name__ == "__main__":
    print(generate_key())
