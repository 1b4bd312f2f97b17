"""Save on the emulated cluster: shoal against ``dcp.save`` and ``dcp.async_save`` to the same S3, in one run.

``--hosts`` hosts of ``--ranks-per-host`` gloo ranks each (network namespaces, shaped links, moto's
S3 behind its own link: :mod:`shoal.testing.cluster`) save a data-parallel model (``--model-mib``,
the same on every rank) plus each rank's optimizer shard (``--shard-mib``). Three contenders, each
its own ``run_ranks`` job (:mod:`shoal.testing.cluster_bench`), ``--saves`` timed saves after one
warm-up, each after the previous one finished, every tensor changed before each save:

  * shoal (partner path, through ``s3://``): stall = until ``save`` returns (B1), the slowest rank;
    B2, B3, B4 from rank 0's handle,
  * ``dcp.save`` with DCP's own fsspec writer (``FsspecWriter``) to ``s3://<bucket>/dcp-step<N>``:
    stall = the whole save,
  * ``dcp.async_save`` with the same writer (its default staging): stall = until it returns,
    completion = until its future is done.

Around each job the parent reads every host's storage NIC counters: bytes sent per save (the
warm-up included, so divided by ``saves + 1``) and, over the drain (shoal's B3, DCP's whole save or
completion), the fraction of the shaped aggregate storage rate they reached. Rank 0 also reads the
machine's and the S3 server's CPU time over the timed saves, to tell the CPU from the links.
Needs root. Usage: ``python benchmarks/cluster_save.py --hosts 2 --ranks-per-host 2 --saves 3``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from shoal.testing.cluster import Cluster, ClusterSpec, cannot_run

MIB = 1 << 20
CONTENDERS = (
    ("shoal", "shoal.testing.cluster_bench:shoal_bench"),
    ("dcp.save + FsspecWriter", "shoal.testing.cluster_bench:dcp_save_bench"),
    ("dcp.async_save + FsspecWriter", "shoal.testing.cluster_bench:async_save_bench"),
)
CPU_BOUND = 0.9
"""Above this share of every core busy (or of one core for moto's process) the CPU, not the links, bounds."""


def _moto_pid(cluster: Cluster) -> int | None:
    out = subprocess.run(
        ["ip", "netns", "pids", cluster.ns("st")], capture_output=True, text=True, check=False
    ).stdout.split()
    return int(out[0]) if len(out) == 1 else None


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _run(cluster: Cluster, scenario: str, ranks_per_host: int, args: dict[str, Any]) -> dict[str, Any]:
    hosts = cluster.spec.hosts
    before = [cluster.counters(i) for i in range(hosts)]
    ranks = cluster.run_ranks(scenario, ranks_per_host, args, timeout=900)
    after = [cluster.counters(i) for i in range(hosts)]
    stalls = [max(r["stall"][k] for r in ranks) for k in range(args["saves"])]
    res: dict[str, Any] = {
        "ranks": ranks,
        "stalls": stalls,
        "tx": [after[i].storage_tx - before[i].storage_tx for i in range(hosts)],
        "fabric_tx": [after[i].fabric_tx - before[i].fabric_tx for i in range(hosts)],
    }
    r0 = ranks[0]
    if "times" in r0:
        for b in ("2", "3", "4"):
            res[f"B{b}"] = [t[b] for t in r0["times"]]
        res["drain"] = res["B3"]
        res["done"] = res["B4"]
    elif "complete" in r0:
        res["done"] = [max(r["complete"][k] for r in ranks) for k in range(args["saves"])]
        res["drain"] = res["done"]
    else:
        res["done"] = res["drain"] = stalls
    res["cpu"] = r0["cpu_busy_s"] / r0["window_s"] / (os.cpu_count() or 1)
    res["moto"] = r0["moto_cpu_s"] / r0["window_s"]
    return res


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--host-storage-mbit", type=float, default=200.0)
    parser.add_argument("--fabric-mbit", type=float, default=None, help="default: 2x the host NIC")
    parser.add_argument("--storage-mbit", type=float, default=300.0, help="the aggregate storage link")
    parser.add_argument("--model-mib", type=int, default=16)
    parser.add_argument("--shard-mib", type=float, default=4.0)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    why = cannot_run()
    if why is not None:
        print(f"cluster_save: {why}", file=sys.stderr)
        return 2
    fabric = args.fabric_mbit if args.fabric_mbit is not None else 2 * args.host_storage_mbit
    spec = ClusterSpec(args.hosts, args.host_storage_mbit, fabric, args.storage_mbit)
    world = args.hosts * args.ranks_per_host
    per_rank = args.model_mib * MIB + int(args.shard_mib * MIB)
    unique = args.model_mib * MIB + world * int(args.shard_mib * MIB)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    dram = tempfile.mkdtemp(prefix="shoal-cluster-bench-dram-", dir=shm)
    local = tempfile.mkdtemp(prefix="shoal-cluster-bench-local-")
    results: dict[str, dict[str, Any]] = {}
    try:
        with Cluster(spec) as cluster:
            common = {
                "bucket": f"shoal-bench-{secrets.token_hex(4)}",
                "saves": args.saves,
                "model_mib": args.model_mib,
                "shard_mib": args.shard_mib,
                "moto_pid": _moto_pid(cluster),
            }
            for name, scenario in CONTENDERS:
                extra = {"dram_root": dram, "local_root": local} if name == "shoal" else {}
                results[name] = _run(cluster, scenario, args.ranks_per_host, {**common, **extra})
                print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(dram, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)

    agg = args.storage_mbit * 1e6 / 8
    print(
        f"{args.hosts} hosts x {args.ranks_per_host} ranks; host storage NIC {args.host_storage_mbit:g} "
        f"Mbit/s, fabric {fabric:g} Mbit/s, storage aggregate {args.storage_mbit:g} Mbit/s "
        f"({agg / MIB:.1f} MiB/s). State per rank {per_rank / MIB:.1f} MiB ({args.model_mib} MiB "
        f"replicated model + {args.shard_mib:g} MiB own shard), {unique / MIB:.1f} MiB unique per "
        f"save. Median of {args.saves} saves after one warm-up; stall = slowest rank.\n"
    )
    base = _med(results["dcp.save + FsspecWriter"]["stalls"])
    print(
        "| contender | stall (s) | B2 (s) | B3 (s) | B4 / completion (s) | dcp.save stall / this stall "
        "| MiB per save through storage NICs (per host) | fraction of the aggregate link while draining |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for name, res in results.items():
        per_save = [tx / (args.saves + 1) for tx in res["tx"]]
        frac = sum(per_save) / _med(res["drain"]) / agg
        b2 = f"{_med(res['B2']):.2f}" if "B2" in res else ""
        b3 = f"{_med(res['B3']):.2f}" if "B3" in res else ""
        hosts = " / ".join(f"{x / MIB:.1f}" for x in per_save)
        print(
            f"| {name} | {_med(res['stalls']):.3f} | {b2} | {b3} | {_med(res['done']):.2f} | "
            f"{base / _med(res['stalls']):.1f} | {sum(per_save) / MIB:.1f} ({hosts}) | {frac:.2f} |"
        )
    print()
    for name, res in results.items():
        cpu_note = []
        if res["cpu"] > CPU_BOUND:
            cpu_note.append("the CPU was the bottleneck (every core busy)")
        if res["moto"] > CPU_BOUND:
            cpu_note.append("moto was the bottleneck (one core of its own)")
        print(
            f"{name}: CPU busy {res['cpu']:.0%} of {os.cpu_count()} cores, moto {res['moto']:.2f} cores "
            f"over the timed saves{'; ' + ', '.join(cpu_note) if cpu_note else ''}; fabric tx per save "
            f"{sum(res['fabric_tx']) / (args.saves + 1) / MIB:.1f} MiB"
        )
        if "B2" in res:  # shoal's partner path drains only after B2: the drain alone, B2 to B3
            drain_only = _med([b3 - b2 for b2, b3 in zip(res["B2"], res["B3"], strict=True)])
            per_save = sum(res["tx"]) / (args.saves + 1)
            print(
                f"  drain alone (B2 to B3, median {drain_only:.2f} s): "
                f"{per_save / drain_only / agg:.2f} of the aggregate link"
            )
        raw = {k: [round(x, 3) for x in res[k]] for k in ("stalls", "B2", "B3", "B4", "done") if k in res}
        print(f"  raw: {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
