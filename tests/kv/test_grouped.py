"""Grouped reads across the ranks of one instance: bit-exact everywhere, each shared block read once,
misses and corrupt blocks the same outcome on every rank that wanted them, never a hang."""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shoal.group.fabric import Fabric
from shoal.kv.grouped import GroupedReader
from shoal.kv.store import KVStore
from shoal.testing.multiproc import run_ranks

# tests/kv is a package or a rootdir on sys.path, depending on whether it has an __init__.py
gw = importlib.import_module(f"{__package__}.grouped_workers" if __package__ else "grouped_workers")

TWO_HOSTS = ["h0", "h0", "h1", "h1"]
SHARED = list(range(20))
CORRUPT, MISSING = 20, 21
IN_H0_DRAM = [30, 31, 32, 33, 34]
LATE_BATCH = list(range(40, 48))
BATCH0 = [
    [*range(0, 12), CORRUPT, MISSING, 30, 31, 32, 33, 34],
    [*range(4, 16), CORRUPT, 30, 31, 34],
    [*range(8, 20), MISSING, 30, 31, 32, 33],
    [*range(0, 4), *range(16, 20), CORRUPT, 32, 33],
]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Four ranks on two hosts: batch 0 with overlapping wants, a corrupt block, a missing block and
    blocks in h0's DRAM pool; batch 1, every rank wanting the same blocks, rank 1 past its deadline."""
    root = str(tmp_path_factory.mktemp("grouped"))
    gw.seed_shared(root, [*SHARED, CORRUPT, *LATE_BATCH])
    gw.corrupt_shared(root, CORRUPT)
    gw.seed_dram(root, "h0", IN_H0_DRAM)
    batches = [BATCH0, [LATE_BATCH] * 4]
    kwargs = {"root": root, "batches": batches, "past_deadline": [[], [1]]}
    return run_ranks(gw.grouped_batches, hosts=TWO_HOSTS, kwargs=kwargs, timeout=300)  # generous: busy hosts


def _batch(ranks: list[dict[str, Any]], b: int) -> dict[tuple[int, int], tuple[Any, ...]]:
    """(rank, block) -> (status, reason, tier, bit-exact, error type) in batch ``b``."""
    return {(r, row[0]): row[1:] for r, out in enumerate(ranks) for row in out["batches"][b]["results"]}


def _sources(ranks: list[dict[str, Any]], b: int, wants: list[list[int]]) -> dict[tuple[int, int], int]:
    return {
        (r, i): src
        for r, out in enumerate(ranks)
        for i, src in zip(wants[r], out["batches"][b]["sources"], strict=True)
    }


def test_every_rank_gets_every_stored_block_bit_exact(two_hosts: list[dict[str, Any]]) -> None:
    got = _batch(two_hosts, 0)
    for r, wants in enumerate(BATCH0):
        for i in wants:
            if i in (CORRUPT, MISSING):
                continue
            status, _, tier, exact, _ = got[(r, i)]
            assert status == "hit" and exact, (r, i, got[(r, i)])
            assert tier == ("dram" if i in IN_H0_DRAM else "shared")


def test_each_distinct_block_is_read_from_the_slow_tier_once_across_the_instance(
    two_hosts: list[dict[str, Any]],
) -> None:
    # batch 0 reads SHARED once each; batch 1's blocks read by ranks in time (rank 1 was late)
    late_reads = sum(1 for i in LATE_BATCH if _sources(two_hosts, 1, [LATE_BATCH] * 4)[(0, i)] != 1)
    assert sum(out["shared_hits"] for out in two_hosts) == len(SHARED) + late_reads
    sizes = sum(gw.block_size(i) for i in SHARED)
    assert sum(out["shared_bytes"] for out in two_hosts) >= sizes
    sources = _sources(two_hosts, 0, BATCH0)
    readers = {i: {src for (_, j), src in sources.items() if j == i} for i in SHARED}
    assert all(len(s) == 1 for s in readers.values()), "every rank that wanted a block names one reader"


def test_a_block_missing_everywhere_is_a_miss_on_every_rank_that_wanted_it(
    two_hosts: list[dict[str, Any]],
) -> None:
    got = _batch(two_hosts, 0)
    for r in (0, 2):
        assert got[(r, MISSING)][:2] == ("miss", "absent")


def test_a_corrupt_block_at_its_reader_is_a_miss_everywhere_and_never_served(
    two_hosts: list[dict[str, Any]],
) -> None:
    got = _batch(two_hosts, 0)
    for r in (0, 1, 3):
        status, reason, _, exact, _ = got[(r, CORRUPT)]
        assert (status, reason, exact) == ("miss", "corrupt", False)


