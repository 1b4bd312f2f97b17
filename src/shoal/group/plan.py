"""What the save planner reads and writes: frozen, plain data (docs/design.md section 4).

Each rank reports :class:`RankChunks`: its items as one :class:`ChunkTable` (columns, with all
its chunk digests in one buffer of raw bytes, as the group save's exchange delivers them). The
planner (:mod:`shoal.group.planner`) answers with a :class:`GroupPlan`: drains and partner
transfers. Chunks in a plan are :class:`ChunkRuns`: runs of consecutive chunks of one item,
stored as columns; runs of whole items read the rank's table instead of holding one object per
item, so that a plan for thousands of ranks stays small to build and to broadcast.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, overload

import numpy as np

from shoal.group.digests import DIGEST_SIZE, PREFIX_SIZE, Digests, ItemDigests, ItemLengths


@dataclass(frozen=True)
class ItemChunks:
    """One item of a :class:`ChunkTable`, read back: its chunks' BLAKE3 digests (hex) and lengths.

    The planner takes two items with the same key and digests to be the same item (their
    ``nbytes`` is that of the first rank to report it). ``digests`` reads as hex strings: a
    :class:`~shoal.group.digests.Digests` view of the table's buffer.
    """

    key: str
    nbytes: int
    digests: Sequence[str]
    lengths: tuple[int, ...]


def _frozen(a: Any) -> np.ndarray:
    out = np.array(a, dtype=np.int64).reshape(-1)
    out.flags.writeable = False
    return out


class ChunkTable(Sequence[ItemChunks]):
    """One rank's items as columns: :attr:`RankChunks.items`, the planner's input.

    ``keys`` and ``nbytes`` per item, ``counts`` (chunks per item), ``lengths`` (every
    chunk's length, item after item) and ``digests`` (every chunk's digest, item after item,
    in one buffer). :meth:`uniform` builds the table of items cut into chunks of one size
    (the engine's chunking), whose counts and lengths follow from ``nbytes``. Reads as a
    sequence of :class:`ItemChunks` (whose digests are views of the buffer); equals a table
    with equal columns. Immutable; pickles as its columns.

    ``prefix`` is the first 8 bytes of every digest, back to back, as :meth:`Digests.prefixes`
    makes them (read as :attr:`prefix`); computed when first read if not given. A rank sends
    its own beside its report (:attr:`~shoal.engine.protocol.RankReport.prefixes`), so that the
    coordinator reads the planner's sort keys from one small buffer per rank instead of
    gathering them from every digest. The planner only sorts by it: digests are compared on all
    32 bytes, so a prefix that disagreed with its digests could hide a duplicate chunk (stored
    twice) but never merge two different ones. Its length and its first and last entries are
    checked. It is not pickled (plans refer to tables, and stay as small as the columns).
    """

    __slots__ = (
        "_lengths",
        "_prefix",
        "chunk_size",
        "counts",
        "digests",
        "item_bytes",
        "keys",
        "n_chunks",
        "nbytes",
        "starts",
    )

    def __init__(
        self,
        keys: Sequence[str],
        nbytes: Sequence[int] | np.ndarray,
        counts: Sequence[int] | np.ndarray | None,
        lengths: Sequence[int] | np.ndarray | None,
        digests: Digests,
        chunk_size: int | None = None,
        prefix: bytes | None = None,
    ) -> None:
        self.keys: tuple[str, ...] = tuple(keys)
        self.nbytes = _frozen(nbytes)
        self.digests = digests
        self._prefix = None if prefix is None else np.frombuffer(_checked_prefix(digests, prefix), np.uint64)
        self.chunk_size = chunk_size
        if chunk_size is not None:
            if chunk_size <= 0:
                raise ValueError(f"chunk_size must be positive, got {chunk_size}")
            if (self.nbytes < 0).any():
                raise ValueError("an item of negative size")
            self.counts = _frozen(-(-self.nbytes // chunk_size))
            self._lengths: np.ndarray | None = None
            self.item_bytes = self.nbytes
        else:
            if counts is None or lengths is None:
                raise ValueError("counts and lengths are needed without a chunk_size")
            self.counts = _frozen(counts)
            self._lengths = _frozen(lengths)
            if (self.counts < 0).any():
                raise ValueError("a negative chunk count")
        if not len(self.keys) == len(self.nbytes) == len(self.counts):
            raise ValueError(
                f"{len(self.keys)} keys, {len(self.nbytes)} sizes and {len(self.counts)} chunk counts"
            )
        total = int(self.counts.sum())
        if total != len(digests) or (self._lengths is not None and total != len(self._lengths)):
            raise ValueError(f"{total} chunks in the items, but {len(digests)} digests")
        self.n_chunks = total
        """Chunks in all the items (``len(digests)``, read without a call)."""
        self.starts = _frozen(np.cumsum(self.counts) - self.counts)
        if chunk_size is None:
            ends = np.concatenate([[0], np.cumsum(self.lengths)])
            self.item_bytes = _frozen(ends[self.starts + self.counts] - ends[self.starts])

    @classmethod
    def uniform(
        cls,
        keys: Sequence[str],
        nbytes: Sequence[int] | np.ndarray,
        chunk_size: int,
        digests: Digests,
        prefix: bytes | None = None,
    ) -> ChunkTable:
        """Items of ``nbytes`` bytes cut into chunks of ``chunk_size`` (the last one shorter)."""
        return cls(keys, nbytes, None, None, digests, chunk_size, prefix)

    @property
    def lengths(self) -> np.ndarray:
        """Every chunk's length, item after item."""
        if self._lengths is None:
            assert self.chunk_size is not None
            out = np.full(len(self.digests), self.chunk_size, dtype=np.int64)
            full = self.counts > 0
            out[(self.starts + self.counts - 1)[full]] = (self.nbytes - (self.counts - 1) * self.chunk_size)[
                full
            ]
            out.flags.writeable = False
            self._lengths = out
        return self._lengths

    @property
    def prefix(self) -> np.ndarray:
        """The first 8 bytes of each digest as an unsigned 64-bit integer, read-only: the planner's
        sort keys (and :meth:`Digests.prefixes` read as integers)."""
        if self._prefix is None:
            self._prefix = np.frombuffer(self.digests.prefixes(), np.uint64)
        return self._prefix

    def item_digests(self, i: int) -> Digests:
        buf, at = self.digests.buffer
        return Digests.view(buf, at + int(self.starts[i]), int(self.counts[i]))

    def item_lengths(self, i: int) -> tuple[int, ...]:
        n = int(self.counts[i])
        if self._lengths is None and self.chunk_size is not None:
            return (
                (self.chunk_size,) * (n - 1) + (int(self.nbytes[i]) - (n - 1) * self.chunk_size,) if n else ()
            )
        a = int(self.starts[i])
        return tuple(self.lengths[a : a + n].tolist())

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> ItemChunks: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[ItemChunks, ...]: ...
    def __getitem__(self, i: int | slice) -> ItemChunks | tuple[ItemChunks, ...]:
        if isinstance(i, slice):
            return tuple(map(self.__getitem__, range(len(self.keys))[i]))
        if i < 0:
            i += len(self.keys)
        if not 0 <= i < len(self.keys):
            raise IndexError("item index out of range")
        return ItemChunks(self.keys[i], int(self.nbytes[i]), self.item_digests(i), self.item_lengths(i))

    def __iter__(self) -> Iterator[ItemChunks]:
        return map(self.__getitem__, range(len(self.keys)))

    def same(self, other: ChunkTable) -> bool:
        """Equal columns (keys, sizes, chunk counts, lengths and digest bytes)."""
        if self is other:
            return True
        if not (
            self.digests == other.digests
            and self.keys == other.keys
            and self.nbytes.tobytes() == other.nbytes.tobytes()
            and self.counts.tobytes() == other.counts.tobytes()
        ):
            return False
        if self.chunk_size is not None and self.chunk_size == other.chunk_size:
            return True  # lengths follow from the sizes
        return np.array_equal(self.lengths, other.lengths)

    def __eq__(self, other: object) -> bool:
        return self.same(other) if isinstance(other, ChunkTable) else NotImplemented

    def __hash__(self) -> int:
        return hash((self.keys, self.digests.raw))

    def __repr__(self) -> str:
        return f"ChunkTable({len(self.keys)} items, {len(self.digests)} chunks)"

    def __reduce__(self) -> tuple[Any, ...]:
        if self.chunk_size is not None:
            return (ChunkTable, (self.keys, self.nbytes, None, None, self.digests, self.chunk_size))
        return (ChunkTable, (self.keys, self.nbytes, self.counts, self.lengths, self.digests))


def _checked_prefix(digests: Digests, prefix: bytes) -> bytes:
    """``prefix`` for ``digests``, its length and its first and last entries checked (a whole
    check would read every digest: what the prefix saves)."""
    n = len(digests)
    if len(prefix) != PREFIX_SIZE * n:
        raise ValueError(f"a prefix of {len(prefix)} bytes for {n} digests ({PREFIX_SIZE} bytes each)")
    if n:
        buf, at = digests.buffer
        for i in (0, n - 1):
            x = (at + i) * DIGEST_SIZE
            if prefix[PREFIX_SIZE * i : PREFIX_SIZE * (i + 1)] != buf[x : x + PREFIX_SIZE]:
                raise ValueError(f"prefix {i} is not the first {PREFIX_SIZE} bytes of digest {i}")
    return bytes(prefix)


@dataclass(frozen=True)
class RankChunks:
    """Everything one rank staged for a checkpoint, in its own item order, as one table."""

    rank: int
    host: str
    items: ChunkTable


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
    Iterating yields one :class:`ChunkRef` per chunk. Each column is a tuple, or (for runs
    of whole items of a :class:`ChunkTable`) a lazy sequence that reads the table and equals
    the tuple it stands for: a plan does not hold one object per item of a fully sharded job.
    """

    keys: Sequence[str] = ()
    starts: Sequence[int] = ()
    digests: Sequence[Sequence[str]] = ()
    lengths: Sequence[tuple[int, ...]] = ()

    def __iter__(self) -> Iterator[ChunkRef]:
        for key, start, digests, lengths in zip(
            self.keys, self.starts, self.digests, self.lengths, strict=True
        ):
            for i, (d, n) in enumerate(zip(digests, lengths, strict=True)):
                yield ChunkRef(d, key, start + i, n)

    def __len__(self) -> int:
        if isinstance(self.digests, ItemDigests):
            return self.digests.total()
        return sum(map(len, self.digests))

    @property
    def nbytes(self) -> int:
        if isinstance(self.lengths, ItemLengths):
            return self.lengths.total()
        return sum(map(sum, self.lengths))


class _Runs:
    """Chunks held as :class:`ChunkRuns` (``runs``), read as :class:`ChunkRef` s and counted in bytes."""

    runs: ChunkRuns

    @property
    def chunks(self) -> tuple[ChunkRef, ...]:
        return tuple(self.runs)

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


@dataclass(frozen=True)
class DrainAssignment(_Runs):
    """The chunks one rank writes to the shared tier, from its own staged state."""

    rank: int
    host: str
    runs: ChunkRuns


@dataclass(frozen=True)
class Transfer(_Runs):
    """One point-to-point stream of chunks, found in the *sender's* staged state."""

    src_rank: int
    dst_rank: int
    runs: ChunkRuns


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
        i = bisect_left(self.drains, rank, key=attrgetter("rank"))
        return self.drains[i] if i < len(self.drains) and self.drains[i].rank == rank else None

    def sends_from(self, rank: int) -> tuple[Transfer, ...]:
        get = attrgetter("src_rank")
        return self.transfers[
            bisect_left(self.transfers, rank, key=get) : bisect_right(self.transfers, rank, key=get)
        ]

    def receives_at(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.dst_rank == rank)

    def bytes_per_host(self) -> dict[str, int]:
        """Drain bytes per host (hosts that drain nothing are left out)."""
        out: dict[str, int] = {}
        for d in self.drains:
            out[d.host] = out.get(d.host, 0) + d.nbytes
        return out


__all__ = [
    "ChunkRef",
    "ChunkRuns",
    "ChunkTable",
    "Digests",
    "DrainAssignment",
    "GroupPlan",
    "ItemChunks",
    "RankChunks",
    "Transfer",
]
