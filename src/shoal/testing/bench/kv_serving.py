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

import functools
import os
import queue
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import blake3

from shoal.errors import ConfigError, MissingFile, ShoalError
from shoal.kv import DRAM, SHARED, BlockKey, KVConfig, KVEvent, KVStore, chain_keys, namespace_for
from shoal.kv.pool import physical_bytes
from shoal.testing.bench.kv_trace import BLOCK_TOKENS, TraceRequest, account, load_trace, window
from shoal.tiers import Tier, open_tier

__all__ = [
    "ABLATIONS",
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
    "STORAGE_WRITE_THREADS",
    "ServingConfig",
    "ShoalFallback",
    "TwoLevelPolicy",
    "make_policy",
    "replay_instance",
    "scaled_link_mbit",
    "serve_requests",
    "summarize",
]

ABLATIONS = {
    "shoal-no-local": "local",
    "shoal-no-batch": "batch",
    "shoal-no-fabric": "fabric",
    "shoal-no-grouped": "grouped",
}
"""shoal with one mechanism off: its local tier, batched reads, the fabric path to other hosts,
grouped reads across an instance's TP ranks."""
FIRST_LEVEL_POLICIES = ("recompute", "storage", "shoal", *ABLATIONS)
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
STORAGE_WRITE_THREADS = 4
"""Concurrent object writes of the ``storage`` policy's write-back (:class:`PerObjectStorage`)."""
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
    tp: int = 1
    """Ranks per serving instance (tensor parallel); each rank needs every block of its requests
    (the KV block is replicated across the instance's ranks: docs/kv_replay.md)."""
    fabric_mbit: float | None = None
    """The fabric link's shaped rate (mbit/s here), for the peer fetches' link use; None: unshaped."""
    peer_timeout_s: float = 2.0
    """The longest a fetch from a peer host may take before its blocks are misses."""
    record_digests: bool = False
    """Each request's record carries the BLAKE3 of the bytes it fetched (tests: TP ranks agree)."""

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

    @property
    def off(self) -> str | None:
        """The mechanism this ablation of shoal switches off (:data:`ABLATIONS`), or None."""
        return ABLATIONS.get(self.policy)

    @property
    def is_shoal(self) -> bool:
        return self.policy == "shoal" or self.policy in ABLATIONS

    def on_host(self, host: str) -> ServingConfig:
        """This config with the host's own roots: each host has its own pool and local tier."""
        from dataclasses import replace

        def under(path: str | None) -> str | None:
            return None if path is None else os.path.join(path, host)

        return replace(self, dram_root=os.path.join(self.dram_root, host), local_root=under(self.local_root))


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

    def kept(self, keys: Sequence[BlockKey]) -> None:
        """The first level kept ``keys`` (on the writer thread): shoal tells the other hosts."""
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

    def kept(self, keys: Sequence[BlockKey]) -> None:
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
    offloading to SSD in DFS", github.com/kvcache-ai/Mooncake/issues/578). The RFC says a put
    "only submit[s] a persistence request to the thread pool" once the block is in memory, and a
    get is a synchronous read. Here: each evicted block is one object on the shared storage
    (:class:`shoal.tiers.Tier`, one write per block), written by a pool of ``write_threads``
    threads, so that ``write_threads`` objects are in flight at once and the writer thread only
    waits when ``write_threads x 4`` blocks are queued (memory is bounded); on a first-level miss
    the request's next blocks are read one per key, in order, until the first that is not there
    (a block still being written is read once its write has ended). No batching, no local tier, no DRAM of
    its own. (:mod:`shoal.kv.mooncake` maps Mooncake's method names onto shoal's store; it has no
    storage offload of its own to follow.)"""

    def __init__(self, tier: Tier, block_bytes: int, write_threads: int = STORAGE_WRITE_THREADS) -> None:
        if isinstance(write_threads, bool) or not isinstance(write_threads, int) or write_threads < 1:
            raise ConfigError(f"PerObjectStorage: write_threads must be an int >= 1, got {write_threads!r}")
        self.tier = tier
        self.block_bytes = block_bytes
        self.lookup_s = 0.0
        self._there: set[str] = set()
        """Digests this instance wrote, is writing or read there: an evicted block known to be
        stored is not written again (another instance's copy may be: an object written twice is
        the same bytes)."""
        self.counts = {"reads": 0, "writes": 0, "misses": 0, "wrong": 0, "errors": 0, "write_errors": 0}
        self._lock = threading.Lock()
        self._room = threading.BoundedSemaphore(write_threads * 4)
        self._pool = ThreadPoolExecutor(write_threads, thread_name_prefix="kv-replay-storage-put")
        self._writing: dict[str, Future[None]] = {}
        """The blocks being written, by digest: a read of one waits for its write to end."""

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        tiers: list[str] = []
        for key in keys:
            with self._lock:
                writing = self._writing.get(key.digest)
            if writing is not None:  # evicted, not stored yet: read once it is (on the request path)
                wait([writing])
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
            with self._lock:
                self._there.add(key.digest)
            tiers.append(SHARED)
        return tiers

    def write_back(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> None:
        for key, data in zip(keys, blocks, strict=True):
            with self._lock:
                if key.digest in self._there:
                    continue
                self._there.add(key.digest)
            self._room.acquire()  # bounded: the writer thread waits when the pool is this far behind
            try:
                future = self._pool.submit(self._put, key.digest, data)
            except BaseException:
                self._room.release()
                raise
            with self._lock:
                self._writing[key.digest] = future
            future.add_done_callback(functools.partial(self._done, key.digest))

    def _done(self, digest: str, done: Future[None]) -> None:
        with self._lock:
            if self._writing.get(digest) is done:  # not a later write of the same block
                del self._writing[digest]

    def drain(self) -> None:
        """Wait for the writes in flight (tests; :meth:`close` waits too)."""
        with self._lock:
            pending = list(self._writing.values())
        wait(pending)

    def _put(self, digest: str, data: bytes) -> None:
        try:
            self.tier.write(digest, data)
        except (ShoalError, OSError):  # not stored: a later request recomputes it
            with self._lock:
                self.counts["write_errors"] += 1
                self._there.discard(digest)
        else:
            with self._lock:
                self.counts["writes"] += 1
        finally:
            self._room.release()

    def kept(self, keys: Sequence[BlockKey]) -> None:
        return None

    def warm(self) -> None:
        self.tier.exists(_WARM)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.counts)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.tier.close()


class ShoalFallback:
    """Policy ``shoal``'s fallback: shoal's store below the first level. A :class:`shoal.kv.KVStore`
    whose pool is a small DRAM staging area (``staging_blocks``, shared by the host's instances):
    an evicted block is put there by one ``put_batch`` and written back to the local tier by the
    store's background thread (the local tier, when bounded, spills to the shared tier); on a
    first-level miss the rest of the prefix is found by one lookup and read by one batch
    (staging, local, then the shared tier in parallel threads, every block verified). Blocks
    served from the staging area are reported as tier ``staging``.

    With :meth:`attach_peers` (several hosts), the fabric path sits between the local and the
    shared tier (:class:`shoal.kv.peers.PeeredStore`): blocks other hosts announced are fetched
    from them, verified on arrival; the blocks this host's first level keeps are announced.
    With ``grouped`` (TP > 1) the instance's ranks read each block once between them
    (:class:`shoal.kv.GroupedReader`) and the bytes reach the other ranks over the fabric.
    ``batched=False`` (the ``shoal-no-batch`` ablation): one lookup and one read per block, in
    order, until the first miss. ``agree``: the instance's agreement on a count (its ranks must
    make the same grouped reads)."""

    def __init__(
        self,
        store: KVStore,
        block_bytes: int,
        *,
        batched: bool = True,
        local: bool = True,
        agree: Any = None,
    ) -> None:
        self.store_ = store
        self.block_bytes = block_bytes
        self.batched = batched
        self.local = local
        self.agree = agree or (lambda n: n)
        self.peers: Any = None
        self.peered: Any = None
        self.grouped: Any = None
        self._buffers: list[bytearray] = []
        self.lookup_s = 0.0
        self.counts = {"wrong": 0, "errors": 0, "put_errors": 0, "grouped_calls": 0}
        self._shared_written: list[str] = []
        self._lock = threading.Lock()
        store.add_listener(self._on_event)

    def attach_peers(self, client: Any) -> None:
        from shoal.kv.peers import PeeredStore

        self.peers = client
        self.peered = PeeredStore(self.store_, client)

    def attach_grouped(self, fabric: Any, host: str) -> None:
        from shoal.kv import GroupedReader

        self.grouped = GroupedReader(self.peered or self.store_, fabric, host=host)

    def _on_event(self, event: KVEvent) -> None:
        if event.kind == "written_back" and event.tier == SHARED and self.peers is not None:
            with self._lock:
                self._shared_written.append(event.digest)

    def _read(self, keys: Sequence[BlockKey], bufs: Sequence[bytearray]) -> list[Any]:
        if self.grouped is not None:
            self.counts["grouped_calls"] += 1
            return list(self.grouped.get_batch_into(keys, bufs))
        return list((self.peered or self.store_).get_batch_into(keys, bufs))

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        t = time.monotonic()
        source = self.peered or self.store_
        if self.batched:
            k = source.lookup_prefix(keys)
        else:  # one lookup per block, as a per-key fallback asks
            k = 0
            while k < len(keys) and source.lookup_prefix(keys[k : k + 1]) == 1:
                k += 1
        if self.grouped is not None and not self.batched:
            # one grouped read per block: the ranks must make as many calls; in one batch they
            # need not want the same keys (the grouped read reads their union once), and the
            # policy agrees on what was found afterwards: one all-gather fewer per request
            k = self.agree(k)
        self.lookup_s = time.monotonic() - t
        while len(self._buffers) < k:
            self._buffers.append(bytearray(self.block_bytes))
        if self.batched:
            results = self._read(keys[:k], self._buffers[:k])
        else:
            results = []
            for i in range(k):
                r = self._read(keys[i : i + 1], self._buffers[i : i + 1])[0]
                results.append(r)
                if r.status != "hit":
                    break
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

    def kept(self, keys: Sequence[BlockKey]) -> None:
        """The first level kept ``keys``: the other hosts learn that this host holds them."""
        if self.peers is not None:
            self.peers.announce("have", [k.digest for k in keys])
            with self._lock:
                shared, self._shared_written = self._shared_written, []
            if shared:
                self.peers.announce("shared", shared)

    def write_back(self, keys: Sequence[BlockKey], blocks: Sequence[bytes]) -> None:
        for r in self.store_.put_batch(keys, blocks):
            self.counts["put_errors"] += r.error is not None
        if self.peers is not None and not self.local:
            # no local tier: the evicted blocks pass through the staging area to the shared tier
            self.peers.announce("gone", [k.digest for k in keys])

    def warm(self) -> None:
        # A get of an absent key reaches every tier, the shared one included (a lookup with
        # shared_lookup="host" would not): the S3 client's session is built here, not on a request.
        self.store_.get_batch_into([BlockKey("warm-up", 0, b"\0" * 32)], [bytearray(self.block_bytes)])

    def stats(self) -> dict[str, Any]:
        s = self.store_.stats()
        out: dict[str, Any] = {**self.counts, "tiers": {name: asdict(t) for name, t in s.tiers.items()}}
        if self.peers is not None:
            out["peers"] = asdict(self.peers.stats)
        if self.grouped is not None:
            out["grouped"] = asdict(self.grouped.stats())
        return out

    def close(self) -> None:
        if self.peered is not None:
            self.peered.close()
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
        agree: Any = None,
    ) -> None:
        self.first = first
        self.below = below
        self.base = base
        self.agree = agree or (lambda n: n)
        """The instance's agreement on a count (TP > 1: the smallest over its ranks)."""
        self.record_digests = False
        self.last_digest: str | None = None
        self._keys: dict[str, BlockKey] = dict(keys or {})
        self._first_hits = 0
        self.lookup_s = 0.0
        self.counts = {"unknown_evicted": 0}

    def fetch(self, keys: Sequence[BlockKey]) -> list[str]:
        for key in keys:
            self._keys.setdefault(key.digest, key)
        k = self.agree(self.first.fetch(keys))
        tiers = [DRAM] * k
        self.lookup_s = self.first.lookup_s
        n = 0
        if k < len(keys):
            below = self.below.fetch(keys[k:])
            n = self.agree(len(below))
            tiers += below[:n]
            self.lookup_s += self.below.lookup_s
        if self.record_digests:
            h = blake3.blake3()
            for buf in [*self.first._buffers[:k], *getattr(self.below, "_buffers", [])[:n]]:
                h.update(buf)
            self.last_digest = h.hexdigest()
        return tiers

    def to_store(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> Sequence[BlockKey]:
        k = 0
        while k < len(tiers) and tiers[k] == DRAM:
            k += 1
        return keys[k:]

    def store(self, keys: Sequence[BlockKey]) -> None:
        evicted, not_kept = self.first.keep(keys, [block_bytes_for(key, self.base) for key in keys])
        missing = {k.digest for k in not_kept}
        self.below.kept([k for k in keys if k.digest not in missing])
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


def make_policy(
    cfg: ServingConfig, instances: int, keys: Mapping[str, BlockKey] | None = None, agree: Any = None
) -> Policy:
    """The policy of ``cfg`` for one instance of ``instances`` on this host (``cfg``'s roots are
    the host's: :meth:`ServingConfig.on_host`).

    ``recompute``, ``storage`` and ``shoal`` get the same :class:`FirstLevel` (the host's pool at
    ``dram_root``, ``dram_blocks`` blocks) and differ only in the :class:`Fallback` below it;
    ``keys``: every block of the replay by digest (:class:`TwoLevelPolicy`). The private LRU of
    ``private-lru+perkey`` gets ``dram_blocks // instances`` blocks, so that the host's instances
    use the same DRAM in all as the one shared pool of ``dram_blocks``. ``agree``: the instance's
    agreement on a count (:meth:`~shoal.testing.bench.kv_instance.Instance.agree`; TP > 1).
    shoal's ablations (:data:`ABLATIONS`) are made here when they are a store's setting (no
    local tier, reads one block at a time); the fabric path and grouped reads are attached by
    :func:`replay_instance`, which knows the hosts and the instance."""
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
        local = cfg.off != "local"
        kv = KVConfig(
            dram_root=cfg.staging_root,
            dram_bytes=cfg.staging_blocks * phys,
            local_root=cfg.local_root if local else None,
            local_bytes=None if cfg.local_blocks is None else cfg.local_blocks * phys,
            shared_url=cfg.shared_url,
            storage_options=options,
            high_water=_STAGING_HIGH_WATER,
            shared_lookup=cfg.shared_lookup,
        )
        below = ShoalFallback(
            KVStore(kv), cfg.block_bytes, batched=cfg.off != "batch", local=local, agree=agree
        )
    try:
        first = FirstLevel(cfg.dram_root, cfg.dram_blocks, cfg.block_bytes, cfg.high_water)
    except BaseException:
        below.close()
        raise
    return TwoLevelPolicy(first, below, base, keys, agree)


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

    def submit(self, keys: Sequence[BlockKey]) -> float:
        """Hand over a request's new blocks; waits (in the instance's time line) when the queue is
        full. Returns the seconds it waited: the write-back's back-pressure on the request path."""
        if not keys:
            return 0.0
        t = time.monotonic()
        if not self.overlap:
            self._put(keys)
        else:
            self._jobs.put(keys)
        waited = time.monotonic() - t
        self.waited += waited
        return waited

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
        **({"digest": getattr(policy, "last_digest", None)} if cfg.record_digests else {}),
    }


