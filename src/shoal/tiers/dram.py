"""The ``dram`` tier: host memory through a tmpfs directory (normally under ``/dev/shm``).

Files behave exactly like the ``local`` tier (temporary sibling + rename), without
fsync: tmpfs does not survive a reboot, so there is nothing to make durable. The
tier also hands out *slabs* (:meth:`DramTier.open_slab`): one shared-memory file per
staging slot, ``<root>/slabs/<name>.slab``, reserved with ``posix_fallocate``,
mapped once and pre-faulted so that staging a checkpoint copies into resident pages
instead of taking a page fault per 4 KiB. Slabs are not checkpoint files: they are
never listed, and tier paths under ``slabs/`` are refused. The tier is the built-in
:class:`~shoal.tiers.slabs.SlabStore` (and :class:`Slab` a :class:`~shoal.tiers.slabs.SlabLike`).

Running out of ``/dev/shm`` is reported as :class:`shoal.errors.InsufficientMemory`
with the bytes needed and free, before anything is mapped: a write into a mapping
of a full tmpfs would kill the process with ``SIGBUS`` instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import weakref

import numpy as np

from shoal.errors import InsufficientMemory, InvalidName, MissingFile, OwnershipError, ShoalError
from shoal.format.names import check_identifier
from shoal.tiers.base import TierCapabilities
from shoal.tiers.files import check_private, ensure_private_dirs, open_private
from shoal.tiers.local import PosixTier, map_private_readonly

log = logging.getLogger(__name__)

SLABS_DIR = "slabs"
PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if os.uname().sysname == "Linux" else None)
_GIB = float(1 << 30)


def _round_up(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def prefault(mm: mmap.mmap, start: int, stop: int) -> None:
    """Make pages ``[start, stop)`` of ``mm`` resident and writable, keeping their content.

    Uses ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+); otherwise writes each page's
    first byte back to itself, which takes the same write faults.
    """
    if stop <= start:
        return
    if _MADV_POPULATE_WRITE is not None:
        try:
            mm.madvise(_MADV_POPULATE_WRITE, start, stop - start)
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
    pages = np.frombuffer(mm, dtype=np.uint8)[start:stop:PAGE]
    try:
        pages[:] = pages.copy()
    finally:
        del pages


class Slab:
    """One pre-faulted shared-memory file mapped into this process; what the stager copies into.

    ``capacity`` is the mapped size in bytes (``nbytes`` rounded up to a page).
    ``buffer`` is a writable view of the whole mapping. Not thread-safe: one stager slot
    owns a slab.
    """

    def __init__(self, tier: DramTier, name: str, path: str, *, exclusive: bool = False) -> None:
        self.tier = tier
        self.name = name
        self.path = path
        self.capacity = 0
        self._mmap: mmap.mmap | None = None
        self._create_exclusive = exclusive
        """Create the file with ``O_EXCL`` on the first mapping (a slab of this process's own)."""

    @property
    def buffer(self) -> memoryview:
        """A writable byte view of the whole slab (``capacity`` bytes)."""
        if self._mmap is None:
            raise ValueError(f"slab {self.path} is closed")
        return memoryview(self._mmap)

    def ensure(self, nbytes: int) -> None:
        """Grow the slab to at least ``nbytes``, keeping its content; no-op if already that big.

        Views from earlier ``buffer`` calls stay valid but keep the old, smaller mapping
        alive; take a fresh ``buffer`` after growing. Raises
        :class:`~shoal.errors.InsufficientMemory` (and leaves the slab as it was) when the
        file system cannot hold the new size.
        """
        if nbytes < 0:
            raise ValueError(f"slab size must be >= 0, got {nbytes}")
        if self._mmap is not None and nbytes <= self.capacity:
            return
        with self.tier.translating("map slab", f"{SLABS_DIR}/{self.name}.slab"):
            new, capacity = self._map(_round_up(max(nbytes, self.capacity)))
        self._drop_mapping()
        self._mmap = new
        self.capacity = capacity

    def _map(self, capacity: int) -> tuple[mmap.mmap, int]:
        """Reserve the file up to ``capacity`` (or its current size if larger), map and pre-fault it."""
        flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if self._create_exclusive else 0)
        try:
            fd = open_private(self.path, flags)
        except FileExistsError:
            st = os.lstat(self.path)
            check_private(self.path, st, directory=False)
            raise OwnershipError(
                f"slab {self.path} already exists (owner uid {st.st_uid}, {st.st_size} bytes); a new "
                f"slab is always created afresh, never written through a file that was there before"
            ) from None
        self._create_exclusive = False
        try:
            size = os.fstat(fd).st_size
            capacity = max(capacity, size)
            if capacity > size:
                self._reserve(fd, size, capacity)
            try:
                new = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                try:
                    prefault(new, 0, capacity)
                except BaseException:
                    new.close()
                    raise
            except BaseException:
                os.ftruncate(fd, size)  # give the reserved memory back
                raise
        finally:
            os.close(fd)
        return new, capacity

    def _reserve(self, fd: int, size: int, capacity: int) -> None:
        """Allocate the file's blocks up to ``capacity``; on failure truncate back to ``size``."""
        st = os.fstat(fd)
        allocated = st.st_blocks * 512
        needed = capacity - allocated
        vfs = os.statvfs(self.tier.root)
        free = vfs.f_bavail * vfs.f_frsize
        if needed > free:
            raise self.tier.no_space(f"slab {self.name!r}", needed, free)
        try:
            os.posix_fallocate(fd, size, capacity - size)
        except OSError as e:
            os.ftruncate(fd, size)
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                free = os.statvfs(self.tier.root).f_bavail * vfs.f_frsize
                raise self.tier.no_space(f"slab {self.name!r}", needed, free) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._zero_fill(fd, size, capacity)

    def _zero_fill(self, fd: int, size: int, capacity: int) -> None:
        """Reserve by writing zeros (file systems without fallocate): ENOSPC here, not SIGBUS later."""
        block = bytes(min(capacity - size, 64 << 20))
        try:
            offset = size
            while offset < capacity:
                offset += os.pwrite(fd, memoryview(block)[: capacity - offset], offset)
        except OSError as e:
            os.ftruncate(fd, size)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self.tier.no_space(f"slab {self.name!r}", capacity - size, 0) from e
            raise

    def _drop_mapping(self) -> None:
        if self._mmap is None:
            return
        # with views still out there, close() raises; the mapping then goes away with the last of them
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None

    def close(self) -> None:
        """Unmap the slab (the file stays for the next ``open_slab``). Idempotent."""
        self._drop_mapping()
        self.capacity = 0

    def __repr__(self) -> str:
        return f"Slab({self.path!r}, capacity={self.capacity})"


