"""The host DRAM pool: one private tmpfs directory of block files plus the host-wide index.

Layout of ``dram_root`` (0700, checked private like every host tier)::

    blocks/<key digest>          one block file each (shoal.kv.blockfile), 0600
    blocks/.<digest>.tmp-<hex>   a put in progress (never served; swept once its writer is dead)
    index.sqlite3                the host index (shoal.kv._index), shared by the host's processes
    index.lock                   flock'd while a process opens (and maybe rebuilds) the index

A put reserves the block's physical bytes in the index first, writes the temporary file and
renames it (so a process killed mid-put leaves only a temporary file), then marks the row
``READY``. A get does not ask the index: it opens ``blocks/<digest>``, reads header and payload
straight into the caller's buffer with one ``preadv`` and verifies both before reporting a hit.
Every process that opens the pool serves what any other put: the files are the truth, the index
the accounting. Bytes are freed only after a file is unlinked, so the files on disk never hold
more than the index counts, and the index never counts more than ``dram_bytes``.

If ``index.sqlite3`` is missing or unreadable, :class:`DramPool` rebuilds it from a scan of
``blocks/`` (torn or foreign files are deleted) and of the local tier.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import suppress

from shoal import failpoints
from shoal.errors import FormatError, ShoalError, TierError
from shoal.kv._index import WRITING, BlockIndex
from shoal.kv.blockfile import HEADER_SIZE, BlockHeader, check_block, parse_header, verify_payload
from shoal.tiers.local import check_private, ensure_private_dirs, is_temp_name, open_private, temp_sibling

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
INDEX_NAME = "index.sqlite3"
BLOCKS_DIR = "blocks"
FP_BEFORE_RENAME = "kv.pool.before_rename"
"""Failpoint: a pool block's temporary file is written, not yet renamed (``kill`` = killed mid-put)."""

LocalScan = Callable[[], list[tuple[str, int, float]]]


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


