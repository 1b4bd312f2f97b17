"""Stall of one Lightning checkpoint: Lightning's default ``TorchCheckpointIO`` against ``ShoalCheckpointIO``.

One ``Trainer.fit`` (one process, CPU) of a model of about ``--mib`` MiB of float32 weights trained
with Adam (the checkpoint holds about three times that: weights and two moments). At every
``--every`` steps a callback times ``trainer.save_checkpoint`` twice at the same step, each in
Lightning's own code path (``dump_checkpoint`` then the strategy's ``CheckpointIO``):

  * default: the strategy's ``TorchCheckpointIO`` (``torch.save`` of the whole dict to a file),
  * shoal: the same strategy with ``ShoalCheckpointIO`` (returns at B1: the state copied into the
    DRAM slab, the pointer written); the time to B4 in the background is printed beside it.

Before each timed save the previous shoal checkpoint has finished (``Checkpointer.wait``), so
neither save competes with shoal's background drain. The first measured step is a warm-up (shoal
faults in its slab there) and is left out of the medians. Files go under ``--dir`` (default: a
temporary directory on /tmp), shoal's DRAM tier under /dev/shm.
Usage: ``PYTHONPATH=src python benchmarks/integrations_lightning.py --mib 32 --saves 5``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

import shoal
from shoal.integrations.lightning import ShoalCheckpointIO
from shoal.testing.bench.scratch import scratch


class Wide(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class TimeSaves(Callback):
    def __init__(self, root: str, io: ShoalCheckpointIO, every: int) -> None:
        self.root, self.io, self.every = root, io, every
        self.default: list[float] = []
        self.shoal: list[float] = []
        self.to_b4: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        strategy = trainer.strategy
        self.io.checkpointer.wait()
        strategy.checkpoint_io = TorchCheckpointIO()
        t0 = time.perf_counter()
        trainer.save_checkpoint(os.path.join(self.root, "default", f"step={step}.ckpt"), weights_only=False)
        self.default.append(time.perf_counter() - t0)
        strategy.checkpoint_io = self.io
        t0 = time.perf_counter()
        trainer.save_checkpoint(
            os.path.join(self.root, "shoal-pointers", f"step={step}.ckpt"), weights_only=False
        )
        self.shoal.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.io.checkpointer.wait()
        self.to_b4.append(self.shoal[-1] + time.perf_counter() - t0)
        print(
            f"step {step:3d}: default {self.default[-1] * 1e3:8.1f} ms   shoal {self.shoal[-1] * 1e3:8.1f} ms"
            f"   (shoal to B4 {self.to_b4[-1] * 1e3:8.1f} ms)",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=32, help="MiB of float32 weights (about)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--saves", type=int, default=5, help="measured saves (after one warm-up)")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    layers = max(1, round(args.mib * 2**20 / (4 * (args.width * args.width + args.width))))
    with scratch("shoal-lit-bench-", args.dir) as (root, dram):
        config = shoal.Config(shared=f"{root}/shared", local=f"{root}/local", dram=dram, job="bench")
        io = ShoalCheckpointIO(config)
        timer = TimeSaves(root, io, args.every)
        trainer = L.Trainer(
            plugins=[io],
            accelerator="cpu",
            devices=1,
            max_steps=args.every * (args.saves + 1),
            callbacks=[timer],
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = Wide(args.width, layers)
        weights = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**20
        print(f"model: {layers} x Linear({args.width}, {args.width}), {weights:.1f} MiB of weights + Adam")
        data = TensorDataset(torch.randn(64, args.width))
        trainer.fit(model, DataLoader(data, batch_size=8))
        size = os.path.getsize(os.path.join(root, "default", f"step={args.every * 2}.ckpt")) / 2**20
        default, ours = statistics.median(timer.default[1:]), statistics.median(timer.shoal[1:])
        print(f"\ncheckpoint: {size:.1f} MiB; median of {len(timer.default) - 1} saves (first left out)")
        print(f"  Lightning default (TorchCheckpointIO): {default * 1e3:8.1f} ms stall")
        print(f"  shoal (ShoalCheckpointIO, B1):         {ours * 1e3:8.1f} ms stall")
        print(f"  shoal to B4 (background):              {statistics.median(timer.to_b4[1:]) * 1e3:8.1f} ms")
        print(f"  ratio default / shoal:                 {default / ours:8.2f}x")


if __name__ == "__main__":
    main()
