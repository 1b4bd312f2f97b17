"""The 4-rank, 2-host run the timeline and report tests read (its fixture is in conftest.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from shoal.records.events import Event

HOSTS = ["h0", "h0", "h1", "h1"]
SAVES = 5


@dataclass(frozen=True)
class Run:
    root: Path
    local: Path
    shared_job: Path
    logs: dict[str, str]
    """Each host's event log."""
    events: dict[str, list[Event]]
    """Each host's records, read back by the one reader."""

    def offset(self, host: str) -> float:
        """The host's clock offset, computed here as docs/observability.md says: median(t - mono)."""
        return statistics.median(e.wall - float(e.mono or 0.0) for e in self.events[host])

    @property
    def origin(self) -> float:
        return min(float(e.mono or 0.0) + self.offset(h) for h, es in self.events.items() for e in es)

    def every(self) -> list[Event]:
        return [e for es in self.events.values() for e in es]
