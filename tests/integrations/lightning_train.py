"""A small deterministic Lightning run on 2 CPU processes, saving through shoal (for test_lightning.py).

Run as a script: Lightning's own launcher re-executes it for rank 1. Prints (global rank 0):
``SHOAL-B4 <step>`` then sleeps, waiting to be killed, with ``--kill-after N`` once step N reached
B4 (checked at the end of step N + 1); ``RESUMED <global_step> <shoal step loaded>`` when it
started from a checkpoint; ``DONE <global_step>`` at the end. ``--dump`` saves the final model
and optimizer state (full, on rank 0) with ``torch.save``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint import state_dict as dcp_sd
from torch.utils.data import DataLoader, TensorDataset

import shoal
from shoal.integrations.lightning import ShoalDDPStrategy, ShoalModelParallelStrategy

SAMPLES = 16  # 2 ranks x batch 4: two steps an epoch, so every checkpoint ends an epoch


class Net(L.LightningModule):
    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 1),
        )

    def configure_model(self) -> None:
        if self.hparams["sharded"]:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}


class Probe(Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path and trainer.is_global_zero:
            load = trainer.strategy.shoal_io.checkpointer.last_load  # type: ignore[attr-defined]
            print(f"RESUMED {trainer.global_step} {load.step if load else None}", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        kill = self.args.kill_after
        if kill is None or trainer.global_step != kill + 1:
            return
        ckpt = trainer.strategy.shoal_io.checkpointer  # type: ignore[attr-defined]
        deadline = time.monotonic() + 120
        while (ckpt.latest() or -1) < kill and time.monotonic() < deadline:
            time.sleep(0.02)
        if trainer.is_global_zero:
            print(f"SHOAL-B4 {ckpt.latest()}", flush=True)
        time.sleep(600)  # the test kills the process group now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.args.dump:
            full = dcp_sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
            model = trainer.strategy.model
            assert model is not None
            state = {
                "model": dcp_sd.get_model_state_dict(model, options=full),
                "optim": dcp_sd.get_optimizer_state_dict(model, trainer.optimizers[0], options=full),
                "global_step": trainer.global_step,
            }
            if trainer.is_global_zero:
                torch.save(state, self.args.dump)
        if trainer.is_global_zero:
            print(f"DONE {trainer.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "mp"], default="ddp")
    p.add_argument("--shared", required=True)
    p.add_argument("--local", required=True)
    p.add_argument("--dram", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--resume")
    p.add_argument("--kill-after", type=int)
    p.add_argument("--dump")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    config = shoal.Config(shared=args.shared, local=args.local, dram=args.dram, job="lit")
    strategy: Any
    if args.strategy == "ddp":
        strategy = ShoalDDPStrategy(config)
    else:
        strategy = ShoalModelParallelStrategy(config, data_parallel_size=2, tensor_parallel_size=1)
    callbacks: list[Callback] = [Probe(args)]
    if args.every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                every_n_train_steps=args.every,
                save_top_k=args.top_k,
                monitor="step",
                mode="max",
                save_last=True,
            )
        )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=args.max_steps,
        callbacks=callbacks,
        enable_checkpointing=bool(args.every),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
    trainer.fit(
        Net(sharded=args.strategy == "mp"),
        DataLoader(data, batch_size=4, shuffle=True),
        ckpt_path=args.resume,
    )


if __name__ == "__main__":
    sys.exit(main())
