"""The host DRAM pool: capacity in physical bytes never exceeded, LRU eviction with write-back,
leases, and the index rebuilt from the files."""

from __future__ import annotations

import os
import random
import sqlite3
import time
from pathlib import Path

import pytest

from shoal.errors import ConfigError, InsufficientMemory
from shoal.kv import KVConfig, KVEvent, KVStore, _index
from shoal.kv._index import Pending
from shoal.kv.blockfile import encode_block, encode_header
from shoal.kv.pool import BLOCKS_DIR, INDEX_NAME, physical_bytes

from .kv_workers import BLOCK, PHYS, disk_bytes, keys, payload, pool_files


def _index_used(root: Path) -> tuple[int, int]:
    """(the index's running total, the sum of its rows): read around the store, as ground truth."""
    with sqlite3.connect(root / INDEX_NAME) as c:
        total, rows = c.execute(  # one statement: one snapshot, while the write-back thread works
            "SELECT (SELECT v FROM meta WHERE k = 'used'), (SELECT COALESCE(SUM(phys), 0) FROM blocks)"
        ).fetchone()
    return int(total), int(rows)


def _check_capacity(root: Path, cap: int) -> None:
    total, rows = _index_used(root)
    assert total == rows, "the running total drifted from the rows"
    assert total <= cap, f"index counts {total} bytes > capacity {cap}"
    on_disk = disk_bytes(root)
    assert on_disk <= cap, f"{on_disk} bytes of files on tmpfs > capacity {cap}"


@pytest.mark.parametrize("writeback", [True, False])
def test_capacity_is_never_exceeded_under_a_random_workload(
    shm_path: Path, tmp_path: Path, writeback: bool
) -> None:
    rng = random.Random(1234 + writeback)
    cap = 12 * PHYS + 3000
    root = shm_path / "pool"
    cfg = KVConfig(str(root), cap, local_root=str(tmp_path / "local"), writeback=writeback, high_water=0.8)
    universe = keys(40)
    sizes = {k.digest: rng.choice([1, 4095, 4096, 5000, BLOCK, 3 * BLOCK]) for k in universe}
    leases = []
    with KVStore(cfg) as store:
        for _ in range(250):
            op = rng.random()
            batch = rng.sample(universe, rng.randint(1, 6))
            if op < 0.5:
                data = [payload(universe.index(k), sizes[k.digest]) for k in batch]
                for put in store.put_batch(batch, data):
                    assert put.error is None, put.error
            elif op < 0.8:
                bufs = [bytearray(sizes[k.digest]) for k in batch]
                for k, buf, r in zip(batch, bufs, store.get_batch_into(batch, bufs), strict=True):
                    assert r.status in ("hit", "miss"), r
                    if r.hit:
                        assert buf == payload(universe.index(k), sizes[k.digest])
            elif op < 0.9:
                store.remove(batch[:1])
            elif op < 0.97:
                leases.append(store.pin(batch[:2], lease_s=5))
            elif leases:
                store.unpin(leases.pop(0))
            _check_capacity(root, cap)
        store.flush(30)
        _check_capacity(root, cap)


