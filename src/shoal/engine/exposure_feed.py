"""The live rollback exposure of one process: its save handles feed it (``Checkpointer.exposure()``).

:class:`ExposureFeed` wraps :class:`~shoal.model.exposure.ExposureTracker` (the pure bookkeeping)
with the engine's side: the save call's time, a listener on each :class:`SaveHandle` for every
boundary it reaches, and on the coordinator an ``exposure`` event at each boundary (docs/events.md;
read back by :mod:`shoal.records.exposure_log`). The runtime owns one, from when it was built.
"""

from __future__ import annotations

from functools import partial

from shoal.boundary import Boundary
from shoal.engine.handle import SaveHandle
from shoal.model.exposure import Exposure, ExposureTracker
from shoal.records.events import EventLog, monotonic

__all__ = ["ExposureFeed"]


class ExposureFeed:
    """This process's exposure tracker, fed by its checkpoints' boundaries."""

    def __init__(self) -> None:
        self.tracker = ExposureTracker(start=monotonic())
        self._events: EventLog | None = None

    @property
    def start(self) -> float:
        """When the process's exposure starts counting (its runtime was built; event clock)."""
        return self.tracker.start

    def log_to(self, events: EventLog) -> None:
        """Log every class's exposure to ``events`` at each boundary (the coordinator only)."""
        self._events = events

    def watch(self, handle: SaveHandle, called: float) -> None:
        """Learn every boundary ``handle`` reaches; ``called``: the save call on the event clock."""
        handle.add_listener(partial(self._on_boundary, called))

    def saved(self, step: int, called: float) -> None:
        """Checkpoint ``step`` was staged (its save was called at ``called``)."""
        self.tracker.saved(step, called)

    def exposure(self, step: int | None = None) -> Exposure:
        """The exposure now, per failure class (``step``: the current training step)."""
        return self.tracker.exposure(monotonic(), step)

    def _on_boundary(self, called: float, handle: SaveHandle, boundary: Boundary, seconds: float) -> None:
        at = max(called + seconds, self.tracker.start)
        self.tracker.reached(handle.step, int(boundary), at)
        if self._events is not None:
            exposure = self.tracker.exposure(at)
            self._events.emit(
                "exposure",
                handle.step,
                boundary=boundary.name,
                seconds=seconds,
                classes=exposure.to_json()["classes"],
            )
