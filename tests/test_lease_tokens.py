"""Lease tokens: agents run tasks only for a valid lease on themselves.

Tokens are HS256 JWTs: a plain JWT library (PyJWT here, as an agent written in
another language would use its own) verifies ours, and ours verifies its. Then
every refusal (wrong `aud`, expired, unknown `kid`, `alg` none, tampering),
key rotation, the agent's task endpoint over HTTP (401 without a valid token,
409 for a foreign or expired lease, 200 with one, the explicit opt-out), and
CapabilityTaskWorkflow end to end on the dev server, its token kept out of
history.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import jwt
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from agentroster.agent.runtime import AgentRuntime
from agentroster.errors import LeaseKeyMissingError
from agentroster.models import Lease, TaskInput, TaskResult
from agentroster.client.lease_tokens import (
    DEFAULT_CLOCK_SKEW_S,
    INSECURE_NO_AUTH,
    LEASE_KEY_MISSING,
    LeaseClaims,
    LeaseKeyError,
    LeaseKeys,
    LeaseTokenError,
    check_claims,
    generate_key,
    key_id,
    parse_key,
    token_from_header,
)
from agentroster.client.settings import lease_keys_from_env, resolve_lease_keys
from tests.conftest import TEST_LEASE_KEY, eventually

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
KEYS = LeaseKeys((KEY,))


def in_seconds(seconds: float) -> datetime:
    """A whole-second time `seconds` from now (a JWT's `exp` has whole seconds)."""
    return datetime.fromtimestamp(math.floor(time.time() + seconds), tz=timezone.utc)


def claims(**changes: Any) -> LeaseClaims:
    base = {
        "pool": "prod",
        "lease_id": "lease-1",
        "agent_id": "math-1",
        "capability": "math.eval",
        "version": "1.0.0",
        "expires_at": in_seconds(3600),
    }
    return LeaseClaims(**{**base, **changes})


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned(header: dict[str, Any], payload: dict[str, Any], signature: bytes = b"") -> str:
    """A token put together by hand: a forger's, or a broken signer's."""
    return f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(payload).encode())}.{b64url(signature)}"


def refusal(token: str | None, keys: LeaseKeys = KEYS, audience: str = "math-1", **options: Any) -> LeaseTokenError:
    with pytest.raises(LeaseTokenError) as err:
        keys.verify(token, audience=audience, **options)
    return err.value


# ------------------------------------------------- a standard JWT, both ways


def test_a_plain_jwt_library_verifies_our_token() -> None:
    """What an agent in another language does with its own JWT library: HS256, its key, audience = its id."""
    expires = in_seconds(60)
    token = KEYS.sign(claims(expires_at=expires))
    assert jwt.get_unverified_header(token) == {"alg": "HS256", "typ": "JWT", "kid": hashlib.sha256(KEY).hexdigest()[:16]}
    payload = jwt.decode(token, KEY, algorithms=["HS256"], audience="math-1", options={"require": ["exp", "aud", "jti"]})
    assert payload == {
        "aud": "math-1",
        "jti": "lease-1",
        "exp": int(expires.timestamp()),
        "pool": "prod",
        "capability": "math.eval",
        "version": "1.0.0",
    }
    with pytest.raises(jwt.InvalidAudienceError):
        jwt.decode(token, KEY, algorithms=["HS256"], audience="math-2")
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(token, OTHER_KEY, algorithms=["HS256"], audience="math-1")


def test_we_verify_a_token_a_plain_jwt_library_made() -> None:
    """A signer in another language: a JWT with our claims, HS256, the key's `kid`."""
    payload = {"aud": "math-1", "jti": "lease-1", "exp": int(in_seconds(3600).timestamp()), "pool": "prod", "capability": "math.eval", "version": "1.0.0"}
    token = jwt.encode(payload, KEY, algorithm="HS256", headers={"kid": key_id(KEY)})
    assert KEYS.verify(token, audience="math-1") == claims()


def test_round_trip_and_exp_never_outlives_the_lease() -> None:
    token = KEYS.sign(claims())
    assert re.fullmatch(r"eyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{43}", token)
    assert KEYS.verify(token, audience="math-1") == claims()
    # A deadline with a fraction of a second: `exp` is rounded down.
    deadline = in_seconds(3600) + timedelta(milliseconds=999)
    assert KEYS.verify(KEYS.sign(claims(expires_at=deadline)), audience="math-1").expires_at == deadline.replace(microsecond=0)


