"""Helpers of the KV store tests, and module-level worker functions for ``multiprocessing`` (spawn).

Block contents are derived from the block's index with a seeded generator, so every process can
compute what a block must hold without being sent it.
"""

from __future__ import annotations

import os
import random
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from shoal import failpoints
from shoal.kv import BlockKey, KVConfig, KVStore, chain_keys
from shoal.kv.pool import BLOCKS_DIR, physical_bytes

NS = "test-model/bf16-L2-H2-D64-B16"
BLOCK = 16 << 10
"""Default test block size: 16 KiB (physical 20 KiB with the header and page rounding)."""
PHYS = physical_bytes(BLOCK)


def keys(n: int, *, seq: int = 0, rank: int = 0) -> list[BlockKey]:
    """``n`` chained keys of sequence ``seq``."""
    return chain_keys(NS, rank, [f"seq{seq}"] + list(range(n - 1))) if n else []


def payload(index: int, size: int = BLOCK) -> bytes:
    """The bytes block ``index`` holds in these tests."""
    return random.Random(index).randbytes(size)


def pool_files(dram_root: str | Path) -> list[Path]:
    return sorted((Path(dram_root) / BLOCKS_DIR).iterdir())


def disk_bytes(dram_root: str | Path) -> int:
    """Physical bytes of every file in the pool directory now (page-rounded allocations)."""
    total = 0
    for path in pool_files(dram_root):
        try:
            total += path.stat().st_blocks * 512
        except FileNotFoundError:
            continue
    return total


def flip_byte(path: str | Path, offset: int) -> None:
    """Corrupt one byte of a file in place (as a bad DIMM or disk would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# -- workers (run in spawned processes) -------------------------------------------------------


def put_and_get_worker(
    config: KVConfig, worker: int, n_own: int, n_common: int, n_workers: int, barrier: Barrier, results: Any
) -> None:
    """Put this worker's blocks and the common ones, wait for all, then read everyone's back.

    Puts on ``results`` (a queue) its counts: hits, bit-exact hits, misses, errors, and the
    largest pool usage seen.
    """
    own = keys(n_own, seq=100 + worker)
    common = keys(n_common, seq=1)
    out = {"hits": 0, "exact": 0, "misses": 0, "errors": 0, "max_used": 0, "put_errors": 0}
    with KVStore(config) as store:
        for rnd in range(2):
            batch = own + common if rnd == 0 else common + own
            data = [payload(1000 * (100 + worker) + i) for i in range(n_own)] + [
                payload(i) for i in range(n_common)
            ]
            if rnd == 1:
                data = data[n_own:] + data[:n_own]
            out["put_errors"] += sum(r.error is not None for r in store.put_batch(batch, data))
            out["max_used"] = max(out["max_used"], store.stats().tiers["dram"].bytes_used or 0)
        barrier.wait(timeout=60)
        for w in range(n_workers):
            ks = keys(n_own, seq=100 + w)
            bufs = [bytearray(BLOCK) for _ in ks]
            for i, r in enumerate(store.get_batch_into(ks, bufs)):
                _count(out, r.status, bufs[i] == payload(1000 * (100 + w) + i))
        bufs = [bytearray(BLOCK) for _ in common]
        for i, r in enumerate(store.get_batch_into(common, bufs)):
            _count(out, r.status, bufs[i] == payload(i))
        out["max_used"] = max(out["max_used"], store.stats().tiers["dram"].bytes_used or 0)
        store.flush(60)
    results.put(out)


def _count(out: dict[str, Any], status: str, exact: bool) -> None:
    if status == "hit":
        out["hits"] += 1
        out["exact"] += int(exact)
    elif status == "miss":
        out["misses"] += 1
    else:
        out["errors"] += 1


def killed_mid_put_worker(config: KVConfig, index: int) -> None:
    """Put one block with the pool's rename failpoint set to SIGKILL this process."""
    failpoints.configure(f"{failpoints_name()}=kill")
    with KVStore(config) as store:
        store.put_batch(keys(index + 1)[index:], [payload(index)])
    os._exit(3)  # not reached: the failpoint kills the process before the rename


def failpoints_name() -> str:
    from shoal.kv.pool import FP_BEFORE_RENAME

    return FP_BEFORE_RENAME


def pin_and_die_worker(config: KVConfig, n: int) -> None:
    """Pin the first ``n`` test keys for an hour, then exit without unpinning."""
    store = KVStore(config)
    store.pin(keys(n), lease_s=3600)
    os._exit(0)
