"""The event log: one JSON object per line, the timeline of every checkpoint.

Events carry the step, the event name and wall-clock time; ``write`` events add
tier, bytes, seconds and the number of concurrent writers (the completion-time
model's input).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to a JSON-lines file; never raises into the caller (logs instead)."""

    def __init__(self, path: str | None, *, host: str = "", rank: int = 0) -> None:
        self.path = path
        self.host = host
        self.rank = rank
        self._lock = threading.Lock()
        self._warned = False

    def emit(self, event: str, step: int | None = None, **fields: Any) -> None:
        record = {"t": time.time(), "event": event, "step": step, "host": self.host, "rank": self.rank}
        record.update(fields)
        log.debug("event %s", record)
        if self.path is None:
            return
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError as e:
                if not self._warned:
                    log.warning("cannot write the event log at %s: %s", self.path, e)
                    self._warned = True


def read_events(path: str) -> list[dict[str, Any]]:
    """Every well-formed event in the log (a torn last line is skipped)."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
