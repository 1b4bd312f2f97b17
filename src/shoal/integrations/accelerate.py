"""shoal inside Hugging Face Accelerate: ``accelerator.save_state()`` / ``load_state()`` through shoal.

::

    ckpts = use_shoal(accelerator, shoal.Config(shared="/lustre/ckpt", job="run-42"))
    ckpts.resume()             # the newest restorable checkpoint, if the job has one
    accelerator.save_state()   # on every process (collective); returns at B1

``save_state`` stages all that Accelerate's own writes (models, optimizers, schedulers, the
GradScaler, each process's python/numpy/torch/device RNG states, ``accelerator.step``, the
objects of ``register_for_checkpointing``, each prepared dataloader's epoch, seedable sampler and
stateful position) as shoal checkpoint ``project_configuration.iteration``; ``load_state`` restores
it exactly; ``total_limit`` is ``Config.keep_last``. Nothing is pickled: RNG states become tensors
and numbers, and each section is saved as :mod:`shoal.format.tree` encodes it (its tensors as items,
its structure and plain values, such as int keys, tuples and empty states, as JSON beside them).
FSDP, DeepSpeed, Megatron-LM and XLA, and save/load pre-hooks, are refused (:class:`ConfigError`).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import SeedableRandomSampler, get_sampler
from accelerate.utils import DistributedType, get_torch_accelerator_backend

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.engine.handle import SaveHandle
from shoal.errors import CheckpointExists, CheckpointNotFound, ConfigError, StateMismatch
from shoal.format import tree

__all__ = ["ShoalState", "use_shoal"]

log = logging.getLogger(__name__)

FORMAT = 2  # of the layout record saved with every checkpoint (``accelerate.layout``)
_REFUSED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)
# saved by the main process, with the models (every process saves the models, optimizers and its RNG)
_SECTIONS = ("optimizers", "schedulers", "dataloaders", "scaler", "custom")


def use_shoal(accelerator: Accelerator, config: Config, *, wait_for: Boundary | None = None) -> ShoalState:
    """Route ``accelerator.save_state`` / ``load_state`` through a new :class:`shoal.Checkpointer`.

    Collective: call it on every process once the ``Accelerator`` exists (before or after
    ``prepare``). ``ProjectConfiguration.total_limit``, if set, replaces ``config.keep_last``.
    ``wait_for``: each ``save_state`` blocks until its checkpoint reaches it (default: B1).
    Raises :class:`ConfigError` for FSDP, DeepSpeed, Megatron-LM or XLA, or a second install.
    """
    return ShoalState(accelerator, config, wait_for=wait_for)


class ShoalState:
    """What :func:`use_shoal` installs: the shoal ``save_state``/``load_state`` of one accelerator."""

    def __init__(self, accelerator: Accelerator, config: Config, *, wait_for: Boundary | None = None) -> None:
        if accelerator.distributed_type in _REFUSED or "save_state" in vars(accelerator):
            why = "already uses shoal" if "save_state" in vars(accelerator) else "is not supported"
            raise ConfigError(f"accelerate: {accelerator.distributed_type} accelerator {why}")
        limit = accelerator.project_configuration.total_limit
        if limit is not None and limit != config.keep_last:
            log.info("ProjectConfiguration.total_limit=%d replaces Config.keep_last", limit)
            config = replace(config, keep_last=limit)
        self.accelerator = accelerator
        self.wait_for = wait_for
        self.checkpointer = Checkpointer(config)
        """The Checkpointer every save and load goes through (``latest()``, ``exposure()``, ``wait()``)."""
        self._numbering_checked = False
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state

    def save_state(
        self, output_dir: str | None = None, *, step: int | None = None, safe_serialization: bool = True
    ) -> SaveHandle:
        """Save the accelerator's state as checkpoint ``step`` (collective); return at B1 with its handle.

        ``step`` defaults to ``project_configuration.iteration``, which becomes ``step + 1``, as
        Accelerate counts. ``safe_serialization`` is moot: nothing is pickled. Raises
        :class:`ConfigError` for an ``output_dir`` (checkpoints live in ``Config.shared``) or a save
        pre-hook; :class:`CheckpointExists` if, at the first save after start or a load, the job
        already holds ``step`` or a newer one; :class:`UnsupportedValue` for a value that would
        need pickle (in a registered object, say).
        """
        acc = self.accelerator
        self._refuse("save", output_dir, acc._save_model_state_pre_hook)
        step = acc.project_configuration.iteration if step is None else step
        if not self._numbering_checked:
            newest = self.checkpointer.latest(Boundary.PERSISTED)
            if newest is not None and step <= newest:
                raise CheckpointExists(
                    f"accelerate: save_state would write step {step}, but the job already holds step "
                    f"{newest}; resume first (load_state() continues the numbering) or set "
                    f"accelerator.project_configuration.iteration above {newest}"
                )
            self._numbering_checked = True
        state, layout = self._state()
        if acc.is_main_process:
            state["accelerate"] = {"layout": json.dumps(layout, allow_nan=False)}
        handle = self.checkpointer.save(step, state)
        if not handle.skipped:
            acc.project_configuration.iteration = step + 1
            if self.wait_for is not None:
                handle.wait(self.wait_for)
        return handle

    def load_state(self, input_dir: str | None = None, *, step: int | None = None) -> int:
        """Restore the accelerator's state from checkpoint ``step`` (None: the newest restorable).

        Collective; returns the step, and ``project_configuration.iteration`` becomes step + 1.
        Models are filled in place, the rest gets ``load_state_dict`` of what was saved (tensors on
        the CPU, as with Accelerate's own), each process its own RNG states (a process the
        checkpoint has none for keeps its own). Raises :class:`ConfigError` (an ``input_dir``, a
        load pre-hook), :class:`CheckpointNotFound`, :class:`StateMismatch` (not as many models,
        optimizers, schedulers, dataloaders or registered objects as saved; other shapes).
        """
        acc = self.accelerator
        self._refuse("load", input_dir, acc._load_model_state_pre_hook)
        head: dict[str, Any] = {"accelerate": {"layout": ""}}
        step = self.checkpointer.load(head, step, heal=False)
        layout = json.loads(head["accelerate"]["layout"])
        if layout["format"] != FORMAT:
            raise StateMismatch(f"accelerate: step {step} has layout format {layout['format']}, not {FORMAT}")
        live = self._objects()
        for name, objects in [("models", acc._models), *live.items()]:
            if len(objects) != layout["counts"][name]:
                raise StateMismatch(
                    f"accelerate: step {step} holds {layout['counts'][name]} {name}, the accelerator has "
                    f"{len(objects)}; prepare and register what the saving run did"
                )
        skeleton = layout["skeleton"]
        models = {str(i): _unwrap(acc, m).state_dict() for i, m in enumerate(acc._models)}
        # the layout again: a load that reads every item heals a checkpoint that was not yet committed
        target: dict[str, Any] = {"accelerate": {"layout": ""}, "models": models}
        target.update({name: tree.targets(skeleton[name]) for name in _SECTIONS})
        rank = acc.process_index
        if rank < layout["num_processes"]:  # its RNG states: shaped as the main process's, its own values
            target["rng"] = {str(rank): {"skeleton": "", "state": tree.targets(skeleton["rng"])}}
        else:
            log.warning("accelerate: step %d has no RNG states for process %d; it keeps its own", step, rank)
        self.checkpointer.load(target, step)
        for i, model in enumerate(acc._models):
            _unwrap(acc, model).load_state_dict(models[str(i)])
        for name in _SECTIONS:
            values = tree.decode(skeleton[name], target[name])
            if name == "dataloaders":
                for dl, saved in zip(acc._dataloaders, values, strict=True):
                    _set_dataloader(dl, saved)
            else:
                for obj, saved in zip(live[name], values, strict=True):
                    obj.load_state_dict(saved)
        if "rng" in target:
            rng = target["rng"][str(rank)]
            _set_rng(tree.decode(json.loads(rng["skeleton"]), rng["state"]))
        acc.step = layout["step"]
        acc.project_configuration.iteration = step + 1
        self._numbering_checked = False
        return step

    def resume(self) -> int | None:
        """:meth:`load_state` of the newest restorable checkpoint; None for a job with no checkpoint."""
        try:
            return self.load_state()
        except CheckpointNotFound:
            if self.checkpointer.latest(Boundary.PERSISTED) is not None:
                raise
            return None

    def close(self) -> None:
        """Finish in-flight checkpoints, close the Checkpointer, give the accelerator its own methods back."""
        for name in ("save_state", "load_state"):
            vars(self.accelerator).pop(name, None)
        self.checkpointer.close()

    def _objects(self) -> dict[str, list[Any]]:
        a = self.accelerator
        scaler = [] if a.scaler is None else [a.scaler]
        objs = (a._optimizers, a._schedulers, a._dataloaders, scaler, a._custom_objects)
        return {name: list(o) for name, o in zip(_SECTIONS, objs, strict=True)}

    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This process's part of the checkpoint, and the layout record (used by the main process's save)."""
        acc = self.accelerator
        live = self._objects()
        encoded = {
            n: tree.encode(
                [_dataloader_state(o) if n == "dataloaders" else o.state_dict() for o in objs],
                where=f"accelerate: {n}",
            )
            for n, objs in live.items()
        }
        # each process's own RNG skeleton beside its states: their plain values (positions) are its own
        rng, rng_skeleton = tree.encode(_rng_state(), where=f"accelerate: process {acc.process_index}'s RNG")
        rng_json = json.dumps(rng_skeleton, allow_nan=False)
        state: dict[str, Any] = {
            "models": {str(i): _unwrap(acc, m).state_dict() for i, m in enumerate(acc._models)},
            "optimizers": encoded["optimizers"][0],
            "rng": {str(acc.process_index): {"skeleton": rng_json, "state": rng}},
        }
        if acc.is_main_process:
            state.update({name: encoded[name][0] for name in _SECTIONS})
        layout = {
            "format": FORMAT,
            "num_processes": acc.num_processes,
            "step": acc.step,
            "counts": {"models": len(acc._models), **{n: len(objs) for n, objs in live.items()}},
            "skeleton": {"rng": rng_skeleton, **{name: encoded[name][1] for name in _SECTIONS}},
        }
        return state, layout

    def _refuse(self, what: str, directory: str | None, hooks: dict[Any, Any]) -> None:
        if directory is not None:
            raise ConfigError(f"accelerate: {what}_state({directory!r}): checkpoints live in Config.shared")
        if hooks:
            raise ConfigError(
                f"accelerate: a {what}-state pre-hook writes into a directory shoal has none of"
            )


