"""``dcp.async_save`` with shoal's writer on several ranks, with DCP's thread and process checkpointers.

Each scenario runs on every rank of :func:`shoal.testing.multiproc.run_ranks`. The background save
gets a gloo group of its own, as DCP asks of any async save that runs beside training.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import shoal
from shoal import dcp as shoal_dcp
from shoal import failpoints
from shoal.testing.checkpoints import assert_state_equal, zeros_like_state
from shoal.testing.scenarios import dp_state, group_config

KINDS = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


def _bump(state: dict[str, Any]) -> None:
    """What the next training step does to the state in place."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)


def _async_save(
    state: dict[str, Any], writer: shoal_dcp.StorageWriter, pg: Any, kind: AsyncCheckpointerType
) -> Future[Any]:
    fut = dcp.async_save(state, storage_writer=writer, process_group=pg, async_checkpointer_type=kind)
    assert isinstance(fut, Future), "shoal stages synchronously: DCP returns its upload future"
    return fut


def _reached(writer: shoal_dcp.StorageWriter) -> str | None:
    reached = writer.handle.reached
    return None if reached is None else reached.name


def boundaries_and_failure(
    rank: int, world_size: int, *, root: str, kind: str, hold: float
) -> dict[str, Any]:
    """Three async saves: one whose future completes at the default B4 (the first: DCP's process
    checkpointer starts its process then), one at B2 while the drain is held back ``hold``
    seconds, one whose drain fails on rank 1 (the future raises on every rank). Then both good
    steps load bit for bit as they were when ``dcp.async_save`` returned."""
    checkpointer_type = KINDS[kind]
    pg = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    with shoal.Checkpointer(group_config(root)) as ckpt:
        state = dp_state(rank)
        saved: dict[int, dict[str, Any]] = {}

        writer = shoal_dcp.StorageWriter(ckpt, 1)
        t0 = time.perf_counter()
        fut = _async_save(state, writer, pg, checkpointer_type)
        out["returned_at"] = _reached(writer)
        out["stall"] = time.perf_counter() - t0
        saved[1] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        _bump(state)
        fut.result(timeout=120)
        out["at_b4_future"] = _reached(writer)
        out["latest_after_b4_future"] = ckpt.latest()

        failpoints.configure(f"pipeline.before_drain=delay:{hold}")
        writer = shoal_dcp.StorageWriter(ckpt, 2, durable_at=shoal.Boundary.REPLICATED)
        fut = _async_save(state, writer, pg, checkpointer_type)
        saved[2] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        _bump(state)  # training goes on: the checkpoint keeps what was staged
        fut.result(timeout=120)
        out["at_b2_future"] = _reached(writer)
        writer.handle.wait(timeout=120)
        failpoints.configure(None)

        failpoints.configure("pipeline.before_drain=raise@rank:1")
        writer = shoal_dcp.StorageWriter(ckpt, 3)
        fut = _async_save(state, writer, pg, checkpointer_type)
        try:
            fut.result(timeout=120)
            out["failed"] = None
        except CheckpointException as e:
            out["failed"] = f"{type(e).__name__}: {e}"
        failpoints.configure(None)
        out["latest_after_failure"] = ckpt.latest()

        for step in (1, 2):
            target = zeros_like_state(saved[step])
            assert ckpt.load(target, step=step) == step
            assert_state_equal(target, saved[step])
    return out


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m shoal.testing.async_save ROOT KIND HOLD``: every rank runs
    :func:`boundaries_and_failure` on its own simulated host and writes its result as JSON to
    ``ROOT/result-<rank>.json``.

    For DCP's process checkpointer, whose checkpoint process a rank of
    :func:`~shoal.testing.multiproc.run_ranks` (a daemon process) may not start.
    """
    import argparse
    import json
    import os

    parser = argparse.ArgumentParser(prog="python -m shoal.testing.async_save")
    parser.add_argument("root")
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("hold", type=float)
    args = parser.parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["SHOAL_HOST_ID"] = f"h{rank}"
    dist.init_process_group("gloo")
    try:
        result = boundaries_and_failure(rank, world_size, root=args.root, kind=args.kind, hold=args.hold)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(args.root, f"result-{rank}.json"), "w") as f:
        json.dump({"rank": rank, **result}, f)


if __name__ == "__main__":
    main()
