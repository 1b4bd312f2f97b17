"""shoal inside torchtitan: its ``CheckpointManager`` saving and loading through shoal.

For torchtitan's own trainer, build the ``Trainer`` after one call (in a launcher script run by
torchrun, instead of ``-m torchtitan.train``)::

    import shoal
    from shoal.integrations.torchtitan import use_shoal
    from torchtitan.train import Trainer, main

    use_shoal(shoal.Config(shared="/lustre/ckpt", job="llama3-8b"))
    main(Trainer)

A training loop of your own builds :class:`ShoalCheckpointManager` where it built
``CheckpointManager`` (the same arguments, plus ``shoal_config=``). What the ``[checkpoint]``
settings mean then:

- ``interval``, ``enable_first_step_checkpoint``, ``load_only``, ``exclude_from_loading``,
  ``last_save_model_only`` / ``export_dtype`` and ``initial_load_*``: as in torchtitan.
- ``async_mode="disabled"``: ``save`` returns at B1 (the state copied into the host's DRAM slab);
  the checkpoint goes on to B4 in the background (``wait_for=`` makes it block longer).
  ``"async"`` and ``"async_with_pinned_mem"``: ``dcp.async_save`` through
  :class:`shoal.dcp.StorageWriter`, staged in the calling thread (B1), its future done at B4;
  torchtitan waits for it before the next save, as it does for its own.
- ``keep_latest_k``: shoal's retention (``Config.keep_last``; 0 keeps all). 1 is allowed: shoal
  never deletes the checkpoint ``LATEST`` names before a newer one is committed.
- ``load_step`` (``load(step)``): that step, else (-1) the newest restorable checkpoint, which
  may be one that had reached only B1..B3 before a crash (shoal then commits it again).
- ``last_save_in_hf``: the final safetensors export is torchtitan's own writer, into ``folder``.

TorchFT (``ft_manager``) is refused with :class:`~shoal.errors.ConfigError`.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager

from shoal import dcp as shoal_dcp
from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.engine.handle import SaveHandle
from shoal.errors import CheckpointNotFound, ConfigError

__all__ = ["ShoalCheckpointManager", "use_shoal"]

log = logging.getLogger(__name__)

_STEP_ID = re.compile(r"step-(\d+)$")


def use_shoal(shoal_config: Config | None = None, *, wait_for: Boundary | None = None) -> None:
    """Make torchtitan's ``Trainer`` build a :class:`ShoalCheckpointManager` (call before it is built).

    Replaces the ``CheckpointManager`` that ``torchtitan.train`` builds its trainer's checkpointer
    with; ``shoal_config`` and ``wait_for`` are passed on (see the class). Calling it again replaces
    the settings.
    """

    def build(*args: Any, **kwargs: Any) -> ShoalCheckpointManager:
        return ShoalCheckpointManager(*args, shoal_config=shoal_config, wait_for=wait_for, **kwargs)

    import torchtitan.train  # the whole trainer: only for whoever uses it

    torchtitan.train.CheckpointManager = build


class ShoalCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with its DCP saves, loads and purges going through shoal.

    Takes ``CheckpointManager``'s arguments, and:

    - ``shoal_config``: where checkpoints go; by default ``shoal.Config(shared=<base_folder>/<folder>,
      job="torchtitan")`` with shoal's default DRAM and local roots. Its ``keep_last`` is replaced
      by ``keep_latest_k``.
    - ``wait_for``: with ``async_mode="disabled"``, each save also waits for this boundary
      (``None``: it returns at B1).

    Construction is collective (it builds a :class:`shoal.Checkpointer`) when checkpointing is
    enabled. :attr:`shoal` is that Checkpointer, :attr:`last_save` the handle of the newest save.
    ``close()`` (torchtitan's trainer calls it at the end) finishes in-flight checkpoints.

    Raises :class:`~shoal.errors.ConfigError` for TorchFT or a negative ``keep_latest_k``; a load
    raises shoal's errors (:class:`~shoal.errors.CheckpointNotFound` for a ``load_step`` that is
    not restorable, :class:`~shoal.errors.StateMismatch`, ...).
    """

    def __init__(
        self,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        checkpoint_config: Any,
        sd_adapter: Any,
        base_folder: str = "",
        ft_manager: Any = None,
        *,
        shoal_config: Config | None = None,
        wait_for: Boundary | None = None,
    ) -> None:
        if ft_manager is not None and ft_manager.enabled:
            raise ConfigError("shoal.integrations.torchtitan: TorchFT (ft_manager) is not supported")
        keep = checkpoint_config.keep_latest_k
        if not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"checkpoint.keep_latest_k must be an int >= 0, got {keep!r}")
        self.shoal: Checkpointer | None = None
        """The Checkpointer every save and load goes through (None while checkpointing is off)."""
        self.last_save: SaveHandle | None = None
        """The handle of the newest checkpoint this manager saved through shoal."""
        self.wait_for = wait_for
        # torchtitan's own purge thread and its k >= 2 rule stay off: shoal's retention does the purge
        super().__init__(
            dataloader,
            model_parts,
            optimizers,
            lr_schedulers,
            states,
            replace(checkpoint_config, keep_latest_k=0),
            sd_adapter,
            base_folder=base_folder,
            ft_manager=ft_manager,
        )
        self.keep_latest_k = keep
        if not self.enable:
            return
        if checkpoint_config.async_mode.lower() == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # shoal stages into its own DRAM slab in the caller: no pinned copy, no staging process
            self.async_mode = AsyncMode.ASYNC
            self.enable_staging = False
        config = shoal_config or Config(shared=self.folder, job="torchtitan")
        self.shoal = Checkpointer(replace(config, keep_last=keep or None))

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        """Save ``state_dict`` as the step ``checkpoint_id`` names, through shoal (see the class)."""
        if self.shoal is None or to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = _step_of(checkpoint_id)
        if async_mode == AsyncMode.DISABLED:
            self.last_save = self.shoal.save(step, state_dict)
            if self.wait_for is not None:
                self.last_save.wait(self.wait_for)
            return None
        writer = shoal_dcp.StorageWriter(self.shoal, step)
        future = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        self.last_save = writer.handle
        return future

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        """Load checkpoint ``step`` (-1: the newest restorable) into the states; False if there is none.

        Step 0 (a seed checkpoint: asked for, or the only one committed) loads the model only, as
        torchtitan does. A checkpoint restored that had not been committed is saved again to reach
        B4 (not with ``load_only``). With no checkpoint at all, torchtitan's ``initial_load_path`` /
        ``initial_load_in_hf`` are honoured. Collective, like torchtitan's own load.
        """
        if self.shoal is None:
            return bool(super().load(step))
        wanted: int | None = None if step == -1 else step
        if wanted is None and self.shoal.latest() == 0:
            wanted = 0  # only the seed checkpoint is committed
        states = self._states_to_load(model_only=wanted == 0)
        try:
            loaded = self.shoal.load(states, step=wanted, heal=not self.load_only)
        except CheckpointNotFound:
            if wanted is not None:
                raise
            return self._initial_load()
        if MODEL in self.states:  # the model's entries are flattened into the states: set them
            self.states[MODEL].load_state_dict(states)
        log.info("torchtitan: resumed from step %d through shoal", loaded)
        return True

    def _initial_load(self) -> bool:
        """torchtitan's first load of a run with no checkpoint: ``initial_load_path`` or HF weights."""
        path = self.initial_load_path
        if path is None and self.initial_load_in_hf and self.sd_adapter is not None:
            path = self.sd_adapter.hf_assets_path
        if path is None:
            return False
        if not os.path.isdir(path):
            raise ConfigError(
                f"checkpoint.initial_load_path (or model.hf_assets_path) {path!r} is no directory"
            )
        states = self._states_to_load(model_only=self.initial_load_model_only)
        self.dcp_load(states, path, self.initial_load_in_hf, self.initial_load_in_hf_quantized)
        return True

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: shoal's retention keeps ``keep_latest_k`` (after each commit, in the background)."""

    def close(self) -> None:
        """torchtitan's close, then the Checkpointer's: in-flight checkpoints are finished first."""
        super().close()
        ckpt, self.shoal = getattr(self, "shoal", None), None
        if ckpt is not None:
            ckpt.close()


def _step_of(checkpoint_id: str) -> int:
    found = _STEP_ID.search(os.fspath(checkpoint_id))
    if found is None:
        raise ConfigError(f"torchtitan checkpoint id {checkpoint_id!r} names no step (step-<n>)")
    return int(found.group(1))