@settings(max_examples=100, deadline=None)
@given(
    pool=st.text(min_size=1, max_size=40),
    lease_id=st.text(min_size=1, max_size=40),
    agent_id=st.text(min_size=1, max_size=40),
    capability=st.text(min_size=1, max_size=40),
    version=st.text(min_size=1, max_size=20),
    expires_s=st.integers(min_value=int(time.time()) + 3600, max_value=253402300799),  # up to year 9999
    key=st.binary(min_size=32, max_size=64),
)
def test_round_trip_any_claims(pool: str, lease_id: str, agent_id: str, capability: str, version: str, expires_s: int, key: bytes) -> None:
    c = LeaseClaims(pool, lease_id, agent_id, capability, version, datetime.fromtimestamp(expires_s, tz=timezone.utc))
    token = LeaseKeys((key,)).sign(c)
    assert LeaseKeys((OTHER_KEY, key)).verify(token, audience=agent_id) == c
    assert refusal(token, LeaseKeys((OTHER_KEY,)), audience=agent_id).reason == "unknown_kid"


# ------------------------------------------------------------------ refusals


def test_refuses_a_wrong_audience_an_expired_token_an_unknown_kid_and_alg_none() -> None:
    token = KEYS.sign(claims())
    err = refusal(token, audience="math-2")
    assert (err.reason, err.status) == ("wrong_audience", 409) and "is for agent 'math-1' (aud), not 'math-2'" in str(err)

    expired = KEYS.sign(claims(expires_at=in_seconds(-DEFAULT_CLOCK_SKEW_S - 2)))
    err = refusal(expired)
    assert (err.reason, err.status) == ("expired", 409) and "lease lease-1 expired at" in str(err)

    err = refusal(LeaseKeys((OTHER_KEY,)).sign(claims()))
    assert (err.reason, err.status) == ("unknown_kid", 401) and "AGENTROSTER_LEASE_KEY" in str(err)

    payload = jwt.decode(token, options={"verify_signature": False})
    for header in ({"alg": "none", "typ": "JWT", "kid": key_id(KEY)}, {"alg": "none"}, {"alg": "None", "kid": key_id(KEY)}):
        err = refusal(unsigned(header, payload))
        assert (err.reason, err.status) == ("wrong_algorithm", 401), header
        assert "lease tokens are signed HS256" in str(err)
    err = refusal(jwt.encode(payload, KEY * 2, algorithm="HS512", headers={"kid": key_id(KEY)}))
    assert err.reason == "wrong_algorithm"


def test_clock_skew_allowance() -> None:
    just_expired = KEYS.sign(claims(expires_at=in_seconds(-DEFAULT_CLOCK_SKEW_S / 2)))
    assert KEYS.verify(just_expired, audience="math-1").lease_id == "lease-1"
    assert refusal(just_expired, clock_skew_s=0).reason == "expired"


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_change_to_a_token_is_refused(data: st.DataObject) -> None:
    token = KEYS.sign(claims())
    position = data.draw(st.integers(0, len(token) - 1), label="position")
    replacement = data.draw(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.=+/ "), label="char")
    if token[position] == replacement:
        return
    tampered = token[:position] + replacement + token[position + 1 :]
    try:
        KEYS.verify(tampered, audience="math-1")
    except LeaseTokenError as err:
        assert err.status == 401
        return
    # Accepted only when the change falls in the unused low bits of the signature's last
    # character (base64url of 32 bytes): the very same signature bytes, so the same token.
    signature, forged = token.rsplit(".", 1)[1], tampered.rsplit(".", 1)[1]
    assert position == len(token) - 1 and base64.urlsafe_b64decode(signature + "=") == base64.urlsafe_b64decode(forged + "=")


def test_tampered_claims_with_the_old_signature_are_refused() -> None:
    header, _, signature = KEYS.sign(claims()).split(".")
    payload = jwt.decode(KEYS.sign(claims()), options={"verify_signature": False})
    for name, value in [("aud", "math-2"), ("exp", payload["exp"] + 3600), ("jti", "lease-2"), ("pool", "staging")]:
        forged = b64url(json.dumps({**payload, name: value}).encode())
        err = refusal(f"{header}.{forged}.{signature}")
        assert (err.reason, err.status) == ("bad_signature", 401), name


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        (None, "missing"),
        ("", "missing"),
        ("abc", "malformed"),
        ("a.b", "malformed"),
        ("a.b.c.d", "malformed"),
        ("!!!.abc.def", "malformed"),
        (unsigned({"alg": "HS256", "kid": 7}, {}), "malformed"),  # kid not a string
        (unsigned({"alg": "HS256"}, {}), "unknown_kid"),
        (unsigned({"alg": "HS256", "kid": "0123456789abcdef"}, {}), "unknown_kid"),
        (unsigned({"alg": "HS256", "kid": key_id(KEY)}, {"aud": "math-1"}, b"x" * 32), "bad_signature"),
    ],
)
def test_refusals_before_the_claims(token: str | None, reason: str) -> None:
    err = refusal(token)
    assert (err.reason, err.status) == (reason, 401)


