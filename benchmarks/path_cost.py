"""What ``path="auto"`` costs the coordinator: its decision at plan time, and its model's updates.

Two measurements, in one run, on synthetic checkpoint records (no cluster, no root):

* **the decision**: ``decide_path(ModelPolicy, context)`` once an update has landed, for jobs of
  ``--ranks`` writers per checkpoint (each rank drains and receives a partner copy) with a full
  history (64 checkpoints): median, p99 and max over ``--decisions`` calls, and the same while an
  update runs in the background;
* **interference**: the coordinator's own work while the model's updates run back to back, a
  refit each time. The stand-in for the save pipeline is a loop in the main thread that does what
  it does per chunk: a BLAKE3 digest of a 1 MiB chunk, the chunk sent over a local socket pair in
  64 KiB messages and read back, and a little bookkeeping in Python. Its rate (chunks per second)
  is measured alone, with the updates in a worker process (the default, ``nice 19`` at
  ``cpu_share``), and with the updates in a thread of the same process (``worker="thread"``),
  ``--seconds`` each, interleaved ``--rounds`` times. Also the updates' own seconds and CPU.

The decision should cost well under a millisecond; the updates in a thread share the
interpreter lock with the pipeline, in a process they do not. Usage::

    python benchmarks/path_cost.py --ranks 4,16
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import blake3
import numpy as np

from shoal.engine.path import PARTNER, ModelPolicy, PathContext, PathRecord, decide_path
from shoal.model.paths import PathTimes
from shoal.model.writers import WriterFit, WriterSample

MB = 1_000_000
SHARD = 8 << 20
HISTORY = 64


def records(ranks: int, count: int, seed: int = 1) -> list[PathRecord]:
    """``count`` checkpoints of ``ranks`` writers: drains on a contended tier, partner copies on a fabric."""
    rng = np.random.default_rng(seed)
    tier = WriterFit("gamma", 40 * MB, 60 * MB, 0.15, 0.2, 0.0, 0)
    fabric = WriterFit("lognormal", 20 * MB, 1e12, 0.05, 0.05, 0.0, 0)
    out = []
    for k in range(1, count + 1):
        drain = [
            WriterSample(k, s.nbytes, s.seconds, ranks, float(k))
            for s in tier.simulate(rng, [SHARD] * ranks, 1)
        ]
        copies = [
            WriterSample(k, s.nbytes, s.seconds, ranks, float(k))
            for s in fabric.simulate(rng, [SHARD] * ranks, 1)
        ]
        pre = 0.2
        b2 = pre + 0.05 + max(s.seconds for s in copies)
        b3 = b2 + max(s.seconds for s in drain) + 0.05
        times = PathTimes(k, PARTNER, ranks * SHARD, pre, b2, b2, b3, tuple(drain), tuple(copies))
        out.append(PathRecord(k, PARTNER, ranks * SHARD, {}, times=times))
    return out


def context(recs: list[PathRecord], ranks: int) -> PathContext:
    hosts = tuple(f"h{i}" for i in range(max(2, ranks // 8)))
    return PathContext(len(recs) + 1, ranks, hosts, ranks * SHARD, can_replicate=True, recent=tuple(recs))


def decision_cost(ranks: int, decisions: int) -> dict[str, Any]:
    """Seconds of one decision after an update landed, and while the next one runs."""
    recs = records(ranks, HISTORY)
    policy = ModelPolicy(refit_every=1)
    try:
        policy.observe(recs)
        assert policy.wait(600), "the model's update did not land"
        ctx = context(recs, ranks)
        quiet = [decide_path(policy, ctx).cost["decide_s"] for _ in range(decisions)]  # type: ignore[index]
        busy: list[float] = []
        policy.observe(recs)  # an update (a refit) under way meanwhile
        while len(busy) < decisions:
            busy.append(decide_path(policy, ctx).cost["decide_s"])  # type: ignore[index]
        policy.wait(600)
        last = decide_path(policy, ctx)
        update = (last.cost or {}).get("update", {})
    finally:
        policy.close()
    return {"ranks": ranks, "quiet": quiet, "busy": busy, "update": update, "path": last.path}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Pipeline:
    """The stand-in for the coordinator's save pipeline: hash, send, receive, bookkeeping, per chunk."""

    def __init__(self) -> None:
        self.chunk = memoryview(os.urandom(1 << 20))
        self.a, self.b = socket.socketpair()
        self.buf = bytearray(64 << 10)

    def run(self, seconds: float) -> float:
        """Chunks per second over ``seconds``."""
        done, end = 0, time.perf_counter() + seconds
        index: dict[str, int] = {}
        while time.perf_counter() < end:
            digest = blake3.blake3(self.chunk).hexdigest()
            for off in range(0, len(self.chunk), len(self.buf)):
                self.a.sendall(self.chunk[off : off + len(self.buf)])
                got = 0
                while got < len(self.buf):
                    got += self.b.recv_into(memoryview(self.buf)[got:])
            index[digest[:16]] = done  # the plan's bookkeeping
            for k in range(64):
                index[f"{digest[:8]}-{k}"] = k
            done += 1
        return done / seconds

    def close(self) -> None:
        self.a.close()
        self.b.close()


