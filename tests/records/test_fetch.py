"""The one chunk fetcher: per-run reads, verified before any byte is placed, repair from the next source."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from shoal.errors import ChecksumMismatch, MissingFile, TierError
from shoal.format.chunking import digest
from shoal.records.fetch import ChunkRequest, ChunkSource, Fetcher, SourceFile, fetch_chunks
from shoal.tiers.base import Tier
from shoal.tiers.dram import DramTier
from shoal.tiers.local import PosixTier


class CountingTier(PosixTier):
    """A local tier that records every range read: ``(path, offset, nbytes)``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int, int]] = []

    def read_range_into(self, path: str, offset: int, out: memoryview) -> None:
        self.reads.append((path, offset, out.nbytes))
        super().read_range_into(path, offset, out)


Chunk = tuple[str, int, bytes]
"""(digest, offset in the pack, bytes)."""


def write_pack(tier: Tier, path: str, sizes: list[int], *, seed: int = 0) -> list[Chunk]:
    """A pack of chunks of ``sizes`` bytes back to back; returns each chunk."""
    rng = random.Random(seed)
    chunks, offset = [], 0
    for n in sizes:
        data = rng.randbytes(n)
        chunks.append((digest(data), offset, data))
        offset += n
    tier.write(path, b"".join(c[2] for c in chunks))
    return chunks


