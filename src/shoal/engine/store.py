"""Reading checkpoints back from a tier: manifests, commit records, verified item bytes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shoal.boundary import Boundary
from shoal.errors import CheckpointNotFound, ChecksumMismatch, FormatError, MissingFile
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import Manifest, Pointer, decode_manifest, decode_pointer
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
    try:
        what = "LATEST record" if path == layout.LATEST else "commit record"
        data = tier.read_small(path, layout.MAX_POINTER_BYTES, what)
    except MissingFile:
        return None
    return decode_pointer(data, f"{tier.url}/{path}")


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
    if expect_digest is not None and digest(data) != expect_digest:
        raise ChecksumMismatch(
            f"manifest {where}: BLAKE3 digest is {digest(data)}, but its commit record says {expect_digest}"
        )
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

    Chunks are read into a scratch buffer of one chunk, hashed, and only then
    copied to the destination, so bytes whose digest does not match never reach
    the caller's memory.
    """

    def __init__(self, tier: Tier, manifest: Manifest) -> None:
        self.tier = tier
        self.manifest = manifest
        self._scratch = bytearray(manifest.chunk_size)
        self.bytes_read = 0

    def read_into(self, key: str, out: memoryview) -> None:
        """Fill ``out`` (exactly the item's size) with item ``key``'s verified bytes."""
        rec = self.manifest.items.get(key)
        if rec is None:
            raise CheckpointNotFound(f"step {self.manifest.step} has no item {key!r} on {self.tier.url}")
        if out.nbytes != rec.nbytes:
            raise FormatError(f"item {key!r} is {rec.nbytes} bytes, destination holds {out.nbytes}")
        scratch = memoryview(self._scratch)
        for i, (dig, item_off, length) in enumerate(self.manifest.chunk_spans(key)):
            loc = self.manifest.locations.get(dig)
            if loc is None:
                raise MissingFile(
                    f"item {key!r} of step {self.manifest.step}: chunk {i} ({dig}) is not held on "
                    f"{self.tier.url} (a partial, host-tier manifest)"
                )
            pack = layout.pack_path(loc.pack)
            view = scratch[:length]
            try:
                self.tier.read_range_into(pack, loc.offset, view)
            except MissingFile as e:
                raise MissingFile(
                    f"item {key!r} of step {self.manifest.step}: pack {self.tier.url}/{pack} is missing "
                    f"(needed for chunk {i} at pack offset {loc.offset})"
                ) from e
            actual = digest(view)
            if actual != dig:
                raise ChecksumMismatch(
                    f"item {key!r} of step {self.manifest.step}: chunk {i} "
                    f"(item bytes {item_off}..{item_off + length})"
                    f" read from pack {self.tier.url}/{pack} at offset {loc.offset} has BLAKE3 {actual}, "
                    f"expected {dig}"
                )
            out[item_off : item_off + length] = view
            self.bytes_read += length

    def read(self, key: str) -> bytearray:
        """Item ``key``'s verified bytes in a new buffer."""
        buf = bytearray(self.manifest.items[key].nbytes)
        self.read_into(key, memoryview(buf))
        return buf
