"""KVStore end to end: bit-exact round trips from every tier, idempotent puts, prefixes, removal,
buffer types and sizes, events and statistics."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shoal.errors import ConfigError, StateError
from shoal.kv import BlockSizeError, KVConfig, KVEvent, KVStore

from .kv_workers import BLOCK, PHYS, keys, payload

TIER_SETUPS = ["dram", "dram+local", "dram+shared", "dram+local+shared", "dram+s3"]


def _config(setup: str, shm: Path, tmp: Path, request: pytest.FixtureRequest, dram_blocks: int) -> KVConfig:
    kwargs: dict[str, Any] = {}
    if "local" in setup:
        kwargs["local_root"] = str(tmp / "local")
    if "shared" in setup:
        kwargs["shared_url"] = str(tmp / "shared")
    if "s3" in setup:
        kwargs["shared_url"] = request.getfixturevalue("s3_url")
        kwargs["storage_options"] = request.getfixturevalue("s3_options")
    return KVConfig(str(shm / "pool"), dram_blocks * PHYS, high_water=1.0, **kwargs)


@pytest.mark.parametrize("setup", TIER_SETUPS)
def test_round_trip_is_bit_exact_from_every_tier(
    setup: str, shm_path: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    small = setup != "dram"  # a pool of 2 blocks: the rest is evicted to the lower tiers
    cfg = _config(setup, shm_path, tmp_path, request, 2 if small else 16)
    ks = keys(6)
    lowest = setup.rsplit("+", 1)[-1].replace("s3", "shared")
    with KVStore(cfg) as store:
        for i, k in enumerate(ks):
            r = store.put_batch([k], [payload(i)])[0]
            assert (r.stored, r.tier, r.error) == (True, "dram", None)
        store.flush(60)
        bufs = [bytearray(BLOCK) for _ in ks]
        results = store.get_batch_into(ks, bufs)
        assert all(r.hit and r.nbytes == BLOCK for r in results), results
        assert all(buf == payload(i) for i, buf in enumerate(bufs))
        first_tier = "local" if "local" in setup else lowest
        assert results[0].tier == first_tier and results[-1].tier == "dram"
        store.flush(60)  # promotions landed; a second read is still exact
        bufs = [bytearray(BLOCK) for _ in ks]
        assert all(r.hit for r in store.get_batch_into(ks, bufs))
        assert all(buf == payload(i) for i, buf in enumerate(bufs))


def test_local_evictions_spill_to_the_shared_tier(shm_path: Path, tmp_path: Path) -> None:
    cfg = KVConfig(
        str(shm_path / "pool"), 2 * PHYS, local_root=str(tmp_path / "l"), local_bytes=2 * PHYS,
        shared_url=str(tmp_path / "s"), high_water=1.0,
    )  # fmt: skip
    ks = keys(8)
    with KVStore(cfg) as store:
        for i, k in enumerate(ks):
            store.put_batch([k], [payload(i)])
        store.flush(60)
        assert store.contains(ks[0]) == "shared" and store.stats().tiers["local"].bytes_used <= 2 * PHYS
        buf = bytearray(BLOCK)
        assert store.get_batch_into(ks[:1], [buf])[0].tier == "shared" and buf == payload(0)


def test_put_is_idempotent_and_deduplicated(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 16 * PHYS)) as store:
        ks = keys(3)
        first = store.put_batch(ks, [payload(i) for i in range(3)])
        assert [r.stored for r in first] == [True] * 3
        again = store.put_batch([ks[0], ks[1], ks[1]], [payload(0), payload(1), payload(1)])
        assert [(r.stored, r.tier) for r in again] == [(False, "dram")] * 3
        dup = store.put_batch([keys(4)[3], keys(4)[3]], [payload(3), payload(3)])
        assert [r.stored for r in dup] == [True, False]
        assert store.stats().tiers["dram"].blocks == 4
        assert store.stats().tiers["dram"].bytes_used == 4 * PHYS


def test_lookup_prefix_counts_the_longest_stored_prefix(shm_path: Path, tmp_path: Path) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 3 * PHYS, shared_url=str(tmp_path / "s"), high_water=1.0)
    ks = keys(10)
    with KVStore(cfg) as store:
        assert store.lookup_prefix(ks) == 0
        for i in range(5):
            store.put_batch([ks[i]], [payload(i)])
        store.flush(60)
        assert store.contains(ks[0]) == "shared"  # found on the shared tier, too
        assert store.lookup_prefix(ks) == 5
        store.put_batch([ks[7]], [payload(7)])
        assert store.lookup_prefix(ks) == 5  # a later block does not extend the prefix
        assert store.remove([ks[2]]) == 1
        assert store.lookup_prefix(ks) == 2
        assert store.lookup_prefix([]) == 0


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The digests every store asks its shared tier about (``SharedBlocks.exists``), in order."""
    from shoal.kv.lower import SharedBlocks

    seen: list[str] = []
    real = SharedBlocks.exists

    def counting(self: SharedBlocks, digest: str) -> bool:
        seen.append(digest)
        return real(self, digest)

    monkeypatch.setattr(SharedBlocks, "exists", counting)
    return seen


