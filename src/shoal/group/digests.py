"""Chunk digests as raw bytes: 32 bytes a digest instead of one 64-character string each.

A rank of a large job reports thousands of BLAKE3-256 digests; the coordinator of 16,384 ranks
receives millions. As Python strings they cost about 110 bytes each to hold, a pickle opcode
each to exchange and a hash each to look up. :class:`Digests` keeps them as raw bytes: an
immutable sequence that yields hex strings (``len``, indexing, slicing, iteration, ``in``), so
code written for a tuple of hex strings keeps working, while the planner reads the bytes
directly (:meth:`Digests.words`) and never makes one Python object per chunk.

A :class:`Digests` may be a *view* of part of a larger buffer (one per rank, say): slicing
shares the buffer instead of copying it, and pickling sends the buffer once however many
views of it the pickled object holds (the pickle memo), with each view's bounds.

The module also holds the lazy columns that let a plan's :class:`~shoal.group.plan.ChunkRuns`
refer to whole items of a rank's report without one Python object per item.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

DIGEST_SIZE = 32
"""Bytes of one BLAKE3-256 digest."""

PREFIX_SIZE = 8
"""Bytes of a digest's prefix (:meth:`Digests.prefixes`): a key to sort by, never a digest."""


class Digests(Sequence[str]):
    """An immutable sequence of chunk digests, stored as raw bytes, read as lowercase hex strings.

    ``Digests(raw)`` takes ``32 * n`` bytes; :meth:`from_hex` takes hex strings. Equal to
    another :class:`Digests` with the same bytes, and to a tuple or list of the same hex
    strings (and hashes like that tuple, so both can key one dictionary).
    """

    __slots__ = ("_buf", "_count", "_hash", "_start")

    def __init__(self, raw: bytes | bytearray | memoryview = b"") -> None:
        buf = bytes(raw)
        if len(buf) % DIGEST_SIZE:
            raise ValueError(f"{len(buf)} bytes is not a whole number of {DIGEST_SIZE}-byte digests")
        self._buf, self._start, self._count = buf, 0, len(buf) // DIGEST_SIZE
        self._hash: int | None = None

    @classmethod
    def view(cls, buf: bytes, start: int, count: int) -> Digests:
        """Digests ``start``, ..., ``start + count - 1`` of ``buf`` (32 bytes each), without a copy."""
        if start < 0 or count < 0 or (start + count) * DIGEST_SIZE > len(buf):
            raise ValueError(f"digests {start}..{start + count} are not all in a {len(buf)}-byte buffer")
        out = cls.__new__(cls)
        out._buf, out._start, out._count, out._hash = buf, start, count, None
        return out

    @classmethod
    def from_hex(cls, digests: Iterable[str]) -> Digests:
        """The digests of ``digests``, hex strings of 64 characters each."""
        hexes = digests if isinstance(digests, (tuple, list)) else list(digests)
        joined = "".join(hexes)
        if len(joined) != 2 * DIGEST_SIZE * len(hexes) or any(len(h) != 2 * DIGEST_SIZE for h in hexes):
            raise ValueError(f"a digest is {2 * DIGEST_SIZE} hex characters")
        return cls(bytes.fromhex(joined))

    @classmethod
    def join(cls, parts: Iterable[Sequence[str]]) -> Digests:
        """The digests of ``parts`` back to back: a view of their buffer when they are consecutive
        views of one (what a rank's report holds), else a new buffer. Tuples of hex are parsed."""
        parts = list(parts)
        if not parts:
            return cls()
        if all(isinstance(p, Digests) for p in parts):
            views: list[Digests] = parts  # type: ignore[assignment]
            buf, start = views[0]._buf, views[0]._start
            at = start
            for v in views:
                if v._buf is not buf or v._start != at:
                    break
                at += v._count
            else:
                return cls.view(buf, start, at - start)
        return cls(b"".join(p.raw if isinstance(p, Digests) else bytes.fromhex("".join(p)) for p in parts))

    @property
    def raw(self) -> bytes:
        """The digests' bytes, back to back (the buffer itself when this view covers all of it)."""
        if self._start == 0 and self._count * DIGEST_SIZE == len(self._buf):
            return self._buf
        return self._buf[self._start * DIGEST_SIZE : (self._start + self._count) * DIGEST_SIZE]

    @property
    def buffer(self) -> tuple[bytes, int]:
        """The shared buffer and the index (in digests) of this view's first digest in it."""
        return self._buf, self._start

    def words(self) -> np.ndarray:
        """The digests as a read-only ``(n, 4)`` array of unsigned 64-bit words (no copy)."""
        return np.frombuffer(self._buf, np.uint64, 4 * self._count, self._start * DIGEST_SIZE).reshape(-1, 4)

    def prefixes(self) -> bytes:
        """The first :data:`PREFIX_SIZE` bytes of each digest, back to back: the planner's sort keys
        (see :attr:`~shoal.group.plan.ChunkTable.prefix`)."""
        return self.words()[:, 0].tobytes()

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Digests: ...
    def __getitem__(self, i: int | slice) -> str | Digests:
        if isinstance(i, slice):
            a, b, step = i.indices(self._count)
            if step != 1:
                return Digests.from_hex(list(self)[i])
            return Digests.view(self._buf, self._start + a, max(0, b - a))
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError("digest index out of range")
        at = (self._start + i) * DIGEST_SIZE
        return self._buf[at : at + DIGEST_SIZE].hex()

    def __iter__(self) -> Iterator[str]:
        text = self.raw.hex()
        step = 2 * DIGEST_SIZE
        return (text[i : i + step] for i in range(0, len(text), step))

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, str) or len(value) != 2 * DIGEST_SIZE:
            return False
        try:
            needle = bytes.fromhex(value)
        except ValueError:
            return False
        words = self.words()
        first = np.frombuffer(needle, np.uint64, 1)[0]
        return any(words[r].tobytes() == needle for r in np.flatnonzero(words[:, 0] == first).tolist())

    def tuple(self) -> builtins.tuple[str, ...]:
        """The digests as a tuple of hex strings."""
        return tuple(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Digests):
            return self._count == other._count and (
                (self._buf is other._buf and self._start == other._start) or self.raw == other.raw
            )
        if isinstance(other, (tuple, list)):
            return len(other) == self._count and tuple(self) == tuple(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self))
        return self._hash

    def __repr__(self) -> str:
        shown = ", ".join(repr(d[:12] + "...") for d in list(self[:3]))
        more = ", ..." if self._count > 3 else ""
        return f"Digests({self._count}: {shown}{more})"

    def __reduce__(self) -> builtins.tuple[Any, ...]:
        # The buffer travels once per pickle however many views share it (the pickle memo).
        return (Digests.view, (self._buf, self._start, self._count))


