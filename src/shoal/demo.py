"""``make demo`` / ``shoal demo``: 4 ranks on 2 simulated hosts train, lose a host, restore, resume.

Three runs of the same data-parallel training job (a small transformer on the CPU, gloo,
each rank its own host directory for DRAM and local disk, as on two machines):

1. **reference**: trains ``--steps`` steps without a fault;
2. **faulty**: checkpoints every ``--every`` steps with shoal (the drain to shared storage
   is slowed down, as on a busy file system), and at step ``--lose-at`` host ``h1`` is lost:
   its processes are SIGKILLed and its DRAM and local disk deleted; the launcher then kills
   the rest of the job;
3. **restart**: every rank loads the newest checkpoint that survives (it reached B2: its
   chunks are in ``h0``'s DRAM and ``h0``'s partner copies of ``h1``'s chunks), heals it,
   trains on to ``--steps``, and compares every parameter with the reference, bit for bit.

It prints each checkpoint's boundary times, the rollback exposure at the failure for each
failure class, where the restored bytes came from, and dedup figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from typing import TYPE_CHECKING, Any

import shoal
from shoal import failpoints
from shoal.format.chunking import digest
from shoal.records.store import list_checkpoints
from shoal.testing.multiproc import run_ranks
from shoal.tiers.roles import Role, open_role

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch is imported by the functions that train (in the ranks' processes), not here: `shoal demo
# --help` and the parser of `shoal` must not wait seconds for it.

HOSTS = ["h0", "h0", "h1", "h1"]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True
    )
    model = nn.Sequential(
        nn.Embedding(512, 64), nn.TransformerEncoder(layer, num_layers=2), nn.Linear(64, 512)
    )
    # A frozen table (think: a frozen embedding): the same in every checkpoint, so stored once.
    model.register_buffer("frozen_table", torch.randn(2048, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, *, sync: bool = True
) -> float:
    """One data-parallel step: this rank's batch, gradients averaged over the job."""
    import torch
    import torch.distributed as dist
    from torch import nn

    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, 512, (8, 32), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    if sync:
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
    opt.step()
    return loss.item()


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def _fingerprint(model: nn.Module) -> dict[str, str]:
    import torch

    return {
        k: digest(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for k, v in model.state_dict().items()
    }


def _config(root: str) -> shoal.Config:
    return shoal.Config(
        shared=os.path.join(root, "shared"),
        local=os.path.join(root, "local"),
        dram=os.path.join(root, "dram"),
        job="demo",
        chunk_size=256 << 10,
        keep_last=3,
        dram_slots=4,  # room for four checkpoints in flight: no back-pressure while drains lag
        collective_timeout=30.0,
    )


def _rank(rank: int, world: int, *, mode: str, root: str, steps: int, every: int, lose_at: int) -> Any:
    import torch.distributed as dist

    model, opt = _model()
    if mode == "reference":
        for step in range(1, steps + 1):
            _train_step(model, opt, step, rank)
        return _fingerprint(model)
    if mode == "faulty":
        # A busy shared file system: each drain waits a few seconds, so B3 trails B2.
        failpoints.configure("pipeline.before_drain=delay:3")
        ckpt = shoal.Checkpointer(_config(root))
        handles = []
        t0 = time.perf_counter()
        for step in range(1, lose_at + 1):
            _train_step(model, opt, step, rank)
            if step % every == 0:
                handles.append(ckpt.save(step, _state(model, opt, step)))
        # The demo waits for the last checkpoint to reach B2 so that every run tells the same story.
        handles[-1].wait(shoal.Boundary.REPLICATED, timeout=60)
        if rank == 0:
            timeline = {
                "elapsed": time.perf_counter() - t0,
                "checkpoints": [
                    {
                        "step": h.step,
                        "reached": int(h.reached or 0),
                        "times": {int(b): t for b, t in h.times.items()},
                    }
                    for h in handles
                ],
            }
            with open(os.path.join(root, "timeline.json"), "w") as f:
                json.dump(timeline, f)
        dist.barrier()
        if HOSTS[rank] == "h1":
            os.kill(os.getpid(), signal.SIGKILL)  # host h1 is gone
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher tears the rest of the job down
    # mode == "restart"
    _train_step(model, opt, 0, rank, sync=False)  # materialise the optimizer state to load into
    with shoal.Checkpointer(_config(root)) as ckpt:
        state = _state(model, opt, 0)
        loaded = ckpt.load(state)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        report = ckpt.last_load
        heal = ckpt.last_heal
        for step in range(loaded + 1, steps + 1):
            _train_step(model, opt, step, rank)
        healed = None
        if heal is not None:
            heal.wait(shoal.Boundary.RESTARTABLE, timeout=120)
            healed = {int(b): t for b, t in heal.times.items()}
        assert report is not None
        return {
            "loaded": loaded,
            "origin": report.origin,
            "by_tier": dict(report.bytes_by_tier),
            "fabric": report.fabric_bytes,
            "healed": healed,
            "fingerprint": _fingerprint(model),
        }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def run(root: str, *, steps: int = 30, every: int = 5, lose_at: int = 23) -> None:
    if not every <= lose_at < steps:
        raise SystemExit("shoal demo: need --every <= --lose-at < --steps")
    t_start = time.perf_counter()
    kw = {"root": root, "steps": steps, "every": every, "lose_at": lose_at}
    print(f"shoal {shoal.__version__} demo: 4 ranks on hosts {HOSTS}, tiers under {root}\n")
    print(f"1. reference run: {steps} steps, no fault ...", flush=True)
    reference = run_ranks(_rank, hosts=HOSTS, kwargs={**kw, "mode": "reference"}, timeout=300)
    print(f"2. faulty run: checkpoint every {every} steps; host h1 lost at step {lose_at} ...", flush=True)
    run_ranks(_rank, hosts=HOSTS, kwargs={**kw, "mode": "faulty"}, allow_death=range(4), timeout=300)
    for tier in ("dram", "local"):
        shutil.rmtree(os.path.join(root, tier, "demo", "h1"), ignore_errors=True)
    with open(os.path.join(root, "timeline.json")) as f:
        timeline = json.load(f)
    print("\n   checkpoint " + "".join(f"{b.label:>16}" for b in shoal.Boundary))
    for c in timeline["checkpoints"]:
        cells = [
            f"{c['times'][str(int(b))] * 1e3:13.1f} ms" if str(int(b)) in c["times"] else f"{'-':>16}"
            for b in shoal.Boundary
        ]
        print(f"   step {c['step']:5d} " + "".join(cells))
    print(f"\n   host h1 lost at step {lose_at}: its processes killed, its DRAM and local disk deleted.")
    print("   rollback exposure at the failure (steps since the newest checkpoint that survives it):")
    for label, boundary in (
        ("process crash", shoal.Boundary.STAGED),
        ("host loss", shoal.Boundary.REPLICATED),
        ("cluster loss", shoal.Boundary.PERSISTED),
    ):
        ok = [c["step"] for c in timeline["checkpoints"] if c["reached"] >= int(boundary)]
        newest = max(ok, default=0)
        print(f"     {label:<13} -> {boundary.label:<14} newest step {newest:3d}: {lose_at - newest} steps")
    print("\n3. restart on h0 and a fresh h1: load, heal, resume ...", flush=True)
    restarted = run_ranks(_rank, hosts=HOSTS, kwargs={**kw, "mode": "restart"}, timeout=300)
    r0 = restarted[0]
    print(
        f"   restored step {r0['loaded']} (metadata from {r0['origin']}): "
        + ", ".join(f"{t} {_mib(n)}" for t, n in sorted(r0["by_tier"].items()))
        + f"; {_mib(r0['fabric'])} over the fabric"
    )
    if r0["healed"]:
        b4 = r0["healed"][int(shoal.Boundary.RESTARTABLE)]
        print(f"   healed: step {r0['loaded']} saved again from the restored state, B4 after {b4:.2f} s")
    print("\n   on shared storage (keep_last=3): bytes the ranks staged, and new bytes written")
    shared = open_role(Role.SHARED, _config(root).shared_url())
    for info in list_checkpoints(shared):
        if info.manifest is None or info.boundary is None:
            continue
        s = info.manifest.stats
        # a step that wrote nothing new reused every byte: say so, not "dedup xinf"
        dedup = (
            f"dedup x{s.dedup_ratio:.2f}" if s.written_bytes else "all reused" if s.logical_bytes else "empty"
        )
        print(
            f"     step {info.step:4d} {info.boundary.label:<15} logical {_mib(s.logical_bytes)}, "
            f"written {_mib(s.written_bytes)}, {dedup}"
        )
    same = all(r["fingerprint"] == reference[i] for i, r in enumerate(restarted))
    if not same:
        raise SystemExit("demo FAILED: the resumed parameters differ from the uninterrupted run")
    print(
        f"\nresumed from step {r0['loaded']} to step {steps}: every parameter on every rank is "
        f"bit-identical to the uninterrupted run ({time.perf_counter() - t_start:.0f} s)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shoal demo", description=__doc__)
    parser.add_argument(
        "--root", default=None, help="where the tiers go (default: a fresh temporary directory)"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--lose-at", type=int, default=23, help="the step at which host h1 is lost")
    args = parser.parse_args(argv)
    if args.root:
        run(args.root, steps=args.steps, every=args.every, lose_at=args.lose_at)
        local = os.path.join(args.root, "local")
        print(
            f"\nsee it: shoal report demo --local {local} -o report.html   (one HTML page)\n"
            f"        shoal timeline demo --local {local} -o trace.json  (open in Perfetto)"
        )
    else:
        with tempfile.TemporaryDirectory(prefix="shoal-demo-") as root:
            run(root, steps=args.steps, every=args.every, lose_at=args.lose_at)


if __name__ == "__main__":
    main()
