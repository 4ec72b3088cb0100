"""`python benchmarks/run.py`: its sections and its refusal of unknown ones (the figures are the benchmarks' own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_section_of_the_issue_is_in_the_runner() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.run import SECTIONS, sections

    listed = sections(1.0, 10)
    assert "".join(listed) == SECTIONS == "abcdef"
    titles = " ".join(title for title, _ in listed.values())
    for words in ("supervisor", "shards", "cost", "agents on one worker"):
        assert words in titles


def test_an_unknown_section_is_refused_by_name() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--only", "b,x"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert "--only: unknown section(s) x" in run.stderr
