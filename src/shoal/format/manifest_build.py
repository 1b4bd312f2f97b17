"""Building a manifest from what a checkpoint wrote: pure, no I/O.

The save protocol knows three things about a checkpoint: its items (with their chunks'
digests), the packs it has just written (their indexes), and the chunks that earlier
checkpoints already left on the tier (the catalog). :func:`build_manifest` turns them into
the :class:`~shoal.format.manifest.Manifest` of one tier: every chunk located, every
located pack recorded, nothing else referenced (so retention keeps exactly what the
checkpoint needs). A partial manifest (a host tier's copy) locates only what that tier holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import FormatError
from shoal.format.manifest import ChunkLocation, ItemRecord, Manifest, PackRecord, Stats, WorldInfo
from shoal.format.pack import PackIndex

__all__ = ["TierChunks", "ManifestHeader", "build_manifest"]


@dataclass(frozen=True)
class TierChunks:
    """Chunks that lie on one tier: digest -> location, and the records of those packs."""

    locations: Mapping[str, ChunkLocation] = field(default_factory=dict)
    packs: Mapping[str, PackRecord] = field(default_factory=dict)

    @classmethod
    def of_packs(cls, indexes: Iterable[PackIndex]) -> TierChunks:
        """The chunks of freshly written packs, from their indexes."""
        locations: dict[str, ChunkLocation] = {}
        packs: dict[str, PackRecord] = {}
        for index in indexes:
            packs[index.pack_id] = PackRecord(index.size, index.blake3)
            for e in index.entries:
                locations[e.digest] = ChunkLocation(index.pack_id, e.offset, e.length)
        return cls(locations, packs)


@dataclass(frozen=True)
class ManifestHeader:
    """What a manifest says about its checkpoint besides its chunks."""

    job: str
    step: int
    created: float
    chunk_size: int
    world: WorldInfo
    stats: Stats
    shoal_version: str
    dcp: Mapping[str, Any] | None = None
    run: str | None = None
    path: str | None = None
    writer: str | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> ManifestHeader:
        """The header of an existing manifest (to rebuild it with more holdings)."""
        return cls(
            job=manifest.job,
            step=manifest.step,
            created=manifest.created,
            chunk_size=manifest.chunk_size,
            world=manifest.world,
            stats=manifest.stats,
            shoal_version=manifest.shoal_version,
            dcp=manifest.dcp,
            run=manifest.run,
            path=manifest.path,
            writer=manifest.writer,
        )


def build_manifest(
    header: ManifestHeader,
    items: Sequence[ItemRecord],
    holdings: Sequence[TierChunks],
    *,
    partial: bool = False,
) -> Manifest:
    """The manifest of ``items``, each chunk located in the first of ``holdings`` that has it.

    A full manifest (``partial=False``) must locate every chunk: one that no holding has is a
    :class:`~shoal.errors.FormatError` naming the step, the item and the chunk (the checkpoint
    is not committed). A partial manifest leaves such chunks out. Only the packs some
    location points into are recorded.
    """
    locations: dict[str, ChunkLocation] = {}
    packs: dict[str, PackRecord] = {}
    for item in items:
        for i, d in enumerate(item.chunks):
            if d in locations:
                continue
            found = _locate(d, holdings)
            if found is None:
                if partial:
                    continue
                raise FormatError(
                    f"step {header.step}: chunk {i} of item {item.key!r} ({d}) lies in no pack "
                    "written by this checkpoint or kept from an earlier one"
                )
            loc, rec = found
            locations[d] = loc
            packs.setdefault(loc.pack, rec)
    return Manifest(
        job=header.job,
        step=header.step,
        created=header.created,
        chunk_size=header.chunk_size,
        items={item.key: item for item in items},
        locations=locations,
        packs=packs,
        world=header.world,
        dcp=header.dcp,
        stats=header.stats,
        shoal_version=header.shoal_version,
        partial=partial,
        run=header.run,
        path=header.path,
        writer=header.writer,
    )


def _locate(d: str, holdings: Sequence[TierChunks]) -> tuple[ChunkLocation, PackRecord] | None:
    for h in holdings:
        loc = h.locations.get(d)
        if loc is not None:
            rec = h.packs.get(loc.pack)
            if rec is None:
                raise FormatError(f"chunk {d} is located in pack {loc.pack}, which has no record")
            return loc, rec
    return None
