"""``SaveHandle``: the awaitable half of a two-phase save."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from shoal.boundary import Boundary
from shoal.errors import BoundaryTimeout, CheckpointFailed

log = logging.getLogger(__name__)

BoundaryListener = Callable[["SaveHandle", Boundary, float], None]
"""Called as ``listener(handle, boundary, seconds)`` for each boundary a handle newly reaches."""


class SaveHandle:
    """What ``Checkpointer.save`` returns (at B1): the checkpoint's progress through the boundaries.

    Thread-safe: the background pipeline advances it, any thread may wait on it.
    Boundaries are recorded only when they are really reached, in order; a
    failure records the boundary that could not be reached and the error.
    """

    def __init__(self, step: int, *, started: float | None = None, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._t0 = time.perf_counter() if started is None else started
        self._cond = threading.Condition()
        self._reached: Boundary | None = None
        self._times: dict[Boundary, float] = {}
        self._error: BaseException | None = None
        self._failed_at: Boundary | None = None
        self._finished = skipped
        self.path: str | None = None
        """``"partner"`` or ``"direct"``: the durability path the coordinator chose for it."""
        self.path_reason: str | None = None
        """Why that path (the policy's own words)."""
        self._listeners: list[BoundaryListener] = []

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else (self._reached.name if self._reached else "pending")
        if self._error is not None:
            state += f", failed before {self._failed_at.name if self._failed_at else '?'}"
        return f"SaveHandle(step={self.step}, {state})"

    # -- read side ---------------------------------------------------------
    @property
    def reached(self) -> Boundary | None:
        """The highest boundary reached so far, or None."""
        with self._cond:
            return self._reached

    @property
    def times(self) -> dict[Boundary, float]:
        """Seconds from the save call to each boundary reached."""
        with self._cond:
            return dict(self._times)

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped this checkpoint, if any."""
        with self._cond:
            return self._error

    @property
    def failed_at(self) -> Boundary | None:
        """The boundary this checkpoint could not reach, if it failed."""
        with self._cond:
            return self._failed_at

    def done(self, boundary: Boundary = Boundary.RESTARTABLE) -> bool:
        """Whether ``boundary`` has been reached (never blocks)."""
        with self._cond:
            return self._reached is not None and self._reached >= boundary

    @property
    def finished(self) -> bool:
        """True once the pipeline will not advance this handle any further."""
        with self._cond:
            return self._finished

    def wait(self, boundary: Boundary = Boundary.RESTARTABLE, timeout: float | None = None) -> Boundary:
        """Block until ``boundary`` is reached; return the boundary reached.

        Raises :class:`CheckpointFailed` (with the cause chained) if the checkpoint
        failed before ``boundary``, or if it was skipped, and
        :class:`BoundaryTimeout` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._reached is not None and self._reached >= boundary:
                    return self._reached
                if self.skipped:
                    raise CheckpointFailed(f"step {self.step} was skipped: every DRAM slot was in flight")
                if self._error is not None:
                    at = self._failed_at.label if self._failed_at else "?"
                    raise CheckpointFailed(
                        f"step {self.step} failed before {at}: {type(self._error).__name__}: {self._error}"
                    ) from self._error
                if self._finished:
                    raise CheckpointFailed(f"step {self.step} stopped at {self._reached} without an error")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BoundaryTimeout(
                        f"step {self.step}: {boundary.label} not reached within {timeout} s "
                        f"(reached: {self._reached.label if self._reached else 'nothing'})"
                    )
                self._cond.wait(remaining)

    # -- write side: the engine's (as a Future's set_result is its executor's) ----------------
    def set_path(self, path: str, reason: str) -> None:
        """Record the durability path the coordinator chose, and why."""
        self.path, self.path_reason = path, reason

    def add_listener(self, listener: BoundaryListener) -> None:
        """Call ``listener(handle, boundary, seconds)`` for each boundary reached from now on.

        Every newly reached boundary, the implied lower ones included, in order, with its seconds
        from the save call; called on the thread that reports it, outside the handle's lock (a
        listener may read the handle). A listener that raises is logged and never breaks the
        handle or the pipeline. Boundaries reached before it was added are not replayed.
        """
        with self._cond:
            self._listeners.append(listener)

    def reach(self, boundary: Boundary) -> float:
        """Record ``boundary`` (and every one before it) as reached now; return the seconds taken.

        Boundaries only move forward: reporting one at or below the last is a ``RuntimeError``.
        """
        return self._advance(boundary, strict=True)

    def reach_at_least(self, boundary: Boundary) -> None:
        """Record ``boundary`` unless it (or a later one) is recorded already.

        For boundaries two parties may observe, such as B1: the training thread sees it
        when ``dcp.save`` returns, the pipeline when every rank's report has arrived.
        Checked and recorded under one lock, so the two never race into a ``RuntimeError``.
        """
        self._advance(boundary, strict=False)

    def _advance(self, boundary: Boundary, *, strict: bool) -> float:
        """Record ``boundary`` and the ones before it, tell the listeners; the seconds it took."""
        with self._cond:
            if self._reached is not None and boundary <= self._reached:
                if strict:
                    raise RuntimeError(f"boundary {boundary.name} reported after {self._reached.name}")
                return self._times[self._reached]
            elapsed = time.perf_counter() - self._t0
            new = [b for b in Boundary if b <= boundary and b not in self._times]
            for b in new:
                self._times[b] = elapsed
            self._reached = boundary
            if boundary == Boundary.RESTARTABLE:
                self._finished = True
            self._cond.notify_all()
            listeners = list(self._listeners)
        for b in new:
            self._notify(listeners, b, elapsed)
        return elapsed

    def _notify(self, listeners: list[BoundaryListener], boundary: Boundary, seconds: float) -> None:
        for listener in listeners:
            try:
                listener(self, boundary, seconds)
            except Exception:  # a listener's bug must not fail the checkpoint
                log.warning(
                    "step %d: a boundary listener failed at %s", self.step, boundary.name, exc_info=True
                )

    def fail(self, boundary: Boundary, error: BaseException) -> None:
        """Record that the checkpoint could not reach ``boundary`` because of ``error``; it is finished."""
        with self._cond:
            self._error = error
            self._failed_at = boundary
            self._finished = True
            self._cond.notify_all()
