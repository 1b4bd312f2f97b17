"""Stall of ``save`` (time to B1) for a large state, against the physical limit and DCP, in one run.

For a state of ``--gib`` GiB (float32 tensors of ``--tensor-mib`` MiB each) it measures:
  * memcpy: ``copy_`` of every tensor into one pre-faulted buffer (the floor for any staging copy),
  * shoal: ``Checkpointer.save`` until it returns (B1), on the 2nd and later saves (slabs reused),
    plus the time each checkpoint took to reach B4 (committed on the shared tier) in the background,
  * dcp: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (synchronous: its stall is
    the whole save), to the same disk,
  * dcp async: ``torch.distributed.checkpoint.async_save`` with ``FileSystemWriter``, three ways:
    default (the writer stages: a fresh CPU copy of the state each call), with ONE reused
    ``DefaultStager`` (synchronous staging into storages it caches across saves), and with one reused
    ``DefaultStager`` staging in its own thread. Stall = until ``async_save`` returns (for the
    thread-staged one: until its ``staging_completion``, when training may mutate its tensors again);
    completion = until the upload future is done. Like shoal, the 2nd and later saves, each after the
    previous one finished.
Single process, no process group (``no_dist=True``). Prints a Markdown table with ratios.
``--metrics on`` runs shoal with its Prometheus endpoint (``Config.metrics_port``, a free port on
127.0.0.1) scraped every ``--scrape-interval`` seconds (default 1.0; a Prometheus scrapes every 15
s by default) by a thread of the benchmark; ``--metrics both`` measures shoal's saves with metrics
off and on, alternating, back to back (off, on, off, on, off, on), and prints both medians and
their ratio. Those saves each start quiet: after ``os.sync()`` (no write-back of the previous
drain meanwhile) and the previous checkpoint's retention pass, since the difference sought is a
few percent of a stall that the page cache's write-back alone can double.
Usage: ``python benchmarks/stall.py --gib 1 --repeats 5``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
import warnings

import torch
import torch.distributed.checkpoint as dcp
from dcp_baselines import make_stager, timed_async_save

import shoal

ASYNC_KINDS = ("default", "stager", "stager-thread")
"""``async_save`` variants: the writer stages (default), one reused DefaultStager, and that in a thread."""


def async_save_seconds(
    state: dict[str, torch.Tensor], root: str, repeats: int, kind: str, *, mutate: bool = True
) -> tuple[list[float], list[float], float]:
    """(stalls, completions, first stall) of ``dcp.async_save``; each save after the previous finished.

    The first save is a warm-up (the reused stager allocates its storages there) and is not in the lists.
    """
    stager = make_stager(kind)
    stalls, done, first = [], [], None
    try:
        for step in range(repeats + 1):
            if mutate:
                for t in state.values():
                    t[0] += 1.0
            path = os.path.join(root, f"dcp-async-{kind}-{step}")
            stall, total = timed_async_save(state, path, stager)
            shutil.rmtree(path)
            if first is None:
                first = stall
                continue
            stalls.append(stall)
            done.append(total)
    finally:
        if stager is not None:
            stager.close()
    assert first is not None
    return stalls, done, first


def make_state(gib: float, tensor_mib: int) -> dict[str, torch.Tensor]:
    n = max(1, int(gib * 1024 / tensor_mib))
    numel = tensor_mib * (1 << 20) // 4
    return {f"layer{i}.weight": torch.randn(numel) for i in range(n)}


def memcpy_seconds(state: dict[str, torch.Tensor], repeats: int) -> list[float]:
    total = sum(t.numel() for t in state.values())
    dst = torch.empty(total, dtype=torch.float32)
    dst.fill_(0)  # pre-fault
    out = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        pos = 0
        for t in state.values():
            dst[pos : pos + t.numel()].copy_(t)
            pos += t.numel()
        out.append(time.perf_counter() - t0)
    return out[1:]


class Scraper:
    """Scrapes a metrics endpoint every ``interval`` seconds in a thread (what a Prometheus does, faster)."""

    def __init__(self, url: str, interval: float = 1.0) -> None:
        self.url, self.interval, self.scrapes = url, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with urllib.request.urlopen(self.url, timeout=30) as reply:
                reply.read()
            self.scrapes += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.scrapes


def shoal_seconds(
    state: dict[str, torch.Tensor],
    root: str,
    dram: str,
    repeats: int,
    *,
    metrics: bool = False,
    job: str = "bench",
    scrape_interval: float = 1.0,
    quiet: bool = False,
) -> tuple[list[float], list[float], float]:
    cfg = shoal.Config(
        shared=os.path.join(root, "shoal-shared"),
        local=os.path.join(root, "local"),
        dram=dram,
        job=job,
        keep_last=2,
        metrics_port=0 if metrics else None,
        metrics_addr="127.0.0.1",
    )
    b1, b4 = [], []
    with shoal.Checkpointer(cfg) as ckpt:
        server = ckpt.runtime.metrics_server
        if metrics and server is None:
            raise SystemExit("--metrics: the metrics endpoint did not start (see the log)")
        scraper = Scraper(server.url, scrape_interval) if server is not None else None
        first = None
        for step in range(repeats + 1):
            for t in state.values():
                t[0] += 1.0  # every save has new bytes in every tensor (no dedup shortcut)
            if quiet:
                ckpt.wait(600)  # the previous checkpoint's retention pass
                os.sync()
                time.sleep(0.3)
            t0 = time.perf_counter()
            h = ckpt.save(step, state)
            stall = time.perf_counter() - t0
            h.wait(shoal.Boundary.RESTARTABLE, timeout=600)
            if first is None:
                first = stall
                continue
            b1.append(stall)
            b4.append(h.times[shoal.Boundary.RESTARTABLE])
        if scraper is not None and scraper.stop() == 0 and scrape_interval < 1.0:
            raise SystemExit("--metrics: the endpoint was never scraped")
    assert first is not None
    return b1, b4, first


def shoal_with_and_without_metrics(
    state: dict[str, torch.Tensor],
    root: str,
    dram: str,
    repeats: int,
    scrape_interval: float,
    rounds: int = 3,
) -> dict[str, list[float]]:
    """Shoal's stalls with metrics off and on, alternating (off, on, off, on, ...): saves 2+ of each."""
    out: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for mode in ("off", "on"):
            b1, _, _ = shoal_seconds(
                state,
                root,
                dram,
                repeats,
                metrics=mode == "on",
                job=f"bench-{mode}-{r}",
                scrape_interval=scrape_interval,
                quiet=True,
            )
            out[mode] += b1
    return out


