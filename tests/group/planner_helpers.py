"""Helpers shared by the planner tests: chunk digests by number, items, who holds what."""

from __future__ import annotations

from collections.abc import Iterable

from shoal.format.chunking import digest
from shoal.group.planner import ItemChunks, RankChunks


def _d(i: int) -> str:
    """The digest standing for chunk number ``i``."""
    return digest(i.to_bytes(8, "little"))


def _item(key: str, chunk_ids: list[int], lengths: dict[str, int]) -> ItemChunks:
    digests = tuple(_d(i) for i in chunk_ids)
    lens = tuple(lengths[d] for d in digests)
    return ItemChunks(key, sum(lens), digests, lens)


def hosts_by_digest(ranks: Iterable[RankChunks]) -> dict[str, set[str]]:
    """Digest -> hosts whose ranks staged it."""
    out: dict[str, set[str]] = {}
    for rc in ranks:
        for item in rc.items:
            for d in item.digests:
                out.setdefault(d, set()).add(rc.host)
    return out
