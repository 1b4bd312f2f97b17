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


class UnknownConfigField(ConfigError, TypeError):
    """A ``shoal.Config`` keyword that is no field of it (a misspelling); names the closest field.

    Also a ``TypeError``, what Python raises for an unexpected keyword argument.
    """


class OwnershipError(ShoalError, PermissionError):
    """A host-tier path, lock or file is not this process's to use.

    Raised for a path owned by another user, writable by others, or a symlink where
    shoal expects its own file or directory (the message names path, owner and mode),
    and for a lock another live process holds (the message names the holder's pid).
    """


class WriterFenced(ShoalError, RuntimeError):
    """Another writer took over this job on shared storage; this one may no longer commit.

    Two processes committing into one shared job (a job name used twice) are never
    interleaved: the newest writer holds the job's ``WRITER`` record, and every commit,
    ``LATEST`` move and retention pass of an older one fails with this error.
    """


class UnsupportedValue(ShoalError, TypeError):
    """A value in the state cannot be saved (it cannot be serialised); the message names its key."""


class StateMismatch(ShoalError, ValueError):
    """A stored item does not fit its target at load: another dtype or shape (names key, stored, target)."""


class CollectiveMismatch(ShoalError, RuntimeError):
    """A collective call (``save``, ``load``) that not every rank made, or not alike; names the ranks."""


class StateError(ShoalError, RuntimeError):
    """An operation that the object's state does not allow (a save after ``close()``)."""


__all__ = [
    "BoundaryTimeout",
    "CheckpointExists",
    "CheckpointFailed",
    "CheckpointNotFound",
    "CollectiveMismatch",
    "ChecksumMismatch",
    "ConfigError",
    "FormatError",
    "InsufficientMemory",
    "InvalidName",
    "MissingFile",
    "OwnershipError",
    "RestoreFailed",
    "ShoalError",
    "StateError",
    "StateMismatch",
    "TierError",
    "UnknownConfigField",
    "UnsupportedFormat",
    "UnsupportedValue",
    "WriterFenced",
]


class RestoreFailed(ShoalError, OSError):
    """A chunk of the checkpoint being loaded could not be read from any copy; names every place tried."""
