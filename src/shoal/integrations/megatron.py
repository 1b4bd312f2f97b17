"""shoal as Megatron's local checkpoint manager (``--non-persistent-ckpt-type local``).

Megatron-LM's ``pretrain`` builds NVIDIA Resiliency Extension's ``LocalCheckpointManager`` for its
non-persistent local checkpoints. One call in the training script, before ``pretrain``, makes it
build a :class:`ShoalLocalCheckpointManager` instead::

    import shoal
    from shoal.integrations.megatron import use_shoal

    use_shoal(shoal.Config(shared="/lustre/ckpt", job="gpt-8b"))
    pretrain(...)  # with --non-persistent-ckpt-type local --non-persistent-save-interval N

A loop of your own builds the manager itself. ``save`` returns at B1 (B2..B4 follow in the
background); nothing is pickled (see docs/integrations.md, "Megatron (local checkpoints)").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import importlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import BaseCheckpointManager, CkptID

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.engine.handle import SaveHandle
from shoal.errors import CheckpointFailed, CheckpointNotFound, ConfigError, ShoalError, UnsupportedValue
from shoal.format import tree

__all__ = ["ShoalLocalCheckpointManager", "use_shoal"]

log = logging.getLogger(__name__)

_TAG = "__shoal_megatron__"  # marks a converted object in the plain tree
_MAPPING = "megatron.core.dist_checkpointing.mapping"  # ShardedTensor, ShardedObject
_MCORE = "megatron.core.dist_checkpointing.tensor_aware_state_dict"


def use_shoal(
    shoal_config: Config, *, wait_for: Boundary | None = None, async_boundary: Boundary = Boundary.RESTARTABLE
) -> None:
    """Make Megatron-LM's ``pretrain`` build a :class:`ShoalLocalCheckpointManager` (call before it).

    Replaces the ``LocalCheckpointManager`` ``pretrain`` imports from NVRx's ``local_manager``;
    ``--non-persistent-local-ckpt-dir`` becomes ``Config.local`` unless the config names one.
    """

    def build(
        root_local_ckpt_dir: str | Path, session_id: str = "", repl_strategy: Any = None, **kwargs: Any
    ) -> ShoalLocalCheckpointManager:
        if kwargs.get("group") is not None:
            raise ConfigError("megatron: a local checkpoint manager on a process subgroup is not supported")
        config = shoal_config if shoal_config.local else replace(shoal_config, local=str(root_local_ckpt_dir))
        kw: dict[str, Any] = {"wait_for": wait_for, "async_boundary": async_boundary}
        return ShoalLocalCheckpointManager(config, session_id=session_id, repl_strategy=repl_strategy, **kw)

    local_manager.LocalCheckpointManager = build


class ShoalLocalCheckpointManager(BaseCheckpointManager):
    """NVRx's ``BaseCheckpointManager`` saving, finding and loading each rank's state through shoal.

    ``shoal_config``: where checkpoints go (``keep_last``: the retention); ``wait_for``: a synchronous
    ``save`` also waits for it (None: returns at B1); ``async_boundary``: when the ``AsyncRequest`` of
    ``save(..., is_async=True)`` is done. ``session_id``: NVRx's, in the ids. :attr:`shoal` is the
    Checkpointer, :attr:`last_save` the newest handle. Construction is collective. Raises
    :class:`ConfigError` for a ``repl_strategy`` (shoal has partner copies) or ``Config.on_busy="skip"``.
    """

    def __init__(
        self,
        shoal_config: Config,
        *,
        session_id: str = "",
        repl_strategy: Any = None,
        wait_for: Boundary | None = None,
        async_boundary: Boundary = Boundary.RESTARTABLE,
    ) -> None:
        if repl_strategy is not None:
            raise ConfigError(
                "megatron: NVRx replication (--replication) is refused: shoal has partner copies"
            )
        if shoal_config.on_busy != "wait":
            raise ConfigError('megatron: Config.on_busy must be "wait" (a skipped save would count as saved)')
        super().__init__(session_id, None)
        self.wait_for = wait_for
        self.async_boundary = async_boundary
        self.shoal = Checkpointer(shoal_config)
        """The Checkpointer every save and load goes through."""
        self.last_save: SaveHandle | None = None
        """The handle of the newest checkpoint this manager saved."""

    def save(
        self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False
    ) -> AsyncRequest | None:
        """Save this rank's ``state_dict`` as checkpoint ``iteration`` (collective); see the class.

        Returns at B1 (or ``wait_for``): None, or an ``AsyncRequest`` if ``is_async``. Raises
        :class:`UnsupportedValue` (a value only pickle could carry), ``CheckpointExists``, and at the
        wait :class:`CheckpointFailed` (the failed step is then removed).
        """
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ConfigError(f"megatron: iteration must be an int >= 0, got {iteration!r}")
        self.latest_iteration = -1  # as NVRx's: find_latest asks again after a save
        self._save(state_dict, self._ckpt_id(iteration))
        assert self.last_save is not None
        if is_async:  # the async process Megatron starts (or its worker) returns once the boundary is reached
            fd, flag = tempfile.mkstemp(prefix=f"shoal-megatron-{iteration}-")
            os.close(fd)
            handle, boundary = self.last_save, self.async_boundary
            threading.Thread(target=_unlink_at, args=(handle, boundary, flag), daemon=True).start()
            return AsyncRequest(_wait_while, (flag, os.getpid()), [partial(self._finish, handle, boundary)])
        if self.wait_for is not None:
            self._finish(self.last_save, self.wait_for)
        return None

    def find_latest(self) -> int:
        """The newest iteration restorable on every rank, or -1 (collective, cached until a save).

        -1 also if that checkpoint was saved by another number of ranks (Megatron then loads its
        persistent checkpoint). Raises :class:`CheckpointNotFound` if the job has checkpoints on
        shared storage but none is restorable (rather than letting training start from scratch).
        """
        if self.latest_iteration != -1:
            return int(self.latest_iteration)
        head: dict[str, Any] = {"megatron": {"world": -1}}
        try:
            found = self.shoal.load(head, heal=False)
        except CheckpointNotFound:
            if self.shoal.latest(Boundary.PERSISTED) is not None:
                raise
            return -1
        saved_by = head["megatron"]["world"]
        if saved_by != self.shoal.world_size:
            log.warning("megatron: iteration %d was saved by %s ranks, not these", found, saved_by)
            return -1
        self.latest_iteration = found
        return found

    def _my_ckpt_ids(self) -> list[CkptID]:
        """This rank's id of the newest restorable checkpoint, or none (collective: :meth:`find_latest`)."""
        return [] if (latest := self.find_latest()) < 0 else [self._ckpt_id(latest)]

    def _save(self, state_dict: TensorAwareStateDict, ckpt_id: CkptID) -> None:
        iteration, rank, _ = ckpt_id
        where = f"megatron: iteration {iteration}, rank {rank}"
        stored, skeleton = tree.encode(_to_plain(state_dict, where), where=where)
        skeleton_json = json.dumps(skeleton, allow_nan=False)
        entry: dict[str, Any] = {str(rank): {"skeleton": skeleton_json, "tensors": stored}}
        if rank == 0:
            entry["world"] = self.shoal.world_size
        self.last_save = self.shoal.save(iteration, {"megatron": entry})

    def _load(self, ckpt_id: CkptID) -> TensorAwareStateDict:
        """This rank's state dict of ``ckpt_id`` (collective), on the CPU (``load()`` moves it back)."""
        iteration, rank, _ = ckpt_id
        head: dict[str, Any] = {"megatron": {str(rank): {"skeleton": ""}}}
        self.shoal.load(head, iteration, heal=False)
        skeleton = json.loads(head["megatron"][str(rank)]["skeleton"])
        # everything this rank saved, again: a load that reads every item heals an uncommitted one
        mine: dict[str, Any] = {"skeleton": "", "tensors": tree.targets(skeleton)}
        target: dict[str, Any] = {"megatron": {str(rank): mine, **({"world": -1} if rank == 0 else {})}}
        self.shoal.load(target, iteration)
        return _from_plain(tree.decode(skeleton, mine["tensors"]))

    def _cleanup(self, iteration: int) -> None:
        """Nothing: shoal's retention keeps ``Config.keep_last`` committed checkpoints."""

    def _cleanup_failed_save(self, iteration: int) -> None:
        """Remove checkpoint ``iteration`` (a failed save) from every tier."""
        self.shoal.remove(iteration)

    def _finish(self, handle: SaveHandle, boundary: Boundary) -> None:
        """Wait for ``boundary``; a failed save is removed, its error raised."""
        try:
            handle.wait(boundary)
        except CheckpointFailed:
            self._cleanup_failed_save(handle.step)
            raise
        log.info("megatron: local checkpoint of iteration %d reached %s", handle.step, boundary.name)

    def close(self) -> None:
        """Finish in-flight checkpoints and close the Checkpointer."""
        self.shoal.close()