class DramTier(PosixTier):
    """Host-memory tier: a :class:`PosixTier` on tmpfs without fsync, plus staging slabs."""

    kind = "dram"
    capabilities = TierCapabilities(persistent=False, host_local=True, atomic_rename=True, read_preference=0)
    durable = False

    def __init__(self, root: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None) -> None:
        super().__init__(root, base=base)
        self._slabs: weakref.WeakSet[Slab] = weakref.WeakSet()

    def _check_path(self, path: str) -> str:
        super()._check_path(path)
        if path == SLABS_DIR or path.startswith(SLABS_DIR + "/"):
            raise InvalidName(
                f"tier path {path!r} is under {SLABS_DIR}/, which the dram tier keeps for slabs"
            )
        return path

    def _listed(self, rel: str) -> bool:
        return rel != SLABS_DIR

    def _classify_error(self, action: str, path: str, err: BaseException) -> ShoalError | None:
        """A full tmpfs: :class:`~shoal.errors.InsufficientMemory` (with the bytes free), not TierError."""
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
            vfs = os.statvfs(self.root) if os.path.isdir(self.root) else None
            free = vfs.f_bavail * vfs.f_frsize if vfs else 0
            return self.no_space(f"{action} of {path!r}", None, free)
        return None

    def no_space(self, what: str, needed: int | None, free: int) -> InsufficientMemory:
        """The error for running out of tmpfs space while doing ``what``."""
        need = f"needs {needed} bytes ({needed / _GIB:.2f} GiB)" if needed is not None else "ran out of space"
        return InsufficientMemory(
            f"DRAM tier {self.root} {need} for {what} but only {free} bytes ({free / _GIB:.2f} GiB) are "
            f"free on its file system (normally /dev/shm); free space there (old slabs: `shoal gc --staged` "
            f"lists what crashed processes left; other jobs), "
            f"enlarge it (docker --shm-size, a bigger memory-backed emptyDir), or lower Config.dram_slots"
        )

    def slab_path(self, name: str) -> str:
        """Where the slab ``name`` lives: ``<root>/slabs/<name>.slab``."""
        return os.path.join(self.root, SLABS_DIR, check_identifier(name, "slab name") + ".slab")

    def open_slab(self, name: str, nbytes: int, *, exclusive: bool = False) -> Slab:
        """Map slab ``name`` with at least ``nbytes``.

        An existing slab file of this user is reused and kept, unless ``exclusive``: then the
        file must not exist yet (:class:`~shoal.errors.OwnershipError` if it does), so that a
        file prepared by someone else is never written through. Raises
        :class:`~shoal.errors.InsufficientMemory` if the file system cannot hold it; nothing
        new is left behind then.
        """
        path = self.slab_path(name)
        with self.translating("create slab in", SLABS_DIR):
            ensure_private_dirs(self.base, os.path.dirname(path), durable=False)
        existed = os.path.lexists(path)
        slab = Slab(self, name, path, exclusive=exclusive)
        try:
            slab.ensure(nbytes)
        except BaseException:
            if not existed:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        self._slabs.add(slab)
        log.debug("slab %s mapped: %d bytes", path, slab.capacity)
        return slab

    def map_slab(self, name: str) -> memoryview:
        """A read-only view of all of slab ``name``, without a copy (:class:`~shoal.tiers.slabs.MappedSlabs`).

        This process's own mapping when it has the slab open (mapped once, pre-faulted: the
        stager's); else a new read-only mapping of the file with its pages populated at once (one
        call, not a fault per page). The mapping lives as long as the view and its slices.
        :class:`~shoal.errors.MissingFile` if there is no such slab.
        """
        check_identifier(name, "slab name")
        for slab in list(self._slabs):
            if slab.name == name and slab.capacity:
                return slab.buffer.toreadonly()
        with self.translating("map slab", name, missing=True):
            return map_private_readonly(self.slab_path(name))

    def read_slab_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from slab ``name`` at ``offset`` (what a restarted process reads back)."""
        path = self.slab_path(name)
        view = memoryview(out).cast("B")
        with self.translating("read slab", name, missing=True):
            fd = open_private(path, os.O_RDONLY)
            try:
                got = 0
                while got < view.nbytes:
                    n = os.preadv(fd, [view[got:]], offset + got)
                    if n <= 0:
                        raise MissingFile(
                            f"slab {path} ends before byte {offset + view.nbytes} (read {got} of "
                            f"{view.nbytes} bytes at offset {offset})"
                        )
                    got += n
            finally:
                os.close(fd)

    def list_slabs(self) -> dict[str, int]:
        """Every slab file under ``<root>/slabs/``, name -> its size in bytes, sorted by name.

        Only regular files named ``<identifier>.slab`` count; a symbolic link or any other
        entry is not a slab (and is never followed).
        """
        found: dict[str, int] = {}
        with self.translating("list slabs in", SLABS_DIR):
            try:
                entries = list(os.scandir(os.path.join(self.root, SLABS_DIR)))
            except (FileNotFoundError, NotADirectoryError):
                return found
            for entry in entries:
                name = entry.name[: -len(".slab")]
                if not entry.name.endswith(".slab") or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    check_identifier(name, "slab name")
                except InvalidName:
                    continue
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    found[name] = entry.stat(follow_symlinks=False).st_size
        return dict(sorted(found.items()))

    def delete_slab(self, name: str) -> None:
        """Remove the slab file ``name`` (mappings still open keep their memory until closed)."""
        with self.translating("delete slab", name), contextlib.suppress(FileNotFoundError):
            os.unlink(self.slab_path(name))

    def close(self) -> None:
        """Unmap every slab this tier opened (their files stay)."""
        for slab in list(self._slabs):
            slab.close()
