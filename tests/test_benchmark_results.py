"""benchmarks/render_results.py: docs/benchmarks.md is generated from the JSON records alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.record import Record  # noqa: E402
from benchmarks.render_results import load_records, main, render  # noqa: E402


def _record(directory: Path, name: str, started: str, value: float, goal: float) -> Path:
    rec = Record(name, load="8 clients", started=started)
    rec.figure("leases_per_s", value, unit="1/s")
    rec.target("leases_per_s_8_clients", value=value, goal=goal, op=">=", unit="1/s")
    return rec.write(directory)


def test_the_page_shows_the_newest_record_of_each_benchmark_its_targets_and_the_history(tmp_path: Path) -> None:
    results = tmp_path / "results"
    old = _record(results, "pool", "2026-01-01T10:00:00Z", 99.0, 150)
    new = _record(results, "pool", "2026-01-02T10:00:00Z", 212.5, 150)
    chaos = _record(results, "chaos", "2026-01-03T10:00:00Z", 3.0, 5)
    (results / "notes.json").write_text(json.dumps({"not": "a record"}))
    out = tmp_path / "docs" / "benchmarks.md"

    assert main(["--results", str(results), "--out", str(out)]) == 0
    page = out.read_text()

    newest, history = page.split("## History")
    # the newest pool record is the one shown, with its target met; the older one only in the history
    assert "| leases_per_s_8_clients | 212.5 1/s | >= 150 1/s | met |" in newest
    assert "99 1/s" not in newest
    assert f"({Path('..') / 'results' / new.name})" in newest
    assert old.name not in newest and old.name in history
    # the reliability harness's record has a section of its own, its missed target marked
    assert "## Reliability harness {#chaos}" in newest
    assert "| leases_per_s_8_clients | 3 1/s | >= 5 1/s | **missed** |" in newest
    # history: every record, newest first; the file that is not a record is left out
    rows = [line for line in history.splitlines() if line.startswith("| 2026-")]
    assert [row.split(" | ")[1] for row in rows] == ["chaos", "pool", "pool"]
    assert rows[0].endswith(f"({Path('..') / 'results' / chaos.name}) |")
    assert "notes.json" not in page


def test_without_records_the_page_says_so(tmp_path: Path) -> None:
    page = render(load_records(tmp_path / "missing"), tmp_path / "benchmarks.md")
    assert "No benchmark record exists yet" in page
    assert "## History" not in page


def test_the_committed_page_is_generated_from_the_committed_records() -> None:
    # Records a local run left uncommitted are not the committed page's business.
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    names = {Path(name).name for name in tracked if name}
    records = [(path, rec) for path, rec in load_records(ROOT / "benchmarks" / "results") if path.name in names]
    expected = render(records, ROOT / "docs" / "benchmarks.md")
    assert (ROOT / "docs" / "benchmarks.md").read_text() == expected, (
        "docs/benchmarks.md is not what benchmarks/results/ renders: run `python benchmarks/render_results.py`"
    )
