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
from collections.abc import Callable, Collection

from shoal._collector import collector_paused
from shoal.boundary import Boundary
from shoal.engine.group_save import GroupSave, emit_checkpoint
from shoal.engine.handle import SaveHandle
from shoal.engine.protocol import PipelineContext, SaveJob
from shoal.errors import CheckpointFailed, StateError, WriterFenced
from shoal.records.fence import WriterFence
from shoal.records.packlist import StepSummaries, summarise
from shoal.records.retention import latest_step, pack_ids_on, plan_retention, retain
from shoal.records.staged import delete_staged
from shoal.records.stager import SlotRing
from shoal.tiers.base import Tier

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

        A pass yields to a checkpoint already waiting for this worker: it stops before its next
        listing or stage of deletes, so that deleting old checkpoints from a slow or contended
        store does not hold up the next one's B2 (the next pass picks up what is left; at most
        ``_MAX_DEFERRED`` passes in a row yield, then one runs whole).
        """
        ctx = self.context
        in_flight = [s for s in self.in_flight() if s != step]
        horizon = min([step, *(s - 1 for s in in_flight)])
        work: list[tuple[Tier, bool]] = []
        writer: frozenset[str] | None = None
        if ctx.fabric.is_coordinator:
            writer = self._shared_writer(step)
            if writer is not None:
                work.append((ctx.shared, False))
        if ctx.is_host_leader and ctx.host_tier is not None:
            work.append((ctx.host_tier, True))
        yielded = False

        def stop() -> bool:
            nonlocal yielded
            if self._deferred < _MAX_DEFERRED and not self._queue.empty():
                yielded = True
            return yielded

        with self._cond:
            removed = sorted(self.removed)
        for tier, host_tier in work:
            catalog = ctx.host_catalog if host_tier else ctx.shared_catalog
            try:
                if catalog is not None and step in catalog.recent:  # written by this process just now
                    self.summaries.prime(tier, *catalog.recent[step])
                freed, dropped = run_retention(
                    tier,
                    self.keep_last,
                    horizon,
                    manifests_are_commits=host_tier,
                    writer=None if host_tier else writer,
                    summaries=self.summaries,
                    stop=stop,
                    drop=removed,
                )
            except Exception as e:
                log.warning(
                    "retention on %s after step %d failed (nothing unsafe was deleted): %s", tier.url, step, e
                )
                continue
            if catalog is not None:
                catalog.drop_packs(dropped)
            if freed or dropped:
                ctx.events.emit("retention", step, tier=tier.kind, freed_bytes=freed, packs=len(dropped))
        self._deferred = self._deferred + 1 if yielded else 0
        if yielded:
            ctx.events.emit("retention_deferred", step, passes=self._deferred)

    def _shared_writer(self, step: int) -> frozenset[str] | None:
        """The writer ids retention on shared runs for (this writer's lineage), or None if fenced (warned)."""
        ctx = self.context
        fence = ctx.writer
        if not isinstance(fence, WriterFence):
            log.warning(
                "retention on %s after step %d skipped: this process holds no writer claim",
                ctx.shared.url,
                step,
            )
            return None
        try:
            fence.check(ctx.shared, "run retention")
        except WriterFenced as e:
            log.warning(
                "retention on %s after step %d skipped (nothing deleted): %s", ctx.shared.url, step, e
            )
            return None
        except Exception as e:
            log.warning(
                "retention on %s after step %d skipped (nothing deleted): the writer record could not be "
                "read: %s",
                ctx.shared.url,
                step,
                e,
            )
            return None
        return fence.lineage


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


def run_retention(
    tier: Tier,
    keep_last: int | None,
    horizon: int,
    *,
    manifests_are_commits: bool = False,
    writer: str | Collection[str] | None = None,
    summaries: StepSummaries | None = None,
    stop: Callable[[], bool] | None = None,
    drop: Collection[int] = (),
) -> tuple[int, tuple[str, ...]]:
    """One retention pass over ``tier``: keep the ``keep_last`` newest committed checkpoints.

    Returns bytes freed and the pack ids deleted. Steps newer than ``horizon`` (in
    flight) and their packs are never touched. Host tiers hold no commit records:
    with ``manifests_are_commits`` a readable manifest counts as committed there.
    ``writer``: the id of the writer that holds the job (shared tier); the steps other
    writers committed are left alone. Damaged steps (unreadable manifest, a commit record
    without its manifest or not matching it) are removed when older than every kept step,
    and otherwise protect the packs they could reference. ``summaries``: each step's pack list
    kept from earlier passes (a manifest is decoded only when it is new or its files changed).
    ``stop``: asked before the listing and before each stage of deletes (:func:`retain`); when
    it says so the pass ends there, and the next one finds what is left. ``drop``: steps the user
    removed, deleted even when among the ``keep_last`` newest (:func:`plan_retention`).
    """
    if stop is not None and stop():
        return 0, ()
    infos = summarise(tier, summaries)
    if manifests_are_commits:
        committed = [i.step for i in infos if i.summary is not None]
    else:
        committed = [i.step for i in infos if i.summary is not None and i.committed]
    plan = plan_retention(
        committed=committed,
        manifests={i.step: i.summary for i in infos},
        latest=latest_step(tier),
        keep_last=keep_last,
        pack_ids=pack_ids_on(tier),
        horizon=horizon,
        writer=writer,
        problems={i.step: i.problem for i in infos if i.problem},
        drop=drop,
    )
    return retain(tier, plan, stop=stop)
