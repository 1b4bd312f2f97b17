"""Benchmark scenarios for the emulated cluster (``benchmarks/cluster_save.py``), one contender each.

Each function runs on every rank of a :meth:`shoal.testing.cluster.hosts.Cluster.run_ranks` job, builds
:func:`~shoal.testing.cluster.scenarios.cluster_state` (a data-parallel model plus this rank's
optimizer shard), and saves it ``saves + 1`` times through the cluster's S3, each save after the
previous one finished; the first is a warm-up (shoal's slabs, s3fs's connections) and is not timed.
Before every save each tensor gets ``+ 1`` on all its elements (on every rank alike, so the model
stays replicated): every chunk is new, no save is shortened by deduplication.

Every rank returns its own numbers; rank 0 adds the CPU time the whole machine and the S3 server
spent during the timed saves (``/proc`` is shared by the namespaces), so the caller can tell the
CPU or moto from the links as the bottleneck.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from shoal._torch_private import FsspecWriter
from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.records.events import WriterRecord, read_events
from shoal.testing.cluster.scenarios import cluster_config, cluster_state
from shoal.testing.s3 import S3Admin, s3_storage_options

__all__ = ["CpuWindow", "async_save_bench", "cpu_seconds", "prepare_bucket", "dcp_save_bench", "shoal_bench"]

WAIT_S = 300.0


def cpu_seconds(pid: int | None = None) -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of process ``pid``), from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / tick
    proc = 0.0
    if pid is not None:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            proc = (int(rest[11]) + int(rest[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            proc = float("nan")
    return busy, proc


def _mutate(state: dict[str, Any]) -> None:
    for group in state.values():
        for t in group.values():
            t.add_(1.0)


def prepare_bucket(rank: int, bucket: str) -> None:
    """Rank 0 creates ``bucket`` on the cluster's S3 when it is not there yet; every rank waits for it."""
    if rank == 0:
        admin = S3Admin(os.environ["SHOAL_S3_ENDPOINT"])
        try:
            if bucket not in {b["Name"] for b in admin.client.list_buckets().get("Buckets", [])}:
                admin.create_bucket(bucket)
        finally:
            admin.close()
    dist.barrier()


def _prepare(rank: int, bucket: str, model_mib: int, shard_mib: float) -> dict[str, Any]:
    prepare_bucket(rank, bucket)
    return cluster_state(rank, model_mib=model_mib, shard_mib=shard_mib)


class CpuWindow:
    """Rank 0's wall and CPU clock (the machine's, and the S3 server's) between two barriers.

    ``start`` and ``stop`` are collective; ``stop`` adds ``window_s``, ``cpu_busy_s`` and
    ``moto_cpu_s`` to rank 0's result."""

    def __init__(self, rank: int, moto_pid: int | None) -> None:
        self.rank, self.moto_pid = rank, moto_pid
        self.t0 = 0.0
        self.cpu0 = (0.0, 0.0)

    def start(self) -> None:
        dist.barrier()
        self.t0 = time.perf_counter()
        self.cpu0 = cpu_seconds(self.moto_pid)

    def stop(self, out: dict[str, Any]) -> None:
        dist.barrier()
        if self.rank == 0:
            busy, moto = cpu_seconds(self.moto_pid)
            out["window_s"] = time.perf_counter() - self.t0
            out["cpu_busy_s"] = busy - self.cpu0[0]
            out["moto_cpu_s"] = moto - self.cpu0[1]


def _distinct(state: dict[str, Any], rank: int) -> None:
    """Make this rank's copy of the model its own: its names carry the rank (DCP then writes every
    rank's, as it does for anything not held under one name) and every chunk's bytes differ from
    every other rank's (nothing for shoal's content dedup either)."""
    state["model"] = {f"r{rank}.{k}": t.add_(float(rank) * 1e-3) for k, t in state["model"].items()}


def _pack_window(event_log: str | None, rank: int, steps: range) -> list[list[float] | None]:
    """Per step, ``[first start, last end, bytes]`` of this rank's drain packs (None: it drained none)."""
    if event_log is None:
        return [None for _ in steps]
    packs = [
        e
        for e in read_events(event_log, kinds=("write",))
        if isinstance(e, WriterRecord) and e.rank == rank and e.what == "pack" and e.tier == "shared"
    ]
    out: list[list[float] | None] = []
    for step in steps:
        mine = [e for e in packs if e.step == step]
        out.append(
            [min(e.start for e in mine), max(e.end for e in mine), sum(e.bytes for e in mine)]
            if mine
            else None
        )
    return out


