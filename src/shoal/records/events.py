"""The event log: one JSON object per line, the timeline of every checkpoint (``docs/events.md``).

Every line carries the record format version ``v`` (:data:`FORMAT_VERSION`), the event name,
the step, the host and rank, wall-clock time ``t`` and this host's monotonic clock ``mono``
(``time.monotonic()``: comparable between processes of one host, not between hosts). Two
events are the completion-time model's input: ``write`` (one per pack or file written, with
its bytes, monotonic start and end and concurrency: :class:`WriterRecord`) and ``checkpoint``
(one per checkpoint and rank when it finishes, with its boundary times:
:class:`CheckpointRecord`). :func:`read_events` is the one reader.

The log is a private file (0600, opened without following a symlink) that rotates at a size
cap: past ``max_bytes`` it is renamed to ``<path>.1`` (replacing an older ``.1``) and a new one
is started, so it never grows without bound. A line torn by a crash (the host went down while
writing it) is closed by the next process that appends, which then writes a ``torn`` event
after it, so the reader knows that line for a torn one and not for a corrupt log.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from shoal.errors import ShoalError
from shoal.model.writers import WriterSample
from shoal.tiers.files import open_private

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "CheckpointRecord",
    "Event",
    "EventLog",
    "Listener",
    "WriterRecord",
    "monotonic",
    "read_events",
    "writer_samples",
]

DEFAULT_MAX_BYTES = 64 << 20
"""The event log's size cap before it rotates (64 MiB: about 250,000 events)."""

FORMAT_VERSION = 1
"""The record format's major version, ``v`` on every line. New fields do not change it (readers
ignore fields they do not know); a field removed, renamed or given another meaning does."""

TORN = "torn"
"""The event written after a line torn by a crash, by the next process appending to the log."""

monotonic: Callable[[], float] = time.monotonic
"""The clock of ``mono``, ``start`` and ``end`` (per host: not comparable across hosts)."""


Listener = Callable[[dict[str, Any]], None]
"""What :meth:`EventLog.add_listener` takes: called with each record, as the dict written."""


