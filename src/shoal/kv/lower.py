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
from collections.abc import Mapping
from contextlib import suppress
from typing import Any, Protocol

from shoal import failpoints
from shoal.errors import FormatError, InsufficientMemory, MissingFile, ShoalError, TierError
from shoal.kv._index import BlockIndex
from shoal.kv.blockfile import HEADER_SIZE, check_block, decode_block, parse_header
from shoal.kv.pool import BufferSizeError, is_digest_name, physical_bytes, read_block_file_into
from shoal.tiers.base import Tier
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

    def write(self, digest: str, header: bytes, payload: memoryview) -> None:
        """Store one block durably (fsync'd / upload complete when it returns)."""
        ...

    def read_into(self, digest: str, out: memoryview) -> bool:
        """Fill ``out`` with the verified payload; False if absent; raise for corrupt or wrong size."""
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


class LocalBlocks(_BlocksOnTier):
    """Block files on the host's local disk, counted against ``capacity`` in the host index.

    When a write needs room, least-recently-used unpinned blocks are deleted (after being copied
    to ``spill``, the shared tier, when there is one).
    """

    name = "local"
    tier: PosixTier

    def __init__(self, root: str, capacity: int | None, index: BlockIndex | None = None) -> None:
        self.tier = PosixTier(root)
        self.capacity = capacity
        self.index = index
        self.spill: LowerTier | None = None

    def where(self, digest: str) -> str:
        return f"{self.tier.root}/{block_path(digest)}"

    def write(self, digest: str, header: bytes, payload: memoryview) -> None:
        assert self.index is not None
        phys = physical_bytes(payload.nbytes)
        try:
            counted, victims = self.index.local_reserve(digest, phys, self.capacity)
        except OverflowError as e:
            raise InsufficientMemory(
                f"local KV tier {self.tier.root} needs {phys} bytes for block {digest} and cannot free "
                f"{e.args[0]} bytes more (every block is pinned); raise KVConfig.local_bytes or unpin"
            ) from e
        for victim, _ in victims:
            self._spill(victim)
            self.tier.delete(block_path(victim))
        if not counted and self.tier.exists(block_path(digest)):
            return
        try:
            self.tier.write(block_path(digest), [header, payload])
        except BaseException:
            self.index.local_forget([digest])
            raise

    def _spill(self, digest: str) -> None:
        if self.spill is None:
            return
        try:
            raw = self.tier.read(block_path(digest))
            payload = decode_block(raw, digest, self.where(digest))
            self.spill.write(digest, raw[:HEADER_SIZE], payload)
        except (ShoalError, OSError) as e:
            log.warning("local KV tier: block %s dropped without a copy on the shared tier: %s", digest, e)

    def read_into(self, digest: str, out: memoryview) -> bool:
        failpoints.hit(FP_LOCAL_READ, rank=failpoints.process_rank())
        path = os.path.join(self.tier.root, block_path(digest))
        return read_block_file_into(path, digest, out, "on the local tier")

    def delete(self, digest: str) -> bool:
        there = super().delete(digest)
        if self.index is not None:
            self.index.local_forget([digest])
        return there

    def scan(self) -> list[tuple[str, int, float]]:
        """Every whole block file: ``(digest, physical bytes, mtime)`` (torn or foreign files deleted)."""
        out: list[tuple[str, int, float]] = []
        try:
            listing = self.tier.list_sizes()
        except ShoalError as e:
            log.warning("local KV tier %s could not be listed: %s", self.tier.root, e)
            return out
        for rel, size in listing.items():
            digest = rel.rsplit("/", 1)[-1]
            try:
                if rel != block_path(digest) or not is_digest_name(digest):
                    raise FormatError(f"{rel} is not a block file name")
                header = parse_header(self.tier.read_range(rel, 0, HEADER_SIZE), self.where(digest))
                check_block(header, digest, size, self.where(digest))
                out.append((digest, physical_bytes(header.length), self.tier.info(rel).mtime))
            except (ShoalError, OSError) as e:
                log.warning("local KV tier: deleting %s (%s)", rel, e)
                with suppress(ShoalError):
                    self.tier.delete(rel)
        return out


class SharedBlocks(_BlocksOnTier):
    """Block files on the shared tier (any fsspec URL), read whole and verified."""

    name = "shared"

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.tier = FsspecTier.from_url(url, storage_options)
        self.index: BlockIndex | None = None
        """The host's index: told of every block written and deleted here (``shared_lookup="host"``)."""

    def where(self, digest: str) -> str:
        return f"{self.tier.url}/{block_path(digest)}"

    def write(self, digest: str, header: bytes, payload: memoryview) -> None:
        failpoints.hit(FP_SHARED_WRITE, rank=failpoints.process_rank())
        self.tier.write(block_path(digest), [header, payload])
        if self.index is not None:
            self.index.shared_note(digest)

    def delete(self, digest: str) -> bool:
        if self.index is not None:
            self.index.shared_forget(digest)  # first: the host never answers for a block being deleted
        return super().delete(digest)

    def known(self, digest: str) -> bool:
        """Whether this host's stores wrote the block here (and did not delete it): no round trip."""
        return self.index is not None and self.index.shared_has(digest)

    def fetch(self, digest: str) -> memoryview | None:
        """The verified payload, or None if absent; raises for a corrupt block or a failing tier."""
        failpoints.hit(FP_SHARED_READ, rank=failpoints.process_rank())
        try:
            raw = self.tier.read(block_path(digest))
        except MissingFile:
            return None
        return decode_block(raw, digest, self.where(digest))

    def read_into(self, digest: str, out: memoryview) -> bool:
        payload = self.fetch(digest)
        if payload is None:
            return False
        if payload.nbytes != out.nbytes:
            raise BufferSizeError(
                f"block {digest} on the shared tier is {payload.nbytes} bytes, the buffer is {out.nbytes}",
                payload.nbytes,
            )
        out[:] = payload
        return True


def tier_error(tier: str, digest: str, err: BaseException) -> ShoalError:
    """A failing tier's exception as the shoal error a result carries."""
    if isinstance(err, ShoalError):
        return err
    return TierError(f"{tier} KV tier failed for block {digest}: {type(err).__name__}: {err}")
