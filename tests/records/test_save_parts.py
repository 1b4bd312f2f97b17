"""The save protocol's reusable parts: the pack writer, the manifest builder, the checkpoint commit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal import failpoints
from shoal.boundary import Boundary
from shoal.errors import ChecksumMismatch, FormatError, InvalidName, MissingFile, WriterFenced
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import ItemRecord, PackRecord, Stats, WorldInfo, decode_manifest, decode_pointer
from shoal.format.manifest_build import ManifestHeader, TierChunks, build_manifest
from shoal.format.pack import PackEntry, PackIndex, decode_index
from shoal.group.plan import ChunkRef
from shoal.records.commit import CheckpointCommit
from shoal.records.fence import WriterFence
from shoal.records.packwriter import drain_parts, slab_runs, write_pack
from shoal.tiers.local import PosixTier

PACK = "000000000003-node-0-r1-0a1b2c3d"
PAYLOADS = [b"alpha" * 10, b"", b"beta", b"gamma" * 3]


def _refs(payloads: list[bytes] = PAYLOADS) -> list[ChunkRef]:
    return [ChunkRef(digest(p), f"item{i}", 0, len(p)) for i, p in enumerate(payloads)]


@pytest.fixture
def tier(tmp_path) -> PosixTier:  # type: ignore[no-untyped-def]
    return PosixTier(str(tmp_path / "tier"))


# -- the pack writer ---------------------------------------------------------------------------
@pytest.mark.parametrize("check", [False, True])
def test_pack_and_index_round_trip(tier: PosixTier, check: bool) -> None:
    views = [memoryview(p) for p in PAYLOADS]
    index = write_pack(tier, PACK, _refs(), views, what="test", rank=0, check=check)
    data = tier.read(layout.pack_path(PACK))
    assert data == b"".join(PAYLOADS)
    assert index.size == len(data) and index.blake3 == digest(data)
    on_tier = decode_index(tier.read(layout.index_path(PACK)), "idx")
    assert on_tier == index
    for entry, payload in zip(index.entries, PAYLOADS, strict=True):
        assert entry.digest == digest(payload)
        assert data[entry.offset : entry.offset + entry.length] == payload


def test_pack_from_runs_of_a_slab(tier: PosixTier) -> None:
    """A drain pack: chunks that lie back to back in the slab go out as one view per run."""
    slab = bytearray(b"....") + b"".join(PAYLOADS) + b"xxxx" + b"tail"
    base = memoryview(slab)
    payloads = [*PAYLOADS, b"tail"]
    starts, pos = [], 4
    for p in PAYLOADS:
        starts.append(pos)
        pos += len(p)
    starts.append(pos + 4)  # after a gap
    refs = _refs(payloads)
    runs = list(slab_runs(base, starts, refs))
    assert [bytes(r) for r in runs] == [b"".join(PAYLOADS), b"tail"]
    index = write_pack(tier, PACK, refs, runs, what="drain", rank=0)
    assert tier.read(layout.pack_path(PACK)) == b"".join(payloads)
    assert [e.length for e in index.entries] == [len(p) for p in payloads]


def test_a_corrupt_chunk_leaves_no_pack_and_no_index(tier: PosixTier) -> None:
    views = [memoryview(p) for p in PAYLOADS]
    views[2] = memoryview(b"BETA")
    with pytest.raises(ChecksumMismatch, match=r"replica: chunk 0 of item 'item2'"):
        write_pack(tier, PACK, _refs(), views, what="replica", rank=0, check=True)
    assert tier.list() == []


@pytest.mark.parametrize("views", [[b"alpha" * 10], [*PAYLOADS, b"more"]])
def test_bytes_that_do_not_add_up_are_refused(tier: PosixTier, views: list[bytes]) -> None:
    with pytest.raises(FormatError, match="pack 000000000003"):
        write_pack(tier, PACK, _refs(), [memoryview(v) for v in views], what="drain", rank=0)
    assert tier.list() == []


def test_a_failing_stream_leaves_nothing(tier: PosixTier) -> None:
    def stream() -> Iterator[memoryview]:
        yield memoryview(PAYLOADS[0])
        raise RuntimeError("peer went away")

    with pytest.raises(RuntimeError, match="peer went away"):
        write_pack(tier, PACK, _refs(), stream(), what="replica", rank=0, check=True)
    assert tier.list() == []


def test_the_index_comes_after_the_pack(tier: PosixTier) -> None:
    failpoints.configure("test.after_pack=raise")
    try:
        with pytest.raises(failpoints.InjectedFault):
            write_pack(
                tier, PACK, _refs(), map(memoryview, PAYLOADS), what="t", rank=0, failpoint="test.after_pack"
            )
    finally:
        failpoints.configure(None)
    assert tier.exists(layout.pack_path(PACK)) and not tier.exists(layout.index_path(PACK))


@pytest.mark.parametrize("pack_id", ["../x", "", "a/b", ".p"])
def test_unsafe_pack_ids_are_refused(tier: PosixTier, pack_id: str) -> None:
    with pytest.raises(InvalidName):
        write_pack(tier, pack_id, [], [], what="t", rank=0)


# -- the manifest builder ----------------------------------------------------------------------
HEADER = ManifestHeader(
    job="j", step=3, created=1.0e9, chunk_size=4096, world=WorldInfo(1, ("h",), 1),
    stats=Stats(10, 10, 10), shoal_version="test", run="r" * 16, path="direct",
)  # fmt: skip


def _holdings(payloads: list[bytes], pack: str) -> TierChunks:
    entries, off = [], 0
    for p in payloads:
        entries.append(PackEntry(digest(p), off, len(p)))
        off += len(p)
    return TierChunks.of_packs([PackIndex(pack, off, digest(b"".join(payloads)), tuple(entries))])


def test_every_chunk_is_located_in_the_first_holding_that_has_it() -> None:
    a, b, c = b"a" * 4096, b"b" * 4096, b"c"
    new, old = _holdings([a, b], "new"), _holdings([b, c], "old")
    items = [
        ItemRecord("x", 0, "bytes", 8192, (digest(a), digest(b))),
        ItemRecord("y", 0, "bytes", 1, (digest(c),)),
    ]
    m = build_manifest(HEADER, items, [new, old])
    assert m.locations[digest(b)].pack == "new" and m.locations[digest(c)].pack == "old"
    assert set(m.packs) == {"new", "old"} and m.step == 3 and m.path == "direct"
    assert decode_manifest(m.encode(), "m") == m


def test_only_referenced_packs_are_recorded() -> None:
    new, old = _holdings([b"a"], "new"), _holdings([b"z"], "old")
    m = build_manifest(HEADER, [ItemRecord("x", 0, "bytes", 1, (digest(b"a"),))], [new, old])
    assert set(m.packs) == {"new"}


def test_a_chunk_no_pack_holds_fails_a_full_manifest_and_is_left_out_of_a_partial_one() -> None:
    items = [ItemRecord("x", 0, "bytes", 2, (digest(b"a"), digest(b"q")))]
    with pytest.raises(FormatError, match=r"step 3: chunk 1 of item 'x'"):
        build_manifest(HEADER, items, [_holdings([b"a"], "new")])
    partial = build_manifest(HEADER, items, [_holdings([b"a"], "new")], partial=True)
    assert partial.partial and list(partial.locations) == [digest(b"a")]
    assert partial.items["x"].chunks == items[0].chunks


def test_header_of_a_manifest_rebuilds_it() -> None:
    m = build_manifest(HEADER, [ItemRecord("x", 0, "bytes", 1, (digest(b"a"),))], [_holdings([b"a"], "p")])
    again = build_manifest(ManifestHeader.of(m), list(m.items.values()), [TierChunks(m.locations, m.packs)])
    assert again == m


# -- the checkpoint commit ---------------------------------------------------------------------
def _committable(tier: PosixTier) -> tuple[bytes, dict[str, PackRecord]]:
    index = write_pack(tier, PACK, _refs(), map(memoryview, PAYLOADS), what="t", rank=0)
    packs = {PACK: PackRecord(index.size, index.blake3)}
    items = [ItemRecord(f"item{i}", 0, "bytes", len(p), (digest(p),)) for i, p in enumerate(PAYLOADS)]
    manifest = build_manifest(HEADER, items, [TierChunks.of_packs([index])])
    return manifest.encode(), packs


def test_commit_writes_manifest_commit_then_latest(tier: PosixTier) -> None:
    data, packs = _committable(tier)
    writes: list[str] = []
    fence = WriterFence.claim(tier, host="h", pid=1)
    commit = CheckpointCommit(tier, fence, 3, rank=0, record=lambda what, *_: writes.append(what))
    commit.commit(data, packs)
    assert writes == ["manifest", "commit", "latest"] and commit.reached == Boundary.RESTARTABLE
    assert tier.read(layout.manifest_path(3)) == data
    pointer = decode_pointer(tier.read(layout.LATEST), "LATEST")
    assert pointer.step == 3 and pointer.manifest_blake3 == digest(data)


def test_commit_writes_nothing_over_a_missing_pack(tier: PosixTier) -> None:
    data, packs = _committable(tier)
    tier.delete(layout.pack_path(PACK))
    commit = CheckpointCommit(tier, WriterFence.claim(tier, host="h", pid=1), 3, rank=0)
    with pytest.raises(MissingFile, match="step 3 not committed"):
        commit.commit(data, packs)
    assert commit.reached is None and not tier.exists(layout.manifest_path(3))


def test_a_fenced_writer_commits_nothing(tier: PosixTier) -> None:
    data, packs = _committable(tier)
    mine = WriterFence.claim(tier, host="h", pid=1)
    WriterFence.claim(tier, host="other", pid=2)
    with pytest.raises(WriterFenced):
        CheckpointCommit(tier, mine, 3, rank=0).commit(data, packs)
    assert not tier.exists(layout.manifest_path(3))


def test_latest_that_cannot_move_takes_the_commit_record_back(tier: PosixTier) -> None:
    data, packs = _committable(tier)
    commit = CheckpointCommit(tier, WriterFence.claim(tier, host="h", pid=1), 3, rank=0)
    failpoints.configure("pipeline.before_latest=raise")
    try:
        with pytest.raises(failpoints.InjectedFault):
            commit.commit(data, packs)
    finally:
        failpoints.configure(None)
    assert commit.reached == Boundary.PERSISTED
    assert tier.exists(layout.manifest_path(3))
    assert not tier.exists(layout.commit_path(3)) and not tier.exists(layout.LATEST)


# -- the drain's packs ------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=60),
    pack_bytes=st.integers(4096, 8 << 20),
)
def test_drain_parts_cover_every_chunk_once_in_order_in_about_equal_packs(lengths, pack_bytes):
    parts = drain_parts(lengths, pack_bytes=pack_bytes)
    assert parts[0][0] == 0 and parts[-1][1] == len(lengths)
    assert all(lo < hi for lo, hi in parts)
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    total = sum(lengths)
    assert len(parts) == max(1, min(len(lengths), round(total / pack_bytes)))
    if len(parts) > 1:  # each part within one chunk of an equal share
        share, longest = total / len(parts), max(lengths)
        for lo, hi in parts:
            assert abs(sum(lengths[lo:hi]) - share) <= 2 * longest


def test_a_small_share_is_one_pack_and_a_large_one_many():
    chunk = 256 << 10
    assert drain_parts([chunk] * 8, pack_bytes=16 << 20) == [(0, 8)]
    assert drain_parts([chunk] * 64, pack_bytes=2 << 20) == [(i, i + 8) for i in range(0, 64, 8)]


def test_drain_parts_refuses_a_pack_size_below_one():
    with pytest.raises(ValueError, match="pack_bytes"):
        drain_parts([1, 2], pack_bytes=0)