def test_lookup_prefix_asks_the_shared_tier_once_for_a_new_tail(
    shm_path: Path, tmp_path: Path, asked: list[str]
) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 8 * PHYS, shared_url=str(tmp_path / "s"), high_water=1.0)
    ks = keys(40)
    with KVStore(cfg) as store:
        store.put_batch(ks[:3], [payload(i) for i in range(3)])
        asked.clear()
        assert store.lookup_prefix(ks) == 3  # the host holds 3; the 37 keys after them: one question
        assert asked == [ks[3].digest]


def test_shared_lookup_host_answers_from_what_this_host_wrote_without_asking(
    shm_path: Path, tmp_path: Path, asked: list[str]
) -> None:
    shared = str(tmp_path / "s")
    ks = keys(10)
    # Another host (its own pool and index) wrote ks[6:8] back to the shared tier.
    with KVStore(KVConfig(str(shm_path / "other"), PHYS, shared_url=shared, high_water=1.0)) as other:
        for i in range(6, 9):  # each put evicts the one before: ks[6] and ks[7] go to the shared tier
            other.put_batch([ks[i]], [payload(i)])
            other.flush(60)
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS, shared_url=shared, high_water=1.0, shared_lookup="host")
    with KVStore(cfg) as store:
        store.put_batch(ks[:6], [payload(i) for i in range(6)])  # a 2-block pool: 4 written back to shared
        store.flush(60)
        asked.clear()
        assert store.lookup_prefix(ks) == 6 and asked == []  # no round trip to the shared tier
        assert {store.contains(k) for k in ks[:6]} == {"dram", "shared"} and asked == []
        assert store.lookup_prefix(ks[6:]) == 0 and store.contains(ks[6]) is None  # not this host's
        with KVStore(replace(cfg, shared_lookup="ask")) as asking:  # the same host, asking
            assert asking.lookup_prefix(ks[6:]) == 2 and asked
        bufs = [bytearray(BLOCK) for _ in range(6)]
        results = store.get_batch_into(ks[:6], bufs)
        assert [r.status for r in results] == ["hit"] * 6
        assert all(bytes(b) == payload(i) for i, b in enumerate(bufs))
        assert store.remove([ks[1]]) == 1
        assert store.lookup_prefix(ks) == 1  # a deleted block is forgotten


def test_remove_takes_a_block_from_every_tier(shm_path: Path, tmp_path: Path) -> None:
    events: list[KVEvent] = []
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS, local_root=str(tmp_path / "l"), high_water=1.0)
    ks = keys(4)
    with KVStore(cfg) as store:
        store.add_listener(events.append)
        for i, k in enumerate(ks):
            store.put_batch([k], [payload(i)])
        store.flush(60)
        assert store.remove(ks + keys(5)[4:]) == 4
        assert [store.contains(k) for k in ks] == [None] * 4
        results = store.get_batch_into(ks, [bytearray(BLOCK) for _ in ks])
        assert [(r.status, r.reason) for r in results] == [("miss", "absent")] * 4
        assert store.stats().tiers["dram"].bytes_used == 0 and store.stats().tiers["local"].bytes_used == 0
    assert sum(e.kind == "removed" for e in events) == 4


def test_numpy_and_torch_buffers_round_trip(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 16 * PHYS)) as store:
        t = torch.randn(64, 128).to(torch.bfloat16)
        a = np.arange(4096, dtype=np.float32)
        ks = keys(2)
        assert all(r.stored for r in store.put_batch(ks, [t, a]))
        t_out = torch.empty_like(t)
        a_out = np.zeros_like(a)
        assert all(r.hit for r in store.get_batch_into(ks, [t_out, a_out]))
        assert torch.equal(t_out.view(torch.int16), t.view(torch.int16)) and np.array_equal(a, a_out)


