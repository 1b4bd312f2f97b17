"""The KV store under hostile conditions, one promise at a time: removes that stick, an index that
is never trusted blindly, deadlines that hold while the index is locked, damaged blocks that heal,
no half-done state after an interrupt, and bad input refused by name.

Where an interleaving matters it is forced (a held write-back, a held lock), never left to timing.
The many-process version of all of it is ``test_kv_stress.py``.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shoal import failpoints
from shoal.errors import ShoalError, TierError
from shoal.kv import KVConfig, KVEvent, KVStore, MooncakeStore
from shoal.kv.blockfile import HEADER_SIZE, encode_block
from shoal.kv.pool import BLOCKS_DIR, FP_BEFORE_RENAME, INDEX_NAME

from .kv_workers import BLOCK, PHYS, disk_bytes, keys, payload, pool_files


def _index_rows(root: Path) -> tuple[int, int, int]:
    """(running total, sum of the rows, rows not READY), read around the store."""
    with sqlite3.connect(root / INDEX_NAME) as c:
        total, rows, busy = c.execute(
            "SELECT (SELECT v FROM meta WHERE k = 'used'), (SELECT COALESCE(SUM(phys), 0) FROM blocks), "
            "(SELECT COUNT(*) FROM blocks WHERE state != 1)"
        ).fetchone()
    return int(total), int(rows), int(busy)


class _Gate:
    """Holds every call of a wrapped function until released (a forced interleaving)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.release.wait(60), "the test never released the gate"
        return self.fn(*args, **kwargs)


def _with_local(shm: Path, tmp: Path, blocks: int = 4, **kw: Any) -> KVConfig:
    return KVConfig(str(shm / "pool"), blocks * PHYS, local_root=str(tmp / "local"), **kw)


# -- 1. removal sticks ---------------------------------------------------------------------------


def test_a_remove_wins_over_a_promotion_queued_before_it(shm_path: Path, tmp_path: Path) -> None:
    cfg = _with_local(shm_path, tmp_path, blocks=1, high_water=1.0)
    k = keys(2)
    with KVStore(cfg) as store:
        store.put_batch(k[:1], [payload(0)])
        store.put_batch(k[1:], [payload(1)])  # evicts k[0] to the local tier
        store.flush(30)
        assert store.contains(k[0]) == "local"
        gate = _Gate(store._writeback._promote)
        store._writeback._promote = gate  # the promotion of the hit below waits here
        buf = bytearray(BLOCK)
        assert store.get_batch_into(k[:1], [buf])[0].tier == "local"
        assert gate.entered.wait(30)
        assert store.remove(k[:1]) == 1
        gate.release.set()
        store.flush(30)
        assert store.contains(k[0]) is None
        assert store.get_batch_into(k[:1], [buf])[0].status == "miss"


def test_a_remove_wins_over_a_write_back_in_flight(shm_path: Path, tmp_path: Path) -> None:
    cfg = _with_local(shm_path, tmp_path, blocks=4, high_water=0.2)
    k = keys(1)
    with KVStore(cfg) as store:
        assert store._local is not None
        gate = _Gate(store._local.write)
        store._local.write = gate  # the background eviction's write-back waits here
        store.put_batch(k, [payload(0)])  # above high water: evicted in the background
        assert gate.entered.wait(30)
        assert store.remove(k) == 1
        gate.release.set()
        store.flush(30)
        assert store.contains(k[0]) is None
        assert not any((tmp_path / "local").rglob(k[0].digest))
        assert store.get_batch_into(k, [bytearray(BLOCK)])[0].status == "miss"


def test_a_put_after_a_remove_stores_the_new_bytes_for_every_process(shm_path: Path) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS)
    k = keys(1)
    new = bytes(reversed(payload(0)))
    with KVStore(cfg) as a, KVStore(cfg) as b:
        a.put_batch(k, [payload(0)])
        assert b.remove(k) == 1
        assert a.contains(k[0]) is None
        assert a.put_batch(k, [new])[0].stored
        buf = bytearray(BLOCK)
        assert b.get_batch_into(k, [buf])[0].hit and buf == new


