"""Scenarios for the emulated cluster, run with :meth:`shoal.testing.cluster.hosts.Cluster.run_ranks`.

Each function runs on every rank of a gloo job whose hosts are network namespaces
(:mod:`shoal.testing.cluster.hosts`): the host comes from ``SHOAL_HOST_ID`` and ``SHOAL_CLUSTER_HOST``,
shared storage is ``s3://<bucket>/root`` on the cluster's S3 (``SHOAL_S3_ENDPOINT``), reached over
the host's own storage NIC. The namespaces share one file system, so each host keeps its tiers
under its own directories: ``<dram_root>/h<i>`` and ``<local_root>/h<i>``
(:func:`host_tier_roots`). Arguments and results are plain JSON.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.records.events import WriterRecord, read_events
from shoal.testing.checkpoints import assert_state_equal, zeros_like_state
from shoal.testing.s3 import S3Admin, s3_storage_options

__all__ = [
    "JOB",
    "all_reduce_placement",
    "cluster_config",
    "cluster_state",
    "host_tier_roots",
    "restore_state",
    "save_state",
    "shared_objects",
    "sleep_or_fail",
]

JOB = "cluster"
CHUNK = 256 << 10
"""Chunk size of the cluster scenarios: a few MiB of state spans enough chunks to balance."""
DRAIN_PACK = 1 << 20
"""Drain pack size of the cluster scenarios. moto handles an upload only once its whole body has
arrived (about 0.1 s per 10 MiB here, one object at a time), so the last packs of a drain leave
the storage link idle while it does. With the emulated cluster's scaled-down rates and states
(a few MiB per rank), the default 16 MiB would make each rank's share one pack, all finishing
together; 1 MiB packs keep that tail short (4 hosts x 2 ranks, 48 MiB a save: 0.76 of the
aggregate link with 2 MiB packs, 0.91 with 1 MiB; docs/benchmarks.md)."""


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"${name} is not set: run this scenario inside the emulated cluster (Cluster.run_ranks)"
        )
    return value


def host_tier_roots(dram_root: str, local_root: str, host: int) -> tuple[str, str]:
    """Host ``host``'s DRAM and local tier roots (the namespaces share one file system)."""
    return os.path.join(dram_root, f"h{host}"), os.path.join(local_root, f"h{host}")


def cluster_config(*, bucket: str, dram_root: str, local_root: str, **overrides: Any) -> Config:
    """Every rank's config: shared on the cluster's S3, this host's own DRAM and local roots."""
    dram, local = host_tier_roots(dram_root, local_root, int(_env("SHOAL_CLUSTER_HOST")))
    kwargs: dict[str, Any] = {
        "shared": f"s3://{bucket}/root",
        "storage_options": s3_storage_options(_env("SHOAL_S3_ENDPOINT")),
        "dram": dram,
        "local": local,
        "job": JOB,
        "chunk_size": CHUNK,
        "drain_pack_bytes": DRAIN_PACK,
        "keep_last": None,
        "path": "partner",
        "collective_timeout": 60.0,
    }
    kwargs.update(overrides)
    return Config(**kwargs)


