"""What survives where: each host's DRAM slabs and host-tier packs, and the shared tier (docs/design.md §5).

A host's leader lists its host (:func:`host_inventory`): the manifests and packs of its
host tiers (partner copies, written at B2), and the staged index of every DRAM slab (what a
slab holds, written by the pipeline once the slab's chunks are hashed). The coordinator
lists the shared tier (:func:`shared_inventory`) and turns everything into the restore
planner's input (:func:`candidates_and_sources`): one :class:`~shoal.group.readplan.Candidate`
per surviving copy of a checkpoint's metadata, and every :class:`~shoal.group.readplan.Source`
of every chunk. Nothing here trusts bytes: every chunk is verified when it is read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.boundary import Boundary
from shoal.errors import MissingFile, ShoalError
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import ItemRecord, Manifest, WorldInfo
from shoal.group.digests import DIGEST_SIZE
from shoal.group.readplan import SHARED, Candidate, Source
from shoal.records.packlist import list_packs
from shoal.records.staged import (
    CHUNKS_FORMAT,
    CHUNKS_SUFFIX,
    DCP_FORMAT,
    DCP_SUFFIX,
    INDEX_SUFFIX,
    STAGED_DIR,
    STAGED_FORMAT,
    STAGED_FORMAT_V1,
)
from shoal.records.store import list_checkpoints
from shoal.tiers.base import Tier
from shoal.tiers.roles import Role, kind_for
from shoal.tiers.slabs import require_slabs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedItemRecord:
    key: str
    kind: str
    offset: int
    nbytes: int
    chunks: tuple[str, ...] | None
    """Chunk digests; None while the pipeline has not hashed the item yet."""
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StagedRecord:
    """One DRAM slab's staged index: the step it holds and where each item's bytes lie in it."""

    step: int
    rank: int
    slab: str
    chunk_size: int
    items: tuple[StagedItemRecord, ...]
    world_size: int = 0
    job: str = ""
    created: float = 0.0
    dcp: Mapping[str, Any] | None = None
    run: str | None = None


def _staged_record(
    doc: Mapping[str, Any], where: str, sidecars: Mapping[str, Any] | None = None
) -> StagedRecord:
    """The record of a staged index ``doc``; ``sidecars`` (format 2): its DCP and chunks sidecars, if any."""
    fmt = doc.get("format")
    if fmt == STAGED_FORMAT_V1:
        items = _items_v1(doc["items"])
        dcp = doc.get("dcp")
    elif fmt == STAGED_FORMAT:
        sidecars = sidecars or {}
        items = _items_v2(doc["columns"], sidecars.get("chunks"), where)
        dcp = (sidecars.get("dcp") or {}).get("dcp")
    else:
        raise ValueError(f"{where}: format is {fmt!r}, expected {STAGED_FORMAT!r}")
    return StagedRecord(
        int(doc["step"]),
        int(doc["rank"]),
        str(doc["slab"]),
        int(doc["chunk_size"]),
        tuple(items),
        int(doc.get("world_size", 0)),
        str(doc.get("job", "")),
        float(doc.get("created", 0.0)),
        dcp if isinstance(dcp, Mapping) else None,
        None if doc.get("run") is None else str(doc["run"]),
    )


def _items_v1(items: Sequence[Mapping[str, Any]]) -> list[StagedItemRecord]:
    out = []
    for it in items:
        chunks = it.get("chunks")
        shape = it.get("shape")
        out.append(
            StagedItemRecord(
                str(it["key"]),
                str(it.get("kind", "tensor")),
                int(it["offset"]),
                int(it["nbytes"]),
                None if chunks is None else tuple(str(c) for c in chunks),
                it.get("dtype"),
                None if shape is None else tuple(int(x) for x in shape),
            )
        )
    return out


def _items_v2(
    columns: Mapping[str, Sequence[Any]], chunks: Mapping[str, Any] | None, where: str
) -> list[StagedItemRecord]:
    """Items from the index's columns, with their digests from the chunks sidecar when there is one."""
    keys, kinds, offsets = columns["key"], columns["kind"], columns["offset"]
    nbytes, dtypes, shapes = columns["nbytes"], columns["dtype"], columns["shape"]
    n = len(keys)
    if any(len(c) != n for c in (kinds, offsets, nbytes, dtypes, shapes)):
        raise ValueError(f"{where}: the item columns are not all {n} long")
    digests: list[tuple[str, ...] | None] = [None] * n
    if chunks is not None:
        counts, joined = chunks["counts"], str(chunks["digests"])
        width = 2 * DIGEST_SIZE
        if len(counts) != n or len(joined) != width * sum(int(c) for c in counts):
            log.warning("ignoring the chunks sidecar of %s: it does not cover its %d items", where, n)
            counts = []
        at = 0
        for i, c in enumerate(counts):
            digests[i] = tuple(joined[at + k * width : at + (k + 1) * width] for k in range(int(c)))
            at += int(c) * width
    return [
        StagedItemRecord(
            str(keys[i]),
            str(kinds[i]),
            int(offsets[i]),
            int(nbytes[i]),
            digests[i],
            None if dtypes[i] is None else str(dtypes[i]),
            None if shapes[i] is None else tuple(int(x) for x in shapes[i]),
        )
        for i in range(n)
    ]


