"""What a tier holds, cheaply: the one pack listing, and each step's pack list without decoding manifests.

Retention, the load inventory and the catalog's pack check all need the packs a tier holds:
:func:`list_packs` is the one listing (a single ``list`` of ``packs/``) that every one of them uses.

Retention also needs, for every step on the tier, which packs its manifest references and
which writer committed it; nothing else. Decoding a manifest of 20,000 items takes most of a
second, and retention runs after every commit, over every retained step. :class:`StepSummaries`
keeps each step's :class:`StepSummary` between passes, keyed by the manifest's path, size and
mtime and the digest its commit record names: any change to the file or to its commit record
makes the next pass read and decode it again. A step this process just committed is recorded
from the manifest it wrote (:meth:`StepSummaries.prime`), once its bytes on the tier are checked
against the commit record's digest (and the digest the writer computed, when it gave one).
Damaged steps (unreadable, malformed, not the one their commit record names) are never cached:
every pass reads them again and reports them as :func:`~shoal.records.store.list_checkpoints` does.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from shoal._collector import collector_paused
from shoal.errors import CheckpointNotFound, ChecksumMismatch, FormatError, MissingFile
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import Manifest, Pointer
from shoal.records.store import list_steps, read_manifest, read_pointer
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)

_PACK = ".pack"
_INDEX = ".idx"


@dataclass(frozen=True)
class PackListing:
    """The pack files directly under ``packs/`` of one tier, by pack id."""

    packs: frozenset[str]
    """Ids with a ``.pack`` file."""
    indexes: frozenset[str]
    """Ids with a ``.idx`` file."""

    @property
    def ids(self) -> frozenset[str]:
        """Ids with either file (an index whose pack is gone is a pack id too, for retention)."""
        return self.packs | self.indexes


def list_packs(tier: Tier) -> PackListing:
    """One listing of ``packs/`` on ``tier`` (files below a sub-directory are not packs)."""
    packs: set[str] = set()
    indexes: set[str] = set()
    cut = len(layout.PACKS_DIR) + 1
    for path in tier.list(layout.PACKS_DIR + "/"):
        name = path[cut:]
        if "/" in name:
            continue
        if name.endswith(_PACK):
            packs.add(name[: -len(_PACK)])
        elif name.endswith(_INDEX):
            indexes.add(name[: -len(_INDEX)])
    return PackListing(frozenset(packs), frozenset(indexes))


@dataclass(frozen=True)
class StepSummary:
    """What retention needs of one step's manifest: who committed it and the packs it references."""

    step: int
    writer: str | None
    packs: frozenset[str]

    @classmethod
    def of(cls, manifest: Manifest) -> StepSummary:
        # The packs of its chunk locations too: a superset of what the manifest references is safe.
        packs = set(manifest.packs)
        packs.update(loc.pack for loc in manifest.locations.values())
        return cls(manifest.step, manifest.writer, frozenset(packs))


@dataclass(frozen=True)
class StepState:
    """One step on a tier, as retention sees it (what :class:`~shoal.records.store.CheckpointInfo` says)."""

    step: int
    committed: bool
    """A commit record names the manifest (only meaningful when ``summary`` is not None)."""
    summary: StepSummary | None
    """None: the step is damaged (``problem`` says why)."""
    problem: str | None = None


@dataclass(frozen=True)
class _Entry:
    size: int
    mtime: float
    commit: str | None
    summary: StepSummary


class StepSummaries:
    """Per tier and step, the :class:`StepSummary` of its manifest, valid while the files are unchanged.

    Thread-safe; one per pipeline (the pipeline's worker is its only user).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._lock = threading.Lock()
        self.decoded = 0
        """Manifests decoded so far (a cache miss each)."""

    def list(self, tier: Tier) -> list[StepState]:
        """Every step on ``tier`` (a manifest or a commit record), ascending, each summarised."""
        steps = list_steps(tier)
        out = [self._state(tier, step) for step in steps]
        with self._lock:
            keep = set(steps)
            for key in [k for k in self._entries if k[0] == tier.url and k[1] not in keep]:
                del self._entries[key]
        return out

    def prime(self, tier: Tier, summary: StepSummary, manifest_digest: str | None = None) -> bool:
        """Record ``summary`` of the manifest this process just wrote to ``tier``, without decoding it back.

        Recorded only if the bytes now at its path have the digest its commit record names
        (shared tier) and ``manifest_digest`` (what the writer computed), where there is one.
        Returns whether it was recorded; if not, the next :meth:`list` decodes the file.
        """
        step = summary.step
        path = layout.manifest_path(step)
        try:
            commit = _commit_digest(tier, step)
            info = tier.info(path)
            data = tier.read_small(path, layout.MAX_MANIFEST_BYTES, "manifest")
        except (FormatError, MissingFile) as e:
            log.debug("not recording step %d of %s: %s", step, tier.url, e)
            return False
        actual = digest(data)
        if (commit is not None and commit != actual) or manifest_digest not in (None, actual):
            return False
        if info.size != len(data):
            return False  # changed between the stat and the read: let the next pass decode it
        with self._lock:
            self._entries[(tier.url, step)] = _Entry(info.size, info.mtime, commit, summary)
        return True

    def _state(self, tier: Tier, step: int) -> StepState:
        path = layout.manifest_path(step)
        try:
            commit = _commit_digest(tier, step)
            info = tier.info(path)
        except FormatError as e:
            return StepState(step, False, None, str(e))
        except MissingFile:
            info = None  # read_manifest below says what is missing, as list_checkpoints does
        with self._lock:
            entry = self._entries.get((tier.url, step))
        if (
            entry is not None
            and info is not None
            and (entry.size, entry.mtime, entry.commit) == (info.size, info.mtime, commit)
        ):
            return StepState(step, commit is not None, entry.summary)
        try:
            with collector_paused():  # a tree of small objects, no cycles
                manifest = read_manifest(tier, step, expect_digest=commit)
        except (FormatError, ChecksumMismatch, CheckpointNotFound) as e:
            return StepState(step, False, None, str(e))
        self.decoded += 1
        summary = StepSummary.of(manifest)
        if info is not None:  # stat before read: a file changed since is decoded again next time
            with self._lock:
                self._entries[(tier.url, step)] = _Entry(info.size, info.mtime, commit, summary)
        return StepState(step, commit is not None, summary)


def _commit_digest(tier: Tier, step: int) -> str | None:
    """The manifest digest ``step``'s commit record names, or None without one (FormatError if bad)."""
    pointer: Pointer | None = read_pointer(tier, layout.commit_path(step))
    return None if pointer is None else pointer.manifest_blake3


def summarise(tier: Tier, summaries: StepSummaries | None = None) -> list[StepState]:
    """:meth:`StepSummaries.list` with ``summaries``, or with a cache used once (every manifest decoded)."""
    return (summaries or StepSummaries()).list(tier)


__all__ = [
    "PackListing",
    "StepState",
    "StepSummaries",
    "StepSummary",
    "list_packs",
    "summarise",
]
