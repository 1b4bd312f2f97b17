"""``shoal.Checkpointer``: the manager API (save, load, latest, close) on top of DCP.

``save`` is two-phase: it returns at B1 once the state is copied into the rank's
pre-faulted DRAM slab, with a :class:`SaveHandle` that the background pipeline
advances through B3 and B4. ``load`` reads through DCP's planner, so DTensor and
ShardedTensor state and resharding work, and verifies every chunk it reads.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from shoal.boundary import Boundary
from shoal.config import Config
from shoal.engine.events import EventLog
from shoal.engine.handle import SaveHandle
from shoal.engine.pipeline import Pipeline, SaveJob
from shoal.engine.stager import Slot, SlotRing, StagedItem, StageEntry, stage_into
from shoal.engine.store import list_checkpoints, read_pointer, resolve_manifest
from shoal.errors import CheckpointExists, ConfigError
from shoal.format import layout
from shoal.format.dcp_codec import encode_metadata
from shoal.format.manifest import Manifest, WorldInfo
from shoal.tiers import open_tier

log = logging.getLogger(__name__)


@contextmanager
def _unwrapped_errors() -> Iterator[None]:
    """Re-raise shoal's own error when DCP wraps it in its ``CheckpointException`` (a BaseException).

    With one failing rank (every failure on one host today) the caller gets the error
    that rank raised, e.g. :class:`InvalidName` or :class:`InsufficientMemory`.
    """
    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        originals = [f[0] if isinstance(f, tuple) else f for f in failures]
        if originals and all(isinstance(o, Exception) for o in originals):
            raise originals[0] from None
        raise


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's 'assuming the intent is to save in a single process' warning: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


class Checkpointer:
    """Saves and loads a job's checkpoints through shoal's tiers.

    Create one per process, after ``torch.distributed.init_process_group`` if the
    job is distributed. ``save`` and ``load`` are collective: every rank calls them
    with the same step, in the same order. Use it as a context manager, or call
    :meth:`close`; at interpreter exit, in-flight checkpoints are finished (up to
    ``Config.close_timeout`` seconds).

    This release saves and loads with one process (``world_size == 1``);
    multi-rank jobs are refused with a clear error until group save lands.
    """

    def __init__(self, config: Config) -> None:
        if not isinstance(config, Config):
            raise ConfigError(f"Checkpointer needs a shoal.Config, got {type(config).__name__}")
        self.config = cfg = config.resolved()
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        if self.world_size > 1:
            raise ConfigError(
                f"this shoal release checkpoints single-process jobs; the job has {self.world_size} ranks "
                "(multi-host group save is the next milestone)"
            )
        assert cfg.host_id is not None and cfg.local is not None
        self.host = cfg.host_id
        self.shared = open_tier("shared", cfg.shared_url(), cfg.storage_options)
        self.dram = open_tier("dram", cfg.host_url(cfg.dram))
        self._ring = SlotRing(self.dram, cfg.dram_slots, prefix=f"r{self.rank}-")  # type: ignore[arg-type]
        self._events = EventLog(cfg.event_log, host=self.host, rank=self.rank)
        self._pipeline = Pipeline(
            shared=self.shared,
            ring=self._ring,
            rank=self.rank,
            host=self.host,
            chunk_size=cfg.chunk_size,
            keep_last=cfg.keep_last,
            events=self._events,
            hash_threads=cfg.hash_threads,
        )
        self._lock = threading.Lock()
        self._staging: dict[int, tuple[SaveHandle, Slot]] = {}
        self._closed = False
        self._warmer: threading.Thread | None = None
        atexit.register(self._at_exit)

    def __repr__(self) -> str:
        return f"Checkpointer(shared={self.shared.url!r}, host={self.host!r}, rank={self.rank})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- save ----------------------------------------------------------------
    def save(self, step: int, state_dict: Mapping[str, Any]) -> SaveHandle:
        """Stage ``state_dict`` as checkpoint ``step`` and return at B1 (collective).

        The returned handle reaches B2/B3 when the bytes are on shared storage and
        B4 when the commit record and ``LATEST`` are written. If every DRAM slot is
        still in flight, ``save`` waits (``Config.on_busy="wait"``, time counted in
        the handle's B1 time) or returns a skipped handle (``"skip"``).

        Raises:
            CheckpointExists: ``step`` is committed on the shared tier or in flight.
            InvalidName: an item name is unsafe (``..`` segment, absolute path, NUL).
            InsufficientMemory: the DRAM tier cannot hold the state.
        """
        started = time.perf_counter()
        self._check_open()
        layout.check_step(step)
        self._check_new_step(step)
        from shoal import dcp as shoal_dcp

        writer = shoal_dcp.StorageWriter(self, step, _started=started)
        try:
            with _quiet_no_dist(), _unwrapped_errors():
                torch_dcp.save(
                    dict(state_dict),
                    storage_writer=writer,
                    planner=shoal_dcp.SavePlanner(),
                    no_dist=self.world_size == 1,
                )
        except BaseException as e:
            self._abort_staging(step, e)
            raise
        return writer.handle

    def _check_new_step(self, step: int) -> None:
        if step in self._pipeline.in_flight() or step in self._staging:
            raise CheckpointExists(f"step {step} is already being checkpointed by this process")
        if self.shared.exists(layout.commit_path(step)):
            raise CheckpointExists(
                f"step {step} already exists at {self.shared.url}/{layout.step_dir(step)}; "
                "checkpoints are immutable: save under a new step, or delete it first"
            )

    def _stage(
        self, step: int, entries: Sequence[StageEntry], *, started: float
    ) -> tuple[SaveHandle, list[StagedItem] | None]:
        """Copy ``entries`` into a free DRAM slot (the writer's ``write_data``); None items if skipped."""
        self._check_open()
        self._check_new_step(step)
        self._events.emit("save_called", step, items=len(entries))
        slot, waited = self._ring.acquire(step, wait=self.config.on_busy == "wait")
        if slot is None:
            handle = SaveHandle(step, started=started, skipped=True)
            self._events.emit("skipped", step, in_flight=self._ring.in_flight_steps())
            log.warning(
                "step %d skipped: every DRAM slot is in flight (%s)", step, self._ring.in_flight_steps()
            )
            return handle, None
        handle = SaveHandle(step, started=started)
        try:
            staged = stage_into(slot, self.dram, entries, rank=self.rank)  # type: ignore[arg-type]
        except BaseException:
            self._ring.release(slot)
            raise
        with self._lock:
            self._staging[step] = (handle, slot)
        self._warm_other_slots(slot)
        self._events.emit("staged", step, bytes=sum(s.nbytes for s in staged), wait_seconds=waited)
        return handle, staged

    def _warm_other_slots(self, slot: Slot) -> None:
        """Pre-fault the ring's other slabs in the background, sized like the one just used."""
        assert slot.slab is not None
        size = slot.slab.capacity
        if self._warmer is not None and self._warmer.is_alive():
            return
        if self._ring.needs_warming(size):
            self._warmer = threading.Thread(
                target=self._ring.warm, args=(size,), name="shoal-warm", daemon=True
            )
            self._warmer.start()

    def _submit(self, handle: SaveHandle, metadata: Metadata) -> None:
        """Record B1 and hand the staged checkpoint to the pipeline (the writer's ``finish``)."""
        if handle.skipped:
            return
        with self._lock:
            _, slot = self._staging.pop(handle.step)
        try:
            encoded = encode_metadata(metadata)
        except BaseException as e:
            self._ring.release(slot)
            handle._fail(Boundary.STAGED, e)
            raise
        elapsed = handle._reach(Boundary.STAGED)
        self._events.emit("boundary", handle.step, boundary=Boundary.STAGED.name, seconds=elapsed)
        world = WorldInfo(self.world_size, (self.host,), 1)
        self._pipeline.submit(SaveJob(handle.step, slot, handle, self.config.job, world, encoded))

    def _abort_staging(self, step: int, error: BaseException) -> None:
        with self._lock:
            pending = self._staging.pop(step, None)
        if pending is not None:
            handle, slot = pending
            self._ring.release(slot)
            handle._fail(Boundary.STAGED, error)

    # -- load ----------------------------------------------------------------
    def load(self, state_dict: Mapping[str, Any], step: int | None = None) -> int:
        """Load checkpoint ``step`` (None: the newest committed) into ``state_dict`` in place (collective).

        Checkpoints this process saved are finished first, so a load sees them.
        Tensors are filled in place, resharded if the saved layout differs;
        non-tensor values are replaced in ``state_dict``. Every chunk is verified
        against its BLAKE3 digest. Returns the step loaded.

        Raises:
            CheckpointNotFound: nothing committed (or no such step).
            ChecksumMismatch: a chunk's bytes do not match its digest (names item, pack, offset).
        """
        self._check_open()
        self._pipeline.flush()
        from shoal import dcp as shoal_dcp

        # Resolved here, not inside dcp.load, so a missing checkpoint raises CheckpointNotFound as itself.
        reader = shoal_dcp.StorageReader(self, _manifest=self._resolve_manifest(step))
        target = state_dict if isinstance(state_dict, dict) else dict(state_dict)
        t0 = time.perf_counter()
        with _quiet_no_dist(), _unwrapped_errors():
            torch_dcp.load(target, storage_reader=reader, no_dist=self.world_size == 1)
        assert reader.step is not None
        self._events.emit("loaded", reader.step, bytes=reader.bytes_read, seconds=time.perf_counter() - t0)
        return reader.step

    def _resolve_manifest(self, step: int | None) -> Manifest:
        return resolve_manifest(self.shared, step)

    def latest(self, boundary: Boundary = Boundary.RESTARTABLE) -> int | None:
        """The newest step known to have reached ``boundary``, or None.

        Counts this process's in-flight checkpoints and what the shared tier proves
        (a manifest for B3, a commit record for B4).
        """
        boundary = Boundary(boundary)
        steps = [s for s, h in self._pipeline.in_flight().items() if h.done(boundary)]
        if boundary == Boundary.RESTARTABLE:
            ptr = read_pointer(self.shared, layout.LATEST)
            steps += [ptr.step] if ptr else []
        steps += [
            info.step
            for info in list_checkpoints(self.shared)
            if info.boundary is not None and info.boundary >= boundary
        ]
        return max(steps, default=None)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every checkpoint this process staged is finished (or failed); False on timeout."""
        return self._pipeline.flush(timeout)

    # -- close -----------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Finish in-flight checkpoints (up to ``timeout``, default ``Config.close_timeout``), then stop."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        limit = self.config.close_timeout if timeout is None else timeout
        if not self._pipeline.close(limit):
            log.warning(
                "close(): checkpoints %s still in flight after %.0f s",
                sorted(self._pipeline.in_flight()),
                limit,
            )
            return
        if self._warmer is not None:
            self._warmer.join()
        # Every checkpoint is finished: the staged copies are redundant, give /dev/shm back.
        self._ring.close(release_memory=True)
        for tier in (self.shared, self.dram):
            tier.close()

    def _at_exit(self) -> None:
        try:
            self.close()
        except Exception as e:  # pragma: no cover - interpreter shutdown
            log.warning("shoal: close at exit failed: %s", e)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")
