"""The completion-time model's fidelity sweep on the emulated cluster (``benchmarks/model_fidelity.py``).

:func:`drain_sweep` runs on every rank of a :meth:`shoal.testing.cluster.hosts.Cluster.run_ranks` job: it
saves ``saves + 1`` checkpoints of a state that is this rank's own (``shard_bytes`` of one tensor,
nothing another rank holds, so each rank drains exactly its own bytes) through the cluster's S3 on
the direct path, every tensor changed before each save (every chunk new, nothing deduplicated),
and returns its own ``write`` records of drain packs on the shared tier as plain dicts.

The pack size is chosen so that each rank's share goes out as exactly ``streams`` packs, all in
flight at once (:func:`pack_bytes_for`): every pack is then one writer of the model, the
checkpoint's writers are ``draining ranks x streams``, all concurrent, and the drain is done when
the slowest pack is. The first save is a warm-up (s3fs connections, slabs) and is not returned.

With ``probe_bytes``, rank 0 probes the tier just before each save: one object of that many
bytes written to the shared tier and timed (:func:`probe_tier`), then deleted after the save. Its
rate is what a job could learn of the tier's weather at the moment a checkpoint starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.format.chunking import MIN_CHUNK_SIZE
from shoal.records.events import WriterRecord, read_events
from shoal.testing.bench.cluster_save import prepare_bucket
from shoal.testing.cluster.scenarios import cluster_config

__all__ = ["CHUNK", "drain_sweep", "pack_bytes_for", "pack_records", "probe_tier"]

PROBE_PATH = "probe/object"

CHUNK = 64 << 10
"""Chunk size of the sweep: a rank's share of a few hundred KiB still cuts into ``streams`` packs."""
WAIT_S = 300.0


def pack_bytes_for(shard_bytes: int, streams: int, chunk: int = CHUNK) -> int:
    """``Config.drain_pack_bytes`` that cuts a share of ``shard_bytes`` into ``streams`` packs.

    :func:`shoal.records.packwriter.drain_parts` makes ``round(total / pack_bytes)`` parts (at most
    one per chunk), so the share divided by ``streams`` gives exactly ``streams`` parts as long as
    the share holds that many chunks.
    """
    if streams < 1 or shard_bytes < streams * chunk:
        raise ValueError(f"a share of {shard_bytes} bytes cannot make {streams} packs of chunks of {chunk}")
    return max(MIN_CHUNK_SIZE, shard_bytes // streams)


def pack_records(events: Iterable[Any], rank: int, steps: Iterable[int]) -> list[dict[str, Any]]:
    """This rank's drain-pack ``write`` records on the shared tier for ``steps``, as plain dicts.

    Each dict has the fields the model and its evaluation need: step, rank, host, bytes, start
    and end (the machine's monotonic clock, shared by the namespaces), concurrency and
    host_concurrency.
    """
    wanted = set(steps)
    return [
        {
            "step": e.step,
            "rank": e.rank,
            "host": e.host,
            "bytes": e.bytes,
            "start": e.start,
            "end": e.end,
            "concurrency": e.concurrency,
            "host_concurrency": e.host_concurrency,
        }
        for e in events
        if isinstance(e, WriterRecord)
        and e.rank == rank
        and e.what == "pack"
        and e.tier == "shared"
        and e.step in wanted
    ]


def probe_tier(tier: Any, payload: bytes, step: int) -> dict[str, Any]:
    """Write ``payload`` to ``tier`` once, timed: ``{"step", "bytes", "start", "end"}`` (monotonic)."""
    start = time.monotonic()
    tier.write(PROBE_PATH, payload)
    return {"step": step, "bytes": len(payload), "start": start, "end": time.monotonic()}


def _state(rank: int, shard_bytes: int) -> dict[str, Any]:
    """This rank's own state: one tensor of ``shard_bytes`` that no other rank holds."""
    g = torch.Generator().manual_seed(20_000 + rank)
    return {"optim": {f"shard{rank}.exp_avg": torch.randn(shard_bytes // 4, generator=g)}}


def drain_sweep(
    rank: int,
    world: int,
    *,
    bucket: str,
    dram_root: str,
    local_root: str,
    job: str,
    saves: int,
    shard_bytes: int,
    streams: int,
    pause_s: float = 0.0,
    probe_bytes: int = 0,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Save ``saves`` timed checkpoints (after one warm-up); return this rank's drain-pack records.

    ``pause_s`` is the compute between checkpoints (the tier's weather moves meanwhile);
    ``config`` overrides the sweep's settings. Returns ``{"rank", "records", "saves", "probes"}``
    (``probes``: rank 0's, see the module); each save waits for the checkpoint to be restartable
    (B4) before the next begins.
    """
    prepare_bucket(rank, bucket)
    state = _state(rank, shard_bytes)
    settings: dict[str, Any] = {
        "job": job,
        "path": "direct",
        "chunk_size": CHUNK,
        "drain_streams": streams,
        "drain_pack_bytes": pack_bytes_for(shard_bytes, streams),
        "keep_last": 2,
        **(config or {}),
    }
    cfg = cluster_config(bucket=bucket, dram_root=dram_root, local_root=local_root, **settings)
    payload = os.urandom(probe_bytes)
    probes: list[dict[str, Any]] = []
    with Checkpointer(cfg) as ckpt:
        for step in range(saves + 1):
            for t in state["optim"].values():
                t.add_(1.0)
            dist.barrier()
            if probe_bytes:
                if rank == 0:
                    probes.append(probe_tier(ckpt.shared, payload, step))
                dist.barrier()
            ckpt.save(step, state).wait(Boundary.RESTARTABLE, timeout=WAIT_S)
            if probe_bytes and rank == 0:
                ckpt.shared.delete(PROBE_PATH)
            if pause_s > 0:
                time.sleep(pause_s)
        ckpt.wait()
        event_log = ckpt.config.event_log
    if event_log is None:
        raise RuntimeError("the checkpointer resolved no event log path")
    records = pack_records(read_events(event_log, kinds=("write",)), rank, range(1, saves + 1))
    dist.barrier()
    return {"rank": rank, "records": records, "saves": saves, "probes": [p for p in probes if p["step"] >= 1]}