def test_a_signed_payload_that_is_not_lease_claims_is_malformed() -> None:
    good = {"aud": "math-1", "jti": "l", "exp": int(in_seconds(60).timestamp()), "pool": "p", "capability": "c", "version": "1"}

    def signed(payload: dict[str, Any]) -> str:
        return jwt.encode(payload, KEY, algorithm="HS256", headers={"kid": key_id(KEY)})

    for name in ("aud", "jti", "exp", "pool", "capability", "version"):
        err = refusal(signed({k: v for k, v in good.items() if k != name}))
        assert (err.reason, name in str(err)) == ("malformed", True), name
    for changes in ({"exp": "soon"}, {"jti": 1}, {"version": 1}, {"pool": None}):
        assert refusal(signed({**good, **changes})).reason == "malformed", changes
    assert KEYS.verify(signed(good), audience="math-1").lease_id == "l"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"pool": "staging"}, "wrong_pool"),
        ({"lease_id": "lease-2"}, "wrong_lease"),
        ({"capability": "rag.search"}, "wrong_capability"),
        ({"version": "1.1.0"}, "wrong_version"),
    ],
)
def test_claims_for_another_task_are_refused(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(LeaseTokenError) as err:
        check_claims(claims(**changes), pool="prod", lease_id="lease-1", capability="math.eval", version="1.0.0")
    assert (err.value.reason, err.value.status) == (reason, 409)


def test_unknown_pool_version_and_lease_are_not_checked() -> None:
    check_claims(claims(pool="whatever"), pool=None, capability="math.eval")  # the agent does not know its pool yet


def test_authorization_header() -> None:
    assert token_from_header(None) is None and token_from_header("  ") is None
    assert token_from_header("Bearer a.b.c") == "a.b.c"
    assert token_from_header("bearer   a.b.c ") == "a.b.c"
    for value in ("Lease a.b.c", "Bearer", "a.b.c"):
        with pytest.raises(LeaseTokenError) as err:
            token_from_header(value)
        assert err.value.status == 401


# ------------------------------------------------------------------------ keys


def test_keys_raw_and_base64() -> None:
    assert parse_key("x" * 32) == b"x" * 32
    raw = bytes(range(32))
    assert parse_key("base64:" + base64.b64encode(raw).decode()) == raw  # openssl rand -base64 32
    assert parse_key("base64:" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()) == raw  # secrets.token_urlsafe
    assert len(parse_key(generate_key())) == 32 and generate_key() != generate_key()


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("x" * 31, "31 bytes; use at least 32"),
        ("base64:" + base64.b64encode(b"x" * 16).decode(), "16 bytes"),
        ("base64:not*base64", "not valid base64"),
        ("", "empty"),
        ("REPLACE-ME-with-a-generated-lease-key", "placeholder"),
        (INSECURE_NO_AUTH, "turns checks off"),
    ],
)
def test_bad_keys_are_refused_with_the_reason(value: str, match: str) -> None:
    with pytest.raises(LeaseKeyError, match=match):
        parse_key(value)


