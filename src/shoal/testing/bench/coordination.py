"""Coordination overhead on the emulated cluster (``benchmarks/cluster_coord.py``): a tiny state, saved often.

:func:`coord_bench` runs on every rank of a :meth:`shoal.testing.cluster.hosts.Cluster.run_ranks` job.
Each rank holds :func:`tiny_state` (a few KiB of its own, under its own keys, so neither shoal nor
DCP deduplicates it away) and saves it ``saves`` times after one warm-up with each contender in
turn, in one process, each save after a barrier and after the previous one finished:

  * ``shoal-partner`` / ``shoal-direct``: shoal through ``s3://`` with that durability path, until
    the handle reached B4, then (``settle``) until the pipeline is idle, timed as ``after_b4`` (the
    retention pass after every commit, which the next save would queue behind); stall = until
    ``save`` returns, ``B1``..``B4`` from the handle, and from
    the event log the seconds inside the protocol's control collectives (the engine's
    ``coordination`` record) and where each step's time went (:func:`step_phases`),
  * ``dcp.save``: with DCP's ``FsspecWriter`` to ``s3://<bucket>/dcp-<N>``, its writer timed
    (:class:`TimedFsspecWriter`) to split the data write and the metadata write from the rest,
  * ``dcp.async_save``: the same writer; stall = until it returns, completion = its upload done.

Before every save each tensor gets ``+ 1``: every chunk is new. With bytes this small, what a save
costs is its protocol: collectives over gloo, the planner, and the round trips to S3 per object.
Every rank returns its own numbers; rank 0 adds the machine's and the S3 server's CPU seconds over
each contender's timed saves (``/proc`` is shared by the namespaces). Plain JSON in and out.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from shoal._torch_private import FsspecWriter
from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.records.events import monotonic, read_events
from shoal.testing.bench.cluster_save import CpuWindow, prepare_bucket
from shoal.testing.cluster.scenarios import cluster_config
from shoal.testing.s3 import s3_storage_options

__all__ = [
    "CONTENDERS",
    "PHASES",
    "TimedFsspecWriter",
    "coord_bench",
    "dcp_phases",
    "median_of_max",
    "step_phases",
    "tiny_state",
]

CONTENDERS = ("shoal-partner", "shoal-direct", "dcp.save", "dcp.async_save")
WAIT_S = 120.0
COMMIT_FILES = ("manifest", "commit", "latest")


def tiny_state(rank: int, *, tensors: int = 4, kib: int = 4) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of ``kib`` KiB, keyed and filled per rank (nothing is replicated)."""
    g = torch.Generator().manual_seed(77_000 + rank)
    return {f"r{rank}.t{i}": torch.randn(kib * 256, generator=g) for i in range(tensors)}


def median_of_max(per_rank: Sequence[Sequence[float]]) -> float:
    """The median over saves of the slowest rank's value (``per_rank[rank][save]``); NaN when empty."""
    if not per_rank or not per_rank[0]:
        return float("nan")
    return statistics.median(max(values) for values in zip(*per_rank, strict=True))


