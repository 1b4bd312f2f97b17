"""Rollback exposure: how much training a failure of each class would throw away (docs/design.md section 3).

Pure math over plain numbers (no I/O, no torch, no event log). A failure of class ``c`` rolls
training back to the newest checkpoint that had reached the boundary protecting against ``c``:

===========  ==================  ===================================================
 class        boundary (level)    why that one
===========  ==================  ===================================================
 ``process``  B1 STAGED (1)       the copy in the host's DRAM survives a crash of the
                                  training processes
 ``host``     B2 REPLICATED (2)   a partner host holds a copy: any one host may go
 ``cluster``  B4 RESTARTABLE (4)  committed on shared storage: a fresh job loads it
===========  ==================  ===================================================

Reaching a level implies every lower one (a checkpoint at B4 protects against a host failure
too). A checkpoint's *saved time* is when its save was called: the training state it holds.

For class ``c`` at time ``t`` the exposure is ``t`` minus the saved time of the newest checkpoint
(largest saved time) that had reached ``c``'s level by ``t``, or ``t - start`` when none had
(``start``: when the run began). In steps: the current step minus that checkpoint's step.

* :class:`ExposureTracker`: the live view, fed by the engine as saves are called and boundaries
  reached; :meth:`ExposureTracker.exposure` answers for any recent ``t``.
* :func:`exposure_timeline`: a finished run's sawtooth per class (points to plot, the peak, the
  exact time integral and the mean), from each checkpoint's save and boundary times.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from shoal.errors import ConfigError

FAILURE_CLASSES: Mapping[str, int] = MappingProxyType({"process": 1, "host": 2, "cluster": 4})
"""Each failure class and the boundary level that protects against it (1 = B1 STAGED .. 4 = B4)."""

LEVEL_NAMES: Mapping[int, str] = MappingProxyType(
    {1: "STAGED", 2: "REPLICATED", 3: "PERSISTED", 4: "RESTARTABLE"}
)
"""The boundary names of the levels (as :class:`shoal.Boundary` names them; the model imports none)."""

MAX_LEVEL = 4


def _time(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number of seconds, got {value!r}")
    return float(value)


def _step(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    return value


def _optional_step(name: str, value: int | None) -> int | None:
    return None if value is None else _step(name, value)


def _level(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LEVEL:
        raise ConfigError(f"{name} must be a boundary level 1..{MAX_LEVEL} (B1..B4), got {value!r}")
    return value


@dataclass(frozen=True)
class ClassExposure:
    """One failure class's exposure at one time.

    ``seconds``: training time a failure of this class would lose now; ``steps``: the same in
    steps (None when nothing is protected and no start step is known); ``protected_step``: the
    checkpoint it would roll back to (None: back to the start of the run).
    """

    failure: str
    boundary_level: int
    seconds: float
    steps: int | None
    protected_step: int | None

    @property
    def boundary(self) -> str:
        """The protecting boundary's name (``RESTARTABLE`` for ``cluster``)."""
        return LEVEL_NAMES[self.boundary_level]

    def to_json(self) -> dict[str, Any]:
        return {
            "failure": self.failure,
            "boundary": self.boundary,
            "boundary_level": self.boundary_level,
            "seconds": self.seconds,
            "steps": self.steps,
            "protected_step": self.protected_step,
        }


@dataclass(frozen=True)
class Exposure:
    """Every failure class's exposure at time ``t`` (keys of :data:`FAILURE_CLASSES`)."""

    t: float
    classes: Mapping[str, ClassExposure]

    def __getitem__(self, failure: str) -> ClassExposure:
        return self.classes[failure]

    def to_json(self) -> dict[str, Any]:
        """``{"t": ..., "classes": {"process": {...}, ...}}``: for the event log and the CLI."""
        return {"t": self.t, "classes": {name: c.to_json() for name, c in self.classes.items()}}


@dataclass(frozen=True)
class Protection:
    """From ``at`` on, checkpoint ``step`` (saved at ``saved``) is the newest one protecting a class."""

    at: float
    saved: float
    step: int


