"""Reading checkpoints back from a tier: manifests, commit records, verified item bytes."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

from shoal.boundary import Boundary
from shoal.errors import CheckpointNotFound, ChecksumMismatch, FormatError, MissingFile, ShoalError, TierError
from shoal.format import layout
from shoal.format.chunking import verify
from shoal.format.manifest import ItemRecord, Manifest, Pointer, decode_manifest, decode_pointer
from shoal.records.fetch import DEFAULT_MAX_RUN, ChunkRequest, ChunkSource, Failure, Fetcher, SourceFile
from shoal.records.small import read_record
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a tier holds for one step. ``boundary`` is PERSISTED (manifest) or RESTARTABLE (committed)."""

    step: int
    boundary: Boundary | None
    manifest: Manifest | None
    problem: str | None = None
    error: Exception | None = None
    """The error behind ``problem``."""


def read_pointer(tier: Tier, path: str) -> Pointer | None:
    """``LATEST`` or a ``COMMIT`` record, or None if absent.

    A record larger than :data:`~shoal.format.layout.MAX_POINTER_BYTES` is a
    :class:`FormatError` and is never read whole.
    """
    what = "LATEST record" if path == layout.LATEST else "commit record"
    return read_record(tier, path, decode_pointer, what=what)


def read_manifest(tier: Tier, step: int, *, expect_digest: str | None = None) -> Manifest:
    """Read and validate the manifest of ``step``; check it against ``expect_digest`` when given.

    A manifest larger than :data:`~shoal.format.layout.MAX_MANIFEST_BYTES` is a
    :class:`FormatError` and is never read whole.
    """
    path = layout.manifest_path(step)
    where = f"{tier.url}/{path}"
    try:
        data = tier.read_small(path, layout.MAX_MANIFEST_BYTES, "manifest")
    except MissingFile as e:
        raise CheckpointNotFound(f"no checkpoint for step {step}: {where} does not exist") from e
    if expect_digest is not None:
        verify(data, expect_digest, f"manifest {where}", said_by="its commit record")
    manifest = decode_manifest(data, where)
    if manifest.step != step:
        raise FormatError(
            f"manifest {where} says step {manifest.step}, but lies in the directory of step {step}"
        )
    return manifest


def list_steps(tier: Tier) -> list[int]:
    """Every step that has a manifest or a commit record on ``tier``, ascending."""
    steps = set()
    for path in tier.list(layout.STEPS_DIR + "/"):
        s = layout.step_of_path(path)
        if s is not None and path.endswith(("/manifest.json", "/COMMIT")):
            steps.add(s)
    return sorted(steps)


def list_checkpoints(tier: Tier) -> list[CheckpointInfo]:
    """Every checkpoint on ``tier`` with the boundary its files prove; unreadable ones carry a problem."""
    out = []
    for step in list_steps(tier):
        try:
            commit = read_pointer(tier, layout.commit_path(step))
            manifest = read_manifest(tier, step, expect_digest=commit.manifest_blake3 if commit else None)
        except (FormatError, ChecksumMismatch, CheckpointNotFound) as e:
            out.append(CheckpointInfo(step, None, None, str(e), e))
            continue
        out.append(CheckpointInfo(step, Boundary.RESTARTABLE if commit else Boundary.PERSISTED, manifest))
    return out


def newest_reached(tier: Tier, boundary: Boundary) -> int | None:
    """The newest step ``tier`` proves reached ``boundary`` (a manifest for B3, a commit record
    for B4, and ``LATEST`` for B4), or None."""
    steps = [i.step for i in list_checkpoints(tier) if i.boundary is not None and i.boundary >= boundary]
    if boundary == Boundary.RESTARTABLE:
        ptr = read_pointer(tier, layout.LATEST)
        steps += [ptr.step] if ptr else []
    return max(steps, default=None)


def resolve_manifest(tier: Tier, step: int | None = None) -> Manifest:
    """The manifest to load: ``LATEST``'s when ``step`` is None, else that step's.

    Either way it is verified against the digest its commit record names.
    """
    if step is None:
        latest = read_pointer(tier, layout.LATEST)
        if latest is None:
            raise CheckpointNotFound(
                f"no committed checkpoint under {tier.url} ({layout.LATEST} does not exist)"
            )
        return read_manifest(tier, latest.step, expect_digest=latest.manifest_blake3)
    commit = read_pointer(tier, layout.commit_path(step))
    if commit is None:
        log.warning("step %d on %s has no commit record; loading its manifest (B3) anyway", step, tier.url)
    return read_manifest(tier, step, expect_digest=commit.manifest_blake3 if commit else None)


