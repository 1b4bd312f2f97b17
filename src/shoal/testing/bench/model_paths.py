"""The path experiment's job on the emulated cluster (``benchmarks/model_paths.py``): one policy, one regime.

Each rank of a :meth:`shoal.testing.cluster.hosts.Cluster.run_ranks` job builds
:func:`~shoal.testing.cluster.scenarios.cluster_state` (a small data-parallel model and this
rank's own optimizer shard) and saves it every ``interval`` seconds, as training does, through the
cluster's S3, with ``Config.path`` set to the policy under test (``direct``, ``partner`` or
``auto``: the completion-time model; ``auto-thread``: the same model with its updates in a thread
of the coordinator instead of a process of their own). Every tensor changes before each save, so
every chunk is new. The saves are on a fixed schedule (a save is called at its tick, or as soon as the one
before reached B4 when that was later: one checkpoint in flight at a time, so that no time to a
boundary includes waiting behind an earlier checkpoint): the exposure to rollback is that of a
job that checkpoints at a steady interval.

Every rank returns, per save: when it was called (the machine's monotonic clock, the same in
every namespace), its seconds to each boundary, the path taken and why; rank 0 also the
predictions and the cost of every ``path`` event its event log holds.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.engine.handle import SaveHandle
from shoal.engine.path import ModelPolicy
from shoal.records.events import read_events
from shoal.testing.bench.cluster_save import prepare_bucket
from shoal.testing.cluster.scenarios import cluster_config, cluster_state

__all__ = ["path_run"]

WAIT_S = 300.0


def path_run(
    rank: int,
    world: int,
    *,
    bucket: str,
    job: str,
    dram_root: str,
    local_root: str,
    path: str,
    saves: int,
    interval: float,
    model_mib: int,
    shard_mib: float,
    config: dict[str, Any] | None = None,
    events: bool = False,
) -> dict[str, Any]:
    """``saves`` saves every ``interval`` seconds with ``Config.path=path``; the times of each.

    ``events``: also return every event of this rank's host log (to see where a slow one went)."""
    prepare_bucket(rank, bucket)
    state = cluster_state(rank, model_mib=model_mib, shard_mib=shard_mib)
    # "auto-thread": the model policy with its updates in a thread of the coordinator (a comparison)
    policy = ModelPolicy(worker="thread") if path == "auto-thread" else None
    overrides = {"path": "auto" if policy else path, "job": job, "keep_last": 2, **(config or {})}
    cfg = cluster_config(bucket=bucket, dram_root=dram_root, local_root=local_root, **overrides)
    handles: list[tuple[int, float, SaveHandle]] = []
    with Checkpointer(cfg, path_policy=policy) as ckpt:
        dist.barrier()
        start = time.monotonic()
        for step in range(1, saves + 1):
            for group in state.values():
                for t in group.values():
                    t.add_(1.0)
            if handles and not handles[-1][2].skipped:  # one checkpoint at a time: no queue in the times
                handles[-1][2].wait(Boundary.RESTARTABLE, timeout=WAIT_S)
            dist.barrier()
            tick = start + (step - 1) * interval
            time.sleep(max(0.0, tick - time.monotonic()))
            saved = time.monotonic()
            handles.append((step, saved, ckpt.save(step, state)))
        for _, _, h in handles:
            if not h.skipped:
                h.wait(Boundary.RESTARTABLE, timeout=WAIT_S)
        end = time.monotonic()
        ckpt.wait()
        out: dict[str, Any] = {"rank": rank, "start": start, "end": end, "saves": []}
        for step, saved, h in handles:
            out["saves"].append(
                {
                    "step": step,
                    "saved": saved,
                    "skipped": h.skipped,
                    "times": {str(int(b)): s for b, s in h.times.items()},
                    "path": h.path,
                    "reason": h.path_reason,
                }
            )
        log = ckpt.config.event_log
        if events and log is not None:
            out["events"] = [dict(e.fields) for e in read_events(log) if e.rank == rank]
        if rank == 0 and log is not None:
            decided = read_events(log, kinds=("path",))
            out["predictions"] = {
                str(e.step): e.get("predictions") for e in decided if e.rank == 0 and e.get("predictions")
            }
            out["costs"] = {str(e.step): e.get("cost") for e in decided if e.rank == 0 and e.get("cost")}
    return out