def test_the_mooncake_facade_remove_wins_over_a_queued_promotion(shm_path: Path, tmp_path: Path) -> None:
    store = KVStore(_with_local(shm_path, tmp_path, blocks=1, high_water=1.0))
    mc = MooncakeStore(store, namespace="hostile")
    try:
        assert mc.put("a", payload(0)) == 0
        assert mc.put("b", payload(1)) == 0  # "a" goes to the local tier
        store.flush(30)
        gate = _Gate(store._writeback._promote)
        store._writeback._promote = gate
        assert mc.get("a") == payload(0)  # a local hit: its promotion waits
        assert gate.entered.wait(30)
        assert mc.remove("a") == 0
        gate.release.set()
        store.flush(30)
        assert mc.is_exist("a") == 0 and mc.get("a") == b""
    finally:
        store.close()


# -- 2. the index is never trusted blindly ----------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.unlink(f"{path}{suffix}")
    if how == "deleted":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(os.urandom(8192))
    elif how == "page_damaged":
        data = bytearray(path.read_bytes())
        page = 4096
        for at in range(page + 16, len(data), page):  # every page but the header: the b-trees
            data[at : at + 64] = os.urandom(64)
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["deleted", "empty", "truncated", "garbage", "page_damaged"])
def test_a_damaged_index_is_rebuilt_and_the_capacity_still_holds(
    shm_path: Path, tmp_path: Path, how: str
) -> None:
    root = shm_path / "pool"
    cap = 5 * PHYS
    cfg = _with_local(shm_path, tmp_path, blocks=5, high_water=1.0)
    with KVStore(cfg) as store:
        for i, k in enumerate(keys(8)):
            store.put_batch([k], [payload(i)])
        store.flush(30)
        local_before = store.stats().tiers["local"].blocks
    files = len(pool_files(root))
    assert files == 5
    _damage(root / INDEX_NAME, how)
    with KVStore(cfg) as store:
        st = store.stats().tiers
        assert (st["dram"].blocks, st["dram"].bytes_used) == (files, files * PHYS)
        assert st["local"].blocks == local_before
        more = keys(12, seq=7)
        for i, k in enumerate(more):
            assert store.put_batch([k], [payload(100 + i)])[0].error is None
            assert disk_bytes(root) <= cap
        total, rows, _ = _index_rows(root)
        assert total == rows <= cap
        bufs = [bytearray(BLOCK) for _ in keys(8)]
        for i, r in enumerate(store.get_batch_into(keys(8), bufs)):
            assert r.hit and bufs[i] == payload(i)  # every old block is still somewhere


