"""A multi-rank run for the timeline and report tests, run with :func:`shoal.testing.multiproc.run_ranks`.

Several saves whose path the completion-time model decides once it has seen two checkpoints
of each path (so the later ones carry predictions), then one load; the model's weights stay the
same from save to save (deduplicated against the shared tier), each rank's optimizer shard
moves. Every rank returns its host, its event log, and what it saw of each checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.engine.path import ModelPolicy
from shoal.testing.checkpoints import assert_state_equal, zeros_like_state
from shoal.testing.scenarios import dp_state, group_config


def _state(rank: int, step: int) -> dict[str, Any]:
    state = dp_state(rank, tensors=4, numel=16 << 10, shard_numel=24 << 10)
    for t in state["optim"].values():
        t.add_(step)
    state["step"] = step
    return state


def saves_then_load(rank: int, world: int, *, root: str, saves: int = 5) -> dict[str, Any]:
    """``saves`` checkpoints (each waited to B4), then every rank loads the newest."""
    cfg = group_config(root)
    policy = ModelPolicy(min_checkpoints=2, background=False)
    out: dict[str, Any] = {"steps": {}}
    with Checkpointer(cfg, path_policy=policy) as ckpt:
        for step in range(1, saves + 1):
            handle = ckpt.save(step, _state(rank, step))
            handle.wait(Boundary.RESTARTABLE, timeout=120)
            out["steps"][step] = {"path": handle.path, "times": {b.name: t for b, t in handle.times.items()}}
        ckpt.wait()
        if world > 1:
            torch.distributed.barrier()
        expected = _state(rank, saves)
        target = zeros_like_state(expected)
        assert ckpt.load(target) == saves
        assert_state_equal(target, expected)
        out["host"] = ckpt.config.host_id
        out["events"] = ckpt.config.event_log
    return out
