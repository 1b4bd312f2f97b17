"""A finished run's checkpoints, read back from its event log: what ``shoal exposure`` and
``shoal advise`` compute from (``docs/exposure.md``).

The coordinator's records (rank 0's; its host's log) are used. Per save: the save call's
monotonic time (``save_called``'s ``called``, its ``mono`` in logs written before it existed),
rank 0's ``staged`` event (the stall is ``staged - called``), and the boundaries: the seconds
from the save call to each, from the ``checkpoint`` record written when it finished, else from
its ``boundary`` events (a checkpoint still in flight when the log ends). Skipped saves are not
checkpoints. The run starts at rank 0's ``opened`` event (when its Checkpointer was built) or
its first event, and ends at its last event.

The monotonic clock is per boot: where it goes backwards by more than :data:`CLOCK_SLACK_S`
(the host restarted) the log holds several runs of the clock; only the last is used, and a note
says so. Lines of one host's threads are in ``mono`` order only to within a few milliseconds
(each takes its time before the log's lock): the saves are read in line order, which is causal
for each checkpoint.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from shoal.boundary import Boundary
from shoal.errors import MissingFile, ShoalError
from shoal.model.advisor import CheckpointTiming, FailureModel, IntervalAdvice, advise_intervals
from shoal.model.exposure import FAILURE_CLASSES, CheckpointTimes, ExposureTimeline, exposure_timeline
from shoal.records.events import CheckpointRecord, Event, read_events

COORDINATOR = 0
"""The rank whose records describe the job's checkpoints (the coordinator commits)."""


@dataclass(frozen=True)
class LoggedCheckpoint:
    """One save as the coordinator's log tells it.

    ``saved``: the save call (monotonic); ``staged``: when rank 0's copy into DRAM was done
    (None: it never was); ``boundaries``: seconds from the save call per boundary name reached;
    ``finished``: whether its ``checkpoint`` record was found (it reached B4 or failed).
    """

    step: int
    saved: float
    where: str
    staged: float | None = None
    boundaries: Mapping[str, float] = field(default_factory=dict)
    durability_path: str | None = None
    failed_at: str | None = None
    finished: bool = False

    @property
    def stall_s(self) -> float | None:
        """Seconds training was blocked: from the save call until rank 0 had staged."""
        return None if self.staged is None else self.staged - self.saved

    def lag_s(self, level: int) -> float | None:
        """Seconds from the save call until it had reached ``level`` (itself or a higher one)."""
        lags = [s for name, s in self.boundaries.items() if _level(name, self.where) >= level]
        return min(lags) if lags else None

    def times(self) -> CheckpointTimes:
        """Its timing for :func:`~shoal.model.exposure.exposure_timeline`."""
        reached = {_level(name, self.where): self.saved + max(0.0, s) for name, s in self.boundaries.items()}
        return CheckpointTimes(self.step, self.saved, reached)


def _level(name: str, where: str) -> int:
    try:
        return int(Boundary[name])
    except KeyError:
        raise ShoalError(f"{where}: {name!r} is not a boundary (STAGED .. RESTARTABLE)") from None


@dataclass(frozen=True)
class RunLog:
    """The coordinator's view of one run: its start and end (monotonic) and its saves, in order."""

    source: str
    start: float
    end: float
    checkpoints: tuple[LoggedCheckpoint, ...]
    notes: tuple[str, ...] = ()

    def timeline(self) -> ExposureTimeline:
        """The run's rollback exposure per failure class (:func:`~shoal.model.exposure.exposure_timeline`)."""
        return exposure_timeline([c.times() for c in self.checkpoints], self.start, self.end)


def read_run_log(path: str, *, rank: int = COORDINATOR) -> RunLog:
    """The run in the event log at ``path`` (its rotated ``.1`` first), as rank ``rank`` logged it."""
    if not os.path.isfile(path):
        raise MissingFile(f"no event log at {path}")
    return run_log(read_events(path), rank=rank, source=path)


def run_log(events: Iterable[Event], *, rank: int = COORDINATOR, source: str = "the event log") -> RunLog:
    """The run in ``events`` (oldest first, as :func:`~shoal.records.events.read_events` returns them).

    Raises :class:`~shoal.errors.ShoalError` naming ``source`` when rank ``rank`` logged nothing
    there (the log of another host) or called no save.
    """
    every = list(events)
    mine = [e for e in every if e.rank == rank and e.mono is not None]
    if not mine:
        ranks = sorted({e.rank for e in every})
        raise ShoalError(
            f"{source}: no events of rank {rank} (the coordinator; ranks here: {ranks or 'none'}): "
            "the coordinator's records are in its own host's event log"
        )
    segment, notes = _last_clock_run(mine, source)
    checkpoints, more = _checkpoints(segment)
    if not checkpoints:
        raise ShoalError(f"{source}: rank {rank} called no save in it (no save_called event): no checkpoints")
    first = segment[0]
    start = float(first.get("start", first.mono)) if first.event == "opened" else _mono(first)
    if first.event != "opened":
        more.append(f"no opened event: the run is taken to start at its first event ({first.where})")
    end = max(_mono(e) for e in segment)
    return RunLog(source, min(start, checkpoints[0].saved), end, tuple(checkpoints), (*notes, *more))