def _class_exposure(
    failure: str,
    t: float,
    start: float,
    protection: Protection | None,
    current_step: int | None,
    start_step: int | None,
) -> ClassExposure:
    """The exposure of ``failure`` at ``t`` given the checkpoint protecting it then (or none)."""
    level = FAILURE_CLASSES[failure]
    if protection is None:
        steps = None if current_step is None or start_step is None else current_step - start_step
        return ClassExposure(failure, level, t - start, steps, None)
    steps = None if current_step is None else current_step - protection.step
    return ClassExposure(failure, level, t - protection.saved, steps, protection.step)


def _protection_at(changes: Sequence[Protection], ats: Sequence[float], t: float) -> Protection | None:
    """The last change at or before ``t`` (``ats`` are the changes' times, ascending)."""
    i = bisect.bisect_right(ats, t)
    return changes[i - 1] if i else None


# -- the live view -------------------------------------------------------------------------------


@dataclass
class _Pending:
    saved: float
    levels: set[int] = field(default_factory=set)


class ExposureTracker:
    """The live exposure of a run, fed as saves are called and boundaries reached.

    Thread-safe: :meth:`saved` is called from the training thread, :meth:`reached` from the
    background pipeline, :meth:`exposure` from anywhere. ``start`` is when the run (or this
    process) began, on the same clock as every ``t`` given later; ``start_step`` the step
    training started from, if known (for the steps of a class nothing protects yet).

    A ``reached`` for a step never given to :meth:`saved` is ignored (the tracker cannot place
    it in time; a listener must never fail the save that reports it). A step saved again (a
    re-save after a failure, a heal) replaces the earlier save of that step from then on. It
    keeps the last ``history`` changes of protection and save calls, so :meth:`exposure`
    answers for any ``t`` back to then; memory stays bounded over a long run.
    """

    def __init__(self, start: float, start_step: int | None = None, *, history: int = 1024) -> None:
        self.start = _time("start", start)
        self.start_step = _optional_step("start_step", start_step)
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ConfigError(f"history must be a whole number >= 1, got {history!r}")
        self._history = history
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._calls: list[tuple[float, int]] = []  # (saved time, step), ascending
        self._changes: dict[int, list[Protection]] = {level: [] for level in range(1, MAX_LEVEL + 1)}
        self._ats: dict[int, list[float]] = {level: [] for level in range(1, MAX_LEVEL + 1)}

    def saved(self, step: int, t: float) -> None:
        """A save of ``step`` was called at ``t`` (it captures the training state of then)."""
        step = _step("step", step)
        t = _time("t", t)
        with self._lock:
            self._pending[step] = _Pending(t)
            bisect.insort(self._calls, (t, step))
            self._trim(self._calls)

    def reached(self, step: int, level: int, t: float) -> None:
        """Checkpoint ``step`` reached boundary ``level`` (and every lower one) at ``t``.

        Times of one class only move forward: a ``t`` before that class's last change (two
        threads reporting microseconds apart) is taken as that change's time.
        """
        level = _level("level", level)
        t = _time("t", t)
        with self._lock:
            pending = self._pending.get(step)
            if pending is None:
                return  # never saved (or long finished): documented as ignored
            for lower in range(1, level + 1):
                if lower not in pending.levels:
                    pending.levels.add(lower)
                    self._protect(lower, pending.saved, step, t)
            if level == MAX_LEVEL:
                del self._pending[step]
                self._drop_superseded()

    def _protect(self, level: int, saved: float, step: int, t: float) -> None:
        """Checkpoint ``step`` reached ``level``: it protects that level if newer than the protector."""
        changes, ats = self._changes[level], self._ats[level]
        if changes and saved <= changes[-1].saved:
            return  # an older checkpoint completing late (out of order) protects nothing new
        at = max(t, ats[-1]) if ats else t
        changes.append(Protection(at, saved, step))
        ats.append(at)
        self._trim(changes)
        self._trim(ats)

    def _drop_superseded(self) -> None:
        """Forget pending saves older than the newest B4 checkpoint: they can never protect anything."""
        top = self._changes[MAX_LEVEL]
        if top:
            newest = top[-1].saved
            self._pending = {s: p for s, p in self._pending.items() if p.saved > newest}

    def _trim(self, items: list[Any]) -> None:
        if len(items) > 2 * self._history:
            del items[: -self._history]

    def exposure(self, t: float, step: int | None = None) -> Exposure:
        """Every class's exposure at ``t`` (>= ``start``); ``step``: the current step (default:
        the step of the newest save called by ``t``, else ``start_step``)."""
        t = _time("t", t)
        if t < self.start:
            raise ConfigError(f"t ({t!r}) is before the tracker's start ({self.start!r})")
        current = _optional_step("step", step)
        with self._lock:
            if current is None:
                i = bisect.bisect_right(self._calls, (t, math.inf))
                current = self._calls[i - 1][1] if i else self.start_step
            classes = {
                name: _class_exposure(
                    name,
                    t,
                    self.start,
                    _protection_at(self._changes[level], self._ats[level], t),
                    current,
                    self.start_step,
                )
                for name, level in FAILURE_CLASSES.items()
            }
        return Exposure(t, MappingProxyType(classes))


