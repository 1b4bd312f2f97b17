"""The store's plain data: its configuration, per-key results, events, statistics and leases.

Re-exported by :mod:`shoal.kv.store` (the names of the contract live there); kept apart so that
the pool and the lower tiers can use them without importing the store.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shoal.errors import ConfigError, ShoalError
from shoal.kv.keys import BlockKey

DRAM = "dram"
LOCAL = "local"
SHARED = "shared"
TIERS = (DRAM, LOCAL, SHARED)

GetStatus = Literal["hit", "miss", "error"]
MissReason = Literal["absent", "deadline", "corrupt"]
EventKind = Literal["stored", "evicted", "written_back", "corrupt", "removed", "fetched"]


@dataclass(frozen=True)
class KVConfig:
    """Where a :class:`~shoal.kv.store.KVStore` keeps blocks and how much of each tier it may use."""

    dram_root: str
    """A directory on tmpfs (``/dev/shm/...``): the host pool, shared by this user's processes."""
    dram_bytes: int
    """The pool's capacity in physical bytes (page-rounded block files, headers included)."""
    local_root: str | None = None
    """The host's NVMe tier (a private directory); None: no local tier."""
    local_bytes: int | None = None
    """The local tier's capacity in physical bytes; None: unbounded."""
    shared_url: str | None = None
    """The shared tier (an fsspec URL such as ``s3://bucket/kv``, or a directory); None: none."""
    storage_options: Mapping[str, Any] | None = None
    """fsspec options of the shared tier (endpoint, credentials)."""
    eviction: str = "lru"
    """The pool's eviction policy; ``"lru"`` (least recently put or read first) is the one there is."""
    writeback: bool = True
    """A block evicted from DRAM is written to the next tier (local, else shared) in the background."""
    high_water: float = 0.9
    """Background eviction starts when the pool is fuller than this fraction of ``dram_bytes``."""
    lease_s: float = 30.0
    """The default length of a :meth:`~shoal.kv.store.KVStore.pin` lease in seconds."""
    shared_lookup: str = "ask"
    """How ``lookup_prefix`` and ``contains`` learn what the shared tier holds beyond the host's
    tiers. ``"ask"``: they ask it (one round trip for a request's new tail; finds blocks any host
    stored there). ``"host"``: the host's index answers alone, from the blocks this host's stores
    wrote to the shared tier (no round trip on the lookup path; blocks other hosts stored, or
    stored before the index was rebuilt, are not found). Reads of a key asked for are the same."""

    def __post_init__(self) -> None:
        if not isinstance(self.dram_root, str) or not self.dram_root:
            raise ConfigError(f"KVConfig.dram_root must be a directory path, got {self.dram_root!r}")
        for name in ("dram_bytes", "local_bytes"):
            value = getattr(self, name)
            if value is None and name == "local_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVConfig.{name} must be a positive number of bytes, got {value!r}")
        if self.eviction != "lru":
            raise ConfigError(
                f"KVConfig.eviction must be 'lru' (the one policy there is), got {self.eviction!r}"
            )
        if not 0.0 < self.high_water <= 1.0:
            raise ConfigError(f"KVConfig.high_water must be in (0, 1], got {self.high_water!r}")
        if not self.lease_s > 0:
            raise ConfigError(f"KVConfig.lease_s must be positive seconds, got {self.lease_s!r}")
        if self.shared_lookup not in ("ask", "host"):
            raise ConfigError(f"KVConfig.shared_lookup must be 'ask' or 'host', got {self.shared_lookup!r}")


class BlockSizeError(ConfigError):
    """A buffer given to ``get_batch_into`` is not the stored block's size (``block_bytes``)."""

    def __init__(self, message: str, block_bytes: int | None = None) -> None:
        super().__init__(message)
        self.block_bytes = block_bytes


