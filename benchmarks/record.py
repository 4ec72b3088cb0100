"""One JSON record per benchmark or harness run, under `benchmarks/results/`.

A record holds what a reader needs to trust a figure: the commit, the machine,
the load while it ran, the figures and each target with whether it was met.
The docs page `docs/benchmarks.md` is generated from these files
(`python benchmarks/render_results.py`); nothing else writes figures into the docs.

    rec = Record("pool", load="8 clients, 8 agents x 8 slots, 6 s per row")
    rec.figure("leases_per_s_8_clients", 212.4, unit="1/s")
    rec.target("leases_per_s_8_clients_vs_floor", value=0.61, goal=0.60, op=">=")
    path = rec.write()
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
_OPS = {">=": lambda v, g: v >= g, "<=": lambda v, g: v <= g, "==": lambda v, g: v == g}


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=RESULTS.parent, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=RESULTS.parent, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load],
    }


@dataclass
class Record:
    """A benchmark's figures and targets; `write()` saves it as one JSON file."""

    benchmark: str
    load: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    _t0: float = field(default_factory=time.monotonic, repr=False)
    _machine: dict[str, Any] = field(default_factory=machine, repr=False)

    def figure(self, name: str, value: Any, unit: str = "") -> Any:
        self.figures[name] = {"value": value, "unit": unit} if unit else value
        return value

    def target(self, name: str, value: float, goal: float, op: str = ">=", unit: str = "") -> bool:
        """A figure with its goal; returns whether it was met."""
        if op not in _OPS:
            raise ValueError(f"op: expected one of {sorted(_OPS)}, got {op!r}")
        met = bool(_OPS[op](value, goal))
        self.targets[name] = {"value": value, "goal": goal, "op": op, "unit": unit, "met": met}
        return met

    @property
    def met(self) -> bool:
        return all(t["met"] for t in self.targets.values())

    def as_dict(self) -> dict[str, Any]:
        try:
            load_end = [round(x, 2) for x in os.getloadavg()]
        except OSError:
            load_end = []
        return {
            "benchmark": self.benchmark,
            "started": self.started,
            "seconds": round(time.monotonic() - self._t0, 1),
            "commit": _commit(),
            "machine": {**self._machine, "loadavg_at_end": load_end},
            "load": self.load,
            "figures": self.figures,
            "targets": self.targets,
            "met": self.met,
            "notes": self.notes,
        }

    def write(self, directory: Path | None = None) -> Path:
        """Save as `<benchmark>-<started>.json` (a new file per run) and return its path."""
        directory = directory or Path(os.environ.get("AGENTROSTER_RESULTS_DIR", RESULTS))
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.benchmark}-{self.started.replace(':', '')}.json"
        path.write_text(json.dumps(self.as_dict(), indent=2, sort_keys=False) + "\n")
        print(f"record: {path}", flush=True)
        return path
