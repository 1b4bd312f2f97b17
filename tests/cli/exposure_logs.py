"""Synthetic event logs for the exposure and advise tests: one JSON line per event, as EventLog writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shoal.boundary import Boundary
from shoal.model.exposure import CheckpointTimes


def line(event: str, step: int | None, mono: float, rank: int = 0, **fields: Any) -> str:
    """One event record of host ``h0``."""
    base = {
        "v": 1,
        "t": 1.0e9 + mono,
        "mono": mono,
        "event": event,
        "step": step,
        "host": "h0",
        "rank": rank,
    }
    return json.dumps({**base, **fields})


def record(step: int, mono: float, boundaries: dict[str, float], path: str | None, **fields: Any) -> str:
    """A ``checkpoint`` record of rank 0."""
    reached = max(boundaries, key=lambda b: Boundary[b], default=None)
    defaults = {"failed_at": None, "error": None, "bytes": 100, "end": mono}
    return line("checkpoint", step, mono, durability_path=path, boundaries=boundaries, reached=reached,
                 **{**defaults, **fields})  # fmt: skip


def synthetic_log(directory: Path) -> Path:
    """A run from 100 to 400 s: step 10 (partner, committed), step 20 (partner, failed before B3),
    step 30 (skipped), step 40 (direct, committed); a line of rank 1 in between."""
    lines = [
        line("opened", None, 100.0, start=100.0),
        line("save_called", 10, 110.5, called=110.0),
        line("staged", 10, 111.0),
        line("save_called", 10, 110.6, rank=1, called=110.0),
        record(
            10, 131.0, {"STAGED": 1.5, "REPLICATED": 5.0, "PERSISTED": 20.0, "RESTARTABLE": 21.0}, "partner"
        ),
        line("save_called", 20, 210.0, called=210.0),
        line("staged", 20, 212.0),
        record(20, 216.0, {"STAGED": 2.5, "REPLICATED": 6.0}, "partner", failed_at="PERSISTED", error="boom"),
        line("save_called", 30, 260.0, called=260.0),
        line("skipped", 30, 260.1, in_flight=[20]),
        line("save_called", 40, 310.0, called=310.0),
        line("staged", 40, 310.5),
        record(40, 312.0, {"STAGED": 1.0, "REPLICATED": 2.0, "PERSISTED": 2.0, "RESTARTABLE": 2.0}, "direct"),
        line("loaded", 40, 400.0),
    ]
    path = directory / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


SYNTHETIC_RUN = [  # what synthetic_log holds, as the model takes it
    CheckpointTimes(10, 110.0, {1: 111.5, 2: 115.0, 3: 130.0, 4: 131.0}),
    CheckpointTimes(20, 210.0, {1: 212.5, 2: 216.0}),
    CheckpointTimes(40, 310.0, {1: 311.0, 2: 312.0, 3: 312.0, 4: 312.0}),
]
