"""The KV store's read path alone and under contention, for one version of shoal at a time.

Three measurements on one host pool (a tmpfs directory):

* ``get64``: ``get_batch_into`` of 64 blocks that are all in the DRAM pool, into buffers allocated
  once (the serving engine's hot path): median and p90 seconds per call over ``--reps`` calls.
* ``contention``: while another process stores a ``--batch``-key ``put_batch`` (small blocks, into a
  pool that has to evict for it), this process calls ``get_batch_into(deadline=now + d)`` on 64
  DRAM blocks in a loop; reported: how long each call took, and by how much it overran its deadline
  (p50, p99, max), next to the same loop with no writer; and the longest index write transaction
  the writer held (``KVStats.longest_index_write_s``: what any other process's put may wait for).
* ``linear``: seconds of one ``put_batch`` of n keys the pool holds (its least recently used) and n
  new ones into a full pool, for n = 1,000 and 10,000 (each new key evicts, and a batch never
  evicts a key it lists): the ratio is 10 when a batch costs time linear in its size.

Compare two versions by running the script with each on ``PYTHONPATH`` and ``--out``, then
``--compare a.json b.json``::

    PYTHONPATH=/path/to/old/src python benchmarks/kv_contention.py --out /tmp/before.json
    PYTHONPATH=src python benchmarks/kv_contention.py --out /tmp/after.json
    python benchmarks/kv_contention.py --compare /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

BLOCK = 64 << 10
SMALL = 4 << 10


def _keys(n: int, seq: str) -> list[Any]:
    from shoal.kv import chain_keys

    return chain_keys("bench/kv-contention", 0, [seq, *range(n - 1)])


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "p50": xs[len(xs) // 2],
        "p90": xs[int(len(xs) * 0.9)],
        "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))],
        "max": xs[-1],
        "mean": statistics.fmean(xs),
        "n": len(xs),
    }


def _writer(root: str, cap: int, batch: int, started: Any, done: Any, longest: Any) -> None:
    from shoal.kv import KVConfig, KVStore

    with KVStore(KVConfig(root, cap, writeback=False, high_water=1.0)) as store:
        data = [os.urandom(SMALL)] * batch
        started.set()
        for rnd in range(3):
            store.put_batch(_keys(batch, f"writer-{rnd}"), data)
        longest.value = _longest_write(store)
    done.set()


def _longest_write(store: Any) -> float:
    """The store's longest index write transaction (-1: a version of shoal that does not report it)."""
    return float(getattr(store.stats(), "longest_index_write_s", -1.0))


