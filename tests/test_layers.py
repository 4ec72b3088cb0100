"""The layers of the package hold: `lint-imports` checks the contracts in `.importlinter`
(each package imports only those below it, no cycle between them, the CLI does not import
the agent runtime, the client does not pull in the worker, the core knows no Temporal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 5 kept, 0 broken." in run.stdout, run.stdout
