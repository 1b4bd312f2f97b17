"""Stall of one torchtitan checkpoint save: its own ``CheckpointManager`` against shoal's, in one run.

One process (gloo, world size 1), torchtitan's llama3 ``Transformer`` (``debugmodel`` flavour widened
to about ``--mib`` MiB of float32 parameters) with torchtitan's AdamW container (its state doubles
that), LR scheduler and a train state, after one training step. For each ``async_mode`` (``disabled``,
then ``async``) two managers over the same model: torchtitan's ``CheckpointManager`` (DCP's file
writer, into a folder under ``--root``) and ``ShoalCheckpointManager`` (shared tier under ``--root``,
DRAM tier in ``/dev/shm``), each saving with ``manager.save(step)`` as torchtitan's Trainer does,
alternating, ``--repeats`` times each after one warm-up each. Each save follows a training step
(so shoal deduplicates nothing it should not) and starts with the previous one of its manager
finished (so its stall is its own). Measured: the stall (``save`` until it returns) and the time until
the checkpoint is done (torchtitan: written, its async future done; shoal: B4, committed). Prints
medians and the stall ratio. Usage: ``python benchmarks/integrations_torchtitan.py --mib 32``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
import warnings
from typing import Any

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import Checkpoint, LRScheduler, Optimizer
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3 import Transformer, llama3_args

import shoal
from shoal.integrations.torchtitan import ShoalCheckpointManager
from shoal.testing.bench.scratch import scratch


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=32, help="model parameters, MiB (AdamW adds twice that)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", default=None, help="where both write (default: a temporary directory)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with scratch("shoal-bench-titan-", args.root, process_group=True) as (root, dram):
        run(args, root, dram)


def run(args: argparse.Namespace, root: str, dram: str) -> None:
    # debugmodel is 256 wide, 6 layers; widen it until the parameters are about --mib MiB
    dim = 256
    while True:
        flavour = dataclasses.replace(llama3_args["debugmodel"], dim=dim, n_heads=16, max_seq_len=64)
        with torch.device("meta"):
            size = sum(t.numel() * 4 for t in Transformer(flavour).parameters())
        if size >= args.mib << 20 or dim >= 4096:
            break
        dim += 64
    torch.manual_seed(0)
    model = Transformer(flavour)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers([model], Optimizer(implementation="for-loop"), dims)
    lr_schedulers = build_lr_schedulers(optimizers, LRScheduler(warmup_steps=2), 1000)
    tokens = torch.randint(0, flavour.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    train_state = TrainState()

    def train_step() -> None:
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.step += 1

    train_step()
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    state = params + sum(
        t.numel() * t.element_size()
        for o in optimizers.optimizers
        for s in o.state.values()
        for t in s.values()
    )
    mib = f"model {params / 2**20:.0f} MiB, state {state / 2**20:.0f} MiB"
    print(f"llama3 dim {dim}: {mib}, {args.repeats} saves each")
    print("| async_mode | manager | stall (ms, median) | until done (ms, median) |")
    print("|---|---|---:|---:|")
    for mode in ("disabled", "async"):
        kind = {"interval": 1, "keep_latest_k": 2, "async_mode": mode, "last_save_model_only": False}

        def build(
            cls: type[CheckpointManager], folder: str, kind: dict[str, Any] = kind, **extra: Any
        ) -> Any:
            return cls(
                dataloader=None,
                model_parts=[model],
                optimizers=optimizers,
                lr_schedulers=lr_schedulers,
                states={"train_state": train_state},
                checkpoint_config=Checkpoint(enable=True, folder=folder, **kind),
                sd_adapter=None,
                base_folder=root,
                **extra,
            )

        config = shoal.Config(shared=os.path.join(root, "shared"), dram=dram, job=f"bench-{mode}")
        managers = {
            "torchtitan's own (DCP files, no fsync)": build(CheckpointManager, f"stock-{mode}"),
            "shoal (returns at B1; done = B4)": build(ShoalCheckpointManager, "unused", shoal_config=config),
        }
        stalls: dict[str, list[float]] = {name: [] for name in managers}
        done: dict[str, list[float]] = {name: [] for name in managers}
        for i in range(args.repeats + 1):
            for name, mgr in managers.items():
                train_step()
                t0 = time.perf_counter()
                mgr.save(train_state.step)
                stall = time.perf_counter() - t0
                if mgr.save_future is not None:
                    mgr.save_future.result()
                if isinstance(mgr, ShoalCheckpointManager):
                    assert mgr.last_save is not None
                    mgr.last_save.wait(shoal.Boundary.RESTARTABLE)
                if i:  # the first of each is a warm-up
                    stalls[name].append(stall)
                    done[name].append(time.perf_counter() - t0)
        for mgr in managers.values():
            mgr.close()
        medians = {name: statistics.median(stalls[name]) * 1e3 for name in managers}
        for name in managers:
            print(f"| {mode} | {name} | {medians[name]:.1f} | {statistics.median(done[name]) * 1e3:.1f} |")
        own, ours = medians.values()
        print(f"| {mode} | stall ratio (torchtitan / shoal) | {own / ours:.1f}x | |")


if __name__ == "__main__":
    main()
