"""Fixed-size chunking and BLAKE3-256 digests.

An item's bytes are cut into chunks of ``chunk_size`` (the last one shorter); each
chunk is named by the hex BLAKE3-256 digest of its bytes. Equal bytes give equal
names, which is all deduplication needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import blake3

from shoal.errors import ChecksumMismatch

DEFAULT_CHUNK_SIZE = 4 << 20
HASH_NAME = "blake3-256"
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 1 << 30


def chunk_spans(nbytes: int, chunk_size: int) -> list[tuple[int, int]]:
    """Return ``(offset, length)`` of each chunk of an item of ``nbytes`` bytes.

    >>> chunk_spans(10, 4)
    [(0, 4), (4, 4), (8, 2)]
    >>> chunk_spans(0, 4)
    []
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be non-negative, got {nbytes}")
    return [(off, min(chunk_size, nbytes - off)) for off in range(0, nbytes, chunk_size)]


def digest(data: bytes | bytearray | memoryview) -> str:
    """Hex BLAKE3-256 digest of ``data``."""
    return blake3.blake3(data).hexdigest()


def expect_digest(
    actual: str, expected: str, what: str | Callable[[], str], *, said_by: str | None = None
) -> None:
    """Raise :class:`ChecksumMismatch` unless ``actual == expected``: the one digest check.

    ``what`` names the bytes and where they came from (for a chunk: the chunk, its item or
    key, and its source: tier url, pack or slab path and offset); it may be a function that
    returns it, so a hot loop builds the text only on a mismatch. The message gives both
    digests, and ``said_by`` (``"its commit record"``) when another record named the expected one.
    """
    if actual != expected:
        where = what() if callable(what) else what
        wanted = f"but {said_by} says {expected}" if said_by else f"expected {expected}"
        raise ChecksumMismatch(f"{where}: BLAKE3 digest is {actual}, {wanted}")


def verify(
    data: bytes | bytearray | memoryview,
    expected: str,
    what: str | Callable[[], str],
    *,
    said_by: str | None = None,
) -> None:
    """Raise :class:`ChecksumMismatch` unless ``data`` hashes to ``expected`` (see :func:`expect_digest`)."""
    expect_digest(digest(data), expected, what, said_by=said_by)


class Hasher:
    """Hashes many chunks on a small thread pool (BLAKE3 releases the GIL).

    One instance is owned by each pipeline; it holds no state between calls
    besides its pool. ``threads=1`` hashes inline.
    """

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads if threads > 0 else max(1, min(4, os.cpu_count() or 1))
        self._pool: Executor | None = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="shoal-hash") if self.threads > 1 else None
        )

    def hash_spans(self, buffer: memoryview, spans: Sequence[tuple[int, int]]) -> list[str]:
        """Digest of ``buffer[off:off+len]`` for each span, in order."""
        if self._pool is None or len(spans) < 2:
            return [digest(buffer[o : o + n]) for o, n in spans]
        return list(self._pool.map(lambda span: digest(buffer[span[0] : span[0] + span[1]]), spans))

    def hash_item(self, buffer: memoryview, chunk_size: int) -> list[str]:
        """Chunk digests of one item whose bytes are all of ``buffer``."""
        return self.hash_spans(buffer, chunk_spans(buffer.nbytes, chunk_size))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