def _sidecars(dram: Tier, path: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP and chunks sidecars of the format-2 index at ``path`` that belong to it (by step, slab,
    creation time); a missing or malformed one, or one an earlier step of the slot left, is left out
    (without digests the items are hashed from the slab; without DCP metadata the step is no staged
    candidate, but its slab still serves chunks)."""
    out: dict[str, Any] = {}
    if doc.get("format") != STAGED_FORMAT:
        return out
    stem = path[: -len(INDEX_SUFFIX)]
    bind = {"step": doc.get("step"), "slab": doc.get("slab"), "created": doc.get("created")}
    for name, suffix, fmt in (("dcp", DCP_SUFFIX, DCP_FORMAT), ("chunks", CHUNKS_SUFFIX, CHUNKS_FORMAT)):
        where = f"{dram.url}/{stem}{suffix}"
        try:
            side = json.loads(dram.read_small(stem + suffix, layout.MAX_STAGED_BYTES, "staged index sidecar"))
        except MissingFile:
            continue
        if not isinstance(side, dict) or side.get("format") != fmt:
            log.warning("ignoring %s: not a %s sidecar", where, fmt)
            continue
        if {k: side.get(k) for k in bind} != bind:
            log.debug("ignoring %s: it belongs to another step of the slot", where)
            continue
        out[name] = side
    return out


def _hashed(rec: StagedRecord, dram: Tier) -> StagedRecord:
    """``rec`` with the digests of items the pipeline had not hashed yet, read from the slab."""
    if all(i.chunks is not None for i in rec.items):
        return rec
    slabs = require_slabs(dram, "hash a staged slab")
    buf = bytearray(rec.chunk_size)
    items = []
    for i in rec.items:
        if i.chunks is None:
            chunks = []
            for off in range(0, i.nbytes, rec.chunk_size):
                view = memoryview(buf)[: min(rec.chunk_size, i.nbytes - off)]
                slabs.read_slab_into(rec.slab, i.offset + off, view)
                chunks.append(digest(view))
            i = dataclasses.replace(i, chunks=tuple(chunks))
        items.append(i)
    return dataclasses.replace(rec, items=tuple(items))


def read_staged(dram: Tier, *, run_id: str | None = None) -> list[StagedRecord]:
    """Every readable staged index on ``dram`` of run ``run_id`` (others are skipped with a log line).

    A malformed index is skipped with a warning. Items staged but not hashed yet (a crash
    right after B1) are hashed from their slab now.
    """
    out = []
    for path in dram.list(STAGED_DIR + "/"):
        if not path.endswith(INDEX_SUFFIX):
            continue
        where = f"{dram.url}/{path}"
        try:
            data = dram.read_small(path, layout.MAX_STAGED_BYTES, "staged index")
            doc = json.loads(data)
            rec = _staged_record(doc, where, _sidecars(dram, path, doc))
            if run_id is not None and rec.run != run_id:
                log.info("ignoring staged index %s: it belongs to run %s, not to this run (%s)",
                         where, rec.run, run_id)  # fmt: skip
                continue
            out.append(_hashed(rec, dram))
        except (ShoalError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            log.warning("ignoring staged index %s: %s", where, e)
    return out


@dataclass
class HostInventory:
    """What one host holds: host-tier manifests and packs (by tier kind) and staged slabs."""

    host: str
    manifests: list[tuple[str, Manifest]] = field(default_factory=list)
    packs: dict[str, frozenset[str]] = field(default_factory=dict)
    staged: list[StagedRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    looked: list[str] = field(default_factory=list)
    """The URLs of the tiers listed."""


def host_inventory(
    host: str, tiers: Mapping[str, Tier], dram: Tier | None, *, run_id: str | None = None
) -> HostInventory:
    """List what ``host`` holds on its host tiers (``kind -> tier``: local, dram) and DRAM slabs.

    With ``run_id``, manifests and staged indexes that name another run are left out (logged).
    """
    inv = HostInventory(host, looked=[t.url for t in tiers.values()])
    for kind, tier in tiers.items():
        try:
            inv.packs[kind] = list_packs(tier).packs
            for info in list_checkpoints(tier):
                m = info.manifest
                if m is not None and run_id is not None and m.run is not None and m.run != run_id:
                    log.info("ignoring manifest of step %d on %s: it belongs to run %s, not %s",
                             m.step, tier.url, m.run, run_id)  # fmt: skip
                    continue
                if info.manifest is not None:
                    inv.manifests.append((kind, info.manifest))
                elif info.problem:
                    inv.problems.append(f"{tier.url}: step {info.step}: {info.problem}")
        except ShoalError as e:
            inv.problems.append(f"{tier.url}: {e}")
    if dram is not None:
        try:
            inv.staged = read_staged(dram, run_id=run_id)
        except ShoalError as e:
            inv.problems.append(f"{dram.url}: {e}")
    return inv


@dataclass
class SharedInventory:
    """What the shared tier holds: readable manifests (with whether committed) and packs."""

    manifests: list[tuple[Manifest, bool]] = field(default_factory=list)
    packs: frozenset[str] = frozenset()
    problem: str | None = None
    """Why the tier could not be listed at all."""
    unreadable: dict[int, Exception] = field(default_factory=dict)
    """Steps whose manifest or commit record is there but cannot be used, and why."""


def shared_inventory(tier: Tier) -> SharedInventory:
    """List the shared tier; an unreachable tier gives an empty inventory and says why."""
    try:
        packs = list_packs(tier).packs
        infos = list_checkpoints(tier)
    except (ShoalError, OSError) as e:
        log.warning("shared tier %s cannot be listed; restoring without it: %s", tier.url, e)
        return SharedInventory(problem=f"{tier.url}: {e}")
    return SharedInventory(
        [(i.manifest, i.boundary == Boundary.RESTARTABLE) for i in infos if i.manifest is not None],
        packs,
        unreadable={i.step: i.error for i in infos if i.error is not None},
    )


def _candidate(m: Manifest, origin: str, committed: bool = False) -> Candidate:
    return Candidate(m.step, {k: rec.chunks for k, rec in m.items.items()}, origin, committed)


@dataclass
class Inventory:
    """The restore planner's input: candidates, every chunk's sources, and what is gone."""

    candidates: list[Candidate]
    sources: dict[str, list[Source]]
    manifests: dict[tuple[int, str], Manifest]
    """Each candidate's manifest, by ``(step, origin)``."""
    gone: dict[str, list[str]]
    """Digest -> copies a manifest names that are no longer there."""


def candidates_and_sources(hosts: Iterable[HostInventory], shared: SharedInventory) -> Inventory:
    """Merge every host's inventory and the shared tier's."""
    candidates: list[Candidate] = []
    manifests: dict[tuple[int, str], Manifest] = {}
    found: dict[str, dict[Source, None]] = {}
    gone: dict[str, list[str]] = {}

    def add(d: str, s: Source, present: frozenset[str]) -> None:
        if s.slab or s.path in present:
            found.setdefault(d, {})[s] = None
        else:
            where = gone.setdefault(d, [])
            text = f"{s.describe()} is missing"
            if text not in where:
                where.append(text)

    for m, committed in shared.manifests:
        candidates.append(_candidate(m, SHARED, committed))
        manifests[(m.step, SHARED)] = m
        for d, loc in m.locations.items():
            add(d, Source(SHARED, None, loc.pack, loc.offset, loc.length), shared.packs)
    staging = kind_for(Role.STAGING)
    for inv in hosts:
        for kind, m in inv.manifests:
            origin = f"{kind}:{inv.host}"
            if (m.step, origin) not in manifests:
                candidates.append(_candidate(m, origin))
                manifests[(m.step, origin)] = m
            present = inv.packs.get(kind, frozenset())
            for d, loc in m.locations.items():
                add(d, Source(kind, inv.host, loc.pack, loc.offset, loc.length), present)
        for rec in inv.staged:
            for item in rec.items:
                for i, d in enumerate(item.chunks or ()):
                    off = i * rec.chunk_size
                    n = min(rec.chunk_size, item.nbytes - off)
                    add(
                        d,
                        Source(staging, inv.host, rec.slab, item.offset + off, n, slab=True),
                        frozenset(),
                    )
    for m in staged_manifests([r for inv in hosts for r in inv.staged]):
        if (m.step, STAGED) not in manifests:
            candidates.append(_candidate(m, STAGED))
            manifests[(m.step, STAGED)] = m
    return Inventory(candidates, {d: list(s) for d, s in found.items()}, manifests, gone)


STAGED = "staged"
"""``Candidate.origin`` of a checkpoint known only from the DRAM slabs' staged indexes."""


def staged_manifests(records: Iterable[StagedRecord]) -> list[Manifest]:
    """The checkpoints whose every rank's slab survives with its staged index (B1 after a crash).

    A step qualifies when staged indexes of one job cover ranks ``0..world_size-1`` and one of
    them (the rank that ran DCP's ``finish``) carries the DCP metadata: every rank had staged. Its
    manifest is rebuilt from them (items and digests; chunk locations come from the sources).
    """
    by_step: dict[tuple[str, int], dict[int, StagedRecord]] = {}
    for r in records:
        by_step.setdefault((r.job, r.step), {})[r.rank] = r
    out = []
    for (job, step), ranks in sorted(by_step.items(), key=lambda kv: kv[0][1]):
        world = max((r.world_size for r in ranks.values()), default=0)
        # DCP's finish ran on one rank (the coordinator, rank 0 unless dcp.save was told another):
        # its index carries the metadata, and proves that every rank had staged.
        coordinator = next((r for _, r in sorted(ranks.items()) if r.dcp is not None), None)
        if not world or set(ranks) != set(range(world)) or coordinator is None:
            continue
        items: dict[str, ItemRecord] = {}
        for rank, rec in sorted(ranks.items()):
            for i in rec.items:
                assert i.chunks is not None
                items[i.key] = ItemRecord(i.key, rank, i.kind, i.nbytes, i.chunks, i.dtype, i.shape)
        out.append(
            Manifest(
                job=job,
                step=step,
                created=coordinator.created,
                chunk_size=coordinator.chunk_size,
                items=items,
                locations={},
                packs={},
                world=WorldInfo(world),
                dcp=coordinator.dcp,
                partial=True,
            )
        )
    return out