def _unwrap(acc: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The model without DDP or torch.compile around it (keys portable to any number of processes)."""
    return acc.unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=False)


def _dataloader_state(dl: Any) -> dict[str, Any]:
    """Where Accelerate keeps a prepared dataloader's position: epoch, seedable sampler, stateful state."""
    state: dict[str, Any] = {}
    if hasattr(dl, "iteration"):
        state["iteration"] = dl.iteration
    sampler = get_sampler(dl)
    if isinstance(sampler, SeedableRandomSampler):
        state["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
    if getattr(dl, "use_stateful_dataloader", False):
        state["state"] = dl.state_dict()
    return state


def _set_dataloader(dl: Any, state: dict[str, Any]) -> None:
    if "iteration" in state:
        dl.iteration = state["iteration"]
    sampler = get_sampler(dl)
    if "sampler" in state and isinstance(sampler, SeedableRandomSampler):
        sampler.epoch, sampler.initial_seed = state["sampler"]["epoch"], state["sampler"]["initial_seed"]
    if "state" in state:
        dl.load_state_dict(state["state"])


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and numbers (Accelerate pickles the objects themselves)."""
    version, words, gauss = random.getstate()
    npy: Any = np.random.get_state(legacy=True)  # (MT19937, 624 uint32 keys, pos, has_gauss, gauss)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": npy[0], "keys": torch.from_numpy(npy[1].astype(np.int64)), "rest": list(npy[2:])},
        "torch": torch.get_rng_state(),
    }
    device, _ = get_torch_accelerator_backend()
    if device not in (None, "cpu"):
        module = torch.get_device_module(device)
        all_ = hasattr(module, "get_rng_state_all")
        state[device] = module.get_rng_state_all() if all_ else module.get_rng_state()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), *npy["rest"]))
    torch.set_rng_state(state["torch"])
    for device in set(state) - {"python", "numpy", "torch"}:
        module, value = torch.get_device_module(device), state[device]
        module.set_rng_state_all(value) if isinstance(value, list) else module.set_rng_state(value)