def dcp_seconds(state: dict[str, torch.Tensor], root: str, repeats: int) -> list[float]:
    out = []
    for step in range(repeats):
        path = os.path.join(root, f"dcp-{step}")
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        out.append(time.perf_counter() - t0)
        shutil.rmtree(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--root", default=None, help="directory for shared-tier and DCP output (default: a temp dir)"
    )
    parser.add_argument(
        "--metrics",
        choices=("off", "on", "both"),
        default="off",
        help="shoal's Prometheus endpoint: off (default), on (scraped), or both, alternating",
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between scrapes with --metrics"
    )
    args = parser.parse_args()
    state = make_state(args.gib, args.tensor_mib)
    nbytes = sum(t.numel() * 4 for t in state.values())
    root = args.root or tempfile.mkdtemp(prefix="shoal-bench-")
    dram = tempfile.mkdtemp(prefix="shoal-bench-dram-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    compared: dict[str, list[float]] | None = None
    try:
        mem = memcpy_seconds(state, args.repeats)
        if args.metrics == "both":
            compared = shoal_with_and_without_metrics(state, root, dram, args.repeats, args.scrape_interval)
        metrics_on = args.metrics == "on"
        b1, b4, first = shoal_seconds(
            state, root, dram, args.repeats, metrics=metrics_on, scrape_interval=args.scrape_interval
        )
        base = dcp_seconds(state, root, args.repeats)
        asyncs = {k: async_save_seconds(state, root, args.repeats, k) for k in ASYNC_KINDS}
    finally:
        shutil.rmtree(dram, ignore_errors=True)
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    gib = nbytes / 2**30
    med = statistics.median
    rows = [
        ("memcpy into pre-faulted memory", med(mem)),
        ("shoal save() stall (to B1), saves 2+", med(b1)),
        ("shoal time to B4 (background, committed)", med(b4)),
        ("dcp.save + FileSystemWriter (stall = whole save)", med(base)),
        ("dcp.async_save default: stall (until it returns)", med(asyncs["default"][0])),
        ("dcp.async_save default: until its future completes", med(asyncs["default"][1])),
        ("dcp.async_save + reused DefaultStager: stall", med(asyncs["stager"][0])),
        ("dcp.async_save + reused DefaultStager: until complete", med(asyncs["stager"][1])),
        (
            "dcp.async_save + reused DefaultStager, thread staging: stall (staging done)",
            med(asyncs["stager-thread"][0]),
        ),
        (
            "dcp.async_save + reused DefaultStager, thread staging: until complete",
            med(asyncs["stager-thread"][1]),
        ),
    ]
    print(
        f"state: {len(state)} float32 tensors, {gib:.2f} GiB; median of {args.repeats} runs "
        f"(shoal's first save, slabs being created: {first:.3f} s)\n"
    )
    ref = med(asyncs["stager"][0])
    print("| what | seconds | GiB/s | x memcpy | dcp.save / this | this / async_save stall (reused stager) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in rows:
        print(
            f"| {name} | {s:.3f} | {gib / s:.2f} | {s / med(mem):.2f} | {med(base) / s:.1f} | {s / ref:.2f} |"
        )
    print(
        f"\nraw: memcpy {[round(x, 3) for x in mem]}, shoal B1 {[round(x, 3) for x in b1]}, "
        f"shoal B4 {[round(x, 3) for x in b4]}, dcp {[round(x, 3) for x in base]}"
    )
    for k in ASYNC_KINDS:
        st, dn, f1 = asyncs[k]
        print(
            f"raw: async_save {k}: stall {[round(x, 3) for x in st]}, complete {[round(x, 3) for x in dn]} "
            f"(first save's stall {f1:.3f})"
        )
    if args.metrics != "off":
        print(
            f"\nmetrics: {args.metrics} (the table's shoal rows: metrics "
            f"{'on' if args.metrics == 'on' else 'off'})"
        )
    if compared is not None:
        off, on = med(compared["off"]), med(compared["on"])
        print(
            f"shoal stall, metrics off: median {off:.4f} s of {len(compared['off'])} saves; metrics on "
            f"(scraped every {args.scrape_interval:g} s): median {on:.4f} s of {len(compared['on'])}; "
            f"on / off = {on / off:.3f}"
        )
        print(
            f"raw: off {[round(x, 4) for x in compared['off']]}, on {[round(x, 4) for x in compared['on']]}"
        )


if __name__ == "__main__":
    main()