def test_an_eviction_that_ends_after_its_victim_was_removed_and_put_again_frees_nothing_of_it(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A race the random workload above once hit (files on tmpfs over the capacity): the
    write-back thread claims a block, the caller removes it and puts it again, and the eviction
    ends while the new copy is being written. Its release must not free the new copy's
    reservation, or the file lands on tmpfs uncounted. Here the interleaving is forced."""
    root = shm_path / "pool"
    cfg = KVConfig(str(root), 4 * PHYS, writeback=False, high_water=1.0)
    k = keys(1)
    with KVStore(cfg) as store:
        store.put_batch(k, [payload(0)])
        victims, since = store._pool.index.claim_above(0)  # what the write-back thread does first
        assert [v.digest for v in victims] == [k[0].digest]
        store.remove(k)
        write_temp = store._pool.write_temp

        def evict_then_write(digest: str, header: bytes, view: memoryview) -> str:
            store._writeback.evict(victims, since)  # the eviction ends between the reserve and the file
            return write_temp(digest, header, view)

        monkeypatch.setattr(store._pool, "write_temp", evict_then_write)
        assert store.put_batch(k, [payload(0)])[0].stored
        assert _index_used(root) == (PHYS, PHYS) and disk_bytes(root) == PHYS
        buf = bytearray(BLOCK)
        assert store.get_batch_into(k, [buf])[0].tier == "dram" and buf == payload(0)


def test_a_remove_while_a_put_of_the_block_is_under_way_wins_and_leaves_nothing(shm_path: Path) -> None:
    """A put reserved its block, then a remove of the block runs, and only then the put's file is
    written and committed (the race of the random workload: a promotion of a lower-tier hit landing
    under a remove, which once left its file on tmpfs uncounted). The remove was called after the
    put began; once it has returned the block must be gone, and no byte may stay on tmpfs."""
    root = shm_path / "pool"
    cfg = KVConfig(str(root), 4 * PHYS, writeback=False, high_water=1.0)
    k = keys(1)
    view = memoryview(payload(0))
    with KVStore(cfg) as store:
        pool = store._pool
        reservations, _, since = pool.index.reserve([(k[0].digest, BLOCK, PHYS)])  # the put begins
        assert reservations[0].outcome == "reserved"
        assert store.remove(k) == 0  # nothing stored yet; the put's reservation stays its own
        tmp = pool.write_temp(k[0].digest, encode_header(k[0].digest, view), view)
        committed, removed, _ = pool.index.commit([Pending(k[0].digest, tmp, None, 0)], since)
        assert (committed, removed) == ([], [k[0].digest])  # the put found the remove's tombstone
        os.unlink(tmp)
        pool.index.release_mine(removed)
        assert _index_used(root) == (0, 0) and disk_bytes(root) == 0
        assert store.contains(k[0]) is None
        assert store.get_batch_into(k, [bytearray(BLOCK)])[0].status == "miss"
        assert store.put_batch(k, [payload(0)])[0].stored  # a put after the remove stores as usual
        assert store.contains(k[0]) == "dram"


def test_a_sweep_deletes_dead_writers_temporary_files_and_keeps_live_ones(shm_path: Path) -> None:
    """Temporary files carry their writer's owner token: a sweep deletes those whose owner is
    gone (a process killed mid-put, in whatever PID namespace) and keeps a live writer's."""
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS, writeback=False, high_water=1.0)
    digest = keys(1)[0].digest
    view = memoryview(payload(0))
    with KVStore(cfg) as store:
        pool = store._pool
        reservations, _, _ = pool.index.reserve([(digest, BLOCK, PHYS)])
        assert reservations[0].outcome == "reserved"
        live = pool.write_temp(digest, encode_header(digest, view), view)
        dead = pool.blocks_dir + f"/.{digest}.{'0' * 16}.tmp-0123456789abcdef"
        Path(dead).write_bytes(b"a block whose writer was killed")
        old_style = pool.blocks_dir + f"/.{digest}.tmp-0123456789abcdef"
        Path(old_style).write_bytes(b"a temporary file without an owner")
        pool.sweep()
        assert os.path.exists(live)
        assert not os.path.exists(dead) and not os.path.exists(old_style)


def test_puts_beyond_capacity_evict_lru_and_write_back_to_local(shm_path: Path, tmp_path: Path) -> None:
    events: list[KVEvent] = []
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS, local_root=str(tmp_path / "local"), high_water=1.0)
    ks = keys(10)
    with KVStore(cfg) as store:
        store.add_listener(events.append)
        for i, k in enumerate(ks):  # one at a time: the LRU order is the put order
            assert store.put_batch([k], [payload(i)])[0].tier == "dram"
        store.flush(30)
        assert {store.contains(k) for k in ks[:6]} == {"local"}
        assert store.contains(ks[-1]) == "dram"
        bufs = [bytearray(BLOCK) for _ in ks]
        results = store.get_batch_into(ks, bufs)
        assert [r.tier for r in results[:6]] == ["local"] * 6
        assert all(r.hit and buf == payload(i) for i, (r, buf) in enumerate(zip(results, bufs, strict=True)))
        stats = store.stats()
        assert stats.tiers["local"].hits == 6 and (stats.tiers["dram"].bytes_used or 0) <= 4 * PHYS
    kinds = {e.kind for e in events}
    assert {"stored", "evicted", "written_back"} <= kinds
    wb = [e for e in events if e.kind == "written_back"]
    assert {e.digest for e in wb} >= {k.digest for k in ks[:6]} and all(e.tier == "local" for e in wb)
    assert wb[0].key in ks  # events carry the key when this store knows it