def serve_requests(
    requests: Sequence[TraceRequest],
    policy: Policy,
    cfg: ServingConfig,
    t0: float,
    origin_ms: int,
    *,
    leader: bool = True,
) -> dict[str, Any]:
    """Serve ``requests`` (this instance's share) in arrival order: the trace's instant
    ``origin_ms`` is the monotonic instant ``t0``. The records are in seconds of this machine
    (:func:`summarize` scales them back to the trace's clock). Only the instance's ``leader``
    stores (its other TP ranks fetch with it, the blocks they keep are the same); each record's
    ``writer_wait`` is what handing its blocks to the writer cost the instance."""
    writer = _Writer(policy, cfg.overlap_puts and leader)
    records = []
    try:
        for req in requests:
            arrival = t0 + (req.timestamp_ms - origin_ms) / 1000.0 / cfg.speedup
            time.sleep(max(0.0, arrival - time.monotonic()))
            keys = chain_keys(cfg.namespace, 0, req.hash_ids)
            record = serve_request(req, keys, policy, cfg, arrival)
            records.append(record)
            new = policy.to_store(keys, record.pop("tiers"))
            record["writer_wait"] = writer.submit(new) if leader else 0.0
    finally:
        writer.finish()
    return {
        "records": records,
        "put_seconds": writer.put_seconds,
        "writer_waited": writer.waited,
        "policy": policy.stats(),
    }


