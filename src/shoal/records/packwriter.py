"""The one way a pack is written: chunks streamed into one tier file, then its index.

Both packs of the save protocol go through :func:`write_pack`: a replica pack (chunks as they
arrive from a partner over the fabric, each verified before it is written) and a drain pack
(chunks straight from the DRAM slab to the shared tier, where contiguous chunks go out as one
view). The pack's whole-file BLAKE3 digest is computed in the same pass as the write, and the
index (``packs/<id>.idx``) is written only after the pack itself is whole on the tier: an
index never names bytes that are not there.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, pairwise

import blake3

from shoal import failpoints
from shoal.errors import FormatError
from shoal.format import layout
from shoal.format.chunking import verify
from shoal.format.names import check_identifier
from shoal.format.pack import PackEntry, PackIndex
from shoal.group.plan import ChunkRef
from shoal.tiers.base import Tier

__all__ = ["drain_parts", "slab_runs", "write_pack"]


def write_pack(
    tier: Tier,
    pack_id: str,
    chunks: Sequence[ChunkRef],
    views: Iterable[memoryview],
    *,
    what: str,
    rank: int,
    check: bool = False,
    failpoint: str | None = None,
) -> PackIndex:
    """Write the pack ``pack_id`` of ``chunks`` (in order) to ``tier``, then its index; return the index.

    ``views`` carry the chunks' bytes back to back: one view per chunk, or fewer, larger views
    that each cover several consecutive chunks (a run of a DRAM slab). With ``check`` there
    must be one view per chunk, and each is verified against its chunk's digest before it is
    written (:class:`~shoal.errors.ChecksumMismatch` naming ``what``, the chunk and the item).
    ``failpoint`` is hit between the pack and its index. The bytes must add up to the chunks'
    lengths exactly, or the write is abandoned (:class:`~shoal.errors.FormatError`) and nothing
    new is visible. Any error from ``views`` (a fabric receive) abandons the write the same way.
    """
    check_identifier(pack_id, "pack id")
    whole = blake3.blake3()

    entries, size = [], 0
    for ref in chunks:
        entries.append(PackEntry(ref.digest, size, ref.length))
        size += ref.length

    def stream() -> Iterator[memoryview]:
        # Raising in here aborts the tier's write: nothing partial becomes visible.
        total = 0
        for i, view in enumerate(views):
            if check:
                if i >= len(chunks):
                    raise FormatError(f"{what}: pack {pack_id} got more than its {len(chunks)} chunks")
                ref = chunks[i]
                verify(view, ref.digest, what=f"{what}: chunk {ref.index} of item {ref.key!r}")
            whole.update(view)
            total += view.nbytes
            yield view
        if total != size:
            raise FormatError(
                f"{what}: pack {pack_id} got {total} bytes for {len(chunks)} chunks of {size} bytes"
            )

    tier.write(layout.pack_path(pack_id), stream())
    if failpoint is not None:
        failpoints.hit(failpoint, rank=rank)
    index = PackIndex(pack_id, size, whole.hexdigest(), tuple(entries))
    tier.write(layout.index_path(pack_id), index.encode())
    return index


def slab_runs(base: memoryview, starts: Sequence[int], chunks: Sequence[ChunkRef]) -> Iterator[memoryview]:
    """Views of ``base`` (a slab) covering ``chunks`` in order, one per run of adjacent chunks.

    ``starts[i]`` is where chunk ``i`` begins in ``base``. A drain pack of many small items
    that lie back to back in the slab is then written with a few large writes instead of one
    per chunk.
    """
    run_start, run_end = -1, -1
    for ref, start in zip(chunks, starts, strict=True):
        if start == run_end:
            run_end += ref.length
            continue
        if run_end > run_start:
            yield base[run_start:run_end]
        run_start, run_end = start, start + ref.length
    if run_end > run_start:
        yield base[run_start:run_end]


def drain_parts(lengths: Sequence[int], *, pack_bytes: int) -> list[tuple[int, int]]:
    """Cut chunks of ``lengths`` (in order) into contiguous parts of about ``pack_bytes`` each.

    Returns ``(start, stop)`` index ranges that cover every chunk once, in order, none empty:
    as many parts as ``pack_bytes`` fits in the total (rounded, at least one, at most one per
    chunk), each of about equal bytes.
    """
    if pack_bytes < 1:
        raise ValueError(f"pack_bytes must be >= 1, got {pack_bytes}")
    total = sum(lengths)
    count = max(1, min(len(lengths), round(total / pack_bytes)))
    ends = list(accumulate(lengths))  # ends[k]: the bytes of chunks 0..k
    cuts = [0]
    for j in range(1, count):
        # cut after the chunk where part j's share of the bytes is reached; leave a chunk for each later part
        at = bisect_left(ends, -(-total * j // count)) + 1
        cuts.append(max(cuts[-1] + 1, min(at, len(lengths) - (count - j))))
    cuts.append(len(lengths))
    return list(pairwise(cuts))