def cluster_state(rank: int, *, model_mib: int = 6, shard_mib: float = 1.5) -> dict[str, Any]:
    """Data-parallel parameters (identical on every rank, ``model_mib`` MiB in six tensors) plus
    this rank's own optimizer shard (``shard_mib`` MiB): the same bytes on every call."""
    g = torch.Generator().manual_seed(1234)
    per_tensor = (model_mib << 20) // 6 // 4
    model = {f"layer{i}.weight": torch.randn(per_tensor, generator=g) for i in range(6)}
    g_rank = torch.Generator().manual_seed(10_000 + rank)
    shard = torch.randn(int(shard_mib * (1 << 20)) // 4, generator=g_rank)
    return {"model": model, "optim": {f"shard{rank}.exp_avg": shard}}


def shared_objects(bucket: str) -> dict[str, int]:
    """Every object in ``bucket`` and its size, as the S3 server reports them."""
    admin = S3Admin(_env("SHOAL_S3_ENDPOINT"))
    try:
        sizes: dict[str, int] = {}
        for page in admin.client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            sizes.update({obj["Key"]: int(obj["Size"]) for obj in page.get("Contents", [])})
        return sizes
    finally:
        admin.close()


def save_state(
    rank: int, world: int, *, bucket: str, dram_root: str, local_root: str, step: int = 1
) -> dict[str, Any]:
    """Save :func:`cluster_state` through S3 to B4; report what this rank wrote to the shared tier.

    Rank 0 creates the bucket first. Returns the rank's host, the handle's outcome, every ``write``
    event of this rank on the shared tier (``what``, ``path``, ``bytes``), the bytes it sent to its
    partner (``replicate`` events), the new bytes of the coordinator's plan (``planned``, rank 0
    only) and on rank 0 every object on S3 with its size after B4.
    """
    if rank == 0:
        admin = S3Admin(_env("SHOAL_S3_ENDPOINT"))
        try:
            admin.create_bucket(bucket)
        finally:
            admin.close()
    dist.barrier()
    cfg = cluster_config(bucket=bucket, dram_root=dram_root, local_root=local_root)
    with Checkpointer(cfg) as ckpt:
        handle = ckpt.save(step, cluster_state(rank))
        handle.wait(Boundary.RESTARTABLE, timeout=60)
        ckpt.wait()
        event_log = ckpt.config.event_log
    if event_log is None:
        raise RuntimeError("the checkpointer resolved no event log path")
    events = [
        e
        for e in read_events(event_log, kinds=("write", "replicate", "planned"))
        if e.rank == rank and e.step == step
    ]
    out: dict[str, Any] = {
        "rank": rank,
        "host": _env("SHOAL_HOST_ID"),
        "reached": None if handle.reached is None else int(handle.reached),
        "writes": [
            {"what": e.what, "path": e.path, "bytes": e.bytes}
            for e in events
            if isinstance(e, WriterRecord) and e.tier == "shared"
        ],
        "replicated": sum(int(e.get("sent_bytes", 0)) for e in events if e.event == "replicate"),
        "planned_new_bytes": [int(e.get("new_bytes", -1)) for e in events if e.event == "planned"],
    }
    dist.barrier()  # every rank's save and close are done before the listing
    if rank == 0:
        out["objects"] = shared_objects(bucket)
    return out


def restore_state(
    rank: int, world: int, *, bucket: str, dram_root: str, local_root: str, step: int = 1
) -> dict[str, Any]:
    """Load the newest checkpoint into zeros and compare it bit for bit with :func:`cluster_state`."""
    cfg = cluster_config(bucket=bucket, dram_root=dram_root, local_root=local_root)
    expected = cluster_state(rank)
    target = zeros_like_state(expected)
    with Checkpointer(cfg) as ckpt:
        loaded = ckpt.load(target)
        report = ckpt.last_load
    assert_state_equal(target, expected)
    if loaded != step:
        raise AssertionError(f"rank {rank} loaded step {loaded}, expected {step}")
    return {
        "rank": rank,
        "host": _env("SHOAL_HOST_ID"),
        "loaded": loaded,
        "bytes_by_tier": {} if report is None else dict(report.bytes_by_tier),
        "fabric_bytes": 0 if report is None else report.fabric_bytes,
        "committed": None if report is None else report.committed,
    }


def all_reduce_placement(rank: int, world: int) -> dict[str, Any]:
    """Where this rank runs (host, the interface gloo binds, its CPUs) and the sum of all ranks over gloo."""
    total = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world": world,
        "host": _env("SHOAL_HOST_ID"),
        "cluster_host": int(_env("SHOAL_CLUSTER_HOST")),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "sum": int(total.item()),
    }


def sleep_or_fail(rank: int, world: int, *, bad_rank: int | None = None, sleep: float = 600.0) -> None:
    """``bad_rank`` raises at once; every other rank sleeps ``sleep`` seconds (the harness's failure
    and timeout paths: a rank that fails while the others go on, ranks that never finish).

    Every rank first passes a barrier, so the job is fully formed when ``bad_rank`` fails: a rank
    that leaves while a peer is still joining makes that peer fail too (its connection to the
    leaver breaks), and the harness's "the others are killed" path would not be the one tested."""
    dist.barrier()
    if rank == bad_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    time.sleep(sleep)