def flip(tier: PosixTier, path: str, offset: int) -> None:
    full = os.path.join(tier.root, path)
    with open(full, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def requests_for(chunks: list[Chunk], *files: SourceFile) -> tuple[list[ChunkRequest], list[bytearray]]:
    """One request per chunk, read from ``files`` in order (the same offsets in each); zeroed destinations."""
    outs = [bytearray(len(data)) for _, _, data in chunks]
    reqs = [
        ChunkRequest(d, len(data), [memoryview(out)], [ChunkSource(f, off) for f in files], f"chunk #{i}")
        for i, ((d, off, data), out) in enumerate(zip(chunks, outs, strict=True))
    ]
    return reqs, outs


@pytest.fixture
def tier(tmp_path: Path) -> CountingTier:
    return CountingTier(tmp_path / "tier")


def test_contiguous_chunks_of_one_pack_are_read_with_one_read(tier: CountingTier) -> None:
    chunks = write_pack(tier, "packs/a.pack", [1024] * 200)
    reqs, outs = requests_for(chunks, SourceFile(tier, "packs/a.pack", kind="local"))
    random.Random(1).shuffle(reqs)  # the order asked in does not matter: runs follow the file
    outs_by_digest = {r.digest: r.dests[0] for r in reqs}
    result = fetch_chunks(reqs, lend=False)  # the read path (a host tier would lend its files)
    assert tier.reads == [("packs/a.pack", 0, 200 * 1024)]
    assert result.reads == 1 and result.bytes_read == 200 * 1024
    assert result.used == [0] * 200 and result.failures == {} and result.lost == []
    assert result.bytes_by_kind == {"local": 200 * 1024}
    for d, _, data in chunks:
        assert bytes(outs_by_digest[d]) == data
    assert len(outs) == 200


def test_runs_break_at_gaps_between_files_and_at_max_run(tier: CountingTier) -> None:
    a = write_pack(tier, "packs/a.pack", [1000] * 30)
    b = write_pack(tier, "packs/b.pack", [1000] * 5, seed=1)
    fa, fb = SourceFile(tier, "packs/a.pack"), SourceFile(tier, "packs/b.pack")
    wanted = a[:10] + a[11:30]  # chunk 10 is not asked for: a gap
    reqs, outs = requests_for(wanted, fa)
    reqs_b, outs_b = requests_for(b, fb)
    result = Fetcher(max_run=12_000, lend=False).fetch(reqs + reqs_b)
    a_reads = sorted(r for r in tier.reads if r[0] == "packs/a.pack")
    assert a_reads == [
        ("packs/a.pack", 0, 10_000),
        ("packs/a.pack", 11_000, 12_000),
        ("packs/a.pack", 23_000, 7_000),
    ]
    assert [r for r in tier.reads if r[0] == "packs/b.pack"] == [("packs/b.pack", 0, 5000)]
    assert result.reads == 4 and result.lost == []
    assert [bytes(o) for o in outs + outs_b] == [c[2] for c in wanted + b]


def test_a_chunk_longer_than_max_run_is_read_alone(tier: CountingTier) -> None:
    chunks = write_pack(tier, "packs/a.pack", [100, 5000, 100, 100])
    reqs, outs = requests_for(chunks, SourceFile(tier, "packs/a.pack"))
    result = Fetcher(max_run=1000, lend=False).fetch(reqs)
    assert sorted(tier.reads) == [
        ("packs/a.pack", 0, 100),
        ("packs/a.pack", 100, 5000),
        ("packs/a.pack", 5100, 200),
    ]
    assert result.lost == [] and [bytes(o) for o in outs] == [c[2] for c in chunks]


def test_a_corrupt_chunk_is_repaired_from_the_next_source_and_the_failure_recorded(
    tier: CountingTier,
) -> None:
    chunks = write_pack(tier, "packs/a.pack", [512] * 8)
    write_pack(tier, "packs/b.pack", [512] * 8)  # the same bytes: a second copy
    flip(tier, "packs/a.pack", 3 * 512 + 100)
    primary = SourceFile(tier, "packs/a.pack", kind="local", label="local tier")
    backup = SourceFile(tier, "packs/b.pack", kind="shared")
    reqs, outs = requests_for(chunks, primary, backup)
    result = fetch_chunks(reqs, lend=False)  # the read path (a host tier would lend its files)
    assert [bytes(o) for o in outs] == [c[2] for c in chunks]
    assert result.used == [0, 0, 0, 1, 0, 0, 0, 0]
    assert result.bytes_by_kind == {"local": 7 * 512, "shared": 512}
    (failure,) = result.failures[3]
    assert failure.source == ChunkSource(primary, 3 * 512) and isinstance(failure.error, ChecksumMismatch)
    text = str(failure.error)
    assert text.startswith(f"chunk #3 read from pack {tier.url}/packs/a.pack at offset 1536 (local tier): ")
    assert f"expected {chunks[3][0]}" in text and "BLAKE3 digest is " in text
    assert failure.describe().startswith("ChecksumMismatch: chunk #3 read from pack")
    # one run from the primary; the repair reads only the chunk that failed
    assert tier.reads == [("packs/a.pack", 0, 8 * 512), ("packs/b.pack", 1536, 512)]


def test_a_missing_file_sends_every_chunk_to_its_next_source(tier: CountingTier) -> None:
    chunks = write_pack(tier, "packs/b.pack", [256] * 4)
    gone = SourceFile(tier, "packs/gone.pack")
    reqs, outs = requests_for(chunks, gone, SourceFile(tier, "packs/b.pack"))
    result = fetch_chunks(reqs, lend=False)  # the read path (a host tier would lend its files)
    assert [bytes(o) for o in outs] == [c[2] for c in chunks] and result.used == [1] * 4
    for i in range(4):
        (failure,) = result.failures[i]
        assert isinstance(failure.error, MissingFile) and failure.source == ChunkSource(gone, i * 256)
        assert failure.describe().startswith(
            f"pack {tier.url}/packs/gone.pack at offset {i * 256}: MissingFile: "
        )


def test_a_truncated_pack_loses_only_the_chunks_past_its_end(tier: CountingTier) -> None:
    chunks = write_pack(tier, "packs/a.pack", [300] * 6)
    write_pack(tier, "packs/b.pack", [300] * 6)
    full = os.path.join(tier.root, "packs/a.pack")
    os.truncate(full, 4 * 300 + 10)  # chunks 0-3 whole, 4 cut short, 5 gone
    reqs, outs = requests_for(chunks, SourceFile(tier, "packs/a.pack"), SourceFile(tier, "packs/b.pack"))
    result = fetch_chunks(reqs, lend=False)  # the read path (a host tier would lend its files)
    assert [bytes(o) for o in outs] == [c[2] for c in chunks]
    assert result.used == [0, 0, 0, 0, 1, 1]
    assert sorted(result.failures) == [4, 5]
    assert all(isinstance(result.error(i), TierError) for i in (4, 5))  # a short read
    # the run failed, then each chunk was read alone; the two short ones came from the copy
    assert tier.reads[0] == ("packs/a.pack", 0, 1800) and len(tier.reads) == 1 + 6 + 1
    assert result.reads == 4 + 1


def test_with_every_copy_bad_the_chunk_is_lost_and_its_destination_untouched(tier: CountingTier) -> None:
    chunks = write_pack(tier, "packs/a.pack", [128] * 3)
    write_pack(tier, "packs/b.pack", [128] * 3)
    flip(tier, "packs/a.pack", 128 + 5)
    flip(tier, "packs/b.pack", 128 + 6)
    reqs, outs = requests_for(
        chunks,
        SourceFile(tier, "packs/a.pack"),
        SourceFile(tier, "packs/b.pack"),
        SourceFile(tier, "packs/x"),
    )
    no_source = ChunkRequest(chunks[0][0], 128, [memoryview(bytearray(128))], [])
    result = fetch_chunks([*reqs, no_source], lend=False)
    assert result.lost == [1, 3] and result.used == [0, None, 0, None]
    assert bytes(outs[1]) == bytes(128)  # never the bad bytes of either copy
    assert [type(f.error) for f in result.failures[1]] == [ChecksumMismatch, ChecksumMismatch, MissingFile]
    assert isinstance(result.error(1), MissingFile) and result.error(3) is None and 3 not in result.failures
    assert bytes(outs[0]) == chunks[0][2] and bytes(outs[2]) == chunks[2][2]


def test_bytes_are_read_into_scratch_and_placed_only_after_the_check(tier: CountingTier) -> None:
    chunks = write_pack(tier, "packs/a.pack", [64] * 4)
    flip(tier, "packs/a.pack", 2 * 64)
    reqs, outs = requests_for(chunks, SourceFile(tier, "packs/a.pack"))
    seen: list[tuple[int, bytes]] = []

    def on_read(file: SourceFile, offset: int, view: memoryview) -> None:
        assert all(o == bytes(64) for o in outs)  # the destinations hold nothing yet
        seen.append((offset, bytes(view)))

    result = Fetcher(on_read=on_read, lend=False).fetch(reqs)
    assert seen == [
        (
            0,
            b"".join(c[2] for c in chunks[:2])
            + bytes([chunks[2][2][0] ^ 1])
            + chunks[2][2][1:]
            + chunks[3][2],
        )
    ]
    assert result.lost == [2] and bytes(outs[2]) == bytes(64)
    assert [bytes(o) for i, o in enumerate(outs) if i != 2] == [c[2] for i, c in enumerate(chunks) if i != 2]


def test_every_destination_of_a_chunk_gets_it_and_none_means_verify_only(tier: CountingTier) -> None:
    (chunk,) = write_pack(tier, "packs/a.pack", [1000])
    d, off, data = chunk
    item = bytearray(3000)
    src = [ChunkSource(SourceFile(tier, "packs/a.pack"), off)]
    dests = [memoryview(item)[0:1000], memoryview(item)[2000:3000]]
    result = fetch_chunks([ChunkRequest(d, 1000, dests, src), ChunkRequest(d, 1000, [], src)])
    assert result.used == [0, 0]
    assert item == data + bytes(1000) + data


def test_slabs_are_read_from_a_slab_store_and_refused_elsewhere(shm_path: Path, tier: CountingTier) -> None:
    dram = DramTier(shm_path / "dram")
    try:
        slab = dram.open_slab("r0-1-slot-0", 4096)
        payload = os.urandom(2048)
        slab.buffer[100 : 100 + 2048] = payload
        slab.close()
        d = digest(payload[1024:])
        good = ChunkSource(SourceFile(dram, "r0-1-slot-0", slab=True, kind="dram"), 1124)
        not_a_store = ChunkSource(SourceFile(tier, "r0-1-slot-0", slab=True), 1124)
        out = bytearray(1024)
        result = fetch_chunks([ChunkRequest(d, 1024, [memoryview(out)], [not_a_store, good])])
        assert out == payload[1024:] and result.used == [1] and result.bytes_by_kind == {"dram": 1024}
        (failure,) = result.failures[0]
        assert isinstance(failure.error, TierError) and "holds no staging slabs" in str(failure.error)
        assert good.describe() == f"slab r0-1-slot-0 of {dram.url} at offset 1124"
    finally:
        dram.close()


@pytest.mark.parametrize("open_here", [False, True], ids=["another process's slab", "this process's slab"])
def test_a_mapped_slab_is_verified_where_it_lies_and_copied_once(
    shm_path: Path, tier: CountingTier, open_here: bool
) -> None:
    """A slab of the DRAM tier is lent, not read: each chunk is checked in the mapping (this
    process's own when it has the slab open) and copied into its destination; a corrupt chunk
    leaves its destination untouched and is taken from the next source, and a chunk past the
    slab's end fails like a short read."""
    dram = DramTier(shm_path / "dram")
    try:
        sizes = [4096, 8192, 1000, 70_000]
        slab = dram.open_slab("r0-1-slot-0", sum(sizes))
        pack = write_pack(tier, "p.pack", sizes, seed=3)
        for _, off, data in pack:
            slab.buffer[off : off + len(data)] = data
        slab.buffer[4096 + 10] ^= 0xFF  # chunk 1 is corrupt in the slab, good in the pack
        if not open_here:
            slab.close()
        in_slab = SourceFile(dram, "r0-1-slot-0", slab=True, kind="dram")
        reqs, outs = requests_for(pack, in_slab, SourceFile(tier, "p.pack"))
        fetcher = Fetcher()
        result = fetcher.fetch(reqs)
        assert [bytes(o) for o in outs] == [data for _, _, data in pack]
        assert (
            result.used == [0, 1, 0, 0] and tier.reads == []
        )  # the repair took the host tier's pack, lent too
        assert result.bytes_by_kind == {"dram": sum(sizes) - 8192, "": 8192}
        assert isinstance(result.failures[1][0].error, ChecksumMismatch)
        assert result.verify_seconds > 0 and result.copy_seconds > 0
        assert not fetcher._maps and fetcher._checker is None  # nothing held after the fetch

        only_slab, only_outs = requests_for(pack[1:2], in_slab)
        only_outs[0][:] = b"\x07" * 8192
        assert Fetcher().fetch(only_slab).lost == [0]
        assert only_outs[0] == b"\x07" * 8192  # a chunk that failed its check never reaches its destination

        past_end = ChunkSource(in_slab, 20_000)  # 70,000 bytes from there run past the slab's end
        short = Fetcher().fetch(
            [ChunkRequest(pack[3][0], 70_000, [memoryview(bytearray(70_000))], [past_end])]
        )
        assert short.lost == [0] and isinstance(short.failures[0][0].error, TierError)
        assert "ends at byte" in str(short.failures[0][0].error)
        absent = ChunkSource(SourceFile(dram, "nope", slab=True), 0)
        gone = Fetcher().fetch([ChunkRequest(pack[0][0], 4096, [], [absent])])
        assert gone.lost == [0] and isinstance(gone.failures[0][0].error, MissingFile)
    finally:
        dram.close()


def test_large_chunks_of_a_lent_run_are_checked_ahead_in_a_helper_thread(tier: CountingTier) -> None:
    """Chunks of 1 MiB and more: the next one's digest is checked while this one is copied; a
    corrupt one among them still fails alone and never reaches its destination."""
    mib = 1 << 20
    pack = write_pack(tier, "big.pack", [mib, mib + 7, mib], seed=4)
    flip(tier, "big.pack", mib + 100)  # the second chunk
    reqs, outs = requests_for(pack, SourceFile(tier, "big.pack"))
    fetcher = Fetcher()
    result = fetcher.fetch(reqs)
    assert result.used == [0, None, 0] and isinstance(result.failures[1][0].error, ChecksumMismatch)
    assert bytes(outs[0]) == pack[0][2] and bytes(outs[2]) == pack[2][2] and outs[1] == bytes(mib + 7)
    assert fetcher._checker is None  # the helper thread is gone with the fetch


def test_a_host_tiers_pack_is_lent_and_a_kept_chunk_is_its_own_bytes(tier: CountingTier) -> None:
    """A pack of a host tier is mapped, not read: its chunks are verified where they lie; one that
    only has to be kept (to send on) comes back as the pack's own bytes, read-only, no copy; a
    truncated pack still loses only the chunks past its end."""
    pack = write_pack(tier, "p.pack", [5000, 6000, 7000], seed=9)
    reqs, outs = requests_for(pack, SourceFile(tier, "p.pack"))
    reqs[2] = ChunkRequest(reqs[2].digest, 7000, [], reqs[2].sources, "chunk #2", keep=True)
    result = fetch_chunks(reqs)
    assert tier.reads == [] and result.used == [0, 0, 0]
    assert [bytes(o) for o in outs[:2]] == [pack[0][2], pack[1][2]]
    kept = result.kept[2]
    assert kept.readonly and bytes(kept) == pack[2][2] and list(result.kept) == [2]
    del kept, result

    with open(os.path.join(tier.root, "p.pack"), "r+b") as f:
        f.truncate(5000 + 6000 + 10)  # the last chunk is cut short
    reqs, outs = requests_for(pack, SourceFile(tier, "p.pack"))
    result = fetch_chunks(reqs)
    assert result.used == [0, 0, None] and [bytes(o) for o in outs[:2]] == [pack[0][2], pack[1][2]]
    assert "a short file" in str(result.failures[2][0].error) and outs[2] == bytes(7000)


def test_a_kept_chunk_read_into_the_scratch_buffer_is_a_copy_of_its_own(tier: CountingTier) -> None:
    pack = write_pack(tier, "p.pack", [3000, 3000], seed=5)
    fetcher = Fetcher(lend=False)
    first = fetcher.fetch(
        [ChunkRequest(pack[0][0], 3000, [], [ChunkSource(SourceFile(tier, "p.pack"), 0)], keep=True)]
    )
    fetcher.fetch([ChunkRequest(pack[1][0], 3000, [], [ChunkSource(SourceFile(tier, "p.pack"), 3000)])])
    assert bytes(first.kept[0]) == pack[0][2]  # the scratch buffer was reused meanwhile: a copy was kept


def test_max_run_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_run"):
        Fetcher(max_run=0)


def test_a_direct_fetcher_reads_large_chunks_into_their_destination_and_repairs_a_bad_one(
    tmp_path: Path,
) -> None:
    """The restore's fetcher: no scratch copy for chunks of 1 MiB or more; a corrupt copy is read over."""
    first, second = CountingTier(tmp_path / "a"), CountingTier(tmp_path / "b")
    sizes = [1 << 20, 3 << 20, 1 << 20, 1000]  # the last one is small: through the scratch buffer
    chunks = write_pack(first, "packs/a.pack", sizes)
    write_pack(second, "packs/a.pack", sizes)
    flip(first, "packs/a.pack", chunks[1][1] + 12345)  # the 3 MiB chunk is damaged in the first copy
    reqs, outs = requests_for(
        chunks,
        SourceFile(first, "packs/a.pack", kind="shared"),
        SourceFile(second, "packs/a.pack", kind="local"),
    )
    extra = bytearray(sizes[2])
    reqs[2].dests = [reqs[2].dests[0], memoryview(extra)]  # a chunk two items share
    result = Fetcher(direct=True, lend=False).fetch(reqs)
    assert [bytes(o) for o in outs] == [c[2] for c in chunks] and bytes(extra) == chunks[2][2]
    assert result.used == [0, 1, 0, 0] and result.lost == []
    assert "ChecksumMismatch" in result.failures[1][0].describe()
    # each large chunk one read of its own, straight into its destination; the small one in a run
    assert first.reads == [
        ("packs/a.pack", 0, 1 << 20),
        ("packs/a.pack", 1 << 20, 3 << 20),
        ("packs/a.pack", 4 << 20, 1 << 20),
        ("packs/a.pack", 5 << 20, 1000),
    ]
    assert second.reads == [("packs/a.pack", 1 << 20, 3 << 20)]
    assert result.bytes_by_kind == {"shared": sum(sizes) - (3 << 20), "local": 3 << 20}


@pytest.mark.parametrize("direct", [False, True])
def test_each_chunk_is_handed_on_once_as_it_is_delivered_verified_never_before(
    tmp_path: Path, direct: bool
) -> None:
    """``on_delivered``: the restore sends a chunk on while it reads the next one."""
    first, second = CountingTier(tmp_path / "a"), CountingTier(tmp_path / "b")
    sizes = [1 << 20, 2000, 1 << 20, 3000]
    chunks = write_pack(first, "p.pack", sizes)
    write_pack(second, "p.pack", sizes)
    flip(first, "p.pack", chunks[0][1] + 7)  # the first chunk comes from the second copy, later
    reqs, outs = requests_for(chunks, SourceFile(first, "p.pack"), SourceFile(second, "p.pack"))
    reqs[3] = ChunkRequest(chunks[3][0], 3000, [], reqs[3].sources, keep=True)  # only others need it
    seen: list[tuple[int, bytes]] = []
    result = Fetcher(direct=direct, lend=False).fetch(
        reqs, on_delivered=lambda i, chunk: seen.append((i, bytes(chunk)))
    )
    assert [i for i, _ in seen] == [1, 2, 3, 0]  # as delivered: the repaired one last
    assert all(data == chunks[i][2] for i, data in seen)  # verified bytes, never the damaged copy
    assert bytes(result.kept[3]) == chunks[3][2]
    assert [bytes(o) for o in outs[:3]] == [c[2] for c in chunks[:3]]


@pytest.mark.parametrize("lend", [False, True])
def test_a_chunk_kept_to_send_on_unchecked_is_handed_back_as_read(tmp_path: Path, lend: bool) -> None:
    """``check=False``: the restore's reader of a chunk only others need leaves the check to them."""
    tier = CountingTier(tmp_path / "t")
    chunks = write_pack(tier, "p.pack", [2000, 3000])
    flip(tier, "p.pack", 2000 + 10)
    source = SourceFile(tier, "p.pack", kind="local")
    unchecked = ChunkRequest(chunks[1][0], 3000, [], [ChunkSource(source, 2000)], keep=True, check=False)
    checked = ChunkRequest(chunks[1][0], 3000, [], [ChunkSource(source, 2000)], keep=True)
    result = Fetcher(lend=lend).fetch([unchecked, checked])
    assert result.used == [0, None]
    assert bytes(result.kept[0]) != chunks[1][2] and len(result.kept[0]) == 3000  # the damaged bytes
    assert "ChecksumMismatch" in result.failures[1][0].describe()  # the same bytes, checked
    with pytest.raises(ValueError, match="checked where it is read"):
        ChunkRequest(chunks[0][0], 2000, [memoryview(bytearray(2000))], [], check=False)