def test_rotation_from_the_environment() -> None:
    old, new = "o" * 32, "n" * 40
    assert lease_keys_from_env({}) is None and lease_keys_from_env({"AGENTROSTER_LEASE_KEY": "  "}) is None
    keys = lease_keys_from_env({"AGENTROSTER_LEASE_KEY": new, "AGENTROSTER_LEASE_KEY_PREVIOUS": f"{old}, base64:{base64.b64encode(KEY).decode()}"})
    assert keys is not None and keys.keys == (new.encode(), old.encode(), KEY)
    # Every key verifies (picked by the token's kid), the first one signs.
    for signer in (old.encode(), KEY, new.encode()):
        assert keys.verify(LeaseKeys((signer,)).sign(claims()), audience="math-1") == claims()
    assert jwt.get_unverified_header(keys.sign(claims()))["kid"] == key_id(new.encode())
    # Once the old key leaves the rotation, its tokens are refused.
    assert refusal(LeaseKeys((old.encode(),)).sign(claims()), LeaseKeys.parse(new)).reason == "unknown_kid"
    off = lease_keys_from_env({"AGENTROSTER_LEASE_KEY": INSECURE_NO_AUTH, "AGENTROSTER_LEASE_KEY_PREVIOUS": "ignored"})
    assert off is not None and not off.enabled and off.headers(claims()) == {}
    with pytest.raises(LeaseKeyError):
        off.sign(claims())
    with pytest.raises(LeaseKeyError, match="AGENTROSTER_LEASE_KEY_PREVIOUS"):
        lease_keys_from_env({"AGENTROSTER_LEASE_KEY": new, "AGENTROSTER_LEASE_KEY_PREVIOUS": "short"})
    with pytest.raises(LeaseKeyError, match="AGENTROSTER_LEASE_KEY: the key is 5 bytes"):
        lease_keys_from_env({"AGENTROSTER_LEASE_KEY": "short"})
    assert resolve_lease_keys(KEY).keys == (KEY,) and not resolve_lease_keys(INSECURE_NO_AUTH, {}).enabled  # type: ignore[union-attr]


def test_keys_never_show_in_repr() -> None:
    keys = LeaseKeys.parse("s" * 32)
    assert "sss" not in repr(keys) and "sss" not in str(keys)


def test_headers_for_a_lease() -> None:
    expires = in_seconds(3600)
    lease = Lease(
        lease_id="lease-1", pool="prod", agent_id="math-1", deployment="math-agent", capability="math.eval", version="1.0.0",
        endpoint="http://x", granted_at=datetime.now(timezone.utc), deadline=expires,
    )
    (header,) = KEYS.headers(lease).items()
    assert header[0] == "Authorization" and header[1].startswith("Bearer eyJ")
    assert KEYS.verify(token_from_header(header[1]), audience="math-1") == claims(expires_at=expires)


# ----------------------------------------------------------- the task endpoint

ECHO = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


