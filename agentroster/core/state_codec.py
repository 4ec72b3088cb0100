"""The pool's continue-as-new state, packed to fit the server's 2 MiB payload limit.

A pool's state is mostly repetition: agents of one deployment share endpoints'
prefixes and capability sets, leases share capabilities, holders and versions.
Plain JSON of 10,000 agents and 10,000 leases is about 6 MiB; zlib over the
sorted, compact JSON brings it to well under 1 MiB (measured by
`benchmarks/bench_state.py`). The packed form stays a JSON object, so the
default data converter, the UI and `temporal workflow show` still read it, and
a run started by older code (plain `PoolCoreState` JSON) is read as before.

Pure and deterministic: the same state packs to the same bytes on every replay.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

from agentroster.core.pool import PoolCoreState

STATE_FORMAT = "agentroster.pool-state/2"
# Decompressed state larger than this is refused rather than inflated: a hand-made
# input must not make the worker allocate without bound.
MAX_UNPACKED_BYTES = 256 * 1024 * 1024
_LEVEL = 6


class StateFormatError(ValueError):
    """The carried state is not one this version can read."""


def encode_state(state: PoolCoreState) -> dict[str, Any]:
    """Pack `state` into a small JSON object for continue-as-new."""
    raw = json.dumps(state.model_dump(mode="json"), separators=(",", ":"), sort_keys=True, allow_nan=False)
    packed = zlib.compress(raw.encode(), _LEVEL)
    return {
        "format": STATE_FORMAT,
        "encoding": "zlib+base64",
        "unpacked_bytes": len(raw),
        "data": base64.b64encode(packed).decode("ascii"),
    }


def decode_state(carried: dict[str, Any]) -> PoolCoreState:
    """Read state written by `encode_state`."""
    if carried.get("format") != STATE_FORMAT or carried.get("encoding") != "zlib+base64":
        raise StateFormatError(
            f"state: format {carried.get('format')!r} with encoding {carried.get('encoding')!r} "
            f"is not {STATE_FORMAT!r} with 'zlib+base64'"
        )
    data = carried.get("data")
    if not isinstance(data, str):
        raise StateFormatError("state.data: must be a base64 string")
    try:
        packed = base64.b64decode(data.encode("ascii"), validate=True)
        inflater = zlib.decompressobj()
        raw = inflater.decompress(packed, MAX_UNPACKED_BYTES)
    except (ValueError, zlib.error) as exc:
        raise StateFormatError(f"state.data: not zlib+base64 ({exc})") from exc
    if inflater.unconsumed_tail:
        raise StateFormatError(f"state.data: unpacks to more than {MAX_UNPACKED_BYTES} bytes")
    return PoolCoreState.model_validate_json(raw)


def packed_size(carried: dict[str, Any]) -> int:
    """Bytes the packed state takes in a JSON payload (what counts toward the 2 MiB limit)."""
    return len(json.dumps(carried, separators=(",", ":")))
