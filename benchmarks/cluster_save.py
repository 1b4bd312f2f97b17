"""Save on the emulated cluster: shoal against ``dcp.save`` and ``dcp.async_save`` to the same S3, in one run.

``--hosts`` hosts of ``--ranks-per-host`` gloo ranks each (network namespaces, shaped links, moto's
S3 behind its own link: :mod:`shoal.testing.cluster.hosts`) save a data-parallel model (``--model-mib``,
the same on every rank) plus each rank's optimizer shard (``--shard-mib``). Three contenders, each
its own ``run_ranks`` job (:mod:`shoal.testing.bench.cluster_save`), ``--saves`` timed saves after one
warm-up, each after the previous one finished, every tensor changed before each save:

  * shoal (partner path, through ``s3://``): stall = until ``save`` returns (B1), the slowest rank;
    B2, B3, B4 from rank 0's handle,
  * ``dcp.save`` with DCP's own fsspec writer (``FsspecWriter``) to ``s3://<bucket>/dcp-step<N>``:
    stall = the whole save,
  * ``dcp.async_save`` with the same writer (its default staging): stall = until it returns,
    completion = until its future is done.

and, unless ``--no-ablations``, shoal with one mechanism switched off at a time (``ABLATIONS``):
dedup, the balanced export, staging. Each shoal contender is its own job on the store.

Around each job the parent reads every host's storage NIC counters: bytes sent per save (the
warm-up included, so divided by ``saves + 1``) and, over the drain, the fraction of the shaped
aggregate storage rate they reached. shoal's drain is the window of its pack uploads (first
start to last end over all ranks, from the event records); DCP's is its whole save (or
completion). Rank 0 also reads the machine's and the S3 server's CPU time over the timed saves,
to tell the CPU from the links. ``--plot PATH`` draws stall and time to durable per contender.
Needs root. Usage: ``python benchmarks/cluster_save.py --hosts 4 --ranks-per-host 2 --saves 3``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
from typing import Any

from shoal.testing.cluster.hosts import Cluster, ClusterSpec, cannot_run

MIB = 1 << 20
SHOAL = "shoal.testing.bench.cluster_save:shoal_bench"
DCP_SAVE = "dcp.save + FsspecWriter"
CONTENDERS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("shoal", SHOAL, {}),
    (DCP_SAVE, "shoal.testing.bench.cluster_save:dcp_save_bench", {}),
    ("dcp.async_save + FsspecWriter", "shoal.testing.bench.cluster_save:async_save_bench", {}),
)
ABLATIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("shoal, dedup off", SHOAL, {"distinct_model": True}),
    ("shoal, balanced export off", SHOAL, {"config": {"balance_drain": False}}),
    ("shoal, staging off", SHOAL, {"blocking": True, "config": {"path": "direct"}}),
)
"""Each switches one of shoal's mechanisms off: dedup (every rank's model copy made its own, in
name and bytes, so neither DCP's dedup by name nor shoal's by content finds anything: each rank
writes its whole state), the balanced export (``Config.balance_drain=False``: a replicated item
or chunk is written by the lowest rank holding it, in DCP's planning stage and in shoal's
planner alike), and staging (the save waits for B4 on the direct path, as a synchronous writer)."""
CPU_BOUND = 0.9
"""Above this share of every core busy (or of one core for moto's process) the CPU, not the links, bounds."""


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _drain_windows(ranks: list[dict[str, Any]], saves: int) -> list[float]:
    """Per timed save, from the first pack upload's start to the last one's end over every rank."""
    out = []
    for k in range(saves):
        spans = [r["packs"][k] for r in ranks if r["packs"][k] is not None]
        if spans:
            out.append(max(e for _, e, _ in spans) - min(s for s, _, _ in spans))
    return out


def _run(cluster: Cluster, scenario: str, ranks_per_host: int, args: dict[str, Any]) -> dict[str, Any]:
    hosts = cluster.spec.hosts
    before = [cluster.counters(i) for i in range(hosts)]
    ranks = cluster.run_ranks(scenario, ranks_per_host, args, timeout=900)
    after = [cluster.counters(i) for i in range(hosts)]
    stalls = [max(r["stall"][k] for r in ranks) for k in range(args["saves"])]
    res: dict[str, Any] = {
        "stalls": stalls,
        "tx": [after[i].storage_tx - before[i].storage_tx for i in range(hosts)],
        "fabric_tx": [after[i].fabric_tx - before[i].fabric_tx for i in range(hosts)],
    }
    r0 = ranks[0]
    if "times" in r0:
        for b in ("2", "3", "4"):
            if b in r0["times"][0]:
                res[f"B{b}"] = [t[b] for t in r0["times"]]
        res["done"] = res["B4"]
        res["drain"] = _drain_windows(ranks, args["saves"])
    elif "complete" in r0:
        res["done"] = res["drain"] = [max(r["complete"][k] for r in ranks) for k in range(args["saves"])]
    else:
        res["done"] = res["drain"] = stalls
    res["cpu"] = r0["cpu_busy_s"] / r0["window_s"] / (os.cpu_count() or 1)
    res["moto"] = r0["moto_cpu_s"] / r0["window_s"]
    return res


def _measure(args: argparse.Namespace, spec: ClusterSpec) -> dict[str, dict[str, Any]]:
    """Run every contender, each its own job of ranks on one cluster; their results by name."""
    contenders = CONTENDERS[:1] + (ABLATIONS if args.ablations else ()) + CONTENDERS[1:]
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
                "moto_pid": cluster.s3_pid(),
            }
            for i, (name, scenario, extra) in enumerate(contenders):
                kwargs = {**common, **extra}
                if scenario == SHOAL:  # each shoal contender its own job: no dedup against another's
                    kwargs.update(dram_root=dram, local_root=local)
                    kwargs["config"] = {**extra.get("config", {}), "job": f"bench{i}"}
                results[name] = _run(cluster, scenario, args.ranks_per_host, kwargs)
                print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(dram, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    return results


def _table(results: dict[str, dict[str, Any]], saves: int, agg: float) -> None:
    shoal = results["shoal"]
    print(
        "| contender | stall (s) | B2 (s) | B3 (s) | B4 / completion (s) | stall / shoal's | "
        "durable / shoal's | MiB per save through storage NICs (per host) | "
        "fraction of the aggregate link while draining |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, res in results.items():
        per_save = [tx / (saves + 1) for tx in res["tx"]]
        frac = sum(per_save) / _med(res["drain"]) / agg
        b2, b3 = (f"{_med(res[b]):.2f}" if b in res else "" for b in ("B2", "B3"))
        hosts = " / ".join(f"{x / MIB:.1f}" for x in per_save)
        print(
            f"| {name} | {_med(res['stalls']):.3f} | {b2} | {b3} | {_med(res['done']):.2f} | "
            f"{_med(res['stalls']) / _med(shoal['stalls']):.2f} | "
            f"{_med(res['done']) / _med(shoal['done']):.2f} | {sum(per_save) / MIB:.1f} ({hosts}) | "
            f"{frac:.2f} |"
        )
    print()


def _shares(results: dict[str, dict[str, Any]]) -> None:
    """What each switch costs, as a share of shoal's gain over ``dcp.save`` (stall and durable)."""
    shoal, base = results["shoal"], results[DCP_SAVE]
    for metric, label in (("stalls", "stall"), ("done", "time to durable")):
        gain = _med(base[metric]) - _med(shoal[metric])
        for name, _, _ in ABLATIONS:
            if name not in results:
                continue
            lost = _med(results[name][metric]) - _med(shoal[metric])
            print(
                f"{label}: {name} adds {lost:+.3f} s to shoal's {_med(shoal[metric]):.3f} s; shoal's "
                f"gain over dcp.save is {gain:+.3f} s, so this switch is {lost / gain:.0%} of it"
                if gain > 0
                else f"{label}: {name} adds {lost:+.3f} s; shoal gains nothing over dcp.save ({gain:+.3f} s)"
            )
    print()


def _notes(results: dict[str, dict[str, Any]], saves: int, agg: float) -> None:
    for name, res in results.items():
        cpu_note = []
        if res["cpu"] > CPU_BOUND:
            cpu_note.append("the CPU was the bottleneck (every core busy)")
        if res["moto"] > CPU_BOUND:
            cpu_note.append("moto was the bottleneck (one core of its own)")
        print(
            f"{name}: CPU busy {res['cpu']:.0%} of {os.cpu_count()} cores, moto {res['moto']:.2f} cores "
            f"over the timed saves{'; ' + ', '.join(cpu_note) if cpu_note else ''}; fabric tx per save "
            f"{sum(res['fabric_tx']) / (saves + 1) / MIB:.1f} MiB"
        )
        b2_b3 = _med([b3 - b2 for b2, b3 in zip(res.get("B2", []), res.get("B3", []), strict=True)])
        if b2_b3 > 0:  # the partner path drains after B2: B2 to B3, beside the pack window
            per_save = sum(res["tx"]) / (saves + 1)
            print(f"  B2 to B3 (median {b2_b3:.2f} s): {per_save / b2_b3 / agg:.2f} of the aggregate link")
        raw = {
            k: [round(x, 3) for x in res[k]]
            for k in ("stalls", "B2", "B3", "B4", "done", "drain")
            if k in res
        }
        print(f"  raw: {raw}")


def _plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.45 * len(names) + 1.4), sharey=True)
    ys = range(len(names))
    left.barh(ys, [_med(results[n]["stalls"]) for n in names], color="tab:blue")
    left.set_xscale("log")
    left.set_xlabel("stall (s, log)")
    right.barh(ys, [_med(results[n]["done"]) for n in names], color="tab:orange")
    right.set_xlabel("time to durable: B4 or completion (s)")
    left.set_yticks(list(ys), names)
    left.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


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
    parser.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--plot", default=None, help="write a PNG of stall and time to durable here")
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
    results = _measure(args, spec)
    agg = args.storage_mbit * 1e6 / 8
    title = (
        f"{args.hosts} hosts x {args.ranks_per_host} ranks; host storage NIC {args.host_storage_mbit:g} "
        f"Mbit/s, fabric {fabric:g} Mbit/s, storage aggregate {args.storage_mbit:g} Mbit/s "
        f"({agg / MIB:.1f} MiB/s)"
    )
    print(
        f"{title}. State per rank {per_rank / MIB:.1f} MiB ({args.model_mib} MiB replicated model + "
        f"{args.shard_mib:g} MiB own shard), {unique / MIB:.1f} MiB unique per save. Median of "
        f"{args.saves} saves after one warm-up; stall = slowest rank.\n"
    )
    _table(results, args.saves, agg)
    _shares(results)
    _notes(results, args.saves, agg)
    if args.plot:
        _plot(results, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
