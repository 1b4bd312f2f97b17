"""Group save on one machine: N gloo ranks on simulated hosts (2 ranks per host).

Reports, per rank count, the coordination overhead per checkpoint (time inside the
pipeline's control collectives: exchange of chunk lists, plan broadcast, replica and
drain acknowledgements, outcome), and the time to B1, B2, B3 and B4.
Usage: ``python benchmarks/group_save.py --ranks 2 4 8 --mib 8`` and
``python benchmarks/group_save.py --ranks 4 --mib 256`` (1 GiB over 4 ranks).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile

from shoal.testing import scenarios
from shoal.testing.multiproc import run_ranks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mib", type=int, default=8, help="MiB of state per rank")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.mib} MiB per rank, median over {args.repeats} checkpoints after a warm-up one\n")
    print("| ranks | hosts | coordination ms | B1 s | B2 s | B3 s | B4 s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.ranks:
        root = tempfile.mkdtemp(prefix="shoal-bench-group-", dir="/dev/shm")
        try:
            hosts = [f"h{r // 2}" for r in range(n)]
            out = run_ranks(
                scenarios.bench_group_save,
                hosts=hosts,
                kwargs={"root": root, "mib_per_rank": args.mib, "repeats": args.repeats},
                timeout=900,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        med = statistics.median
        coord = med(max(r["coordination"][i] for r in out) for i in range(args.repeats))
        b = {k: med(max(r["times"][i][k] for r in out) for i in range(args.repeats)) for k in (1, 2, 3, 4)}
        cells = " | ".join(f"{b[k]:.3f}" for k in (1, 2, 3, 4))
        print(f"| {n} | {len(set(hosts))} | {coord * 1e3:.1f} | {cells} |")


if __name__ == "__main__":
    main()