@dataclass(frozen=True)
class GetResult:
    """What :meth:`~shoal.kv.store.KVStore.get_batch_into` did for one key."""

    key: BlockKey
    status: GetStatus
    """``hit``: the buffer holds the verified block; ``miss``: recompute it; ``error``: see ``error``."""
    tier: str | None = None
    """Where the bytes came from, on a hit (``dram``, ``local``, ``shared``)."""
    nbytes: int = 0
    """Bytes placed in the buffer (0 unless a hit)."""
    error: ShoalError | None = None
    """Why, for ``error`` (a wrong buffer size, a tier that failed)."""
    reason: MissReason | None = None
    """For a miss: ``absent`` (no tier has it), ``deadline`` (not in time), ``corrupt`` (only bad copies)."""
    payload_digest: str | None = None
    """On a hit: the BLAKE3 (hex) the bytes in the buffer were verified against (from every
    tier, a peer host and a grouped read's arrival), so that a caller passing them on need not
    hash them again (the fabric path's server, a grouped read's reader)."""

    @property
    def hit(self) -> bool:
        """Whether the buffer holds the block."""
        return self.status == "hit"


@dataclass(frozen=True)
class PutResult:
    """What :meth:`~shoal.kv.store.KVStore.put_batch` did for one key."""

    key: BlockKey
    stored: bool
    """True when this call stored the block; False when it was there already (or an error)."""
    tier: str | None = None
    """The tier it was stored in (or found in, when already present)."""
    error: ShoalError | None = None


@dataclass(frozen=True)
class KVEvent:
    """One thing that happened to a block, given to every listener of the store that saw it.

    ``fetched`` is the one event of a whole call, not of a block: one per ``get_batch_into``, with
    ``key`` None and ``digest`` empty, ``tier`` the lowest tier the call had to ask (``dram`` when
    the pool had every block), ``nbytes`` the bytes it hit and ``seconds`` how long it took.
    """

    kind: EventKind
    key: BlockKey | None
    """The key; None when the pool evicted a block it knows only by digest (another process put it)."""
    tier: str
    nbytes: int
    at: float
    """``time.monotonic()`` when it happened."""
    digest: str = ""
    """The key digest (always set, also when ``key`` is None; empty for ``fetched``)."""
    seconds: float = 0.0
    """``fetched``: the call's duration (``time.monotonic()``); 0 for the other kinds."""


@dataclass(frozen=True)
class TierStats:
    """One tier's numbers: contents (host-wide for dram/local) and this store's traffic."""

    blocks: int | None
    """Blocks held (host-wide); None where the tier is not counted (shared: never listed)."""
    bytes_used: int | None
    """Physical bytes (page-rounded files) for dram and local; None for shared."""
    capacity: int | None
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass(frozen=True)
class KVStats:
    """:meth:`~shoal.kv.store.KVStore.stats`: one :class:`TierStats` per configured tier."""

    tiers: Mapping[str, TierStats]
    pending_writebacks: int = 0
    corrupt: int = 0
    longest_index_write_s: float = 0.0
    """The longest this store (its calls and its background jobs) held the host index's write lock
    in one transaction, in seconds: what another process's put or remove may have waited for it."""


@dataclass(frozen=True)
class Lease:
    """A pin on some blocks (:meth:`~shoal.kv.store.KVStore.pin`): none is evicted until it is
    unpinned, it expires, or its owner process dies."""

    lease_id: str
    keys: tuple[BlockKey, ...]
    expires_at: float
    """Wall-clock (``time.time()``) expiry, comparable across the host's processes."""
    digests: tuple[str, ...] = field(default=(), repr=False)


class TrafficCounters:
    """A store's traffic on one tier (what :class:`TierStats` reports). Bumped by the caller's
    threads and the write-back thread (promotions, evictions), so every change holds the lock."""

    __slots__ = ("_lock", "bytes_read", "bytes_written", "hits", "misses")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = self.misses = self.bytes_read = self.bytes_written = 0

    def add(self, *, hits: int = 0, misses: int = 0, bytes_read: int = 0, bytes_written: int = 0) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written

    def snapshot(self) -> tuple[int, int, int, int]:
        with self._lock:
            return self.hits, self.misses, self.bytes_read, self.bytes_written
