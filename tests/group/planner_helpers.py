"""Helpers shared by the planner tests: chunk digests by number, reports as tables, who holds what.

The planner reads one form of report, a :class:`~shoal.group.plan.ChunkTable` per rank (what the
group save's exchange delivers). Tests write a rank's items as before, one :class:`ItemChunks`
each (key, size, digests, lengths; :func:`_item` makes one from chunk numbers), or as a dict
``{key: [chunk number, ...]}``, and :func:`rank` turns them into the rank's table.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping, Sequence

from shoal.format.chunking import digest
from shoal.group.digests import Digests
from shoal.group.plan import ChunkTable, GroupPlan, ItemChunks, RankChunks
from shoal.group.planner import plan_group_save
from shoal.group.topology import build_topology


def _d(i: int) -> str:
    """The digest standing for chunk number ``i``."""
    return digest(i.to_bytes(8, "little"))


def _item(key: str, chunk_ids: Sequence[int], lengths: Mapping[str, int]) -> ItemChunks:
    """Item ``key`` made of chunks ``chunk_ids`` (``lengths``: digest -> chunk length)."""
    digests = tuple(_d(i) for i in chunk_ids)
    lens = tuple(lengths[d] for d in digests)
    return ItemChunks(key, sum(lens), digests, lens)


def table(
    items: Iterable[ItemChunks] | Mapping[str, Sequence[int]], lengths: Mapping[str, int] | None = None
) -> ChunkTable:
    """One rank's report as a table: its ``items`` in order, all digests in one buffer.

    ``items``: :class:`ItemChunks` (digests as hex strings or :class:`Digests`), or a dict
    ``{key: [chunk number, ...]}`` read with ``lengths`` (digest -> chunk length).
    """
    if isinstance(items, Mapping):
        if lengths is None:
            raise TypeError("a dict of chunk numbers needs the chunk lengths")
        items = [_item(key, ids, lengths) for key, ids in items.items()]
    items = list(items)
    for it in items:
        assert len(it.digests) == len(it.lengths), f"item {it.key!r}: digests and lengths differ in number"
    return ChunkTable(
        [it.key for it in items],
        [it.nbytes for it in items],
        [len(it.lengths) for it in items],
        [n for it in items for n in it.lengths],
        Digests.from_hex([d for it in items for d in it.digests]),
    )


def rank(
    r: int,
    host: str,
    *items: ItemChunks,
    chunks: Mapping[str, Sequence[int]] | None = None,
    lengths: Mapping[str, int] | None = None,
) -> RankChunks:
    """Rank ``r`` on ``host`` reporting ``items`` (or the dict ``chunks``, see :func:`table`)."""
    return RankChunks(r, host, table(items) if chunks is None else table(chunks, lengths))


def pickled(ranks: Iterable[RankChunks]) -> list[RankChunks]:
    """The same reports in new objects, each table through a pickle, as the exchange delivers them
    (the digest prefixes are not pickled: the coordinator computes them again)."""
    return [RankChunks(rc.rank, rc.host, pickle.loads(pickle.dumps(rc.items))) for rc in ranks]


def plan_drains(
    step: int, ranks: Sequence[RankChunks], durable: frozenset[str] | set[str], *, balance: bool = True
) -> GroupPlan:
    """The plan without replication, hosts as the ranks report them (each its own failure domain).

    Every rank ``0 .. len(ranks) - 1`` reports once (in any order); ``()`` plans nothing.
    """
    by_rank = sorted(ranks, key=lambda rc: rc.rank)
    hosts = [rc.host for rc in by_rank] or ["h0"]
    topology = build_topology(hosts, replicate=False)
    return plan_group_save(step, ranks, durable, topology, replicate=False, balance=balance)


def hosts_by_digest(ranks: Iterable[RankChunks]) -> dict[str, set[str]]:
    """Digest -> hosts whose ranks staged it."""
    out: dict[str, set[str]] = {}
    for rc in ranks:
        for item in rc.items:
            for d in item.digests:
                out.setdefault(d, set()).add(rc.host)
    return out