def test_an_index_killed_in_the_middle_of_its_rebuild_is_rebuilt_again(shm_path: Path) -> None:
    root = shm_path / "pool"
    cfg = KVConfig(str(root), 4 * PHYS, high_water=1.0)
    with KVStore(cfg) as store:
        store.put_batch(keys(4), [payload(i) for i in range(4)])
    (root / INDEX_NAME).unlink()
    # what a process killed after creating the new index and before filling it leaves: the schema,
    # the meta rows of an empty pool, and the four block files it never counted
    code = (
        "import sys; from shoal.kv import _index, _owners; "
        "o = _owners.OwnerLock(sys.argv[1]); "
        "_index.BlockIndex(sys.argv[1] + '/index.sqlite3', int(sys.argv[2]), sys.argv[1] + '/blocks', o); "
        "import os; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, str(root), str(4 * PHYS)], check=True, timeout=60)
    with KVStore(cfg) as store:
        assert store.stats().tiers["dram"].blocks == 4
        store.put_batch(keys(6, seq=3), [payload(10 + i) for i in range(6)])
        assert disk_bytes(root) <= 4 * PHYS


def test_block_files_the_index_does_not_know_are_counted_or_deleted(shm_path: Path) -> None:
    root = shm_path / "pool"
    cap = 4 * PHYS
    cfg = KVConfig(str(root), cap, high_water=1.0)
    with KVStore(cfg) as store:
        store.put_batch(keys(2), [payload(0), payload(1)])
    for i, k in enumerate(keys(5, seq=9)):  # planted around the store: whole block files, uncounted
        path = root / BLOCKS_DIR / k.digest
        path.write_bytes(encode_block(k.digest, payload(50 + i)))
        os.chmod(path, 0o600)
    with KVStore(cfg) as store:
        used = store.stats().tiers["dram"].bytes_used
        assert used == disk_bytes(root) <= cap  # counted while they fit, the rest deleted
        assert len(pool_files(root)) == 4
        store.put_batch(keys(4, seq=11), [payload(70 + i) for i in range(4)])
        assert disk_bytes(root) <= cap


def test_a_directory_where_the_index_belongs_is_refused_naming_it(shm_path: Path) -> None:
    root = shm_path / "pool"
    cfg = KVConfig(str(root), 4 * PHYS)
    KVStore(cfg).close()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{root / INDEX_NAME}{suffix}"):
            os.unlink(f"{root / INDEX_NAME}{suffix}")
    (root / INDEX_NAME).mkdir()
    with pytest.raises(TierError, match=r"index\.sqlite3 is a directory.*remove it"):
        KVStore(cfg)


def test_temporary_files_of_killed_local_writers_are_swept_and_local_files_counted(
    shm_path: Path, tmp_path: Path
) -> None:
    cfg = _with_local(shm_path, tmp_path, blocks=2, high_water=1.0)
    with KVStore(cfg) as store:
        store.put_batch(keys(4), [payload(i) for i in range(4)])  # two of them to the local tier
        store.flush(30)
        local_blocks = store.stats().tiers["local"].blocks
        assert local_blocks == 2
    local = tmp_path / "local"
    k = keys(1, seq=5)[0]
    sub = local / k.digest[:2]
    sub.mkdir(mode=0o700, exist_ok=True)
    temp = sub / f".{k.digest}.{'0' * 16}.tmp-0123456789abcdef"  # a writer killed mid-write
    temp.write_bytes(b"x" * 5000)
    planted = sub / k.digest  # a whole block the index never counted
    planted.write_bytes(encode_block(k.digest, payload(5)))
    os.chmod(planted, 0o600)
    with KVStore(cfg) as store:
        assert not temp.exists()
        assert store.stats().tiers["local"].blocks == 3
        buf = bytearray(BLOCK)
        assert store.get_batch_into([k], [buf])[0].tier == "local" and buf == payload(5)


# -- 4. deadlines hold under contention, a locked index is a ShoalError ----------------------------


@pytest.fixture
def locked_index(shm_path: Path) -> Iterator[Callable[[], None]]:
    """Another process holding the pool index's write lock until the test lets go."""
    procs: list[subprocess.Popen[bytes]] = []

    def lock() -> None:
        code = (
            "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True); sys.stdin.read(1)"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(shm_path / "pool" / INDEX_NAME)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"

    yield lock
    for proc in procs:
        proc.kill()
        proc.wait(30)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def test_gets_never_wait_on_a_write_transaction(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, locked_index: Callable[[], None]
) -> None:
    from shoal.kv import _index

    monkeypatch.setattr(_index, "LOCK_WAIT_S", 1.0)  # the background jobs' wait, not the get's
    cfg = _with_local(shm_path, tmp_path, blocks=2, high_water=1.0)
    ks = keys(3)
    with KVStore(cfg) as store:
        store.put_batch(ks, [payload(i) for i in range(3)])  # one of them goes to the local tier
        store.flush(30)
        tiers = [store.contains(k) for k in ks]
        assert sorted(tiers, key=str) == ["dram", "dram", "local"]
        locked_index()  # held until the fixture ends: a get that waited on it would never return
        bufs = [bytearray(BLOCK) for _ in ks]
        results = store.get_batch_into(ks, bufs, deadline=time.monotonic() + 30)
        assert [r.tier for r in results] == tiers
        assert all(buf == payload(i) for i, buf in enumerate(bufs))
        assert store.contains(ks[1]) == "dram" and store.lookup_prefix(ks) == 3


def test_a_locked_index_is_a_shoal_error_naming_it_not_a_sqlite_one(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch, locked_index: Callable[[], None]
) -> None:
    from shoal.kv import _index

    monkeypatch.setattr(_index, "LOCK_WAIT_S", 0.5)
    with KVStore(KVConfig(str(shm_path / "pool"), 4 * PHYS)) as store:
        locked_index()
        with pytest.raises(ShoalError, match=r"index\.sqlite3"):
            store.put_batch(keys(1), [payload(0)])


def test_a_store_reports_the_longest_it_held_the_index_write_lock(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 4 * PHYS)) as store:
        store.put_batch(keys(2), [payload(0), payload(1)])
        after_put = store.stats().longest_index_write_s
        assert after_put > 0.0
        t0 = time.monotonic()
        with store._pool.index.transaction():  # a transaction held for a known time
            time.sleep(0.2)
        held = time.monotonic() - t0
        assert 0.2 <= store.stats().longest_index_write_s <= max(held, after_put)


# -- 5. a damaged block is a damaged block ----------------------------------------------------------


@pytest.mark.parametrize("how", ["truncated", "extended"])
@pytest.mark.parametrize("tier", ["dram", "local"])
def test_a_block_file_of_the_wrong_size_is_a_corrupt_copy_and_a_put_heals_it(
    shm_path: Path, tmp_path: Path, tier: str, how: str
) -> None:
    cfg = _with_local(shm_path, tmp_path, blocks=1, high_water=1.0)
    k = keys(2)
    events: list[KVEvent] = []
    with KVStore(cfg) as store:
        store.add_listener(events.append)
        store.put_batch(k[:1], [payload(0)])
        if tier == "local":
            store.put_batch(k[1:], [payload(1)])  # k[0] to the local tier
            store.flush(30)
            path = tmp_path / "local" / k[0].digest[:2] / k[0].digest
        else:
            path = shm_path / "pool" / BLOCKS_DIR / k[0].digest
        assert store.contains(k[0]) == tier
        with open(path, "r+b") as f:
            if how == "truncated":
                f.truncate(HEADER_SIZE + BLOCK // 2)
            else:
                f.seek(0, 2)
                f.write(b"\0" * 100)
        buf = bytearray(BLOCK)
        r = store.get_batch_into(k[:1], [buf])[0]
        assert (r.status, r.reason) == ("miss", "corrupt")
        assert [(e.kind, e.tier) for e in events if e.kind == "corrupt"] == [("corrupt", tier)]
        assert not path.exists()
        assert store.put_batch(k[:1], [payload(0)])[0].stored  # the key is not poisoned
        assert store.get_batch_into(k[:1], [buf])[0].hit and buf == payload(0)


def test_a_whole_block_and_a_wrong_buffer_is_the_callers_error(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 4 * PHYS)) as store:
        store.put_batch(keys(1), [payload(0)])
        r = store.get_batch_into(keys(1), [bytearray(BLOCK - 1)])[0]
        assert r.status == "error" and "pass a buffer of the block's size" in str(r.error)
        assert store.contains(keys(1)[0]) == "dram"  # nothing deleted


# -- 6. no half-done state after an interrupt --------------------------------------------------------


def test_a_keyboard_interrupt_inside_put_batch_leaves_a_consistent_pool(shm_path: Path) -> None:
    root = shm_path / "pool"
    cap = 8 * PHYS
    cfg = KVConfig(str(root), cap, writeback=False, high_water=1.0)
    ks = keys(6)
    failpoints.configure(f"{FP_BEFORE_RENAME}=delay:2")
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    # Python ignores SIGINT when started with it ignored (a shell's background job): make it the
    # KeyboardInterrupt a user's Ctrl-C is, for this test
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    with KVStore(cfg) as store:
        store.put_batch(keys(4, seq=3), [payload(20 + i) for i in range(4)])  # victims to claim
        try:
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                store.put_batch(ks, [payload(i) for i in range(6)])  # >= 12 s: interrupted inside
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, before)
            failpoints.configure("")
        total, rows, busy = _index_rows(root)
        assert busy == 0, "a reservation or a claim outlived the interrupted put"
        assert total == rows == disk_bytes(root) <= cap
        results = store.put_batch(ks, [payload(i) for i in range(6)])
        assert all(r.error is None for r in results)
        bufs = [bytearray(BLOCK) for _ in ks]
        got = store.get_batch_into(ks, bufs)
        assert all(r.hit for r in got) and all(buf == payload(i) for i, buf in enumerate(bufs))