def interference(ranks: int, seconds: float, rounds: int) -> dict[str, Any]:
    """The pipeline's rate alone and beside back-to-back updates in a process and in a thread."""
    recs = records(ranks, HISTORY)
    pipe = Pipeline()
    rates: dict[str, list[float]] = {"alone": [], "process": [], "thread": []}
    updates: dict[str, list[dict[str, Any]]] = {"process": [], "thread": []}
    try:
        for _ in range(rounds):
            rates["alone"].append(pipe.run(seconds))
            for worker in ("process", "thread"):
                policy = ModelPolicy(refit_every=1, worker=worker)
                policy.observe(recs)  # the worker started and the first fit made before timing
                policy.wait(600)
                stop = threading.Event()

                def drive(p: ModelPolicy = policy, ev: threading.Event = stop, w: str = worker) -> None:
                    while not ev.is_set():
                        p.observe(recs)
                        p.wait(600)
                        cost = p.last_update
                        if cost:
                            updates[w].append(dict(cost))

                driver = threading.Thread(target=drive, daemon=True)
                driver.start()
                try:
                    rates[worker].append(pipe.run(seconds))
                finally:
                    stop.set()
                    driver.join(600)
                    policy.close()
    finally:
        pipe.close()
    return {"ranks": ranks, "rates": rates, "updates": updates}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,16", help="writers per checkpoint (comma-separated)")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=4.0, help="each interference measurement")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    print(f"{os.cpu_count()} CPUs; python {sys.version.split()[0]}\n")
    print(
        "| ranks | decision median ms | p99 ms | max ms | while an update runs: median ms | max ms | path |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    for n in ranks:
        d = decision_cost(n, args.decisions)
        q, b = d["quiet"], d["busy"]
        print(
            f"| {n} | {statistics.median(q) * 1e3:.4f} | {_pct(q, 0.99) * 1e3:.4f} | {max(q) * 1e3:.4f} | "
            f"{statistics.median(b) * 1e3:.4f} | {max(b) * 1e3:.4f} | {d['path']} |"
        )
    print()
    print(
        "| ranks | pipeline alone, chunks/s | beside updates in a process | ratio | "
        "beside updates in a thread | ratio | updates (process / thread) | refit CPU s (process / thread) | "
        "refit wall s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in ranks:
        r = interference(n, args.seconds, args.rounds)
        alone = statistics.median(r["rates"]["alone"])
        proc = statistics.median(r["rates"]["process"])
        thread = statistics.median(r["rates"]["thread"])
        up, ut = r["updates"]["process"], r["updates"]["thread"]

        def cpu(us: list[dict[str, Any]]) -> str:
            return f"{statistics.median(u['cpu_s'] for u in us):.3f}" if us else ""

        wall = f"{statistics.median(u['wall_s'] for u in up):.3f}" if up else ""
        print(
            f"| {n} | {alone:.1f} | {proc:.1f} | {proc / alone:.3f} | {thread:.1f} | {thread / alone:.3f} | "
            f"{len(up)} / {len(ut)} | {cpu(up)} / {cpu(ut)} | {wall} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