def test_a_wrong_buffer_is_an_error_result_naming_the_sizes(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 16 * PHYS)) as store:
        ks = keys(3)
        store.put_batch(ks, [payload(i) for i in range(3)])
        results = store.get_batch_into(ks, [bytearray(BLOCK - 1), b"x" * BLOCK, bytearray(BLOCK)])
        assert [r.status for r in results] == ["error", "error", "hit"]
        assert isinstance(results[0].error, BlockSizeError) and results[0].error.block_bytes == BLOCK
        assert f"{BLOCK - 1} bytes" in str(results[0].error) and str(BLOCK) in str(results[0].error)
        assert isinstance(results[1].error, ConfigError) and "read-only" in str(results[1].error)
        with pytest.raises(ConfigError, match="3 keys but 2"):
            store.get_batch_into(ks, [bytearray(BLOCK)] * 2)
        assert store.block_size(ks[0]) == BLOCK and store.block_size(keys(4)[3]) is None


def test_events_and_stats_describe_what_happened(shm_path: Path) -> None:
    events: list[KVEvent] = []
    with KVStore(KVConfig(str(shm_path / "pool"), 16 * PHYS)) as store:
        store.add_listener(events.append)
        store.add_listener(lambda e: 1 / 0)  # a failing listener does not fail the store
        ks = keys(2)
        store.put_batch(ks, [payload(0), payload(1)])
        store.get_batch_into(keys(3), [bytearray(BLOCK) for _ in range(3)])
        stats = store.stats()
        assert stats.tiers["dram"].blocks == 2 and stats.tiers["dram"].capacity == 16 * PHYS
        assert (stats.tiers["dram"].hits, stats.tiers["dram"].misses) == (2, 1)
        assert stats.tiers["dram"].bytes_read == 2 * BLOCK and stats.tiers["dram"].bytes_written == 2 * BLOCK
    stored = [e for e in events if e.kind == "stored"]
    assert [e.key for e in stored] == ks and all(e.tier == "dram" and e.nbytes == BLOCK for e in stored)


def test_stats_count_every_hit_of_concurrent_callers_and_promotions(shm_path: Path, tmp_path: Path) -> None:
    # Four threads read while the write-back thread promotes local hits into DRAM and evicts:
    # the per-tier counters are bumped from all of them and must add up to the results returned.
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS, local_root=str(tmp_path / "local"), high_water=1.0)
    ks = keys(12)
    returned: dict[str, int] = {"dram": 0, "local": 0}
    lock = threading.Lock()
    with KVStore(cfg) as store:
        store.put_batch(ks, [payload(i) for i in range(len(ks))])
        store.flush(60)

        def reader(seed: int) -> None:
            order = ks[seed:] + ks[:seed]
            for _ in range(15):
                for r in store.get_batch_into(order, [bytearray(BLOCK) for _ in order]):
                    assert r.status == "hit"
                    with lock:
                        returned[r.tier or "?"] += 1

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.flush(60)
        stats = store.stats()
    assert returned["dram"] + returned["local"] == 4 * 15 * len(ks)
    assert stats.tiers["dram"].hits == returned["dram"] and stats.tiers["local"].hits == returned["local"]
    assert stats.tiers["dram"].bytes_read == returned["dram"] * BLOCK
    assert stats.tiers["local"].misses == 0


def test_a_closed_store_refuses_calls(shm_path: Path) -> None:
    store = KVStore(KVConfig(str(shm_path / "pool"), 16 * PHYS))
    store.close()
    store.close()
    with pytest.raises(StateError, match="closed"):
        store.put_batch(keys(1), [payload(0)])


def test_config_is_validated_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="dram_bytes"):
        KVConfig("/dev/shm/x", 0)
    with pytest.raises(ConfigError, match="high_water"):
        KVConfig("/dev/shm/x", 1, high_water=1.5)
    with pytest.raises(ConfigError, match="eviction"):
        KVConfig("/dev/shm/x", 1, eviction="fifo")


def test_the_kv_docs_examples_run_as_written() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "kv.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert len(blocks) == 3
    outputs = []
    for block in blocks:
        proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outputs.append(proc.stdout)
    assert "['peer', 'peer', 'peer']" in outputs[1]  # the fabric path: all three from the other host
    assert (
        "reusable prefix: 5 blocks"
        in subprocess.run(
            [sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=120
        ).stdout
    )
