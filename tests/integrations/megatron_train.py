"""Rank functions for the Megatron test: megatron.core's GPTModel, its sharded state dict, NVRx's manager.

Megatron-LM's trainer (``megatron.training``) is not in megatron-core's wheel, and megatron.core's
``GPTModel.forward`` needs CUDA (``transformer/dot_product_attention.py`` line 189, the global
memory buffer: ``AssertionError: Torch not compiled with CUDA enabled`` from
``torch.cuda.current_device``). So each rank does on CPU (gloo) what Megatron-LM's
``save_checkpoint(..., non_persistent_ckpt=True)`` and ``load_checkpoint`` do around the local
checkpoint manager: megatron.core's ``GPTModel`` (tiny, built with ``parallel_state``
initialised), its ``sharded_state_dict()`` plus a ``ShardedObject`` of RNG states and a common
part (iteration, ``args`` namespace, a torch optimizer's state), turned into an
``MCoreTensorAwareStateDict`` (``algo="atomic"``) and saved by the manager; on resume
``find_latest()``, ``load()`` and ``to_state_dict(...)``. Training steps the GPT's parameters with
Adam on a loss of its own (random targets, a dropout-like mask from torch's global RNG).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB, SEQ, HIDDEN = 128, 16, 64


def _model(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron.core logs every common value that differs between ranks (here each rank's optimizer)
    logging.getLogger("megatron.core.dist_checkpointing").setLevel(logging.ERROR)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        use_cpu_initialization=True,
        ffn_hidden_size=128,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: Any, opt: torch.optim.Optimizer, rank: int, iteration: int) -> None:
    targets = torch.Generator().manual_seed(1000 * iteration + rank)
    loss = torch.zeros(())
    for p in model.parameters():
        keep = (torch.rand(p.shape) > 0.1).to(p.dtype)  # the global RNG, restored on resume
        loss = loss + ((p - torch.randn(p.shape, generator=targets)) ** 2 * keep).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _rng() -> dict[str, Any]:
    return {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}


def _sharded(model: Any, opt: torch.optim.Optimizer, rank: int, world: int, iteration: int) -> dict[str, Any]:
    """A state like Megatron-LM's ``generate_state_dict``: sharded model and RNG, plain common values."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.transformer.enums import AttnBackend

    return {
        "model": model.sharded_state_dict(),
        "rng_state": ShardedObject("rng_state", [_rng()], (world,), (rank,), replica_id=0),
        "optimizer": opt.state_dict(),
        "iteration": iteration,
        "checkpoint_version": 3.0,
        # Megatron-LM's args hold enums (attention_backend) and dtypes beside plain values
        "args": argparse.Namespace(
            lr=1e-2,
            hidden_size=HIDDEN,
            params_dtype=torch.float32,
            tokenizer=None,
            attention_backend=AttnBackend.auto,
        ),
    }


