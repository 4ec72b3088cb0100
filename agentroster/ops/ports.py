"""Loopback ports for the servers and listeners a process starts itself."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def ephemeral_floor() -> int:
    """The lowest port the kernel binds port 0 to (Linux's `ip_local_port_range`)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port free at this moment, below the kernel's ephemeral range: for a
    dev server, an exporter or any listener started next.

    A dev server binds its internal services (history, matching, worker) to ports
    the kernel hands out from the ephemeral range. A frontend port found the same
    way (binding port 0) can be handed to one of those services before the
    frontend binds it, and the server then dies as it starts ("address already in
    use"). Below that range only callers that name their port compete, and this
    one checks the port is free before it answers.
    """
    low = ephemeral_floor()
    first = max(1024, low - 16384)
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {first}-{low - 1}")


__all__ = ["ephemeral_floor", "free_port"]
