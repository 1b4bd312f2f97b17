"""A third-party tier written from scratch against shoal's public interface: bytes in a dict.

It is the test suite's proof that a new tier is one module (this one), one registry line
(``register_tier("memory", MemoryTier)`` in ``test_third_party.py``) and one conformance
subclass (``TestMemoryTier`` there). It is also a slab store, with slabs in ``bytearray`` s,
so the slab tests of the conformance suite run on a store that has no files at all.
"""

from __future__ import annotations

import time
import weakref

from shoal.errors import InvalidName, MissingFile, OwnershipError, TierError
from shoal.format.names import check_identifier, check_relpath
from shoal.tiers import FileInfo, Tier, TierCapabilities
from shoal.tiers.base import Data, iter_byte_views


def _check_prefix(prefix: str) -> str:
    if prefix:
        check_relpath(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class MemorySlab:
    """One slab of a :class:`MemoryTier`: a ``bytearray`` the store keeps after ``close``."""

    def __init__(self, store: MemoryTier, name: str, data: bytearray) -> None:
        self._store = store
        self._name = name
        self._data: bytearray | None = data

    @property
    def capacity(self) -> int:
        return 0 if self._data is None else len(self._data)

    @property
    def buffer(self) -> memoryview:
        if self._data is None:
            raise ValueError(f"memory slab {self._name!r} is closed")
        return memoryview(self._data)

    def ensure(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"slab size must be >= 0, got {nbytes}")
        if self._data is None:
            raise ValueError(f"memory slab {self._name!r} is closed")
        if nbytes <= len(self._data):
            return
        grown = bytearray(nbytes)  # a new buffer: earlier views keep the old one alive
        grown[: len(self._data)] = self._data
        if self._store.slabs.get(self._name) is self._data:
            self._store.slabs[self._name] = grown
        self._data = grown

    def close(self) -> None:
        self._data = None


class MemoryTier(Tier):
    """A host-local, volatile tier at ``memory://<name>``; every instance starts empty."""

    kind = "memory"
    capabilities = TierCapabilities(persistent=False, host_local=True, atomic_rename=False)

    def __init__(self, url: str) -> None:
        if not url.startswith("memory://") or not url[len("memory://") :]:
            raise InvalidName(f"a memory tier URL looks like 'memory://<name>', got {url!r}")
        self._url = url
        self.files: dict[str, tuple[bytes, float]] = {}
        """Path -> (content, mtime): the backing storage, for the conformance suite's ground truth."""
        self.slabs: dict[str, bytearray] = {}
        self._open: weakref.WeakSet[MemorySlab] = weakref.WeakSet()

    @property
    def url(self) -> str:
        return self._url

    def _get(self, path: str) -> bytes:
        check_relpath(path)
        try:
            return self.files[path][0]
        except KeyError:
            raise MissingFile(f"no file {path!r} in memory tier {self._url}") from None

    def write(self, path: str, data: Data) -> int:
        check_relpath(path)
        content = b"".join(bytes(view) for view in iter_byte_views(data))  # all or nothing
        self.files[path] = (content, time.time())
        return len(content)

    def read(self, path: str) -> bytes:
        return self._get(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"a tier range needs offset >= 0 and length >= 0, got {offset}, {length}")
        content = self._get(path)
        if offset + length > len(content):
            raise TierError(
                f"short read of {path!r} in memory tier {self._url}: {length} bytes at offset {offset} "
                f"asked for, the file has {len(content)}"
            )
        return content[offset : offset + length]

    def exists(self, path: str) -> bool:
        check_relpath(path)
        return path in self.files

    def info(self, path: str) -> FileInfo:
        content = self._get(path)
        return FileInfo(path, len(content), self.files[path][1])

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix)
        return sorted(p for p in self.files if p.startswith(prefix))

    def delete(self, path: str) -> None:
        check_relpath(path)
        self.files.pop(path, None)

    # -- the slab capability (shoal.tiers.SlabStore) ----------------------------------------

    def open_slab(self, name: str, nbytes: int, *, exclusive: bool = False) -> MemorySlab:
        check_identifier(name, "slab name")
        if exclusive and name in self.slabs:
            raise OwnershipError(f"slab {name!r} already exists in memory tier {self._url}")
        data = self.slabs.setdefault(name, bytearray())
        slab = MemorySlab(self, name, data)
        slab.ensure(nbytes)
        self._open.add(slab)
        return slab

    def read_slab_into(self, name: str, offset: int, out: memoryview) -> None:
        check_identifier(name, "slab name")
        if offset < 0:
            raise ValueError(f"a slab offset must be >= 0, got {offset}")
        view = memoryview(out).cast("B")
        data = self.slabs.get(name)
        if data is None or offset + view.nbytes > len(data):
            raise MissingFile(
                f"slab {name!r} in memory tier {self._url} does not hold bytes "
                f"{offset}..{offset + view.nbytes}"
            )
        view[:] = data[offset : offset + view.nbytes]

    def list_slabs(self) -> dict[str, int]:
        return {name: len(self.slabs[name]) for name in sorted(self.slabs)}

    def delete_slab(self, name: str) -> None:
        check_identifier(name, "slab name")
        self.slabs.pop(name, None)

    def close(self) -> None:
        for slab in list(self._open):
            slab.close()
