"""torchtitan's own ``Trainer`` on CPU (gloo), its checkpointer switched to shoal with ``use_shoal``.

Unmodified, torchtitan 0.2.2's Trainer cannot start without CUDA: ``torchtitan.tools.utils`` picks
``device_type = _get_available_device_type() or "cuda"`` at import, and ``Trainer.__init__``
(torchtitan/train.py line 90) calls ``torch.cuda.set_device``: ``AttributeError: module 'torch._C'
has no attribute '_cuda_setDevice'``. :func:`run_on_cpu` points torchtitan's device names at the
CPU (``device_type = "cpu"``, so gloo, and a device module whose memory statistics are empty);
nothing else of torchtitan is replaced. Its FSDP path cannot run on gloo (torchtitan's
``apply_fsdp`` reduces gradients with ``ReduceOp.PREMUL_SUM``: ``RuntimeError: Cannot use
ReduceOp.PREMUL_SUM with Gloo``), so the runs use its data-parallel replicate path (DDP).

:func:`tiny_spec` registers torchtitan's llama3 train spec with a tiny flavour, no tokenizer and a
random-token dataset (no download; torchtitan's text datasets need files that its wheel lacks).
"""

from __future__ import annotations

import os
import types
from dataclasses import replace
from typing import Any

import torch

from . import torchtitan_train as train
from .torchtitan_train import SEQ, VOCAB, to_bytes


def run_on_cpu() -> None:
    """Point torchtitan's device type and device module at the CPU (before a Trainer is built)."""
    import torchtitan.components.metrics
    import torchtitan.distributed.parallel_dims
    import torchtitan.distributed.utils
    import torchtitan.tools.utils

    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=pages),
        reset_peak_memory_stats=lambda *args: None,
        empty_cache=lambda: None,
        memory_stats=lambda *args: {},
        synchronize=torch.cpu.synchronize,
    )
    for module in (
        torchtitan.tools.utils,
        torchtitan.distributed.utils,
        torchtitan.distributed.parallel_dims,
        torchtitan.components.metrics,
    ):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu


class Tokens(train.Tokens):
    """Endless random token sequences, sample ``i`` of a dp rank the same on every run."""

    def __init__(self, dp_rank: int) -> None:
        super().__init__(dp_rank, samples=2**62)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **_: Any) -> Any:
    from torchtitan.components.dataloader import ParallelAwareDataloader

    batch = job_config.training.local_batch_size
    return ParallelAwareDataloader(
        Tokens(dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=batch
    )


def tiny_spec() -> None:
    """Register ``tiny_cpu``: torchtitan's llama3 train spec, flavour ``tiny``, random tokens."""
    from torchtitan.models.llama3 import get_train_spec, llama3_args
    from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

    if "tiny_cpu" in _extra_train_specs:
        return
    flavour = replace(
        llama3_args["debugmodel"], dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ
    )
    spec = replace(
        get_train_spec(),
        model_args={"tiny": flavour},
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
    )
    register_train_spec("tiny_cpu", spec)


def arguments(root: str, steps: int, *extra: str) -> list[str]:
    """torchtitan's command line for a run of ``steps`` steps on 2 replicas, checkpoints every 2."""
    return [
        "--model.name=tiny_cpu",
        "--model.flavor=tiny",
        f"--training.steps={steps}",
        "--training.local_batch_size=2",
        f"--training.seq_len={SEQ}",
        "--training.mixed_precision_param=float32",
        "--parallelism.data_parallel_shard_degree=1",
        "--parallelism.data_parallel_replicate_degree=2",
        "--lr_scheduler.warmup_steps=2",
        "--debug.seed=0",
        "--checkpoint.enable",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=3",
        "--checkpoint.no-last-save-model-only",
        f"--job.dump_folder={root}/titan",
        "--metrics.log_freq=100",
        *extra,
    ]


def trainer_resumes(rank: int, world_size: int, *, root: str, dram: str) -> dict[str, Any] | None:
    """Two Trainers, as two runs of ``torchtitan.train`` with ``use_shoal`` would be.

    The first trains steps 1..8 (checkpoints 2..8 through shoal; its own state at step 8 is
    returned). The second is started with ``load_step=4`` and ``load_only`` (no saves): its
    ``Trainer.train`` loads step 4 and trains 5..8; its state at step 8 is returned.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    import shoal
    from shoal.integrations.torchtitan import use_shoal

    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun would set; the process group exists already
    run_on_cpu()
    tiny_spec()
    use_shoal(shoal.Config(shared=f"{root}/shared", local=f"{root}/local", dram=dram, job="trainer"))
    out: dict[str, Any] = {}
    for name, extra in (("first", ()), ("resumed", ("--checkpoint.load_step=4", "--checkpoint.load_only"))):
        trainer = Trainer(ConfigManager().parse_args(arguments(root, 8, *extra)))
        trainer.train()
        model = trainer.model_parts[0]
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {
            "model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, trainer.optimizers.optimizers[0], options=opts),
            "train_state": trainer.state_dict(),
        }
        manager = trainer.checkpointer
        loaded = manager.shoal.last_load
        out[name] = {
            "state": to_bytes(state),
            "manager": type(manager).__name__,
            "loaded": None if loaded is None else loaded.step,
        }
        trainer.close()
        dist.barrier()
    return out if rank == 0 else None
