"""The event log: one JSON object per line, the timeline of every checkpoint.

Events carry the step, the event name and wall-clock time; ``write`` events add
tier, bytes, seconds and the number of concurrent writers (the completion-time
model's input).

The log is a private file (0600, opened without following a symlink) that rotates
at a size cap: past ``max_bytes`` it is renamed to ``<path>.1`` (replacing an older
``.1``) and a new one is started, so it never grows without bound.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from shoal.errors import ShoalError
from shoal.tiers.local import open_private

log = logging.getLogger(__name__)


DEFAULT_MAX_BYTES = 64 << 20
"""The event log's size cap before it rotates (64 MiB: about 250,000 events)."""


class EventLog:
    """Appends events to a JSON-lines file; never raises into the caller (logs instead)."""

    def __init__(
        self, path: str | None, *, host: str = "", rank: int = 0, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.path = path
        self.host = host
        self.rank = rank
        self.max_bytes = max_bytes
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
                os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
                self._append(self.path, line.encode())
            except (OSError, ShoalError) as e:
                if not self._warned:
                    log.warning("cannot write the event log at %s: %s", self.path, e)
                    self._warned = True

    def _append(self, path: str, data: bytes) -> None:
        fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and size + len(data) > self.max_bytes:
                os.close(fd)
                fd = -1
                os.replace(path, path + ".1")
                fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, data)
        finally:
            if fd >= 0:
                os.close(fd)


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
