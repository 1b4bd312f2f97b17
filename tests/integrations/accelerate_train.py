"""A small Accelerate training script that checkpoints through shoal, as a user would write it.

Run with ``python -m torch.distributed.run --standalone --nproc_per_node 2 accelerate_train.py ...``
(torchrun; on CPU the processes use gloo). It resumes from the newest restorable checkpoint if
the job has one, trains ``--steps`` steps (deterministic: fixed data, seeds, dropout, python and
numpy noise in the loss), saves every ``--save-every`` steps, writes each process's full state at
``--dump-at`` to ``<out>/<tag>-rank<r>.pt``, and with ``--hang-at`` waits there until its last
checkpoint is committed (B4), writes ``<out>/<tag>-committed`` and sleeps until it is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

if os.environ.get("ACCELERATE_TEST_HOST_PER_RANK"):
    os.environ["SHOAL_HOST_ID"] = f"node{os.environ['RANK']}"  # each process its own simulated host

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

import shoal
from shoal.integrations.accelerate import use_shoal


class Progress:
    """The loop's own bookkeeping, registered for checkpointing (a list that grows, an int key)."""

    def __init__(self) -> None:
        self.step = 0
        self.losses: list[float] = []
        self.by_epoch: dict[int, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses), "by_epoch": dict(self.by_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.losses, self.by_epoch = state["step"], list(state["losses"]), dict(state["by_epoch"])


def snapshot(
    accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, progress: Progress
) -> dict:
    """Everything a resumed run must reproduce, as plain tensors and values."""
    return {
        "model": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "progress": progress.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": list(random.getstate()[1]),
        "numpy_rng": np.random.get_state()[1].tolist(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    # (names no prefix of torchrun's own options: it would take them)
    for name in ("--ckpt-shared", "--ckpt-local", "--ckpt-dram", "--project-dir", "--dump-dir", "--tag"):
        p.add_argument(name, required=True)
    p.add_argument("--job", default="acc")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--total-limit", type=int, default=2)
    p.add_argument("--dump-at", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=-1)
    args = p.parse_args()
    out = Path(args.dump_dir)

    set_seed(1234)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=args.total_limit
        ),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True),
    )
    data = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=data)
    y = x @ torch.randn(8, 1, generator=data) + 0.1 * torch.randn(40, 1, generator=data)
    # 5 steps an epoch on 2 processes. The loader's own generator: without one, each new iterator draws
    # its base seed from the global torch RNG, once more in a run resumed mid-epoch than in one that was not
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator())
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    # the lines that switch this script to shoal
    ckpts = use_shoal(
        accelerator,
        shoal.Config(
            shared=args.ckpt_shared,
            local=args.ckpt_local,
            dram=args.ckpt_dram,
            job=args.job,
            chunk_size=1 << 16,
        ),
    )
    resumed = ckpts.resume()

    rank = accelerator.process_index
    start = {
        "pid": os.getpid(),
        "resumed": resumed,
        "step": progress.step,
        "iteration": accelerator.project_configuration.iteration,
    }
    (out / f"{args.tag}-start-rank{rank}.json").write_text(json.dumps(start))
    last = None
    while progress.step < args.steps:
        epoch = loader.iteration
        for xb, yb in loader:
            noise = 1e-3 * (random.random() + float(np.random.randn()))
            loss = torch.nn.functional.mse_loss(model(xb), yb) + noise
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            progress.losses.append(accelerator.reduce(loss.detach(), "mean").item())
            progress.by_epoch[epoch] = progress.by_epoch.get(epoch, 0) + 1
            if progress.step == args.dump_at:
                snap = snapshot(accelerator, model, optimizer, scheduler, progress)
                torch.save(snap, out / f"{args.tag}-rank{rank}.pt")
            if progress.step % args.save_every == 0:
                last = accelerator.save_state()
            if progress.step == args.hang_at:
                assert last is not None
                last.wait(shoal.Boundary.RESTARTABLE, timeout=120)
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    (out / f"{args.tag}-committed").write_text(str(last.step))
                while True:
                    time.sleep(60)
            if progress.step >= args.steps:
                break
    if last is not None:
        last.wait(shoal.Boundary.RESTARTABLE, timeout=120)
    ckpts.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
