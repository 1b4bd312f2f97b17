"""The host DRAM pool: one private tmpfs directory of block files plus the host-wide index.

Layout of ``dram_root`` (0700, checked private like every host tier)::

    blocks/<key digest>                    one block file each (shoal.kv.blockfile), 0600
    blocks/.<digest>.<owner>.tmp-<hex>     a put in progress (never served; swept once its owner is dead)
    owners/<owner>                         each live process's lock file (shoal.kv._owners)
    index.sqlite3                          the host index (shoal.kv._index), shared by the host's processes
    index.lock                             flock'd while a process opens (and maybe rebuilds) the index

A put reserves the block's physical bytes in the index first, writes the temporary file, then
renames it into place and marks the row ``READY`` in one index transaction (so a process killed
mid-put leaves only a temporary file, and a remove is ordered against the rename). A get does not
ask the index: it opens ``blocks/<digest>``, reads header and payload straight into the caller's
buffer with one ``preadv`` and verifies both before reporting a hit. Every process that opens the
pool serves what any other put: the files are the truth, the index the accounting. Bytes are
freed only after a file is unlinked, so the files on disk never hold more than the index counts,
and the index never counts more than ``dram_bytes``.

Opening a pool never trusts the index blindly. A missing, empty, garbage, damaged (``PRAGMA
quick_check``), half-built or inconsistent ``index.sqlite3`` is rebuilt; a directory, link or
foreign file in its place is a :class:`~shoal.errors.TierError` naming it. Then the rows are
reconciled with the files (rows without a file are forgotten, files without a row counted while
they fit and deleted otherwise, torn and foreign files deleted), the same for the local tier, and
the leftovers of dead processes are swept.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import sqlite3
import stat
from collections.abc import Callable, Collection, Sequence
from contextlib import suppress

from shoal import failpoints
from shoal.errors import FormatError, ShoalError, TierError
from shoal.kv._index import WRITING, BlockIndex
from shoal.kv._owners import OwnerLock, temp_name, temp_owner
from shoal.kv.blockfile import HEADER_SIZE, BlockHeader, check_block, parse_header, verify_payload
from shoal.tiers.files import (
    check_private,
    ensure_private_dirs,
    is_temp_name,
    open_private,
    open_private_stat,
)

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
INDEX_NAME = "index.sqlite3"
BLOCKS_DIR = "blocks"
FP_BEFORE_RENAME = "kv.pool.before_rename"
"""Failpoint: a pool block's temporary file is written, not yet renamed (``kill`` = killed mid-put)."""

LocalListing = Callable[[Collection[str]], dict[str, tuple[int, float]]]
"""The local tier's whole block files, ``digest -> (phys, mtime)``; the argument holds the
digests the index counts already (their headers need not be read again)."""


