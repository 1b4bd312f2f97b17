"""Restore a checkpoint on 4 ranks / 2 simulated hosts: from DRAM, from partner copies, from shared storage.

Each rank holds ``--mib`` MiB of its own shards (4 x 256 MiB = 1 GiB by default). After one
save reaches B4, the same job loads it three times, each time with less left: the DRAM slabs
(every chunk on its own host), then the partner copies only (the slabs given back: each
host's chunks come from the other host's local disk over the fabric), then shared storage
only (local disks deleted). Then PyTorch DCP saves the same state with its
``FileSystemWriter`` and loads it back with ``FileSystemReader``: the baseline. Shared and
local tiers live under ``--dir`` (a disk by default); the files were just written, so reads
are mostly served by the page cache on a machine with enough memory. Times are the slowest
rank's ``load`` (collective), with every chunk verified. Beside them, memcpy of the same bytes:
every rank copies its own state into its (already touched) target at once, the slowest rank's
time. Then where each load's time went, per source: each phase of the ``loaded`` event's
``phases`` (the slowest rank's seconds in it). Usage::

    python benchmarks/restore.py --mib 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from shoal.testing import restore_scenarios
from shoal.testing.multiproc import run_ranks

CASES = {"dram": "DRAM (slabs)", "partner": "partner copies", "shared": "shared storage"}
PHASES = ("choose", "caller", "agree", "places", "buffers", "read", "verify", "copy", "rounds", "exchange",
          "stats", "after")  # fmt: skip
"""The ``loaded`` event's phases, in the order a load goes through them (docs/events.md; ``buffers``:
the buffers for chunks only other ranks need, which older versions allocated)."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="MiB of state per rank")
    parser.add_argument("--dir", default=None, help="where shared and local tiers go (default: a temp dir)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="shoal-bench-restore-", dir=args.dir)
    dram = tempfile.mkdtemp(
        prefix="shoal-bench-restore-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    try:
        out = run_ranks(
            restore_scenarios.bench_restore,
            hosts=["h0", "h0", "h1", "h1"],
            kwargs={"root": root, "dram": dram, "mib_per_rank": args.mib},
            timeout=1800,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(dram, ignore_errors=True)
    total = 4 * args.mib
    print(
        f"4 ranks on 2 hosts, {total} MiB checkpoint ({args.mib} MiB of own shards per rank), 4 MiB chunks\n"
    )
    memcpy = max(r["memcpy"] for r in out)
    print(
        "| restore from | seconds | GiB/s | of memcpy's | from DRAM | from local disks | from shared | "
        "over the fabric |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| memcpy of the same bytes (every rank its own) | {memcpy:.2f} | {total / 1024 / memcpy:.2f} | "
        "100% | | | | |"
    )
    dcp = max(r["dcp"][0] for r in out)
    for case, label in CASES.items():
        seconds = max(r[case][0] for r in out)
        by_tier, fabric = out[0][case][1], out[0][case][2]  # job-wide totals, the same on every rank
        cells = " | ".join(f"{by_tier.get(t, 0) / 2**20:.0f} MiB" for t in ("dram", "local", "shared"))
        print(
            f"| {label} | {seconds:.2f} | {total / 1024 / seconds:.2f} | {memcpy / seconds:.0%} | {cells} | "
            f"{fabric / 2**20:.0f} MiB |"
        )
    print(
        f"| DCP FileSystemReader (baseline) | {dcp:.2f} | {total / 1024 / dcp:.2f} | {memcpy / dcp:.0%} | "
        f"| | {total} MiB | |"
    )
    shared = max(r["shared"][0] for r in out)
    partner = max(r["partner"][0] for r in out)
    print(
        f"\nshoal from shared storage / DCP: {shared / dcp:.2f}x the time; "
        f"partner / shared: {partner / shared:.2f}x"
    )
    print("\nWhere the time went (seconds, the slowest rank in each phase):\n")
    names = [p for p in PHASES if any(p in r[c][3] for r in out for c in CASES)]
    print("| phase | " + " | ".join(label for _, label in CASES.items()) + " |")
    print("|---|" + "---:|" * len(CASES))
    for p in names:
        cells = " | ".join(f"{max(r[c][3].get(p, 0.0) for r in out):.3f}" for c in CASES)
        print(f"| {p} | {cells} |")
    cells = " | ".join(f"{max(r[c][0] for r in out):.3f}" for c in CASES)
    print(f"| the whole load | {cells} |")


if __name__ == "__main__":
    main()
