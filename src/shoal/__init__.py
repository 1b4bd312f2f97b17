"""shoal: fast and safe checkpointing for distributed PyTorch.

Training stalls only for a memory copy into pre-faulted DRAM; a background
pipeline deduplicates by BLAKE3 chunk digests, drains to shared storage and
reports each durability boundary as it is reached::

    import shoal
    ckpt = shoal.Checkpointer(shoal.Config(shared="/lustre/run", job="run-42"))
    handle = ckpt.save(100, {"model": model.state_dict()})   # returns at B1
    handle.wait(shoal.Boundary.RESTARTABLE)
    step = ckpt.load({"model": model.state_dict()})           # newest restorable checkpoint

``load`` with no step loads the newest *restorable* checkpoint, which may be newer than the one
``LATEST`` names: one that reached B2 or B3 but was not committed, or one still whole in the job's
DRAM slabs. An uncommitted checkpoint it loads is healed (saved again, so that it reaches B4)
unless ``heal=False``; pass ``step=ckpt.latest()`` for the newest committed one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal._version import __version__
from shoal.boundary import Boundary
from shoal.config import Config
from shoal.engine.handle import SaveHandle
from shoal.errors import (
    BoundaryTimeout,
    CheckpointExists,
    CheckpointFailed,
    CheckpointNotFound,
    ChecksumMismatch,
    CollectiveMismatch,
    ConfigError,
    FormatError,
    InsufficientMemory,
    InvalidName,
    MissingFile,
    RestoreFailed,
    ShoalError,
    StateMismatch,
    TierError,
    UnknownConfigField,
    UnsupportedFormat,
    UnsupportedValue,
)

if TYPE_CHECKING:
    from shoal import dcp
    from shoal.checkpointer import Checkpointer


def __getattr__(name: str) -> object:
    # Checkpointer and shoal.dcp import torch.distributed.checkpoint (seconds): load them on first use,
    # so that `shoal ls` and friends start fast.
    if name == "Checkpointer":
        from shoal.checkpointer import Checkpointer

        return Checkpointer
    if name == "dcp":
        import importlib

        return importlib.import_module("shoal.dcp")
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")


__all__ = [
    "Boundary",
    "BoundaryTimeout",
    "CheckpointExists",
    "CheckpointFailed",
    "CheckpointNotFound",
    "Checkpointer",
    "ChecksumMismatch",
    "CollectiveMismatch",
    "Config",
    "ConfigError",
    "FormatError",
    "InsufficientMemory",
    "InvalidName",
    "MissingFile",
    "RestoreFailed",
    "SaveHandle",
    "ShoalError",
    "StateMismatch",
    "TierError",
    "UnknownConfigField",
    "UnsupportedFormat",
    "UnsupportedValue",
    "__version__",
    "dcp",
]