def test_without_writeback_evicted_blocks_are_dropped(shm_path: Path, tmp_path: Path) -> None:
    cfg = KVConfig(
        str(shm_path / "pool"), 3 * PHYS, local_root=str(tmp_path / "l"), writeback=False, high_water=1.0
    )
    ks = keys(6)
    with KVStore(cfg) as store:
        for i, k in enumerate(ks):
            store.put_batch([k], [payload(i)])
        store.flush(30)
        assert [store.contains(k) for k in ks] == [None] * 3 + ["dram"] * 3
        r = store.get_batch_into(ks[:1], [bytearray(BLOCK)])[0]
        assert (r.status, r.reason) == ("miss", "absent")


def test_background_eviction_keeps_the_pool_under_high_water(shm_path: Path, tmp_path: Path) -> None:
    cap = 10 * PHYS
    cfg = KVConfig(str(shm_path / "pool"), cap, local_root=str(tmp_path / "l"), high_water=0.5)
    with KVStore(cfg) as store:
        store.put_batch(keys(9), [payload(i) for i in range(9)])
        store.flush(30)
        assert (store.stats().tiers["dram"].bytes_used or 0) <= 0.5 * cap
        assert store.lookup_prefix(keys(9)) == 9  # nothing lost: the rest is on local


def test_a_put_batch_never_evicts_a_block_it_reports_present(shm_path: Path) -> None:
    """A batch whose present blocks are the pool's least recently used: its new blocks evict the
    next LRU ones instead, so every block reported in DRAM is there (it used to evict them for the
    batch's first new blocks, then report them present: lost)."""
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS, writeback=False, high_water=1.0)
    ks = keys(6)
    with KVStore(cfg) as store:
        for i in range(4):  # one at a time: LRU order 0, 1, 2, 3
            store.put_batch([ks[i]], [payload(i)])
        batch = [ks[4], ks[5], ks[0], ks[1]]
        results = store.put_batch(batch, [payload(i) for i in (4, 5, 0, 1)])
        assert [(r.stored, r.tier) for r in results] == [(True, "dram")] * 2 + [(False, "dram")] * 2
        assert [store.contains(k) for k in ks] == ["dram", "dram", None, None, "dram", "dram"]
        bufs = [bytearray(BLOCK) for _ in batch]
        got = store.get_batch_into(batch, bufs)
        assert all(r.tier == "dram" for r in got)
        assert [bytes(b) for b in bufs] == [payload(i) for i in (4, 5, 0, 1)]


def test_a_batch_touched_or_stored_at_one_instant_is_evicted_tail_first(shm_path: Path) -> None:
    """A prefix's blocks, head first: its deepest block goes first, so what stays is a usable
    prefix (a tail without its head serves no lookup)."""
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS, writeback=False, high_water=1.0)
    ks = keys(7)
    with KVStore(cfg) as store:
        store.put_batch(ks[:4], [payload(i) for i in range(4)])
        store.put_batch(ks[4:5], [payload(4)])
        assert [store.contains(k) for k in ks[:5]] == ["dram", "dram", "dram", None, "dram"]
        assert store.lookup_prefix(ks[:4]) == 3
        got = store.get_batch_into(ks[:3], [bytearray(BLOCK) for _ in range(3)])  # one instant
        assert all(r.tier == "dram" for r in got)
        store.put_batch(ks[5:7], [payload(5), payload(6)])  # evicts 4 (older), then 2, not 0
        assert [store.contains(k) for k in ks] == ["dram", "dram", None, None, None, "dram", "dram"]
        assert store.lookup_prefix(ks) == 2


