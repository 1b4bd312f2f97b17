"""The checkpoint commit on the shared tier: manifest (B3), ``COMMIT`` and ``LATEST`` (B4).

A strategy object beside the tiers' file commit strategies
(:class:`~shoal.tiers.base.CommitStrategy` makes one *file* appear whole or not at all;
:class:`CheckpointCommit` makes one *checkpoint* appear committed or not at all). The order,
and what is checked before each write (docs/design.md section 4, steps 8-9; section 11):

1. every pack the manifest references is on the tier whole
   (:func:`~shoal.records.catalog.require_packs`), else nothing is written;
2. this process holds the job (:class:`~shoal.records.fence.WriterFence`), checked before
   each of the three writes;
3. the manifest (B3 once it is durable), ``COMMIT`` (a pointer naming the manifest's
   digest), then ``LATEST``. If ``LATEST`` cannot be moved, the ``COMMIT`` record is taken
   back (best effort), so the tier says B3 as the handle does.

Only the coordinator commits, from the pipeline thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping

from shoal import failpoints
from shoal.boundary import Boundary
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import PackRecord, Pointer
from shoal.records.catalog import require_packs
from shoal.records.fence import WriterFence
from shoal.tiers.base import Tier

__all__ = ["CheckpointCommit", "WriteRecorder"]

WriteRecorder = Callable[[str, str, int, float], None]
"""Called after each metadata write with (what, path, bytes, seconds): the event log's ``write``."""


class CheckpointCommit:
    """Commit one checkpoint's manifest into ``shared``; :attr:`reached` says how far it got."""

    def __init__(
        self,
        shared: Tier,
        fence: WriterFence,
        step: int,
        *,
        rank: int,
        record: WriteRecorder | None = None,
    ) -> None:
        self.shared = shared
        self.fence = fence
        self.step = step
        self.rank = rank
        self._record = record
        self.manifest_digest: str | None = None
        """The BLAKE3 of the manifest bytes written (what ``COMMIT`` and ``LATEST`` name)."""
        self.reached: Boundary | None = None
        """``PERSISTED`` once the manifest is durable, ``RESTARTABLE`` once ``LATEST`` names it."""

    def commit(self, manifest: bytes, packs: Mapping[str, PackRecord]) -> None:
        """Write ``manifest`` (whose referenced packs are ``packs``), ``COMMIT`` and ``LATEST``.

        Raises what stopped it; :attr:`reached` tells whether B3 was reached before.
        """
        step, shared = self.step, self.shared
        require_packs(shared, packs, f"step {step} not committed")
        self.fence.check(shared, f"write the manifest of step {step}")
        failpoints.hit("pipeline.before_manifest", rank=self.rank)
        self._write("manifest", layout.manifest_path(step), manifest)
        self.reached = Boundary.PERSISTED
        failpoints.hit("pipeline.before_commit", rank=self.rank)
        self.manifest_digest = digest(manifest)
        pointer = Pointer(step, self.manifest_digest).encode()
        self.fence.check(shared, f"commit step {step}")
        self._write("commit", layout.commit_path(step), pointer)
        try:
            failpoints.hit("pipeline.before_latest", rank=self.rank)
            self.fence.check(shared, f"move {layout.LATEST} to step {step}")
            self._write("latest", layout.LATEST, pointer)
        except Exception:
            self.roll_back()
            raise
        self.reached = Boundary.RESTARTABLE

    def roll_back(self) -> None:
        """Take the ``COMMIT`` record back (best effort): B4 means ``COMMIT`` *and* ``LATEST``."""
        with contextlib.suppress(Exception):
            self.shared.delete(layout.commit_path(self.step))

    def _write(self, what: str, path: str, data: bytes) -> None:
        t0 = time.perf_counter()
        n = self.shared.write(path, data)
        if self._record is not None:
            self._record(what, path, n, time.perf_counter() - t0)
