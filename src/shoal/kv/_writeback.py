"""Eviction and write-back of pool blocks, and promotion of lower-tier hits, off the caller's path.

One :class:`WriteBack` per store: a daemon thread that takes jobs from a queue. ``kick`` asks it to
claim least-recently-used unpinned blocks until the pool is under its high-water mark and evict
them; ``promote`` asks it to copy a block read from a lower tier into the pool; ``touch`` records
the reads' LRU updates (the read path never writes to the index), which the thread writes in one
transaction at most every :data:`TOUCH_INTERVAL_S` (and this store's own evictions first).
:meth:`evict` is also called inline by a put that found no room. Evicting blocks: write each to
the next tier (verified first; skipped when the index says a lower tier has it, or with
``writeback=False``), decide the drop in the index (a victim pinned since it was claimed stays),
unlink the pool files, then free their bytes, in that order, so the files never hold more than
the index counts. A block whose write-back failed goes back to ``READY`` (still served), and so
does every victim an exception (even a ``KeyboardInterrupt``) left unhandled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from shoal.errors import ChecksumMismatch, FormatError, ShoalError
from shoal.kv._index import Victim
from shoal.kv.blockfile import HEADER_SIZE, decode_block
from shoal.kv.lower import LowerTier
from shoal.kv.pool import DramPool

log = logging.getLogger(__name__)

Emit = Callable[[str, str, str, int], None]
"""``emit(kind, digest, tier, nbytes)``: the store's event hook."""
Promote = Callable[[str, memoryview, str, int], None]
"""``promote(digest, payload, lower_tier, since)``: the store's put into the pool (``since``: the
removal sequence read before the payload was)."""
_TOUCHES = 1 << 16
"""The most LRU updates waiting for the thread; past it, new ones are dropped (bookkeeping only)."""
TOUCH_INTERVAL_S = 0.1
"""How long a read's LRU update may wait before the thread writes it to the host index: other
processes' evictions see it then (this store's own puts and evictions apply it first). One index
transaction per interval, however many reads: a transaction and a thread hand-off per read cost
the read path a sixth of its time."""


