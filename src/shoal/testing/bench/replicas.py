"""Load N replicas of one model on the emulated cluster (``benchmarks/cluster_replicas.py``, issue 10).

N gloo ranks, each a replica of one data-parallel model, load it on the hosts of
:mod:`shoal.testing.cluster.hosts` (placed by :func:`placement`: one rank per host up to the cluster's
hosts, then several). The scenarios below run on every rank of a
:meth:`~shoal.testing.cluster.hosts.Cluster.run_ranks` job; arguments and results are JSON:

* :func:`setup_replicas` (once, before the others): rank 0 creates the bucket; the job saves the
  model once with shoal (``s3://<bucket>/root``, direct path) and once with ``dcp.save`` and DCP's
  ``FsspecWriter`` (``s3://<bucket>/dcp-model``). The caller then deletes the job's host roots: no
  host tier holds the model afterwards, only S3.
* :func:`shoal_replicas`: every rank ``Checkpointer.load``\\ s the model ``loads + 1`` times (the
  first is a warm-up), ``heal=False``. ``source="shared"``: fresh, empty host roots, so every chunk
  comes from S3 (read once in the job, then spread over the fabric). ``source="dram"``: the job
  first saves the model itself (its own shared root ``s3://<bucket>/dram-<world>``, direct path)
  and loads it back in the same processes, whose DRAM slabs hold it (a save's slabs are released
  only at close).
* :func:`dcp_replicas`: the baseline, every rank ``dcp.load``\\ s the whole model for itself from
  ``s3://<bucket>/dcp-model`` with ``FsspecReader``. DCP has no host cache: its DRAM case is the
  same read from S3.

Each load starts after a barrier. Every rank times its own load and reads its host's interface
counters before and after it (``/sys/class/net`` inside the host's namespace), between barriers;
rank 0 adds the CPU time the machine and the S3 server spent, and shoal's ``LoadReport``. Every
load is compared bit for bit with the model. :func:`summarise` turns the ranks' records into one
record per load (the slowest rank, the bytes per host); :func:`link_fraction` says how much of a
link's rate that was.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shoal._torch_private import FsspecReader, FsspecWriter
from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.testing.bench.cluster_save import cpu_seconds
from shoal.testing.checkpoints import assert_state_equal, zeros_like_state
from shoal.testing.cluster.scenarios import cluster_config, shared_objects
from shoal.testing.s3 import S3Admin, s3_storage_options

__all__ = [
    "DCP_PATH",
    "LINKS",
    "dcp_replicas",
    "link_fraction",
    "load_metrics",
    "placement",
    "replica_model",
    "setup_replicas",
    "shoal_replicas",
    "summarise",
]

MIB = 1 << 20
DCP_PATH = "dcp-model"
"""Where :func:`setup_replicas` saves the DCP baseline's checkpoint in the bucket."""
LINKS = ("storage_tx", "storage_rx", "fabric_tx", "fabric_rx")
"""The interface counters each load record carries, per host: ``st0`` and ``fb0``, each direction."""
WAIT_S = 300.0


def placement(replicas: int, hosts: int) -> tuple[int, int]:
    """``(hosts used, ranks per host)`` for ``replicas`` ranks on a cluster of ``hosts`` hosts.

    One rank per host on the first ``replicas`` hosts while they suffice, else every host with
    ``replicas / hosts`` ranks (which must divide evenly: every host then carries the same load).
    """
    if replicas < 1 or hosts < 1:
        raise ValueError(f"replicas and hosts must be >= 1, got {replicas} replicas on {hosts} hosts")
    if replicas <= hosts:
        return replicas, 1
    if replicas % hosts:
        raise ValueError(
            f"{replicas} replicas do not spread evenly over {hosts} hosts: use a multiple of {hosts}"
        )
    return hosts, replicas // hosts


def link_fraction(nbytes: float, seconds: float, mbit: float) -> float:
    """The share of a link of ``mbit`` Mbit/s that ``nbytes`` in ``seconds`` used (payload only)."""
    if seconds <= 0 or mbit <= 0:
        raise ValueError(f"need seconds > 0 and mbit > 0, got {seconds} s and {mbit} Mbit/s")
    return nbytes / seconds / (mbit * 1e6 / 8)


def replica_model(model_mib: float, tensors: int) -> dict[str, Any]:
    """The model every replica holds: ``tensors`` float32 tensors, ``model_mib`` MiB in all.

    The same bytes on every call and every rank (a fixed seed). Several tensors, so that DCP's
    dedup of replicated items spreads the saved copy over the ranks (and so the hosts).
    """
    if tensors < 1 or model_mib <= 0:
        raise ValueError(f"need tensors >= 1 and model_mib > 0, got {tensors} and {model_mib}")
    g = torch.Generator().manual_seed(4321)
    per_tensor = int(model_mib * MIB) // tensors // 4
    return {"model": {f"layer{i:02d}.weight": torch.randn(per_tensor, generator=g) for i in range(tensors)}}


