"""The background pipeline of one rank: hash, plan, drain, commit, release (DESIGN.md section 4).

One worker thread per rank handles checkpoints in the order they were staged.
Training never waits for it except through a full slot ring. A failure in any
stage marks that checkpoint failed at the boundary it was working towards, is
logged and written to the event log, and leaves every earlier checkpoint and the
next one untouched: nothing is committed, ``LATEST`` does not move, and the
partial pack it may have left is reclaimed by retention later.

This issue runs it with one host: the plan covers this rank alone, the drain
goes straight to the shared tier, and B2 is reached with B3. The multi-host
exchange, replication and balanced drain plug in between ``_plan`` and ``_drain``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal import __version__, failpoints
from shoal.boundary import Boundary
from shoal.engine.catalog import ChunkCatalog
from shoal.engine.events import EventLog
from shoal.engine.handle import SaveHandle
from shoal.engine.retention import apply_retention, pack_ids_on, plan_retention
from shoal.engine.stager import Slot, SlotRing
from shoal.engine.store import list_checkpoints, read_pointer
from shoal.format import layout
from shoal.format.chunking import Hasher, chunk_spans, digest
from shoal.format.manifest import (
    ChunkLocation,
    ItemRecord,
    Manifest,
    PackRecord,
    Pointer,
    Stats,
    WorldInfo,
)
from shoal.format.pack import PackBuilder
from shoal.group.planner import CheckpointPlan, ItemChunks, RankChunks, plan_save
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SaveJob:
    """One staged checkpoint handed to the pipeline."""

    step: int
    slot: Slot
    handle: SaveHandle
    job: str
    world: WorldInfo
    dcp: Mapping[str, Any] | None = None
    created: float = field(default_factory=time.time)


class Pipeline:
    """The background worker of one rank.

    Args:
        shared: the shared tier (drain and commit target).
        ring: the rank's DRAM slot ring; the pipeline releases each job's slot.
        rank, host: who this worker is (pack ids and events carry them).
        chunk_size: dedup granularity, as in ``Config``.
        keep_last: retention after each commit (None keeps everything).
        events: the event log.
        hash_threads: BLAKE3 threads (0: automatic).
        gc_tiers: host tiers garbage-collected by reachability with the shared one.
    """

    def __init__(
        self,
        *,
        shared: Tier,
        ring: SlotRing,
        rank: int,
        host: str,
        chunk_size: int,
        keep_last: int | None,
        events: EventLog,
        hash_threads: int = 0,
        gc_tiers: tuple[Tier, ...] = (),
    ) -> None:
        self.shared = shared
        self.ring = ring
        self.rank = rank
        self.host = host
        self.chunk_size = chunk_size
        self.keep_last = keep_last
        self.events = events
        self.gc_tiers = gc_tiers
        self._hasher = Hasher(hash_threads)
        self._catalog: ChunkCatalog | None = None
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending: dict[int, SaveJob] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- trainer side --------------------------------------------------------
    def submit(self, job: SaveJob) -> None:
        """Queue a staged checkpoint (called after B1, on the training thread)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the pipeline is closed")
            self._pending[job.step] = job
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"shoal-pipeline-r{self.rank}", daemon=True
                )
                self._thread.start()
        self._queue.put(job)

    def in_flight(self) -> dict[int, SaveHandle]:
        """Handles of the checkpoints queued or being processed, by step."""
        with self._cond:
            return {s: j.handle for s, j in self._pending.items()}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint is finished; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
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
        self._hasher.close()
        return finished

    # -- worker side -------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._process(job)
            finally:
                with self._cond:
                    self._pending.pop(job.step, None)
                    self._cond.notify_all()

    def _process(self, job: SaveJob) -> None:
        h, step = job.handle, job.step
        target = Boundary.PERSISTED
        try:
            digests = self._hash(job)
            catalog = self._catalog_of_shared()
            if not self._reused_packs_present(digests, catalog):
                self._catalog = catalog = ChunkCatalog.scan(self.shared)
            plan = self._plan(job, digests, catalog)
            failpoints.hit("pipeline.before_drain", rank=self.rank)
            new_locs, new_packs = self._drain(job, plan)
            manifest = self._manifest(job, digests, plan, catalog, new_locs, new_packs)
            data = manifest.encode()
            failpoints.hit("pipeline.before_manifest", rank=self.rank)
            self._write(step, "manifest", layout.manifest_path(step), data)
            self._reached(h, Boundary.PERSISTED)
            target = Boundary.RESTARTABLE
            failpoints.hit("pipeline.before_commit", rank=self.rank)
            pointer = Pointer(step, digest(data)).encode()
            self._write(step, "commit", layout.commit_path(step), pointer)
            self._write(step, "latest", layout.LATEST, pointer)
            catalog.add_manifest(manifest)
            self._reached(h, Boundary.RESTARTABLE)
        except Exception as e:
            log.error("checkpoint %d failed before %s: %s: %s", step, target.label, type(e).__name__, e)
            self.events.emit("failed", step, boundary=target.name, error=f"{type(e).__name__}: {e}")
            h._fail(target, e)
            if not isinstance(e, OSError | ValueError):
                log.debug("traceback of the failure of step %d", step, exc_info=True)
            self._catalog = None  # rebuild from what the tier really holds
        finally:
            self.ring.release(job.slot)
        if h.error is None:
            self._retain(step)

    def _reached(self, handle: SaveHandle, boundary: Boundary) -> None:
        elapsed = handle._reach(boundary)
        self.events.emit("boundary", handle.step, boundary=boundary.name, seconds=elapsed)

    def _hash(self, job: SaveJob) -> dict[str, list[str]]:
        t0 = time.perf_counter()
        out = {
            item.key: self._hasher.hash_item(job.slot.view(item), self.chunk_size) for item in job.slot.items
        }
        nbytes = sum(item.nbytes for item in job.slot.items)
        self.events.emit("hashed", job.step, bytes=nbytes, seconds=time.perf_counter() - t0)
        return out

    def _catalog_of_shared(self) -> ChunkCatalog:
        if self._catalog is None:
            self._catalog = ChunkCatalog.scan(self.shared)
        return self._catalog

    def _reused_packs_present(self, digests: dict[str, list[str]], catalog: ChunkCatalog) -> bool:
        """Whether every pack this checkpoint would reuse is still on the shared tier.

        One existence check per pack (not per chunk): a new manifest never points at a
        pack that something outside shoal removed since the catalog was built.
        """
        packs = {catalog.locations[d].pack for ds in digests.values() for d in ds if d in catalog}
        missing = sorted(p for p in packs if not self.shared.exists(layout.pack_path(p)))
        if missing:
            log.warning(
                "packs %s vanished from %s; their chunks will be written again", missing, self.shared.url
            )
        return not missing

    def _plan(self, job: SaveJob, digests: dict[str, list[str]], catalog: ChunkCatalog) -> CheckpointPlan:
        items = []
        for item in job.slot.items:
            lengths = tuple(n for _, n in chunk_spans(item.nbytes, self.chunk_size))
            items.append(ItemChunks(item.key, item.nbytes, tuple(digests[item.key]), lengths))
        return plan_save(job.step, [RankChunks(self.rank, self.host, tuple(items))], catalog)

    def _drain(
        self, job: SaveJob, plan: CheckpointPlan
    ) -> tuple[dict[str, ChunkLocation], dict[str, PackRecord]]:
        mine = plan.drain_for(self.rank)
        if mine is None or not mine.chunks:
            return {}, {}
        by_key = {item.key: item for item in job.slot.items}
        builder = PackBuilder(layout.new_pack_id(job.step, self.host, self.rank))
        for ref in mine.chunks:
            off = ref.index * self.chunk_size
            builder.add(ref.digest, job.slot.view(by_key[ref.key])[off : off + ref.length])
        index = builder.index()
        self._write(
            job.step, "pack", layout.pack_path(builder.pack_id), builder.buffers(), nbytes=builder.size
        )
        failpoints.hit("pipeline.after_pack", rank=self.rank)
        self._write(job.step, "index", layout.index_path(builder.pack_id), index.encode())
        locs = {e.digest: ChunkLocation(builder.pack_id, e.offset, e.length) for e in index.entries}
        return locs, {builder.pack_id: PackRecord(index.size, index.blake3)}

    def _write(self, step: int, what: str, path: str, data: Any, *, nbytes: int | None = None) -> None:
        t0 = time.perf_counter()
        written = self.shared.write(path, data)
        self.events.emit(
            "write",
            step,
            tier="shared",
            what=what,
            path=path,
            bytes=written if nbytes is None else nbytes,
            seconds=time.perf_counter() - t0,
            writers=1,
        )

    def _manifest(
        self,
        job: SaveJob,
        digests: dict[str, list[str]],
        plan: CheckpointPlan,
        catalog: ChunkCatalog,
        new_locs: dict[str, ChunkLocation],
        new_packs: dict[str, PackRecord],
    ) -> Manifest:
        items: dict[str, ItemRecord] = {}
        locations: dict[str, ChunkLocation] = {}
        packs: dict[str, PackRecord] = {}
        for item in job.slot.items:
            chunks = digests[item.key]
            for d in chunks:
                loc = new_locs.get(d) or catalog.locations[d]
                locations[d] = loc
                packs[loc.pack] = new_packs.get(loc.pack) or catalog.packs[loc.pack]
            items[item.key] = ItemRecord(
                item.key, item.rank, item.kind, item.nbytes, tuple(chunks), item.dtype, item.shape
            )
        return Manifest(
            job=job.job,
            step=job.step,
            created=job.created,
            chunk_size=self.chunk_size,
            items=items,
            locations=locations,
            packs=packs,
            world=job.world,
            dcp=job.dcp,
            stats=Stats(plan.logical_bytes, plan.unique_bytes, plan.new_bytes),
            shoal_version=__version__,
        )

    def _retain(self, step: int) -> None:
        """Retention on the shared tier (and the host tiers) after ``step`` committed; never raises."""
        in_flight = [s for s in self.in_flight() if s != step]
        horizon = min([step, *(s - 1 for s in in_flight)])
        for tier in (self.shared, *self.gc_tiers):
            try:
                freed, dropped = run_retention(tier, self.keep_last, horizon)
            except Exception as e:
                log.warning(
                    "retention on %s after step %d failed (nothing unsafe was deleted): %s", tier.url, step, e
                )
                continue
            if tier is self.shared and self._catalog is not None:
                self._catalog.drop_packs(dropped)
            if freed or dropped:
                self.events.emit("retention", step, tier=tier.kind, freed_bytes=freed, packs=len(dropped))


def run_retention(tier: Tier, keep_last: int | None, horizon: int) -> tuple[int, tuple[str, ...]]:
    """One retention pass over ``tier``: keep the ``keep_last`` newest committed checkpoints.

    Returns bytes freed and the pack ids deleted. Steps newer than ``horizon`` (in
    flight) and their packs are never touched.
    """
    infos = list_checkpoints(tier)
    committed = [i.step for i in infos if i.boundary == Boundary.RESTARTABLE]
    latest = read_pointer(tier, layout.LATEST)
    plan = plan_retention(
        committed=committed,
        manifests={i.step: i.manifest for i in infos},
        latest=latest.step if latest else None,
        keep_last=keep_last,
        pack_ids=pack_ids_on(tier),
        horizon=horizon,
    )
    return apply_retention(tier, plan), plan.delete_packs
