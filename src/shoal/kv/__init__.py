"""``shoal.kv``: the KV-cache block store (docs/design.md section 12; docs/kv.md).

Blocks keyed by :class:`BlockKey` (namespace, tensor-parallel rank, chained prefix hash) live in a
host DRAM pool shared by the host's processes, then on local disk, then on shared storage;
:class:`KVStore` is the batch-first API, :class:`GroupedReader` its collective read across the ranks
of one serving instance, :class:`MooncakeStore` a facade with Mooncake Store's method names.
"""

from __future__ import annotations

from shoal.kv.grouped import GroupedReader, GroupedStats
from shoal.kv.keys import BlockKey, chain_keys, namespace_for
from shoal.kv.mooncake import MooncakeStore
from shoal.kv.store import (
    DRAM,
    LOCAL,
    SHARED,
    BlockSizeError,
    GetResult,
    KVConfig,
    KVEvent,
    KVStats,
    KVStore,
    Lease,
    PutResult,
    TierStats,
)

__all__ = [
    "DRAM",
    "LOCAL",
    "SHARED",
    "BlockKey",
    "BlockSizeError",
    "GetResult",
    "GroupedReader",
    "GroupedStats",
    "KVConfig",
    "KVEvent",
    "KVStats",
    "KVStore",
    "Lease",
    "MooncakeStore",
    "PutResult",
    "TierStats",
    "chain_keys",
    "namespace_for",
]
