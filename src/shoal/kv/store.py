"""``KVStore``: the KV-cache block store a serving engine's offload path calls.

Blocks are content-addressed by :class:`~shoal.kv.keys.BlockKey`; every call is batch-first and
reports per key instead of raising on a miss:

* :meth:`KVStore.put_batch` stores blocks in the host DRAM pool (idempotent: a block the pool
  holds, or another process is storing, is not written again). When the pool is full, the least
  recently used unpinned blocks are evicted first (written back to the next tier); when nothing
  can be evicted (everything pinned), the block goes straight to the next tier (local, else
  shared), and only without one is it an ``InsufficientMemory`` error result.
* :meth:`KVStore.get_batch_into` reads into the caller's buffers: one pass over the pool, then the
  rest from local disk, then from the shared tier in parallel threads; every block is verified
  (BLAKE3 of header and payload) before it counts as a hit; a torn or corrupt copy is deleted, a
  ``corrupt`` event is emitted and the next tier is tried. At the ``deadline`` whatever has not
  arrived is a miss (reason ``deadline``) so the caller recomputes; a shared read still running
  then is abandoned (it never writes into the caller's buffer). A local-disk read is not
  interrupted: it can finish up to one block read after the deadline. The buffer of any key
  that is not a hit holds unspecified bytes. Lower-tier hits are promoted into the pool in the
  background.
* The pool is shared by every process of this user on the host (:mod:`shoal.kv.pool`), so a
  block any of them put is served from memory to all; its capacity is counted in physical bytes
  and never exceeded. Above ``high_water`` a background thread evicts down to it, writing back to
  the next tier, so that a put rarely waits for a write-back; where there is nothing to write back
  to (no lower tier, or ``writeback=False``) blocks are dropped only when a put needs the room.
* :meth:`KVStore.lookup_prefix` and :meth:`KVStore.contains` answer from the host's index for
  DRAM and local disk; past them they ask the shared tier (``KVConfig.shared_lookup="ask"``, one
  round trip for a request's new tail), or, with ``"host"``, answer from the index's record of the
  blocks this host wrote there, with no round trip on the lookup path.

Events (``stored``, ``evicted``, ``written_back``, ``corrupt``, ``removed``; and ``fetched``, one
per ``get_batch_into`` with its duration) go to the listeners of the store that saw them, on the
thread that saw them (the caller's or the write-back thread).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import suppress
from functools import partial
from typing import Any

from shoal.errors import (
    BoundaryTimeout,
    ChecksumMismatch,
    ConfigError,
    FormatError,
    InsufficientMemory,
    ShoalError,
    StateError,
)
from shoal.kv._buffers import block_view, writable_view
from shoal.kv._index import DROPPING, EVICTING, READY, TXN_KEYS, LruMark, Pending, Victim
from shoal.kv._results import (
    DRAM,
    LOCAL,
    SHARED,
    BlockSizeError,
    GetResult,
    KVConfig,
    KVEvent,
    KVStats,
    Lease,
    PutResult,
    TierStats,
    TrafficCounters,
)
from shoal.kv._writeback import WriteBack
from shoal.kv.blockfile import encode_header
from shoal.kv.keys import BlockKey
from shoal.kv.lower import LocalBlocks, LowerTier, SharedBlocks, tier_error
from shoal.kv.pool import BufferSizeError, DramPool, physical_bytes

log = logging.getLogger(__name__)

Buffer = Any
"""Anything exposing the buffer protocol, or a CPU torch tensor."""


_SHARED_LOOKUP_WINDOW = 16
"""The most shared-tier existence checks :meth:`KVStore.lookup_prefix` has in flight at once."""

__all__ = [
    "BlockSizeError",
    "DRAM",
    "LOCAL",
    "SHARED",
    "Buffer",
    "GetResult",
    "KVConfig",
    "KVEvent",
    "KVStats",
    "KVStore",
    "Lease",
    "PutResult",
    "TierStats",
]

_KEY_MEMORY = 1 << 16
_PUT_ROUNDS = 10
"""Rounds of reserve-and-evict a put tries before it sends a block to the next tier (or fails):
while other processes' evictions and writes are in flight it waits for them, 20 ms more each
round (at most about a second in all)."""
_SHARED_THREADS = 8


class KVStore:
    """The block store of one process (module docstring); joins, or creates, the host's pool."""

    def __init__(self, config: KVConfig) -> None:
        if not isinstance(config, KVConfig):
            raise ConfigError(f"KVStore takes a KVConfig, got {type(config).__name__}")
        self.config = config
        self._local = LocalBlocks(config.local_root, config.local_bytes) if config.local_root else None
        self._pool = DramPool(config.dram_root, config.dram_bytes)
        try:
            self._shared = (
                SharedBlocks(config.shared_url, config.storage_options) if config.shared_url else None
            )
            if self._shared is not None:
                self._shared.index = self._pool.index
            if self._local is not None:
                self._local.index = self._pool.index
                self._pool.index.local_root = self._local.tier.root
                self._pool.local = self._local.listing
                if self._shared is not None and config.writeback:
                    self._local.spill = self._shared
            self._pool.reconcile()
        except BaseException:
            self._pool.close()
            raise
        self._lower: list[LowerTier] = [t for t in (self._local, self._shared) if t is not None]
        self._listeners: list[Callable[[KVEvent], None]] = []
        self._counters = {name: TrafficCounters() for name in (DRAM, LOCAL, SHARED)}
        self._corrupt = 0
        self._corrupt_lock = threading.Lock()
        self._keys: OrderedDict[str, BlockKey] = OrderedDict()
        self._readers: ThreadPoolExecutor | None = None
        self._closed = False
        self._writeback = WriteBack(
            self._pool,
            self._lower[0] if self._lower else None,
            writeback=config.writeback,
            high_water_bytes=int(config.high_water * config.dram_bytes),
            emit=self._emit,
            promote=self._promote,
        )

    # -- put ------------------------------------------------------------------------------

    def put_batch(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[PutResult]:
        """Store each block under its key (module docstring); one result per key, in order."""
        self._check_open()
        _check_keys(keys, "put_batch")
        if len(keys) != len(blocks):
            raise ConfigError(f"put_batch got {len(keys)} keys but {len(blocks)} blocks")
        results: list[PutResult | None] = [None] * len(keys)
        items: dict[str, tuple[memoryview, str | None]] = {}
        for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
            self._remember(key)
            if key.digest in items:
                continue
            try:
                view = block_view(block, f"block {i} ({key.digest})")
            except ConfigError as e:
                results[i] = PutResult(key, False, None, e)
                continue
            local_copy = LOCAL if self._local is not None and self._local.exists(key.digest) else None
            items[key.digest] = (view, local_copy)
        self._writeback.apply_touches()  # this store's reads before the put count for its evictions
        outcomes = self._put_dram(items)
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if results[i] is None:
                stored, tier, error = outcomes[key.digest]
                results[i] = PutResult(key, stored and key.digest not in seen, tier, error)
                seen.add(key.digest)
        if (
            self._writeback.next_tier is not None
            and self._pool.index.last_used > self._writeback.high_water_bytes
        ):
            self._writeback.kick()  # only where evicting means a write-back: a drop is instant at put time
        return [r for r in results if r is not None]

    def _put_dram(
        self, items: dict[str, tuple[memoryview, str | None]], since: int | None = None
    ) -> dict[str, tuple[bool, str | None, ShoalError | None]]:
        """Put blocks into the pool, evicting inline when full; the rest to the next tier (or errors).

        At most :data:`TXN_KEYS` keys per index transaction: a large batch is cut into parts that
        are reserved, written and committed one after the other. ``since``: for a promotion, the
        removal sequence read before its bytes were (a remove after it discards the copy).
        """
        out: dict[str, tuple[bool, str | None, ShoalError | None]] = {}
        order = list(items)
        depth = {d: i for i, d in enumerate(order)}
        at = time.time()  # one instant for the whole batch, whichever round stores a block
        resume: list[LruMark | None] = [None]  # one pass over the LRU order for the whole batch
        for start in range(0, len(order), TXN_KEYS):
            self._put_part(order[start : start + TXN_KEYS], items, depth, at, since, out, resume)
        return out

    def _put_part(
        self,
        part: list[str],
        items: dict[str, tuple[memoryview, str | None]],
        depth: dict[str, int],
        at: float,
        since: int | None,
        out: dict[str, tuple[bool, str | None, ShoalError | None]],
        resume: list[LruMark | None],
    ) -> None:
        pending = part
        last: dict[str, tuple[int, int]] = {}
        index = self._pool.index
        for attempt in range(_PUT_ROUNDS):
            reqs = [(d, items[d][0].nbytes, physical_bytes(items[d][0].nbytes)) for d in pending]
            reservations, victims, reserved_since = index.reserve(reqs, keep=items.keys(), resume=resume)
            order = reserved_since if since is None else min(since, reserved_since)
            full: list[str] = []
            stale: list[str] = []
            for r in reservations:
                if r.outcome == "present":
                    out[r.digest] = (False, DRAM, None)
                elif r.outcome == "stale":
                    stale.append(r.digest)
                elif r.outcome == "full":
                    full.append(r.digest)
                    last[r.digest] = (r.needed, r.free)
            reserved = [r.digest for r in reservations if r.outcome == "reserved"]
            self._write_reserved(reserved, items, depth, at, order, out, victims, reserved_since)
            pending = full + stale
            if not pending:
                break
            if stale:  # a dead process's half-written copy: sweep it (files first), then again
                self._pool.sweep()
            elif not victims:  # nothing evictable now: dead processes' rows, others' writes or write-backs
                if attempt == 0:
                    self._pool.sweep()
                elif index.in_flight_count() == 0 or attempt >= _PUT_ROUNDS - 2:
                    break
                else:
                    time.sleep(0.02 * attempt)
        for digest in pending:
            out[digest] = self._overflow(digest, items[digest], *last.get(digest, (0, 0)))

    def _write_reserved(
        self,
        reserved: list[str],
        items: dict[str, tuple[memoryview, str | None]],
        depth: dict[str, int],
        at: float,
        since: int,
        out: dict[str, tuple[bool, str | None, ShoalError | None]],
        victims: list[Victim],
        claimed_since: int,
    ) -> None:
        """Write the reserved blocks' temporary files, commit them, and evict the victims claimed
        for the rest. Whatever is raised on the way (a ``KeyboardInterrupt`` too), nothing is left
        half done: an uncommitted reservation is freed with its files, an unhandled victim is
        given back."""
        index = self._pool.index
        temps: list[Pending] = []
        finished = False
        try:
            for digest in reserved:
                view, lower = items[digest]
                try:
                    tmp = self._pool.write_temp(digest, encode_header(digest, view), view)
                except (ShoalError, OSError) as e:
                    index.release_mine([digest])
                    out[digest] = (False, None, tier_error(DRAM, digest, e))
                    continue
                temps.append(Pending(digest, tmp, lower, depth[digest]))
            committed, removed, failed = index.commit(temps, since, at)
            finished = True
        finally:
            if not finished:
                self._abandon([p.digest for p in temps] + [d for d in reserved if d not in out], temps)
                index.unclaim([v.digest for v in victims])
        for p in temps:
            if p.digest not in committed:
                with suppress(OSError):
                    os.unlink(p.tmp)
        index.release_mine(removed + list(failed))
        for digest in removed:
            out[digest] = (False, None, None)  # a remove overtook this put: nothing stays
        for digest, err in failed.items():
            out[digest] = (False, None, tier_error(DRAM, digest, err))
        for digest in committed:
            view = items[digest][0]
            self._counters[DRAM].add(bytes_written=view.nbytes)
            out[digest] = (True, DRAM, None)
            self._emit("stored", digest, DRAM, view.nbytes)
        if victims:
            self._writeback.evict(victims, claimed_since)

    def _abandon(self, digests: list[str], temps: list[Pending]) -> None:
        """Undo this process's reservations of ``digests`` after an exception: their temporary
        files, and a file a rolled-back commit had already renamed into place, then the rows."""
        with suppress(BaseException):
            for p in temps:
                with suppress(OSError):
                    os.unlink(p.tmp)
            mine = self._pool.index.writing_mine(digests)
            for digest in mine:
                self._pool.unlink(digest)  # renamed in a commit that did not commit: never counted
            self._pool.index.release_mine(mine)

    def _overflow(
        self, digest: str, item: tuple[memoryview, str | None], needed: int, free: int
    ) -> tuple[bool, str | None, ShoalError | None]:
        """A block the pool cannot take: straight to the next tier, or an error naming the bytes."""
        view, lower = item
        if lower is not None:
            return False, lower, None
        if not self._lower:
            return (
                False,
                None,
                InsufficientMemory(
                    f"KV pool {self._pool.root} needs {needed} bytes for block {digest} but only {free} "
                    f"of its {self._pool.capacity} bytes are free and every other block is pinned or "
                    f"being written; "
                    f"unpin blocks, raise KVConfig.dram_bytes, or configure a local or shared tier"
                ),
            )
        tier = self._lower[0]
        try:
            if not tier.write(digest, encode_header(digest, view), view, self._pool.index.seq()):
                return False, None, None  # a remove overtook this put
        except (ShoalError, OSError) as e:
            return False, None, tier_error(tier.name, digest, e)
        self._counters[tier.name].add(bytes_written=view.nbytes)
        self._emit("stored", digest, tier.name, view.nbytes)
        return True, tier.name, None

    def _promote(self, digest: str, payload: memoryview, lower: str, since: int) -> None:
        """The write-back thread's job: copy a lower-tier hit into the pool (best effort), unless
        a remove came after ``since`` (read before the hit's bytes were)."""
        if not self._closed:
            self._put_dram({digest: (payload, lower)}, since)

    # -- get ------------------------------------------------------------------------------

    def get_batch_into(
        self,
        keys: Sequence[BlockKey],
        buffers: Sequence[Buffer],
        *,
        deadline: float | None = None,
        for_peer: bool = False,
    ) -> list[GetResult]:
        """Fill each buffer with its key's verified block (module docstring); one result per key.

        ``for_peer``: a read on another host's behalf (:class:`shoal.kv.peers.PeerServer`): only
        this host's tiers (DRAM, local disk) are read, never the shared one, and the read is not a
        use of the blocks here: their LRU order is not touched and nothing is promoted."""
        self._check_open()
        began = time.monotonic()
        _check_keys(keys, "get_batch_into")
        _check_deadline(deadline)
        if len(keys) != len(buffers):
            raise ConfigError(f"get_batch_into got {len(keys)} keys but {len(buffers)} buffers")
        results: list[GetResult | None] = [None] * len(keys)
        views: dict[int, memoryview] = {}
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            self._remember(key)
            try:
                views[i] = writable_view(buf, f"buffer {i} for block {key.digest}")
            except ConfigError as e:
                results[i] = GetResult(key, "error", error=e)
        corrupt: set[int] = set()
        use = not for_peer
        todo = self._read_pass(self._pool_read, DRAM, keys, views, results, corrupt, deadline, 0, use)
        asked = DRAM
        if todo and self._lower:
            # read before any lower tier's bytes: a promotion of what is read now is discarded if a
            # remove comes after this point (WAL: a read that never waits on a writer)
            since = self._pool.index.seq()
            if self._local is not None:
                asked = LOCAL
                todo = self._read_pass(
                    self._local.read_into, LOCAL, keys, todo, results, corrupt, deadline, since, use
                )
            if self._shared is not None and todo and use:
                asked = SHARED
                todo = self._shared_pass(keys, todo, results, corrupt, deadline, since)
        for i in todo:
            results[i] = GetResult(keys[i], "miss", reason="corrupt" if i in corrupt else "absent")
        out = [
            r if r is not None else GetResult(keys[i], "miss", reason="absent") for i, r in enumerate(results)
        ]
        if self._listeners:
            hit = sum(r.nbytes for r in out if r.status == "hit")
            now = time.monotonic()
            self._notify(KVEvent("fetched", None, asked, hit, now, "", now - began))
        return out

    def _pool_read(self, digest: str, out: memoryview) -> str | None:
        return self._pool.read_into(digest, out)

    def _read_pass(
        self,
        read: Callable[[str, memoryview], str | None],
        tier: str,
        keys: Sequence[BlockKey],
        views: dict[int, memoryview],
        results: list[GetResult | None],
        corrupt: set[int],
        deadline: float | None,
        since: int,
        use: bool = True,
    ) -> dict[int, memoryview]:
        """Read what ``tier`` holds of ``views``, in the calling thread; return what is still missing.

        ``use``: the read is a use of the blocks (DRAM hits touched, lower hits promoted)."""
        missing: dict[int, memoryview] = {}
        hits: list[str] = []
        for i, view in views.items():
            key = keys[i]
            if deadline is not None and time.monotonic() >= deadline:
                results[i] = GetResult(key, "miss", reason="deadline")
                continue
            if self._take(
                tier, i, key, view, partial(read, key.digest, view), results, corrupt, missing, since, use
            ):
                hits.append(key.digest)
        if tier == DRAM and use:
            self._writeback.touch(hits)  # the LRU update, off the read path
        return missing

    def _take(
        self,
        tier: str,
        i: int,
        key: BlockKey,
        view: memoryview,
        attempt: Callable[[], str | None],
        results: list[GetResult | None],
        corrupt: set[int],
        missing: dict[int, memoryview],
        since: int,
        use: bool = True,
    ) -> bool:
        """One key's read from ``tier`` (``attempt`` fills ``view``, verified, or says it is absent):
        its result on a hit or an error, into ``missing`` otherwise (a corrupt copy is dropped)."""
        counters = self._counters[tier]
        try:
            found = attempt()
        except BufferSizeError as e:
            results[i] = GetResult(key, "error", error=BlockSizeError(str(e), e.block_bytes))
            return False
        except (FormatError, ChecksumMismatch) as e:
            self._drop_corrupt(key.digest, tier, e)
            corrupt.add(i)
            found = None
        except (ShoalError, OSError) as e:
            results[i] = GetResult(key, "error", error=tier_error(tier, key.digest, e))
            return False
        if not found:
            counters.add(misses=1)
            missing[i] = view
            return False
        results[i] = GetResult(key, "hit", tier=tier, nbytes=view.nbytes, payload_digest=found)
        counters.add(hits=1, bytes_read=view.nbytes)
        if tier != DRAM and use:
            self._writeback.promote(key.digest, bytes(view), tier, since)
        return True

    def _shared_pass(
        self,
        keys: Sequence[BlockKey],
        views: dict[int, memoryview],
        results: list[GetResult | None],
        corrupt: set[int],
        deadline: float | None,
        since: int,
    ) -> dict[int, memoryview]:
        """Fetch the rest from the shared tier in parallel, waiting no later than ``deadline``.

        A copy that a remove on this host overtook (uploaded by a write-back that started before
        the remove, and about to be deleted by it) is not served."""
        assert self._shared is not None
        shared = self._shared
        pool = self._reader_pool()
        futures: dict[int, Future[tuple[memoryview, str] | None]] = {
            i: pool.submit(shared.fetch_verified, keys[i].digest) for i in views
        }
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait_futures(list(futures.values()), timeout=timeout)
        missing: dict[int, memoryview] = {}
        done = [i for i, fut in futures.items() if fut.done()]
        stale = self._pool.index.stale_shared([keys[i].digest for i in done]) if done else set()
        for i, fut in futures.items():
            key, view = keys[i], views[i]
            if not fut.done():
                fut.cancel()  # abandoned: it never touches the caller's buffer
                results[i] = GetResult(key, "miss", reason="deadline")
                continue
            if key.digest in stale:
                missing[i] = view
                continue
            self._take(
                SHARED, i, key, view, partial(_copy_fetched, fut, key, view), results, corrupt, missing, since
            )
        return missing

    def _drop_corrupt(self, digest: str, tier: str, err: ShoalError) -> None:
        """A torn or corrupt copy: never served; deleted (so a good copy can replace it) and reported."""
        log.warning("KV store: %s copy of block %s is corrupt, deleted: %s", tier, digest, err)
        with self._corrupt_lock:
            self._corrupt += 1
        try:
            if tier == DRAM:
                self._pool.unlink(digest)
                self._pool.index.release([digest], states=(READY, EVICTING, DROPPING))
            elif tier == LOCAL and self._local is not None:
                self._local.delete(digest)
            elif tier == SHARED and self._shared is not None:
                self._shared.delete(digest)
        except (ShoalError, OSError) as e:
            log.warning("KV store: could not delete the corrupt %s copy of block %s: %s", tier, digest, e)
        self._emit("corrupt", digest, tier, 0)

    def _reader_pool(self) -> ThreadPoolExecutor:
        if self._readers is None:
            self._readers = ThreadPoolExecutor(_SHARED_THREADS, thread_name_prefix="shoal-kv-read")
        return self._readers

    # -- membership, removal, pins ----------------------------------------------------------

    def contains(self, key: BlockKey) -> str | None:
        """The highest tier that holds ``key``'s block now, or None (a copy is not verified here)."""
        self._check_open()
        _check_keys([key], "contains")
        if self._pool.exists(key.digest):
            return DRAM
        for tier in self._lower:
            try:
                if self._lower_has(tier, key.digest):
                    return tier.name
            except (ShoalError, OSError) as e:
                log.warning(
                    "KV store: %s tier could not say whether it holds %s: %s", tier.name, key.digest, e
                )
        return None

    def block_size(self, key: BlockKey) -> int | None:
        """The stored block's size in bytes (from the highest tier holding it), or None."""
        self._check_open()
        _check_keys([key], "block_size")
        size = self._pool.block_size(key.digest)
        for tier in self._lower:
            if size is not None:
                break
            try:
                size = tier.block_size(key.digest)
            except (ShoalError, OSError) as e:
                log.warning("KV store: %s tier could not stat block %s: %s", tier.name, key.digest, e)
        return size

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, are stored in some tier (the longest stored prefix)."""
        self._check_open()
        _check_keys(keys, "lookup_prefix")
        n = 0
        for key in keys:
            if self._pool.exists(key.digest) or (self._local is not None and self._local.exists(key.digest)):
                n += 1
            else:
                break
        if self._shared is None or n == len(keys):
            return n
        shared = self._shared

        def anywhere(key: BlockKey) -> bool:
            host = self._pool.exists(key.digest) or (
                self._local is not None and self._local.exists(key.digest)
            )
            return host or self._lower_has(shared, key.digest)

        if self.config.shared_lookup == "host":  # the host's index answers: no round trips to batch
            while n < len(keys) and anywhere(keys[n]):
                n += 1
            return n
        # Galloping windows: the first key past the host's prefix is asked alone (the common case,
        # a request's new tail, costs one request to the shared tier), then 2, 4 ... up to 16 keys
        # in parallel while every key asked was there.
        window = 1
        while n < len(keys):
            for there in self._reader_pool().map(anywhere, keys[n : n + window]):
                if not there:
                    return n
                n += 1
            window = min(2 * window, _SHARED_LOOKUP_WINDOW)
        return n

    def _lower_has(self, tier: LowerTier, digest: str) -> bool:
        """Whether a lower tier holds the block: the shared tier is asked, or with
        ``shared_lookup="host"`` the host's record of what it wrote there answers."""
        shared = self._shared
        if shared is not None and tier is shared:
            if self.config.shared_lookup == "host":
                return shared.known(digest)
            return shared.exists(digest) and not self._pool.index.stale_shared([digest])
        return tier.exists(digest)

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Remove each block from every tier; the number of keys some tier held.

        The remove is recorded (a tombstone) in the same index transaction that deletes the DRAM
        and local copies, and wins over every put, promotion and write-back of the keys under way
        when it is called: once it returns, no
        copy they make appears (module docstring of :mod:`shoal.kv._index`), and a put called
        after it returns stores as usual."""
        self._check_open()
        _check_keys(keys, "remove")
        local = self._local

        def unlink(digest: str) -> bool:  # inside the index transaction: no index call here
            was = self._pool.exists(digest)
            self._pool.unlink(digest)
            if local is not None:
                was = local.unlink(digest) or was
            return was

        found: set[str] = set()
        for start in range(0, len(keys), TXN_KEYS):
            part = list(dict.fromkeys(k.digest for k in keys[start : start + TXN_KEYS]))
            found |= self._pool.index.remove(part, unlink)
        removed = 0
        for key in dict.fromkeys(keys):
            was = key.digest in found
            if self._shared is not None:
                was = self._shared.delete(key.digest) or was
            if was:
                removed += 1
                self._emit("removed", key.digest, "all", 0)
        return removed

    def pin(self, keys: Sequence[BlockKey], lease_s: float | None = None) -> Lease:
        """Keep ``keys`` from being evicted (on every process of the host) until :meth:`unpin`, the
        lease's expiry (``lease_s``, default ``KVConfig.lease_s``) or this process's death."""
        self._check_open()
        _check_keys(keys, "pin")
        seconds = self.config.lease_s if lease_s is None else lease_s
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
            raise ConfigError(f"KVStore.pin: lease_s must be positive seconds, got {lease_s!r}")
        lease = Lease(secrets.token_hex(8), tuple(keys), time.time() + seconds, tuple(k.digest for k in keys))
        self._pool.index.add_lease(lease.lease_id, list(dict.fromkeys(lease.digests)), lease.expires_at)
        return lease

    def unpin(self, lease: Lease) -> None:
        """End a lease (idempotent)."""
        self._check_open()
        self._pool.index.drop_lease(lease.lease_id)

    # -- events, stats, lifecycle -----------------------------------------------------------

    def add_listener(self, fn: Callable[[KVEvent], None]) -> None:
        """Call ``fn(event)`` for every event this store sees (module docstring)."""
        self._listeners.append(fn)

    def _remember(self, key: BlockKey) -> None:
        keys = self._keys
        keys[key.digest] = key
        if len(keys) > _KEY_MEMORY:
            keys.popitem(last=False)

    def _emit(self, kind: str, digest: str, tier: str, nbytes: int) -> None:
        if kind == "written_back":
            self._counters[tier].add(bytes_written=nbytes)
        if not self._listeners:
            return
        self._notify(KVEvent(kind, self._keys.get(digest), tier, nbytes, time.monotonic(), digest))  # type: ignore[arg-type]

    def _notify(self, event: KVEvent) -> None:
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the store
                log.exception("KV store listener %r failed on %s", fn, event)

    def stats(self) -> KVStats:
        """Per tier: blocks and physical bytes (host-wide), capacity, and this store's traffic."""
        pool_blocks, pool_bytes, local_blocks, local_bytes = self._pool.index.usage()
        contents: dict[str, tuple[int | None, int | None, int | None]] = {
            DRAM: (pool_blocks, pool_bytes, self.config.dram_bytes)
        }
        if self._local is not None:
            contents[LOCAL] = (local_blocks, local_bytes, self.config.local_bytes)
        if self._shared is not None:
            contents[SHARED] = (None, None, None)
        tiers = {}
        for name, (blocks, used, cap) in contents.items():
            tiers[name] = TierStats(blocks, used, cap, *self._counters[name].snapshot())
        return KVStats(tiers, self._writeback.pending(), self._corrupt, self._pool.index.longest_write_s)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until this store's pending write-backs and promotions landed."""
        if not self._writeback.flush(timeout):
            raise BoundaryTimeout(
                f"KVStore.flush: {self._writeback.pending()} write-back jobs still pending after {timeout} s"
            )

    def close(self) -> None:
        """Finish pending write-backs, stop the threads, close the index (idempotent)."""
        if self._closed:
            return
        self._writeback.close()
        self._closed = True
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
        self._pool.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"KVStore on {self._pool.root} is closed; open a new one")

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tiers = [DRAM] + [t.name for t in self._lower]
        return f"KVStore({self._pool.root!r}, tiers={tiers})"


