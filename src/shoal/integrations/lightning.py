"""shoal inside PyTorch Lightning 2.6: strategies for DDP and ModelParallel (FSDP2, TP), a CheckpointIO.

Lightning's DDP saves on global rank 0 only, its ModelParallel strategy with DCP's default writer;
with these, every rank saves through one :class:`shoal.Checkpointer` (``save`` returns at B1)::

    strategy = ShoalDDPStrategy(shoal.Config(shared="/lustre/ckpt", job="run1"))
    trainer = L.Trainer(strategy=strategy, callbacks=[ModelCheckpoint(save_last=True, ...)])
    trainer.fit(model, ckpt_path="last")

At the file Lightning names, global rank 0 writes a JSON **pointer**: the shoal step (the
checkpoint's ``global_step``), the job's shared URL, and the checkpoint without the tensors of
``state_dict`` and ``optimizer_states`` (which shoal holds) as exact JSON (:mod:`shoal.format.tree`;
other tensors as raw bytes). A value only pickle could save is an :class:`~shoal.errors.UnsupportedValue`
naming its place: convert it in ``on_save_checkpoint``, back in ``on_load_checkpoint``.
``ModelCheckpoint``'s listing, top-k and ``"last"`` work on these files. A pointer is written when
the save returns, at B1 (at ``wait_for`` if set): it means *staged*. Loading restores its step from
the nearest surviving copy or, if none survives, the newest restorable older step (the step holds
its own JSON), with a warning. Saves at one ``global_step`` (``epoch=..-step=N.ckpt``,
``last.ckpt``) share a shoal step, removed once no pointer (in its directory, or written by this
process) names it. shoal's ``keep_last`` is off.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy
from torch.distributed.checkpoint import state_dict as dcp_sd

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.errors import CheckpointExists, CheckpointNotFound, ConfigError
from shoal.format import tree
from shoal.tiers.files import AtomicRenameCommit

__all__ = ["ShoalCheckpointIO", "ShoalDDPStrategy", "ShoalModelParallelStrategy"]

log = logging.getLogger(__name__)
FORMAT = "shoal-lightning/2"
_MAGIC = b'{"format": "shoal-lightning/'
_BULK = ("state_dict", "optimizer_states")  # tensors under these go to shoal, the rest into JSON
_SKELETON = "lightning"


class ShoalCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` on shoal, one process: ``Trainer(plugins=[ShoalCheckpointIO(config)])``.

    ``save_checkpoint`` saves the tensors as shoal step ``checkpoint["global_step"]`` (returning at
    B1, or once ``wait_for`` is reached) and writes the pointer at ``path``; ``load_checkpoint``
    restores it (a ``.ckpt`` that is no pointer is loaded by Lightning's own ``TorchCheckpointIO``);
    ``remove_checkpoint`` deletes the pointer and the step once nothing names it. Tensors come
    back on the CPU. The :class:`ShoalDDPStrategy` and :class:`ShoalModelParallelStrategy` drive
    one on every rank. ``teardown`` (the end of ``fit``) waits for in-flight checkpoints.

    Raises: :class:`~shoal.errors.CheckpointExists` when the step was committed by an earlier run
    (resumed from an older checkpoint than the newest: use a new ``Config.job``);
    :class:`~shoal.errors.ConfigError` for a pointer of another job.
    """

    def __init__(self, config: Config, *, wait_for: Boundary | None = None) -> None:
        if not isinstance(config, Config):
            raise ConfigError(f"ShoalCheckpointIO needs a shoal.Config, got {type(config).__name__}")
        self.config = replace(config, keep_last=None)
        self.wait_for = wait_for
        self.broadcast: Callable[[Any], Any] = lambda obj: obj
        self.is_writer = True  # global rank 0: reads and writes the pointers
        self._ckpt: Checkpointer | None = None
        self._steps: dict[int, set[tree.Path]] = {}  # steps this Checkpointer saved or loaded: their tensors
        self._pointers: dict[str, int] = {}  # pointers written by this process, anywhere

    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`shoal.Checkpointer` (made on first use: collective, after the process group)."""
        self._ckpt = self._ckpt or Checkpointer(self.config)
        return self._ckpt

    def connect(self, broadcast: Callable[[Any], Any], is_writer: bool) -> None:
        """For a strategy, on every rank: ``broadcast`` from global rank 0, the only ``is_writer`` (of
        the pointers); makes the Checkpointer now (collective)."""
        self.broadcast, self.is_writer = broadcast, is_writer
        self._ckpt = self.checkpointer  # made now, on every rank alike

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise ConfigError("ShoalCheckpointIO.save_checkpoint: storage_options are not supported")
        step, path = checkpoint.get("global_step"), _norm(path)
        if not isinstance(step, int):
            raise ConfigError(f"Lightning checkpoint for {path} has no int global_step: {step!r}")
        stored, skeleton = tree.encode(
            checkpoint, where="Lightning checkpoint", inline=lambda p: not p or p[0] not in _BULK
        )
        bulk = set(tree.paths(stored))
        if step not in self._steps:
            state = {**stored, _SKELETON: json.dumps(skeleton, allow_nan=False)}
            try:
                handle = self.checkpointer.save(step, state)
            except CheckpointExists as e:
                raise CheckpointExists(
                    f"{e} (Lightning's global_step {step}: an earlier run of job {self.config.job!r} "
                    "went past the checkpoint resumed from; resume from the newest or use a new job)"
                ) from e
            if handle.skipped:
                log.warning("step %d skipped (every DRAM slot in flight): no pointer at %s", step, path)
                return
            if self.wait_for is not None:
                handle.wait(self.wait_for)
            self._steps[step] = bulk
        elif not bulk <= self._steps[step]:
            raise ConfigError(f"{path}: step {step} was saved without {sorted(bulk - self._steps[step])}")
        orphans: list[int] = []
        if self.is_writer:
            before = (_read(path, self.config) or {}).get("step")
            doc = {"format": FORMAT, "step": step, "shared": self.config.shared_url(), "checkpoint": skeleton}
            _write(path, json.dumps(doc, allow_nan=False).encode())
            self._pointers[path] = step
            if before is not None and before != step and not self._named(before, path):
                orphans.append(before)
        self._remove(orphans)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        live: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The checkpoint the pointer at ``path`` names (collective). ``live``: targets to load into
        in place ({"state_dict": ..., "optimizer_states": [...]}, DTensors for resharding)."""
        doc = self.broadcast(_read(str(path)) if self.is_writer else None)
        if doc is None:
            return TorchCheckpointIO().load_checkpoint(path, map_location, weights_only=weights_only)
        if doc["shared"] != self.config.shared_url():
            raise ConfigError(f"{path} names shoal job {doc['shared']}, not {self.config.shared_url()}")
        into = tree.encode(live or {}, where="Lightning live state")[0]  # stored-shaped, as targets wants
        step = doc["step"]
        try:
            return self._load(doc["checkpoint"], step, into)
        except CheckpointNotFound as e:
            probe = {_SKELETON: ""}
            older = self.checkpointer.load(probe, heal=False)
            if older > step:
                raise
            log.warning(
                "%s: step %d is not restorable (%s); loading %d, the newest that is", path, step, e, older
            )
            return self._load(json.loads(probe[_SKELETON]), older, into)

    def _load(self, skeleton: Any, step: int, live: dict[str, Any]) -> dict[str, Any]:
        stored = tree.targets(skeleton, live)
        self.checkpointer.load({**stored, _SKELETON: ""}, step=step)  # every item: healed if uncommitted
        self._steps[step] = set(tree.paths(stored))
        return cast(dict[str, Any], tree.decode(skeleton, stored))

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the file at ``path``, and its shoal step once no pointer names it (every rank)."""
        path, orphans = _norm(path), []
        if self.is_writer:
            step = (_read(path, self.config) or {}).get("step")
            fs = get_filesystem(path)
            if isinstance(fs, LocalFileSystem):
                if os.path.lexists(path):  # a link too (save_last="link"), dangling or not
                    os.remove(path)
            elif fs.exists(path):
                fs.rm(path)
            self._pointers.pop(path, None)
            if step is not None and not self._named(step, path):
                orphans.append(step)
        self._remove(orphans)

    def _named(self, step: int, but: str) -> bool:
        """Whether a pointer other than ``but``, in its directory or written here, names ``step``."""
        fs = get_filesystem(but)
        parent = os.path.dirname(but)
        listed = fs.ls(parent, detail=False) if fs.exists(parent) else []
        paths = {_norm(p) for p in listed} | set(self._pointers)
        paths.discard(but)
        return any(
            (_read(p, self.config) or {}).get("step") == step for p in paths if os.path.basename(p)[:1] != "."
        )

    def _remove(self, orphans: list[int]) -> None:
        for step in self.broadcast(orphans):
            self.checkpointer.remove(step)
            self._steps.pop(step, None)

    def teardown(self) -> None:
        """Finish in-flight checkpoints and removals, then close the Checkpointer (every rank)."""
        if self._ckpt is not None:
            self._ckpt.wait(self.config.close_timeout)
            self._ckpt.close()
            self._ckpt, self._steps = None, {}


def _norm(path: Any) -> str:
    """``path`` as a string, absolute if it is local (so that two spellings of one file compare equal)."""
    path = str(path)
    return os.path.abspath(path) if isinstance(get_filesystem(path), LocalFileSystem) else path


def _read(path: str, config: Config | None = None) -> dict[str, Any] | None:
    """The pointer at ``path``; None for a file that is no pointer (a Lightning ``.ckpt``). With
    ``config``: None too for no file, or a pointer of another job (for a directory's scan)."""
    try:
        with get_filesystem(path).open(path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                return None
            doc: dict[str, Any] = json.loads(_MAGIC + f.read())
    except OSError:
        if config is None:
            raise
        return None
    if doc.get("format") != FORMAT:
        raise ConfigError(f"{path}: pointer format {doc.get('format')!r}; this shoal reads {FORMAT}")
    return doc if config is None or doc["shared"] == config.shared_url() else None


def _write(path: str, data: bytes) -> None:
    """Write the pointer whole or not at all (local: fsync'd, renamed into place)."""
    fs = get_filesystem(path)
    if isinstance(fs, LocalFileSystem):
        AtomicRenameCommit().write(os.path.abspath(path), data)
    else:
        fs.pipe_file(path, data)  # an object store's put is atomic


class _OnEveryRank(ParallelStrategy):
    """What both strategies change: checkpoints saved, loaded and removed through shoal on every rank."""

    shoal_io: ShoalCheckpointIO

    def setup_environment(self) -> None:
        super().setup_environment()
        self.shoal_io.connect(self.broadcast, self.is_global_zero)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.shoal_io.save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.shoal_io.load_checkpoint(checkpoint_path, weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.shoal_io.remove_checkpoint(filepath)

    def teardown(self) -> None:
        self.shoal_io.teardown()
        super().teardown()


class ShoalDDPStrategy(_OnEveryRank, DDPStrategy):
    """Lightning's ``DDPStrategy``, saving, loading and removing checkpoints through shoal on every rank.

    ``ShoalDDPStrategy(shoal.Config(...), wait_for=None, **ddp_kwargs)``; see :class:`ShoalCheckpointIO`.
    ``save_checkpoint`` and ``remove_checkpoint`` are collectives (as ``ModelCheckpoint`` calls them).
    """

    def __init__(self, config: Config, *, wait_for: Boundary | None = None, **kwargs: Any) -> None:
        self.shoal_io = ShoalCheckpointIO(config, wait_for=wait_for)
        super().__init__(checkpoint_io=self.shoal_io, **kwargs)


class ShoalModelParallelStrategy(_OnEveryRank, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallel) on shoal.

    Every rank saves its shards (DTensors) as one shoal step and loads into the live sharded model
    and optimizers (resharded if the layout changed), then Lightning restores the rest.
    ``save_distributed_checkpoint=False`` (everything gathered on rank 0) is refused: ConfigError.
    """

    def __init__(self, config: Config, *, wait_for: Boundary | None = None, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ConfigError("ShoalModelParallelStrategy saves shards: save_distributed_checkpoint=True")
        super().__init__(**kwargs)
        self.shoal_io = ShoalCheckpointIO(config, wait_for=wait_for)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        model, offload = self.model, dcp_sd.StateDictOptions(cpu_offload=True)  # as for a save
        optimizers = [dcp_sd.get_optimizer_state_dict(model, o, options=offload) for o in self.optimizers]
        state = dcp_sd.get_model_state_dict(model, options=offload)
        live = {"state_dict": state, "optimizer_states": optimizers}
        checkpoint = self.shoal_io.load_checkpoint(checkpoint_path, live=live)
        strict = dcp_sd.StateDictOptions(strict=self.lightning_module.strict_loading)
        dcp_sd.set_model_state_dict(model, checkpoint.pop("state_dict"), options=strict)
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", []), strict=False):
            dcp_sd.set_optimizer_state_dict(model, optimizer, state, options=strict)
        return checkpoint