def _marks(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The monotonic instants of one rank's step that :func:`step_phases` cuts at."""
    marks: dict[str, float] = {}
    for r in records:
        name = r["event"]
        if name == "boundary":
            marks[str(r["boundary"])] = float(r["mono"])
        elif name in ("save_called", "staged", "hashed", "path"):
            marks[name] = float(r["mono"])
    return marks


PHASES = (
    "DCP plan",
    "stage",
    "DCP finish",
    "queue+hash",
    "C1",
    "plan",
    "C2",
    "replica I/O",
    "C3-C5",
    "drain I/O",
    "C6-C7",
    "commit I/O",
    "commit checks",
    "coordination",
    "collectives",
)
"""The keys of :func:`step_phases`, in the order of a checkpoint."""


def step_phases(
    records: Sequence[Mapping[str, Any]], *, called: float | None = None, returned: float | None = None
) -> dict[str, float]:
    """Where one rank's checkpoint went, in seconds, from its event records (one rank, one step).

    ``called`` and ``returned`` are when ``save`` was called and returned, on the records' clock
    (``time.monotonic()``). Cut at the records' monotonic instants (``docs/events.md``): ``DCP plan``
    (the call to ``save_called``: ``save`` drives ``dcp.save``, whose plan is gathered and scattered
    before shoal's writer stages), ``stage`` (to ``staged``: the copy), ``DCP finish`` (to the return:
    DCP's write results gathered, its metadata, the job submitted), ``queue+hash`` (to ``hashed``:
    the pipeline picks the job up and hashes), ``C1`` (to B1, reached
    once every rank reported), ``plan`` (the coordinator's ``planned`` seconds) and ``C2`` (the rest,
    to the ``path`` record), ``C3-C5`` (partner path: to B2, less ``replica I/O``, the ``replicate``
    record's seconds), then to B3: ``drain I/O`` (this rank's pack write), ``commit I/O`` (the
    coordinator's manifest, ``COMMIT`` and ``LATEST`` writes), ``C6-C7`` and ``commit checks``.
    ``coordination`` and ``collectives`` are the engine's own figures (its ``coordination`` record:
    every control collective, timed); C6 and C7 get what of it the earlier cuts do not hold, and
    ``commit checks`` the rest of that last stretch (on the coordinator: the reads that check the
    packs and the writer record before the commit writes, and the manifest's build). Records of
    other events are ignored; a phase whose records are missing is left out.
    """
    marks = _marks(records)
    if called is not None:
        marks["called"] = called
    if returned is not None and "staged" in marks and "hashed" in marks:
        marks["returned"] = min(max(returned, marks["staged"]), marks["hashed"])
    out: dict[str, float] = {}
    total = {
        name: sum(float(r["seconds"]) for r in records if r["event"] == name)
        for name in ("planned", "replicate")
    }
    writes = [r for r in records if r["event"] == "write" and r.get("tier") == "shared"]
    chain = [("called", "DCP plan", "save_called"), ("save_called", "stage", "staged")]
    if "returned" in marks:
        chain += [("staged", "DCP finish", "returned"), ("returned", "queue+hash", "hashed")]
    else:
        chain.append(("staged", "queue+hash", "hashed"))
    chain.append(("hashed", "C1", "STAGED"))
    for start, phase, end in chain:
        if start in marks and end in marks:
            out[phase] = marks[end] - marks[start]
    if "STAGED" in marks and "path" in marks:
        out["plan"] = total["planned"]
        out["C2"] = marks["path"] - marks["STAGED"] - out["plan"]
    after = marks.get("path")
    if after is not None and "REPLICATED" in marks:
        out["replica I/O"] = total["replicate"]
        out["C3-C5"] = marks["REPLICATED"] - after - out["replica I/O"]
        after = marks["REPLICATED"]
    coordination = next((r for r in records if r["event"] == "coordination"), None)
    if after is not None and "PERSISTED" in marks:
        out["drain I/O"] = sum(float(r["seconds"]) for r in writes if r.get("what") == "pack")
        out["commit I/O"] = sum(float(r["seconds"]) for r in writes if r.get("what") in COMMIT_FILES)
        rest = marks["PERSISTED"] - after - out["drain I/O"] - out["commit I/O"]
        if coordination is not None:
            earlier = sum(out.get(k, 0.0) for k in ("C1", "C2", "C3-C5"))
            out["C6-C7"] = min(rest, max(0.0, float(coordination["seconds"]) - earlier))
            out["commit checks"] = rest - out["C6-C7"]
    if coordination is not None:
        out["coordination"] = float(coordination["seconds"])
        out["collectives"] = float(coordination["collectives"])
    return {k: out[k] for k in PHASES if k in out}


def dcp_phases(stamps: Mapping[str, float], start: float, end: float) -> dict[str, float]:
    """One ``dcp.save`` on one rank, from :class:`TimedFsspecWriter`'s stamps (``perf_counter``).

    ``before write`` (set-up, local and global plan and their gather and scatter), ``write I/O``
    (this rank's data file), ``after write`` (the results' gather, the coordinator's metadata write
    and the broadcast after it), ``finish I/O`` (the metadata write, coordinator only) and
    ``coordination``: the whole save less the two writes.
    """
    write = stamps["write_end"] - stamps["write_start"]
    finish = stamps.get("finish_end", 0.0) - stamps.get("finish_start", 0.0)
    return {
        "before write": stamps["write_start"] - start,
        "write I/O": write,
        "after write": end - stamps["write_end"],
        "finish I/O": finish,
        "coordination": end - start - write - finish,
    }


class TimedFsspecWriter(FsspecWriter):
    """DCP's ``FsspecWriter`` that notes when its data write and its metadata write start and end.

    ``write_data`` runs on every rank after the plan was scattered; ``finish`` on the coordinator
    only, after the write results were gathered. The stamps are ``time.perf_counter()``.
    """

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.stamps: dict[str, float] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.stamps["write_start"] = time.perf_counter()
        fut = super().write_data(plan, planner)
        fut.wait()
        self.stamps["write_end"] = time.perf_counter()
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.stamps["finish_start"] = time.perf_counter()
        super().finish(metadata, results)
        self.stamps["finish_end"] = time.perf_counter()


def _mutate(state: Mapping[str, torch.Tensor]) -> None:
    for t in state.values():
        t.add_(1.0)


def _start_save(step: int, window: CpuWindow, state: Mapping[str, torch.Tensor]) -> None:
    """Before save ``step``: change every tensor, then line the ranks up (step 1 opens the window)."""
    _mutate(state)
    if step == 1:
        window.start()
    else:
        dist.barrier()


def _shoal_run(
    rank: int,
    state: Mapping[str, torch.Tensor],
    saves: int,
    window: CpuWindow,
    settle: bool,
    **cfg_args: Any,
) -> dict[str, Any]:
    """``saves`` timed shoal saves after a warm-up; each waits for B4, and with ``settle`` then for
    the pipeline to go idle (``after_b4``: the retention pass that follows every commit). Phases
    from the event log."""
    cfg = cluster_config(**cfg_args)
    out: dict[str, Any] = {"stall": [], "times": [], "after_b4": []}
    calls: dict[int, tuple[float, float]] = {}
    with Checkpointer(cfg) as ckpt:
        for step in range(saves + 1):
            _start_save(step, window, state)
            t0, m0 = time.perf_counter(), monotonic()
            handle = ckpt.save(step, dict(state))
            stall, m1 = time.perf_counter() - t0, monotonic()
            handle.wait(Boundary.RESTARTABLE, timeout=WAIT_S)
            t1 = time.perf_counter()
            if settle:
                ckpt.wait(WAIT_S)
            if step:
                if settle:
                    out["after_b4"].append(time.perf_counter() - t1)
                calls[step] = (m0, m1)
                out["stall"].append(stall)
                out["times"].append({str(int(b)): s for b, s in handle.times.items()})
        window.stop(out)
        ckpt.wait()
        event_log = ckpt.config.event_log
    if event_log is None:
        raise RuntimeError("the checkpointer resolved no event log path")
    mine = [dict(e.fields) for e in read_events(event_log) if e.rank == rank]
    out["phases"] = [
        step_phases([e for e in mine if e["step"] == s], called=calls[s][0], returned=calls[s][1])
        for s in range(1, saves + 1)
    ]
    return out


def _dcp_run(
    bucket: str, state: Mapping[str, torch.Tensor], saves: int, window: CpuWindow, *, asynchronous: bool
) -> dict[str, Any]:
    """``saves`` timed ``dcp.save`` (or ``dcp.async_save``) calls after a warm-up, each to its own prefix."""
    opts = s3_storage_options(os.environ["SHOAL_S3_ENDPOINT"])
    name = "dcp-async" if asynchronous else "dcp"
    out: dict[str, Any] = {"stall": [], "complete": [], "phases": []}
    for step in range(saves + 1):
        _start_save(step, window, state)
        writer = TimedFsspecWriter(f"s3://{bucket}/{name}-{step}", **opts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            if asynchronous:
                fut = dcp.async_save(dict(state), storage_writer=writer)
                stall = time.perf_counter() - t0
                upload = fut.upload_completion if isinstance(fut, AsyncSaveResponse) else fut
                upload.result()
            else:
                dcp.save(dict(state), storage_writer=writer)
                stall = time.perf_counter() - t0
            end = time.perf_counter()
        if step:
            out["stall"].append(stall)
            out["complete"].append(end - t0)
            out["phases"].append(dcp_phases(writer.stamps, t0, end))
    window.stop(out)
    return out


def _shoal_contender(
    rank: int,
    state: Mapping[str, torch.Tensor],
    saves: int,
    bucket: str,
    dram_root: str,
    local_root: str,
    path: str,
    settle: bool,
    window: CpuWindow,
) -> dict[str, Any]:
    """shoal with durability path ``path``: its own job, S3 prefix and host tier roots."""
    return _shoal_run(
        rank,
        state,
        saves,
        window,
        settle,
        bucket=bucket,
        dram_root=os.path.join(dram_root, path),
        local_root=os.path.join(local_root, path),
        path=path,
        job=f"coord-{path}",
        shared=f"s3://{bucket}/shoal-{path}",
    )


def coord_bench(
    rank: int,
    world: int,
    *,
    bucket: str,
    dram_root: str,
    local_root: str,
    saves: int,
    contenders: Sequence[str] = CONTENDERS,
    tensors: int = 4,
    kib: int = 4,
    settle: bool = True,
    moto_pid: int | None = None,
) -> dict[str, Any]:
    """Every contender of ``contenders`` (:data:`CONTENDERS`) in turn on this rank: ``saves`` timed
    saves of :func:`tiny_state` after one warm-up. Returns ``{contender: numbers}`` and ``rank``.

    Every rank calls it with the same arguments; the contenders run in the same order on every
    rank, and every save starts after a barrier of all ranks. shoal's contenders each get their own
    job, S3 prefix and host tier roots (``<root>/<path>``); with ``settle`` each of their saves
    starts once the previous one's pipeline work is all done (its retention pass after B4 too),
    without it as soon as the previous one reached B4.
    """
    prepare_bucket(rank, bucket)
    state = tiny_state(rank, tensors=tensors, kib=kib)
    out: dict[str, Any] = {"rank": rank, "world": world}
    runs: dict[str, Callable[[CpuWindow], dict[str, Any]]] = {
        "dcp.save": lambda w: _dcp_run(bucket, state, saves, w, asynchronous=False),
        "dcp.async_save": lambda w: _dcp_run(bucket, state, saves, w, asynchronous=True),
    }
    for path in ("partner", "direct"):
        runs[f"shoal-{path}"] = functools.partial(
            _shoal_contender, rank, state, saves, bucket, dram_root, local_root, path, settle
        )
    for name in contenders:
        if name not in runs:
            raise ValueError(f"unknown contender {name!r}: expected one of {', '.join(CONTENDERS)}")
        out[name] = runs[name](CpuWindow(rank, moto_pid))
    return out
