"""Version ranges of capability refs: the one place for parsing and matching rules.

Pure (no I/O, no clock): imported by `agentroster.models` and by the pool core.

A range is one of

* empty: any version, pre-releases included (a bare `rag.search` pins nothing);
* a PEP 440 specifier set: `>=2,<3`, `==2.1.0`, `~=2.1`, `!=2.0.1`;
* one npm-style caret or tilde term, translated to PEP 440:
  `^2.1` -> `>=2.1.0,<3.0.0`, `^0.2.3` -> `>=0.2.3,<0.3.0`, `^0.0.3` -> `>=0.0.3,<0.0.4`,
  `~2.1.3` -> `>=2.1.3,<2.2.0`, `~2` -> `>=2.0.0,<3.0.0` (partials like `^2` are
  padded with zeros; `x` wildcards are not accepted, the partial says the same).

Pre-release rule (PEP 440's, as `packaging` implements it per clause): a version
with a pre-release tag (`2.5.0-beta.1`) matches a range only if some clause of
the range other than `!=` and `==X.*` names a pre-release, e.g.
`>=2.5.0-beta.1,<3`. Such a range then admits every pre-release inside it
(`2.6.0-rc.1` too): npm's stricter "same MAJOR.MINOR.PATCH" rule is not applied.
Clause versions may be written semver-style (`2.5.0-beta.1`) or PEP 440-style
(`2.5.0b1`).

Capability versions are semver strings, compared as `packaging` Versions.
`packaging` reads alpha/a, beta/b, rc/c/pre/preview and dev pre-releases
(`1.0.0-rc.1` is `1.0.0rc1`); semver pre-releases it cannot order faithfully
are refused with the reason: ones it cannot parse (`1.0.0-foo.bar`,
`1.0.0-alpha.beta`, `1.0.0-0.3.7`) and ones it would read as a post-release
sorting after the release (`1.0.0-post.1`, `1.0.0-r.1`, `1.0.0-1`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["VersionRange", "matches", "parse_range", "parse_semver"]

# semver.org's own grammar (major.minor.patch, optional pre-release and build).
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?\Z"
)
_NUMBER = re.compile(r"^(0|[1-9]\d*)\Z")
_WILDCARDS = frozenset({"x", "X", "*"})
# Characters one caret/tilde version can hold; anything else means several terms.
_ONE_TERM = re.compile(r"^[0-9A-Za-z.*+-]*\Z")
_HINT = "e.g. >=2,<3, ^2.1 or ~2.1.3"


def parse_semver(version: str) -> Version:
    """Parse a semver string into a comparable `packaging` Version.

    Raises ValueError naming the reason when `version` is not semver, or is a
    semver pre-release `packaging` cannot order faithfully (see the module doc).
    """
    if not isinstance(version, str):
        raise ValueError(f"{version!r} is not a semantic version (expected MAJOR.MINOR.PATCH, e.g. 2.1.0)")
    return _parse_semver(version)


@lru_cache(maxsize=4096)
def _parse_semver(version: str) -> Version:
    match = _SEMVER.match(version)
    if not match:
        raise ValueError(f"{version!r} is not a semantic version (expected MAJOR.MINOR.PATCH, e.g. 2.1.0)")
    pre = match.group(4)
    try:
        parsed = Version(version)
    except InvalidVersion as exc:
        raise ValueError(
            f"{version!r} is not a comparable version: the pre-release {pre!r} has no PEP 440 ordering "
            "(use alpha, beta, rc or dev with an optional number, e.g. 2.1.0-beta.1)"
        ) from exc
    if pre is not None and not parsed.is_prerelease:
        # e.g. 1.0.0-post.1 -> 1.0.0.post1: it would sort after 1.0.0 and pass
        # every range as a release, the opposite of what semver means.
        raise ValueError(
            f"{version!r} is not a comparable version: packaging reads the pre-release {pre!r} as the "
            f"post-release {parsed}, which sorts after the release (use alpha, beta, rc or dev, e.g. 2.1.0-rc.1)"
        )
    return parsed


@dataclass(frozen=True)
class VersionRange:
    """A parsed range: its text as written, its PEP 440 form and whether it names a pre-release."""

    text: str
    pep440: str
    specifiers: SpecifierSet
    prereleases: bool

    def contains(self, version: str | Version) -> bool:
        """Whether `version` (semver string or Version) lies in the range, by the module's pre-release rule."""
        parsed = version if isinstance(version, Version) else parse_semver(version)
        if not self.pep440:
            return True  # empty range: any version, pre-releases included
        return self.specifiers.contains(parsed, prereleases=self.prereleases)


