"""Stall of one Megatron local checkpoint save: NVRx's ``LocalCheckpointManager`` against shoal's, in one run.

One process (gloo, world size 1), megatron.core's ``GPTModel`` (local layer spec, widened to about
``--mib`` MiB of float32 parameters) with a torch Adam whose state (twice that) goes in the common
part, as an ``MCoreTensorAwareStateDict`` (``algo="atomic"``) built from ``sharded_state_dict()``
before each save, as Megatron-LM's ``save_checkpoint`` does. Two managers, alternating,
``--repeats`` saves each after one warm-up each, each after a parameter update (GPTModel's forward
needs CUDA, so the update is Adam on a loss of the parameters alone): NVRx's
``LocalCheckpointManager`` (``torch.save`` of the whole state dict into ``--root``, synchronous: its
async path calls ``torch.cuda.synchronize``) and :class:`ShoalLocalCheckpointManager` (shared tier
under ``--root``, DRAM tier in ``/dev/shm``). Measured: the stall (``save`` until it returns) and the
time until the checkpoint is done (NVRx: the same, written and validated; shoal: B4, committed).
Prints medians and the stall ratio. Usage: ``python benchmarks/integrations_megatron.py --mib 32``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

import shoal
from shoal.testing.bench.scratch import scratch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=32, help="model parameters, MiB (Adam adds twice that)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", default=None, help="where both write (default: a temporary directory)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron.core: no Apex, no TE
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    with scratch("shoal-bench-megatron-", args.root, process_group=True) as (root, dram):
        run(args, root, dram)


def run(args: argparse.Namespace, root: str, dram: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    from shoal.integrations.megatron import ShoalLocalCheckpointManager

    parallel_state.initialize_model_parallel(1, 1)
    hidden = 128
    while 4 * (4 * 12 * hidden * hidden + 2 * 1024 * hidden) < args.mib << 20 and hidden < 4096:
        hidden += 64
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=hidden, num_attention_heads=8, use_cpu_initialization=True
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=1024, max_sequence_length=64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train_step() -> None:
        opt.zero_grad()
        sum((p.float() ** 2).mean() for p in model.parameters()).backward()
        opt.step()

    def state(iteration: int) -> MCoreTensorAwareStateDict:
        sd = {"model": model.sharded_state_dict(), "optimizer": opt.state_dict(), "iteration": iteration}
        return MCoreTensorAwareStateDict.from_state_dict(sd, algo="atomic")[0]

    train_step()
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    total = params + sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    print(
        f"GPTModel hidden {hidden}, 4 layers: model {params / 2**20:.0f} MiB, state {total / 2**20:.0f} MiB"
    )
    print("| manager | stall (ms, median) | until done (ms, median) |")
    print("|---|---:|---:|")
    cfg = shoal.Config(shared=os.path.join(root, "shared"), dram=dram, job="bench", keep_last=2)
    managers = {
        "NVRx LocalCheckpointManager (torch.save, sync)": LocalCheckpointManager(os.path.join(root, "local")),
        "shoal (returns at B1; done = B4)": ShoalLocalCheckpointManager(cfg),
    }
    stalls: dict[str, list[float]] = {name: [] for name in managers}
    done: dict[str, list[float]] = {name: [] for name in managers}
    for i in range(args.repeats + 1):
        for name, mgr in managers.items():
            train_step()
            tasd = state(i + 1)
            t0 = time.perf_counter()
            mgr.save(tasd, i + 1)
            stall = time.perf_counter() - t0
            if isinstance(mgr, ShoalLocalCheckpointManager):
                assert mgr.last_save is not None
                mgr.last_save.wait(shoal.Boundary.RESTARTABLE)
            if i:  # the first of each is a warm-up
                stalls[name].append(stall)
                done[name].append(time.perf_counter() - t0)
    managers["shoal (returns at B1; done = B4)"].close()
    medians = {name: statistics.median(stalls[name]) * 1e3 for name in managers}
    for name in managers:
        print(f"| {name} | {medians[name]:.1f} | {statistics.median(done[name]) * 1e3:.1f} |")
    own, ours = medians.values()
    print(f"| stall ratio (NVRx / shoal) | {own / ours:.1f}x | |")


if __name__ == "__main__":
    main()
