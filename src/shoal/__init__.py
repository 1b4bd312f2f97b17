"""shoal: fast and safe checkpointing for distributed PyTorch.

Training stalls only for a memory copy into pre-faulted DRAM; a background
pipeline deduplicates by BLAKE3 chunk digests, drains to shared storage and
reports each durability boundary as it is reached::

    import shoal
    ckpt = shoal.Checkpointer(shoal.Config(shared="/lustre/run", job="run-42"))
    handle = ckpt.save(100, {"model": model.state_dict()})   # returns at B1
    handle.wait(shoal.Boundary.RESTARTABLE)
    ckpt.load({"model": model.state_dict()})                  # newest committed step
"""

from __future__ import annotations

__version__ = "0.1.0"

from shoal import dcp
from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.engine.handle import SaveHandle
from shoal.errors import (
    BoundaryTimeout,
    CheckpointExists,
    CheckpointFailed,
    CheckpointNotFound,
    ChecksumMismatch,
    ConfigError,
    FormatError,
    InsufficientMemory,
    InvalidName,
    MissingFile,
    ShoalError,
    TierError,
    UnsupportedFormat,
)

__all__ = [
    "Boundary",
    "BoundaryTimeout",
    "CheckpointExists",
    "CheckpointFailed",
    "CheckpointNotFound",
    "Checkpointer",
    "ChecksumMismatch",
    "Config",
    "ConfigError",
    "FormatError",
    "InsufficientMemory",
    "InvalidName",
    "MissingFile",
    "SaveHandle",
    "ShoalError",
    "TierError",
    "UnsupportedFormat",
    "__version__",
    "dcp",
]
