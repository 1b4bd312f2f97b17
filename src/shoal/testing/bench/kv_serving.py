"""The serving simulator of the KV-cache trace replay (``benchmarks/kv_replay.py``, docs/kv_replay.md).

One serving instance per process; requests of a trace (:mod:`shoal.testing.bench.kv_trace`) go to the
instances round-robin and arrive on the trace's clock divided by ``speedup``. Each instance runs
its prefills one at a time, in arrival order. For one request (:func:`serve_request`):

1. **fetch**: the policy looks up the longest stored prefix of the request's chained block keys
   (:func:`shoal.kv.keys.chain_keys` over ``hash_ids``) and reads those blocks, real I/O, timed;
2. **prefill**: the rest costs ``uncached_tokens x per_token_s``, simulated by a sleep of that
   divided by ``speedup``;
3. the first token is out: TTFT = queue wait + fetch + prefill;
4. **store**: the request's new blocks are put. In a real engine that overlaps the next
   request's prefill, so it runs on the instance's writer thread, off the TTFT path; but it is in
   the instance's time line: at most :data:`MAX_PUTS_IN_FLIGHT` requests' blocks wait to be
   stored (they hold accelerator memory until then), beyond that the instance waits.

The policies implement :class:`Policy`. Three of them (``recompute``, ``storage``, ``shoal``) are one
:class:`FirstLevel` (the host's shared DRAM pool, identical in all three) composed by
:class:`TwoLevelPolicy` with a :class:`Fallback` below it (:class:`NothingBelow`,
:class:`PerObjectStorage`, :class:`ShoalFallback`): what the first level serves, touches and
stores is decided by the first level and the trace alone, never by the fallback, so the three
see the same first-level hits request by request (docs/kv_replay.md, "The policies"). Two more
are rows of their own: ``private-lru+perkey`` (:class:`PerKeyFallback`: a private LRU per
instance, then per-key reads, the replay's former ``perkey``) and ``nocache`` (:class:`NoCache`).
:func:`replay_instance` is the scenario one rank runs (under
:func:`shoal.testing.multiproc.run_ranks` on one machine, or
:meth:`shoal.testing.cluster.hosts.Cluster.run_ranks` in a host namespace of the emulated cluster);
it returns per-request records as JSON, which :func:`summarize` turns into the report.
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from shoal.errors import ConfigError, MissingFile, ShoalError
from shoal.kv import DRAM, SHARED, BlockKey, KVConfig, KVEvent, KVStore, chain_keys, namespace_for
from shoal.kv.pool import physical_bytes
from shoal.testing.bench.kv_trace import BLOCK_TOKENS, TraceRequest, account, load_trace, window
from shoal.tiers import Tier, open_tier

__all__ = [
    "FIRST_LEVEL_POLICIES",
    "MAX_PUTS_IN_FLIGHT",
    "POLICIES",
    "RENAMED",
    "Fallback",
    "FirstLevel",
    "ModelLayout",
    "NoCache",
    "NothingBelow",
    "PerKeyFallback",
    "PerObjectStorage",
    "Policy",
    "QWEN25_14B",
    "ServingConfig",
    "ShoalFallback",
    "TwoLevelPolicy",
    "make_policy",
    "replay_instance",
    "scaled_link_mbit",
    "serve_requests",
    "summarize",
]

FIRST_LEVEL_POLICIES = ("recompute", "storage", "shoal")
"""The policies that share one first level (:class:`FirstLevel`) and differ only below it."""
POLICIES = (*FIRST_LEVEL_POLICIES, "private-lru+perkey", "nocache")
RENAMED = {"perkey": "private-lru+perkey"}
"""Former policy names: refused with a message naming the new one (``recompute`` kept its name
but is now the first level with nothing below; the former no-cache row is ``nocache``)."""
_STAGING_HIGH_WATER = 0.5
"""shoal's staging area writes its blocks back once it is half full (it is a way down, not a cache)."""
STAGING = "staging"
"""The tier name of a block :class:`ShoalFallback` served from its DRAM staging area."""
MAX_PUTS_IN_FLIGHT = 4
"""Requests whose new blocks may wait for the writer thread before the instance itself waits."""
_CHECK = 32
_WARM = "warm-up-" + "0" * 56
"""The first bytes of a block are its key's prefix hash: a fetched block is checked to be the right one."""


