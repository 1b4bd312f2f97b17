"""Rank functions for the grouped-read tests (run by shoal.testing.multiproc.run_ranks, spawned).

Each rank opens a real :class:`~shoal.kv.store.KVStore` on its simulated host (``$SHOAL_HOST_ID``):
the host's DRAM pool under ``<root>/<host>/dram`` and the instance's shared tier ``<root>/shared``,
then makes the grouped reads it is told to and reports, per key, what it got and whether the bytes
are the block's (checked against :func:`block_bytes`, the ground truth), plus its counters.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import blake3

from shoal.group.fabric import Fabric
from shoal.kv._results import GetResult, KVConfig
from shoal.kv.blockfile import encode_header
from shoal.kv.grouped import GroupedReader
from shoal.kv.keys import BlockKey
from shoal.kv.lower import SharedBlocks
from shoal.kv.store import KVStore

NAMESPACE = "test-model/bf16-L2-H2-D64-B16"


def block_key(i: int) -> BlockKey:
    """The key of test block ``i``."""
    return BlockKey(NAMESPACE, 0, blake3.blake3(f"block {i}".encode()).digest())


def block_size(i: int) -> int:
    return (16 << 10) * (1 + i % 4)


def block_bytes(i: int) -> bytes:
    """The ground truth: block ``i``'s bytes."""
    return blake3.blake3(f"payload {i}".encode()).digest(length=block_size(i))


def config(root: str, host: str) -> KVConfig:
    return KVConfig(
        dram_root=os.path.join(root, host, "dram"), dram_bytes=64 << 20, shared_url=f"{root}/shared"
    )


def seed_shared(root: str, blocks: Iterable[int]) -> None:
    """Write blocks straight to the shared tier (around the store), in the block file format."""
    tier = SharedBlocks(f"{root}/shared")
    for i in blocks:
        d, payload = block_key(i).digest, block_bytes(i)
        tier.write(d, encode_header(d, payload), memoryview(payload))


def corrupt_shared(root: str, i: int) -> None:
    """Flip the last payload byte of block ``i``'s shared-tier file."""
    d = block_key(i).digest
    path = os.path.join(root, "shared", d[:2], d)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def seed_dram(root: str, host: str, blocks: Iterable[int]) -> None:
    """Put blocks into ``host``'s DRAM pool with a store of its own (the pool outlives it)."""
    idx = list(blocks)
    with KVStore(config(root, host)) as store:
        results = store.put_batch([block_key(i) for i in idx], [block_bytes(i) for i in idx])
        assert all(r.error is None for r in results), results
        store.flush()


class TamperingFabric(Fabric):
    """A fabric whose sends carry a copy with one byte flipped: a block damaged in transit."""

    def post_sends(self, sends: Sequence[tuple[int, Iterable[memoryview]]]) -> list[Any]:
        bad = []
        for dst, views in sends:
            copies = []
            for v in views:
                c = bytearray(v)
                c[len(c) // 2] ^= 0x01
                copies.append(memoryview(c))
            bad.append((dst, copies))
        self._keep = bad  # alive until the works complete
        return super().post_sends(bad)


def _outcome(results: Sequence[GetResult], wanted: Sequence[int], buffers: Sequence[bytearray]) -> list[Any]:
    out = []
    for i, res, buf in zip(wanted, results, buffers, strict=True):
        exact = res.hit and bytes(buf) == block_bytes(i)
        out.append(
            (i, res.status, res.reason, res.tier, exact, type(res.error).__name__ if res.error else None)
        )
    return out


def grouped_batches(
    rank: int,
    world_size: int,
    *,
    root: str,
    batches: Sequence[Sequence[Sequence[int]]],
    past_deadline: Sequence[Sequence[int]] = (),
    tamper_rank: int | None = None,
) -> dict[str, Any]:
    """Run ``batches[b][rank]`` (the blocks this rank wants in batch ``b``) as grouped reads.

    ``past_deadline[b]`` lists the ranks that pass an already expired deadline in batch ``b``;
    ``tamper_rank`` is a rank whose sends are damaged in transit. Returns per batch the outcome
    of each key and this rank's sources, plus the store's shared-tier hits and bytes and the
    reader's counters.
    """
    host = os.environ["SHOAL_HOST_ID"]
    fabric = Fabric.create(timeout=60)
    if tamper_rank == rank:
        fabric = TamperingFabric(fabric.group, fabric.rank, fabric.world_size)
    outcomes = []
    with KVStore(config(root, host)) as store:
        reader = GroupedReader(store, fabric)
        for b, wants in enumerate(batches):
            wanted = list(wants[rank])
            buffers = [bytearray(block_size(i)) for i in wanted]
            late = b < len(past_deadline) and rank in past_deadline[b]
            deadline = time.monotonic() - 1.0 if late else time.monotonic() + 60.0
            results = reader.get_batch_into([block_key(i) for i in wanted], buffers, deadline=deadline)
            outcomes.append({"results": _outcome(results, wanted, buffers), "sources": reader.last_sources()})
        store.flush()
        shared = store.stats().tiers["shared"]
        return {
            "host": host,
            "batches": outcomes,
            "shared_hits": shared.hits,
            "shared_bytes": shared.bytes_read,
            "stats": reader.stats(),
        }
