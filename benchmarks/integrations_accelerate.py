"""Stall of one ``accelerator.save_state()``: Accelerate's own against through shoal, in one run.

One process, one ``Accelerator`` (CPU), a model of about ``--mib`` MiB of float32 parameters (an MLP)
with AdamW (whose state doubles it), an LR scheduler, a prepared DataLoader and a registered object,
after one training step. Measured, alternating, ``--repeats`` times each after one warm-up each:
  * accelerate: ``Accelerator.save_state(dir)``, Accelerate's own (safetensors for the model,
    torch.save for the rest), into a fresh directory under ``--root``; its stall is the whole save;
  * shoal: ``accelerator.save_state()`` after ``use_shoal`` until it returns (B1), with the time the
    checkpoint then took to reach B4 (committed on the shared tier, under ``--root`` too).
Each save mutates the model first (a training step), so shoal deduplicates nothing it should not.
Prints the medians and the ratio. Usage: ``python benchmarks/integrations_accelerate.py --mib 32``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

import shoal
from shoal.integrations.accelerate import use_shoal
from shoal.testing.bench.scratch import scratch


class Seen:
    """A registered object (its state a few numbers)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=32, help="model parameters, MiB (AdamW adds twice that)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", default=None, help="where both write (default: a temporary directory)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    with scratch("shoal-bench-acc-", args.root) as (root, dram):
        run(args, root, dram)


def run(args: argparse.Namespace, root: str, dram: str) -> None:
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root))
    width = 1024
    layers = max(1, round(args.mib * (1 << 20) / 4 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer)
    loader = DataLoader(TensorDataset(torch.randn(64, width)), batch_size=8)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    accelerator.register_for_checkpointing(Seen())
    batch = next(iter(loader))[0]

    def train_step() -> None:
        accelerator.backward(model(batch).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    train_step()
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    state_bytes = params + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim()
    )
    ckpts = use_shoal(accelerator, shoal.Config(shared=os.path.join(root, "shared"), dram=dram, job="bench"))

    default_s: list[float] = []
    shoal_s: list[float] = []
    b4_s: list[float] = []
    for i in range(args.repeats + 1):
        train_step()
        t0 = time.perf_counter()
        Accelerator.save_state(accelerator, os.path.join(root, f"accelerate-{i}"))  # Accelerate's own
        default = time.perf_counter() - t0
        train_step()
        t0 = time.perf_counter()
        handle = accelerator.save_state()  # through shoal
        stall = time.perf_counter() - t0
        handle.wait(shoal.Boundary.RESTARTABLE)
        b4 = time.perf_counter() - t0
        shutil.rmtree(os.path.join(root, f"accelerate-{i}"))
        if i:  # the first of each is a warm-up
            default_s.append(default)
            shoal_s.append(stall)
            b4_s.append(b4)
    ckpts.close()

    a, s, c = (statistics.median(x) * 1e3 for x in (default_s, shoal_s, b4_s))
    print(f"model {params / 2**20:.0f} MiB, state {state_bytes / 2**20:.0f} MiB, {args.repeats} saves each")
    print("| save_state | stall (ms, median) | until done (ms, median) |")
    print("|---|---:|---:|")
    print(f"| Accelerate's own (safetensors + torch.save, no fsync) | {a:.1f} | {a:.1f} |")
    print(f"| through shoal (returns at B1; done = B4, committed) | {s:.1f} | {c:.1f} |")
    print(f"stall ratio (Accelerate / shoal): {a / s:.1f}x")


if __name__ == "__main__":
    main()