def test_a_block_in_a_hosts_dram_is_read_there_and_never_crosses_the_fabric_to_it(
    two_hosts: list[dict[str, Any]],
) -> None:
    sources = _sources(two_hosts, 0, BATCH0)
    for r in (0, 1):  # on h0, whose pool holds them: each reads its own from memory
        for i in IN_H0_DRAM:
            if i in BATCH0[r]:
                assert sources[(r, i)] == r
    for r in (2, 3):  # h1 gets them from an h0 rank's memory: no slow read anywhere
        for i in IN_H0_DRAM:
            if i in BATCH0[r]:
                assert sources[(r, i)] in (0, 1)
    h0_received = sum(out["stats"].blocks_received for out in two_hosts[:2])
    # h0's ranks receive only blocks of SHARED read by other ranks and the late batch's
    assert h0_received <= sum(1 for r in (0, 1) for i in BATCH0[r] if i in SHARED) + 2 * len(LATE_BATCH)


def test_a_rank_past_its_deadline_gets_misses_and_its_blocks_are_misses_everywhere(
    two_hosts: list[dict[str, Any]],
) -> None:
    got = _batch(two_hosts, 1)
    sources = _sources(two_hosts, 1, [LATE_BATCH] * 4)
    assert {got[(1, i)][:2] for i in LATE_BATCH} == {("miss", "deadline")}
    for r in (0, 2, 3):
        for i in LATE_BATCH:
            if sources[(r, i)] == 1:
                assert got[(r, i)][:2] == ("miss", "deadline")
            else:
                assert got[(r, i)][0] == "hit" and got[(r, i)][3]
    assert any(src == 1 for src in sources.values()), "rank 1 was a reader (balanced over all four)"


def test_bytes_damaged_on_the_fabric_are_a_miss_at_the_receiver_never_served(tmp_path: Path) -> None:
    root = str(tmp_path)
    blocks = list(range(50, 56))
    gw.seed_shared(root, [*blocks, 56, 57])
    batches = [[blocks] * 3, [[], [56], [57]]]
    kwargs = {"root": root, "batches": batches, "tamper_rank": 0}
    ranks = run_ranks(gw.grouped_batches, hosts=["h0", "h0", "h0"], kwargs=kwargs, timeout=300)
    got = _batch(ranks, 0)
    sources = _sources(ranks, 0, [blocks] * 3)
    assert {sources[(0, i)] for i in blocks} == {0, 1, 2}, "three readers share six blocks"
    for r in range(3):
        for i in blocks:
            status, reason, _, exact, error = got[(r, i)]
            if sources[(r, i)] == 0 and r != 0:
                assert (status, reason, exact, error) == ("miss", "corrupt", False, "ChecksumMismatch")
            else:
                assert status == "hit" and exact
    assert sum(out["stats"].corrupt_received for out in ranks) == 2 * sum(
        1 for i in blocks if sources[(0, i)] == 0
    )
    assert _batch(ranks, 1) == {
        (1, 56): ("hit", None, "shared", True, None),
        (2, 57): ("hit", None, "shared", True, None),
    }
    assert all(out["stats"].blocks_received == 4 for out in ranks[1:]), "batch 1 sent nothing"
    assert Counter(out["shared_hits"] for out in ranks) == Counter({3: 2, 2: 1})


def test_one_rank_reads_repeated_keys_once_and_copies_them(tmp_path: Path) -> None:
    root = str(tmp_path)
    gw.seed_shared(root, [1, 2])
    with KVStore(gw.config(root, "h0")) as store:
        reader = GroupedReader(store, Fabric(None, 0, 1), host="h0")
        wanted = [1, 2, 1, 9]
        buffers = [bytearray(gw.block_size(i)) for i in wanted]
        results = reader.get_batch_into([gw.block_key(i) for i in wanted], buffers)
        assert [r.status for r in results] == ["hit", "hit", "hit", "miss"]
        assert [bytes(b) == gw.block_bytes(i) for b, i in zip(buffers, wanted, strict=True)][:3] == [True] * 3
        assert store.stats().tiers["shared"].hits == 2
        assert reader.last_sources() == (0, 0, 0, 0)
        assert reader.stats().bytes_sent == 0


def test_a_bad_buffer_is_an_error_for_that_key_only(tmp_path: Path) -> None:
    root = str(tmp_path)
    gw.seed_shared(root, [1])
    with KVStore(gw.config(root, "h0")) as store:
        reader = GroupedReader(store, Fabric(None, 0, 1), host="h0")
        results = reader.get_batch_into(
            [gw.block_key(1), gw.block_key(2)], [bytearray(gw.block_size(1)), b"x"]
        )
        assert results[0].hit and results[1].status == "error"
        assert "read-only" in str(results[1].error)
        with pytest.raises(Exception, match="1 keys but 2 buffers"):
            reader.get_batch_into([gw.block_key(1)], [bytearray(1), bytearray(1)])
