"""The ``local`` tier: a directory on node-local disk, written with rename + fsync.

Every write goes to a temporary sibling ``.<name>.tmp-<random>`` in the target's
directory, is fsync'd, renamed over the target with :func:`os.replace`, and the
directory is fsync'd (:class:`~shoal.tiers.files.AtomicRenameCommit`). Readers therefore see the old
file or the whole new one, and the new one survives a crash once ``write`` returns.
Temporary files are never listed, and names that look like them are refused.

Reads go straight into the caller's buffer (``os.preadv``); no tier method
concatenates the parts of a write.

Host tiers are private (docs/design.md section 11): every directory the tier creates is
0700 and every file 0600; a directory on the way from the tier's *trusted base* (the
configured root, e.g. ``/dev/shm/shoal-<uid>``) to the tier root that already exists
must be a real directory (not a symlink), owned by this user and writable by nobody
else, or it is refused with :class:`~shoal.errors.OwnershipError` naming its path,
owner and mode. Files are opened with ``O_NOFOLLOW`` and read only when this user owns
them, so a symlink or a file planted by someone else is never followed or read. Those checks,
the temporary names and the fsyncs are the helpers of :mod:`shoal.tiers.files`.
"""

from __future__ import annotations

import builtins
import functools
import mmap
import os
import stat
from contextlib import AbstractContextManager, suppress

from shoal.errors import InvalidName, MissingFile, ShoalError, TierError
from shoal.format.names import check_relpath
from shoal.tiers.base import Data, FileInfo, Tier, TierCapabilities, translate_errors
from shoal.tiers.files import (
    MAX_IO,
    AtomicRenameCommit,
    check_prefix,
    check_private,
    check_tier_path,
    ensure_private_dirs,
    is_temp_name,
    open_private,
    remove_empty_dirs_below,
)

MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Populate a read-only mapping's page tables at once (Linux): one call instead of a fault per page."""


