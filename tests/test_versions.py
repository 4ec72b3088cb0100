"""Version ranges (agentroster.vocabulary.versions): the pre-release rule, ^/~ ranges, errors.

The first two tests are defect 4: before the fix `rag.search@>=2,<3` matched
`2.5.0-beta.1`, in `CapabilityRef.matches` and in the pool's picks.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from pydantic import ValidationError

from agentroster.messages import AcquireRequest, AgentSnapshot, CapabilityDigest
from agentroster.models import AgentState, Capability, CapabilityRef
from agentroster.vocabulary.versions import parse_semver
from agentroster.core.index import CapabilityIndex
from agentroster.core.pool import PoolCore


def _verified(core: PoolCore, now: float, new_id) -> None:  # noqa: ANN001
    """Answer the pool's checks of new agents as the workflow's activity would: they run."""
    for agent_id in core.take_verifications():
        core.agent_verified(agent_id, True, now, new_id)
from agentroster.vocabulary.versions import matches, parse_range

# ----------------------------------------------------------------- defect 4


def test_ordinary_range_does_not_match_a_prerelease() -> None:
    ref = CapabilityRef.parse("rag.search@>=2,<3")
    assert not ref.matches("2.5.0-beta.1")
    assert ref.matches("2.5.0")
    index = CapabilityIndex()
    assert not index.version_matches(ref, "2.5.0-beta.1")


def _agent(agent_id: str, version: str) -> AgentSnapshot:
    return AgentSnapshot(
        agent_id=agent_id,
        deployment="search",
        endpoint=f"http://{agent_id}.local:8080",
        state=AgentState.READY,
        capabilities=[CapabilityDigest(name="rag.search", version=version, max_concurrency=1)],
    )


def test_pool_skips_prerelease_agent_for_ordinary_range_and_caret_picks_release() -> None:
    ids = (f"id-{n}" for n in itertools.count())
    core = PoolCore("versions")
    core.agent_snapshot(_agent("beta-agent", "2.5.0-beta.1"), 0.0, lambda: next(ids))
    _verified(core, 0.0, lambda: next(ids))

    reply = core.acquire(AcquireRequest(ref="rag.search@>=2,<3", wait_s=0, request_id="r" * 16), 1.0, lambda: next(ids))
    assert reply.lease is None
    assert reply.report is not None and reply.report.matching == 0 and reply.report.total_agents == 1

    core.agent_snapshot(_agent("release-agent", "2.3.0"), 2.0, lambda: next(ids))
    _verified(core, 2.0, lambda: next(ids))
    assert core.find("rag.search@>=2,<3") == ["release-agent"]
    assert core.find("rag.search@>=2.5.0-beta.1,<3") == ["beta-agent"]

    reply = core.acquire(AcquireRequest(ref="rag.search@^2.1", wait_s=0, request_id="s" * 16), 3.0, lambda: next(ids))
    assert reply.lease is not None
    assert (reply.lease.agent_id, reply.lease.version) == ("release-agent", "2.3.0")
    # A range that names a pre-release may take the beta agent.
    reply = core.acquire(AcquireRequest(ref="rag.search@^2.5.0-beta.1", wait_s=0, request_id="t" * 16), 4.0, lambda: next(ids))
    assert reply.lease is not None and reply.lease.agent_id == "beta-agent"


# ----------------------------------------------------------------- the pre-release rule


@pytest.mark.parametrize(
    ("range_text", "version", "expected"),
    [
        (">=2,<3", "2.5.0-beta.1", False),
        (">=2,<3", "2.5.0", True),
        (">=2,<3", "2.1.0+build.5", True),  # build metadata is not a pre-release
        ("^2.1", "2.2.0-rc.1", False),
        ("~2.1.3", "2.1.4-alpha", False),
        ("==2.*", "2.1.0-rc.1", False),
        ("~=2.1", "2.2.0-rc.1", False),
        ("!=2.0.0-beta.1", "2.1.0-beta.1", False),  # excluding a pre-release does not ask for them
        # Naming a pre-release, semver- or PEP 440-style, admits pre-releases in the range...
        (">=2.5.0-beta.1,<3", "2.5.0-beta.1", True),
        (">=2.5.0b1,<3", "2.5.0-beta.1", True),
        ("==2.5.0-beta.1", "2.5.0-beta.1", True),
        ("^2.1.0-beta.1", "2.1.0-beta.2", True),
        ("^2.1.0-beta.1", "2.1.0", True),
        ("~2.1.3-rc.1", "2.1.3-rc.2", True),
        # ...every one of them (PEP 440), not only those of the same MAJOR.MINOR.PATCH (npm)
        (">=2.5.0-beta.1,<3", "2.6.0-rc.1", True),
        ("^2.1.0-beta.1", "2.4.0-alpha.3", True),
        # ...but not outside it
        (">=2.5.0-beta.1,<3", "2.5.0-alpha.1", False),
        (">=2.5.0-beta.1,<3", "3.0.0-alpha.1", False),  # PEP 440: <3 excludes 3's pre-releases
        ("^2.1.0-beta.1", "2.1.0-alpha.9", False),
        ("^2.1.0-beta.1", "3.0.0-rc.1", False),
        # A bare name pins nothing: any version, pre-releases included.
        ("", "2.5.0-beta.1", True),
        ("", "0.0.1", True),
    ],
)
def test_prerelease_rule(range_text: str, version: str, expected: bool) -> None:
    assert matches(range_text, version) is expected
    ref = CapabilityRef(name="rag.search", specifier=range_text)
    assert ref.matches(version) is expected


# ----------------------------------------------------------------- ^ and ~


@pytest.mark.parametrize(
    ("range_text", "pep440"),
    [
        ("^2.1", ">=2.1.0,<3.0.0"),
        ("^2.1.3", ">=2.1.3,<3.0.0"),
        ("^2", ">=2.0.0,<3.0.0"),
        ("^0.2.3", ">=0.2.3,<0.3.0"),
        ("^0.2", ">=0.2.0,<0.3.0"),
        ("^0.0.3", ">=0.0.3,<0.0.4"),
        ("^0.0", ">=0.0.0,<0.1.0"),
        ("^0", ">=0.0.0,<1.0.0"),
        ("^2.1.0-beta.1", ">=2.1.0b1,<3.0.0"),
        ("~2.1.3", ">=2.1.3,<2.2.0"),
        ("~2.1", ">=2.1.0,<2.2.0"),
        ("~2", ">=2.0.0,<3.0.0"),
        ("~0.2.3", ">=0.2.3,<0.3.0"),
        ("~0", ">=0.0.0,<1.0.0"),
        ("~2.1.3-rc.1", ">=2.1.3rc1,<2.2.0"),
        (" ^ 2.1 ", ">=2.1.0,<3.0.0"),
    ],
)
def test_caret_and_tilde_translate_to_pep440(range_text: str, pep440: str) -> None:
    assert parse_range(range_text).pep440 == pep440


@pytest.mark.parametrize(
    ("range_text", "version", "expected"),
    [
        ("^2.1", "2.1.0", True),
        ("^2.1", "2.9.9", True),
        ("^2.1", "2.0.9", False),
        ("^2.1", "3.0.0", False),
        ("^0.2.3", "0.2.9", True),
        ("^0.2.3", "0.3.0", False),
        ("^0.0.3", "0.0.3", True),
        ("^0.0.3", "0.0.4", False),
        ("~2.1.3", "2.1.9", True),
        ("~2.1.3", "2.2.0", False),
        ("~2.1.3", "2.1.2", False),
        ("~2", "2.9.0", True),
        ("~2", "3.0.0", False),
    ],
)
def test_caret_and_tilde_match(range_text: str, version: str, expected: bool) -> None:
    assert matches(range_text, version) is expected


@pytest.mark.parametrize("ref", ["rag.search@^2.1", "rag.search@~2.1.3", "rag.search@>=2,<3", "rag.search@~=2.1", "rag.search"])
def test_ref_round_trips_as_written(ref: str) -> None:
    parsed = CapabilityRef.parse(ref)
    assert str(parsed) == ref
    assert CapabilityRef.parse(str(parsed)) == parsed
    assert AcquireRequest(ref=ref, request_id="u" * 16).ref == ref


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("range_text", "reason"),
    [
        ("^", "has no version after it"),
        ("~", "has no version after it"),
        ("^2.x.y", "wildcards (x, X, *) are not accepted"),
        ("^2.x", "wildcards (x, X, *) are not accepted"),
        ("~>2", "Ruby's operator"),
        ("garbage", "not a version specifier set"),
        (">>2", "not a version specifier set"),
        ("*", "not a version specifier set"),
        ("^2.1-beta.1", "needs a full MAJOR.MINOR.PATCH"),
        ("^1.2.3.4", "more than MAJOR.MINOR.PATCH"),
        ("^01.2", "no leading zero"),
        ("^2.1.y", "'y' is not a version number"),
        ("^2 || ^3", "one version"),
        ("^2.1,<2.5", "one version"),
        ("^2.1.0+build.1", "build metadata"),
        ("^2.1.0-foo.bar", "has no PEP 440 ordering"),
        ("===2.0.0", "arbitrary equality"),
        (">=1.0.0-1", "reads as a PEP 440 post-release"),
    ],
)
def test_bad_range_names_the_reason(range_text: str, reason: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_range(range_text)
    assert repr(range_text) in str(exc.value) and reason in str(exc.value)
    with pytest.raises(ValidationError) as exc2:
        CapabilityRef.parse(f"rag.search@{range_text}")
    errors = exc2.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == ("specifier",) and reason in errors[0]["msg"]


# ----------------------------------------------------------------- semver -> comparable versions


@pytest.mark.parametrize(
    ("version", "pep440"),
    [
        ("2.5.0-beta.1", "2.5.0b1"),
        ("1.0.0-rc.1", "1.0.0rc1"),
        ("1.0.0-alpha", "1.0.0a0"),
        ("1.0.0-alpha.1", "1.0.0a1"),
        ("1.0.0-dev.3", "1.0.0.dev3"),
        ("1.0.0+build.5", "1.0.0+build.5"),
    ],
)
def test_semver_prereleases_become_comparable_prereleases(version: str, pep440: str) -> None:
    parsed = parse_semver(version)
    assert str(parsed) == pep440
    assert parsed.is_prerelease is ("-" in version)


def test_semver_prerelease_order() -> None:
    ordered = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0"]
    assert sorted(ordered, key=parse_semver) == ordered


@pytest.mark.parametrize(
    ("version", "reason"),
    [
        ("1.0.0-foo.bar", "has no PEP 440 ordering"),
        ("1.0.0-alpha.beta", "has no PEP 440 ordering"),
        ("1.0.0-0.3.7", "has no PEP 440 ordering"),
        # packaging would make these post-releases sorting after 1.0.0
        ("1.0.0-post.1", "as the post-release 1.0.0.post1"),
        ("1.0.0-r.1", "as the post-release 1.0.0.post1"),
        ("1.0.0-1", "as the post-release 1.0.0.post1"),
    ],
)
def test_unrepresentable_semver_prerelease_refused_at_registration(version: str, reason: str) -> None:
    with pytest.raises(ValidationError) as exc:
        Capability(name="rag.search", version=version)
    errors = exc.value.errors()
    assert errors[0]["loc"] == ("version",)
    assert "not a comparable version" in errors[0]["msg"] and reason in errors[0]["msg"]


def test_matching_is_cached_and_bounded() -> None:
    assert matches.cache_info().maxsize == 4096
    assert parse_range("^2.1") is parse_range("^2.1")


# ----------------------------------------------------------------- properties

_TAGS = {"alpha": 0, "beta": 1, "rc": 2}
numbers = st.integers(0, 4)
prerelease = st.one_of(st.none(), st.tuples(st.sampled_from(sorted(_TAGS)), st.integers(1, 3)))
semvers = st.tuples(numbers, numbers, numbers, prerelease)


def _semver(v: tuple) -> str:
    major, minor, patch, pre = v
    return f"{major}.{minor}.{patch}" + (f"-{pre[0]}.{pre[1]}" if pre else "")


def _order(v: tuple) -> tuple:
    """semver precedence for these versions, without packaging: pre-releases before the release."""
    major, minor, patch, pre = v
    return (major, minor, patch, (0, _TAGS[pre[0]], pre[1]) if pre else (1, 0, 0))


def _npm_case(op: str, given_parts: list[int], range_pre: tuple | None, version: tuple) -> tuple[str, bool]:
    """A ^/~ range and whether `version` is in it, by npm's definitions written apart from the code.

    ^ keeps every part up to the left-most non-zero one given (the last given
    one if all are zero); ~ keeps MAJOR.MINOR when a minor is given, else
    MAJOR. Pre-releases: only when the range names one, and then any in range.
    """
    if range_pre is not None:
        given_parts = (given_parts + [0, 0])[:3]
    lower = (*given_parts, *[0] * (3 - len(given_parts)), range_pre)
    text = op + _semver(lower) if range_pre else op + ".".join(map(str, given_parts))
    if op == "^":
        kept = next((i for i, n in enumerate(given_parts) if n), len(given_parts) - 1) + 1
    else:
        kept = 2 if len(given_parts) >= 2 else 1
    expected = _order(version) >= _order(lower) and version[:kept] == lower[:kept]
    return text, expected and (version[3] is None or range_pre is not None)


@given(op=st.sampled_from("^~"), given_parts=st.lists(numbers, min_size=1, max_size=3), range_pre=prerelease, data=st.data())
def test_caret_and_tilde_follow_their_definition(op: str, given_parts: list[int], range_pre, data: st.DataObject) -> None:
    # Versions within one of the lower bound, part by part, reach both bounds
    # (the upper one is the lower one with a part bumped) and so find off-by-ones.
    lower = (given_parts + [0, 0])[:3]
    version = data.draw(st.tuples(*(st.sampled_from(sorted({max(0, n - 1), n, n + 1})) for n in lower), prerelease))
    text, expected = _npm_case(op, given_parts, range_pre, version)
    assert matches(text, _semver(version)) is expected, (text, parse_range(text).pep440)


def test_caret_and_tilde_follow_their_definition_on_a_small_grid() -> None:
    """Every ^/~ range over parts 0..2 against every version over 0..3: the corners random draws miss."""
    pres = [None, ("alpha", 1), ("rc", 2)]
    versions = list(itertools.product(range(4), range(4), range(4), pres))
    partials = [list(p) for n in (1, 2, 3) for p in itertools.product(range(3), repeat=n)]
    for op, parts, range_pre in itertools.product("^~", partials, pres):
        if range_pre is not None and len(parts) < 3:
            continue
        for version in versions:
            text, expected = _npm_case(op, parts, range_pre, version)
            assert matches(text, _semver(version)) is expected, (text, _semver(version))


clause_ops = st.sampled_from([">=", ">", "<=", "<", "==", "!=", "~="])
release_clauses = st.lists(st.tuples(clause_ops, numbers, numbers, numbers), min_size=1, max_size=3)


def _pep440(clauses: list[tuple]) -> str:
    return ",".join(f"{op}{a}.{b}.{c}" for op, a, b, c in clauses)


@given(clauses=release_clauses, version=semvers)
def test_range_naming_no_prerelease_never_matches_one(clauses: list[tuple], version: tuple) -> None:
    text = _pep440(clauses)
    got = matches(text, _semver(version))
    if version[3] is not None:
        assert got is False
    else:
        # Releases match exactly as before the fix.
        assert got is SpecifierSet(text).contains(Version(_semver(version)), prereleases=True)


@given(clauses=release_clauses, named=st.tuples(st.sampled_from([">=", "<=", ">", "<", "=="]), semvers), version=semvers)
def test_range_naming_a_prerelease_follows_pep440(clauses: list[tuple], named: tuple, version: tuple) -> None:
    op, pre_version = named
    if pre_version[3] is None:
        pre_version = (*pre_version[:3], ("rc", 1))
    text = f"{_pep440(clauses)},{op}{_semver(pre_version)}"
    assert parse_range(text).prereleases
    expected = SpecifierSet(text).contains(Version(_semver(version)), prereleases=True)
    assert matches(text, _semver(version)) is expected
