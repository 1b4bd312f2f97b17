"""Writer fencing: one process at a time commits into a job on shared storage (docs/design.md section 11).

Two processes that save under one ``Config.job`` into one shared root (a job name used
twice, on two machines) would otherwise interleave their commits, move ``LATEST`` back
and forth and delete each other's packs. The job's ``WRITER`` record names the process
allowed to commit::

    <shared>/<job>/WRITER   {"format": "shoal-writer/1", "writer": "<16 hex>", "host": "...",
                             "pid": N, "claimed": <unix time>}

Who calls what, all on the coordinator (rank 0), from the pipeline thread:

* :meth:`WriterFence.claim` by :class:`~shoal.engine.group_save.GroupSave` before the first
  commit of the process (never at construction: a process that only loads must not fence
  the trainer). The newest claim wins: it overwrites the record of the writer before it.
* :meth:`WriterFence.check` before the manifest, the ``COMMIT`` record and the ``LATEST``
  move of every checkpoint, and by the pipeline before each retention pass on the shared
  tier. It raises :class:`~shoal.errors.WriterFenced` once another writer holds the job, or
  when the record is missing or malformed: a writer that cannot prove it holds the job
  writes nothing more into it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import time
from dataclasses import dataclass

from shoal.errors import FormatError, ShoalError, WriterFenced
from shoal.format import layout
from shoal.format.strict_json import load_json
from shoal.records.small import read_record
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)

WRITER_FORMAT = "shoal-writer/1"
_WRITER_ID = re.compile(r"[0-9a-f]{16}")
_MAX_HOST = 255
MAX_LINEAGE = 64
"""How many earlier writers a ``WRITER`` record lists as continued (older ones fall off)."""

__all__ = [
    "WRITER_FORMAT",
    "WriterFence",
    "WriterClaim",
    "after_failed_commit",
    "decode_writer",
    "read_writer",
]


@dataclass(frozen=True)
class WriterClaim:
    """A job's writer claim (its ``WRITER`` record): who claimed the job, where and when."""

    writer: str
    host: str
    pid: int
    claimed: float
    inherits: tuple[str, ...] = ()
    """Earlier writers whose history this one continues (it resumed from their checkpoints):
    their steps count as its own for retention. Newest last, at most :data:`MAX_LINEAGE`."""

    @property
    def lineage(self) -> frozenset[str]:
        """This writer and every writer it continues: the steps retention judges as its own."""
        return frozenset((self.writer, *self.inherits))

    def encode(self) -> bytes:
        doc: dict[str, object] = {
            "format": WRITER_FORMAT,
            "writer": self.writer,
            "host": self.host,
            "pid": self.pid,
            "claimed": self.claimed,
        }
        if self.inherits:
            doc["inherits"] = list(self.inherits)
        return json.dumps(doc).encode()

    def describe(self) -> str:
        """``writer 0123abcd... (host 'a', pid 42, claimed 2024-05-01 12:00:00 UTC)``, for messages."""
        return f"writer {self.writer} (host {self.host!r}, pid {self.pid}, claimed {_when(self.claimed)})"