def read_block_file_into(path: str, digest: str, out: memoryview, where: str) -> bool:
    """Read the block file at ``path`` into ``out`` (one ``preadv``) and verify header and payload.

    False if there is no such file. Raises :class:`BufferSizeError` for a buffer of the wrong size,
    and :class:`~shoal.errors.FormatError` / :class:`~shoal.errors.ChecksumMismatch` for a torn or
    corrupt file (``out`` then holds garbage). ``where`` names the tier in messages. The pool and
    the local tier both read their block files here.
    """
    try:
        fd = open_private(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        size = os.fstat(fd).st_size
        if size - HEADER_SIZE != out.nbytes:
            if size < HEADER_SIZE:
                raise FormatError(f"block file {path} is {size} bytes, shorter than its header")
            raise BufferSizeError(
                f"block {digest} {where} is {size - HEADER_SIZE} bytes, the buffer is "
                f"{out.nbytes} bytes; pass a buffer of the block's size",
                size - HEADER_SIZE,
            )
        head = bytearray(HEADER_SIZE)
        got = os.preadv(fd, [head, out], 0)
    finally:
        os.close(fd)
    header = parse_header(head, path)
    check_block(header, digest, got, path)
    verify_payload(header, out, path)
    return True


class DramPool:
    """The files of the host pool and its index (module docstring). Created by ``KVStore``."""

    def __init__(self, root: str, capacity: int, local_scan: LocalScan | None = None) -> None:
        self.root = os.path.abspath(root)
        self.capacity = capacity
        self.blocks_dir = os.path.join(self.root, BLOCKS_DIR)
        with _as_tier_error(f"open the KV pool at {self.root}"):
            ensure_private_dirs(self.root, self.blocks_dir, durable=False)
        self.index = self._open_index(local_scan)

    # -- opening, rebuilding, sweeping ------------------------------------------------------

    def _open_index(self, local_scan: LocalScan | None) -> BlockIndex:
        lock_path = os.path.join(self.root, "index.lock")
        with _as_tier_error(f"lock the KV pool index at {lock_path}"):
            fd = open_private(lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = os.path.join(self.root, INDEX_NAME)
            if os.path.lexists(path):
                check_private(path, os.lstat(path), directory=False)
                try:
                    index = BlockIndex(path, self.capacity, self.blocks_dir)
                except sqlite3.DatabaseError as e:
                    log.warning("KV pool index %s is unreadable (%s); rebuilding it from the tiers", path, e)
                    _remove_index(path)
                else:
                    self.sweep(index)
                    return index
            else:
                _remove_index(path)  # a stale -wal/-shm of a deleted index must not be replayed
            index = BlockIndex(path, self.capacity, self.blocks_dir)
            self.rebuild(index, local_scan)
            return index
        finally:
            os.close(fd)  # releases the flock

    def rebuild(self, index: BlockIndex, local_scan: LocalScan | None) -> None:
        """Fill ``index`` from the files: every whole pool block (LRU by mtime) and the local tier.

        Temporary files and torn or foreign files are deleted; if the blocks found hold more
        than the capacity, the oldest are deleted until they fit.
        """
        found: list[tuple[str, int, int, float]] = []
        for entry in _scandir(self.blocks_dir):
            header = self._scan_one(entry)
            if header is not None:
                found.append(
                    (entry.name, header.length, physical_bytes(header.length), entry.stat().st_mtime)
                )
        found.sort(key=lambda row: row[3], reverse=True)
        kept, used = [], 0
        for row in found:
            if used + row[2] <= self.capacity:
                kept.append(row)
                used += row[2]
            else:
                self.unlink(row[0])
        index.load(kept, local_scan() if local_scan is not None else [])
        log.info("KV pool %s: index rebuilt with %d blocks (%d bytes)", self.root, len(kept), used)

    def _scan_one(self, entry: os.DirEntry[str]) -> BlockHeader | None:
        """The header of a whole block file, or None (and the file deleted) for anything else."""
        path = entry.path
        try:
            if not entry.is_file(follow_symlinks=False):
                return None
            if not is_digest_name(entry.name):
                raise FormatError(f"{path} is not named by a key digest")
            with open(path, "rb", opener=lambda p, f: open_private(p, f)) as f:
                header = parse_header(f.read(HEADER_SIZE), path)
            check_block(header, entry.name, entry.stat(follow_symlinks=False).st_size, path)
            return header
        except (FormatError, OSError) as e:
            log.warning("KV pool: deleting %s (%s)", path, e)
            with suppress(OSError):
                os.unlink(path)
            return None

    def sweep(self, index: BlockIndex | None = None) -> None:
        """Clean up after dead processes: their leases, claims, half-written blocks, temporary files."""
        index = index or self.index
        writing, _ = index.sweep_dead()
        whole, torn = [], []
        for digest in writing:
            try:
                st = os.lstat(self.path(digest))
                with open(self.path(digest), "rb", opener=lambda p, f: open_private(p, f)) as f:
                    check_block(parse_header(f.read(HEADER_SIZE), digest), digest, st.st_size, digest)
                whole.append(digest)
            except (OSError, FormatError):
                with suppress(OSError):
                    os.unlink(self.path(digest))
                torn.append(digest)
        index.adopt(whole)
        # only rows still the dead writer's: another sweeper may have released one meanwhile, and
        # a live process reserved the digest again (its bytes must stay counted)
        index.release(torn, states=(WRITING,), owners={writing[d] for d in torn})
        # The listing first, then who is writing: a put reserves its row before it creates its
        # temporary file, so every temporary file listed whose writer still runs is in ``live``
        # (read the other way round, a put that reserved between the two lost its file mid-write).
        entries = _scandir(self.blocks_dir)
        live = index.writers_alive()
        for entry in entries:
            if is_temp_name(entry.name) and entry.name[1:65] not in live:
                with suppress(OSError):
                    os.unlink(entry.path)

    # -- files ------------------------------------------------------------------------------

    def path(self, digest: str) -> str:
        return os.path.join(self.blocks_dir, digest)

    def write_file(self, digest: str, header: bytes, payload: memoryview) -> None:
        """Write one block file: temporary name, then rename (only after its bytes were reserved)."""
        target = self.path(digest)
        tmp = temp_sibling(target)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with _as_tier_error(f"write block {digest} to the KV pool {self.root}"):
            fd = os.open(tmp, flags, 0o600)
            try:
                try:
                    _writev_all(fd, [header, payload])
                finally:
                    os.close(fd)
                failpoints.hit(FP_BEFORE_RENAME, rank=failpoints.process_rank())
                os.rename(tmp, target)
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp)
                raise

    def read_into(self, digest: str, out: memoryview) -> bool:
        """Fill ``out`` with the block's verified payload; False if the pool does not hold it.

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
        return os.path.isfile(self.path(digest))

    def block_size(self, digest: str) -> int | None:
        """The payload bytes of the pool's copy (from its file size), or None."""
        try:
            return max(0, os.stat(self.path(digest), follow_symlinks=False).st_size - HEADER_SIZE)
        except FileNotFoundError:
            return None

    def unlink(self, digest: str) -> None:
        with suppress(FileNotFoundError):
            os.unlink(self.path(digest))

    def disk_bytes(self) -> int:
        """Physical bytes of every file in ``blocks/`` now (temporary files too): a test's ground truth."""
        total = 0
        for entry in _scandir(self.blocks_dir):
            with suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def close(self) -> None:
        self.index.close()


def _writev_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _scandir(directory: str) -> list[os.DirEntry[str]]:
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