class Agent:
    """An in-process AgentRuntime with `test.echo@1.2.0` and `test.other@1.0.0`, registered in the stack's pool."""

    def __init__(self, stack: Any, http: aiohttp.ClientSession, **options: Any) -> None:
        self.stack = stack
        self.http = http
        self.calls: list[Any] = []
        self.agent_id = f"lease-agent-{uuid.uuid4().hex[:8]}"
        self.runtime = AgentRuntime(
            agent_id=self.agent_id, deployment="lease-agent", roster=stack.roster, port=0, host="127.0.0.1", heartbeat_interval_s=1.0, **options
        )

        @self.runtime.capability("test.echo", "1.2.0", input_schema=ECHO, max_concurrency=4)
        async def echo(payload: dict[str, Any]) -> dict[str, Any]:
            self.calls.append(payload)
            return {"echo": payload["text"]}

        @self.runtime.capability("test.other", "1.0.0")
        async def other(payload: Any) -> Any:
            self.calls.append(payload)
            return {}

    def claims(self, **changes: Any) -> LeaseClaims:
        base = {
            "pool": self.stack.pool,
            "lease_id": "made-up",
            "agent_id": self.agent_id,
            "capability": "test.echo",
            "version": "1.2.0",
            "expires_at": in_seconds(60),
        }
        return LeaseClaims(**{**base, **changes})

    async def post(self, *, lease_id: str = "made-up", version: str = "1.2.0", capability: str = "test.echo",
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
        body = {"lease_id": lease_id, "capability": capability, "version": version, "input": {"text": "hi"}}
        assert self.runtime.endpoint is not None
        async with self.http.post(f"{self.runtime.endpoint}/tasks/{capability}", json=body, headers=headers) as resp:
            return resp.status, await resp.json(), resp.headers

    async def signed(self, key: bytes | str = TEST_LEASE_KEY, **changes: Any) -> tuple[int, dict[str, Any], Any]:
        c = self.claims(**changes)
        return await self.post(lease_id="made-up", headers=LeaseKeys.of(key).headers(c))


@pytest_asyncio.fixture
async def agents(stack: Any) -> AsyncIterator[Any]:
    made: list[Agent] = []
    async with aiohttp.ClientSession() as http:

        async def make(**options: Any) -> Agent:
            agent = Agent(stack, http, **options)
            made.append(agent)
            await agent.runtime.start()
            await agent.runtime.wait_ready(20)
            return agent

        try:
            yield make
        finally:
            for agent in made:
                await agent.runtime.stop(drain=False)


async def test_a_made_up_lease_gets_401_not_a_task(agents: Any) -> None:
    """The issue's repro: `"made-up"` used to get a 200 from whoever reached the agent."""
    a = await agents()
    status, body, headers = await a.post(lease_id="made-up")
    assert status == 401 and "no lease token" in body["error"]
    assert headers["WWW-Authenticate"] == "Bearer"
    assert a.calls == []


async def test_the_task_endpoint_checks_the_lease_token(agents: Any) -> None:
    a = await agents()
    other_key = generate_key()
    alg_none = unsigned({"alg": "none", "typ": "JWT", "kid": key_id(parse_key(TEST_LEASE_KEY))}, a.claims().to_jwt())
    cases: list[tuple[str, Any, int, str]] = [
        ("another scheme", {"Authorization": "Lease a.b.c"}, 401, "expected `Authorization: Bearer <token>`"),
        ("garbage", {"Authorization": "Bearer garbage"}, 401, "malformed"),
        ("alg none", {"Authorization": f"Bearer {alg_none}"}, 401, "lease tokens are signed HS256"),
        ("another key", LeaseKeys.of(other_key).headers(a.claims()), 401, "none of this agent's lease keys"),
        ("another agent", LeaseKeys.of(TEST_LEASE_KEY).headers(a.claims(agent_id="someone-else")), 409, "is for agent 'someone-else'"),
        ("another pool", LeaseKeys.of(TEST_LEASE_KEY).headers(a.claims(pool="elsewhere")), 409, "is for pool 'elsewhere'"),
        ("another lease", LeaseKeys.of(TEST_LEASE_KEY).headers(a.claims(lease_id="other-lease")), 409, "is for lease 'other-lease'"),
        ("another capability", LeaseKeys.of(TEST_LEASE_KEY).headers(a.claims(capability="test.other")), 409, "capability 'test.other'"),
        ("another version", LeaseKeys.of(TEST_LEASE_KEY).headers(a.claims(version="1.3.0")), 409, "test.echo@1.3.0"),
        ("expired", LeaseKeys.of(TEST_LEASE_KEY).headers(a.claims(expires_at=in_seconds(-60))), 409, "expired"),
    ]
    for what, headers, expected, message in cases:
        status, body, _ = await a.post(headers=headers)
        assert (status, message in body["error"]) == (expected, True), (what, body)
    assert a.calls == []
    refusals = a.runtime.status()["lease_refusals"]
    assert refusals == {
        "malformed": 2, "wrong_algorithm": 1, "unknown_kid": 1, "wrong_audience": 1, "wrong_pool": 1, "wrong_lease": 1,
        "wrong_capability": 1, "wrong_version": 1, "expired": 1,
    }
    # Just past the deadline, within the clock-skew allowance: still accepted.
    status, body, _ = await a.signed(expires_at=in_seconds(-DEFAULT_CLOCK_SKEW_S / 2))
    assert status == 200, body
    status, body, _ = await a.signed()
    assert (status, body) == (200, {"output": {"echo": "hi"}})
    assert len(a.calls) == 2


async def test_a_real_lease_works_until_it_expires(agents: Any, stack: Any) -> None:
    """A holder calling the agent directly signs with `roster.lease_headers`; past the deadline it is refused."""
    a = await agents(lease_clock_skew_s=0)
    lease = await stack.roster.acquire("test.echo@>=1,<2", timeout=5, lease_ttl_s=2)
    assert lease.agent_id == a.agent_id
    status, body, _ = await a.post(lease_id=lease.lease_id, headers=stack.roster.lease_headers(lease))
    assert status == 200, body
    token = stack.roster.sign(lease)
    assert stack.roster.lease_headers(lease) == {"Authorization": f"Bearer {token}"}
    await asyncio.sleep(max(0.0, (lease.deadline - datetime.now(timezone.utc)).total_seconds()) + 0.2)
    status, body, _ = await a.post(lease_id=lease.lease_id, headers=stack.roster.lease_headers(lease))
    assert status == 409 and f"lease {lease.lease_id} expired" in body["error"], body
    # The next holder gets a new lease, and its token works.
    fresh = await stack.roster.acquire("test.echo@>=1,<2", timeout=5)
    status, body, _ = await a.post(lease_id=fresh.lease_id, headers=stack.roster.lease_headers(fresh))
    assert status == 200, body
    await stack.roster.release(fresh)


async def test_the_explicit_opt_out_accepts_any_task(agents: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="agentroster.agent.runtime"):
        a = await agents(lease_key=INSECURE_NO_AUTH)
    assert "LEASE CHECKS ARE OFF" in caplog.text
    status, body, _ = await a.post(lease_id="made-up")
    assert (status, body) == (200, {"output": {"echo": "hi"}})


async def test_an_agent_without_a_key_refuses_to_start(stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTROSTER_LEASE_KEY")
    runtime = AgentRuntime(agent_id="keyless", deployment="lease-agent", roster=stack.roster, port=0, host="127.0.0.1")
    runtime.add_capability(*_echo_capability())
    with pytest.raises(LeaseKeyMissingError, match="AGENTROSTER_LEASE_KEY=insecure-no-auth"):
        await runtime.start()
    assert runtime.endpoint is None  # nothing listens
    # The environment of `from_env` counts, and a bad key is refused when the runtime is built.
    with pytest.raises(LeaseKeyError, match="placeholder"):
        AgentRuntime.from_env({"AGENTROSTER_LEASE_KEY": "REPLACE-ME", "AGENT_DEPLOYMENT": "d", "AGENT_ID": "x"})


def _echo_capability() -> tuple[Any, Any]:
    from agentroster.models import Capability

    async def echo(payload: Any) -> Any:
        return payload

    return Capability(name="test.echo", version="1.2.0"), echo


# --------------------------------------------------------- end to end, workflow


async def run_task(stack: Any, ref: str = "test.echo@>=1,<2", **options: Any) -> TaskResult:
    return await stack.env.client.execute_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref=ref, payload={"text": "through the pool"}, pool=stack.pool, acquire_timeout_s=5, **options),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
        result_type=TaskResult,
    )