def _when(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        return f"at unix time {t!r}"


def decode_writer(data: bytes, where: str) -> WriterClaim:
    """Parse and validate a ``WRITER`` record; any problem is a :class:`~shoal.errors.FormatError`."""
    doc = load_json(data, f"writer record {where}")
    if not isinstance(doc, dict):
        raise FormatError(f"writer record {where}: expected a JSON object, got {type(doc).__name__}")
    fmt = doc.get("format")
    if fmt != WRITER_FORMAT:
        raise FormatError(f"writer record {where}: format is {fmt!r}, expected {WRITER_FORMAT!r}")
    writer, host, pid, claimed = (doc.get(k) for k in ("writer", "host", "pid", "claimed"))
    if not isinstance(writer, str) or not _WRITER_ID.fullmatch(writer):
        raise FormatError(f"writer record {where}: writer {writer!r} is not 16 lowercase hex digits")
    if not isinstance(host, str) or not 0 < len(host) <= _MAX_HOST:
        raise FormatError(
            f"writer record {where}: host {host!r} is not a name of 1 to {_MAX_HOST} characters"
        )
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
        raise FormatError(f"writer record {where}: pid {pid!r} is not a non-negative integer")
    if isinstance(claimed, bool) or not isinstance(claimed, int | float) or not math.isfinite(claimed):
        raise FormatError(f"writer record {where}: claimed {claimed!r} is not a time")
    inherits = doc.get("inherits", [])
    if (
        not isinstance(inherits, list)
        or len(inherits) > MAX_LINEAGE
        or not all(isinstance(w, str) and _WRITER_ID.fullmatch(w) for w in inherits)
    ):
        raise FormatError(
            f"writer record {where}: inherits must be a list of at most {MAX_LINEAGE} writer ids"
        )
    return WriterClaim(writer, host, pid, float(claimed), tuple(inherits))


def read_writer(shared: Tier) -> WriterClaim | None:
    """The job's ``WRITER`` record, or None if there is none; FormatError if it is malformed."""
    return read_record(shared, layout.WRITER, decode_writer, what="writer record")


class WriterFence:
    """This process's claim on a job (the coordinator's ``PipelineContext.writer``).

    Create it with :meth:`claim`. ``superseded_by`` is set by :meth:`check` once another
    writer's record was seen, and never cleared: a writer that lost the job does not get it
    back (the process must be restarted, under another ``Config.job`` or shared root).
    """

    def __init__(self, record: WriterClaim) -> None:
        self.record = record
        self.superseded_by: WriterClaim | None = None

    @property
    def writer_id(self) -> str:
        return self.record.writer

    @property
    def lineage(self) -> frozenset[str]:
        """The writer ids whose steps this process's retention judges as its own."""
        return self.record.lineage

    @classmethod
    def claim(cls, shared: Tier, *, host: str, pid: int, resumed: bool = False) -> WriterFence:
        """Write a fresh ``WRITER`` record on ``shared`` (the newest claim wins) and return the fence.

        A record left by another writer is replaced: that writer's next commit fails with
        :class:`~shoal.errors.WriterFenced`. With ``resumed`` (this process loaded one of the
        job's checkpoints before its first commit: a restart) the new writer continues the old
        one's history, so retention judges the old writer's steps as its own; without it (a
        process that starts saving into a job it never loaded) the old steps are another
        writer's, kept apart, and the takeover is logged as a warning.
        """
        try:
            previous = read_writer(shared)
        except FormatError as e:
            log.warning("replacing the unreadable writer record of %s: %s", shared.url, e)
            previous = None
        inherits: tuple[str, ...] = ()
        if resumed and previous is not None:
            inherits = (*previous.inherits, previous.writer)[-MAX_LINEAGE:]
        record = WriterClaim(secrets.token_hex(8), host, pid, time.time(), inherits)
        shared.write(layout.WRITER, record.encode())
        if previous is not None and resumed:
            log.info(
                "%s: this process (host %r, pid %d) resumed the job and continues %s",
                shared.url,
                host,
                pid,
                previous.describe(),
            )
        elif previous is not None:
            log.warning(
                "%s: this process (host %r, pid %d) takes over the job from %s; that writer commits "
                "nothing more. Two jobs writing with the same Config.job into one shared root? Give "
                "one of them another Config.job or shared root.",
                shared.url,
                host,
                pid,
                previous.describe(),
            )
        else:
            log.info("%s: claimed the job as %s", shared.url, record.describe())
        return cls(record)

    def holder(self, shared: Tier) -> WriterClaim | None:
        """Who holds the job now, read from ``shared`` (None: no record; FormatError: malformed)."""
        return read_writer(shared)

    def check(self, shared: Tier, action: str = "commit") -> None:
        """Raise :class:`~shoal.errors.WriterFenced` unless ``shared``'s record still names this writer.

        ``action`` says what was about to happen (``"commit step 5"``), for the message.
        I/O errors reading the record propagate as they are (:class:`~shoal.errors.TierError`).
        """
        where = f"{shared.url}/{layout.WRITER}"
        me = self.record.describe()
        try:
            current = self.holder(shared)
        except ShoalError as e:
            if isinstance(e, FormatError):
                raise WriterFenced(
                    f"will not {action} in {shared.url}: its writer record is unreadable ({e}), so this "
                    f"process ({me}) cannot tell whether another job writes there. If two jobs use the "
                    f"same Config.job and shared root, give one of them another; if not, delete {where}: "
                    "a save that then finds no record lets this process claim the job anew."
                ) from e
            raise
        if current is None:
            raise WriterFenced(
                f"will not {action} in {shared.url}: its writer record {where} is missing (was the job "
                f"directory removed?), so this process ({me}) cannot tell whether another job writes "
                "there. If two jobs use the same Config.job and shared root, give one of them another "
                "Config.job or shared root."
            )
        if current.writer != self.record.writer:
            self.superseded_by = current
            raise WriterFenced(
                f"will not {action} in {shared.url}: {current.describe()} holds the job now, not this "
                f"process ({me}). Two jobs are writing with the same Config.job into the same shared "
                "root; this one commits nothing more. Give one of them another Config.job or shared root."
            )


def after_failed_commit(
    fence: WriterFence, shared: Tier, error: Exception, action: str
) -> tuple[Exception, WriterFence | None]:
    """After a failed commit on the coordinator: the error to report, and the fence to keep.

    Called by :class:`~shoal.engine.group_save.GroupSave` with the error that stopped the
    commit. If another writer holds the job now, :class:`~shoal.errors.WriterFenced` is the
    error to report, whatever else went wrong (its retention may have deleted the packs
    this process meant to reuse). If the record is gone (the job directory was removed)
    and no other writer was ever seen, the fence is dropped (None): the next commit
    claims the job again, as on a new job. One read of the record.
    """
    try:
        current = fence.holder(shared)
    except (ShoalError, OSError):
        return error, fence  # unreadable: keep the fence; the next check says why
    if current is None:
        if fence.superseded_by is not None:
            return error, fence
        log.warning(
            "%s has no writer record any more (was the job directory removed?): the next commit "
            "claims the job again",
            shared.url,
        )
        return error, None
    if current.writer != fence.writer_id and not isinstance(error, WriterFenced):
        try:
            fence.check(shared, action)
        except WriterFenced as fenced:
            fenced.__cause__ = error
            return fenced, fence
    return error, fence