def _mono(e: Event) -> float:
    assert e.mono is not None
    return float(e.mono)


CLOCK_SLACK_S = 10.0
"""How far a line's ``mono`` may lag the lines before it without meaning a reboot: threads take
their time before they take the log's lock, so lines are in order only to within that."""


def _last_clock_run(events: Sequence[Event], source: str) -> tuple[list[Event], list[str]]:
    """The events since the monotonic clock last went backwards (a reboot), and a note if it did."""
    cut, newest = 0, _mono(events[0])
    for i in range(1, len(events)):
        mono = _mono(events[i])
        if mono < newest - CLOCK_SLACK_S:
            cut, newest = i, mono
        newest = max(newest, mono)
    if not cut:
        return list(events), []
    return list(events[cut:]), [
        f"{source}: the monotonic clock went backwards at {events[cut].where} (the host restarted?): "
        f"only the {len(events) - cut} events from there on are used"
    ]


@dataclass
class _Building:
    step: int
    saved: float
    where: str
    staged: float | None = None
    boundaries: dict[str, float] = field(default_factory=dict)
    skipped: bool = False

    def done(self, record: CheckpointRecord | None) -> LoggedCheckpoint:
        if record is None:
            return LoggedCheckpoint(self.step, self.saved, self.where, self.staged, dict(self.boundaries))
        return LoggedCheckpoint(
            self.step,
            self.saved,
            self.where,
            self.staged,
            {k: float(v) for k, v in record.boundaries.items()},
            record.durability_path,
            record.failed_at,
            finished=True,
        )


def _checkpoints(events: Sequence[Event]) -> tuple[list[LoggedCheckpoint], list[str]]:
    """Every save in ``events``, in call order; notes about records that could not be placed."""
    order: list[_Building] = []
    open_: dict[int, _Building] = {}
    done: dict[int, LoggedCheckpoint] = {}  # by id() of the builder
    notes: list[str] = []
    for e in events:
        step = e.step
        if step is None:
            continue
        building = open_.get(step)
        if e.event == "save_called":
            building = _Building(step, float(e.get("called", e.mono)), e.where)
            open_[step] = building
            order.append(building)
        elif building is None:
            if e.event == "checkpoint":
                notes.append(f"{e.where}: the checkpoint record of step {step} has no save_called before it")
        elif e.event == "skipped":
            building.skipped = True
            del open_[step]
        elif e.event == "staged":
            building.staged = _mono(e)
        elif e.event == "boundary" and isinstance(e.get("seconds"), int | float):
            building.boundaries[str(e["boundary"])] = float(e["seconds"])
        elif isinstance(e, CheckpointRecord):
            done[id(building)] = building.done(e)
            del open_[step]
    return [done.get(id(b)) or b.done(None) for b in order if not b.skipped], notes


# -- the interval advisor's input ---------------------------------------------------------------


@dataclass(frozen=True)
class ClassLag:
    """How long a path's checkpoints took to protect against one failure class."""

    failure: str
    boundary_level: int
    checkpoints: int
    """How many of the path's checkpoints reached the class's boundary (the lag's sample)."""
    lag_s: float
    lag_spread_s: float
    """The mean and standard deviation of the seconds from the save call to that boundary."""


@dataclass(frozen=True)
class PathMeasurements:
    """What one durability path's checkpoints measured: the stall and the lag per failure class."""

    path: str
    checkpoints: int
    stall_s: float
    stall_spread_s: float
    lags: Mapping[str, ClassLag]

    def timings(self) -> dict[str, CheckpointTiming]:
        """One :class:`~shoal.model.advisor.CheckpointTiming` per failure class measured.

        The lag is at least the stall (the advisor's condition; both are means, so a lag just
        under it is the two clocks' rounding), and has no spread when it equals the stall.
        """
        out = {}
        for name, lag in self.lags.items():
            mean = max(lag.lag_s, self.stall_s)
            spread = lag.lag_spread_s if mean > self.stall_s else 0.0
            out[name] = CheckpointTiming(self.stall_s, mean, spread)
        return out