def physical_bytes(payload_bytes: int) -> int:
    """Bytes a block file of ``payload_bytes`` occupies on tmpfs: header + payload, page-rounded."""
    return -(-(HEADER_SIZE + payload_bytes) // PAGE) * PAGE


def is_digest_name(name: str) -> bool:
    return len(name) == 64 and all(ch in "0123456789abcdef" for ch in name)


class BufferSizeError(ShoalError, ValueError):
    """The caller's buffer is not the block's size (the store turns it into an error result)."""

    def __init__(self, message: str, block_bytes: int) -> None:
        super().__init__(message)
        self.block_bytes = block_bytes


def read_block_file_into(path: str, digest: str, out: memoryview, where: str) -> str | None:
    """Read the block file at ``path`` into ``out`` (one ``preadv``) and verify header and payload.

    Returns the payload's BLAKE3 (hex), which the bytes in ``out`` were verified to have; None if
    there is no such file. Raises :class:`BufferSizeError` for a buffer of the wrong size,
    and :class:`~shoal.errors.FormatError` / :class:`~shoal.errors.ChecksumMismatch` for a torn or
    corrupt file (``out`` then holds garbage). ``where`` names the tier in messages. The pool and
    the local tier both read their block files here.
    """
    try:
        fd, st = open_private_stat(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        size = st.st_size
        if size - HEADER_SIZE != out.nbytes:
            # Either the file is damaged (truncated, extended: its size disagrees with its own
            # header) or the caller's buffer is the wrong size for a whole block: tell them apart.
            header = parse_header(os.pread(fd, HEADER_SIZE, 0), path)
            check_block(header, digest, size, path)
            raise BufferSizeError(
                f"block {digest} {where} is {header.length} bytes, the buffer is "
                f"{out.nbytes} bytes; pass a buffer of the block's size",
                header.length,
            )
        head = bytearray(HEADER_SIZE)
        got = os.preadv(fd, [head, out], 0)
    finally:
        os.close(fd)
    header = parse_header(head, path)
    check_block(header, digest, got, path)
    verify_payload(header, out, path)
    return header.payload_digest


class DramPool:
    """The files of the host pool and its index (module docstring). Created by ``KVStore``."""

    def __init__(self, root: str, capacity: int, local: LocalListing | None = None) -> None:
        """Open (or create) the pool and its index; the caller then runs :meth:`reconcile`."""
        self.root = os.path.abspath(root)
        self.capacity = capacity
        self.blocks_dir = os.path.join(self.root, BLOCKS_DIR)
        with _as_tier_error(f"open the KV pool at {self.root}"):
            ensure_private_dirs(self.root, self.blocks_dir, durable=False)
        self.owner = OwnerLock(self.root)
        try:
            self.index = self._open_index()
        except BaseException:
            self.owner.close()
            raise
        self.local = local
        """The local tier's listing, for :meth:`reconcile` (the store sets it once the tier is wired)."""

    # -- opening, reconciling, sweeping -----------------------------------------------------

    def _open_index(self) -> BlockIndex:
        lock_path = os.path.join(self.root, "index.lock")
        with _as_tier_error(f"lock the KV pool index at {lock_path}"):
            fd = open_private(lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = os.path.join(self.root, INDEX_NAME)
            if os.path.lexists(path):
                _check_index_file(path)
                index = None
                try:
                    index = BlockIndex(path, self.capacity, self.blocks_dir, self.owner)
                    index.check()
                except sqlite3.DatabaseError as e:
                    if index is not None:
                        index.close()
                    log.warning(
                        "KV pool index %s cannot be trusted (%s); rebuilding it from the files", path, e
                    )
                    _remove_index(path)
                else:
                    return index
            else:
                _remove_index(path)  # a stale -wal/-shm of a deleted index must not be replayed
            index = BlockIndex(path, self.capacity, self.blocks_dir, self.owner)
            index.load([], [])  # whole (and empty); the reconcile that follows counts the files
            log.info("KV pool %s: index rebuilt", self.root)
            return index
        finally:
            os.close(fd)  # releases the flock

    def reconcile(self) -> None:
        """Make the index agree with the files of the pool and of the local tier (module docstring),
        then sweep what dead processes left. Done at every open; safe while other processes run."""
        index = self.index

        def listing() -> dict[str, tuple[int, int, float] | None]:
            rows = index.pool_rows()
            files: dict[str, tuple[int, int, float] | None] = {}
            for entry in scandir_or_empty(self.blocks_dir):
                if is_temp_name(entry.name):
                    continue  # the sweep's
                known = rows.get(entry.name)
                header = self._scan_one(entry, None if known is None else known[3])
                if header is not None:
                    files[entry.name] = (
                        header.length,
                        physical_bytes(header.length),
                        entry.stat(follow_symlinks=False).st_mtime,
                    )
                elif is_digest_name(entry.name):
                    files[entry.name] = None
            return files

        forgotten, counted, deleted = index.reconcile(listing, self.unlink)
        if forgotten or counted or deleted:
            log.warning(
                "KV pool %s: the index disagreed with the files: %d rows without a file forgotten, %d files "
                "the index did not count counted, %d deleted (no room)",
                self.root,
                forgotten,
                counted,
                deleted,
            )
        if self.local is not None:
            local = self.local
            forgot, added = index.local_reconcile(local)
            if forgot or added:
                log.warning(
                    "KV pool %s: the local tier's count disagreed with its files: %d rows forgotten, "
                    "%d files counted",
                    self.root,
                    forgot,
                    added,
                )
        self.sweep()

    def _scan_one(self, entry: os.DirEntry[str], size: int | None = None) -> BlockHeader | None:
        """The header of a whole block file, or None (and the file deleted) for anything else.

        ``size``: the payload size the index records for it; a file of that size is taken as
        whole without reading its header (a get verifies every byte before serving it anyway).
        """
        path = entry.path
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                log.warning("KV pool: %s is a directory, not a block file; left alone (remove it)", path)
                return None
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{path} is not a regular file")
            if not is_digest_name(entry.name):
                raise FormatError(f"{path} is not named by a key digest")
            if size is not None and st.st_size == HEADER_SIZE + size:
                return BlockHeader(entry.name, size, "")
            with open(path, "rb", opener=lambda p, f: open_private(p, f)) as f:
                header = parse_header(f.read(HEADER_SIZE), path)
            check_block(header, entry.name, st.st_size, path)
            return header
        except (FormatError, OSError) as e:
            log.warning("KV pool: deleting %s (%s)", path, e)
            with suppress(OSError):
                os.unlink(path)
            return None

    def sweep(self) -> None:
        """Clean up after dead processes: their leases, claims, half-written blocks, temporary
        files and lock files. A process is dead when nobody holds its lock (shoal.kv._owners)."""
        index = self.index
        owner = self.owner
        writing, _ = index.sweep_dead()
        whole, torn = [], []
        for digest in writing:
            try:
                st = os.lstat(self.path(digest))
                with open(self.path(digest), "rb", opener=lambda p, f: open_private(p, f)) as f:
                    check_block(parse_header(f.read(HEADER_SIZE), digest), digest, st.st_size, digest)
                whole.append(digest)  # renamed into place by a writer killed before its commit
            except (OSError, FormatError):
                with suppress(OSError):
                    os.unlink(self.path(digest))
                torn.append(digest)
        index.adopt(whole)
        # only rows still the dead writer's (another sweeper may have released one meanwhile, and
        # a live process reserved the digest again: its bytes must stay counted)
        index.release(torn, states=(WRITING,), owners={writing[d] for d in torn})
        for entry in scandir_or_empty(self.blocks_dir):
            if is_temp_name(entry.name):
                who = temp_owner(entry.name)
                if who is None or not owner.alive(who[1]):
                    with suppress(OSError):
                        os.unlink(entry.path)
        in_use = index.owners_in_use()
        for token in owner.listed():
            if token not in in_use:
                owner.reap(token)  # only if dead

    # -- files ------------------------------------------------------------------------------

    def path(self, digest: str) -> str:
        return os.path.join(self.blocks_dir, digest)

    def write_temp(self, digest: str, header: bytes, payload: memoryview) -> str:
        """Write one block to a temporary file of this process (only after its bytes were
        reserved); return its path, for :meth:`BlockIndex.commit` to rename into place."""
        tmp = os.path.join(self.blocks_dir, temp_name(digest, self.owner.token))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with _as_tier_error(f"write block {digest} to the KV pool {self.root}"):
            fd = os.open(tmp, flags, 0o600)
            try:
                try:
                    _writev_all(fd, [header, payload])
                finally:
                    os.close(fd)
                failpoints.hit(FP_BEFORE_RENAME, rank=failpoints.process_rank())
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp)
                raise
        return tmp

    def read_into(self, digest: str, out: memoryview) -> str | None:
        """Fill ``out`` with the block's verified payload and return its BLAKE3; None if the pool
        does not hold it.

        Raises as :func:`read_block_file_into`.
        """
        return read_block_file_into(self.path(digest), digest, out, "in the KV pool")

    def read_raw(self, digest: str) -> bytes:
        """The whole block file (for a write-back); FileNotFoundError if gone."""
        fd = open_private(self.path(digest), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def exists(self, digest: str) -> bool:
        """Whether the pool holds a block file for ``digest`` (a link there is not followed: no)."""
        try:
            return stat.S_ISREG(os.lstat(self.path(digest)).st_mode)
        except OSError:
            return False

    def block_size(self, digest: str) -> int | None:
        """The payload bytes of the pool's copy (from its file size), or None."""
        try:
            st = os.stat(self.path(digest), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return max(0, st.st_size - HEADER_SIZE) if stat.S_ISREG(st.st_mode) else None

    def unlink(self, digest: str) -> None:
        with suppress(FileNotFoundError):
            os.unlink(self.path(digest))

    def disk_bytes(self) -> int:
        """Physical bytes of every file in ``blocks/`` now (temporary files too): a test's ground truth."""
        total = 0
        for entry in scandir_or_empty(self.blocks_dir):
            with suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def close(self) -> None:
        self.index.close()
        self.owner.close()


def _check_index_file(path: str) -> None:
    """Refuse a directory, link or foreign file where the index belongs, with the way out."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "not a regular file"
        )
        raise TierError(
            f"the KV pool index {path} is {kind}, not the index file shoal writes; remove it "
            f"(rm -r {path}) and open the store again: the index is rebuilt from the block files"
        )
    check_private(path, st, directory=False)


def _writev_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def scandir_or_empty(directory: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(directory))
    except FileNotFoundError:
        return []


def _remove_index(path: str) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        with suppress(FileNotFoundError):
            os.unlink(path + suffix)


class _as_tier_error:  # noqa: N801 - used as a context manager, reads like one
    """Turn an ``OSError`` into a :class:`TierError` naming what was being done."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: object) -> None:
        if isinstance(err, OSError) and not isinstance(err, ShoalError):
            raise TierError(f"could not {self.what}: {err}") from err
