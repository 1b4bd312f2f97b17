"""A run's event records from every host's log, merged onto one clock (``docs/observability.md``).

Event logs are host-local (``docs/events.md``): each host appends to its own ``events.jsonl`` in
the run's directory of its local root, ``<local>/<job>/<host>/runs/<run>/events.jsonl``. The
timeline and the report read them together: :func:`find_logs` finds every host's log of a job
below a local root (where the hosts' local directories sit side by side: one machine, emulated
hosts, or a shared mount of them), :func:`load_run` reads and merges them.

Times on a host's monotonic clock (``mono``, ``start``, ``end``, ``called``) compare only within
the host. Every line carries ``t`` (the wall clock) and ``mono`` taken at one instant, so for
each log (and each boot of its host's clock) the offset ``wall = mono + offset`` is the median of
``t - mono`` over its lines. The median shrugs off the few lines where the two readings were taken
apart (a thread switch between them) and the wall clock's small steps. This assumes the hosts'
wall clocks agree (NTP): two hosts' events line up to within their wall clocks' skew, and a
host's own events keep their exact monotonic spacing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shoal.errors import MissingFile, ShoalError
from shoal.records.events import Event, read_events
from shoal.records.exposure_log import CLOCK_SLACK_S

__all__ = [
    "EVENT_LOG",
    "ClockOffset",
    "RunRecords",
    "StepFilter",
    "find_logs",
    "load_run",
    "parse_steps",
    "write_output",
]

EVENT_LOG = "events.jsonl"
_PATTERNS = (EVENT_LOG, f"runs/*/{EVENT_LOG}", f"*/runs/*/{EVENT_LOG}")
"""Where a log lies below a run directory, a host's local directory and a job's local directory."""


@dataclass(frozen=True)
class ClockOffset:
    """How one log's monotonic clock maps onto the wall clock: ``wall = mono + offset``.

    One per log file and boot of its host's clock (a reboot starts a new monotonic clock).
    ``spread`` is the largest ``|t - mono - offset|`` over its lines: how far single lines
    stray from the median (their two readings taken apart), not the error against other hosts.
    """

    source: str
    host: str
    first: str
    """The first line it covers (``<file>:<line>``)."""
    lines: int
    offset: float
    spread: float


@dataclass(frozen=True)
class RunRecords:
    """Every event of a run, from one or more hosts' logs, each with its clock's offset.

    ``events`` are in the order of the files given, each file's lines in order. :meth:`wall`
    puts any of an event's monotonic times on the common (wall) clock.
    """

    sources: tuple[str, ...]
    events: tuple[Event, ...]
    offsets: tuple[ClockOffset, ...]
    notes: tuple[str, ...] = ()
    _offset_of: Mapping[str, float] = field(default_factory=dict, repr=False)

    def offset(self, e: Event) -> float:
        """The offset of ``e``'s host clock (``wall = mono + offset``)."""
        try:
            return self._offset_of[e.where]
        except KeyError:
            raise ShoalError(f"{e.where}: not an event of this run's logs") from None

    def wall_at(self, where: str, mono: float) -> float:
        """``mono`` on the clock of the host that wrote the line at ``where`` (``<file>:<line>``)."""
        try:
            return float(mono) + self._offset_of[where]
        except KeyError:
            raise ShoalError(f"{where}: not a line of this run's logs") from None

    def wall(self, e: Event, mono: float) -> float:
        """``mono``, a time on the monotonic clock of ``e``'s host, on the common wall clock."""
        return float(mono) + self.offset(e)

    @property
    def origin(self) -> float:
        """The run's first instant on the common clock (its earliest line)."""
        return min(float(e.mono) + self.offset(e) for e in self.events if e.mono is not None)

    def hosts(self) -> list[str]:
        """The hosts, in order of their first rank."""
        return sorted({e.host for e in self.events}, key=lambda h: (min(self.ranks_of(h)), h))

    def ranks_of(self, host: str) -> list[int]:
        return sorted({e.rank for e in self.events if e.host == host})

    def of(self, *kinds: str) -> list[Event]:
        """The events of these names, in the order of :attr:`events`."""
        wanted = frozenset(kinds)
        return [e for e in self.events if e.event in wanted]

    def coordinator(self, rank: int = 0) -> list[Event]:
        """Rank ``rank``'s events in the order it logged them (its files by their first line's time)."""
        files: dict[str, list[Event]] = {}
        for e in self.events:
            if e.rank == rank and e.mono is not None:
                files.setdefault(_file_of(e), []).append(e)
        ordered = sorted(files.values(), key=lambda es: self.wall(es[0], float(es[0].mono or 0.0)))
        return [e for es in ordered for e in es]


def _file_of(e: Event) -> str:
    return e.where.rsplit(":", 1)[0]