def _payload_bytes(history_json: str) -> bytes:
    """Every payload in a history, decoded (payload data is base64 in the JSON form)."""
    found: list[bytes] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("data"), str) and "metadata" in node:
                found.append(base64.b64decode(node["data"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(history_json))
    return b"\n".join(found)


async def test_capability_task_workflow_signs_and_keeps_the_token_out_of_history(agents: Any, stack: Any) -> None:
    a = await agents()
    handle = await stack.env.client.start_workflow(
        "CapabilityTaskWorkflow",
        TaskInput(ref="test.echo@>=1,<2", payload={"text": "through the pool"}, pool=stack.pool, acquire_timeout_s=5),
        id=f"task-{uuid.uuid4().hex[:8]}",
        task_queue=stack.task_queue,
        result_type=TaskResult,
    )
    result = await handle.result()
    assert (result.agent_id, result.output, result.attempts) == (a.agent_id, {"echo": "through the pool"}, 1)
    assert a.runtime.status()["lease_refusals"] == {}
    payloads = _payload_bytes((await handle.fetch_history()).to_json())
    assert b"through the pool" in payloads and a.agent_id.encode() in payloads  # the payloads were decoded
    assert b"Bearer " not in payloads and not re.search(rb"eyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{43}", payloads)
    key = parse_key(TEST_LEASE_KEY)
    assert TEST_LEASE_KEY.encode() not in payloads and key not in payloads


async def test_a_worker_with_another_key_is_refused(agents: Any, stack: Any) -> None:
    a = await agents()
    await stack.stop_worker()
    await stack.start_worker(lease_key=generate_key())
    with pytest.raises(WorkflowFailureError) as err:
        await run_task(stack, max_attempts=1)
    cause = err.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "CapabilityTaskFailed"
    assert "refused the lease token (401)" in cause.message and "AGENTROSTER_LEASE_KEY" in cause.message
    assert a.calls == [] and a.runtime.status()["lease_refusals"] == {"unknown_kid": 1}


async def test_a_worker_without_a_key_fails_the_task_at_once(agents: Any, stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    a = await agents()
    await stack.stop_worker()
    monkeypatch.delenv("AGENTROSTER_LEASE_KEY")
    await stack.start_worker()  # starts (it may never call an agent), warns
    started = time.monotonic()
    with pytest.raises(WorkflowFailureError) as err:
        await run_task(stack)
    cause = err.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == LEASE_KEY_MISSING
    assert "insecure-no-auth" in cause.message
    assert time.monotonic() - started < 15  # no failover round
    assert a.calls == []
    await eventually(lambda: a.runtime.status()["in_flight"]["test.echo"] == 0)
