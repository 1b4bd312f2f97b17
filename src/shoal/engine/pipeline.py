"""The background pipeline of one rank: a worker thread that takes staged checkpoints in order.

Training never waits for it except through a full slot ring. For each checkpoint
the worker runs the group protocol (:mod:`shoal.engine.group_save`: hash, exchange,
plan, replicate, drain, commit), releases the DRAM slot, and runs retention. A
failure marks that checkpoint failed at the boundary it was working towards, is
logged and written to the event log, and leaves every earlier checkpoint and the
next one untouched: nothing is committed, ``LATEST`` does not move, and a partial
pack it may have left is reclaimed by retention later.

Retention on the shared tier runs on the coordinator only while this process holds
the job (:class:`~shoal.records.fence.WriterFence`), and leaves the steps of other
writers alone (:func:`~shoal.records.retention.plan_retention`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time

from shoal._collector import collector_paused
from shoal.boundary import Boundary
from shoal.engine.group_save import GroupSave, emit_checkpoint
from shoal.engine.handle import SaveHandle
from shoal.engine.protocol import PipelineContext, SaveJob
from shoal.engine.retention import SharedRetention, run_retention
from shoal.errors import CheckpointFailed, StateError
from shoal.records.packlist import StepSummaries
from shoal.records.staged import delete_staged
from shoal.records.stager import SlotRing

log = logging.getLogger(__name__)

__all__ = ["Pipeline", "SaveJob", "run_retention"]


class Pipeline:
    """The background worker of one rank.

    Args:
        context: the protocol's state on this rank (fabric, topology, tiers, catalogs).
        ring: the rank's DRAM slot ring; the pipeline releases each job's slot.
        keep_last: retention after each commit (None keeps everything).
    """

    def __init__(self, context: PipelineContext, ring: SlotRing, *, keep_last: int | None) -> None:
        self.context = context
        self.ring = ring
        self.keep_last = keep_last
        self._queue: queue.Queue[SaveJob | _Removal | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending: dict[int, SaveJob] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._deferred = 0
        """Retention passes in a row that yielded to a waiting checkpoint."""
        self.summaries = StepSummaries()
        """Each retained step's pack list, kept between retention passes (the worker's alone)."""
        self.removed: set[int] = set()
        """Steps the user removed (:meth:`remove`): every retention pass deletes them once it may."""
        self._removals = 0
        """Removal passes queued and not yet run (:meth:`flush` waits for them too)."""
        self._shared: SharedRetention | None = None
        """The coordinator's retention on the shared tier (:meth:`flush` waits for it too)."""

    # -- trainer side --------------------------------------------------------
    def submit(self, job: SaveJob) -> None:
        """Queue a staged checkpoint (called by the training thread right after staging)."""
        with self._cond:
            if self._closed:
                raise StateError("the pipeline is closed: this Checkpointer was closed")
            self._pending[job.step] = job
            self.removed.discard(job.step)  # saved again: this checkpoint is wanted
            self._start()
        self._queue.put(job)

    def remove(self, step: int) -> None:
        """Delete ``step`` from this rank's tiers at the worker's next retention pass, queued now.

        The worker runs the pass between checkpoints, as it runs retention after a commit; a
        step in flight, or the one ``LATEST`` names, is deleted by the first pass after a newer
        checkpoint committed.
        """
        with self._cond:
            if self._closed:
                raise StateError("the pipeline is closed: this Checkpointer was closed")
            self.removed.add(step)
            self._removals += 1
            self._start()
        self._queue.put(_Removal(step))

    def _start(self) -> None:
        if self._thread is None:
            name = f"shoal-pipeline-r{self.context.rank}"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def in_flight(self) -> dict[int, SaveHandle]:
        """Handles of the checkpoints queued or being processed, by step."""
        with self._cond:
            return {s: j.handle for s, j in self._pending.items()}

    def jobs(self) -> list[SaveJob]:
        """The checkpoints queued or being processed, in step order."""
        with self._cond:
            return [self._pending[s] for s in sorted(self._pending)]

    def job(self, step: int) -> SaveJob | None:
        with self._cond:
            return self._pending.get(step)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint is finished and every removal ran; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._removals:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        if self._shared is not None:
            return self._shared.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued work (up to ``timeout`` seconds), then stop the worker. Idempotent."""
        finished = self.flush(timeout)
        with self._cond:
            if self._closed:
                return finished
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            if finished:
                thread.join()
        if self._shared is not None:
            finished = self._shared.close(0.0 if not finished else None) and finished
        self.context.hasher.close()
        return finished

    # -- worker side -------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Removal):
                try:
                    with self._cond:
                        in_flight = [s for s in self._pending if s <= job.step]
                    if not in_flight:  # else the pass after that checkpoint's commit deletes it
                        self._retain(job.step)
                except Exception:  # pragma: no cover - _retain logs its own failures
                    log.exception("pipeline worker: unexpected error removing step %d", job.step)
                finally:
                    with self._cond:
                        self._removals -= 1
                        self._cond.notify_all()
                continue
            try:
                try:
                    abandoned = job.gate.wait()
                    if abandoned is None:
                        with _paused_for(job):
                            GroupSave(self.context, job).run()
                    else:
                        self._abandon(job, abandoned)
                finally:
                    self.ring.release(job.slot)
                if job.handle.error is None:
                    with _paused_for(job):
                        self._retain(job.step)
            except Exception:  # pragma: no cover - GroupSave.run never raises; keep the worker alive anyway
                log.exception("pipeline worker: unexpected error on step %d", job.step)
            finally:
                self.context.shared_pins.release(job.step)
                with self._cond:
                    self._pending.pop(job.step, None)
                    self._cond.notify_all()

    def _abandon(self, job: SaveJob, why: str) -> None:
        """Fail a checkpoint whose gate failed, at B1, on this rank alone: no collective is made."""
        error = CheckpointFailed(f"step {job.step} was abandoned before the group protocol: {why}")
        log.warning("%s", error)
        self.context.events.emit("failed", job.step, boundary=Boundary.STAGED.name, error=str(error))
        if self.context.dram is not None and job.staged is not None:
            try:  # the slot's bytes will be overwritten: its index must not describe them
                delete_staged(self.context.dram, job.staged.slab)
            except Exception as e:
                log.warning("could not delete the staged index of abandoned step %d: %s", job.step, e)
        job.handle.fail(Boundary.STAGED, error)
        emit_checkpoint(self.context, job, None)

    def _retain(self, step: int) -> None:
        """Retention after ``step`` committed: the coordinator on shared, host leaders on their tier.

        The shared tier's pass runs on its own thread, beside the next checkpoint
        (:class:`~shoal.engine.retention.SharedRetention`); this asks for it. The host tier's
        runs here. It yields to a checkpoint already waiting for this worker: it stops before its
        next listing or stage of deletes (the next pass picks up what is left; at most
        ``_MAX_DEFERRED`` passes in a row yield, then one runs whole).
        """
        ctx = self.context
        if ctx.fabric.is_coordinator:
            self._shared_retention().request(step)
        if not (ctx.is_host_leader and ctx.host_tier is not None):
            return
        in_flight = [s for s in self.in_flight() if s != step]
        horizon = min([step, *(s - 1 for s in in_flight)])
        yielded = False

        def stop() -> bool:
            nonlocal yielded
            if self._deferred < _MAX_DEFERRED and not self._queue.empty():
                yielded = True
            return yielded

        tier, catalog = ctx.host_tier, ctx.host_catalog
        try:
            recent = None if catalog is None else catalog.recent_step(step)
            if recent is not None:  # written by this process just now
                self.summaries.prime(tier, *recent)
            freed, dropped = run_retention(
                tier,
                self.keep_last,
                horizon,
                manifests_are_commits=True,
                summaries=self.summaries,
                stop=stop,
                drop=self._removed_now(),
            )
        except Exception as e:
            log.warning(
                "retention on %s after step %d failed (nothing unsafe was deleted): %s", tier.url, step, e
            )
        else:
            if catalog is not None:
                catalog.drop_packs(dropped)
            if freed or dropped:
                ctx.events.emit("retention", step, tier=tier.kind, freed_bytes=freed, packs=len(dropped))
        self._deferred = self._deferred + 1 if yielded else 0
        if yielded:
            ctx.events.emit("retention_deferred", step, passes=self._deferred)

    def _removed_now(self) -> list[int]:
        with self._cond:
            return sorted(self.removed)

    def _shared_retention(self) -> SharedRetention:
        """The coordinator's shared-tier retention thread, started at its first request."""
        if self._shared is None:
            self._shared = SharedRetention(
                self.context,
                self.keep_last,
                self.summaries,
                in_flight=lambda: self.in_flight().keys(),
                removed=self._removed_now,
            )
        return self._shared


@dataclasses.dataclass(frozen=True)
class _Removal:
    """A queued request to delete ``step`` (:meth:`Pipeline.remove`)."""

    step: int


_MAX_DEFERRED = 4
"""Retention passes in a row that may yield to a waiting checkpoint; the next one runs whole."""

_MANY_ITEMS = 1000
"""From this many items in a rank's checkpoint, the pipeline pauses the collector for it."""


def _paused_for(job: SaveJob) -> contextlib.AbstractContextManager[None]:
    """The collector paused for ``job``'s trip through the pipeline when it has many items.

    Per-item tables by the ten thousand, and no cycles: a collection during them traverses every
    object the process holds (the training state's too), several times per checkpoint. With
    few items the tables are small; the collector is left alone then, since the trip can be
    long (a drain of large tensors to slow storage, other ranks' collectives).
    """
    return collector_paused() if len(job.slot.items) >= _MANY_ITEMS else contextlib.nullcontext()