@lru_cache(maxsize=1024)
def parse_range(text: str) -> VersionRange:
    """Parse a range (PEP 440 set, one ^/~ term, or empty). Raises ValueError with the reason."""
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a version range ({_HINT})")
    stripped = text.strip()
    if stripped.startswith("~>"):
        raise ValueError(f"{text!r} is not a version range: '~>' is Ruby's operator; write ~2.1 (npm) or ~=2.1 (PEP 440)")
    if stripped[:1] == "^" or (stripped[:1] == "~" and stripped[1:2] != "="):
        pep440 = _translate_npm(stripped[0], stripped[1:].strip(), text)
        specifiers = SpecifierSet(pep440)
        return VersionRange(text=stripped, pep440=pep440, specifiers=specifiers, prereleases=_names_prerelease(specifiers))
    try:
        specifiers = SpecifierSet(stripped)
    except InvalidSpecifier as exc:
        raise ValueError(f"{text!r} is not a version specifier set ({_HINT}): {exc}") from exc
    for clause in specifiers:
        if clause.operator == "===":
            # === compares raw strings: 2.1.0-beta.1 would never equal its parsed form.
            raise ValueError(f"{text!r} is not a version range: arbitrary equality (===) is not supported; use ==")
        if "-" in clause.version and not Version(clause.version.removesuffix(".*")).is_prerelease:
            raise ValueError(
                f"{text!r} is not a version range: {clause.version!r} reads as a PEP 440 post-release, "
                "not a semver pre-release (use alpha, beta, rc or dev, e.g. 2.1.0-rc.1)"
            )
    return VersionRange(text=stripped, pep440=str(specifiers), specifiers=specifiers, prereleases=_names_prerelease(specifiers))


@lru_cache(maxsize=4096)
def matches(range_text: str, version: str) -> bool:
    """Whether semver `version` lies in `range_text`: the one matching rule, cached for the pool's hot path.

    Raises ValueError for a bad range or a version that is not semver.
    """
    return parse_range(range_text).contains(version)


def _names_prerelease(specifiers: SpecifierSet) -> bool:
    """PEP 440: a clause asks for pre-releases when its version is one, except `!=` and `==X.*`."""
    return any(
        clause.operator != "!=" and not clause.version.endswith(".*") and Version(clause.version).is_prerelease
        for clause in specifiers
    )


def _translate_npm(op: str, body: str, text: str) -> str:
    """`^`/`~` plus a (partial) version -> the equivalent PEP 440 specifier set."""
    where = f"{text!r} is not a version range"
    if not body:
        raise ValueError(f"{where}: '{op}' has no version after it (e.g. {op}2.1)")
    if not _ONE_TERM.match(body):
        raise ValueError(f"{where}: a {op} range is one version; combine clauses PEP 440-style, e.g. >=2.1,<2.5")
    if "+" in body:
        raise ValueError(f"{where}: build metadata ('+...') has no place in a range")
    core, dash, pre = body.partition("-")
    parts = core.split(".")
    if any(p in _WILDCARDS for p in parts):
        raise ValueError(f"{where}: wildcards (x, X, *) are not accepted after {op}; write a partial version such as {op}2 or {op}2.1")
    if len(parts) > 3:
        raise ValueError(f"{where}: {core!r} has more than MAJOR.MINOR.PATCH")
    bad = next((p for p in parts if not _NUMBER.match(p)), None)
    if bad is not None:
        raise ValueError(f"{where}: {bad!r} is not a version number (digits, no leading zero)")
    nums = [int(p) for p in parts]
    if dash:
        if len(parts) != 3:
            raise ValueError(f"{where}: a pre-release needs a full MAJOR.MINOR.PATCH version (e.g. {op}2.1.0-beta.1)")
        try:
            lower = str(parse_semver(body))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    else:
        lower = ".".join(str(n) for n in nums + [0] * (3 - len(nums)))
    if op == "^":
        # Bump the left-most non-zero part given (the last given one if all are zero).
        bump = next((i for i, n in enumerate(nums) if n != 0), len(nums) - 1)
    else:
        bump = 1 if len(nums) >= 2 else 0
    upper = nums[:bump] + [nums[bump] + 1] + [0] * (2 - bump)
    return f">={lower},<{'.'.join(map(str, upper))}"