class WriteBack:
    """The store's background evictor (module docstring)."""

    def __init__(
        self,
        pool: DramPool,
        next_tier: LowerTier | None,
        *,
        writeback: bool,
        high_water_bytes: int,
        emit: Emit,
        promote: Promote,
    ) -> None:
        self.pool = pool
        self.next_tier = next_tier if writeback else None
        self.high_water_bytes = high_water_bytes
        self._emit = emit
        self._promote = promote
        self._jobs: queue.Queue[tuple[str, str, bytes, str, int] | None] = queue.Queue(maxsize=256)
        self._touches: dict[str, tuple[float, int]] = {}
        self._touch_due: float | None = None
        """When the thread writes the waiting touches (monotonic); None while none wait."""
        self._idle = threading.Condition()
        self._pending = 0
        self._kicked = False
        self.written_back = 0
        self._thread = threading.Thread(target=self._run, name="shoal-kv-writeback", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------

    def kick(self) -> None:
        """Evict down to the high-water mark in the background (one request queued at a time)."""
        with self._idle:
            if self._kicked:
                return
            self._kicked = True
        self._submit(("kick", "", b"", "", 0))

    def promote(self, digest: str, payload: bytes, lower: str, since: int) -> None:
        """Copy a lower-tier hit into the pool in the background (dropped if the queue is full)."""
        self._submit(("promote", digest, payload, lower, since), block=False)

    def touch(self, digests: Sequence[str]) -> None:
        """Record that ``digests`` (one batch, head first) were read now: the thread updates their
        LRU position later. Never waits (dropped when the thread is far behind)."""
        if not digests:
            return
        now = time.time()
        with self._idle:
            if len(self._touches) < _TOUCHES:
                for i, d in enumerate(digests):
                    self._touches[d] = (now, i)
            if self._touch_due is not None:
                return  # the thread already waits to write them
            self._touch_due = time.monotonic() + TOUCH_INTERVAL_S
        # wake the thread (it may be waiting for a job with no timeout) so that it sets its timer
        if not self._submit(("touch", "", b"", "", 0), block=False):
            with self._idle:
                self._touch_due = None  # the queue is full: the next read asks again

    def _submit(self, job: tuple[str, str, bytes, str, int], *, block: bool = True) -> bool:
        with self._idle:
            self._pending += 1
        try:
            self._jobs.put(job, block=block)
        except queue.Full:
            self._done()
            return False
        return True

    def pending(self) -> int:
        with self._idle:
            return self._pending

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job ran, then write the waiting LRU updates; whether the jobs
        ran within ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        self._flush_touches()
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        self.flush(timeout)
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- evicting ---------------------------------------------------------------------------

    def evict(self, victims: Sequence[Victim], since: int) -> None:
        """Write back (where needed), decide, unlink and free each claimed victim (``since``: the
        removal sequence they were claimed under); give back those that fail or stay pinned."""
        written: list[Victim] = []
        dropped: list[str] = []
        try:
            for victim in victims:
                try:
                    target = self._write_back(victim, since)
                except (ShoalError, OSError) as e:
                    log.warning(
                        "KV pool: write-back of block %s failed, it stays in DRAM: %s", victim.digest, e
                    )
                    continue
                written.append(victim)
                if target is not None:
                    self.written_back += 1
                    self._emit("written_back", victim.digest, target, victim.size)
            for digest in self.pool.index.decide_drop([v.digest for v in written]):
                self.pool.unlink(digest)
                dropped.append(digest)
        finally:
            # whatever happened, nothing stays claimed: the dropped are freed (their files are
            # gone), every other victim is READY again (its file is still there)
            if dropped:
                self.pool.index.release(dropped)
            self.pool.index.unclaim([v.digest for v in victims if v.digest not in set(dropped)])
        sizes = {v.digest: v.size for v in victims}
        for digest in dropped:
            self._emit("evicted", digest, "dram", sizes[digest])

    def _write_back(self, victim: Victim, since: int) -> str | None:
        """Copy one victim to the next tier; the tier it went to, or None if not copied (not
        needed, removed meanwhile, or corrupt)."""
        if self.next_tier is None or victim.lower is not None:
            return None
        try:
            raw = self.pool.read_raw(victim.digest)
        except FileNotFoundError:
            return None  # removed meanwhile
        try:
            payload = decode_block(raw, victim.digest, self.pool.path(victim.digest))
        except (FormatError, ChecksumMismatch) as e:
            log.warning("KV pool: block %s is corrupt, dropped instead of written back: %s", victim.digest, e)
            self._emit("corrupt", victim.digest, "dram", victim.size)
            return None
        if not self.next_tier.write(victim.digest, raw[:HEADER_SIZE], payload, since):
            return None  # a remove came after the claim: the copy was discarded
        return self.next_tier.name

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._idle:
                due = self._touch_due
            try:
                job = self._jobs.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            except queue.Empty:  # the touches are due
                self._flush_touches()
                continue
            if job is None:
                return
            kind, digest, payload, lower, since = job
            try:
                if kind == "kick":
                    with self._idle:
                        self._kicked = False
                    self._evict_to_high_water()
                elif kind == "touch":
                    pass  # a wake-up: the loop's next wait ends when the touches are due
                else:
                    self._promote(digest, memoryview(payload), lower, since)
            except ShoalError as e:  # a busy index, a failing tier: said, and the next job goes on
                log.warning("KV store background job %s %s failed: %s", kind, digest, e)
            except Exception:  # noqa: BLE001 - a background job must not kill the thread
                log.exception("KV store background job %s %s failed", kind, digest)
            finally:
                self._done()

    def apply_touches(self) -> None:
        """Write the LRU updates of this store's reads so far (the thread's job; a put of this
        store also does it first, so that what it evicts reflects every read before it)."""
        with self._idle:
            if not self._touches:
                return
            touches, self._touches = self._touches, {}
        self.pool.index.touch([(d, t, i) for d, (t, i) in touches.items()])

    def _flush_touches(self) -> None:
        with self._idle:
            self._touch_due = None
        try:
            self.apply_touches()
        except ShoalError as e:  # a busy index: bookkeeping, dropped
            log.warning("KV store: LRU updates of recent reads dropped: %s", e)

    def _evict_to_high_water(self) -> None:
        self.apply_touches()  # what this store read before counts
        for _ in range(64):
            victims, since = self.pool.index.claim_above(self.high_water_bytes)
            if not victims:
                return
            self.evict(victims, since)

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()
