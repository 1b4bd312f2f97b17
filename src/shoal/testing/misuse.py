"""Collective calls made wrong, for the multi-process harness: a ``save`` or ``load`` called on some
ranks only (``if rank == 0: ckpt.save(...)``), or with another step on one rank.

Each scenario returns what every rank saw (the error's class and message, or None), so a test
checks that the ranks which made the call failed with a :class:`~shoal.errors.CollectiveMismatch`
naming the others, while the ranks that did not call were still alive and waiting: the error came
from shoal's own check, not from a peer going away.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import shoal
from shoal.testing.scenarios import group_config


def _state(rank: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.float32) + rank}


def partial_call(
    rank: int, world: int, *, root: str, call: str, callers: Sequence[int], timeout: float
) -> dict[str, Any]:
    """``call`` ("save" or "load") made by ``callers`` only, with ``Config.collective_timeout=timeout``.

    A load first needs a checkpoint: every rank saves step 1 together before. The ranks not in
    ``callers`` wait on the default group's barrier, which the callers reach once their call
    failed; then every rank closes together.
    """
    seen: dict[str, Any] = {"raised": None, "seconds": None}
    with shoal.Checkpointer(group_config(root, collective_timeout=timeout)) as ckpt:
        if call == "load":
            ckpt.save(1, _state(rank)).wait(shoal.Boundary.RESTARTABLE, timeout=120)
        if rank in callers:
            t0 = time.monotonic()
            try:
                if call == "save":
                    ckpt.save(2, _state(rank))
                else:
                    ckpt.load(_state(rank))
            except shoal.ShoalError as e:
                seen["raised"] = (type(e).__name__, str(e))
            seen["seconds"] = round(time.monotonic() - t0, 1)
        dist.barrier()
    return seen


def mismatched_steps(rank: int, world: int, *, root: str, odd_rank: int) -> dict[str, Any]:
    """Every rank calls ``save``, ``odd_rank`` with step 3 and the others with step 2."""
    seen: dict[str, Any] = {"raised": None}
    with shoal.Checkpointer(group_config(root, collective_timeout=60.0)) as ckpt:
        try:
            ckpt.save(3 if rank == odd_rank else 2, _state(rank))
        except shoal.ShoalError as e:
            seen["raised"] = (type(e).__name__, str(e))
        dist.barrier()
    return seen