# -- 7. races: a pin taken while a block is being evicted keeps it --------------------------------


def test_a_pin_taken_while_its_block_is_being_written_back_keeps_it(shm_path: Path, tmp_path: Path) -> None:
    cfg = _with_local(shm_path, tmp_path, blocks=4, high_water=0.2)
    k = keys(1)
    with KVStore(cfg) as store:
        assert store._local is not None
        gate = _Gate(store._local.write)
        store._local.write = gate
        store.put_batch(k, [payload(0)])  # claimed by the background eviction, held in its write-back
        assert gate.entered.wait(30)
        lease = store.pin(k, lease_s=60)
        gate.release.set()
        store.flush(30)
        assert store.contains(k[0]) == "dram"
        store.unpin(lease)


# -- 8. bad input is refused clearly -----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["a-string-key", b"bytes-key", None, 7])
def test_keys_that_are_not_block_keys_are_refused_naming_them(shm_path: Path, bad: object) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 4 * PHYS)) as store:
        calls: list[Callable[[], object]] = [
            lambda: store.put_batch([bad], [payload(0)]),  # type: ignore[list-item]
            lambda: store.get_batch_into([bad], [bytearray(BLOCK)]),  # type: ignore[list-item]
            lambda: store.contains(bad),  # type: ignore[arg-type]
            lambda: store.block_size(bad),  # type: ignore[arg-type]
            lambda: store.lookup_prefix([bad]),  # type: ignore[list-item]
            lambda: store.remove([bad]),  # type: ignore[list-item]
            lambda: store.pin([bad]),  # type: ignore[list-item]
        ]
        for call in calls:
            with pytest.raises(ShoalError, match=r"not a BlockKey|list of BlockKey"):
                call()
        with pytest.raises(ShoalError, match="list of BlockKey"):
            store.remove("abc")  # type: ignore[arg-type]