class ItemReader:
    """Reads items of one manifest from one tier, verifying every chunk before it is used.

    Reads go through the one chunk fetcher (:class:`~shoal.records.fetch.Fetcher`): the
    chunks of the items asked for at once are read per contiguous run of a pack, each
    verified against its BLAKE3 digest before it is copied out, so bytes whose digest does
    not match never reach the caller's memory. A chunk several items share is read once.
    """

    def __init__(self, tier: Tier, manifest: Manifest, *, max_run: int = DEFAULT_MAX_RUN) -> None:
        self.tier = tier
        self.manifest = manifest
        self.bytes_read = 0
        self._fetcher = Fetcher(max_run=max(max_run, manifest.chunk_size))
        self._files: dict[str, SourceFile] = {}

    def read_into(self, key: str, out: memoryview) -> None:
        """Fill ``out`` (exactly the item's size) with item ``key``'s verified bytes."""
        self.read_many({key: out})

    def read(self, key: str) -> bytearray:
        """Item ``key``'s verified bytes in a new buffer."""
        return self.read_items([key])[key]

    def read_items(self, keys: Iterable[str]) -> dict[str, bytearray]:
        """The verified bytes of each item of ``keys``, each in a new buffer, read together."""
        out = {key: bytearray(self._record(key).nbytes) for key in keys}
        self.read_many({key: memoryview(buf) for key, buf in out.items()})
        return out

    def read_many(self, dests: Mapping[str, memoryview]) -> None:
        """Fill each ``dests[key]`` (exactly the item's size) with item ``key``'s verified bytes.

        Raises :class:`~shoal.errors.ChecksumMismatch` (or the read's error, such as
        :class:`~shoal.errors.MissingFile`) naming the item, the chunk and the pack and offset
        read; nothing is read if a chunk has no location on this tier.
        """
        requests: dict[str, ChunkRequest] = {}
        for key, out in dests.items():
            rec = self._record(key)
            if out.nbytes != rec.nbytes:
                raise FormatError(f"item {key!r} is {rec.nbytes} bytes, destination holds {out.nbytes}")
            for i, (dig, item_off, length) in enumerate(self.manifest.chunk_spans(key)):
                dest = out[item_off : item_off + length]
                known = requests.get(dig)
                if known is not None:
                    cast(list[memoryview], known.dests).append(dest)
                    continue
                span = f"item bytes {item_off}..{item_off + length}"
                what = f"item {key!r} of step {self.manifest.step}: chunk {i} ({span})"
                requests[dig] = ChunkRequest(dig, length, [dest], [self._source(dig, what)], what)
        order = list(requests.values())
        result = self._fetcher.fetch(order)
        self.bytes_read += sum(order[i].length for i, u in enumerate(result.used) if u is not None)
        lost = result.lost
        if lost:
            failure = result.failures[lost[0]][-1]
            error = self._error(order[lost[0]], failure)
            if error is failure.error:
                raise error
            raise error from failure.error

    def _record(self, key: str) -> ItemRecord:
        rec = self.manifest.items.get(key)
        if rec is None:
            raise CheckpointNotFound(f"step {self.manifest.step} has no item {key!r} on {self.tier.url}")
        return rec

    def _source(self, dig: str, what: str) -> ChunkSource:
        loc = self.manifest.locations.get(dig)
        if loc is None:
            raise MissingFile(
                f"{what} ({dig}) is not held on {self.tier.url} (a partial, host-tier manifest)"
            )
        file = self._files.get(loc.pack)
        if file is None:
            file = self._files[loc.pack] = SourceFile(self.tier, layout.pack_path(loc.pack))
        return ChunkSource(file, loc.offset)

    @staticmethod
    def _error(req: ChunkRequest, failure: Failure) -> ShoalError:
        """The error to raise for a chunk that could not be read: it names the item, chunk and source."""
        error = failure.error
        if isinstance(error, ChecksumMismatch):
            return error
        where = failure.source.describe()
        if isinstance(error, MissingFile):
            return MissingFile(f"{req.what}: {where}: {error}")
        if isinstance(error, ShoalError):
            return type(error)(f"{req.what}: {where}: {error}")
        return TierError(f"{req.what}: reading {where} failed: {type(error).__name__}: {error}")