def map_private_readonly(target: str) -> memoryview:
    """All of the private file ``target`` (owner and mode checked, no link followed) mapped
    read-only, its pages populated at once; the mapping lives as long as the view and its slices."""
    fd = open_private(target, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return memoryview(b"")
        return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | MAP_POPULATE, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


class PosixTier(Tier):
    """A tier rooted at a local directory; see the module docstring for the commit protocol.

    The root is created on the first write, not by the constructor, so opening a tier
    to read never creates directories. ``root`` may be a path or a ``file://`` URL.
    ``base`` is the trusted base of the private checks (module docstring): the configured
    root the tier lies under (``<base>/<job>/<host>/...``); it defaults to ``root`` itself.
    """

    kind = "local"
    capabilities = TierCapabilities(persistent=True, host_local=True, atomic_rename=True, read_preference=1)
    durable = True
    """Whether writes fsync (file and directory); subclasses for volatile tiers turn it off."""

    def __init__(self, root: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None) -> None:
        root = os.fspath(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        if not root or "\x00" in root:
            raise InvalidName(f"{self.kind} tier root {root!r} is empty or contains a NUL character")
        self._root = os.path.abspath(root)
        self._base = self._root if base is None else os.path.abspath(os.fspath(base))
        if self._root != self._base and not self._root.startswith(self._base.rstrip("/") + "/"):
            raise InvalidName(f"{self.kind} tier root {self._root} is not below its base {self._base}")
        self._commit = AtomicRenameCommit(durable=self.durable, private_base=self._base)

    @property
    def url(self) -> str:
        return self._root

    @property
    def root(self) -> str:
        """The absolute directory this tier is rooted at."""
        return self._root

    @property
    def base(self) -> str:
        """The trusted base: from here down to :attr:`root`, every directory must be private."""
        return self._base

    def ensure_root(self) -> None:
        """Create the root (0700 levels from :attr:`base`), or check an existing one is private.

        Raises :class:`~shoal.errors.OwnershipError` naming the offending directory.
        """
        with self.translating("create", "."):
            ensure_private_dirs(self._base, self._root, durable=self.durable)

    def ensure_dir(self, rel: str) -> str:
        """Create the private directory ``rel`` below the root; return its absolute path."""
        target = os.path.join(self._root, check_relpath(rel))
        with self.translating("create", rel):
            ensure_private_dirs(self._base, target, durable=self.durable)
        return target

    # -- paths and errors -------------------------------------------------------------------

    def _check_path(self, path: str) -> str:
        """Validate ``path``; subclasses refuse reserved areas. Returns ``path``."""
        return check_tier_path(path)

    def _abs(self, path: str) -> str:
        return os.path.join(self._root, self._check_path(path))

    def _where(self, path: str) -> str:
        return f"{path!r} in {self.kind} tier {self._root}"

    def _classify_error(self, action: str, path: str, err: BaseException) -> ShoalError | None:
        """A subclass's own error for ``err`` (raised doing ``action`` on ``path``), before it
        becomes a :class:`TierError`; None here."""
        return None

    def translating(self, action: str, path: str, *, missing: bool = False) -> AbstractContextManager[None]:
        """Where this tier's ``OSError`` s become shoal's: :func:`~shoal.tiers.base.translate_errors`
        for ``action`` on ``path`` (:class:`TierError`, or :class:`MissingFile` when ``missing``)."""
        classify = functools.partial(self._classify_error, action, path)
        return translate_errors(action, self._where(path), missing=missing, classify=classify)

    # -- the Tier interface -----------------------------------------------------------------

    def write(self, path: str, data: Data) -> int:
        """Atomically write ``data`` to ``path`` (rename + fsync, see :class:`AtomicRenameCommit`)."""
        target = self._abs(path)
        with self.translating("write", path):
            return self._commit.write(target, data)

    def read(self, path: str) -> bytes:
        target = self._abs(path)
        with self.translating("read", path, missing=True):
            fd = open_private(target, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                return self._pread(fd, path, 0, size, exact=False)
            finally:
                os.close(fd)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        _check_range(offset, length)
        target = self._abs(path)
        with self.translating("read", path, missing=True):
            fd = open_private(target, os.O_RDONLY)
            try:
                return self._pread(fd, path, offset, length, exact=True)
            finally:
                os.close(fd)

    def _pread(self, fd: int, path: str, offset: int, length: int, *, exact: bool) -> bytes:
        """Read ``length`` bytes at ``offset``; fewer only at end of file and only if not ``exact``."""
        parts = []
        got = 0
        while got < length:
            part = os.pread(fd, min(length - got, MAX_IO), offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        if exact and got < length:
            raise self._short(path, offset, length, got)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _short(self, path: str, offset: int, length: int, got: int) -> TierError:
        return TierError(
            f"short read of {self._where(path)}: asked for {length} bytes at offset {offset}, "
            f"the file holds only {got} of them"
        )

    def read_range_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``offset`` with ``os.preadv`` straight into the caller's buffer."""
        view = writable_byte_view(out)
        _check_range(offset, view.nbytes)
        target = self._abs(path)
        with self.translating("read", path, missing=True):
            fd = open_private(target, os.O_RDONLY)
            try:
                got = 0
                while got < view.nbytes:
                    n = os.preadv(fd, [view[got : got + MAX_IO]], offset + got)
                    if n <= 0:
                        raise self._short(path, offset, view.nbytes, got)
                    got += n
            finally:
                os.close(fd)

    def map_file(self, path: str) -> memoryview:
        """A read-only view of all of file ``path`` without a copy (:class:`~shoal.tiers.slabs.MappedFiles`),
        its pages populated at once; the mapping lives as long as the view and its slices. The
        tier's files are private to this user and replaced by rename, never truncated in place."""
        target = self._abs(path)
        with self.translating("map", path, missing=True):
            return map_private_readonly(target)

    def exists(self, path: str) -> bool:
        try:
            st = os.lstat(self._abs(path))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def info(self, path: str) -> FileInfo:
        target = self._abs(path)
        with self.translating("stat", path, missing=True):
            st = os.lstat(target)
        if stat.S_ISLNK(st.st_mode):
            check_private(target, st, directory=False)
        if not stat.S_ISREG(st.st_mode):
            raise MissingFile(f"cannot stat {self._where(path)}: it is a directory, not a file")
        return FileInfo(path=path, size=st.st_size, mtime=st.st_mtime)

    def _walk(self, rel: str, found: list[str], sizes: dict[str, int] | None = None) -> None:
        """Append every listed file below directory ``rel`` (relative to the root) to ``found``
        (and, with ``sizes``, record its size there, from the same scan)."""
        directory = os.path.join(self._root, rel) if rel else self._root
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            child = f"{rel}/{entry.name}" if rel else entry.name
            if not self._listed(child):
                continue
            if entry.is_dir(follow_symlinks=False):
                self._walk(child, found, sizes)
            elif entry.is_file(follow_symlinks=False) and not is_temp_name(entry.name):
                found.append(child)
                if sizes is not None:
                    try:
                        sizes[child] = entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        found.pop()  # removed since the scan saw it

    def _listed(self, rel: str) -> bool:
        """Whether the entry ``rel`` (file or directory) belongs to the tier's listing."""
        return True

    def list(self, prefix: str = "") -> list[str]:
        """Every file whose relative path starts with ``prefix`` (pass ``"dir/"`` for a directory)."""
        return self._scan(prefix, None)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """:meth:`list` with each file's size, from the same directory scan."""
        sizes: dict[str, int] = {}
        return {p: sizes[p] for p in self._scan(prefix, sizes)}

    def _scan(self, prefix: str, sizes: dict[str, int] | None) -> builtins.list[str]:
        check_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        found: list[str] = []
        parts = base.split("/") if base else []
        if not all(self._listed("/".join(parts[: i + 1])) for i in range(len(parts))):
            return found
        with self.translating("list", prefix or "."):
            self._walk(base, found, sizes)
        return sorted(p for p in found if p.startswith(prefix))

    def delete(self, path: str) -> None:
        target = self._abs(path)
        with self.translating("delete", path), suppress(FileNotFoundError):
            os.unlink(target)

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove the empty directories at and below ``prefix`` (a relative directory path).

        Retention calls it after deleting a step's files. A directory that is not empty
        stays; symbolic links are never followed or removed.
        """
        with self.translating("remove empty directories under", prefix):
            remove_empty_dirs_below(self._abs(prefix.rstrip("/")))


def _check_range(offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise ValueError(
            f"a tier range needs offset >= 0 and length >= 0, got offset={offset} length={length}"
        )
    if offset + length > 2**63 - 1:
        raise TierError(
            f"a tier range ends past the largest file offset: offset {offset} + length {length}; the "
            "metadata that asked for it is corrupt"
        )


def writable_byte_view(out: memoryview) -> memoryview:
    """``out`` as a flat, writable, format-``B`` view; raise ``ValueError`` if it cannot be one."""
    view = out if isinstance(out, memoryview) else memoryview(out)
    if view.readonly:
        raise ValueError("read_range_into needs a writable buffer, got a read-only one")
    if not view.c_contiguous:
        raise ValueError("read_range_into needs a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
