"""FSDP2 (``fully_shard``) state saved through shoal at one world size and loaded at another.

Ranks of :func:`shoal.testing.multiproc.run_ranks`, gloo, CPU. The model and its Adam state are
taken with DCP's ``get_state_dict`` (DTensor shards) and saved with ``Checkpointer.save``; a run at
another world size loads them with ``Checkpointer.load`` into its own shards (DCP plans the
resharding) and ``set_state_dict``. Each run returns the full (gathered) state, for comparison.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

import shoal
from shoal.testing.scenarios import group_config


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 48))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
        loss = model(torch.randn(8, 64, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _plain(value: Any) -> Any:
    """``value`` with every tensor as a numpy array (what a rank can send back through a queue)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return _plain(
        {
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, opt, options=full),
        }
    )


def save_sharded(rank: int, world_size: int, *, root: str, step: int) -> dict[str, Any]:
    """Train ``step`` steps on this world size, save through shoal; return the full state there."""
    model, opt = _model()
    _train(model, opt, range(step))
    with shoal.Checkpointer(group_config(root)) as ckpt:
        model_sd, optim_sd = get_state_dict(model, opt)
        ckpt.save(step, {"model": model_sd, "optim": optim_sd}).wait(timeout=120)
    return _full(model, opt)


def load_resharded(rank: int, world_size: int, *, root: str, step: int) -> dict[str, Any]:
    """Load ``step`` at this world size; return the full state, and after one more training step."""
    model, opt = _model()
    _train(model, opt, range(1))  # the optimizer has state to load into (and wrong values in it)
    with shoal.Checkpointer(group_config(root)) as ckpt:
        model_sd, optim_sd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        loaded = ckpt.load(state, step=step)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = {"loaded": loaded, "state": _full(model, opt)}
    _train(model, opt, range(step, step + 1))
    shards = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]  # DTensor shards
    out["trained_on"] = all(bool(torch.isfinite(t).all()) for t in shards)
    return out