@pytest.mark.parametrize("deadline", [float("inf"), float("nan"), -1.0, "soon", True])
def test_bad_deadlines_are_refused_naming_them(shm_path: Path, deadline: object) -> None:
    with (
        KVStore(KVConfig(str(shm_path / "pool"), 4 * PHYS)) as store,
        pytest.raises(ShoalError, match="deadline"),
    ):
        store.get_batch_into(keys(1), [bytearray(BLOCK)], deadline=deadline)  # type: ignore[arg-type]


def test_buffers_of_python_objects_and_non_contiguous_tensors_are_refused(shm_path: Path) -> None:
    with KVStore(KVConfig(str(shm_path / "pool"), 4 * PHYS)) as store:
        store.put_batch(keys(1), [payload(0)])
        objects = np.empty(BLOCK // 8, dtype=object)
        r = store.get_batch_into(keys(1), [objects])[0]  # a raw copy into it would corrupt memory
        assert r.status == "error" and "Python objects" in str(r.error)
        assert store.put_batch(keys(2)[1:], [objects])[0].error is not None
        t = torch.zeros(64, BLOCK // 64, dtype=torch.uint8).t()
        r = store.get_batch_into(keys(1), [t])[0]
        assert r.status == "error" and "non-contiguous" in str(r.error)


def test_contains_and_lookup_prefix_do_not_follow_symlinks(shm_path: Path, tmp_path: Path) -> None:
    root = shm_path / "pool"
    with KVStore(KVConfig(str(root), 4 * PHYS)) as store:
        k = keys(1)
        target = tmp_path / "elsewhere"
        target.write_bytes(encode_block(k[0].digest, payload(0)))
        (root / BLOCKS_DIR / k[0].digest).symlink_to(target)
        assert store.contains(k[0]) is None
        assert store.lookup_prefix(k) == 0
        assert store.block_size(k[0]) is None