def shoal_bench(
    rank: int,
    world: int,
    *,
    bucket: str,
    dram_root: str,
    local_root: str,
    saves: int,
    model_mib: int,
    shard_mib: float,
    moto_pid: int | None = None,
    config: dict[str, Any] | None = None,
    distinct_model: bool = False,
    blocking: bool = False,
) -> dict[str, Any]:
    """shoal: stall = until ``save`` returns (B1); B2/B3/B4 from the handle after it reached B4.

    ``config`` overrides :func:`~shoal.testing.cluster.scenarios.cluster_config`'s settings.
    The switches of the ablations: ``distinct_model`` gives every rank its own copy of the model
    under its own names (nothing to deduplicate: each rank writes its whole state, as a writer
    without dedup does);
    ``blocking`` counts the wait for B4 as stall (no staging: training waits for the write).
    Also returns each timed step's drain window (``packs``: this rank's first pack start, last
    pack end and pack bytes, on the machine's monotonic clock, the same in every namespace).
    """
    state = _prepare(rank, bucket, model_mib, shard_mib)
    if distinct_model:
        _distinct(state, rank)
    cfg = cluster_config(bucket=bucket, dram_root=dram_root, local_root=local_root, **(config or {}))
    out: dict[str, Any] = {"rank": rank, "stall": [], "times": []}
    window = CpuWindow(rank, moto_pid)
    with Checkpointer(cfg) as ckpt:
        for step in range(saves + 1):
            _mutate(state)
            if step == 1:
                window.start()
            else:
                dist.barrier()
            t0 = time.perf_counter()
            handle = ckpt.save(step, state)
            if blocking:
                handle.wait(Boundary.RESTARTABLE, timeout=WAIT_S)
            stall = time.perf_counter() - t0
            handle.wait(Boundary.RESTARTABLE, timeout=WAIT_S)
            if step == 0:
                continue
            out["stall"].append(stall)
            out["times"].append({str(int(b)): s for b, s in handle.times.items()})
        window.stop(out)
        ckpt.wait()
        out["packs"] = _pack_window(ckpt.config.event_log, rank, range(1, saves + 1))
    return out


def _writer(bucket: str, name: str) -> FsspecWriter:
    opts = s3_storage_options(os.environ["SHOAL_S3_ENDPOINT"])
    return FsspecWriter(f"s3://{bucket}/{name}", **opts)


def _dcp_bench(
    rank: int,
    bucket: str,
    saves: int,
    model_mib: int,
    shard_mib: float,
    moto_pid: int | None,
    one_save: Callable[[dict[str, Any], FsspecWriter], tuple[float, float] | None],
    name: str,
) -> dict[str, Any]:
    """``saves`` timed DCP saves after a warm-up, each to ``s3://<bucket>/<name><N>``.

    ``one_save`` makes one save and returns when its stall ends; it returns the seconds from its
    start to the end of its stall and to completion (None: synchronous, the stall is the whole save)."""
    state = _prepare(rank, bucket, model_mib, shard_mib)
    out: dict[str, Any] = {"rank": rank, "stall": [], "complete": []}
    window = CpuWindow(rank, moto_pid)
    for step in range(saves + 1):
        _mutate(state)
        if step == 1:
            window.start()
        else:
            dist.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            done = one_save(state, _writer(bucket, f"{name}{step}"))
            stall = time.perf_counter() - t0 if done is None else done[0]
        if step:
            out["stall"].append(stall)
            if done is not None:
                out["complete"].append(done[1])
    if not out["complete"]:
        del out["complete"]
    window.stop(out)
    return out


def dcp_save_bench(
    rank: int,
    world: int,
    *,
    bucket: str,
    saves: int,
    model_mib: int,
    shard_mib: float,
    moto_pid: int | None = None,
    **_: Any,
) -> dict[str, Any]:
    """``dcp.save`` with DCP's own ``FsspecWriter`` to ``s3://<bucket>/dcp-step<N>``.

    Synchronous: its stall is the whole save."""

    def one(state: dict[str, Any], writer: FsspecWriter) -> None:
        dcp.save(state, storage_writer=writer)

    return _dcp_bench(rank, bucket, saves, model_mib, shard_mib, moto_pid, one, "dcp-step")


def async_save_bench(
    rank: int,
    world: int,
    *,
    bucket: str,
    saves: int,
    model_mib: int,
    shard_mib: float,
    moto_pid: int | None = None,
    **_: Any,
) -> dict[str, Any]:
    """``dcp.async_save`` (its default: the writer stages a CPU copy) with ``FsspecWriter`` to
    ``s3://<bucket>/dcp-async-step<N>``: stall = until it returns, completion = until its future is done."""

    def one(state: dict[str, Any], writer: FsspecWriter) -> tuple[float, float]:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer)
        stall = time.perf_counter() - t0
        upload = fut.upload_completion if isinstance(fut, AsyncSaveResponse) else fut
        upload.result()
        return stall, time.perf_counter() - t0

    return _dcp_bench(rank, bucket, saves, model_mib, shard_mib, moto_pid, one, "dcp-async-step")
