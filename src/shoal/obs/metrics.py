"""Prometheus metrics derived from the event records (``docs/observability.md``, "Metrics").

:class:`Metrics` owns shoal's metrics on a ``prometheus_client`` registry (the caller's, or its
own) and maps event records to them in :meth:`Metrics.observe`. It is fed one of two ways:

* as a listener of an :class:`~shoal.records.events.EventLog` (``events.add_listener(m.observe)``):
  the records of that process, as they are emitted, into a registry the caller exports;
* from a host's event log file (``log_path``): each collection first reads what the host's ranks
  appended since the last one, so one endpoint serves every rank of the host without a second
  channel between processes. This is what ``Config.metrics_port`` starts
  (:class:`MetricsServer`, on the host's first rank).

A :class:`~shoal.kv.store.KVStore` is bound with :meth:`Metrics.bind_kv`: its hit and miss counts
come from its ``stats()`` at each collection, corrupt copies and fetch times from its events.

``prometheus_client`` is imported when a :class:`Metrics` is made, never when this module is: the
core imports this module and stays free of it while metrics are off.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from shoal.errors import ConfigError, ShoalError
from shoal.model.exposure import FAILURE_CLASSES
from shoal.records.events import FORMAT_VERSION, TORN, monotonic
from shoal.tiers.files import open_private

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

__all__ = [
    "KV_SECONDS_BUCKETS",
    "NO_PATH",
    "SECONDS_BUCKETS",
    "KVSource",
    "Metrics",
    "MetricsServer",
    "require_prometheus",
]

SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
)  # fmt: skip
"""Buckets of the stall, boundary and restore histograms: a millisecond's stall to an hour's drain."""

KV_SECONDS_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Buckets of ``shoal_kv_fetch_seconds``: a pool hit in microseconds to a slow shared-tier read."""

NO_PATH = "none"
"""The ``path`` label of a record without a durability path (failed before the path was chosen)."""

COORDINATOR = 0
"""The rank whose records carry the job's own numbers (the plan, the path, the exposure)."""

_CALLS_KEPT = 256
"""Save calls remembered for the exposure gauge (the protecting checkpoint is a recent one)."""

_INSTALL = "install the metrics extra: pip install 'shoal[metrics]'"


def require_prometheus(what: str) -> None:
    """Raise :class:`~shoal.errors.ConfigError` naming ``what`` unless ``prometheus_client`` is
    installed (looked up, not imported)."""
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(f"{what} needs prometheus_client, which is not installed: {_INSTALL}")


class KVSource(Protocol):
    """What :meth:`Metrics.bind_kv` needs of a KV store (:class:`~shoal.kv.store.KVStore` is one)."""

    def add_listener(self, fn: Callable[[Any], None]) -> None: ...

    def stats(self) -> Any: ...


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _label(value: Any) -> str:
    return value if isinstance(value, str) and value else NO_PATH


