"""A save session: one rank's save of one step, from the call to the hand-off to the pipeline.

Both front doors hold one per save. :meth:`shoal.Checkpointer.save` opens it with
:meth:`~shoal.engine.runtime.Runtime.begin_save` before it calls ``dcp.save``, passes it to
:class:`shoal.dcp.StorageWriter` (``session=``) and, once ``dcp.save`` has returned on every rank,
hands the staged checkpoint to the pipeline (:meth:`SaveSession.submit`) or gives it up
(:meth:`SaveSession.abort`). A ``StorageWriter`` made without a session (``dcp.save`` called
directly) opens a *direct* one itself: it enters the collective check in DCP's first call, and its
checkpoint goes to the pipeline at once, behind a gate that the rank running DCP's ``finish``
opens (:class:`~shoal.engine.protocol.Gate`).

The session owns its :class:`~shoal.engine.protocol.SaveJob` until the hand-off: staging
creates it, DCP's ``finish`` adds the encoded metadata, and only then does the pipeline read it
(``dcp_ready`` and the gate order the two). Nothing else looks a staged job up by its step.
The load session is :class:`~shoal.engine.restore.Restore`
(:meth:`~shoal.engine.runtime.Runtime.begin_restore`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import Metadata

from shoal.boundary import Boundary
from shoal.engine.handle import SaveHandle
from shoal.engine.protocol import SaveJob
from shoal.errors import StateError
from shoal.records.stager import StagedItem, StageEntry

if TYPE_CHECKING:
    from shoal.engine.runtime import Runtime


class SaveSession:
    """One rank's save of ``step`` (see the module docstring); made by :meth:`Runtime.begin_save`.

    ``direct``: ``dcp.save`` was called with shoal's writer but without a session, so the session
    makes the collective check itself and its checkpoint waits behind a gate; otherwise the
    caller (the :class:`~shoal.Checkpointer`) made the check and submits.
    """

    def __init__(self, runtime: Runtime, step: int, *, started: float | None = None, direct: bool) -> None:
        self.runtime = runtime
        self.step = step
        self.started = time.perf_counter() if started is None else started
        """When the save was called (``time.perf_counter``): B1's time counts from here."""
        self.direct = direct
        # Every rank makes one direct session per dcp.save, so the count names the save alike on
        # every rank (its gate's name).
        self.sequence = runtime.next_save_sequence() if direct else None
        self._handle: SaveHandle | None = None
        self._job: SaveJob | None = None
        self._handed_over = False

    @property
    def handle(self) -> SaveHandle:
        """The checkpoint's :class:`~shoal.engine.handle.SaveHandle` (once staged)."""
        if self._handle is None:
            raise StateError(f"step {self.step}: nothing is staged yet (dcp.save has not called write_data)")
        return self._handle

    def enter(self) -> None:
        """DCP's first call (every rank): a direct session checks every rank made this save.

        Raises :class:`~shoal.errors.CollectiveMismatch` (see
        :meth:`~shoal.engine.runtime.Runtime.enter_collective`).
        """
        if self.direct:
            self.runtime.enter_collective(f"dcp.save(step {self.step})")

    def stage(self, entries: Sequence[StageEntry]) -> list[StagedItem] | None:
        """Copy ``entries`` into a free DRAM slot (DCP's ``write_data``); None if the save was skipped."""
        if self._handle is not None:
            raise StateError(f"step {self.step}: this save session has staged already")
        gate = None
        if self.sequence is not None:
            gate = self.runtime.new_gate(self.sequence, self.step)
        self._handle, self._job = self.runtime.stage(self.step, entries, started=self.started, gate=gate)
        if self._job is None:
            return None  # skipped
        assert self._job.staged is not None
        self._handed_over = self.direct  # a gated job went to the pipeline at once
        return self._job.staged.items

    def finish(self, metadata: Metadata) -> None:
        """DCP's ``finish`` (its coordinator only): keep the encoded metadata for the manifest."""
        if self._job is not None:
            self.runtime.attach_metadata(self._job, metadata, gated=self.direct)
        if self.direct and self._handle is not None:
            # every rank's write results reached finish(): every rank has staged
            self._handle.reach_at_least(Boundary.STAGED)

    def submit(self) -> SaveHandle:
        """Hand the staged checkpoint to the pipeline (every rank, once ``dcp.save`` returned)."""
        handle = self.handle
        if self._job is not None and not self._handed_over:
            self._handed_over = True
            self.runtime.submit(self._job)
        handle.reach_at_least(Boundary.STAGED)
        self.runtime.watch(handle)
        return handle

    def abort(self, error: BaseException) -> None:
        """Give the save up (``dcp.save`` raised): free its slot and fail its handle at B1."""
        if self._job is not None and not self._handed_over:
            self._handed_over = True
            self.runtime.abort(self._job, error)


__all__ = ["SaveSession"]