@dataclass(frozen=True)
class ModelLayout:
    """A model's KV layout: the bytes of one block on one tensor-parallel rank."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int = BLOCK_TOKENS
    tp: int = 1

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer, all KV heads (one token, the whole instance)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """One block on one rank (the heads are split over ``tp`` ranks)."""
        return self.bytes_per_token * self.block_tokens // self.tp

    @property
    def namespace(self) -> str:
        layout = (
            f"bf{8 * self.dtype_bytes}-L{self.layers}-H{self.kv_heads}-D{self.head_dim}-B{self.block_tokens}"
        )
        return namespace_for(self.name, f"{layout}-TP{self.tp}")


QWEN25_14B = ModelLayout("qwen2.5-14b", layers=48, kv_heads=8, head_dim=128, dtype_bytes=2)
"""Qwen2.5-14B (config.json: 48 layers, 8 KV heads, head dim 128), bf16: 196,608 B/token, 96 MiB/block."""


@dataclass(frozen=True)
class ServingConfig:
    """What one replay of one policy needs (JSON-able: it travels to every rank)."""

    policy: str
    trace: str
    minutes: float
    speedup: float
    per_token_s: float
    block_bytes: int
    """Bytes of one block as stored here (the layout's, divided by the byte scale factor)."""
    dram_blocks: int
    namespace: str
    dram_root: str
    block_tokens: int = BLOCK_TOKENS
    """Tokens per block of the trace (one ``hash_ids`` entry each)."""
    local_root: str | None = None
    local_blocks: int | None = None
    shared_url: str | None = None
    s3: bool = False
    """The shared tier is the emulated cluster's S3 (its endpoint from ``SHOAL_S3_ENDPOINT``)."""
    high_water: float = 1.0
    shared_lookup: str = "ask"
    """shoal's ``KVConfig.shared_lookup``."""
    staging_blocks: int = 64
    """The DRAM staging area of shoal's fallback (:class:`ShoalFallback`), in blocks: evicted blocks
    wait there for their write-back to the local tier, reads from below pass through it."""
    overlap_puts: bool = True
    start_delay_s: float = 2.0

    def __post_init__(self) -> None:
        if self.policy in RENAMED:
            raise ConfigError(
                f"ServingConfig.policy {self.policy!r} is now {RENAMED[self.policy]!r} (a private LRU "
                f"per instance, then per-key reads); the per-key fallback under the shared first level "
                f"is 'storage'"
            )
        if self.policy not in POLICIES:
            raise ConfigError(f"ServingConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("speedup", "per_token_s", "minutes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ServingConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if (
            isinstance(self.block_tokens, bool)
            or not isinstance(self.block_tokens, int)
            or self.block_tokens < 1
        ):
            raise ConfigError(f"ServingConfig.block_tokens must be an int >= 1, got {self.block_tokens!r}")
        if (
            isinstance(self.staging_blocks, bool)
            or not isinstance(self.staging_blocks, int)
            or self.staging_blocks < 1
        ):
            raise ConfigError(
                f"ServingConfig.staging_blocks must be an int >= 1, got {self.staging_blocks!r}"
            )
        if self.block_bytes < _CHECK or self.dram_blocks < 0:
            raise ConfigError(
                f"ServingConfig: block_bytes must be >= {_CHECK} and dram_blocks >= 0, "
                f"got {self.block_bytes} and {self.dram_blocks}"
            )

    @property
    def staging_root(self) -> str:
        """Where shoal's fallback keeps its DRAM staging area (next to the first level's pool)."""
        return self.dram_root.rstrip("/") + "-staging"


def scaled_link_mbit(full_scale_gbps: float, speedup: float, byte_scale: float) -> float:
    """The ``tc`` rate (mbit/s here) of a link that moves ``full_scale_gbps`` GB/s at full scale.

    The replay moves 1 / ``byte_scale`` of the bytes, ``speedup`` times faster than the trace's
    clock, and reads its times back multiplied by ``speedup``: a link of B bytes/s at full scale
    is B x speedup / byte_scale bytes/s here (docs/kv_replay.md, "What the two scale factors
    preserve")."""
    for name, v in (("full_scale_gbps", full_scale_gbps), ("speedup", speedup), ("byte_scale", byte_scale)):
        if not v > 0:
            raise ConfigError(f"scaled_link_mbit: {name} must be > 0, got {v!r}")
    return full_scale_gbps * 1e9 * speedup / byte_scale * 8 / 1e6


class Policy(Protocol):
    """How an instance finds and keeps KV blocks. Called by one instance's threads only."""

    lookup_s: float
    """Seconds the last :meth:`fetch` spent finding the prefix (0 where it is not a step of its own)."""

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        """Read the longest stored prefix of ``keys``; the tier each of its blocks came from."""
        ...

    def to_store(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> Sequence[BlockKey]:
        """Of a request's ``keys``, whose prefix came from ``tiers``, the blocks :meth:`store` gets."""
        ...

    def store(self, keys: Sequence[BlockKey]) -> None:
        """Keep the request's new blocks (called on the writer thread)."""
        ...

    def warm(self) -> None:
        """Connect to the storage before the replay starts (a server does it at start-up, not on
        its first request: an S3 client's first call builds its session, about a second here)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def block_bytes_for(key: BlockKey, base: bytes) -> bytes:
    """The block's stand-in bytes: its prefix hash, then a fixed pattern (the KV tensors' place)."""
    return key.prefix_hash + base[_CHECK:]


def _right_block(key: BlockKey, data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[:_CHECK]) == key.prefix_hash


def _not_fetched(keys: Sequence[BlockKey], tiers: Sequence[str]) -> Sequence[BlockKey]:
    return keys[len(tiers) :]


class NoCache:
    """Never fetches, never stores: every prefill computes the whole prompt (no first level)."""

    lookup_s = 0.0
    to_store = staticmethod(_not_fetched)

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        return []

    def store(self, keys: Sequence[BlockKey]) -> None:
        return None

    def warm(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


class PerKeyFallback:
    """Policy ``private-lru+perkey``: a private in-process LRU of ``dram_blocks`` blocks per
    instance (not the shared first level), then one read per block on the shared storage through
    :class:`shoal.tiers.Tier`, in order, until the first miss; every new block is written through
    to the storage, one by one. No batching, no local tier."""

    to_store = staticmethod(_not_fetched)

    def __init__(self, tier: Tier, dram_blocks: int, block_bytes: int, base: bytes) -> None:
        self.tier = tier
        self.base = base
        self.capacity = dram_blocks
        self.block_bytes = block_bytes
        self._lru: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.lookup_s = 0.0
        self.counts = {"reads": 0, "writes": 0, "misses": 0, "wrong": 0, "errors": 0, "write_errors": 0}

    def _keep(self, digest: str, data: bytes) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._lru[digest] = data
            self._lru.move_to_end(digest)
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        tiers: list[str] = []
        for key in keys:
            with self._lock:
                cached = self._lru.get(key.digest)
                if cached is not None:
                    self._lru.move_to_end(key.digest)
            if cached is not None:
                tiers.append(DRAM)
                continue
            try:
                data = self.tier.read(key.digest)
            except MissingFile:
                self.counts["misses"] += 1
                break
            except (ShoalError, OSError):  # the storage failed this read: recompute from here
                self.counts["errors"] += 1
                break
            self.counts["reads"] += 1
            if len(data) != self.block_bytes or not _right_block(key, data):
                self.counts["wrong"] += 1
                break
            self._keep(key.digest, data)
            tiers.append(SHARED)
        return tiers

    def store(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            data = block_bytes_for(key, self.base)
            self._keep(key.digest, data)
            try:
                self.tier.write(key.digest, data)
            except (ShoalError, OSError):  # not stored: a later request recomputes it
                self.counts["write_errors"] += 1
                continue
            self.counts["writes"] += 1

    def warm(self) -> None:
        self.tier.exists(_WARM)

    def stats(self) -> dict[str, Any]:
        return dict(self.counts)

    def close(self) -> None:
        self.tier.close()


class FirstLevel:
    """The first level every ``recompute`` / ``storage`` / ``shoal`` replay has: the host's DRAM
    pool (shoal's own, :class:`shoal.kv.KVStore` with no tier below it), shared by the host's
    instances (one ``dram_root``), of ``dram_blocks`` blocks, LRU. It is the level a serving
    system such as Mooncake keeps for itself; the fallbacks below it are what the policies compare.

    Its operations per request are fixed here, whatever is below it (:class:`TwoLevelPolicy`):
    :meth:`fetch` serves the longest prefix the pool holds (touched as one batch, head first);
    :meth:`keep` puts every other block of the request, fetched from below or recomputed, as one
    batch, after the request's prefill. Blocks are dropped only when a put needs their room; the
    evicted ones, and the ones that did not fit, are handed back so that a fallback can keep them.
    So the pool's contents and order follow the trace and the capacity alone
    (:func:`~shoal.testing.bench.kv_trace.simulate_lru` with ``backed=False`` is its exact model)."""

    def __init__(self, dram_root: str, dram_blocks: int, block_bytes: int, high_water: float = 1.0) -> None:
        phys = physical_bytes(block_bytes)
        self.block_bytes = block_bytes
        self.store_ = KVStore(
            KVConfig(dram_root=dram_root, dram_bytes=max(phys, dram_blocks * phys), high_water=high_water)
        )
        self._evicted: list[str] = []
        self._lock = threading.Lock()
        self.store_.add_listener(self._on_event)
        self._buffers: list[bytearray] = []
        self.lookup_s = 0.0
        """Seconds the last :meth:`fetch` spent finding the prefix (its reads not included)."""
        self.counts = {"wrong": 0, "errors": 0, "evicted": 0, "not_kept": 0}

    def _on_event(self, event: KVEvent) -> None:
        if event.kind == "evicted":
            with self._lock:
                self._evicted.append(event.digest)

    def fetch(self, keys: Sequence[BlockKey]) -> int:
        """How many blocks of ``keys``, from the first, the pool served (read and checked)."""
        t = time.monotonic()
        k = self.store_.lookup_prefix(keys)
        self.lookup_s = time.monotonic() - t
        while len(self._buffers) < k:
            self._buffers.append(bytearray(self.block_bytes))
        results = self.store_.get_batch_into(keys[:k], self._buffers[:k])
        n = 0
        for key, result, buf in zip(keys[:k], results, self._buffers, strict=False):
            if result.status != "hit":  # another instance's put evicted it since the lookup
                self.counts["errors"] += result.status == "error"
                break
            if not _right_block(key, buf):
                self.counts["wrong"] += 1
                break
            n += 1
        return n

    def keep(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> tuple[list[str], list[BlockKey]]:
        """Put ``blocks`` as one batch; the digests the pool evicted meanwhile (this process's
        puts evict inline, there is no tier to write back to) and the keys it could not hold."""
        not_kept = [r.key for r in self.store_.put_batch(keys, blocks) if r.error is not None]
        with self._lock:
            evicted, self._evicted = self._evicted, []
        self.counts["evicted"] += len(evicted)
        self.counts["not_kept"] += len(not_kept)
        return evicted, not_kept

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "dram": asdict(self.store_.stats().tiers[DRAM])}

    def close(self) -> None:
        self.store_.close()


class Fallback(Protocol):
    """What a :class:`TwoLevelPolicy` has below its :class:`FirstLevel`."""

    lookup_s: float

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        """Read the longest prefix of ``keys`` this level holds; the tier of each block."""
        ...

    def write_back(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> None:
        """Keep blocks the first level evicted (or could not hold); on the writer thread."""
        ...

    def warm(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class NothingBelow:
    """Policy ``recompute``'s fallback: none. A block the first level evicted is recomputed."""

    lookup_s = 0.0

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        return []

    def write_back(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> None:
        return None

    def warm(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


class PerObjectStorage:
    """Policy ``storage``'s fallback: the plain storage fallback of a serving system's own KV pool.

    It follows Mooncake Store's description of its storage offload: an object that would be
    evicted from memory is persisted to the storage, and a get that finds no memory replica falls
    back to reading it from there (Mooncake's "SSD Offload Design",
    kvcache-ai.github.io/Mooncake/design/ssd-offload.html); on a shared file system each object is
    one file named by its key, a get is a synchronous read of that file (Mooncake RFC "KVCache
    offloading to SSD in DFS", github.com/kvcache-ai/Mooncake/issues/578). Here: each evicted
    block is written to the shared storage as one object (:class:`shoal.tiers.Tier`, one write
    per block, on the writer thread); on a first-level miss the request's next blocks are read
    one per key, in order, until the first that is not there. No batching, no local tier, no
    DRAM of its own. (:mod:`shoal.kv.mooncake` maps Mooncake's method names onto shoal's store;
    it has no storage offload of its own to follow.)"""

    def __init__(self, tier: Tier, block_bytes: int) -> None:
        self.tier = tier
        self.block_bytes = block_bytes
        self.lookup_s = 0.0
        self._there: set[str] = set()
        """Digests this instance wrote or read there: an evicted block known to be stored is not
        written again (another instance's copy may be: an object written twice is the same bytes)."""
        self.counts = {"reads": 0, "writes": 0, "misses": 0, "wrong": 0, "errors": 0, "write_errors": 0}

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        tiers: list[str] = []
        for key in keys:
            try:
                data = self.tier.read(key.digest)
            except MissingFile:
                self.counts["misses"] += 1
                break
            except (ShoalError, OSError):  # the storage failed this read: recompute from here
                self.counts["errors"] += 1
                break
            self.counts["reads"] += 1
            if len(data) != self.block_bytes or not _right_block(key, data):
                self.counts["wrong"] += 1
                break
            self._there.add(key.digest)
            tiers.append(SHARED)
        return tiers

    def write_back(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> None:
        for key, data in zip(keys, blocks, strict=True):
            if key.digest in self._there:
                continue
            try:
                self.tier.write(key.digest, data)
            except (ShoalError, OSError):  # not stored: a later request recomputes it
                self.counts["write_errors"] += 1
                continue
            self._there.add(key.digest)
            self.counts["writes"] += 1

    def warm(self) -> None:
        self.tier.exists(_WARM)

    def stats(self) -> dict[str, Any]:
        return dict(self.counts)

    def close(self) -> None:
        self.tier.close()


class ShoalFallback:
    """Policy ``shoal``'s fallback: shoal's store below the first level. A :class:`shoal.kv.KVStore`
    whose pool is a small DRAM staging area (``staging_blocks``, shared by the host's instances):
    an evicted block is put there by one ``put_batch`` and written back to the local tier by the
    store's background thread (the local tier, when bounded, spills to the shared tier); on a
    first-level miss the rest of the prefix is found by one ``lookup_prefix`` and read by one
    ``get_batch_into`` (staging, local, then the shared tier in parallel threads, every block
    verified). Blocks served from the staging area are reported as tier ``staging``."""

    def __init__(self, store: KVStore, block_bytes: int) -> None:
        self.store_ = store
        self.block_bytes = block_bytes
        self._buffers: list[bytearray] = []
        self.lookup_s = 0.0
        self.counts = {"wrong": 0, "errors": 0, "put_errors": 0}

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        t = time.monotonic()
        k = self.store_.lookup_prefix(keys)
        self.lookup_s = time.monotonic() - t
        while len(self._buffers) < k:
            self._buffers.append(bytearray(self.block_bytes))
        results = self.store_.get_batch_into(keys[:k], self._buffers[:k])
        tiers: list[str] = []
        for key, result, buf in zip(keys[:k], results, self._buffers, strict=False):
            if result.status != "hit" or result.tier is None:
                self.counts["errors"] += result.status == "error"
                break
            if not _right_block(key, buf):
                self.counts["wrong"] += 1
                break
            tiers.append(STAGING if result.tier == DRAM else result.tier)
        return tiers

    def write_back(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> None:
        for r in self.store_.put_batch(keys, blocks):
            self.counts["put_errors"] += r.error is not None

    def warm(self) -> None:
        # A get of an absent key reaches every tier, the shared one included (a lookup with
        # shared_lookup="host" would not): the S3 client's session is built here, not on a request.
        self.store_.get_batch_into([BlockKey("warm-up", 0, b"\0" * 32)], [bytearray(self.block_bytes)])

    def stats(self) -> dict[str, Any]:
        s = self.store_.stats()
        return {**self.counts, "tiers": {name: asdict(t) for name, t in s.tiers.items()}}

    def close(self) -> None:
        self.store_.close()


class TwoLevelPolicy:
    """A :class:`FirstLevel` with a :class:`Fallback` below it: policies ``recompute``, ``storage``
    and ``shoal``. Per request: the first level serves its prefix; the fallback is asked for the
    blocks after it; every block the first level did not serve is then kept in the first level
    (:meth:`to_store`), and what the first level evicted goes to the fallback. The first level is
    never told what the fallback found, so its hits are the same under every fallback.

    ``keys``: the blocks of the whole replay by digest (every instance's), so that an evicted block
    that another instance put can be written back; blocks this policy sees are added to it."""

    def __init__(
        self,
        first: FirstLevel,
        below: Fallback,
        base: bytes,
        keys: Mapping[str, BlockKey] | None = None,
    ) -> None:
        self.first = first
        self.below = below
        self.base = base
        self._keys: dict[str, BlockKey] = dict(keys or {})
        self._first_hits = 0
        self.lookup_s = 0.0
        self.counts = {"unknown_evicted": 0}

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        for key in keys:
            self._keys.setdefault(key.digest, key)
        k = self.first.fetch(keys)
        tiers = [DRAM] * k
        self.lookup_s = self.first.lookup_s
        if k < len(keys):
            tiers += self.below.fetch(keys[k:])
            self.lookup_s += self.below.lookup_s
        return tiers

    def to_store(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> Sequence[BlockKey]:
        k = 0
        while k < len(tiers) and tiers[k] == DRAM:
            k += 1
        return keys[k:]

    def store(self, keys: Sequence[BlockKey]) -> None:
        evicted, not_kept = self.first.keep(keys, [block_bytes_for(key, self.base) for key in keys])
        down = list(not_kept)
        for digest in evicted:
            key = self._keys.get(digest)
            if key is None:
                self.counts["unknown_evicted"] += 1
                continue
            down.append(key)
        if down:
            self.below.write_back(down, [block_bytes_for(key, self.base) for key in down])

    def warm(self) -> None:
        self.below.warm()

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "first_level": self.first.stats(), "below": self.below.stats()}

    def close(self) -> None:
        try:
            self.below.close()
        finally:
            self.first.close()


def make_policy(cfg: ServingConfig, instances: int, keys: Mapping[str, BlockKey] | None = None) -> Policy:
    """The policy of ``cfg`` for one instance of ``instances`` on this host.

    ``recompute``, ``storage`` and ``shoal`` get the same :class:`FirstLevel` (the host's pool at
    ``dram_root``, ``dram_blocks`` blocks) and differ only in the :class:`Fallback` below it;
    ``keys``: every block of the replay by digest (:class:`TwoLevelPolicy`). The private LRU of
    ``private-lru+perkey`` gets ``dram_blocks // instances`` blocks, so that the host's instances
    use the same DRAM in all as the one shared pool of ``dram_blocks``."""
    base = os.urandom(cfg.block_bytes)
    options = None
    if cfg.s3:
        from shoal.testing.s3 import s3_storage_options

        options = s3_storage_options(os.environ["SHOAL_S3_ENDPOINT"])
    if cfg.policy == "nocache":
        return NoCache()
    if cfg.policy in ("private-lru+perkey", "storage") and cfg.shared_url is None:
        raise ConfigError(f"policy {cfg.policy!r} needs ServingConfig.shared_url (its storage)")
    if cfg.policy == "private-lru+perkey":
        assert cfg.shared_url is not None
        tier = open_tier("shared", cfg.shared_url, options)
        return PerKeyFallback(tier, cfg.dram_blocks // instances, cfg.block_bytes, base)
    below: Fallback
    if cfg.policy == "recompute":
        below = NothingBelow()
    elif cfg.policy == "storage":
        assert cfg.shared_url is not None
        below = PerObjectStorage(open_tier("shared", cfg.shared_url, options), cfg.block_bytes)
    else:
        phys = physical_bytes(cfg.block_bytes)
        kv = KVConfig(
            dram_root=cfg.staging_root,
            dram_bytes=cfg.staging_blocks * phys,
            local_root=cfg.local_root,
            local_bytes=None if cfg.local_blocks is None else cfg.local_blocks * phys,
            shared_url=cfg.shared_url,
            storage_options=options,
            high_water=_STAGING_HIGH_WATER,
            shared_lookup=cfg.shared_lookup,
        )
        below = ShoalFallback(KVStore(kv), cfg.block_bytes)
    try:
        first = FirstLevel(cfg.dram_root, cfg.dram_blocks, cfg.block_bytes, cfg.high_water)
    except BaseException:
        below.close()
        raise
    return TwoLevelPolicy(first, below, base, keys)


class _Writer:
    """An instance's writer thread: stores each request's new blocks after its first token."""

    def __init__(self, policy: Policy, overlap: bool) -> None:
        self.policy = policy
        self.overlap = overlap
        self._jobs: queue.Queue[Sequence[BlockKey] | None] = queue.Queue(maxsize=MAX_PUTS_IN_FLIGHT)
        self.put_seconds = 0.0
        self.waited = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-replay-writer", daemon=True)
        if overlap:
            self._thread.start()

    def submit(self, keys: Sequence[BlockKey]) -> None:
        """Hand over a request's new blocks; waits (in the instance's time line) when the queue is full."""
        if not keys:
            return
        if not self.overlap:
            self._put(keys)
            return
        t = time.monotonic()
        self._jobs.put(keys)
        self.waited += time.monotonic() - t

    def _put(self, keys: Sequence[BlockKey]) -> None:
        t = time.monotonic()
        self.policy.store(keys)
        self.put_seconds += time.monotonic() - t

    def _run(self) -> None:
        while (keys := self._jobs.get()) is not None:
            try:
                self._put(keys)
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self.error = e
                return

    def finish(self) -> None:
        if self.overlap:
            self._jobs.put(None)
            self._thread.join()
        if self.error is not None:
            raise ShoalError(f"the replay's writer thread failed: {self.error!r}") from self.error


def serve_request(
    req: TraceRequest, keys: Sequence[BlockKey], policy: Policy, cfg: ServingConfig, arrival: float
) -> dict[str, Any]:
    """One request on an instance that is free now (steps 1-3 of the module docstring); its record."""
    start = time.monotonic()
    tiers = policy.fetch(keys)
    fetched = time.monotonic()
    first_hits = 0
    while first_hits < len(tiers) and tiers[first_hits] == DRAM:
        first_hits += 1
    acct = account(req, tiers, block_tokens=cfg.block_tokens)
    time.sleep(acct.uncached_tokens * cfg.per_token_s / cfg.speedup)
    done = time.monotonic()
    return {
        "line": req.line,
        "arrival": arrival,
        "queue": start - arrival,
        "fetch": fetched - start,
        "lookup": policy.lookup_s,
        "prefill": done - fetched,
        "ttft": done - arrival,
        "blocks": acct.blocks,
        "fetched": acct.fetched,
        "recomputed": acct.recomputed,
        "uncached_tokens": acct.uncached_tokens,
        "first_level_hits": first_hits,
        "tiers": tiers,
    }


def serve_requests(
    requests: Sequence[TraceRequest], policy: Policy, cfg: ServingConfig, t0: float, origin_ms: int
) -> dict[str, Any]:
    """Serve ``requests`` (this instance's share) in arrival order: the trace's instant
    ``origin_ms`` is the monotonic instant ``t0``. The records are in seconds of this machine
    (:func:`summarize` scales them back to the trace's clock)."""
    writer = _Writer(policy, cfg.overlap_puts)
    records = []
    try:
        for req in requests:
            arrival = t0 + (req.timestamp_ms - origin_ms) / 1000.0 / cfg.speedup
            time.sleep(max(0.0, arrival - time.monotonic()))
            keys = chain_keys(cfg.namespace, 0, req.hash_ids)
            record = serve_request(req, keys, policy, cfg, arrival)
            records.append(record)
            writer.submit(policy.to_store(keys, record.pop("tiers")))
    finally:
        writer.finish()
    return {
        "records": records,
        "put_seconds": writer.put_seconds,
        "writer_waited": writer.waited,
        "policy": policy.stats(),
    }


def replay_instance(rank: int, world: int, *, config: Mapping[str, Any]) -> dict[str, Any]:
    """The scenario of one rank = one serving instance: requests ``rank, rank + world, ...`` of the
    trace window. Every rank loads the trace itself, builds its policy, then they agree on the
    start instant (rank 0's clock plus ``start_delay_s``, broadcast; the monotonic clock is the
    machine's, the same in every namespace) and replay. Returns :func:`serve_requests`' dict."""
    import torch.distributed as dist

    cfg = ServingConfig(**config)
    if cfg.s3 and cfg.shared_url is not None:
        from shoal.testing.bench.cluster_save import prepare_bucket

        prepare_bucket(rank, cfg.shared_url.removeprefix("s3://").split("/", 1)[0])
    reqs = window(load_trace(cfg.trace, block_tokens=cfg.block_tokens), cfg.minutes)
    mine = reqs[rank::world]
    keys = {k.digest: k for r in reqs for k in chain_keys(cfg.namespace, 0, r.hash_ids)}
    policy = make_policy(cfg, world, keys)
    try:
        policy.warm()
        start = [time.monotonic() + cfg.start_delay_s]
        dist.broadcast_object_list(start, src=0)
        out = serve_requests(mine, policy, cfg, float(start[0]), reqs[0].timestamp_ms)
        dist.barrier()
    finally:
        policy.close()
    out["rank"] = rank
    return out


def _percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` (nearest rank); NaN for no values."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


def summarize(
    ranks: Sequence[Mapping[str, Any]], cfg: ServingConfig, full_block_bytes: int
) -> dict[str, Any]:
    """One policy's report from its ranks' :func:`serve_requests` dicts: TTFT (trace seconds:
    measured x ``speedup``) mean/p50/p90/p99 and its parts, hit ratios per tier (blocks fetched
    from the tier / blocks asked for), blocks recomputed, and bytes read per tier, as stored here
    and at the model's full block size."""
    records = [r for rank in ranks for r in rank["records"]]
    s = cfg.speedup
    ttft = [r["ttft"] * s for r in records]
    blocks = sum(r["blocks"] for r in records)
    per_tier: dict[str, int] = {}
    for r in records:
        for tier, n in r["fetched"].items():
            per_tier[tier] = per_tier.get(tier, 0) + n
    recomputed = sum(r["recomputed"] for r in records)
    if blocks != recomputed + sum(per_tier.values()):
        raise ShoalError(
            f"replay accounting: {blocks} blocks but {recomputed} recomputed + {per_tier} fetched"
        )
    return {
        "policy": cfg.policy,
        "requests": len(records),
        "ttft": {
            "mean": statistics.fmean(ttft) if ttft else float("nan"),
            "p50": _percentile(ttft, 0.5),
            "p90": _percentile(ttft, 0.9),
            "p99": _percentile(ttft, 0.99),
        },
        "parts": {
            k: statistics.fmean(r.get(k, 0.0) * s for r in records) if records else 0.0
            for k in ("queue", "fetch", "lookup", "prefill")
        },
        "blocks": blocks,
        "hit_ratio": {t: n / blocks for t, n in sorted(per_tier.items())} if blocks else {},
        "recomputed_ratio": recomputed / blocks if blocks else 0.0,
        "bytes_read": {t: n * cfg.block_bytes for t, n in sorted(per_tier.items())},
        "bytes_read_full_scale": {t: n * full_block_bytes for t, n in sorted(per_tier.items())},
        "uncached_tokens": sum(r["uncached_tokens"] for r in records),
        "put_seconds": sum(rank["put_seconds"] for rank in ranks) * s,
        "writer_waited": sum(rank["writer_waited"] for rank in ranks) * s,
        "policy_stats": [rank["policy"] for rank in ranks],
    }
