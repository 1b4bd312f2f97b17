"""What checking that every rank made a collective call costs a save, against the vote it precedes.

``Checkpointer.save`` and ``load`` first check, on the job's store, that every rank made the same
call (:meth:`shoal.engine.runtime.Runtime.enter_collective`): a few store round trips and a short
poll. This measures that check on ``--ranks`` processes of one host (a ``FileStore`` like the test
harness's, or a ``TCPStore`` with ``--tcp``), beside what the save already does at that point: one
``all_gather_object`` on the default gloo group (the skip vote). Prints the median and p90 of each
in milliseconds and their ratio.

Usage: ``python benchmarks/collective_entry.py --ranks 4 --calls 200``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.group.fabric import Board

Timings = dict[int, tuple[list[float], list[float]]]


def _rank(rank: int, world: int, init: str, calls: int, out: Timings) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    board = Board.for_job("bench/")
    assert board is not None
    entry: list[float] = []
    vote: list[float] = []
    for i in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        arrival = board.arrive(f"call/{i}", rank, world, 60.0, call=f"save({i})")
        entry.append(time.perf_counter() - t0)
        assert arrival.complete, arrival
        dist.barrier()
        votes: list[object] = [None] * world
        t0 = time.perf_counter()
        dist.all_gather_object(votes, (None, False))
        vote.append(time.perf_counter() - t0)
    out[rank] = (entry, vote)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--tcp", action="store_true", help="a TCPStore on 127.0.0.1 instead of a FileStore")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init = "tcp://127.0.0.1:29533" if args.tcp else f"file://{os.path.join(tmp, 'store')}"
        manager = mp.Manager()
        out = manager.dict()
        mp.start_processes(_rank, args=(args.ranks, init, args.calls, out), nprocs=args.ranks,
                           start_method="spawn")  # fmt: skip
        entry = sorted(x * 1e3 for r in out.values() for x in r[0])
        vote = sorted(x * 1e3 for r in out.values() for x in r[1])

    def q(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    store = "TCPStore" if args.tcp else "FileStore"
    print(f"{args.ranks} ranks, {args.calls} calls each, {store}, {os.cpu_count()} CPUs")
    print("| step | median ms | p90 ms |\n|---|---:|---:|")
    print(f"| entry check (shoal) | {statistics.median(entry):.3f} | {q(entry, 0.9):.3f} |")
    print(f"| skip vote (all_gather_object, gloo) | {statistics.median(vote):.3f} | {q(vote, 0.9):.3f} |")
    print(f"ratio entry / vote (median): {statistics.median(entry) / statistics.median(vote):.2f}")


if __name__ == "__main__":
    sys.exit(main())
