"""One error root for shoal; each leaf also subclasses the builtin it means.

Callers can catch ``shoal.ShoalError`` for anything shoal raises on purpose, or the
builtin (``ValueError``, ``FileNotFoundError``, ...) when they do not care that it
came from shoal. Every message says what was wrong and where.
"""

from __future__ import annotations


class ShoalError(Exception):
    """Root of every error shoal raises on purpose."""


class FormatError(ShoalError, ValueError):
    """A manifest, pack index or other shoal metadata file is malformed."""


class UnsupportedFormat(FormatError):
    """Metadata written by a newer, incompatible major format version."""


class InvalidName(ShoalError, ValueError):
    """An item key, path or identifier is unsafe or out of bounds (``..``, absolute, NUL)."""


class ChecksumMismatch(ShoalError, ValueError):
    """Bytes read back do not match their BLAKE3 digest. Never used, never silent."""


class CheckpointNotFound(ShoalError, FileNotFoundError):
    """The requested checkpoint (or any checkpoint) does not exist where it was looked for."""


class CheckpointExists(ShoalError, FileExistsError):
    """A checkpoint for this step already exists or is in flight."""


class MissingFile(ShoalError, FileNotFoundError):
    """A file a tier was asked for is not there (a pack, an index, a manifest)."""


class TierError(ShoalError, OSError):
    """A tier could not complete an operation; the message names the tier and the path."""


class InsufficientMemory(ShoalError, MemoryError):
    """The DRAM tier (``/dev/shm``) cannot hold the bytes a checkpoint needs."""


class CheckpointFailed(ShoalError, RuntimeError):
    """A checkpoint's background pipeline failed before reaching the boundary waited for."""


class BoundaryTimeout(ShoalError, TimeoutError):
    """``SaveHandle.wait`` ran out of time before the boundary was reached."""


class ConfigError(ShoalError, ValueError):
    """A ``shoal.Config`` value is invalid; the message names the field."""


__all__ = [
    "BoundaryTimeout",
    "CheckpointExists",
    "CheckpointFailed",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "ConfigError",
    "FormatError",
    "InsufficientMemory",
    "InvalidName",
    "MissingFile",
    "ShoalError",
    "TierError",
    "UnsupportedFormat",
]


class RestoreFailed(ShoalError, OSError):
    """A chunk of the checkpoint being loaded could not be read from any copy; names every place tried."""