def _mean_spread(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def measure_paths(log: RunLog) -> dict[str, PathMeasurements]:
    """Per durability path (``partner``, ``direct``): the stall and every class's lag.

    Only checkpoints whose path was chosen and whose stall was measured count; a class none of
    a path's checkpoints reached has no lag there.
    """
    by_path: dict[str, list[LoggedCheckpoint]] = {}
    for c in log.checkpoints:
        if c.durability_path is not None and c.stall_s is not None:
            by_path.setdefault(c.durability_path, []).append(c)
    out = {}
    for path, cps in sorted(by_path.items()):
        stall, stall_spread = _mean_spread([c.stall_s for c in cps if c.stall_s is not None])
        lags = {}
        for name, level in FAILURE_CLASSES.items():
            values = [lag for c in cps if (lag := c.lag_s(level)) is not None]
            if values:
                mean, spread = _mean_spread(values)
                lags[name] = ClassLag(name, level, len(values), mean, spread)
        out[path] = PathMeasurements(path, len(cps), stall, stall_spread, MappingProxyType(lags))
    return out


def save_gaps(log: RunLog) -> tuple[float | None, float | None]:
    """The median seconds and median steps between consecutive save calls (None: one save)."""
    calls = sorted((c.saved, c.step) for c in log.checkpoints)
    gaps = [b[0] - a[0] for a, b in zip(calls, calls[1:], strict=False)]
    steps = [b[1] - a[1] for a, b in zip(calls, calls[1:], strict=False) if b[1] > a[1]]
    return (
        statistics.median(gaps) if gaps else None,
        float(statistics.median(steps)) if steps else None,
    )


@dataclass(frozen=True)
class PathAdvice:
    """The advice for one durability path: what it measured, and one advice per failure class.

    ``current_interval_s`` is the work between saves the advice is given at: the gap between
    save calls minus the stall. ``step_time_s``: seconds of work per step, measured (None with
    a single save or steps that never grew).
    """

    measured: PathMeasurements
    current_interval_s: float | None
    step_time_s: float | None
    advice: Mapping[str, IntervalAdvice]


@dataclass(frozen=True)
class RunAdvice:
    """``shoal advise``'s answer: the run's save gap (measured or given) and every path's advice."""

    source: str
    failures: FailureModel
    save_gap_s: float | None
    gap_given: bool
    paths: Mapping[str, PathAdvice]
    notes: tuple[str, ...] = ()


def advise_run(
    log: RunLog,
    failures: FailureModel,
    *,
    interval_s: float | None = None,
    accelerators_per_node: int | None = None,
) -> RunAdvice:
    """The advisor (:func:`~shoal.model.advisor.advise_intervals`) on a run's own measurements.

    ``interval_s``: seconds between save calls to judge (default: the run's median gap). Raises
    :class:`~shoal.errors.ShoalError` when no checkpoint of the run chose a path and was staged.
    """
    measured = measure_paths(log)
    if not measured:
        raise ShoalError(
            f"{log.source}: none of the {len(log.checkpoints)} saves got as far as a durability path "
            "with its stall measured (save_called, staged and a path): nothing to advise from"
        )
    measured_gap, step_gap = save_gaps(log)
    gap = measured_gap if interval_s is None else interval_s
    paths = {}
    for name, m in measured.items():
        work = None if gap is None else gap - m.stall_s
        if work is not None and work <= 0:
            raise ShoalError(
                f"{log.source}: the gap between save calls ({gap:.3g} s) is not longer than the "
                f"{name} path's stall ({m.stall_s:.3g} s): no work between saves to judge"
            )
        step_time = _step_time(measured_gap, step_gap, m.stall_s)
        advice = advise_intervals(
            m.timings(),
            failures,
            current_interval_s=work,
            step_time_s=step_time,
            accelerators_per_node=accelerators_per_node,
        )
        paths[name] = PathAdvice(m, work, step_time, MappingProxyType(advice))
    return RunAdvice(log.source, failures, gap, interval_s is not None, MappingProxyType(paths), log.notes)


def _step_time(gap: float | None, step_gap: float | None, stall: float) -> float | None:
    """Seconds of work per step: the measured gap's work over its steps (None: not measurable)."""
    if gap is None or step_gap is None or gap <= stall:
        return None
    return (gap - stall) / step_gap


def advise_from_events(
    events: Iterable[Event],
    failures: FailureModel,
    *,
    interval_s: float | None = None,
    accelerators_per_node: int | None = None,
    rank: int = COORDINATOR,
    source: str = "the event log",
) -> RunAdvice:
    """:func:`advise_run` over events as :func:`~shoal.records.events.read_events` returns them."""
    log = run_log(events, rank=rank, source=source)
    return advise_run(log, failures, interval_s=interval_s, accelerators_per_node=accelerators_per_node)