def replay_instance(rank: int, world: int, *, config: Mapping[str, Any]) -> dict[str, Any]:
    """The scenario of one rank: TP rank ``rank % tp`` of serving instance ``rank // tp``, which
    serves requests ``i, i + instances, ...`` of the trace window (round-robin over the
    instances, host-major). Every rank loads the trace itself, builds its policy on its host's
    roots; the job forms its instances and, for shoal on several hosts, its fabric path
    (:mod:`shoal.testing.bench.kv_instance`); then the ranks agree on the start instant (rank 0's
    clock plus ``start_delay_s``, broadcast; the monotonic clock is the machine's, the same in
    every namespace) and replay. Returns :func:`serve_requests`' dict."""
    import torch.distributed as dist

    from shoal.testing.bench.kv_instance import form, start_peers

    cfg = ServingConfig(**config)
    inst = form(rank, world, cfg.tp)
    cfg = cfg.on_host(inst.host)
    if cfg.s3 and cfg.shared_url is not None:
        from shoal.testing.bench.cluster_save import prepare_bucket

        prepare_bucket(rank, cfg.shared_url.removeprefix("s3://").split("/", 1)[0])
    reqs = window(load_trace(cfg.trace, block_tokens=cfg.block_tokens), cfg.minutes)
    mine = reqs[inst.index :: inst.instances]
    keys = {k.digest: k for r in reqs for k in chain_keys(cfg.namespace, 0, r.hash_ids)}
    per_host = sum(h == inst.host for h in inst.hosts) // cfg.tp
    policy = make_policy(cfg, per_host, keys, inst.agree)
    if isinstance(policy, TwoLevelPolicy):
        policy.record_digests = cfg.record_digests
    server = client = None
    try:
        below = getattr(policy, "below", None)
        peers_on = cfg.is_shoal and cfg.off != "fabric" and inst.multi_host
        if cfg.is_shoal and inst.multi_host:  # every rank takes part in the collective
            assert isinstance(policy, TwoLevelPolicy) and isinstance(below, ShoalFallback)
            server, client = start_peers(inst, [policy.first.store_, below.store_], cfg.peer_timeout_s)
            if peers_on:
                below.attach_peers(client)
        if cfg.is_shoal and inst.fabric is not None and cfg.off != "grouped":
            assert isinstance(below, ShoalFallback)
            below.attach_grouped(inst.fabric, inst.host)
        policy.warm()
        start = [time.monotonic() + cfg.start_delay_s]
        dist.broadcast_object_list(start, src=0)
        out = serve_requests(mine, policy, cfg, float(start[0]), reqs[0].timestamp_ms, leader=inst.leader)
        dist.barrier()
    finally:
        if server is not None:
            server.close()
        policy.close()
        if client is not None:
            client.close()
    out.update(rank=rank, host=inst.host, instance=inst.index, tp_rank=inst.tp_rank, leader=inst.leader)
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
    and at the model's full block size. An instance's requests are its leader's records (its
    other TP ranks fetch with it and agree on what was fetched). The write-back's back-pressure
    is each request's ``writer_wait`` (mean, p99); the fabric links' use is :func:`peer_link`'s."""
    leaders = [rank for rank in ranks if rank.get("leader", True)]
    records = [r for rank in leaders for r in rank["records"]]
    s = cfg.speedup
    ttft = [r["ttft"] * s for r in records]
    waits = [r.get("writer_wait", 0.0) * s for r in records]
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
        "put_seconds": sum(rank["put_seconds"] for rank in leaders) * s,
        "writer_waited": sum(rank["writer_waited"] for rank in leaders) * s,
        "writer_wait": {
            "mean": statistics.fmean(waits) if waits else 0.0,
            "p99": _percentile(waits, 0.99) if waits else 0.0,
        },
        "peer_link": peer_link(ranks, cfg),
        "policy_stats": [rank["policy"] for rank in ranks],
    }


