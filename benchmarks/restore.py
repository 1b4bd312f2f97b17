"""Restore a checkpoint on 4 ranks / 2 simulated hosts: from DRAM, from partner copies, from shared storage.

Each rank holds ``--mib`` MiB of its own shards (4 x 256 MiB = 1 GiB by default). After one
save reaches B4, the same job loads it three times, each time with less left: the DRAM slabs
(every chunk on its own host), then the partner copies only (the slabs given back: each
host's chunks come from the other host's local disk over the fabric), then shared storage
only (local disks deleted). Then PyTorch DCP saves the same state with its
``FileSystemWriter`` and loads it back with ``FileSystemReader``: the baseline. Shared and
local tiers live under ``--dir`` (a disk by default); the files were just written, so reads
are mostly served by the page cache on a machine with enough memory. Times are the slowest
rank's ``load`` (collective), with every chunk verified. Usage::

    python benchmarks/restore.py --mib 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from shoal.testing import restore_scenarios
from shoal.testing.multiproc import run_ranks


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
    print("| restore from | seconds | GiB/s | from DRAM | from local disks | from shared | over the fabric |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    dcp = max(r["dcp"][0] for r in out)
    for case, label in (
        ("dram", "DRAM (slabs)"),
        ("partner", "partner copies"),
        ("shared", "shared storage"),
    ):
        seconds = max(r[case][0] for r in out)
        by_tier, fabric = out[0][case][1], out[0][case][2]  # job-wide totals, the same on every rank
        cells = " | ".join(f"{by_tier.get(t, 0) / 2**20:.0f} MiB" for t in ("dram", "local", "shared"))
        print(
            f"| {label} | {seconds:.2f} | {total / 1024 / seconds:.2f} | {cells} | {fabric / 2**20:.0f} MiB |"
        )
    print(f"| DCP FileSystemReader (baseline) | {dcp:.2f} | {total / 1024 / dcp:.2f} | | | {total} MiB | |")
    shared = max(r["shared"][0] for r in out)
    print(f"\nshoal from shared storage / DCP: {shared / dcp:.2f}x the time")


if __name__ == "__main__":
    main()