class _IndexClock:
    """The wall clock the index compares leases with, moved on by the test: a lease expires when
    the test says so, not when a busy machine gets there."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def time(self) -> float:
        return time.time() + self.ahead


def test_pinned_blocks_are_not_evicted_and_a_lease_expires(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _IndexClock()
    monkeypatch.setattr(_index, "time", clock)
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS, writeback=False, high_water=1.0)
    ks = keys(12)
    with KVStore(cfg) as store:
        store.put_batch(ks[:4], [payload(i) for i in range(4)])
        lease = store.pin(ks[:2], lease_s=3600)
        short = store.pin(ks[2:3], lease_s=600)
        for i in range(4, 8):
            store.put_batch([ks[i]], [payload(i)])
        assert [store.contains(k) for k in ks[:3]] == ["dram"] * 3
        clock.ahead = 1200  # the short lease has expired; it no longer pins
        for i in range(8, 10):
            store.put_batch([ks[i]], [payload(i)])
        assert store.contains(ks[2]) is None
        assert [store.contains(k) for k in ks[:2]] == ["dram"] * 2
        store.unpin(lease)
        store.unpin(short)
        for i in range(10, 12):
            store.put_batch([ks[i]], [payload(i)])
        assert [store.contains(k) for k in ks[:2]] == [None, None]


def test_a_full_pool_of_pinned_blocks_refuses_a_put_naming_the_bytes(shm_path: Path) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS)
    with KVStore(cfg) as store:
        store.put_batch(keys(2), [payload(0), payload(1)])
        store.pin(keys(2))
        r = store.put_batch(keys(3)[2:], [payload(2)])[0]
        assert not r.stored and isinstance(r.error, InsufficientMemory)
        assert f"needs {PHYS} bytes" in str(r.error) and "0 of its" in str(r.error)


def test_a_full_pool_of_pinned_blocks_sends_a_put_to_the_next_tier(shm_path: Path, tmp_path: Path) -> None:
    # high_water=1.0: no background eviction between the put and the pin (at the default 0.9 the
    # write-back thread could make room first, and the third block would fit in DRAM)
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS, local_root=str(tmp_path / "l"), high_water=1.0)
    with KVStore(cfg) as store:
        store.put_batch(keys(2), [payload(0), payload(1)])
        store.pin(keys(2))
        r = store.put_batch(keys(3)[2:], [payload(2)])[0]
        assert (r.stored, r.tier, r.error) == (True, "local", None)
        buf = bytearray(BLOCK)
        assert store.get_batch_into(keys(3)[2:], [buf])[0].tier == "local" and buf == payload(2)


def test_the_index_is_rebuilt_from_the_tiers_after_it_is_deleted(shm_path: Path, tmp_path: Path) -> None:
    root = shm_path / "pool"
    cfg = KVConfig(str(root), 5 * PHYS, local_root=str(tmp_path / "l"))
    ks = keys(8)
    with KVStore(cfg) as store:
        for i, k in enumerate(ks):
            store.put_batch([k], [payload(i)])
        store.flush(30)
        before = store.stats()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{root / INDEX_NAME}{suffix}"):
            os.unlink(f"{root / INDEX_NAME}{suffix}")
    torn = root / BLOCKS_DIR / ("ab" * 32)
    torn.write_bytes(encode_block("ab" * 32, payload(99))[:-10])  # a torn block file
    (root / BLOCKS_DIR / f".{'cd' * 32}.tmp-0123456789abcdef").write_bytes(b"partial")
    with KVStore(cfg) as store:
        after = store.stats()
        assert after.tiers["dram"].blocks == before.tiers["dram"].blocks
        assert after.tiers["dram"].bytes_used == before.tiers["dram"].bytes_used
        assert after.tiers["local"].blocks == before.tiers["local"].blocks
        assert [p.name for p in pool_files(root)] == sorted(
            k.digest for k in ks if store.contains(k) == "dram"
        )
        bufs = [bytearray(BLOCK) for _ in ks]
        assert all(r.hit for r in store.get_batch_into(ks, bufs))
        assert all(buf == payload(i) for i, buf in enumerate(bufs))
        _check_capacity(root, 5 * PHYS)


def test_a_corrupt_index_file_is_rebuilt(shm_path: Path) -> None:
    root = shm_path / "pool"
    cfg = KVConfig(str(root), 5 * PHYS)
    with KVStore(cfg) as store:
        store.put_batch(keys(3), [payload(i) for i in range(3)])
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{root / INDEX_NAME}{suffix}"):
            os.unlink(f"{root / INDEX_NAME}{suffix}")
    (root / INDEX_NAME).write_bytes(b"this is not a database" * 100)
    with KVStore(cfg) as store:
        assert store.stats().tiers["dram"].blocks == 3
        assert store.stats().tiers["dram"].bytes_used == 3 * physical_bytes(BLOCK)


def test_every_process_of_a_host_must_agree_on_the_capacity(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 5 * PHYS)), pytest.raises(ConfigError, match="dram_bytes"):
        KVStore(KVConfig(str(shm_path / "pool"), 6 * PHYS))


def test_the_pool_directory_and_its_files_are_private(shm_path: Path) -> None:
    root = shm_path / "pool"
    with KVStore(KVConfig(str(root), 5 * PHYS)) as store:
        store.put_batch(keys(1), [payload(0)])
        assert os.stat(root).st_mode & 0o777 == 0o700
        assert os.stat(root / BLOCKS_DIR).st_mode & 0o777 == 0o700
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in pool_files(root))
        assert (root / INDEX_NAME).stat().st_mode & 0o777 == 0o600
