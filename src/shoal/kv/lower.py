"""The tiers below the DRAM pool, holding the same block files: the host's local disk and the
shared tier (a parallel file system or an object store).

Both are thin layers over :mod:`shoal.tiers`: :class:`LocalBlocks` over a private
:class:`~shoal.tiers.local.PosixTier` (rename + fsync, 0700/0600, ``O_NOFOLLOW``, owner checked)
with its capacity counted in the host index, :class:`SharedBlocks` over
:class:`~shoal.tiers.shared.FsspecTier` (one completed upload per block on an object store). A
block lives at ``<digest[:2]>/<digest>`` on both. Reads verify header and payload
(:mod:`shoal.kv.blockfile`) before they report a hit.

Failpoints: ``kv.local.read`` and ``kv.shared.read`` (before a block is read: ``delay:<s>`` makes
the tier slow), ``kv.shared.write`` (before a block is uploaded).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Collection, Mapping
from contextlib import suppress
from typing import Any, Protocol

from shoal import failpoints
from shoal.errors import FormatError, InsufficientMemory, MissingFile, ShoalError, TierError
from shoal.kv._index import BlockIndex
from shoal.kv._owners import temp_name, temp_owner
from shoal.kv.blockfile import HEADER_SIZE, check_block, decode_block, decode_block_verified, parse_header
from shoal.kv.pool import (
    BufferSizeError,
    is_digest_name,
    physical_bytes,
    read_block_file_into,
    scandir_or_empty,
)
from shoal.tiers.base import Tier
from shoal.tiers.files import fsync_dir, is_temp_name, open_private, write_all
from shoal.tiers.local import PosixTier
from shoal.tiers.shared import FsspecTier

log = logging.getLogger(__name__)

FP_LOCAL_READ = "kv.local.read"
FP_SHARED_READ = "kv.shared.read"
FP_SHARED_WRITE = "kv.shared.write"


def block_path(digest: str) -> str:
    """Where a block lives on a lower tier, relative to its root."""
    return f"{digest[:2]}/{digest}"


class LowerTier(Protocol):
    """What the store asks of a tier below DRAM."""

    name: str

    def write(self, digest: str, header: bytes, payload: memoryview, since: int | None = None) -> bool:
        """Store one block (in place when it returns: renamed into place on the local tier, which
        is a cache and does not fsync; upload complete on the shared tier). ``since``: the
        removal sequence read before the bytes were (shoal.kv._index; None: now); False if a
        remove of the block came after it, and the copy was discarded."""
        ...

    def read_into(self, digest: str, out: memoryview) -> str | None:
        """Fill ``out`` with the verified payload and return the BLAKE3 (hex) it was verified
        against; None if absent; raise for corrupt or wrong size."""
        ...

    def exists(self, digest: str) -> bool: ...

    def block_size(self, digest: str) -> int | None:
        """Payload bytes of the tier's copy (from the file size), or None if absent."""
        ...

    def delete(self, digest: str) -> bool:
        """Remove the block; whether it was there."""
        ...

    def where(self, digest: str) -> str: ...


class _BlocksOnTier:
    """What both lower tiers answer the same way from their :class:`~shoal.tiers.base.Tier`."""

    tier: Tier

    def exists(self, digest: str) -> bool:
        return self.tier.exists(block_path(digest))

    def block_size(self, digest: str) -> int | None:
        """Payload bytes of the tier's copy (from the file size), or None if absent."""
        try:
            return max(0, self.tier.info(block_path(digest)).size - HEADER_SIZE)
        except MissingFile:
            return None

    def delete(self, digest: str) -> bool:
        """Remove the block; whether it was there."""
        there = self.exists(digest)
        self.tier.delete(block_path(digest))
        return there


class _CacheDisk(PosixTier):
    """The local KV tier's directory: private and checked like any host tier, but a cache, so its
    writes are not fsync'd. A block that a power failure loses or tears fails its BLAKE3 check on
    the next read and is dropped (a miss, never wrong bytes); a killed process loses nothing (the
    page cache holds its writes). The write-back then costs a write and a rename per block, not
    two fsyncs as well (2.1 ms of 2.9 ms per 64 KiB block on this project's test machine)."""

    durable = False


