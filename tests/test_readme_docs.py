"""README.md is the front door and docs/ the manual: short, undated, and every link lands."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GENERATED = {"benchmarks.md"}  # generated from the benchmark records, which carry their dates
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_at_most_400_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 400, f"README.md has {lines} lines: move the detail into a page under docs/"


def test_the_readme_and_the_manual_have_no_dated_entries() -> None:
    pages = [README, *(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in GENERATED)]
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not DATED.search(line), f"{page.relative_to(ROOT)}:{number} is a dated entry: {line.strip()}"


def test_every_relative_link_in_the_readme_lands_on_a_file() -> None:
    for target in LINK.findall(README.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = (ROOT / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"README.md links to {target}, which does not exist"


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def test_every_page_under_docs_is_in_the_site_nav_and_every_nav_entry_exists() -> None:
    # mkdocs.yml holds a !!python/name tag (the mermaid fence): read it without resolving tags.
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    nav = set(_nav_pages(config["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries with no page: {sorted(nav - pages)}"