# -- a finished run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointTimes:
    """One checkpoint's timing: its step, when its save was called, when it reached each level.

    ``reached`` maps a boundary level (1..4) to the time it was reached; a level missing is
    one it never reached (a failed checkpoint stops short), unless a higher one is there: reaching
    a level implies the lower ones, at the same time at the latest.
    """

    step: int
    saved: float
    reached: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _step("step", self.step)
        _time("saved", self.saved)
        for level, at in self.reached.items():
            _level(f"step {self.step}: a reached level", level)
            if _time(f"step {self.step}: the time of level {level}", at) < self.saved:
                raise ConfigError(
                    f"step {self.step} reached level {level} at {at!r}, before its save was called "
                    f"({self.saved!r}): a boundary is reached after the save call"
                )

    def reached_at(self, level: int) -> float | None:
        """When this checkpoint had reached ``level`` (itself or a higher one), or None: never."""
        times = [at for lvl, at in self.reached.items() if lvl >= level]
        return min(times) if times else None


def protection_changes(checkpoints: Iterable[CheckpointTimes], level: int) -> list[Protection]:
    """When the newest checkpoint protecting ``level`` changed, in time order.

    A checkpoint reaching the level protects from then on only if it was saved after the one
    protecting it already: an older checkpoint completing late (out of order) changes nothing.
    Changes at one instant keep the newest checkpoint only.
    """
    _level("level", level)
    reached = sorted((at, c.saved, c.step) for c in checkpoints if (at := c.reached_at(level)) is not None)
    changes: list[Protection] = []
    for at, saved, step in reached:
        if changes and saved <= changes[-1].saved:
            continue
        if changes and changes[-1].at == at:
            changes.pop()
        changes.append(Protection(at, saved, step))
    return changes


@dataclass(frozen=True)
class ClassTimeline:
    """One failure class over a run: the sawtooth and what it adds up to.

    ``points``: ``(t, seconds)`` corners of the piecewise-linear exposure (slope 1 between
    checkpoints, a drop where a newer one reaches the class's level: two points at the same
    ``t``); ``peak_seconds``: its largest value; ``integral``: its exact time integral
    (seconds squared); ``mean_seconds``: integral over the run's duration (at a zero-length run,
    the value at the end); ``at_end``: the exposure at the run's end; ``checkpoints``: how many
    checkpoints had reached the level by the end; ``protections``: how many of them ever
    became the newest protecting one.
    """

    failure: str
    boundary_level: int
    points: tuple[tuple[float, float], ...]
    peak_seconds: float
    integral: float
    mean_seconds: float
    at_end: ClassExposure
    checkpoints: int
    protections: int

    def to_json(self) -> dict[str, Any]:
        return {
            "failure": self.failure,
            "boundary": LEVEL_NAMES[self.boundary_level],
            "boundary_level": self.boundary_level,
            "peak_seconds": self.peak_seconds,
            "mean_seconds": self.mean_seconds,
            "integral_seconds2": self.integral,
            "at_end": self.at_end.to_json(),
            "checkpoints": self.checkpoints,
            "protections": self.protections,
            "points": [list(p) for p in self.points],
        }


@dataclass(frozen=True)
class ExposureTimeline:
    """Every failure class's :class:`ClassTimeline` over a run from ``start`` to ``end``."""

    start: float
    end: float
    checkpoints: int
    """Save calls counted (saved by ``end``), failed ones included."""
    classes: Mapping[str, ClassTimeline]

    @property
    def duration(self) -> float:
        return self.end - self.start

    def __getitem__(self, failure: str) -> ClassTimeline:
        return self.classes[failure]

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "duration_seconds": self.duration,
            "checkpoints": self.checkpoints,
            "classes": {name: c.to_json() for name, c in self.classes.items()},
        }


