"""Rank functions for the torchtitan tests: torchtitan's own components, trained as its Trainer does.

torchtitan's ``Trainer`` cannot start on a machine without CUDA (``torchtitan.train`` line 90,
``device_module.set_device``: ``AttributeError: module 'torch._C' has no attribute
'_cuda_setDevice'``). So these functions do on CPU (gloo) what it does around its checkpointer:
torchtitan's llama3 ``Transformer`` (a tiny flavour) sharded with FSDP2 (``fully_shard`` per block,
then the root, as its ``apply_fsdp``), its ``OptimizersContainer`` and ``LRSchedulersContainer``
from its own builders, its ``ParallelAwareDataloader``, a train state like the Trainer's, and a
checkpoint manager built with the Trainer's own keyword arguments: ``torchtitan.train.CheckpointManager``
after :func:`shoal.integrations.torchtitan.use_shoal` (shoal), or torchtitan's ``CheckpointManager``
itself (the reference). The loop calls ``load(step=load_step)`` first and ``save(step,
last_step=...)`` after every step, as ``Trainer.train`` does.

Results come back from rank 0 as ``torch.save`` bytes (a tensor sent through the result queue
would be shared memory of a process that is gone).
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset

VOCAB = 256
SEQ = 16


class Tokens(IterableDataset, Stateful):  # type: ignore[type-arg]
    """Random token sequences in torchtitan's batch shape, sample ``i`` of a dp rank the same on every
    run; stateful like torchtitan's own text datasets (its position is the sample index).

    (Without a state of its own, torchdata 0.11's ``StatefulDataLoader`` fast-forwards an iterable
    dataset, and then counts the skipped samples twice in its next state: resumed twice, it skips data.)
    """

    def __init__(self, dp_rank: int, samples: int = 256) -> None:
        self.dp_rank = dp_rank
        self.samples = samples
        self.sample_idx = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while self.sample_idx < self.samples:
            g = torch.Generator().manual_seed(1_000_000 * (1 + self.dp_rank) + self.sample_idx)
            self.sample_idx += 1
            t = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = state_dict["sample_idx"]


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state``: its step and the tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


@dataclasses.dataclass
class Job:
    model: torch.nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    train_state: TrainState


def build(world_size: int, rank: int, *, steps: int, dim: int = 64, layers: int = 2) -> Job:
    """torchtitan's components for ``world_size`` FSDP2 ranks; the same initial weights on every run."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config.job_config import LRScheduler, Optimizer
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = dataclasses.replace(
        llama3_args["debugmodel"], dim=dim, n_layers=layers, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ
    )
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    optimizers = build_optimizers([model], Optimizer(lr=1e-2, implementation="for-loop"), dims)
    lr_schedulers = build_lr_schedulers(optimizers, LRScheduler(warmup_steps=2), steps)
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world_size, batch_size=2)
    return Job(model, optimizers, lr_schedulers, dataloader, TrainState())


def train_step(job: Job, batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> float:
    from torchtitan.components.loss import cross_entropy_loss

    inputs, labels = batch
    loss = cross_entropy_loss(job.model(inputs["input"]), labels)
    loss.backward()
    job.optimizers.step()
    job.lr_schedulers.step()
    job.optimizers.zero_grad()
    job.train_state.ntokens_seen += labels.numel()
    return float(loss.detach())


def full_state(job: Job) -> dict[str, Any]:
    """The unsharded model and optimizer state (on rank 0; empty elsewhere), plus the train state."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(job.model, options=opts),
        "optim": get_optimizer_state_dict(job.model, job.optimizers.optimizers[0], options=opts),
        "train_state": job.train_state.state_dict(),
        "lr": job.lr_schedulers.schedulers[0].state_dict()["last_epoch"],
    }


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def manager(job: Job, root: str, dram: str, *, stock: bool, **checkpoint: Any) -> Any:
    """A checkpoint manager built as torchtitan's Trainer builds it, with ``[checkpoint]`` settings."""
    import torchtitan.train
    from torchtitan.config.job_config import Checkpoint

    import shoal
    from shoal.integrations.torchtitan import use_shoal

    cfg = Checkpoint(enable=True, folder="ckpt", last_save_model_only=False, **checkpoint)
    if stock:
        from torchtitan.components.checkpoint import CheckpointManager as build_manager
    else:
        shared = os.path.join(root, "shared")
        use_shoal(shoal.Config(shared=shared, local=os.path.join(root, "local"), dram=dram, job="titan"))
        build_manager = torchtitan.train.CheckpointManager
    return build_manager(
        dataloader=job.dataloader,
        model_parts=[job.model],
        optimizers=job.optimizers,
        lr_schedulers=job.lr_schedulers,
        states={"train_state": job.train_state},
        checkpoint_config=cfg,
        sd_adapter=None,
        base_folder=os.path.join(root, "stock" if stock else "titan"),
    )


def train(
    rank: int,
    world_size: int,
    *,
    root: str,
    dram: str,
    steps: int,
    record: Sequence[int] = (),
    stop_after: int | None = None,
    kill: bool = False,
    reload: int | None = None,
    stock: bool = False,
    load_step: int = -1,
    record_load: bool = False,
    report: str | None = None,
    **checkpoint: Any,
) -> dict[str, Any] | None:
    """Train to ``steps`` (or to ``stop_after``) as torchtitan's Trainer does, saving every ``interval``.

    ``record``: steps whose full state is returned (``record_load``: the state loaded, too).
    ``kill``: after step ``stop_after``, wait until the newest save reached B4 and SIGKILL this
    rank. ``reload``: at the end, once every checkpoint is committed, ``load(step=reload)`` (a
    restart with ``load_step``) and return the state loaded. ``report``: rank 0 also writes what it
    returns to this file (with ``torch.save``), before a kill.
    """
    import shoal

    job = build(world_size, rank, steps=steps)
    mgr = manager(job, root, dram, stock=stock, **checkpoint)
    out: dict[str, Any] = {"loaded": mgr.load(step=load_step), "start": job.train_state.step, "states": {}}
    out["async_mode"], out["async_saves"] = str(mgr.async_mode.value), 0
    if record_load:
        out["loaded_state"] = to_bytes(full_state(job))
    batches = iter(job.dataloader)
    while job.train_state.step < (stop_after or steps):
        job.train_state.step += 1
        out["loss"] = train_step(job, next(batches))
        pending = mgr.save_future
        mgr.save(job.train_state.step, last_step=job.train_state.step == steps)
        out["async_saves"] += mgr.save_future not in (None, pending)  # a new dcp.async_save future
        if job.train_state.step in record:
            out["states"][job.train_state.step] = to_bytes(full_state(job))
    if report is not None and rank == 0:
        torch.save(out, report)
    if kill:
        assert mgr.last_save is not None
        mgr.last_save.wait(shoal.Boundary.RESTARTABLE, timeout=120)
        os.kill(os.getpid(), signal.SIGKILL)
    if reload is not None:
        assert mgr.shoal is not None and mgr.shoal.wait(timeout=120)
        out["reloaded"] = mgr.load(step=reload)
        out["reloaded_state"] = to_bytes(full_state(job))
    mgr.close()
    return out if rank == 0 else None


def train_runs(
    rank: int, world_size: int, *, runs: Sequence[dict[str, Any]], report: str, **common: Any
) -> None:
    """Several :func:`train` runs one after the other in these processes (one launch; imports once):
    run ``i`` with ``common`` and ``runs[i]``; rank 0 writes each run's result to ``<report>.<i>``."""
    for i, run in enumerate(runs):
        train(rank, world_size, report=f"{report}.{i}", **{**common, **run})