class LocalBlocks(_BlocksOnTier):
    """Block files on the host's local disk, counted against ``capacity`` in the host index.

    When a write needs room, least-recently-used unpinned blocks are deleted (after being copied
    to ``spill``, the shared tier, when there is one). Writes are not fsync'd (:class:`_CacheDisk`).
    """

    name = "local"
    tier: PosixTier

    def __init__(self, root: str, capacity: int | None, index: BlockIndex | None = None) -> None:
        self.tier = _CacheDisk(root)
        self.capacity = capacity
        self.index = index
        self.spill: LowerTier | None = None

    def where(self, digest: str) -> str:
        return f"{self.tier.root}/{block_path(digest)}"

    def write(self, digest: str, header: bytes, payload: memoryview, since: int | None = None) -> bool:
        """Count the block, write a temporary file of this process, then rename it into place
        inside an index transaction that checks no remove came after ``since``."""
        assert self.index is not None
        since = self.index.seq() if since is None else since
        phys = physical_bytes(payload.nbytes)
        try:
            outcome, victims = self.index.local_reserve(digest, phys, self.capacity)
        except OverflowError as e:
            raise InsufficientMemory(
                f"local KV tier {self.tier.root} needs {phys} bytes for block {digest} and cannot free "
                f"{e.args[0]} bytes more (every block is pinned); raise KVConfig.local_bytes or unpin"
            ) from e
        for victim, _ in victims:
            self._spill(victim)
            self.tier.delete(block_path(victim))
        if outcome == "present":
            return True
        final = os.path.join(self.tier.root, block_path(digest))
        directory = os.path.dirname(final)
        tmp = os.path.join(directory, temp_name(digest, self.index.me))
        try:
            self.tier.ensure_dir(digest[:2])
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, [header, payload])
                if self.tier.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            committed = self.index.local_commit(digest, since, lambda: os.rename(tmp, final))
        except BaseException as e:
            with suppress(OSError):
                os.unlink(tmp)
            self.index.local_forget([digest], owner=self.index.me)
            if isinstance(e, OSError) and not isinstance(e, ShoalError):
                raise TierError(f"could not write block {digest} to the local KV tier {final}: {e}") from e
            raise
        if not committed:
            with suppress(OSError):
                os.unlink(tmp)
            self.index.local_forget([digest], owner=self.index.me)
            return False
        if self.tier.durable:
            fsync_dir(directory)
        return True

    def _spill(self, digest: str) -> None:
        if self.spill is None:
            return
        since = self.index.seq() if self.index is not None else 0  # before the bytes are read
        try:
            raw = self.tier.read(block_path(digest))
            payload = decode_block(raw, digest, self.where(digest))
            self.spill.write(digest, raw[:HEADER_SIZE], payload, since)
        except (ShoalError, OSError) as e:
            log.warning("local KV tier: block %s dropped without a copy on the shared tier: %s", digest, e)

    def read_into(self, digest: str, out: memoryview) -> str | None:
        failpoints.hit(FP_LOCAL_READ, rank=failpoints.process_rank())
        path = os.path.join(self.tier.root, block_path(digest))
        return read_block_file_into(path, digest, out, "on the local tier")

    def delete(self, digest: str) -> bool:
        there = super().delete(digest)
        if self.index is not None:
            self.index.local_forget([digest])
        return there

    def unlink(self, digest: str) -> bool:
        """Delete the block's file only (the caller fixes the count in its own transaction)."""
        there = self.exists(digest)
        self.tier.delete(block_path(digest))
        return there

    def listing(self, counted: Collection[str]) -> dict[str, tuple[int, float]]:
        """Every whole block file, ``digest -> (physical bytes, mtime)``: the headers of files the
        index does not count (``counted``) are read and checked; torn, foreign and misplaced files
        are deleted, and so are the temporary files of dead writers."""
        out: dict[str, tuple[int, float]] = {}
        root = self.tier.root
        for top in scandir_or_empty(root):
            if not top.is_dir(follow_symlinks=False) or len(top.name) != 2:
                continue
            for entry in scandir_or_empty(top.path):
                self._list_one(top.name, entry, counted, out)
        return out

    def _list_one(
        self, top: str, entry: os.DirEntry[str], counted: Collection[str], out: dict[str, tuple[int, float]]
    ) -> None:
        path = entry.path
        if is_temp_name(entry.name):
            who = temp_owner(entry.name)
            if self.index is None or who is None or not self.index.owner.alive(who[1]):
                with suppress(OSError):
                    os.unlink(path)
            return
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or not is_digest_name(entry.name) or entry.name[:2] != top:
                raise FormatError(f"{path} is not a block file")
            if entry.name not in counted:
                with open(path, "rb", opener=lambda p, f: open_private(p, f)) as f:
                    header = parse_header(f.read(HEADER_SIZE), path)
                check_block(header, entry.name, st.st_size, path)
            out[entry.name] = (physical_bytes(st.st_size - HEADER_SIZE), st.st_mtime)
        except (ShoalError, OSError) as e:
            log.warning("local KV tier: deleting %s (%s)", path, e)
            with suppress(OSError):
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    os.unlink(path)


