"""Correctness under faults: several processes on one host, a process killed mid-put, corrupt
blocks on DRAM and local disk, a dead process's lease, and a deadline under a slow shared tier."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path

import pytest

from shoal.kv import KVConfig, KVEvent, KVStore
from shoal.kv.lower import SharedBlocks, block_path

from . import kv_workers
from .kv_workers import BLOCK, PHYS, disk_bytes, flip_byte, keys, payload, pool_files

SPAWN = mp.get_context("spawn")


def test_processes_putting_and_getting_concurrently_read_bit_exact_within_capacity(
    shm_path: Path, tmp_path: Path
) -> None:
    n_workers, n_own, n_common = 3, 6, 6
    cap = 14 * PHYS  # less than the 24 distinct blocks: eviction and write-back under contention
    cfg = KVConfig(str(shm_path / "pool"), cap, local_root=str(tmp_path / "local"), high_water=0.8)
    barrier = SPAWN.Barrier(n_workers)
    results = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=kv_workers.put_and_get_worker, args=(cfg, w, n_own, n_common, n_workers, barrier, results)
        )
        for w in range(n_workers)
    ]
    for p in procs:
        p.start()
    outs = [results.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    expected = n_workers * n_own + n_common
    for out in outs:
        assert out["errors"] == 0 and out["put_errors"] == 0, out
        assert out["hits"] == out["exact"] == expected, out  # every block found, every byte right
        assert out["max_used"] <= cap
    assert disk_bytes(shm_path / "pool") <= cap
    with KVStore(cfg) as store:
        assert store.stats().tiers["dram"].bytes_used <= cap


def test_a_process_killed_mid_put_leaves_no_block_that_is_served(shm_path: Path) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 8 * PHYS)
    proc = SPAWN.Process(target=kv_workers.killed_mid_put_worker, args=(cfg, 0))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9  # SIGKILLed between writing the temporary file and the rename
    assert any(p.name.startswith(".") for p in pool_files(shm_path / "pool"))  # it left a temp file
    key = keys(1)[0]
    with KVStore(cfg) as store:  # joining the pool sweeps what the dead writer left
        buf = bytearray(BLOCK)
        r = store.get_batch_into([key], [buf])[0]
        assert (r.status, r.reason) == ("miss", "absent") and buf == bytes(BLOCK)
        assert store.contains(key) is None
        assert pool_files(shm_path / "pool") == []
        assert store.stats().tiers["dram"].bytes_used == 0  # its reservation was given back
        assert store.put_batch([key], [payload(0)])[0].stored
        assert store.get_batch_into([key], [buf])[0].hit and buf == payload(0)


def test_a_corrupt_block_in_dram_is_a_miss_and_an_event_never_served(shm_path: Path) -> None:
    events: list[KVEvent] = []
    with KVStore(KVConfig(str(shm_path / "pool"), 8 * PHYS)) as store:
        store.add_listener(events.append)
        ks = keys(2)
        store.put_batch(ks, [payload(0), payload(1)])
        flip_byte(shm_path / "pool" / "blocks" / ks[0].digest, 96 + 1234)
        bufs = [bytearray(BLOCK), bytearray(BLOCK)]
        results = store.get_batch_into(ks, bufs)
        assert (results[0].status, results[0].reason) == ("miss", "corrupt")
        assert results[1].hit and bufs[1] == payload(1)
        assert store.contains(ks[0]) is None  # the bad copy is gone; a new put can replace it
        assert store.stats().corrupt == 1
    corrupt = [e for e in events if e.kind == "corrupt"]
    assert [(e.key, e.tier) for e in corrupt] == [(ks[0], "dram")]


def test_a_corrupt_dram_copy_falls_back_to_a_good_local_copy(shm_path: Path, tmp_path: Path) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS, local_root=str(tmp_path / "l"), high_water=1.0)
    ks = keys(3)
    with KVStore(cfg) as store:
        for i, k in enumerate(ks):
            store.put_batch([k], [payload(i)])
        store.flush(30)
        buf = bytearray(BLOCK)
        assert store.get_batch_into(ks[:1], [buf])[0].tier == "local"
        store.flush(30)  # promoted into DRAM, with its local copy kept
        assert store.contains(ks[0]) == "dram"
        flip_byte(shm_path / "pool" / "blocks" / ks[0].digest, 10)  # a header byte this time
        r = store.get_batch_into(ks[:1], [buf])[0]
        assert (r.status, r.tier) == ("hit", "local") and buf == payload(0)


def test_a_corrupt_block_on_local_disk_is_a_miss_and_an_event(shm_path: Path, tmp_path: Path) -> None:
    events: list[KVEvent] = []
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS, local_root=str(tmp_path / "l"), high_water=1.0)
    ks = keys(4)
    with KVStore(cfg) as store:
        store.add_listener(events.append)
        for i, k in enumerate(ks):
            store.put_batch([k], [payload(i)])
        store.flush(30)
        assert store.contains(ks[0]) == "local"
        flip_byte(tmp_path / "l" / block_path(ks[0].digest), 96 + BLOCK - 1)
        buf = bytearray(BLOCK)
        r = store.get_batch_into(ks[:1], [buf])[0]
        assert (r.status, r.reason) == ("miss", "corrupt")
        assert store.contains(ks[0]) is None
    assert [(e.key, e.tier) for e in events if e.kind == "corrupt"] == [(ks[0], "local")]


def test_a_dead_processes_lease_no_longer_pins(shm_path: Path) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS, writeback=False, high_water=1.0)
    with KVStore(cfg) as store:
        store.put_batch(keys(2), [payload(0), payload(1)])
        proc = SPAWN.Process(target=kv_workers.pin_and_die_worker, args=(cfg, 2))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        r = store.put_batch(keys(3)[2:], [payload(2)])[0]
        assert (r.stored, r.tier, r.error) == (True, "dram", None)  # a block was evicted for it


def test_a_deadline_is_honoured_under_a_slow_shared_tier(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 1 * PHYS, shared_url=str(tmp_path / "s"), high_water=1.0)
    ks = keys(4)
    with KVStore(cfg) as store:
        for i, k in enumerate(ks):
            store.put_batch([k], [payload(i)])
        store.flush(30)
        assert [store.contains(k) for k in ks] == ["shared"] * 3 + ["dram"]
        # A slow shared tier: its reads are held until the test lets them go (after the get
        # returned), so the get can only have returned at its deadline, whatever the machine's speed.
        release, lock = threading.Event(), threading.Lock()
        started: list[str] = []
        finished: list[str] = []
        fetch = SharedBlocks.fetch_verified

        def held(self: SharedBlocks, digest: str) -> tuple[memoryview, str] | None:
            with lock:
                started.append(digest)
            release.wait(120)  # a get that waited for its reads would wait this long, then fail below
            try:
                return fetch(self, digest)
            finally:
                with lock:
                    finished.append(digest)

        monkeypatch.setattr(SharedBlocks, "fetch_verified", held)
        bufs = [bytearray(BLOCK) for _ in ks]
        # the deadline only has to outlast the DRAM read of ks[3]; the shared reads never end before it
        results = store.get_batch_into(ks, bufs, deadline=time.monotonic() + 2.0)
        with lock:
            assert finished == []  # returned at the deadline, with every shared read still under way
        release.set()
        assert [(r.status, r.reason) for r in results[:3]] == [("miss", "deadline")] * 3
        assert results[3].hit and bufs[3] == payload(3)
        for _ in range(1200):  # the abandoned reads end (those that started): at most 120 s
            with lock:
                if len(finished) == len(started):
                    break
            time.sleep(0.1)
        with lock:
            assert len(finished) == len(started)
        assert all(buf == bytes(BLOCK) for buf in bufs[:3])  # abandoned reads never touch the buffers
        r = store.get_batch_into(ks[:1], bufs[:1])[0]  # without the hold, the same read hits
        assert r.hit and r.tier == "shared" and bufs[0] == payload(0)


def test_a_deadline_already_past_reads_nothing(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 4 * PHYS)) as store:
        store.put_batch(keys(2), [payload(0), payload(1)])
        results = store.get_batch_into(keys(2), [bytearray(BLOCK)] * 2, deadline=time.monotonic() - 1)
        assert [(r.status, r.reason) for r in results] == [("miss", "deadline")] * 2


def test_a_live_store_takes_over_a_block_whose_writer_was_killed(shm_path: Path) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 8 * PHYS)
    key = keys(1)[0]
    with KVStore(cfg) as store:  # joined before the writer dies: no sweep at open to rely on
        proc = SPAWN.Process(target=kv_workers.killed_mid_put_worker, args=(cfg, 0))
        proc.start()
        proc.join(60)
        assert proc.exitcode == -9
        assert store.get_batch_into([key], [bytearray(BLOCK)])[0].reason == "absent"
        r = store.put_batch([key], [payload(0)])[0]
        assert (r.stored, r.tier, r.error) == (True, "dram", None)
        assert [p.name for p in pool_files(shm_path / "pool")] == [key.digest]  # its temp file swept
        assert store.stats().tiers["dram"].bytes_used == PHYS
        buf = bytearray(BLOCK)
        assert store.get_batch_into([key], [buf])[0].hit and buf == payload(0)