class _Column(Sequence[Any]):
    """A lazy sequence of per-item values of one rank's report, for items ``order[0]``, ...

    Equal to any sequence with equal elements (a tuple of the same values, say).
    """

    __slots__ = ("_order", "_table")

    def __init__(self, table: Any, order: Sequence[int]) -> None:
        self._table, self._order = table, order

    def __len__(self) -> int:
        return len(self._order)

    def _one(self, p: int) -> Any:
        raise NotImplementedError

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(map(self._one, self._order[i]))
        return self._one(self._order[i])

    def __iter__(self) -> Iterator[Any]:
        return map(self._one, self._order)

    def __eq__(self, other: object) -> bool:
        if (
            isinstance(other, _Column)
            and type(other) is type(self)
            and other._table is self._table
            and tuple(other._order) == tuple(self._order)
        ):
            return True
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} items)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._table, self._order))

    def counts(self) -> np.ndarray:
        """Chunks of each item, in order."""
        return np.asarray(self._table.counts)[np.asarray(self._order, dtype=np.int64)]


class ItemDigests(_Column):
    """Per item, its digests (a view of the rank's buffer): a run column of whole items."""

    __slots__ = ()

    def _one(self, p: int) -> Digests:
        return self._table.item_digests(p)

    def total(self) -> int:
        """Chunks in all the items."""
        return int(self.counts().sum())


class ItemLengths(_Column):
    """Per item, its chunk lengths (a tuple): a run column of whole items."""

    __slots__ = ()

    def _one(self, p: int) -> tuple[int, ...]:
        return self._table.item_lengths(p)

    def total(self) -> int:
        """Bytes in all the items."""
        return int(self._table.item_bytes[np.asarray(self._order, dtype=np.int64)].sum())


__all__ = ["DIGEST_SIZE", "PREFIX_SIZE", "Digests", "ItemDigests", "ItemLengths"]