def _sawtooth(
    changes: Sequence[Protection], start: float, end: float
) -> tuple[list[tuple[float, float]], float, float]:
    """The corners, peak and exact integral of ``t - saved(t)`` over ``[start, end]``.

    ``saved(t)`` is the protector's saved time (``start`` before any), stepping up at each change.
    """
    before = [c for c in changes if c.at <= start]
    base = before[-1].saved if before else start
    points = [(start, start - base)]
    peak, integral, prev = start - base, 0.0, start
    for change in (c for c in changes if start < c.at <= end):
        value = change.at - base
        integral += (change.at - prev) * ((prev - base) + value) / 2.0
        peak = max(peak, value)
        points.append((change.at, value))
        base, prev = change.saved, change.at
        points.append((change.at, change.at - base))
    value = end - base
    integral += (end - prev) * ((prev - base) + value) / 2.0
    peak = max(peak, value)
    if points[-1] != (end, value):
        points.append((end, value))
    return points, peak, integral


def exposure_timeline(
    checkpoints: Iterable[CheckpointTimes],
    start: float,
    end: float,
    *,
    start_step: int | None = None,
    end_step: int | None = None,
) -> ExposureTimeline:
    """The exposure of every failure class over a finished run, from ``start`` to ``end``.

    ``checkpoints``: each save's step, call time and boundary times (a failed one lacks the
    levels it never reached; reaching a level implies the lower ones). Checkpoints saved after
    ``end``, and boundaries reached after it, do not count. ``end_step``: the step training had
    reached at ``end`` (default: the newest save's), for the steps at the end.

    >>> run = [CheckpointTimes(10, 100.0, {1: 101.0, 4: 130.0}),
    ...        CheckpointTimes(20, 200.0, {1: 201.0})]  # step 20 failed after B1
    >>> timeline = exposure_timeline(run, 0.0, 300.0)
    >>> timeline["cluster"].peak_seconds, timeline["cluster"].at_end.seconds
    (200.0, 200.0)
    >>> timeline["process"].at_end.protected_step, timeline["process"].integral
    (20, 15200.0)
    """
    start, end = _time("start", start), _time("end", end)
    if end < start:
        raise ConfigError(f"end ({end!r}) is before start ({start!r})")
    start_step = _optional_step("start_step", start_step)
    given = list(checkpoints)
    for c in given:
        if not isinstance(c, CheckpointTimes):
            raise ConfigError(f"checkpoints must be CheckpointTimes, got {type(c).__name__}")
    counted = [c for c in given if c.saved <= end]
    current = _optional_step("end_step", end_step)
    if current is None:
        newest = max(counted, key=lambda c: c.saved, default=None)
        current = newest.step if newest is not None else start_step
    classes = {
        name: _class_timeline(name, counted, start, end, current, start_step) for name in FAILURE_CLASSES
    }
    return ExposureTimeline(start, end, len(counted), MappingProxyType(classes))


def _protectors(changes: Sequence[Protection], start: float) -> int:
    """How many checkpoints were the protecting one at some time from ``start`` on."""
    later = sum(1 for c in changes if c.at > start)
    return later + (1 if len(changes) > later else 0)


def _class_timeline(
    failure: str,
    checkpoints: Sequence[CheckpointTimes],
    start: float,
    end: float,
    current: int | None,
    start_step: int | None,
) -> ClassTimeline:
    level = FAILURE_CLASSES[failure]
    changes = [c for c in protection_changes(checkpoints, level) if c.at <= end]
    points, peak, integral = _sawtooth(changes, start, end)
    duration = end - start
    at_end = _class_exposure(failure, end, start, changes[-1] if changes else None, current, start_step)
    reached = sum(1 for c in checkpoints if (at := c.reached_at(level)) is not None and at <= end)
    return ClassTimeline(
        failure=failure,
        boundary_level=level,
        points=tuple(points),
        peak_seconds=peak,
        integral=integral,
        mean_seconds=integral / duration if duration > 0 else at_end.seconds,
        at_end=at_end,
        checkpoints=reached,
        protections=_protectors(changes, start),
    )
