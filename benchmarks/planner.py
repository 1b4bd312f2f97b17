"""Seconds the group save planner takes on its own, for 64 to 16,384 ranks (docs/design.md section 3).

Every rank reports ``--chunks`` chunks of 4 MiB in items of ``--chunks-per-item`` chunks; hosts
hold ``--ranks-per-host`` ranks, partners by the ring scheme, nothing durable or held yet (a
first checkpoint). Workloads:

* ``dp``: pure data parallel: every rank holds the same chunks;
* ``dp+zero``: data parallel plus ZeRO-like optimizer shards: ``--shared`` chunks held by every
  rank, the rest (in two items) unique to each rank;
* ``unique``: every chunk of every rank is different (fully sharded state).

Each rank's report is a :class:`~shoal.group.plan.ChunkTable` (keys and sizes per item, every
digest as 32 raw bytes in one buffer, and the digests' 8-byte prefixes the rank made), unpickled
from its own bytes, as the group save's exchange delivers it (``ReportItem.digests`` are views
of one buffer per rank and ``RankReport.prefixes`` its prefixes, which the coordinator hands
the planner as a table): ``--inputs compact``, the planner's one input form. Building the
reports is not timed.

The timed call is ``plan_group_save`` (a fresh plan), and ``PlanCache.lookup_or_plan`` for
equal reports in new objects, as the next checkpoint of an unchanged model delivers them
(``cache hit``: layout and every digest compared, the plan reused).
Prints a Markdown table. Usage::

    python benchmarks/planner.py --ranks 64 1024 16384 --workloads dp dp+zero unique --inputs compact
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable

from shoal.group.digests import Digests
from shoal.group.plan import ChunkTable, GroupPlan, RankChunks
from shoal.group.planner import PlanCache, plan_group_save
from shoal.group.topology import build_topology

CHUNK = 4 << 20


def _sent(table: ChunkTable) -> ChunkTable:
    """``table`` through a pickle with the prefixes its rank made, as the exchange delivers a report."""
    t, prefix = pickle.loads(pickle.dumps((table, table.digests.prefixes())))
    return ChunkTable.uniform(t.keys, t.nbytes, CHUNK, t.digests, prefix)


def build(workload: str, n_ranks: int, args: argparse.Namespace) -> list[RankChunks]:
    """Every rank's report as a table, unpickled from its own bytes (as the exchange delivers it)."""
    shared = {"dp": args.chunks, "dp+zero": args.shared, "unique": 0}[workload]
    n_own = args.chunks - shared
    per_own = max(1, -(-n_own // 2)) if workload == "dp+zero" else args.chunks_per_item
    common = os.urandom(32 * shared)

    def layout(prefix: str, n: int, per_item: int) -> tuple[list[str], list[int]]:
        sizes = [min(per_item, n - a) for a in range(0, n, per_item)]
        return [sys.intern(f"{prefix}.{j}") for j in range(len(sizes))], [CHUNK * k for k in sizes]

    k1, n1 = layout("model", shared, args.chunks_per_item)
    k2, n2 = layout("optim", n_own, per_own)
    ranks = []
    for r in range(n_ranks):
        table = ChunkTable.uniform(k1 + k2, n1 + n2, CHUNK, Digests(common + os.urandom(32 * n_own)))
        ranks.append(RankChunks(r, f"host{r // args.ranks_per_host}", _sent(table)))
    return ranks


def copied(ranks: list[RankChunks]) -> list[RankChunks]:
    """Equal reports in new objects (the next checkpoint's exchange)."""
    return [RankChunks(rc.rank, rc.host, _sent(rc.items)) for rc in ranks]


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(ranks: list[RankChunks], again: list[RankChunks], repeats: int) -> tuple[GroupPlan, float, float]:
    """The plan, the median seconds of a fresh plan, and of a PlanCache hit for equal reports
    in new objects (``again``)."""
    topo = build_topology([rc.host for rc in ranks])
    plan = plan_group_save(0, ranks, set(), topo)
    seconds = timed(lambda: plan_group_save(0, ranks, set(), topo), repeats)
    cache = PlanCache()
    cache.lookup_or_plan(0, ranks, set(), topo)
    hit = timed(lambda: cache.lookup_or_plan(1, again, set(), topo), repeats)
    assert cache.hits == repeats
    return plan, seconds, hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 16384])
    ap.add_argument(
        "--workloads", nargs="+", default=["dp", "dp+zero", "unique"], choices=["dp", "dp+zero", "unique"]
    )
    ap.add_argument(
        "--inputs", nargs="+", default=["compact"], choices=["compact"], help="the planner's one input form"
    )
    ap.add_argument("--chunks", type=int, default=1000, help="chunks per rank")
    ap.add_argument("--chunks-per-item", type=int, default=5)
    ap.add_argument("--shared", type=int, default=900, help="chunks every rank holds (dp+zero)")
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    print(
        f"{args.chunks} chunks of 4 MiB per rank, {args.chunks_per_item} chunks per item, "
        f"{args.ranks_per_host} ranks per host, ring partners; median of {args.repeats} runs.\n"
    )
    print("| workload | inputs | ranks | plan (s) | cache hit (s) | unique GiB | drainers | transfers |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for workload in args.workloads:
        for inputs in args.inputs:
            for n in args.ranks:
                ranks = build(workload, n, args)
                again = copied(ranks)
                plan, seconds, hit = measure(ranks, again, args.repeats)
                print(
                    f"| {workload} | {inputs} | {n:,} | {seconds:.3f} | {hit:.3f} | "
                    f"{plan.unique_bytes / 2**30:,.1f} | {len(plan.drains):,} | {len(plan.transfers):,} |",
                    flush=True,
                )
                del ranks, again, plan
                gc.collect()


if __name__ == "__main__":
    main()
