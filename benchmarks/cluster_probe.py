"""What the emulated cluster's S3 server sustains here, unshaped and shaped (issue 10: measure it first).

Shaped rates are only meaningful while they stay well under what moto (one Python process) and the
two cores can serve: then the links, not the CPU, are the bottleneck. This probe puts and gets
objects from 1 and from all hosts at once through links shaped far above anything the CPU can
serve ("unshaped"), then through a host NIC shaped to ``--mbit``, and prints MiB/s with the
fraction of the shaped rate reached.

    sudo .venv/bin/python benchmarks/cluster_probe.py --hosts 2 --mib 32 --mbit 200
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from shoal.testing.cluster.hosts import Cluster, ClusterSpec, cannot_run

MIB = 1 << 20

CLIENT = """
import json, os, sys, time, s3fs
from shoal.testing.s3 import s3_storage_options
fs = s3fs.S3FileSystem(**s3_storage_options(os.environ["SHOAL_S3_ENDPOINT"]))
bucket, n = sys.argv[1], int(sys.argv[2])
key = f"{bucket}/{os.environ['SHOAL_HOST_ID']}"
data = os.urandom(n)
t0 = time.perf_counter(); fs.pipe(key, data); t1 = time.perf_counter()
back = fs.cat(key); t2 = time.perf_counter()
assert back == data
print(json.dumps({"put": t1 - t0, "get": t2 - t1}))
"""

BUCKET = """
import os, sys
from shoal.testing.s3 import S3Admin
S3Admin(os.environ["SHOAL_S3_ENDPOINT"]).create_bucket(sys.argv[1])
"""


def _round(cluster: Cluster, hosts: list[int], nbytes: int) -> list[dict[str, float]]:
    def one(i: int) -> dict[str, float]:
        done = cluster.run_on(i, [sys.executable, "-c", CLIENT, "probe", str(nbytes)], timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"host {i}: {done.stderr}")
        return dict(json.loads(done.stdout))

    with ThreadPoolExecutor(len(hosts)) as pool:
        return list(pool.map(one, hosts))


def _report(label: str, results: list[dict[str, float]], nbytes: int, limit_mibs: float | None) -> None:
    for op in ("put", "get"):
        slowest = max(r[op] for r in results)
        aggregate = len(results) * nbytes / MIB / slowest
        per = [nbytes / MIB / r[op] for r in results]
        share = "" if limit_mibs is None else f", {aggregate / limit_mibs:.0%} of the shaped {limit_mibs:.1f}"
        print(
            f"| {label} | {op} | {len(results)} | {aggregate:.1f}{share} | "
            + " / ".join(f"{p:.1f}" for p in per)
            + " |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--mib", type=int, default=32, help="object size per client")
    p.add_argument("--mbit", type=float, default=200.0, help="the shaped host NIC for the second half")
    args = p.parse_args()
    why = cannot_run()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    nbytes = args.mib * MIB
    print("| links | op | clients | aggregate MiB/s | per client MiB/s |")
    print("|---|---|---:|---:|---|")
    fast = ClusterSpec(hosts=args.hosts, host_storage_mbit=100000, fabric_mbit=100000, storage_mbit=100000)
    with Cluster(fast) as cluster:
        cluster.run_on(0, [sys.executable, "-c", BUCKET, "probe"])
        _round(cluster, [0], MIB)  # warm-up: the first request of a server is slow
        _report("unshaped", _round(cluster, [0], nbytes), nbytes, None)
        _report("unshaped", _round(cluster, list(range(args.hosts)), nbytes), nbytes, None)
    shaped = ClusterSpec(
        hosts=args.hosts,
        host_storage_mbit=args.mbit,
        fabric_mbit=args.mbit,
        storage_mbit=args.mbit * args.hosts,
    )
    limit = args.mbit * 1e6 / 8 / MIB
    with Cluster(shaped) as cluster:
        cluster.run_on(0, [sys.executable, "-c", BUCKET, "probe"])
        _round(cluster, [0], MIB)
        _report(f"host NIC {args.mbit:g} Mbit/s", _round(cluster, [0], nbytes), nbytes, limit)
        _report(
            f"host NICs {args.mbit:g} Mbit/s each",
            _round(cluster, list(range(args.hosts)), nbytes),
            nbytes,
            limit * args.hosts,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