def _link_bytes() -> dict[str, int]:
    """Bytes through this host's storage NIC and fabric so far (this namespace's ``/sys``)."""
    out = {}
    for dev, name in (("st0", "storage"), ("fb0", "fabric")):
        for way in ("tx", "rx"):
            with open(f"/sys/class/net/{dev}/statistics/{way}_bytes", encoding="ascii") as f:
                out[f"{name}_{way}"] = int(f.read())
    return out


def _config(bucket: str, root: str, dram_root: str, local_root: str, chunk_kib: int) -> Config:
    return cluster_config(
        bucket=bucket,
        dram_root=dram_root,
        local_root=local_root,
        shared=f"s3://{bucket}/{root}",
        path="direct",
        chunk_size=chunk_kib << 10,
    )


def _timed_loads(
    rank: int, model: dict[str, Any], loads: int, moto_pid: int | None, load: Callable[[dict[str, Any]], Any]
) -> list[dict[str, Any]]:
    """``loads + 1`` loads of ``model`` into zeros, each between barriers; the first is a warm-up.

    Per load: this rank's seconds, its process's CPU seconds (every thread) and its host's link
    bytes (and, on rank 0, the CPU seconds of the whole machine and of the S3 server over the load,
    and whatever ``load`` returned). Each load is checked bit for bit against ``model``."""
    records = []
    for k in range(loads + 1):
        target = zeros_like_state(model)
        dist.barrier()
        links0, cpu0, own0, t0 = (
            _link_bytes(),
            cpu_seconds(moto_pid),
            time.process_time(),
            time.perf_counter(),
        )
        extra = load(target)
        seconds = time.perf_counter() - t0
        own = time.process_time() - own0
        dist.barrier()
        links1, cpu1 = _link_bytes(), cpu_seconds(moto_pid)
        window = time.perf_counter() - t0
        assert_state_equal(target, model)
        rec: dict[str, Any] = {
            "warmup": k == 0,
            "seconds": seconds,
            "cpu_s": own,
            "links": {n: links1[n] - links0[n] for n in LINKS},
        }
        if rank == 0:
            rec.update(window_s=window, cpu_busy_s=cpu1[0] - cpu0[0], moto_cpu_s=cpu1[1] - cpu0[1])
            if extra is not None:
                rec["report"] = extra
        records.append(rec)
    return records


