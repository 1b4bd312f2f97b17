"""The catalog of chunks already durable on a tier, for incremental saves.

Built from the manifests of the committed checkpoints retained on the tier; a
chunk found here is not written again: the new manifest points at the pack that
already holds it. The catalog is updated after each commit and pruned after
each retention pass, by the one pipeline thread that owns it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shoal.boundary import Boundary
from shoal.errors import MissingFile
from shoal.format import layout
from shoal.format.manifest import ChunkLocation, Manifest, PackRecord
from shoal.records.packlist import StepSummary
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)

_RECENT = 8
"""Steps :attr:`ChunkCatalog.recent` remembers."""


@dataclass
class ChunkCatalog:
    """Digest -> where the chunk lies on one tier, and the records of the packs involved."""

    locations: dict[str, ChunkLocation] = field(default_factory=dict)
    packs: dict[str, PackRecord] = field(default_factory=dict)
    recent: dict[int, tuple[StepSummary, str | None]] = field(default_factory=dict)
    """The newest steps added (at most :data:`_RECENT`): step -> the summary of its manifest and the
    digest of its bytes where the writer gave it; retention's
    :meth:`~shoal.records.packlist.StepSummaries.prime` takes them instead of decoding the file."""

    def __contains__(self, digest: object) -> bool:
        return digest in self.locations

    def __len__(self) -> int:
        return len(self.locations)

    def add_manifest(self, manifest: Manifest, *, manifest_digest: str | None = None) -> None:
        """Record every chunk ``manifest`` references (it must be committed on this catalog's tier).

        ``manifest_digest``: the BLAKE3 of the bytes written for it, where the writer has it.
        """
        for digest, loc in manifest.locations.items():
            self.locations.setdefault(digest, loc)
        for pid, rec in manifest.packs.items():
            self.packs.setdefault(pid, rec)
        self.recent[manifest.step] = (StepSummary.of(manifest), manifest_digest)
        while len(self.recent) > _RECENT:
            del self.recent[min(self.recent)]

    def drop_packs(self, pack_ids: Iterable[str]) -> None:
        """Forget packs that retention deleted, and every chunk that lay in them."""
        gone = set(pack_ids)
        if not gone:
            return
        for pid in gone:
            self.packs.pop(pid, None)
        self.locations = {d: loc for d, loc in self.locations.items() if loc.pack not in gone}

    @classmethod
    def scan(cls, tier: Tier, *, committed_only: bool = True) -> ChunkCatalog:
        """Build the catalog from every committed, readable checkpoint on ``tier``.

        Host tiers have no commit records: scan them with ``committed_only=False``.

        Packs that are referenced but missing, or not of their recorded size, are left out
        (with a warning), so a new checkpoint never points at bytes that are not there.
        """
        from shoal.records.store import list_checkpoints

        cat = cls()
        for info in list_checkpoints(tier):
            committed = info.boundary == Boundary.RESTARTABLE or not committed_only
            if committed and info.manifest is not None:
                cat.add_manifest(info.manifest)
        problems = pack_problems(tier, cat.packs)
        if problems:
            log.warning(
                "catalog of %s: %d referenced packs are unusable: %s",
                tier.url,
                len(problems),
                "; ".join(problems.values()),
            )
            cat.drop_packs(problems)
        return cat


def pack_problems(tier: Tier, packs: Mapping[str, PackRecord]) -> dict[str, str]:
    """Pack id -> what is wrong with it on ``tier``, for each of ``packs`` that is not there whole.

    A pack is there whole when its ``.pack`` file has the size its record says and its
    ``.idx`` exists. Costs one listing of ``packs/`` with sizes (:meth:`Tier.list_sizes`: on an
    object store or a file system no request per pack, however many packs the manifest
    references). Called by the coordinator before a commit (every pack the new manifest
    references) and by :meth:`ChunkCatalog.scan`.
    """
    if not packs:
        return {}
    sizes = tier.list_sizes(layout.PACKS_DIR + "/")
    out: dict[str, str] = {}
    for pid in sorted(packs):
        path = layout.pack_path(pid)
        size = sizes.get(path)
        if size is None:
            out[pid] = f"{path} is missing"
        elif size != packs[pid].size:
            out[pid] = f"{path} is {size} bytes, its record says {packs[pid].size}"
        elif layout.index_path(pid) not in sizes:
            out[pid] = f"{layout.index_path(pid)} (the index of {path}) is missing"
    return out


def require_packs(tier: Tier, packs: Mapping[str, PackRecord], what: str) -> None:
    """Raise :class:`~shoal.errors.MissingFile` naming every one of ``packs`` not whole on ``tier``.

    The coordinator calls it before writing a manifest (``what``: "step 5 not committed"),
    so that B4 is only ever reached over bytes that are there.
    """
    problems = pack_problems(tier, packs)
    if not problems:
        return
    shown = list(problems.values())
    more = f" (and {len(shown) - 10} more)" if len(shown) > 10 else ""
    raise MissingFile(
        f"{what}: {len(problems)} of the {len(packs)} packs its manifest references are not whole on "
        f"{tier.url}: {'; '.join(shown[:10])}{more}. The next save scans {tier.url} again and writes "
        "their chunks anew."
    )
