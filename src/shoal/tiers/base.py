"""The narrow interface every tier implements.

A tier is a place bytes live: ``dram`` (host memory under ``/dev/shm``), ``local``
(node-local disk) or ``shared`` (a parallel file system or an object store through
fsspec). A tier instance is rooted at one directory or prefix, normally
``<root>/<job>`` (shared) or ``<root>/<job>/<host_id>`` (dram, local); every path
passed to it is relative to that root, POSIX-style, and checked by
:func:`shoal.format.names.check_relpath`.

Contract shared by every implementation (checked by
``shoal.testing.TierTests``):

* ``write`` is atomic and durable: a reader sees either the old file or the
  complete new one, never a prefix, and when ``write`` returns the bytes are
  fsync'd (POSIX, with the directory) or upload-complete (object stores) where the
  tier is persistent. ``write`` replaces an existing file.
* ``read``/``read_range`` return exactly the bytes asked for or raise: a missing
  file is :class:`shoal.errors.MissingFile`, a short range is
  :class:`shoal.errors.TierError`. Tiers never verify digests; callers do.
* ``delete`` of a missing file is not an error.
* ``list(prefix)`` returns every file below ``prefix`` (recursively), as relative
  paths, sorted; temporary files of writes in progress are never listed.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass

BytesLike = bytes | bytearray | memoryview
Data = BytesLike | Iterable[BytesLike]
"""What ``Tier.write`` accepts: one bytes-like object, or an iterable of them written back to back."""


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier can promise; callers branch on these flags, never on the class."""

    persistent: bool
    """Bytes survive a reboot of the host (false for ``dram``)."""
    host_local: bool
    """The tier belongs to one host (``dram``, ``local``) rather than the whole job."""
    atomic_rename: bool
    """Commits by write-to-temporary then rename (POSIX); false for single-PUT object stores."""


@dataclass(frozen=True)
class FileInfo:
    """Size and modification time of one file in a tier."""

    path: str
    size: int
    mtime: float


class Tier(abc.ABC):
    """Abstract tier. Implementations are small modules registered in ``shoal.tiers``."""

    kind: str = "abstract"
    capabilities: TierCapabilities

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the tier's root is, for messages (a path or ``s3://bucket/prefix``)."""

    @abc.abstractmethod
    def write(self, path: str, data: Data) -> int:
        """Atomically and durably write ``data`` to ``path``; return the bytes written."""

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """Return the whole file."""

    @abc.abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Return ``length`` bytes starting at ``offset``; raise if fewer are there."""

    def read_range_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` (a writable byte view) from ``offset``; raise if fewer bytes are there.

        Implementations override this to read straight into the caller's buffer
        (``os.preadv`` on POSIX) and skip a copy; the default reads then copies.
        """
        out[:] = self.read_range(path, offset, out.nbytes)

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` names a file in this tier."""

    @abc.abstractmethod
    def info(self, path: str) -> FileInfo:
        """Size and mtime of ``path``; :class:`shoal.errors.MissingFile` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every file below ``prefix`` (``""`` for the whole tier), relative, sorted."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove ``path``; a missing file is not an error."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (open mappings, connections). Idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