def _check_keys(keys: object, call: str) -> None:
    """Refuse anything but a sequence of :class:`BlockKey` (naming the first bad one)."""
    if isinstance(keys, str | bytes | bytearray) or not isinstance(keys, Sequence):
        raise ConfigError(f"KVStore.{call}: keys must be a list of BlockKey, got a {type(keys).__name__}")
    for i, key in enumerate(keys):
        if not isinstance(key, BlockKey):
            raise ConfigError(
                f"KVStore.{call}: key {i} is a {type(key).__name__} ({key!r:.80}), not a BlockKey; "
                "build keys with shoal.kv.chain_keys (or use shoal.kv.MooncakeStore for string keys)"
            )


def _check_deadline(deadline: object) -> None:
    """A deadline is None or a finite, non-negative ``time.monotonic()`` instant."""
    if deadline is None:
        return
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        raise ConfigError(
            f"KVStore.get_batch_into: deadline must be a time.monotonic() instant in seconds or None, "
            f"got a {type(deadline).__name__} ({deadline!r:.80})"
        )
    if not math.isfinite(deadline) or deadline < 0:
        raise ConfigError(
            f"KVStore.get_batch_into: deadline must be a finite time.monotonic() instant, got {deadline!r}; "
            "pass None for no deadline"
        )


def _copy_fetched(fut: Future[tuple[memoryview, str] | None], key: BlockKey, view: memoryview) -> str | None:
    """A finished shared-tier fetch (verified there) into the caller's buffer, and the digest it
    was verified against; None if absent."""
    found = fut.result()
    if found is None:
        return None
    payload, checked = found
    if payload.nbytes != view.nbytes:
        raise BufferSizeError(
            f"block {key.digest} on the shared tier is {payload.nbytes} bytes, the buffer is "
            f"{view.nbytes} bytes; pass a buffer of the block's size",
            payload.nbytes,
        )
    view[:] = payload
    return checked
