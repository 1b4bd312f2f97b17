"""Coordination overhead per checkpoint against the number of ranks, on the emulated cluster (issue 10).

For each shape ``HxR`` of ``--shapes`` (``H`` hosts of ``R`` gloo ranks: network namespaces,
shaped links, moto's S3 behind its own link: :mod:`shoal.testing.cluster.hosts`), every rank saves a
tiny state of its own (``--tensors`` tensors of ``--kib`` KiB, changed before each save), so that
what a save costs is its protocol and not its bytes. Every link is shaped at ``--mbit`` (fast
enough that a few KiB per rank take well under a millisecond). In one ``run_ranks`` job per shape
(:func:`shoal.testing.bench.coordination.coord_bench`) each contender makes ``--saves`` timed saves
after one warm-up, each after a barrier and after the previous one finished:

  * shoal, partner path and direct path, through ``s3://``: stall = until ``save`` returns, B4 =
    until ``LATEST`` (the slowest rank); the seconds inside the protocol's control collectives
    and the time of each phase (C1 .. C7, planner, I/O) from rank 0's event log,
  * ``dcp.save`` with DCP's ``FsspecWriter`` to the same S3 (its whole save; its data write and
    metadata write timed apart from the rest), and ``dcp.async_save`` (stall and completion).

Rank 0 reads the machine's and the S3 server's CPU time over each contender's saves: with many
python+torch ranks on few cores the CPU, not the network, can be what bounds the protocol.
Needs root. Usage::

    python benchmarks/cluster_coord.py --shapes 2x1 2x2 4x2 4x4 8x2 --saves 10 --plot out.png
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from shoal.testing.bench.coordination import CONTENDERS, median_of_max
from shoal.testing.cluster.hosts import Cluster, ClusterSpec, cannot_run

NAN = float("nan")
CPU_BOUND = 0.9
"""Above this share of every core busy (or of one core for moto's process) the CPU bounds."""
DEFAULT_SHAPES = ((2, 1), (2, 2), (4, 2), (4, 4), (8, 2))
"""2 to 16 ranks; 16 python+torch ranks on a 2-core machine are CPU bound (the output says so)."""
AITURBO_MS, AITURBO_RANKS = 45.0, 64
"""AITURBO's reported coordination overhead: at most 45 ms at 64 ranks."""


def parse_shape(text: str) -> tuple[int, int]:
    """``"4x2"`` -> (4 hosts, 2 ranks per host)."""
    hosts, sep, per_host = text.lower().partition("x")
    if not sep or not hosts.isdigit() or not per_host.isdigit() or int(hosts) < 1 or int(per_host) < 1:
        raise argparse.ArgumentTypeError(f"a shape is HOSTSxRANKS_PER_HOST (e.g. 4x2), not {text!r}")
    return int(hosts), int(per_host)


def _loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as f:
        return " ".join(f.read().split()[:3])


def _rank0_median(ranks: list[dict[str, Any]], name: str, phase: str) -> float:
    values = [p[phase] for p in ranks[0][name]["phases"] if phase in p]
    return statistics.median(values) if values else float("nan")


def summarize(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One contender's figures for one shape: medians over the saves of the slowest rank's value,
    rank 0's phases (medians), and the CPU busy share of the machine and of moto over its saves."""
    runs = [r[name] for r in ranks]
    res: dict[str, Any] = {"stall": median_of_max([r["stall"] for r in runs])}
    if "times" in runs[0]:
        for b in ("2", "3", "4"):
            res[f"B{b}"] = median_of_max([[t[b] for t in r["times"]] for r in runs])
        done = [[t["4"] for t in r["times"]] for r in runs]
        res["after_b4"] = median_of_max([r["after_b4"] for r in runs])
    else:
        done = [r["complete"] for r in runs]
        res["B4"] = median_of_max(done)
    res["per_save"] = [max(values) for values in zip(*done, strict=True)]
    keys = list(dict.fromkeys(k for p in runs[0]["phases"] for k in p))
    res["phases"] = {k: _rank0_median(ranks, name, k) for k in keys}
    r0 = runs[0]
    res["cpu"] = r0["cpu_busy_s"] / r0["window_s"] / (os.cpu_count() or 1)
    res["moto"] = r0["moto_cpu_s"] / r0["window_s"]
    return res


def run_shape(args: argparse.Namespace, hosts: int, per_host: int) -> dict[str, Any]:
    """One cluster of ``hosts`` hosts, one ``run_ranks`` job of every contender; summaries by name."""
    world = hosts * per_host
    saves = args.saves if world < 16 else args.saves_16
    spec = ClusterSpec(hosts, args.mbit, args.mbit, args.mbit)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    dram = tempfile.mkdtemp(prefix="shoal-cluster-coord-dram-", dir=shm)
    local = tempfile.mkdtemp(prefix="shoal-cluster-coord-local-")
    load_before = _loadavg()
    t0 = time.monotonic()
    try:
        with Cluster(spec) as cluster:
            job = {
                "bucket": f"shoal-coord-{secrets.token_hex(4)}",
                "dram_root": dram,
                "local_root": local,
                "saves": saves,
                "contenders": list(args.contenders),
                "tensors": args.tensors,
                "kib": args.kib,
                "settle": not args.no_settle,
                "moto_pid": cluster.s3_pid(),
            }
            ranks = cluster.run_ranks(
                "shoal.testing.bench.coordination:coord_bench", per_host, job, timeout=900
            )
    finally:
        shutil.rmtree(dram, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    out: dict[str, Any] = {name: summarize(ranks, name) for name in args.contenders}
    out.update(hosts=hosts, per_host=per_host, world=world, saves=saves, seconds=time.monotonic() - t0)
    out["load"] = f"{load_before} -> {_loadavg()}"
    print(
        f"{hosts}x{per_host}: done in {out['seconds']:.0f} s, load {out['load']}", file=sys.stderr, flush=True
    )
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds == seconds else ""


def _cell(res: dict[str, Any] | None, *keys: str) -> str:
    """``res[k]`` in ms for each key (``phases.<name>``: a phase), joined by `` / ``; "" without ``res``."""
    if res is None:
        return ""
    values = [res["phases"].get(k[7:], NAN) if k.startswith("phases.") else res[k] for k in keys]
    return " / ".join(_ms(v) for v in values)


def print_tables(shapes: list[dict[str, Any]], names: Sequence[str]) -> None:
    """The main table, the other contenders' table, and where the time went on rank 0."""
    print(
        "| ranks | hosts | shoal stall (ms) | shoal B4 (ms) | shoal in collectives (ms, rank 0) "
        "| dcp.save (ms) | dcp.save / shoal B4 | CPU busy (shoal / dcp.save) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for s in shapes:
        shoal = "shoal-partner" if "shoal-partner" in s else "shoal-direct"
        sh, dc = s.get(shoal), s.get("dcp.save")
        ratio = f"{dc['stall'] / sh['B4']:.2f}" if sh and dc else ""
        cpu = " / ".join(f"{s[n]['cpu']:.0%}" for n in (shoal, "dcp.save") if n in s)
        print(
            f"| {s['world']} | {s['hosts']} | {_cell(sh, 'stall')} | {_cell(sh, 'B4')} "
            f"| {_cell(sh, 'phases.coordination')} | {_cell(dc, 'stall')} | {ratio} | {cpu} |"
        )
    print()
    print(
        "| ranks | hosts | shoal partner / direct: after B4 until idle (ms) | shoal direct: stall / B4 (ms) "
        "| dcp.save: outside its two writes (ms, rank 0) | dcp.async_save: stall / completion (ms) |"
    )
    print("|---:|---:|---|---|---:|---|")
    for s in shapes:
        idle = " / ".join(_cell(s.get(n), "after_b4") for n in ("shoal-partner", "shoal-direct")).strip(" /")
        print(
            f"| {s['world']} | {s['hosts']} | {idle} | {_cell(s.get('shoal-direct'), 'stall', 'B4')} "
            f"| {_cell(s.get('dcp.save'), 'phases.coordination')} "
            f"| {_cell(s.get('dcp.async_save'), 'stall', 'B4')} |"
        )
    print()
    for name in names:
        if name == "dcp.async_save":
            continue
        keys = [k for k in shapes[0][name]["phases"] if k != "collectives"]
        print(f"Where {name}'s time went on rank 0 (ms, median over the saves):\n")
        print("| ranks | " + " | ".join(keys) + " |")
        print("|---:|" + "---:|" * len(keys))
        for s in shapes:
            print(f"| {s['world']} | " + " | ".join(_ms(s[name]["phases"].get(k, NAN)) for k in keys) + " |")
        print()


def print_notes(shapes: list[dict[str, Any]], names: Sequence[str]) -> None:
    """CPU and moto busy shares per shape and contender, and what they say about the bound."""
    cores = os.cpu_count() or 1
    for s in shapes:
        parts = []
        for name in names:
            r = s[name]
            flag = " (CPU bound)" if r["cpu"] > CPU_BOUND else ""
            flag += " (moto bound)" if r["moto"] > CPU_BOUND else ""
            parts.append(f"{name} {r['cpu']:.0%}/moto {r['moto']:.2f}{flag}")
        print(
            f"- {s['hosts']}x{s['per_host']} ({s['world']} ranks, {s['saves']} saves, {s['seconds']:.0f} s, "
            f"load {s['load']}): CPU busy of {cores} cores: " + "; ".join(parts)
        )
        raw = "; ".join(f"{n} {' '.join(_ms(x) for x in s[n]['per_save'])}" for n in names)
        print(f"  each save, slowest rank's B4 / completion (ms): {raw}")


def plot(shapes: list[dict[str, Any]], names: Sequence[str], path: str) -> None:
    """Time per checkpoint against ranks: shoal stall and B4, dcp.save (and the others run).

    A line joins the first shape of each rank count; a further shape of the same count (``8x2``
    after ``4x4``) is an unjoined marker. AITURBO's figure is its one point, at 64 ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    lines = [("shoal-partner", "stall", "shoal stall"), ("shoal-partner", "B4", "shoal B4 (partner)"),
             ("shoal-direct", "B4", "shoal B4 (direct)"), ("dcp.save", "stall", "dcp.save"),
             ("dcp.async_save", "B4", "dcp.async_save completion")]  # fmt: skip
    first = {s["world"]: s for s in reversed(shapes)}
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, key, label in lines:
        if name not in names:
            continue
        pts = sorted((w, s[name][key] * 1e3) for w, s in first.items())
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for s in shapes:
            if first[s["world"]] is not s:
                ax.plot(
                    [s["world"]], [s[name][key] * 1e3], marker="s", fillstyle="none", color=line.get_color()
                )
    ax.plot([AITURBO_RANKS], [AITURBO_MS], marker="*", markersize=12, color="black", linestyle="none",
            label=f"AITURBO (reported): {AITURBO_MS:g} ms at {AITURBO_RANKS}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({*first, AITURBO_RANKS})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("ranks (hollow squares: a second shape of that rank count)")
    ax.set_ylabel("ms per checkpoint (median, slowest rank)")
    ax.set_title("Tiny-state checkpoint on the emulated cluster (2 cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=list(DEFAULT_SHAPES),
                        help="HOSTSxRANKS_PER_HOST, e.g. 2x1 4x4 8x2")  # fmt: skip
    parser.add_argument("--mbit", type=float, default=1000.0, help="every link: host NICs, fabric, storage")
    parser.add_argument("--saves", type=int, default=10, help="timed saves per contender below 16 ranks")
    parser.add_argument(
        "--saves-16", type=int, default=6, help="timed saves per contender at 16 ranks or more"
    )
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--kib", type=int, default=4, help="KiB per tensor")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--no-settle", action="store_true",
                        help="start each shoal save once the previous reached B4 (default: once its "
                        "pipeline work, the retention pass after B4, is done too)")  # fmt: skip
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of time against ranks")
    args = parser.parse_args()
    why = cannot_run()
    if why is not None:
        print(f"cluster_coord: {why}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("cluster_coord: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    shapes = [run_shape(args, hosts, per_host) for hosts, per_host in args.shapes]
    after = "reached B4" if args.no_settle else "is done (B4 and its retention pass)"
    print(
        f"Every link {args.mbit:g} Mbit/s; each rank {args.tensors} x {args.kib} KiB of its own, changed "
        f"before each save; median over the timed saves (after a warm-up) of the slowest rank. Each shoal "
        f"save starts once the previous one {after}.\n"
    )
    print_tables(shapes, args.contenders)
    print_notes(shapes, args.contenders)
    if args.plot:
        plot(shapes, args.contenders, args.plot)
        print(f"\nplot: {args.plot} ({os.path.getsize(args.plot) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