def find_logs(directory: str, *, run: str | None = None) -> tuple[list[str], list[str]]:
    """Every host's event log of one run below ``directory``, and notes on how they were chosen.

    ``directory`` is a run directory, a host's local directory (``<local>/<job>/<host>``) or a
    job's (``<local>/<job>``): every ``events.jsonl`` there is found. Where they belong to
    several runs, ``run`` chooses; without it the run whose log was written last is taken, and a
    note says so. Raises :class:`~shoal.errors.MissingFile` naming the directory when none is there.
    """
    found = sorted(
        {p for pattern in _PATTERNS for p in glob.glob(os.path.join(glob.escape(directory), pattern))}
    )
    by_run: dict[str | None, list[str]] = {}
    for p in found:
        by_run.setdefault(_run_of(directory, p), []).append(p)
    if run is not None:
        chosen = by_run.get(run, []) + (by_run.get(None, []) if len(by_run) > 1 else [])
        if not by_run.get(run):
            runs = sorted(r for r in by_run if r is not None)
            raise MissingFile(
                f"no event log ({EVENT_LOG}) of run {run!r} under {directory}"
                + (f"; runs there: {', '.join(runs)}" if runs else "")
            )
        return chosen, []
    if not found:
        raise MissingFile(
            f"no event log ({EVENT_LOG}) under {directory}: give the logs themselves, or the job's "
            "local directory (<local>/<job>, with a directory per host)"
        )
    if len(by_run) == 1:
        return found, []
    newest = max(by_run, key=lambda r: max(os.path.getmtime(p) for p in by_run[r]))
    others = sorted(str(r) for r in by_run if r != newest)
    return by_run[newest], [
        f"event logs of {len(by_run)} runs under {directory}: reading run {newest} (written last); "
        f"the others: {', '.join(others)} (choose with --run RUN)"
    ]


def _run_of(directory: str, path: str) -> str | None:
    """The run id of ``path`` (``.../runs/<run>/events.jsonl``), None when the path does not say."""
    parts = os.path.relpath(path, directory).split(os.sep)
    if len(parts) >= 3 and parts[-3] == "runs":
        return parts[-2]
    return os.path.basename(directory) if os.path.basename(os.path.dirname(directory)) == "runs" else None


def load_run(paths: Iterable[str]) -> RunRecords:
    """The events of the logs at ``paths`` (each with its rotated ``.1``), merged, clocks mapped.

    A log given twice is read once. Raises :class:`~shoal.errors.MissingFile` for a path that
    is not a file and :class:`~shoal.errors.ShoalError` (naming the file and line) for a log
    the event reader refuses, or for logs that hold no versioned line at all.
    """
    sources: list[str] = []
    seen: set[str] = set()
    for p in paths:
        if not os.path.isfile(p):
            raise MissingFile(f"no event log at {p}: not a file")
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            sources.append(p)
    if not sources:
        raise MissingFile("no event log given")
    events: list[Event] = []
    offsets: list[ClockOffset] = []
    offset_of: dict[str, float] = {}
    notes: list[str] = []
    for source in sources:
        read = [e for e in read_events(source) if e.mono is not None]
        if not read:
            notes.append(f"{source}: no versioned event lines (written before records had a version?)")
            continue
        for segment in _clock_segments(read):
            offset = _offset(segment, source)
            offsets.append(offset)
            for e in segment:
                offset_of[e.where] = offset.offset
        events.extend(read)
    if not events:
        raise ShoalError(f"no event with a monotonic time in {', '.join(sources)}: nothing to show")
    if len(offsets) > len(sources):
        notes.append(
            "a host's monotonic clock went backwards within a log (the host restarted?): each boot "
            "has its own clock offset"
        )
    return RunRecords(tuple(sources), tuple(events), tuple(offsets), tuple(notes), offset_of)


def _clock_segments(events: Sequence[Event]) -> list[list[Event]]:
    """``events`` cut where the monotonic clock goes backwards by more than the log's slack (a reboot)."""
    segments: list[list[Event]] = [[events[0]]]
    newest = float(events[0].mono or 0.0)
    for e in events[1:]:
        mono = float(e.mono or 0.0)
        if mono < newest - CLOCK_SLACK_S:
            segments.append([])
            newest = mono
        segments[-1].append(e)
        newest = max(newest, mono)
    return segments


def _offset(segment: Sequence[Event], source: str) -> ClockOffset:
    deltas = [e.wall - float(e.mono or 0.0) for e in segment]
    offset = statistics.median(deltas)
    hosts = sorted({e.host for e in segment})
    return ClockOffset(
        source,
        ",".join(hosts),
        segment[0].where,
        len(segment),
        offset,
        max(abs(d - offset) for d in deltas),
    )


@dataclass(frozen=True)
class StepFilter:
    """Which steps to show: inclusive ranges, from ``--steps`` (``3-7``, ``5``, ``1-3,9``)."""

    ranges: tuple[tuple[int, int], ...] = ()
    text: str = ""

    def __contains__(self, step: object) -> bool:
        if not self.ranges:
            return True
        return isinstance(step, int) and any(lo <= step <= hi for lo, hi in self.ranges)

    def keeps(self, e: Event) -> bool:
        """Whether ``e`` belongs to a step shown (events of no step are kept)."""
        return e.step is None or e.step in self


def parse_steps(text: str | None) -> StepFilter:
    """``"3-7"``, ``"5"``, ``"1-3,9"``: the steps to show (None or ``""``: every step).

    Raises :class:`~shoal.errors.ShoalError` naming the part that is not a step or a range.
    """
    if not text:
        return StepFilter()
    ranges = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ShoalError(
                f"steps {text!r}: {part.strip()!r} is not a step or a range of steps (3, 3-7, 1-3,9)"
            ) from None
        if a < 0 or b < a:
            raise ShoalError(f"steps {text!r}: {part.strip()!r} is not a range from a lower to a higher step")
        ranges.append((a, b))
    return StepFilter(tuple(ranges), text)


def write_output(path: str, text: str, what: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place (never half a file).

    Raises :class:`~shoal.errors.ShoalError` naming ``what`` and the path when it cannot be written.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ShoalError(f"cannot write {what} to {path}: {e}") from e