LINK_FILL_S = 0.02
"""A busy period of a link counts towards its use when its bytes take at least this long at the
link's rate (a shorter one is mostly its round trip)."""


def _busy_periods(spans: Sequence[tuple[float, float, int]]) -> list[tuple[float, int]]:
    """The union of ``(start, end, bytes)`` spans: (seconds, bytes) per busy period."""
    out: list[tuple[float, int]] = []
    cur: list[float] | None = None  # start, end, bytes of the period being built
    for s, e, b in sorted(spans):
        if cur is not None and s <= cur[1]:
            cur[1], cur[2] = max(cur[1], e), cur[2] + b
            continue
        if cur is not None:
            out.append((cur[1] - cur[0], int(cur[2])))
        cur = [s, e, b]
    if cur is not None:
        out.append((cur[1] - cur[0], int(cur[2])))
    return out


def peer_link(ranks: Sequence[Mapping[str, Any]], cfg: ServingConfig) -> dict[str, Any]:
    """The peer fetches of every rank: blocks, bytes, requests, and the fabric links' use.

    Each fetch occupies its holder's link out and its receiver's link in (both shaped to
    ``cfg.fabric_mbit``), and several fetches may share a link at once. A link's busy periods are
    the union of its fetches' spans; those whose bytes take at least :data:`LINK_FILL_S` at the
    link's rate count. ``link_use_out`` / ``link_use_in``: over the holders' links out / the
    receivers' links in, the bytes of those periods over their seconds, over the rate;
    ``link_use``: the larger (the bottleneck side: two hosts reading from one fill its link out,
    not theirs in). ``per_fetch_use``: single fetches of that size, each on its own (lower when
    fetches share a link)."""
    fetches: list[tuple[str, str, int, float, float | None]] = []
    out: dict[str, Any] = {"requests": 0, "blocks": 0, "bytes": 0, "corrupt": 0, "failed": 0}
    for rank in ranks:
        below = rank.get("policy", {}).get("below", {})
        p = below.get("peers")
        if not p:
            continue
        for k in out:
            out[k] += p.get(k, 0)
        for f in p.get("fetches", []):
            started = float(f[3]) if len(f) > 3 else None  # files saved before spans were recorded
            fetches.append((str(f[0]), str(rank.get("host", "")), int(f[1]), float(f[2]), started))
    rate = None if cfg.fabric_mbit is None else cfg.fabric_mbit * 1e6 / 8
    out["fetches"] = len(fetches)
    if not rate or not fetches:
        return out
    fill = rate * LINK_FILL_S
    big = [(b, t) for _, _, b, t, _ in fetches if b >= fill and t > 0]
    out["large_fetches"] = len(big)
    if big:
        out["per_fetch_use"] = sum(b for b, _ in big) / sum(t for _, t in big) / rate
    links: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for holder, receiver, b, t, started in fetches:
        if started is not None:
            links.setdefault((holder, "out"), []).append((started, started + t, b))
            links.setdefault((receiver, "in"), []).append((started, started + t, b))
    out["busy_periods"] = 0
    for way in ("out", "in"):
        periods = [
            p for (_, w), spans in links.items() if w == way for p in _busy_periods(spans)
            if p[1] >= fill and p[0] > 0
        ]  # fmt: skip
        out["busy_periods"] += len(periods)
        if periods:
            out[f"link_use_{way}"] = sum(b for _, b in periods) / sum(t for t, _ in periods) / rate
    if "link_use_out" in out or "link_use_in" in out:
        # the fuller side is the bottleneck: two hosts reading from one fill its link out, not theirs in
        out["link_use"] = max(out.get("link_use_out", 0.0), out.get("link_use_in", 0.0))
    elif big and not links:
        out["link_use"] = out["per_fetch_use"]  # an old file: only single fetches were recorded
    return out
