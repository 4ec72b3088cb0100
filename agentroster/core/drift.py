"""Capability drift: one capability name served by several versions at once.

Normal mid-rollout, but an operator must see it: a warning each time the set of
versions served changes while it holds more than one.
"""

from __future__ import annotations


class DriftDetector:
    def __init__(self) -> None:
        self._served: dict[str, frozenset[str]] = {}

    def observe(self, name: str, versions: frozenset[str]) -> str | None:
        """Record the versions of `name` served now; return a warning if they drifted."""
        previous = self._served.get(name, frozenset())
        if versions:
            self._served[name] = versions
        else:
            self._served.pop(name, None)
        if versions != previous and len(versions) > 1:
            listed = ", ".join(sorted(versions))
            return f"capability drift: {name} is served by {len(versions)} versions at once ({listed})"
        return None

    def state(self) -> dict[str, list[str]]:
        return {name: sorted(v) for name, v in sorted(self._served.items())}

    @classmethod
    def from_state(cls, state: dict[str, list[str]]) -> DriftDetector:
        detector = cls()
        detector._served = {name: frozenset(v) for name, v in state.items()}
        return detector
