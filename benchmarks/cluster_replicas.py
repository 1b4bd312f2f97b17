"""Load N replicas of one model on the emulated cluster: shoal against every rank's own ``dcp.load``.

``--hosts`` hosts (network namespaces, shaped links, moto's S3 behind its own link:
:mod:`shoal.testing.cluster.hosts`). For each N of ``--replicas``, N gloo ranks (one per host on the first
N hosts while they suffice, then the same number on every host) each load the same ``--model-mib``
model (``--tensors`` float32 tensors, shoal chunks of ``--chunk-kib``), ``--loads`` timed loads after
one warm-up, each job its own ``run_ranks`` (:mod:`shoal.testing.bench.replicas`):

  * shoal from shared storage: fresh, empty host roots, so every chunk comes from S3; shoal reads
    each chunk once in the job (balanced over the hosts' storage NICs) and spreads it over the fabric,
  * shoal from DRAM caches: the job saves the model first (direct path) and loads it back from its
    hosts' DRAM slabs,
  * the baseline: every rank ``dcp.load``\\ s the whole model for itself with DCP's ``FsspecReader``
    from a DCP checkpoint of the same model on the same S3. DCP has no host cache: its number is the
    same for both sources.

A setup job saves both checkpoints once (then its host roots are deleted). Seconds are the slowest
rank's load, the median over the timed loads; bytes come from each host's interface counters around
each load. The fractions are the storage NICs' bytes over the load time as a share of the aggregate
storage rate, and the busiest host's fabric bytes over the load time as a share of one fabric link.
Every load is checked bit for bit. Needs root.

Usage: ``python benchmarks/cluster_replicas.py [--replicas 1,2,4,8] [--plot docs/img/cluster_replicas.png]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from shoal.testing.bench.replicas import load_metrics, placement, summarise
from shoal.testing.cluster.hosts import Cluster, ClusterSpec, cannot_run

MIB = 1 << 20
SCENARIOS = "shoal.testing.bench.replicas"
CONTENDERS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("shoal, shared", "shoal_replicas", {"source": "shared"}),
    ("shoal, DRAM", "shoal_replicas", {"source": "dram"}),
    ("DCP", "dcp_replicas", {}),
)
TIMEOUT_S = 600.0


@contextlib.contextmanager
def _fresh_roots() -> Iterator[dict[str, str]]:
    """Empty DRAM (``/dev/shm``) and local roots for one job's host tiers, deleted after it."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    dram = tempfile.mkdtemp(prefix="shoal-replicas-dram-", dir=shm)
    local = tempfile.mkdtemp(prefix="shoal-replicas-local-")
    try:
        yield {"dram_root": dram, "local_root": local}
    finally:
        shutil.rmtree(dram, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


def _job(cluster: Cluster, scenario: str, replicas: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``run_ranks`` job of ``replicas`` ranks with fresh host roots; its timed loads, summarised."""
    hosts, per_host = placement(replicas, cluster.spec.hosts)
    with _fresh_roots() as roots:
        ranks = cluster.run_ranks(
            f"{SCENARIOS}:{scenario}", per_host, {**args, **roots}, timeout=TIMEOUT_S, hosts=hosts
        )
    return summarise(ranks, per_host)


def _measure(args: argparse.Namespace, spec: ClusterSpec, replicas: list[int]) -> dict[tuple[int, str], Any]:
    """Every contender for every N, on one cluster; ``{(N, contender): summarised loads}``."""
    results: dict[tuple[int, str], Any] = {}
    with Cluster(spec) as cluster:
        model = {"model_mib": args.model_mib, "tensors": args.tensors, "chunk_kib": args.chunk_kib}
        bucket = f"shoal-replicas-{secrets.token_hex(4)}"
        with _fresh_roots() as roots:
            cluster.run_ranks(
                f"{SCENARIOS}:setup_replicas", 1, {"bucket": bucket, **model, **roots}, timeout=TIMEOUT_S
            )
        common = {"bucket": bucket, "loads": args.loads, "moto_pid": cluster.s3_pid(), **model}
        for n in replicas:
            for name, scenario, extra in CONTENDERS:
                t0 = time.monotonic()
                results[(n, name)] = _job(cluster, scenario, n, {**common, **extra})
                print(f"N={n} {name}: done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return results


def _mib(xs: list[float]) -> str:
    return f"{sum(xs) / MIB:.1f} ({' / '.join(f'{x / MIB:.1f}' for x in xs)})"


def _table(results: dict[tuple[int, str], Any], spec: ClusterSpec, replicas: list[int]) -> dict[str, Any]:
    """Print the markdown table; return each case's metrics (for the plot and the notes)."""
    rates = {"storage_mbit": spec.storage_mbit, "fabric_mbit": spec.fabric_mbit}
    metrics = {f"{n}/{name}": load_metrics(results[(n, name)], **rates) for (n, name) in results}
    print(
        "| N | source | shoal s | DCP s | DCP / shoal | shoal storage NIC MiB, total (per host) "
        "| DCP storage NIC MiB, total | shoal fabric MiB, busiest host | shoal: of aggregate storage "
        "| shoal: of fabric | shoal exchange s (of fabric) | DCP: of aggregate storage |"
    )
    print("|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|")
    for n in replicas:
        d = metrics[f"{n}/DCP"]
        for source in ("shared", "DRAM"):
            s = metrics[f"{n}/shoal, {source}"]
            print(
                f"| {n} | {source} | {s['seconds']:.2f} | {d['seconds']:.2f} | "
                f"{d['seconds'] / s['seconds']:.2f} | {_mib(s['storage'])} | {sum(d['storage']) / MIB:.1f} | "
                f"{max(s['fabric']) / MIB:.1f} | {s['storage_fraction']:.2f} | {s['fabric_fraction']:.2f} | "
                f"{_exchange(s)} | {d['storage_fraction']:.2f} |"
            )
    return metrics


def _exchange(m: dict[str, Any]) -> str:
    """The exchange's seconds and its share of the busiest fabric link, where there was one."""
    if "exchange_seconds" not in m or max(m["fabric"]) < MIB:  # no exchange (a few stray packets)
        return ""
    return f"{m['exchange_seconds']:.2f} ({m['exchange_fraction']:.2f})"


def _notes(results: dict[tuple[int, str], Any], cores: int) -> None:
    """Per case: CPU (the machine, this job's ranks, moto), shoal's load report, every load's seconds."""
    for (n, name), loads in results.items():
        window = sum(x["window_s"] for x in loads)
        machine = sum(x["cpu_busy_s"] for x in loads) / window / cores
        ours = sum(x["ranks_cpu_s"] for x in loads) / window / cores
        moto = sum(x["moto_cpu_s"] for x in loads) / window
        report = loads[-1].get("report")
        where = ""
        if report:
            tiers = ", ".join(f"{k} {v / MIB:.1f}" for k, v in sorted(report["bytes_by_tier"].items()))
            where = (
                f"; read {tiers} MiB, fabric {report['fabric_bytes'] / MIB:.1f} MiB "
                f"(relayed in hosts {report['relayed_bytes'] / MIB:.1f}), metadata from {report['origin']}"
            )
        print(
            f"N={n} {name}: CPU busy {machine:.0%} of {cores} cores (its ranks {ours:.0%}), moto "
            f"{moto:.2f} cores{where}; loads {[round(x['seconds'], 2) for x in loads]} s"
        )


def _plot(
    path: str, metrics: dict[str, Any], replicas: list[int], spec: ClusterSpec, model_mib: float
) -> None:
    """Load time against N: shoal from S3, shoal from DRAM, DCP; M over the storage and fabric rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=100)
    for name, style in (("shoal, shared", "o-"), ("shoal, DRAM", "s-"), ("DCP", "^--")):
        label = (
            "DCP, every rank from S3"
            if name == "DCP"
            else name.replace("shared", "from S3").replace("DRAM", "from DRAM caches")
        )
        ax.plot(replicas, [metrics[f"{n}/{name}"]["seconds"] for n in replicas], style, label=label)
    mb = model_mib * MIB / 1e6 * 8  # megabits
    ax.axhline(
        mb / spec.storage_mbit, color="grey", ls=":", label=f"M / storage ({spec.storage_mbit:g} Mbit/s)"
    )
    ax.axhline(
        mb / spec.fabric_mbit, color="grey", ls="-.", label=f"M / fabric ({spec.fabric_mbit:g} Mbit/s)"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(replicas, [str(n) for n in replicas])
    ax.set_xlabel(f"replicas N (on {spec.hosts} hosts)")
    ax.set_ylabel("load time, slowest rank (s)")
    ax.set_title(f"Load N replicas of a {model_mib:g} MiB model (emulated cluster)", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--replicas", default="1,2,4,8", help="comma-separated N")
    p.add_argument("--host-storage-mbit", type=float, default=200.0)
    p.add_argument("--fabric-mbit", type=float, default=None, help="default: 2x the host NIC")
    p.add_argument("--storage-mbit", type=float, default=300.0, help="the aggregate storage link")
    p.add_argument("--model-mib", type=float, default=32.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--chunk-kib", type=int, default=256)
    p.add_argument("--loads", type=int, default=3, help="timed loads per case, after one warm-up")
    p.add_argument("--plot", default=None, help="write a PNG of load time against N here")
    return p


def main() -> int:
    args = _parser().parse_args()
    try:
        replicas = sorted({int(x) for x in args.replicas.split(",") if x.strip()})
        for n in replicas:
            placement(n, args.hosts)
    except ValueError as e:
        print(f"cluster_replicas: --replicas {args.replicas!r}: {e}", file=sys.stderr)
        return 2
    why = cannot_run()
    if why is not None:
        print(f"cluster_replicas: {why}", file=sys.stderr)
        return 2
    fabric = args.fabric_mbit if args.fabric_mbit is not None else 2 * args.host_storage_mbit
    spec = ClusterSpec(args.hosts, args.host_storage_mbit, fabric, args.storage_mbit)
    results = _measure(args, spec, replicas)
    print(
        f"{spec.hosts} hosts; host storage NIC {spec.host_storage_mbit:g} Mbit/s, fabric {fabric:g} Mbit/s, "
        f"storage aggregate {spec.storage_mbit:g} Mbit/s ({spec.storage_mbit * 1e6 / 8 / MIB:.1f} MiB/s). "
        f"Model {args.model_mib:g} MiB in {args.tensors} tensors, chunks {args.chunk_kib} KiB. Median of "
        f"{args.loads} loads after one warm-up; seconds = the slowest rank. DCP has no cache: its "
        "seconds are the same read from S3 in both rows.\n"
    )
    metrics = _table(results, spec, replicas)
    print()
    _notes(results, os.cpu_count() or 1)
    if args.plot:
        _plot(args.plot, metrics, replicas, spec, args.model_mib)
        print(f"\nplot: {args.plot} ({os.path.getsize(args.plot) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
