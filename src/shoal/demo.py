"""``make demo`` / ``shoal demo``: one process trains a small model, checkpoints it with shoal, restores it.

It saves every few steps (``save`` returns at B1 while the pipeline drains in the
background), prints the boundary times and dedup figures of each checkpoint,
then loads the newest checkpoint into a fresh model and optimizer and checks
that every tensor is bit-identical, and that training resumed from it matches
an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import torch
from torch import nn

import shoal
from shoal.engine.store import list_checkpoints


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 16))
    # A frozen embedding-like block: unchanged between checkpoints, so it is deduplicated.
    model.register_buffer("frozen_table", torch.randn(2048, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 256, generator=g)
    y = torch.randn(64, 16, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def run(root: str, *, steps: int = 24, every: int = 6, dram: str | None = None) -> None:
    dram_root = dram or os.path.join(
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), f"shoal-demo-{os.getpid()}"
    )
    cfg = shoal.Config(
        shared=os.path.join(root, "shared"),
        local=os.path.join(root, "local"),
        dram=dram_root,
        job="demo",
        keep_last=3,
        chunk_size=256 << 10,
    )
    print(f"shoal {shoal.__version__} demo: shared tier {cfg.shared_url()}, DRAM {dram_root}")
    model, opt = _model(0)
    handles = []
    try:
        with shoal.Checkpointer(cfg) as ckpt:
            for step in range(1, steps + 1):
                loss = _train_step(model, opt, step)
                if step % every == 0:
                    t0 = time.perf_counter()
                    h = ckpt.save(step, _state(model, opt, step))
                    stall = time.perf_counter() - t0
                    print(f"step {step:3d}  loss {loss:.4f}  save returned at B1 after {stall * 1e3:6.1f} ms")
                    handles.append(h)
            for h in handles:
                h.wait(shoal.Boundary.RESTARTABLE, timeout=120)
            ckpt.wait()  # retention runs after each commit, in the background
            print("\ncheckpoint  " + "  ".join(f"{b.label:>15}" for b in shoal.Boundary))
            for h in handles:
                print(
                    f"step {h.step:5d}  " + "  ".join(f"{h.times[b] * 1e3:12.1f} ms" for b in shoal.Boundary)
                )
            print("\nretained on shared storage (keep_last=3):")
            for info in list_checkpoints(ckpt.shared):
                m = info.manifest
                assert m is not None and info.boundary is not None
                s = m.stats
                print(
                    f"  step {info.step:4d}  {info.boundary.label:<15} "
                    f"logical {s.logical_bytes / 2**20:6.2f} MiB  "
                    f"written {s.written_bytes / 2**20:6.2f} MiB  dedup x{s.dedup_ratio:.2f}"
                )

            # Restore into a fresh model and optimizer, then check every tensor bit for bit.
            fresh_model, fresh_opt = _model(seed=1)
            _train_step(fresh_model, fresh_opt, 0)  # materialise optimizer state to load into
            target = _state(fresh_model, fresh_opt, 0)
            loaded = ckpt.load(target)
            fresh_model.load_state_dict(target["model"])
            fresh_opt.load_state_dict(target["optim"])
            _check_equal(_state(model, opt, steps), _state(fresh_model, fresh_opt, steps), loaded)
            print(f"\nloaded step {loaded} into a fresh model: every tensor is bit-identical")

            # Resume from the checkpoint and compare with the uninterrupted run.
            ref_model, ref_opt = _model(0)
            for step in range(1, steps + 5):
                _train_step(ref_model, ref_opt, step)
            for step in range(loaded + 1, steps + 5):
                _train_step(fresh_model, fresh_opt, step)
            _check_equal(_state(ref_model, ref_opt, 0), _state(fresh_model, fresh_opt, 0), loaded)
            print(
                f"resumed from step {loaded} to step {steps + 4}: "
                "parameters match an uninterrupted run bit for bit"
            )
    finally:
        if dram is None:
            shutil.rmtree(dram_root, ignore_errors=True)


def _check_equal(a: Any, b: Any, step: int, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        if not (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.view(-1).view(torch.uint8) if a.dim() else a, b.view(-1).view(torch.uint8) if b.dim() else b
            )
        ):
            raise SystemExit(f"demo FAILED: {path} differs after loading step {step}")
    elif isinstance(a, dict):
        if set(a) != set(b):
            raise SystemExit(f"demo FAILED: keys of {path or 'state'} differ")
        for k in a:
            _check_equal(a[k], b[k], step, f"{path}.{k}" if path else str(k))
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _check_equal(x, y, step, f"{path}[{i}]")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shoal demo", description=__doc__)
    parser.add_argument(
        "--root", default=None, help="where the tiers go (default: a fresh temporary directory)"
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6)
    args = parser.parse_args(argv)
    if args.root:
        run(args.root, steps=args.steps, every=args.every)
    else:
        with tempfile.TemporaryDirectory(prefix="shoal-demo-") as root:
            run(root, steps=args.steps, every=args.every)


if __name__ == "__main__":
    main()
