"""``dcp.async_save`` through shoal's writer against ``Checkpointer.save``: the stall, in one run.

For two states, a large one (``--gib`` GiB of float32 tensors of 64 MiB) and a many-item one
(``--count`` float32 tensors of ``--bytes`` bytes), it measures, on one ``Checkpointer``:
  * ``Checkpointer.save``: until it returns (B1);
  * ``dcp.async_save(state, storage_writer=shoal.dcp.StorageWriter(ckpt, step))``: until it returns
    (shoal stages in the calling thread: B1), and until its future completes (B4 by default);
  * for reference, in a separate phase afterwards (its fresh full copies would disturb shoal's),
    ``dcp.async_save`` with DCP's ``FileSystemWriter`` and its default staging.
The two shoal doors alternate, and which goes first alternates too. Every save starts after the
previous one reached B4 and its retention pass ran (``Checkpointer.wait``), and after ``os.sync()``
(no write-back of earlier saves' page cache meanwhile); every tensor changes before every save
(nothing deduplicates). The first round is a warm-up (slabs created); medians of the rest.
Single process (``no_dist=True``). Prints a Markdown table.

The many-item state runs twice: nested under one key, as frameworks pass it (``{"model": ...}``),
and with every tensor a top-level key. ``dcp.async_save`` itself wraps the ``state_dict()``
resolution of each *top-level* key in its logging wrapper before it calls any stager (about 20 us
a key, whichever writer): the third row shows that cost, which ``Checkpointer.save`` skips; the
table gives it (timed alone, on the same state) and the ratio without it.
Usage: ``python benchmarks/async_door.py --gib 1 --count 20000 --bytes 1024 --repeats 5``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

import shoal
from shoal.testing.bench.scratch import scratch


def _bump(state: dict[str, Any]) -> None:
    for t in state.values():
        if isinstance(t, dict):
            _bump(t)
        else:
            t[0] += 1.0


def _quiet() -> None:
    """Before each timed save: no dirty page cache left for the kernel to write back meanwhile."""
    os.sync()
    time.sleep(0.2)


def _shoal_save(ckpt: shoal.Checkpointer, step: int, state: dict[str, Any]) -> tuple[float, float]:
    t0 = time.perf_counter()
    h = ckpt.save(step, state)
    stall = time.perf_counter() - t0
    h.wait(timeout=600)
    return stall, time.perf_counter() - t0


def _shoal_async(ckpt: shoal.Checkpointer, step: int, state: dict[str, Any]) -> tuple[float, float]:
    writer = shoal.dcp.StorageWriter(ckpt, step)
    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
    stall = time.perf_counter() - t0
    fut.result(timeout=600)
    return stall, time.perf_counter() - t0


def measure(state: dict[str, Any], root: str, dram: str, repeats: int) -> dict[str, list[float]]:
    cfg = shoal.Config(
        shared=os.path.join(root, "shared"),
        local=os.path.join(root, "local"),
        dram=dram,
        job="bench",
        keep_last=2,
    )
    out: dict[str, list[float]] = {k: [] for k in ("save", "save_done", "async", "async_done")}
    doors = {"save": _shoal_save, "async": _shoal_async}
    step = 0
    with shoal.Checkpointer(cfg) as ckpt:
        for i in range(repeats + 1):
            # The two doors alternate which goes first, so neither always follows the other.
            for name in ("save", "async") if i % 2 else ("async", "save"):
                _bump(state)
                step += 1
                _quiet()
                stall, done = doors[name](ckpt, step, state)
                ckpt.wait(600)  # and its retention pass: every save starts with the pipeline idle
                if i:
                    out[name].append(stall)
                    out[name + "_done"].append(done)
    # For reference, after shoal's runs (its fresh 1 GiB copies would disturb them): DCP's own door.
    out["dcp_async"], out["dcp_done"] = [], []
    for i in range(repeats + 1):
        _bump(state)
        path = os.path.join(root, f"dcp-{i}")
        _quiet()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        stall = time.perf_counter() - t0
        fut.result(timeout=600)
        done = time.perf_counter() - t0
        shutil.rmtree(path)
        if i:
            out["dcp_async"].append(stall)
            out["dcp_done"].append(done)
    # What dcp.async_save spends before it calls any stager (its per-top-level-key logging wrapper).
    out["dcp_pre"] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _stateful_to_state_dict(state)
        out["dcp_pre"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP's note on every no_dist save
    states = {
        f"{args.gib:g} GiB in 64 MiB tensors": {
            f"layer{i}.weight": torch.randn(16 << 20) for i in range(max(1, int(args.gib * 16)))
        },
    }
    small = {f"p{i}": torch.randn(args.bytes // 4) for i in range(args.count)}
    states[f"{args.count} tensors of {args.bytes} B under one key (model)"] = {"model": small}
    states[f"{args.count} tensors of {args.bytes} B, each a top-level key"] = dict(small)
    med = statistics.median
    print(
        "| state | Checkpointer.save stall | dcp.async_save (shoal) stall | ratio "
        "| of it, DCP before the stager | ratio without that | its future done (B4) "
        "| dcp.async_save (FileSystemWriter) stall | its future done |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, state in states.items():
        with scratch("shoal-async-") as (root, dram):
            r = measure(state, root, dram, args.repeats)
        ratio = med(r["async"]) / med(r["save"])
        pre = med(r["dcp_pre"])
        print(
            f"| {name} | {med(r['save']):.3f} s | {med(r['async']):.3f} s | {ratio:.2f} "
            f"| {pre:.3f} s | {(med(r['async']) - pre) / med(r['save']):.2f} | {med(r['async_done']):.3f} s "
            f"| {med(r['dcp_async']):.3f} s | {med(r['dcp_done']):.3f} s |"
        )
        print(
            f"<!-- raw {name}: " + ", ".join(f"{k} {[round(x, 3) for x in v]}" for k, v in r.items()) + " -->"
        )


if __name__ == "__main__":
    main()