def _snapshot(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    import copy

    return {
        "model": {
            k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")
        },
        "optimizer": copy.deepcopy(opt.state_dict()),
        "rng": _rng(),
    }


def _manager(root: str, dram: str, **kwargs: Any) -> Any:
    import shoal
    from shoal.integrations.megatron import ShoalLocalCheckpointManager

    config = shoal.Config(shared=f"{root}/shared", local=f"{root}/local", dram=dram, job="gpt", keep_last=2)
    return ShoalLocalCheckpointManager(config, **kwargs)


def train_then_die(rank: int, world: int, *, root: str, dram: str) -> None:
    """Iterations 1..3 (saves: 1 async, finalised at the next iteration; 2 and 3 sync, at B1); once 2
    is committed, go on uninterrupted to 4, keep what each rank holds after 3 and after 4, SIGKILL."""
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from shoal.boundary import Boundary
    from shoal.errors import UnsupportedValue

    model, opt = _model(seed=7)
    mgr = _manager(root, dram)
    assert mgr.find_latest() == -1
    pending = None
    handles = {}
    for iteration in (1, 2, 3):
        _step(model, opt, rank, iteration)
        if pending is not None:
            # what megatron.core's TemporalAsyncCaller does (after a torch.cuda.synchronize, which needs
            # CUDA): fork a process that runs the request's function (os.fork: these ranks are daemons)
            child = os.fork()
            if child == 0:
                pending.async_fn(*pending.async_fn_args)
                os._exit(0)
            assert os.waitpid(child, 0)[1] == 0 and handles[1].done(Boundary.RESTARTABLE)
            pending.execute_sync()  # NVRx's own: the function again (done), a barrier, the finalize functions
            pending = None
        state = _sharded(model, opt, rank, world, iteration)
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo="atomic")
        if iteration == 1:
            pending = mgr.save(tasd, iteration, is_async=True)
            assert pending.async_fn is not None and len(pending.finalize_fns) == 1
            # megatron.core's persistent worker gets the request pickled, without its finalize functions
            pickle.loads(pickle.dumps(pending._replace(finalize_fns=[])))
        else:
            assert mgr.save(tasd, iteration) is None
        handles[iteration] = mgr.last_save
    assert handles[1].done(Boundary.RESTARTABLE)
    # a value only pickle could carry is refused before anything is staged, naming its place
    bad, _ = MCoreTensorAwareStateDict.from_state_dict({"x": Path("/")}, algo="atomic")
    try:
        mgr.save(bad, 9)
        raise AssertionError("saved a pathlib.Path")
    except UnsupportedValue as e:
        assert "common/x" in str(e) or "at x" in str(e), e
    torch.save(_snapshot(model, opt), f"{root}/after3-{rank}.pt")
    _step(model, opt, rank, 4)
    torch.save(_snapshot(model, opt), f"{root}/after4-{rank}.pt")
    handles[2].wait(Boundary.RESTARTABLE, timeout=120)  # a commit before the crash; 3 may be at B1 only
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(rank: int, world: int, *, root: str, dram: str) -> dict[str, Any]:
    """A fresh model (another seed); find_latest, load, to_state_dict; compare with the killed run's own
    state after 3; iteration 4 again, compared with the uninterrupted one; save 4 and commit it."""
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from shoal.boundary import Boundary
    from shoal.testing.checkpoints import assert_identical

    model, opt = _model(seed=99)
    mgr = _manager(root, dram)
    found = mgr.find_latest()
    tasd, ckpt_id = mgr.load()
    assert isinstance(tasd, MCoreTensorAwareStateDict)
    template = _sharded(model, opt, rank, world, 0)
    loaded = tasd.to_state_dict(template, algo="atomic")
    model.load_state_dict(loaded["model"], strict=False)
    opt.load_state_dict(loaded["optimizer"])
    rng = loaded["rng_state"][0]
    random.setstate(rng["random"])
    np.random.set_state(rng["np"])
    torch.set_rng_state(rng["torch"])
    after3 = torch.load(f"{root}/after3-{rank}.pt", weights_only=False)
    assert_identical(_snapshot(model, opt), after3, "after 3")
    assert_identical(vars(loaded["args"]), vars(template["args"]), "args")
    assert (loaded["iteration"], loaded["checkpoint_version"]) == (3, 3.0)
    _step(model, opt, rank, 4)
    assert_identical(
        _snapshot(model, opt), torch.load(f"{root}/after4-{rank}.pt", weights_only=False), "after 4"
    )
    state = _sharded(model, opt, rank, world, 4)
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo="atomic")
    mgr.save(tasd, 4)
    mgr.last_save.wait(Boundary.RESTARTABLE, timeout=120)
    healed = mgr.shoal.last_heal is not None
    mgr.shoal.wait(timeout=120)
    mgr.close()
    return {"found": found, "ckpt_id": list(ckpt_id), "healed": healed}


def basic_round_trip(rank: int, world: int, *, root: str, dram: str) -> None:
    """NVRx's ``BasicTensorAwareStateDict`` (its constructor asserts CUDA tensors: here plain values
    only), saved at iteration 5, found and loaded back: the same class, the same values and types."""
    from collections import OrderedDict

    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    from shoal.testing.checkpoints import assert_identical

    value = {"iteration": 5, "lr": [0.5, float("inf"), None], "sched": OrderedDict(b=(1, "x"), a=True)}
    mgr = _manager(root, dram, wait_for=__import__("shoal").Boundary.RESTARTABLE)
    mgr.save(BasicTensorAwareStateDict(value), 5)
    assert mgr.find_latest() == 5
    tasd, ckpt_id = mgr.load()
    assert type(tasd) is BasicTensorAwareStateDict and ckpt_id == (5, 0, "")
    assert_identical(tasd.state_dict, value, "basic")
    mgr.close()
