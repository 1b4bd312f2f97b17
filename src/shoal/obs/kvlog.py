"""A KV store's hits and misses, per tier, as event records over time (for ``shoal report``).

The KV store (:mod:`shoal.kv`) counts its traffic itself (:meth:`~shoal.kv.store.KVStore.stats`)
and tells listeners what happens to its blocks; it writes no event log of its own. A
:class:`KVRecorder` puts those counters into an :class:`~shoal.records.events.EventLog` as
``kv_stats`` records, at most one every ``every`` seconds (at the end of a ``get_batch_into``
call) and one when it is closed, so the report can draw the hit ratio per tier over time::

    from shoal.kv import KVStore
    from shoal.obs.kvlog import KVRecorder
    from shoal.records.events import EventLog

    store = KVStore(config)
    recorder = KVRecorder(store, EventLog("/nvme/kv/events.jsonl", host="h0"), every=1.0)
    ...                      # serve: get_batch_into / put_batch as usual
    recorder.close()         # the last counters
    # shoal report --events /nvme/kv/events.jsonl -o kv.html

A record carries the store's cumulative counters (``tiers``: per tier ``hits``, ``misses``,
``bytes_read``, ``bytes_written``) and ``corrupt``: the numbers of ``stats()`` at that moment,
not a second count. The rates between two records are the traffic in between.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from shoal.records.events import EventLog

__all__ = ["KV_STATS", "KVRecorder"]

KV_STATS = "kv_stats"
"""The records' event name."""


class _Store(Protocol):
    def add_listener(self, fn: Any) -> None: ...

    def stats(self) -> Any: ...


class KVRecorder:
    """Writes ``store``'s traffic counters into ``events`` as ``kv_stats`` records (module docstring).

    ``every``: the least seconds between two records (a call that ends sooner writes none). A
    record is written in the thread that made the call, after it returned its blocks' bytes.
    """

    def __init__(self, store: _Store, events: EventLog, *, every: float = 1.0) -> None:
        if not every > 0:
            raise ValueError(f"every must be > 0 seconds, got {every!r}")
        self.store, self.events, self.every = store, events, every
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._closed = False
        store.add_listener(self._on_event)
        self.record()  # where the counters start

    def _on_event(self, event: Any) -> None:
        if getattr(event, "kind", None) != "fetched" or self._closed:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every:
                return
            self._last = now
        self.record()

    def record(self) -> None:
        """Write one ``kv_stats`` record now (the store's counters at this moment)."""
        stats = self.store.stats()
        tiers = {
            name: {
                "hits": t.hits,
                "misses": t.misses,
                "bytes_read": t.bytes_read,
                "bytes_written": t.bytes_written,
            }
            for name, t in stats.tiers.items()
        }
        with self._lock:
            self._last = time.monotonic()
        self.events.emit(KV_STATS, None, tiers=tiers, corrupt=stats.corrupt)

    def close(self) -> None:
        """Write the last record; later calls of the store write none (idempotent)."""
        if self._closed:
            return
        self.record()
        self._closed = True
