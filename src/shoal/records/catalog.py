"""The catalog of chunks already durable on a tier, for incremental saves.

Built from the manifests of the committed checkpoints retained on the tier; a
chunk found here is not written again: the new manifest points at the pack that
already holds it. The catalog is updated after each commit by the pipeline's
worker and pruned by retention, which on the shared tier runs on a thread of its
own beside the next checkpoint: :class:`PackPins` keeps the two apart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Mapping
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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Held while the catalog changes: :meth:`drop_packs` may come from the retention thread.
    It replaces ``locations`` and ``packs`` with new dicts, so a reader holding the old ones
    (the planner, a manifest being built) never sees them change under it."""

    def __contains__(self, digest: object) -> bool:
        return digest in self.locations

    def __len__(self) -> int:
        return len(self.locations)

    def add_manifest(self, manifest: Manifest, *, manifest_digest: str | None = None) -> None:
        """Record every chunk ``manifest`` references (it must be committed on this catalog's tier).

        ``manifest_digest``: the BLAKE3 of the bytes written for it, where the writer has it.
        """
        summary = StepSummary.of(manifest)
        with self._lock:
            for digest, loc in manifest.locations.items():
                self.locations.setdefault(digest, loc)
            for pid, rec in manifest.packs.items():
                self.packs.setdefault(pid, rec)
            self.recent[manifest.step] = (summary, manifest_digest)
            while len(self.recent) > _RECENT:
                del self.recent[min(self.recent)]

    def recent_step(self, step: int) -> tuple[StepSummary, str | None] | None:
        """What :attr:`recent` holds of ``step`` (read under the lock: another thread may add)."""
        with self._lock:
            return self.recent.get(step)

    def drop_packs(self, pack_ids: Iterable[str]) -> None:
        """Forget packs that retention deleted, and every chunk that lay in them."""
        gone = set(pack_ids)
        with self._lock:
            if not gone & self.packs.keys():
                return
            self.packs = {pid: rec for pid, rec in self.packs.items() if pid not in gone}
            self.locations = {d: loc for d, loc in self.locations.items() if loc.pack not in gone}

    def records_holding(self, digests: Iterable[str]) -> dict[str, PackRecord]:
        """Pack id -> record, of the packs that hold any of ``digests`` (those this catalog knows)."""
        with self._lock:  # one consistent pair: drop_packs replaces both dicts, never changes them
            locations, packs = self.locations, self.packs
        return {pid: packs[pid] for pid in {locations[d].pack for d in digests if d in locations}}

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


class PackPins:
    """Which shared-tier packs the checkpoints in flight reuse, and which retention is deleting.

    Retention on the shared tier runs on a thread of its own, beside the next checkpoint. A pack
    it deletes must not be one that checkpoint's manifest will point at. So the coordinator pins,
    before it plans, every pack the plan could reuse (:meth:`pin`), and releases them once the
    checkpoint committed or failed (:meth:`release`). A retention pass marks its start
    (:meth:`mark`) before it lists the tier, and asks to delete packs (:meth:`claim`); it gets
    those that are not pinned now and were not released since its mark (the step that held one
    may have committed after the pass listed the steps, so the pass cannot have seen it refer to
    the pack). A claimed pack is never pinned: :meth:`pin` returns it instead, and the plan drops
    it from its catalog. When the deletes are over (:meth:`deleted`) the claim ends; a catalog
    that still names such a pack is caught by the presence check that follows every pin.

    Thread-safe. One retention pass at a time (the pipeline's retention thread).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._pinned: dict[int, frozenset[str]] = {}
        self._released: dict[str, int] = {}
        """Pack -> the sequence number of its last release since the newest mark."""
        self._claimed: set[str] = set()

    def pin(self, step: int, packs: Iterable[str]) -> frozenset[str]:
        """Pin ``packs`` for ``step``'s checkpoint; returns those retention claimed (not pinned: unusable)."""
        wanted = frozenset(packs)
        with self._lock:
            claimed = wanted & self._claimed
            self._pinned[step] = self._pinned.get(step, frozenset()) | (wanted - claimed)
            return claimed

    def release(self, step: int) -> None:
        """``step``'s checkpoint committed or failed: its packs are no longer pinned by it."""
        with self._lock:
            packs = self._pinned.pop(step, frozenset())
            if packs:
                self._seq += 1
                for pid in packs:
                    self._released[pid] = self._seq

    def mark(self) -> int:
        """A retention pass begins (before it lists anything); the mark to pass to :meth:`claim`."""
        with self._lock:
            self._seq += 1
            self._released.clear()  # releases before this mark matter to no pass from now on
            return self._seq

    def claim(self, packs: Collection[str], since: int) -> tuple[str, ...]:
        """Of ``packs``, those retention may delete now (claimed until :meth:`deleted`), in order."""
        with self._lock:
            held = set().union(*self._pinned.values())
            ok = tuple(pid for pid in packs if pid not in held and self._released.get(pid, since) <= since)
            self._claimed.update(ok)
            return ok

    def deleted(self, packs: Iterable[str]) -> None:
        """The deletes of claimed ``packs`` are over (done or failed): their claims end."""
        with self._lock:
            self._claimed.difference_update(packs)

    def pinned(self) -> frozenset[str]:
        """Every pack pinned now (for tests and diagnosis)."""
        with self._lock:
            return frozenset().union(*self._pinned.values())


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