def _gets(
    store: Any, keys: list[Any], bufs: list[bytearray], d: float, until: Any, reps: int
) -> dict[str, Any]:
    took: list[float] = []
    over: list[float] = []
    hits = 0
    for i in range(reps):
        if until is not None and until.is_set() and i > 10:
            break
        t0 = time.monotonic()
        results = store.get_batch_into(keys, bufs, deadline=t0 + d)
        t1 = time.monotonic()
        took.append(t1 - t0)
        over.append(max(0.0, t1 - (t0 + d)))
        hits += sum(r.status == "hit" for r in results)
    return {"took": _quantiles(took), "overrun": _quantiles(over), "hit_ratio": hits / (64 * len(took))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import shoal
    from shoal.kv import KVConfig, KVStore
    from shoal.kv.pool import physical_bytes

    base = tempfile.mkdtemp(prefix="shoal-kv-bench-", dir="/dev/shm")
    out: dict[str, Any] = {"shoal": os.path.dirname(shoal.__file__), "python": sys.version.split()[0]}
    try:
        # -- get64 -------------------------------------------------------------------------------
        root = os.path.join(base, "get64")
        with KVStore(KVConfig(root, 128 * physical_bytes(BLOCK), high_water=1.0)) as store:
            keys = _keys(64, "hot")
            store.put_batch(keys, [os.urandom(BLOCK) for _ in keys])
            bufs = [bytearray(BLOCK) for _ in keys]
            for _ in range(50):
                store.get_batch_into(keys, bufs)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                store.get_batch_into(keys, bufs)
                times.append(time.perf_counter() - t0)
            out["get64"] = _quantiles(times)
        # -- contention --------------------------------------------------------------------------
        root = os.path.join(base, "contention")
        cap = 64 * physical_bytes(BLOCK) + args.batch * physical_bytes(SMALL)
        with KVStore(KVConfig(root, cap, writeback=False, high_water=1.0)) as store:
            keys = _keys(64, "hot")
            store.put_batch(keys, [os.urandom(BLOCK) for _ in keys])
            lease = store.pin(keys, lease_s=3600)  # the writer's evictions never take the hot blocks
            bufs = [bytearray(BLOCK) for _ in keys]
            out["quiet"] = _gets(store, keys, bufs, args.deadline, None, args.reps)
            ctx = mp.get_context("spawn")
            started, done, longest = ctx.Event(), ctx.Event(), ctx.Value("d", -1.0)
            proc = ctx.Process(target=_writer, args=(root, cap, args.batch, started, done, longest))
            proc.start()
            started.wait(120)
            out["contention"] = _gets(store, keys, bufs, args.deadline, done, 10**9)
            proc.join(600)
            out["contention"]["writer_longest_write_s"] = longest.value
            store.unpin(lease)
        # -- linear ------------------------------------------------------------------------------
        for n in (1000, 10000):
            root = os.path.join(base, f"linear{n}")
            cap = 2 * n * physical_bytes(SMALL)
            with KVStore(KVConfig(root, cap, writeback=False, high_water=1.0)) as store:
                data = [os.urandom(SMALL)] * n
                old = _keys(n, "old")
                store.put_batch(old, data)  # the least recently used: the batch below lists them
                store.put_batch(_keys(n, "other"), data)  # full now: the batch below evicts these
                t0 = time.perf_counter()
                store.put_batch(old + _keys(n, "timed"), data + data)  # n present, n new
                out[f"put{n}_s"] = time.perf_counter() - t0
                out[f"put{n}_longest_write_s"] = _longest_write(store)
        out["linear_ratio"] = out["put10000_s"] / out["put1000_s"]
        out["args"] = vars(args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def report(name: str, r: dict[str, Any]) -> None:
    print(f"{name}: {r['shoal']}")
    g = r["get64"]
    print(
        f"  get_batch_into, 64 DRAM blocks of {BLOCK >> 10} KiB: "
        f"p50 {g['p50'] * 1e6:.0f} us, p90 {g['p90'] * 1e6:.0f} us"
    )
    for mode in ("quiet", "contention"):
        c = r[mode]
        print(
            f"  {mode:10s} deadline {r['args']['deadline'] * 1e3:.0f} ms: "
            f"call p50 {c['took']['p50'] * 1e3:.2f} ms, p99 {c['took']['p99'] * 1e3:.2f} ms, "
            f"max {c['took']['max'] * 1e3:.2f} ms; overrun p99 {c['overrun']['p99'] * 1e3:.2f} ms, "
            f"max {c['overrun']['max'] * 1e3:.2f} ms; hits {c['hit_ratio']:.1%} ({c['took']['n']} calls)"
        )
    print(
        f"  put_batch of 1,000 / 10,000 held + as many new keys into a full pool: {r['put1000_s']:.3f} s / "
        f"{r['put10000_s']:.3f} s (ratio {r['linear_ratio']:.1f}; 10 is linear)"
    )
    held = [
        r["contention"].get("writer_longest_write_s", -1.0),
        r.get("put10000_longest_write_s", -1.0),
    ]
    if max(held) >= 0:
        print(
            "  longest index write transaction: "
            f"{held[0] * 1e3:.1f} ms (the contending writer), {held[1] * 1e3:.1f} ms (the 10,000-key batch)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2000, help="get64 calls timed (default 2000)")
    ap.add_argument(
        "--batch", type=int, default=10000, help="keys of the contending put_batch (default 10000)"
    )
    ap.add_argument("--deadline", type=float, default=0.05, help="seconds each contended get may take")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="report two saved runs")
    args = ap.parse_args()
    if args.compare:
        saved = []
        for path in args.compare:
            with open(path) as f:
                saved.append(json.load(f))
        before, after = saved
        report("before", before)
        report("after", after)
        ratio = after["get64"]["p50"] / before["get64"]["p50"]
        print(f"get64 p50 after / before: {ratio:.3f}")
        return
    r = run(args)
    report("this run", r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