def setup_replicas(
    rank: int,
    world: int,
    *,
    bucket: str,
    dram_root: str,
    local_root: str,
    model_mib: float,
    tensors: int,
    chunk_kib: int,
) -> dict[str, Any]:
    """Save the model once with shoal (step 1, ``s3://<bucket>/root``) and once with DCP (:data:`DCP_PATH`).

    Rank 0 creates the bucket first. Returns, on rank 0, every object on S3 with its size."""
    if rank == 0:
        admin = S3Admin(os.environ["SHOAL_S3_ENDPOINT"])
        try:
            admin.create_bucket(bucket)
        finally:
            admin.close()
    dist.barrier()
    model = replica_model(model_mib, tensors)
    with Checkpointer(_config(bucket, "root", dram_root, local_root, chunk_kib)) as ckpt:
        ckpt.save(1, model).wait(Boundary.RESTARTABLE, timeout=WAIT_S)
        ckpt.wait()
    opts = s3_storage_options(os.environ["SHOAL_S3_ENDPOINT"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model, storage_writer=FsspecWriter(f"s3://{bucket}/{DCP_PATH}", **opts))
    dist.barrier()
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        out["objects"] = shared_objects(bucket)
    return out


def shoal_replicas(
    rank: int,
    world: int,
    *,
    bucket: str,
    source: str,
    dram_root: str,
    local_root: str,
    model_mib: float,
    tensors: int,
    chunk_kib: int,
    loads: int,
    moto_pid: int | None = None,
    shared_root: str | None = None,
) -> list[dict[str, Any]]:
    """shoal: ``loads + 1`` ``Checkpointer.load`` of step 1, from S3 (``source="shared"``: the host
    roots must be fresh) or from this job's own DRAM slabs (``"dram"``: it saves the model first).

    ``shared_root``: shoal's root in the bucket; by default ``root`` (where :func:`setup_replicas`
    saved) for ``"shared"`` and ``dram-<world>`` for ``"dram"``, whose save fails with
    :class:`~shoal.errors.CheckpointExists` where an earlier job saved there: give each DRAM job its own."""
    if source not in ("shared", "dram"):
        raise ValueError(f"source must be 'shared' or 'dram', got {source!r}")
    model = replica_model(model_mib, tensors)
    root = shared_root or ("root" if source == "shared" else f"dram-{world}")
    with Checkpointer(_config(bucket, root, dram_root, local_root, chunk_kib)) as ckpt:
        if source == "dram":
            ckpt.save(1, model).wait(Boundary.RESTARTABLE, timeout=WAIT_S)
            ckpt.wait()

        def load(target: dict[str, Any]) -> dict[str, Any]:
            step = ckpt.load(target, 1, heal=False)
            report = ckpt.last_load
            if step != 1 or report is None:
                raise AssertionError(f"rank {rank}: loaded step {step} (report {report}), expected step 1")
            return {
                "bytes_by_tier": dict(report.bytes_by_tier),
                "fabric_bytes": report.fabric_bytes,
                "relayed_bytes": report.relayed_bytes,
                "read_seconds": report.read_seconds,
                "exchange_seconds": report.exchange_seconds,
                "origin": report.origin,
            }

        return _timed_loads(rank, model, loads, moto_pid, load)


def dcp_replicas(
    rank: int,
    world: int,
    *,
    bucket: str,
    model_mib: float,
    tensors: int,
    loads: int,
    moto_pid: int | None = None,
    **_: Any,
) -> list[dict[str, Any]]:
    """The baseline: ``loads + 1`` ``dcp.load`` of the whole model by every rank, each through its own
    ``FsspecReader`` on ``s3://<bucket>/``:data:`DCP_PATH` (no cache: every load reads S3)."""
    model = replica_model(model_mib, tensors)
    opts = s3_storage_options(os.environ["SHOAL_S3_ENDPOINT"])

    def load(target: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, storage_reader=FsspecReader(f"s3://{bucket}/{DCP_PATH}", **opts))

    return _timed_loads(rank, model, loads, moto_pid, load)


def summarise(ranks: Sequence[Sequence[Mapping[str, Any]]], ranks_per_host: int) -> list[dict[str, Any]]:
    """One record per timed load (warm-ups left out) from every rank's records, in rank order.

    ``seconds``: the slowest rank's; ``ranks_cpu_s``: the CPU seconds of every rank's process, summed;
    ``hosts``: per host (the first rank of each host reports its
    host's counters), the bytes through each link of :data:`LINKS`; rank 0's CPU and report as they
    are. Raises ValueError when the ranks do not agree on the number of loads."""
    if not ranks or len({len(r) for r in ranks}) != 1:
        raise ValueError(f"every rank must report the same loads, got {[len(r) for r in ranks]}")
    out = []
    for k, first in enumerate(ranks[0]):
        if first.get("warmup"):
            continue
        hosts = [dict(ranks[r][k]["links"]) for r in range(0, len(ranks), ranks_per_host)]
        rec = {
            "seconds": max(float(r[k]["seconds"]) for r in ranks),
            "ranks_cpu_s": sum(float(r[k]["cpu_s"]) for r in ranks),
            "hosts": hosts,
            **{n: first[n] for n in ("window_s", "cpu_busy_s", "moto_cpu_s", "report") if n in first},
        }
        out.append(rec)
    return out


def load_metrics(
    loads: Sequence[Mapping[str, Any]], *, storage_mbit: float, fabric_mbit: float
) -> dict[str, Any]:
    """The medians of :func:`summarise`'s loads, and the shares of the links they used.

    ``seconds``; ``storage``: bytes the hosts' storage NICs received, per host; ``fabric``: per
    host, the busier direction of its fabric link; ``storage_fraction``: all the storage bytes
    over the seconds, as a share of the aggregate storage rate (``storage_mbit``); ``fabric_fraction``:
    the busiest host's fabric bytes over the seconds, as a share of one fabric link (``fabric_mbit``);
    with shoal's load reports, ``exchange_seconds`` (median) and ``exchange_fraction``, the same
    bytes over the exchange alone (the part of the load that uses the fabric).
    """
    if not loads:
        raise ValueError("no timed loads to summarise")
    seconds = statistics.median(float(x["seconds"]) for x in loads)
    n_hosts = len(loads[0]["hosts"])
    storage = [statistics.median(x["hosts"][h]["storage_rx"] for x in loads) for h in range(n_hosts)]
    fabric = [
        statistics.median(max(x["hosts"][h]["fabric_tx"], x["hosts"][h]["fabric_rx"]) for x in loads)
        for h in range(n_hosts)
    ]
    out: dict[str, Any] = {
        "seconds": seconds,
        "storage": storage,
        "fabric": fabric,
        "storage_fraction": link_fraction(sum(storage), seconds, storage_mbit),
        "fabric_fraction": link_fraction(max(fabric), seconds, fabric_mbit),
    }
    exchanges = [float(x["report"].get("exchange_seconds", 0.0)) for x in loads if x.get("report")]
    exchange = statistics.median(exchanges) if exchanges else 0.0
    if exchange > 0:
        out["exchange_seconds"] = exchange
        out["exchange_fraction"] = link_fraction(max(fabric), exchange, fabric_mbit)
    return out
