"""What the save planner reads and writes: frozen, plain data (DESIGN.md section 4).

Ranks report :class:`RankChunks`; the planner (:mod:`shoal.group.planner`) answers with a
:class:`CheckpointPlan` (one host) or a :class:`GroupPlan` (drains and partner transfers).
Chunks in a plan are :class:`ChunkRuns`: runs of consecutive chunks of one item, stored as
columns, so that a plan for thousands of ranks stays small to build and to broadcast. A
run that covers a whole item shares the digest tuple the rank reported.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter


@dataclass(frozen=True)
class ItemChunks:
    """One staged item as its rank reports it: its chunks' BLAKE3 digests (hex) and lengths.

    The planner takes two items with the same key and digests to be the same item (their
    ``nbytes`` is that of the first rank to report it).
    """

    key: str
    nbytes: int
    digests: tuple[str, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class RankChunks:
    """Everything one rank staged for a checkpoint, in its own item order."""

    rank: int
    host: str
    items: tuple[ItemChunks, ...]


@dataclass(frozen=True)
class ChunkRef:
    """Where a rank finds a chunk in its own staged state."""

    digest: str
    key: str
    index: int
    length: int


@dataclass(frozen=True)
class ChunkRuns:
    """Chunks as runs of consecutive chunks of one item, stored as columns.

    Run ``i`` holds chunks ``starts[i]``, ``starts[i] + 1``, ... of item ``keys[i]``, with
    digests ``digests[i]`` and lengths ``lengths[i]``; runs are in (key, start) order.
    Iterating yields one :class:`ChunkRef` per chunk.
    """

    keys: tuple[str, ...] = ()
    starts: tuple[int, ...] = ()
    digests: tuple[tuple[str, ...], ...] = ()
    lengths: tuple[tuple[int, ...], ...] = ()

    def __iter__(self) -> Iterator[ChunkRef]:
        for key, start, digests, lengths in zip(
            self.keys, self.starts, self.digests, self.lengths, strict=True
        ):
            for i, (d, n) in enumerate(zip(digests, lengths, strict=True)):
                yield ChunkRef(d, key, start + i, n)

    def __len__(self) -> int:
        return sum(map(len, self.digests))

    @property
    def nbytes(self) -> int:
        return sum(map(sum, self.lengths))


@dataclass(frozen=True)
class DrainAssignment:
    """The chunks one rank writes to the shared tier, from its own staged state."""

    rank: int
    host: str
    runs: ChunkRuns

    @property
    def chunks(self) -> tuple[ChunkRef, ...]:
        return tuple(self.runs)

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


@dataclass(frozen=True)
class Transfer:
    """One point-to-point stream of chunks, found in the *sender's* staged state."""

    src_rank: int
    dst_rank: int
    runs: ChunkRuns

    @property
    def chunks(self) -> tuple[ChunkRef, ...]:
        return tuple(self.runs)

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


def _bytes_per_host(drains: Sequence[DrainAssignment]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in drains:
        out[d.host] = out.get(d.host, 0) + d.nbytes
    return out


def _drain_for(drains: Sequence[DrainAssignment], rank: int) -> DrainAssignment | None:
    i = bisect_left(drains, rank, key=attrgetter("rank"))
    return drains[i] if i < len(drains) and drains[i].rank == rank else None


@dataclass(frozen=True)
class CheckpointPlan:
    """A plan without replication (:func:`plan_save`): who drains which new chunk."""

    step: int
    drains: tuple[DrainAssignment, ...]
    """One per rank that drains anything, by rank."""
    logical_bytes: int
    unique_bytes: int
    reused_bytes: int
    """Unique bytes already durable: not written again."""

    @property
    def new_bytes(self) -> int:
        return sum(d.nbytes for d in self.drains)

    def drain_for(self, rank: int) -> DrainAssignment | None:
        return _drain_for(self.drains, rank)

    def bytes_per_host(self) -> dict[str, int]:
        """Drain bytes per host (hosts that drain nothing are left out)."""
        return _bytes_per_host(self.drains)


@dataclass(frozen=True)
class GroupPlan:
    """The plan of one group save: drains to shared storage and transfers to partner hosts."""

    step: int
    drains: tuple[DrainAssignment, ...]
    """One per rank that drains anything, by rank."""
    transfers: tuple[Transfer, ...]
    """One per (sender, receiver) pair, by sender then receiver."""
    logical_bytes: int
    unique_bytes: int
    reused_bytes: int
    """Unique bytes already durable on the shared tier: neither drained nor replicated."""

    @property
    def new_bytes(self) -> int:
        return self.unique_bytes - self.reused_bytes

    @property
    def replicated_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def drain_for(self, rank: int) -> DrainAssignment | None:
        return _drain_for(self.drains, rank)

    def sends_from(self, rank: int) -> tuple[Transfer, ...]:
        get = attrgetter("src_rank")
        return self.transfers[
            bisect_left(self.transfers, rank, key=get) : bisect_right(self.transfers, rank, key=get)
        ]

    def receives_at(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.dst_rank == rank)

    def bytes_per_host(self) -> dict[str, int]:
        """Drain bytes per host (hosts that drain nothing are left out)."""
        return _bytes_per_host(self.drains)


__all__ = [
    "CheckpointPlan",
    "ChunkRef",
    "ChunkRuns",
    "DrainAssignment",
    "GroupPlan",
    "ItemChunks",
    "RankChunks",
    "Transfer",
]