class Metrics:
    """shoal's Prometheus metrics on ``registry`` (default: a new ``CollectorRegistry`` of its own).

    ``log_path``: read the records from this event log file (every rank of a host writes the
    same one) at each collection, from its end as it is now; otherwise only what
    :meth:`observe` is given counts. Every metric is registered as one collector, so a second
    :class:`Metrics` on the same registry is a :class:`~shoal.errors.ConfigError`.

    Raises :class:`~shoal.errors.ConfigError` when ``prometheus_client`` is not installed.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, log_path: str | None = None) -> None:
        require_prometheus("shoal.obs.metrics.Metrics")
        import prometheus_client as prom
        import prometheus_client.metrics_core as core

        self.registry: CollectorRegistry = prom.CollectorRegistry() if registry is None else registry
        """The registry these metrics are collected from (export it, or serve it with :meth:`serve`)."""
        self._prom = prom
        self._core = core
        self._lock = threading.RLock()
        hist, counter, gauge = prom.Histogram, prom.Counter, prom.Gauge
        self.save_stall = hist(
            "shoal_save_stall_seconds",
            "Seconds a save blocked training (from the save call to B1 STAGED), one per rank and "
            "checkpoint; path: the checkpoint's durability path",
            ["path"],
            buckets=SECONDS_BUCKETS,
            registry=None,
        )
        self.boundary = hist(
            "shoal_boundary_seconds",
            "Seconds from the save call to each boundary a checkpoint reached (STAGED, REPLICATED, "
            "PERSISTED, RESTARTABLE), one per rank, checkpoint and boundary",
            ["boundary", "path"],
            buckets=SECONDS_BUCKETS,
            registry=None,
        )
        self.written = counter(
            "shoal_written_bytes_total",
            "Bytes written, per tier (shared, local, dram), kind of file (pack: drain packs, replica: "
            "partner copies received, manifest, commit, latest) and durability path",
            ["tier", "what", "path"],
            registry=None,
        )
        self.staged = counter(
            "shoal_staged_bytes_total",
            "Bytes the ranks staged for checkpoints that finished (before dedup)",
            registry=None,
        )
        self.dedup = counter(
            "shoal_dedup_bytes_total",
            "Bytes dedup kept from being written to the shared tier: kind=within (a chunk staged "
            "more than once in the checkpoint), kind=reused (already on the shared tier)",
            ["kind"],
            registry=None,
        )
        self.checkpoints = counter(
            "shoal_checkpoints_total",
            "Checkpoints, by outcome: committed (reached B4), failed, skipped (every DRAM slot busy)",
            ["outcome"],
            registry=None,
        )
        self.predicted_b2 = gauge(
            "shoal_predicted_b2_seconds",
            "The completion-time model's predicted quantile (Config.path='auto': p90) of the latest "
            "checkpoint's time to B2 REPLICATED by each path, in seconds from the save call",
            ["path"],
            registry=None,
        )
        self.observed_b2 = gauge(
            "shoal_observed_b2_seconds",
            "The observed time to B2 REPLICATED of the latest checkpoint that took each path, in "
            "seconds from the save call",
            ["path"],
            registry=None,
        )
        self.restore = hist(
            "shoal_restore_seconds",
            "Seconds a load took (Checkpointer.load), one per rank and load",
            buckets=SECONDS_BUCKETS,
            registry=None,
        )
        self.restore_bytes = counter(
            "shoal_restore_bytes_total",
            "Bytes loads read, per source tier (dram, local, shared), over the whole job",
            ["tier"],
            registry=None,
        )
        self.kv_corrupt = counter(
            "shoal_kv_corrupt_total",
            "KV blocks found corrupt or torn (deleted, never served), per tier",
            ["tier"],
            registry=None,
        )
        self.kv_fetch = hist(
            "shoal_kv_fetch_seconds",
            "Seconds of one KV get_batch_into call; tier: the lowest tier it had to ask",
            ["tier"],
            buckets=KV_SECONDS_BUCKETS,
            registry=None,
        )
        self._metrics: tuple[Any, ...] = (
            self.save_stall, self.boundary, self.written, self.staged, self.dedup, self.checkpoints,
            self.predicted_b2, self.observed_b2, self.restore, self.restore_bytes, self.kv_corrupt,
            self.kv_fetch,
        )  # fmt: skip
        self._handlers: dict[str, Callable[[Mapping[str, Any]], None]] = {
            "checkpoint": self._on_checkpoint,
            "write": self._on_write,
            "planned": self._on_planned,
            "skipped": self._on_skipped,
            "path": self._on_path,
            "path_observed": self._on_path_observed,
            "loaded": self._on_loaded,
            "opened": self._on_opened,
            "save_called": self._on_save_called,
            "exposure": self._on_exposure,
        }
        self._origins: dict[str, float] = {}
        """Per failure class: when the training it would lose began (the coordinator's clock)."""
        self._start: float | None = None
        self._called: OrderedDict[int, float] = OrderedDict()
        self._stores: list[KVSource] = []
        self._bad: set[str] = set()
        self._tail = None if log_path is None else LogTail(log_path)
        try:
            self.registry.register(self)  # one collector: collect() reads the log before any metric
        except ValueError as e:  # a name the registry holds already
            raise ConfigError(f"cannot register shoal's metrics on {self.registry!r}: {e}") from e

    # -- records -----------------------------------------------------------------------------
    def observe(self, record: Mapping[str, Any]) -> None:
        """Update the metrics from one event record (a dict as written, ``docs/events.md``).

        Events that feed no metric are ignored; a record with a field of the wrong type is
        logged (once per event name) and ignored. Never raises: it is an event log listener.
        """
        try:
            handler = self._handlers.get(record.get("event"))  # type: ignore[arg-type]
            if handler is None:
                return
            with self._lock:
                handler(record)
        except Exception:
            event = str(record.get("event")) if isinstance(record, Mapping) else repr(record)
            if event not in self._bad:
                self._bad.add(event)
                log.warning(
                    "metrics: ignored a %r record it could not read: %r", event, record, exc_info=True
                )

    def _on_checkpoint(self, r: Mapping[str, Any]) -> None:
        path = _label(r.get("durability_path"))
        boundaries = r.get("boundaries")
        if isinstance(boundaries, Mapping):
            stall = boundaries.get("STAGED")
            if stall is not None and _number(stall):
                self.save_stall.labels(path).observe(stall)
            for name, seconds in boundaries.items():
                if isinstance(name, str) and _number(seconds):
                    self.boundary.labels(name, path).observe(seconds)
        if _count(r.get("bytes")):
            self.staged.inc(r["bytes"])
        if r.get("rank") == COORDINATOR:
            self.checkpoints.labels("committed" if r.get("reached") == "RESTARTABLE" else "failed").inc()

    def _on_write(self, r: Mapping[str, Any]) -> None:
        if _count(r.get("bytes")) and isinstance(r.get("tier"), str) and isinstance(r.get("what"), str):
            self.written.labels(r["tier"], r["what"], _label(r.get("durability_path"))).inc(r["bytes"])

    def _on_planned(self, r: Mapping[str, Any]) -> None:
        logical, unique, reused = (
            r.get("logical_bytes", -1),
            r.get("unique_bytes", -1),
            r.get("reused_bytes", -1),
        )
        if _count(logical) and _count(unique) and logical >= unique:
            self.dedup.labels("within").inc(logical - unique)
        if _count(reused):
            self.dedup.labels("reused").inc(reused)

    def _on_skipped(self, r: Mapping[str, Any]) -> None:
        if r.get("rank") == COORDINATOR:
            self.checkpoints.labels("skipped").inc()

    def _on_path(self, r: Mapping[str, Any]) -> None:
        if r.get("rank") != COORDINATOR:
            return
        predictions = r.get("predictions")
        self.predicted_b2.clear()  # a rule's decision predicts nothing: no stale prediction stays
        if isinstance(predictions, Mapping):
            for path, p in predictions.items():
                if isinstance(p, Mapping) and _number(p.get("seconds")):
                    self.predicted_b2.labels(str(path)).set(p["seconds"])

    def _on_path_observed(self, r: Mapping[str, Any]) -> None:
        if r.get("rank") == COORDINATOR and _number(r.get("b2")):
            self.observed_b2.labels(_label(r.get("path"))).set(r["b2"])

    def _on_loaded(self, r: Mapping[str, Any]) -> None:
        if _number(r.get("seconds")):
            self.restore.observe(r["seconds"])
        by_tier = r.get("bytes_by_tier")
        if r.get("rank") == COORDINATOR and isinstance(by_tier, Mapping):  # the job's totals, on every rank
            for tier, n in by_tier.items():
                if _count(n):
                    self.restore_bytes.labels(str(tier)).inc(n)

    def _on_opened(self, r: Mapping[str, Any]) -> None:
        if r.get("rank") == COORDINATOR and _number(r.get("start")):
            self._start = r["start"]
            self._called.clear()
            self._origins = dict.fromkeys(FAILURE_CLASSES, r["start"])  # nothing protects anything yet

    def _on_save_called(self, r: Mapping[str, Any]) -> None:
        if r.get("rank") == COORDINATOR and _number(r.get("called")) and isinstance(r.get("step"), int):
            self._called[r["step"]] = r["called"]
            while len(self._called) > _CALLS_KEPT:
                self._called.popitem(last=False)

    def _on_exposure(self, r: Mapping[str, Any]) -> None:
        classes = r.get("classes")
        if r.get("rank") != COORDINATOR or not isinstance(classes, Mapping) or not _number(r.get("mono")):
            return
        for name, c in classes.items():
            if not isinstance(c, Mapping) or not _number(c.get("seconds")):
                continue
            protected = c.get("protected_step")
            if protected is None and self._start is not None:
                origin = self._start
            elif isinstance(protected, int) and protected in self._called:
                origin = self._called[protected]
            else:  # its save call came before what this saw: the record's own numbers
                origin = r["mono"] - c["seconds"]
            self._origins[str(name)] = origin

    # -- the KV store ------------------------------------------------------------------------
    def bind_kv(self, store: KVSource) -> None:
        """Export ``store``'s numbers: hits, misses, bytes per tier (its ``stats()``, read at each
        collection), corrupt copies and fetch times (its events, from now on)."""
        if not (callable(getattr(store, "add_listener", None)) and callable(getattr(store, "stats", None))):
            raise ConfigError(f"Metrics.bind_kv needs a KV store (add_listener and stats), got {store!r}")
        store.add_listener(self._on_kv_event)
        with self._lock:
            self._stores.append(store)

    def _on_kv_event(self, event: Any) -> None:
        kind = getattr(event, "kind", None)
        if kind == "corrupt":
            self.kv_corrupt.labels(str(event.tier)).inc()
        elif kind == "fetched" and _number(event.seconds):
            self.kv_fetch.labels(str(event.tier)).observe(event.seconds)

    # -- collection --------------------------------------------------------------------------
    def collect(self) -> list[Metric]:
        """Every metric family now (what a scrape of :attr:`registry` returns of shoal's)."""
        with self._lock:
            if self._tail is not None:
                for record in self._tail.read():
                    self.observe(record)
            families: list[Metric] = [f for m in self._metrics for f in m.collect()]
            origins = dict(self._origins)
            stores = list(self._stores)
        families.append(self._exposure(origins))
        families.extend(self._kv_families(stores))
        return families

    def describe(self) -> list[Metric]:
        """The metric families without samples (the registry's check of names)."""
        families: list[Metric] = [f for m in self._metrics for f in m.describe()]
        families.append(self._exposure({}))
        families.extend(self._kv_families([]))
        return families

    def _exposure(self, origins: Mapping[str, float]) -> Metric:
        family = self._core.GaugeMetricFamily(
            "shoal_exposure_seconds",
            "Training a failure of each class would lose now: seconds since the save call of the "
            "newest checkpoint that reached the boundary protecting against it (process: B1, host: "
            "B2, cluster: B4), or since the run started",
            labels=["failure_class"],
        )
        now = monotonic()
        for name, origin in sorted(origins.items()):
            family.add_metric([name], max(0.0, now - origin))
        return family

    def _kv_families(self, stores: list[KVSource]) -> list[Metric]:
        core = self._core
        kinds: list[tuple[str, str, Any]] = [
            ("shoal_kv_hits", "KV blocks served from each tier (verified)", core.CounterMetricFamily),
            (
                "shoal_kv_misses",
                "KV blocks each tier was asked for and did not hold",
                core.CounterMetricFamily,
            ),
            ("shoal_kv_read_bytes", "KV bytes served from each tier", core.CounterMetricFamily),
            ("shoal_kv_written_bytes", "KV bytes written into each tier", core.CounterMetricFamily),
            (
                "shoal_kv_used_bytes",
                "KV bytes each host tier holds (physical, host-wide)",
                core.GaugeMetricFamily,
            ),
            ("shoal_kv_capacity_bytes", "KV bytes each host tier may hold", core.GaugeMetricFamily),
        ]
        totals: dict[str, dict[str, float]] = {name: {} for name, _, _ in kinds}
        for store in stores:
            try:
                tiers = store.stats().tiers
            except Exception as e:  # a closed store: nothing to say
                log.debug("metrics: KV store %r has no stats: %s", store, e)
                continue
            for tier, s in tiers.items():
                values = (s.hits, s.misses, s.bytes_read, s.bytes_written, s.bytes_used, s.capacity)
                for (name, _, _), value in zip(kinds, values, strict=True):
                    if value is not None:
                        totals[name][tier] = totals[name].get(tier, 0) + value
        families: list[Metric] = []
        for name, doc, family_type in kinds:
            family = family_type(name, doc, labels=["tier"])
            for tier, value in sorted(totals[name].items()):
                family.add_metric([tier], value)
            families.append(family)
        return families

    # -- serving -----------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "") -> MetricsServer:
        """Serve :attr:`registry` over HTTP on ``addr:port`` (``port`` 0: a free one; ``addr`` "":
        every interface) in a daemon thread; :meth:`MetricsServer.close` stops it.

        Raises :class:`~shoal.errors.ConfigError` naming the address when it cannot be bound.
        """
        return MetricsServer(self, port, addr)

    def close(self) -> None:
        """Stop reading the event log and leave the registry (idempotent)."""
        with self._lock:
            if self._tail is not None:
                self._tail.close()
                self._tail = None
        with contextlib.suppress(KeyError):
            self.registry.unregister(self)


class MetricsServer:
    """``prometheus_client``'s HTTP server over a :class:`Metrics` registry (:meth:`Metrics.serve`)."""

    def __init__(self, metrics: Metrics, port: int, addr: str = "") -> None:
        from prometheus_client import start_http_server

        self.metrics = metrics
        bind = addr or "0.0.0.0"
        try:
            self._server, self._thread = start_http_server(port, bind, registry=metrics.registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {bind}:{port} (Config.metrics_port): {e}") from e
        self.address: str = str(self._server.server_address[0])
        self.port: int = int(self._server.server_address[1])
        """The port bound (the one asked for, or the free one chosen for 0)."""
        self._closed = False

    @property
    def url(self) -> str:
        """``http://<host>:<port>/metrics`` (the loopback address when bound to every interface)."""
        host = "127.0.0.1" if self.address in ("0.0.0.0", "::", "") else self.address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


# -- following a host's event log ------------------------------------------------------------


class LogTail:
    """The records appended to one event log file since this was made, rotation followed.

    Each :meth:`read` returns what the host's processes appended since the last one. The file
    is opened as its writers open it (no symlink followed, owned by this user); a rotation
    (``<path>`` renamed to ``<path>.1``) is noticed at the next read, which finishes the old file
    (kept open: a writer that opened it before the rename may still append a line) and reads
    the new one from its start. Lines that are not JSON objects (a line torn by a crash) and
    ``torn`` markers are skipped; records of a newer format version are skipped with a warning.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._files: list[_TailFile] = []
        self._warned = False
        self._newer = False
        try:
            first = _TailFile(path)
        except FileNotFoundError:
            return  # the log does not exist yet: read from its start once it does
        first.skip_to_end()
        self._files.append(first)

    def read(self) -> list[dict[str, Any]]:
        """The records appended since the last call (oldest first)."""
        records: list[dict[str, Any]] = []
        try:
            for f in self._files:
                records += f.read()
            self._follow_rotation(records)
        except (OSError, ShoalError) as e:
            if not self._warned:
                self._warned = True
                log.warning("metrics: cannot read the event log %s: %s", self.path, e)
        readable = [r for r in records if _readable_version(r.get("v", 0))]
        if len(readable) < len(records) and not self._newer:
            self._newer = True
            log.warning("metrics: %s holds records of a newer shoal's format: skipped", self.path)
        return readable

    def _follow_rotation(self, records: list[dict[str, Any]]) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        known = {f.identity for f in self._files}
        if (st.st_dev, st.st_ino) in known:
            return
        if self._files:  # rotated since the last read: the rotated file may be one never seen
            try:
                older = os.stat(self.path + ".1")
                if (older.st_dev, older.st_ino) not in known:
                    rotated = _TailFile(self.path + ".1")
                    records += rotated.read()
                    self._files.append(rotated)
            except FileNotFoundError:
                pass
        current = _TailFile(self.path)
        records += current.read()
        self._files.append(current)
        while len(self._files) > 2:
            self._files.pop(0).close()

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


def _readable_version(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= FORMAT_VERSION


class _TailFile:
    """One open file of the log: the bytes read so far and an unfinished last line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_private(path, os.O_RDONLY)
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)
        self._rest = b""

    def skip_to_end(self) -> None:
        os.lseek(self.fd, 0, os.SEEK_END)

    def read(self) -> list[dict[str, Any]]:
        chunks = [self._rest]
        while True:
            data = os.read(self.fd, 1 << 20)
            if not data:
                break
            chunks.append(data)
        lines = b"".join(chunks).split(b"\n")
        self._rest = lines.pop()  # the unfinished line (b"" after a newline)
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a torn line (or an empty one)
                continue
            if isinstance(record, dict) and record.get("event") != TORN:
                records.append(record)
        return records

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