class SharedBlocks(_BlocksOnTier):
    """Block files on the shared tier (any fsspec URL), read whole and verified."""

    name = "shared"

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.tier = FsspecTier.from_url(url, storage_options)
        self.index: BlockIndex | None = None
        """The host's index: told of every block written and deleted here (``shared_lookup="host"``)."""

    def where(self, digest: str) -> str:
        return f"{self.tier.url}/{block_path(digest)}"

    def write(self, digest: str, header: bytes, payload: memoryview, since: int | None = None) -> bool:
        """Upload the block; then, if a remove of it came after ``since`` (the upload cannot be
        ordered against it: an object store has no rename), delete the upload again."""
        failpoints.hit(FP_SHARED_WRITE, rank=failpoints.process_rank())
        if self.index is not None and since is None:
            since = self.index.seq()
        self.tier.write(block_path(digest), [header, payload])
        if self.index is not None and since is not None and not self.index.shared_note(digest, since):
            self.index.shared_forget(digest)
            self.tier.delete(block_path(digest))
            return False
        return True

    def delete(self, digest: str) -> bool:
        if self.index is not None:
            self.index.shared_forget(digest)  # first: the host never answers for a block being deleted
        return super().delete(digest)

    def known(self, digest: str) -> bool:
        """Whether this host's stores wrote the block here (and did not delete it): no round trip."""
        return self.index is not None and self.index.shared_has(digest)

    def fetch(self, digest: str) -> memoryview | None:
        """The verified payload, or None if absent; raises for a corrupt block or a failing tier."""
        found = self.fetch_verified(digest)
        return None if found is None else found[0]

    def fetch_verified(self, digest: str) -> tuple[memoryview, str] | None:
        """:meth:`fetch`, with the BLAKE3 (hex) the payload was verified against."""
        failpoints.hit(FP_SHARED_READ, rank=failpoints.process_rank())
        try:
            raw = self.tier.read(block_path(digest))
        except MissingFile:
            return None
        return decode_block_verified(raw, digest, self.where(digest))

    def read_into(self, digest: str, out: memoryview) -> str | None:
        found = self.fetch_verified(digest)
        if found is None:
            return None
        payload, checked = found
        if payload.nbytes != out.nbytes:
            raise BufferSizeError(
                f"block {digest} on the shared tier is {payload.nbytes} bytes, the buffer is {out.nbytes}",
                payload.nbytes,
            )
        out[:] = payload
        return checked


def tier_error(tier: str, digest: str, err: BaseException) -> ShoalError:
    """A failing tier's exception as the shoal error a result carries."""
    if isinstance(err, ShoalError):
        return err
    return TierError(f"{tier} KV tier failed for block {digest}: {type(err).__name__}: {err}")