def _unlink_at(handle: SaveHandle, boundary: Boundary, flag: str) -> None:
    with contextlib.suppress(ShoalError):  # the request's finalize function raises it
        handle.wait(boundary)
    os.unlink(flag)


def _wait_while(flag: str, trainer: int) -> None:
    """The async request's function: return once the trainer removed ``flag`` (the checkpoint reached
    the boundary, or failed) or is gone (polls: Megatron forks it, or hands it to its worker)."""
    while os.path.exists(flag):
        try:
            os.kill(trainer, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)


def _to_plain(value: Any, where: str) -> Any:
    """``value`` (a TensorAwareStateDict) as nested plain values and tensors that :mod:`tree` encodes."""
    mapping = sys.modules.get(_MAPPING)  # a ShardedTensor exists only once megatron.core is imported
    sharded = (mapping.ShardedTensor, mapping.ShardedObject) if mapping is not None else ()

    def walk(node: Any, path: str) -> Any:
        kind = type(node)
        if kind is dict or kind is OrderedDict:
            if _TAG in node:
                raise UnsupportedValue(f"{where}: the dict at {path} has the reserved key {_TAG!r}")
            return kind((k, walk(v, f"{path}/{k}")) for k, v in node.items())
        if kind is list or kind is tuple:
            return kind(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        if kind in sharded:
            fields = {
                f.name: walk(getattr(node, f.name), f"{path}/{f.name}") for f in dataclasses.fields(node)
            }
            on = node.data.device.type if isinstance(node.data, torch.Tensor) else "cpu"
            return {_TAG: kind.__name__, "fields": fields, "device": getattr(node, "orig_device", on)}
        if kind is argparse.Namespace:
            return {_TAG: "Namespace", "fields": walk(vars(node), path)}
        if isinstance(node, enum.Enum) and kind.__module__.startswith("megatron."):  # in Megatron's args
            return {_TAG: "Enum", "class": [kind.__module__, kind.__qualname__], "name": node.name}
        if kind is np.ndarray:
            try:
                return {_TAG: "ndarray", "data": torch.from_numpy(np.ascontiguousarray(node).copy())}
            except TypeError as e:
                raise UnsupportedValue(
                    f"{where}: the numpy array at {path} has dtype {node.dtype}: {e}"
                ) from e
        return node  # tensors and plain values; tree.encode refuses the rest, naming the place

    if value.is_hollow:
        raise UnsupportedValue(f"{where}: the state dict is hollow (its tensors were popped)")
    if type(value) is BasicTensorAwareStateDict:
        return {"kind": "basic", "state": walk(value.state_dict, "state_dict")}
    if type(value).__module__ == _MCORE and type(value).__name__ == "MCoreTensorAwareStateDict":
        return {
            "kind": "mcore",
            "common": walk(value.common, "common"),
            "sharded": walk(value.sharded_state_dict, "sharded"),
        }
    raise UnsupportedValue(f"{where}: a {type(value).__qualname__} (only pickle could rebuild it)")


def _from_plain(plain: dict[str, Any]) -> TensorAwareStateDict:
    """The TensorAwareStateDict :func:`_to_plain` was given (its tensors on the CPU)."""

    def walk(node: Any) -> Any:
        kind = type(node)
        if (kind is dict or kind is OrderedDict) and _TAG in node:
            tag = node[_TAG]
            if tag == "ndarray":
                return node["data"].numpy()
            if tag == "Namespace":
                return argparse.Namespace(**walk(node["fields"]))
            if tag == "Enum" and node["class"][0].startswith("megatron."):  # never another module
                return getattr(importlib.import_module(node["class"][0]), node["class"][1])[node["name"]]
            made = getattr(sys.modules[_MAPPING], tag)(**walk(node["fields"]))
            if node["device"] != "cpu":
                made.orig_device = node["device"]  # megatron.core's mark: restore_tensor_device moves it
            return made
        if kind is dict or kind is OrderedDict:
            return kind((k, walk(v)) for k, v in node.items())
        if kind is list or kind is tuple:
            return kind(walk(v) for v in node)
        return node

    if plain["kind"] == "basic":
        basic = BasicTensorAwareStateDict({})  # its constructor asserts CUDA tensors: load() moves them there
        basic.state_dict = walk(plain["state"])
        return basic
    mcore = importlib.import_module(_MCORE).MCoreTensorAwareStateDict  # and ShardedTensor's module
    return mcore(common=walk(plain["common"]), sharded_state_dict=walk(plain["sharded"]))