class EventLog:
    """Appends events to a JSON-lines file; never raises into the caller (logs instead).

    :meth:`add_listener` subscribes a function to every record this log emits (metrics derive
    from them, ``docs/observability.md``); with no listener, emitting costs what it always did.
    """

    def __init__(
        self, path: str | None, *, host: str = "", rank: int = 0, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.path = path
        self.host = host
        self.rank = rank
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._warned = False
        self._tail_checked = False
        self._listeners: tuple[Listener, ...] = ()
        self._failed: set[int] = set()
        """ids of listeners that raised once (logged with the traceback; later failures at debug)."""

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(record)`` with every record emitted from now on, after it is written.

        ``record`` is the dict written (``v``, ``t``, ``mono``, ``event``, ``step``, ``host``,
        ``rank`` and the event's fields, ``docs/events.md``); treat it as read-only. ``fn`` runs
        on the emitting thread (the training thread or the background pipeline): keep it short.
        An exception it raises is logged, never raised into the caller. Also called when the log
        has no file (``path`` None).
        """
        if not callable(fn):
            raise ShoalError(f"EventLog.add_listener needs a callable, got {fn!r}")
        with self._lock:
            self._listeners = (*self._listeners, fn)

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """The listeners added (in order), none by default."""
        return self._listeners

    def remove_listener(self, fn: Listener) -> None:
        """Stop calling ``fn`` (a listener added before; anything else is ignored)."""
        with self._lock:
            # ``!=``, not ``is not``: a bound method is a new object at each access, equal to the last
            self._listeners = tuple(f for f in self._listeners if f != fn)

    def emit(self, event: str, step: int | None = None, **fields: Any) -> None:
        record = self._record(event, step, fields)
        log.debug("event %s", record)
        if self.path is not None:
            line = json.dumps(record, default=str) + "\n"
            with self._lock:
                try:
                    os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
                    self._append(self.path, line.encode())
                except (OSError, ShoalError) as e:
                    if not self._warned:
                        log.warning("cannot write the event log at %s: %s", self.path, e)
                        self._warned = True
        if self._listeners:
            self._notify(record)

    def _notify(self, record: dict[str, Any]) -> None:
        for fn in self._listeners:
            try:
                fn(record)
            except Exception:
                if id(fn) in self._failed:
                    log.debug("listener %r failed on a %r record", fn, record["event"], exc_info=True)
                else:
                    self._failed.add(id(fn))
                    log.exception(
                        "event log listener %r failed on a %r record (ignored; later failures of this "
                        "listener are logged at debug level)",
                        fn,
                        record["event"],
                    )

    def _record(self, event: str, step: int | None, fields: Mapping[str, Any]) -> dict[str, Any]:
        record = {
            "v": FORMAT_VERSION,
            "t": time.time(),
            "mono": monotonic(),
            "event": event,
            "step": step,
            "host": self.host,
            "rank": self.rank,
        }
        record.update(fields)
        return record

    def _append(self, path: str, data: bytes) -> None:
        fd = open_private(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and size + len(data) > self.max_bytes:
                os.close(fd)
                fd = -1
                os.replace(path, path + ".1")
                fd = open_private(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
                size = 0
            if not self._tail_checked:
                data = self._close_torn_tail(fd, size) + data
            os.write(fd, data)
        finally:
            if fd >= 0:
                os.close(fd)

    def _close_torn_tail(self, fd: int, size: int) -> bytes:
        """Once per process: what ends a line a crash left unfinished (and says so), or nothing."""
        self._tail_checked = True
        if not size or os.pread(fd, 1, size - 1) == b"\n":
            return b""
        marker = self._record(TORN, None, {"note": "the line before was torn by a crash"})
        return b"\n" + (json.dumps(marker) + "\n").encode()


# -- the reader ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One event as read back: the common fields typed, every field in ``fields``.

    It also reads as the JSON object it was written as (``e["bytes"]``, ``e.get("what")``).
    ``mono`` is None only for a line written before records were versioned (``version`` 0).
    """

    version: int
    event: str
    step: int | None
    host: str
    rank: int
    wall: float
    mono: float | None
    fields: Mapping[str, Any]
    where: str
    """``<file>:<line>``, for messages about this record."""

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


@dataclass(frozen=True)
class WriterRecord(Event):
    """A ``write`` event: one pack or file written to a tier, by one rank.

    ``what`` is ``pack`` (a drain pack on the shared tier), ``replica`` (a partner copy received
    into this host's tier), or ``manifest``/``commit``/``latest`` (the coordinator's commit).
    ``concurrency`` is how many writes of that kind this checkpoint had in flight at once, at most
    (drain packs: the ranks with chunks to drain times the uploads each keeps in flight;
    replicas: the receiving ranks), over every host; ``host_concurrency`` how many on this host.
    """

    tier: str
    what: str
    path: str
    bytes: int
    start: float
    end: float
    seconds: float
    concurrency: int
    host_concurrency: int
    durability_path: str | None


@dataclass(frozen=True)
class CheckpointRecord(Event):
    """A ``checkpoint`` event: one checkpoint as one rank saw it, written once when it finished.

    ``boundaries`` maps each boundary reached (``STAGED`` .. ``RESTARTABLE``) to its seconds
    from the save call; ``end`` is the monotonic time the checkpoint finished on this rank.
    """

    durability_path: str | None
    boundaries: Mapping[str, float]
    reached: str | None
    failed_at: str | None
    error: str | None
    bytes: int
    end: float


_NUMBER = (int, float)
_WRITER_FIELDS: dict[str, tuple[type, ...]] = {
    "tier": (str,),
    "what": (str,),
    "path": (str,),
    "bytes": (int,),
    "start": _NUMBER,
    "end": _NUMBER,
    "seconds": _NUMBER,
    "concurrency": (int,),
    "host_concurrency": (int,),
    "durability_path": (str, type(None)),
}
_CHECKPOINT_FIELDS: dict[str, tuple[type, ...]] = {
    "durability_path": (str, type(None)),
    "boundaries": (dict,),
    "reached": (str, type(None)),
    "failed_at": (str, type(None)),
    "error": (str, type(None)),
    "bytes": (int,),
    "end": _NUMBER,
}
_TYPED: dict[str, tuple[type[Event], dict[str, tuple[type, ...]]]] = {
    "write": (WriterRecord, _WRITER_FIELDS),
    "checkpoint": (CheckpointRecord, _CHECKPOINT_FIELDS),
}


def read_events(
    path: str, *, kinds: Iterable[str] | None = None, rotated: bool = True, private: bool = False
) -> list[Event]:
    """Every event in the log at ``path``, oldest first, typed; ``kinds``: only these event names.

    With ``rotated`` the rotated file ``<path>.1`` (the older events) is read first when it is
    there. Lines are parsed strictly: a record of a newer major version, a line that is not a
    JSON object or lacks a field its event needs raises :class:`~shoal.errors.ShoalError` naming
    the file and the line. A torn line (not JSON) is skipped when it is the file's last line
    (a crash while writing it) or when a ``torn`` event follows it (closed by the next writer);
    ``torn`` events themselves are not returned.

    With ``private`` (a process that acts on what the log says, not a person reading it), each
    file is opened as the writer opens it: no symlink followed, owned by this user, writable by
    nobody else (:func:`~shoal.tiers.files.open_private`; :class:`~shoal.errors.OwnershipError`).
    """
    wanted = None if kinds is None else frozenset(kinds)
    events: list[Event] = []
    for name, f in _open_log(path, rotated, private):
        with f:
            events.extend(e for e in _parse(name, f) if wanted is None or e.event in wanted)
    return events


def writer_samples(
    events: Iterable[Event], *, what: str = "pack", tier: str = "shared"
) -> list[WriterSample]:
    """The completion-time model's input (:class:`shoal.model.WriterSample`) from writer records.

    One sample per ``write`` record of kind ``what`` on ``tier`` (default: the drain packs on the
    shared tier; ``what="replica"`` on ``local`` or ``dram`` for the partner copies): its step
    as the checkpoint (its writers share the tier's state), its bytes, its seconds (end - start),
    the writers it shared the tier with (``concurrency``) and its end time. Records of one host's
    log only: merge the hosts' logs for a job's whole checkpoint.
    """
    return [
        WriterSample(e.step, e.bytes, e.end - e.start, max(1, e.concurrency), e.end)
        for e in events
        if isinstance(e, WriterRecord)
        and e.step is not None
        and e.what == what
        and e.tier == tier
        and e.end > e.start
        and e.bytes > 0
    ]


def _open_log(path: str, rotated: bool, private: bool = False) -> list[tuple[str, IO[str]]]:
    """The log's files, oldest first; the current one opened first, so a rotation in between
    shows as both names holding the same file (read once) rather than as events lost."""

    def open_text(name: str) -> IO[str]:
        if private:
            return os.fdopen(open_private(name, os.O_RDONLY), encoding="utf-8")
        return open(name, encoding="utf-8")  # noqa: SIM115 - closed by the caller

    current = open_text(path)
    files: list[tuple[str, IO[str]]] = [(path, current)]
    older = path + ".1"
    if rotated and os.path.exists(older):
        try:
            f = open_text(older)
        except FileNotFoundError:
            return files
        if os.fstat(f.fileno()).st_ino == os.fstat(current.fileno()).st_ino:
            f.close()
        else:
            files.insert(0, (older, f))
    return files


def _parse(name: str, f: IO[str]) -> Iterator[Event]:
    torn: int | None = None  # the number of a torn line not yet explained
    for number, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if torn is not None:
                raise ShoalError(f"{name}:{torn}: not a JSON event record") from None
            torn = number
            continue
        where = f"{name}:{number}"
        if torn is not None and not (isinstance(record, dict) and record.get("event") == TORN):
            raise ShoalError(f"{name}:{torn}: not a JSON event record")
        torn = None
        event = _typed(record, where)
        if event.event != TORN:
            yield event
    # A torn last line (``torn`` still set) is a crash while writing it: skipped.


def _typed(record: Any, where: str) -> Event:
    if not isinstance(record, dict):
        raise ShoalError(f"{where}: an event record must be a JSON object, not {type(record).__name__}")
    version = record.get("v", 0)
    if type(version) is not int or not 0 <= version <= FORMAT_VERSION:
        raise ShoalError(
            f"{where}: event record version {version!r} is not one this shoal reads "
            f"(it reads up to {FORMAT_VERSION}): written by a newer shoal?"
        )
    common: dict[str, tuple[type, ...]] = {
        "event": (str,),
        "step": (int, type(None)),
        "host": (str,),
        "rank": (int,),
        "t": _NUMBER,
    }
    if version >= 1:
        common["mono"] = _NUMBER
    _check(record, common, where)
    base = {
        "version": version,
        "event": record["event"],
        "step": record["step"],
        "host": record["host"],
        "rank": record["rank"],
        "wall": record["t"],
        "mono": record.get("mono"),
        "fields": record,
        "where": where,
    }
    typed = _TYPED.get(record["event"]) if version >= 1 else None
    if typed is None:
        return Event(**base)
    cls, fields = typed
    _check(record, fields, where)
    return cls(**base, **{k: record[k] for k in fields})


def _check(record: Mapping[str, Any], fields: Mapping[str, tuple[type, ...]], where: str) -> None:
    for key, types in fields.items():
        if key not in record:
            raise ShoalError(f"{where}: a {record.get('event')!r} event record has no {key!r}")
        value = record[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ShoalError(
                f"{where}: {key!r} of a {record.get('event')!r} event record is {value!r}, "
                f"not {' or '.join(t.__name__ for t in types)}"
            )
