"""The save planner: pure functions over plain data, frozen plans out (DESIGN.md section 4).

Input: every rank's chunk list (item key, chunk digests and lengths) and the set
of chunks already durable on the shared tier. Output: one owner per unique new
chunk, chosen so that the bytes each *host* drains are balanced: a greedy over hosts,
then over that host's ranks, taking chunks most constrained first (fewest hosts hold
them: a rank's own shard before a replicated weight), then longest first.

Placing the chunks only one host can drain before the ones any host can drain is what
keeps the greedy within one chunk of the lower bound ``max(forced bytes of any host,
new bytes / hosts, biggest chunk)`` for the usual mix of sharded and replicated state;
longest-first alone can hand a replicated chunk to a host whose own shards come later.
No I/O and no torch.distributed here, so it runs for thousands of ranks in a unit test.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ItemChunks:
    """One staged item as its rank reports it."""

    key: str
    nbytes: int
    digests: tuple[str, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class RankChunks:
    rank: int
    host: str
    items: tuple[ItemChunks, ...]


@dataclass(frozen=True)
class ChunkRef:
    """Where an owner finds a chunk in its own staged state."""

    digest: str
    key: str
    index: int
    length: int


@dataclass(frozen=True)
class DrainAssignment:
    rank: int
    host: str
    chunks: tuple[ChunkRef, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class CheckpointPlan:
    step: int
    drains: tuple[DrainAssignment, ...]
    logical_bytes: int
    unique_bytes: int
    reused_bytes: int

    @property
    def new_bytes(self) -> int:
        return sum(d.nbytes for d in self.drains)

    def drain_for(self, rank: int) -> DrainAssignment | None:
        return next((d for d in self.drains if d.rank == rank), None)

    def bytes_per_host(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.drains:
            out[d.host] = out.get(d.host, 0) + d.nbytes
        return out


def plan_save(step: int, ranks: Sequence[RankChunks], durable: Container[str]) -> CheckpointPlan:
    """Deduplicate across ranks and against ``durable``; give each new chunk one owner, balanced by host."""
    holders: dict[str, list[tuple[int, str, ChunkRef]]] = {}
    logical = 0
    for rc in ranks:
        for item in rc.items:
            logical += item.nbytes
            for i, (d, n) in enumerate(zip(item.digests, item.lengths, strict=True)):
                holders.setdefault(d, []).append((rc.rank, rc.host, ChunkRef(d, item.key, i, n)))
    unique = sum(h[0][2].length for h in holders.values())
    new = [(d, h) for d, h in holders.items() if d not in durable]
    reused = unique - sum(h[0][2].length for _, h in new)
    # Fewest holder hosts first, then longest first; each chunk to the least-loaded host holding
    # it, then to that host's least-loaded rank holding it.
    spread = {d: len({host for _, host, _ in hs}) for d, hs in new}
    new.sort(key=lambda dh: (spread[dh[0]], -dh[1][0][2].length, dh[0]))
    host_load: dict[str, int] = {rc.host: 0 for rc in ranks}
    rank_load: dict[int, int] = {rc.rank: 0 for rc in ranks}
    owned: dict[int, list[ChunkRef]] = {}
    rank_host = {rc.rank: rc.host for rc in ranks}
    for _, hs in new:
        rank, host, ref = min(hs, key=lambda h: (host_load[h[1]], rank_load[h[0]], h[0]))
        host_load[host] += ref.length
        rank_load[rank] += ref.length
        owned.setdefault(rank, []).append(ref)
    drains = tuple(
        DrainAssignment(rank, rank_host[rank], tuple(sorted(refs, key=lambda r: (r.key, r.index))))
        for rank, refs in sorted(owned.items())
    )
    return CheckpointPlan(step, drains, logical, unique, reused)
