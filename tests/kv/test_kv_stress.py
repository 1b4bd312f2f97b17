"""Adversarial KV store tests: many processes putting, reading, removing and pinning overlapping
keys while some are SIGKILLed, against a pool smaller than the working set; and a process in
another PID namespace whose pins and in-flight put must hold until it dies, and no longer after.

The stress test's duration is :data:`STRESS_S` seconds of load (``SHOAL_KV_STRESS_S`` to run longer).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

import shoal
from shoal.kv import KVConfig, KVStore, chain_keys
from shoal.kv._index import WRITING
from shoal.kv.pool import BLOCKS_DIR

from . import stress_workers as sw
from .kv_workers import BLOCK, PHYS, keys, payload

SPAWN = mp.get_context("spawn")
STRESS_S = float(os.environ.get("SHOAL_KV_STRESS_S", "5"))
"""Seconds of load in the stress test."""
N_WORKERS = 5
CAP_BLOCKS = 12
"""The pool holds about this many 16 KiB blocks; the 48 keys need about 64 of them."""
END_GRACE_S = 90.0
"""How long a worker that was not killed may take to finish after the end time (a busy machine)."""


class DiskMonitor(threading.Thread):
    """Samples the physical bytes of the pool's block files every ``period`` seconds; records the
    largest and every sample above ``cap`` (with the files, for the report)."""

    def __init__(self, dram_root: Path, cap: int, period: float = 0.002) -> None:
        super().__init__(name="disk-monitor", daemon=True)
        self.blocks = str(dram_root / BLOCKS_DIR)
        self.cap = cap
        self.period = period
        self.samples = 0
        self.max_bytes = 0
        self.violations: list[dict[str, Any]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period):
            self.sample()

    def sample(self) -> int:
        total, files = sw.scan_disk(self.blocks)
        self.samples += 1
        self.max_bytes = max(self.max_bytes, total)
        if total > self.cap:
            if len(self.violations) < 5:
                self.violations.append({"bytes": total, "cap": self.cap, "files": sorted(files)})
            else:
                self.violations.append({"bytes": total})
        return total

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)
        self.sample()


# -- many processes ---------------------------------------------------------------------------


def run_stress(shm: Path, tmp: Path, *, local: bool, seconds: float, seed: int) -> dict[str, Any]:
    """The stress run (module docstring); fails on any violation, returns its counts."""
    cap = CAP_BLOCKS * PHYS
    root = shm / "pool"
    cfg = KVConfig(str(root), cap, local_root=str(tmp / "local") if local else None, high_water=0.8)
    work = tmp / "work"
    sw.init_work(work, sw.N_KEYS)
    setup = sw.StressSetup(cfg, str(work))
    rng = random.Random(seed)
    procs: dict[int, BaseProcess] = {}
    killed: set[int] = set()
    monitor = DiskMonitor(root, cap)

    def start(wid: int) -> None:
        p = SPAWN.Process(
            target=sw.stress_worker, args=(setup, wid, seed * 1000 + wid), name=f"stress-worker-{wid}"
        )
        p.start()
        procs[wid] = p

    hung: list[str] = []
    monitor.start()
    try:
        for w in range(N_WORKERS):
            start(w)
        limit = time.monotonic() + 120
        while len(list((work / "ready").iterdir())) < N_WORKERS:
            dead = [f"{p.name} (exit {p.exitcode})" for p in procs.values() if p.exitcode is not None]
            assert not dead, f"workers died before the start: {dead}; {_events(work)}"
            assert time.monotonic() < limit, "the workers did not open their stores within 120 s"
            time.sleep(0.02)
        end_at = time.time() + seconds
        (work / "go.tmp").write_text(repr(end_at))
        os.replace(work / "go.tmp", work / "go")
        next_wid = N_WORKERS
        while True:
            pause = rng.uniform(1.0, 2.0)
            if time.time() + pause > end_at - 0.5:
                break
            time.sleep(pause)
            alive = sorted(w for w, p in procs.items() if w not in killed and p.is_alive())
            if not alive:
                break  # every worker failed: reported below
            victim = rng.choice(alive)
            procs[victim].kill()  # SIGKILL: mid-put, mid-remove, holding a lock or a pin, whatever
            procs[victim].join(30)
            killed.add(victim)
            start(next_wid)
            next_wid += 1
        deadline = end_at + END_GRACE_S
        for w, p in sorted(procs.items()):
            if w in killed:
                continue
            p.join(max(0.0, deadline - time.time()))
            if p.is_alive():
                hung.append(f"{p.name} (pid {p.pid}) still running {END_GRACE_S:.0f} s after the end time")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(30)
        monitor.stop()
    assert not hung, f"deadlock or livelock: {hung}"
    bad_exits = [
        f"{p.name} exited {p.exitcode}" for w, p in sorted(procs.items()) if w not in killed and p.exitcode
    ]
    events = _events(work)
    errors = [e for e in events if e["kind"] in ("error", "exception")]
    violations = [e for e in events if e["kind"] not in ("error", "exception")]
    counts = _counts(work)
    counts.update(_final_check(cfg, work, violations))
    counts.update(
        kills=len(killed),
        processes=len(procs),
        max_disk_bytes=monitor.max_bytes,
        cap=cap,
        disk_samples=monitor.samples,
        disk_violations=len(monitor.violations),
        violations=len(violations),
        errors=len(errors),
    )
    print(f"\nKV stress ({'dram+local' if local else 'dram'}, {seconds:g} s): {json.dumps(counts)}")
    assert not violations, f"{len(violations)} violations, the first: {violations[:5]}"
    assert not errors, f"{len(errors)} errors in workers, the first: {errors[:5]}"
    assert not bad_exits, f"{bad_exits}; events: {events[:5]}"
    assert not monitor.violations, f"bytes on disk above dram_bytes={cap}: {monitor.violations[:3]}"
    assert monitor.max_bytes <= cap
    # it did what it is meant to: reads that found blocks, removes, evictions, kills
    assert counts["hits"] > 0 and counts["removes"] > 0 and counts["stored"] > 0, counts
    assert seconds < 3 or counts["kills"] >= 1, counts
    return counts


def _final_check(cfg: KVConfig, work: Path, violations: list[dict[str, Any]]) -> dict[str, Any]:
    """Every process is gone: a store that joins the pool sweeps what they left; then every
    key reads as its latest generation or misses, and the index agrees with the files."""
    shared = sw.Shared(str(work), sw.N_KEYS)
    ks = sw.stress_keys()
    root = Path(cfg.dram_root)
    with KVStore(cfg) as store:
        idx = list(range(sw.N_KEYS))
        bufs = [bytearray(sw.block_size(i)) for i in idx]
        results = store.get_batch_into(ks, bufs)
        final_hits = 0
        for i, buf, r in zip(idx, bufs, results, strict=True):
            assert r.status in ("hit", "miss"), (i, r)
            if r.hit:
                final_hits += 1
                if bytes(buf) != sw.value(i, shared.gen(i)):
                    violations.append(
                        {"kind": "final_not_latest", "key": i, "head": list(sw._HEAD.unpack_from(buf))}
                    )
        store.flush(60)
        total, files = sw.scan_disk(str(root / BLOCKS_DIR))
        temps = [n for n, _ in files if n.startswith(".")]
        rows = store._pool.index.pool_rows()
        writing = [d for d, row in rows.items() if row[0] == WRITING]
        used = store.stats().tiers["dram"].bytes_used
        owners = sorted(os.listdir(root / "owners"))
        leases = store._pool.index._read("SELECT COUNT(*) FROM leases")[0][0]
        mine = store._pool.owner.token
    assert not temps and not writing, f"left after the sweep: temporary files {temps}, WRITING rows {writing}"
    assert used == total <= cfg.dram_bytes, f"index counts {used} bytes, the files hold {total}"
    assert owners == [mine], f"dead owners' lock files not reaped: {owners}"
    assert leases == 0, f"{leases} leases of dead processes left"
    return {"final_hits": final_hits, "final_bytes": total}


def _events(work: Path) -> list[dict[str, Any]]:
    text = (work / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _counts(work: Path) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for path in sorted((work / "counts").glob("*.json")):
        for k, v in json.loads(path.read_text()).items():
            if k not in ("wid", "done"):
                total[k] = total.get(k, 0) + v
    return total


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tiers", ["dram+local", "dram"])
def test_many_processes_with_removes_pins_and_kills_never_serve_a_stale_byte(
    tiers: str, shm_path: Path, tmp_path: Path
) -> None:
    run_stress(shm_path, tmp_path, local=tiers == "dram+local", seconds=STRESS_S, seed=2112)


# -- the interleavings the stress test found, forced ------------------------------------------
# A remove that recorded its tombstone first and deleted the copies tier by tier afterwards let an
# operation that read its removal sequence (``since``) after the tombstone, but its bytes from a
# tier the remove had not cleaned yet, copy the removed bytes into a tier the remove had already
# cleaned: after the remove returned, the removed value was served. The remove now deletes the DRAM
# and local copies in the tombstone's own transaction; these tests hold each interleaving open.


def test_a_get_during_a_remove_does_not_promote_the_removed_block_back_into_dram(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 2 * PHYS, local_root=str(tmp_path / "local"), high_water=1.0)
    with KVStore(cfg) as remover, KVStore(cfg) as reader:
        ks = keys(3)
        for i, k in enumerate(ks):
            remover.put_batch([k], [payload(i)])
        remover.flush(30)
        assert remover.contains(ks[0]) == "local"
        local = remover._local
        assert local is not None
        delete = local.delete
        during: list[tuple[str, str | None]] = []

        def held_delete(digest: str) -> bool:
            # the remove is under way: tombstoned, its DRAM copy gone, its local copy not yet
            r = reader.get_batch_into([ks[0]], [bytearray(BLOCK)])[0]
            during.append((r.status, r.tier))  # a hit now is fine: the remove has not returned
            reader._writeback.flush(10)  # the hit's promotion lands before the local copy is deleted
            return delete(digest)

        monkeypatch.setattr(local, "delete", held_delete)
        assert remover.remove(ks[:1]) == 1
        monkeypatch.setattr(local, "delete", delete)
        assert during in ([], [("hit", "local")])  # [] where the remove deletes no copy this way
        buf = bytearray(BLOCK)
        r = remover.get_batch_into(ks[:1], [buf])[0]
        assert (r.status, remover.contains(ks[0])) == ("miss", None), (
            f"the removed block is served from {r.tier} after the remove returned "
            f"(its old bytes: {bytes(buf) == payload(0)})"
        )


def test_an_eviction_claimed_during_a_remove_does_not_write_the_removed_block_back_to_local(
    shm_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = KVConfig(str(shm_path / "pool"), 4 * PHYS, local_root=str(tmp_path / "local"), high_water=1.0)
    with KVStore(cfg) as remover, KVStore(cfg) as evictor:
        k = keys(1)[0]
        remover.put_batch([k], [payload(0)])
        assert remover.contains(k) == "dram"
        tombstoned, resume = threading.Event(), threading.Event()
        tombstone = remover._pool.index.remove

        def held_tombstone(*args: Any, **kwargs: Any) -> set[str]:
            found = tombstone(*args, **kwargs)
            tombstoned.set()
            resume.wait(30)  # the remove is under way: its index transaction done, not returned
            return found

        monkeypatch.setattr(remover._pool.index, "remove", held_tombstone)
        removed: list[int] = []
        thread = threading.Thread(target=lambda: removed.append(remover.remove([k])), daemon=True)
        thread.start()
        assert tombstoned.wait(30)
        victims, since = evictor._pool.index.claim_above(0)  # claimed after the tombstone (if still READY)
        assert [v.digest for v in victims] in ([], [k.digest])
        local_reserve = evictor._pool.index.local_reserve

        def held_reserve(*args: Any, **kwargs: Any) -> tuple[str, list[tuple[str, int]]]:
            resume.set()  # the victim's bytes are read (if it still had any): the remove runs to its end
            thread.join(30)
            return local_reserve(*args, **kwargs)

        monkeypatch.setattr(evictor._pool.index, "local_reserve", held_reserve)
        evictor._writeback.evict(victims, since)
        resume.set()
        thread.join(30)
        assert removed == [1]
        buf = bytearray(BLOCK)
        r = remover.get_batch_into([k], [buf])[0]
        assert (r.status, remover.contains(k)) == ("miss", None), (
            f"the removed block is served from {r.tier} after the remove returned "
            f"(its old bytes: {bytes(buf) == payload(0)})"
        )


# -- another PID namespace --------------------------------------------------------------------


def _unshare_or_skip() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root: a PID namespace (unshare --pid) needs CAP_SYS_ADMIN")
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux's unshare to start a worker in another PID namespace")
    probe = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid --fork --mount-proc fails here: {probe.stderr.strip()[:200]}")
    return unshare


def _session_pids(sid: int) -> list[int]:
    """Host PIDs of the processes of session ``sid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:  # state ppid pgrp session
            out.append(int(name))
    return out


def _free_pid() -> int:
    """A PID that no process of this namespace has now (minus one: the ns_last_pid to write)."""
    for last in range(30000, 32700, 7):
        if not os.path.exists(f"/proc/{last + 1}"):
            return last
    pytest.skip("no free PID near 30000 in this namespace")


@pytest.mark.timeout(180)
def test_a_worker_in_another_pid_namespace_keeps_its_pins_and_in_flight_put_until_it_is_killed(
    shm_path: Path, tmp_path: Path
) -> None:
    unshare = _unshare_or_skip()
    cap = 16 * PHYS
    root = shm_path / "pool"
    cfg = KVConfig(str(root), cap, writeback=False, high_water=1.0)
    work = tmp_path / "ns"
    work.mkdir()
    job = sw.NamespacedJob(str(root), cap, str(work), n_pinned=4, delay_s=120.0)
    pinned_keys = sw.namespaced_keys(job)[: job.n_pinned]
    held_key = sw.namespaced_keys(job)[job.n_pinned]
    last = _free_pid()
    module_root = Path(sw.__file__).resolve().parents[sw.__name__.count(".")]
    src_root = Path(shoal.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src_root), str(module_root)])}
    env.pop("SHOAL_FAILPOINTS", None)
    # no exec of python as the shell's last command: it must be forked, to take the PID after `last`
    script = (
        f"echo {last} > /proc/sys/kernel/ns_last_pid; "
        f"{shlex.quote(sys.executable)} -m {sw.__name__} {shlex.quote(sw.job_json(job))}; exit $?"
    )
    monitor = DiskMonitor(root, cap)
    monitor.start()
    log = open(tmp_path / "ns.log", "w+")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", "--mount-proc", "sh", "-c", script],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    host_pids: list[int] = []
    store = None
    try:
        limit = time.monotonic() + 120
        while not (work / "ready").exists():
            assert proc.poll() is None, f"the namespaced worker exited {proc.returncode}: {_log(log)}"
            assert time.monotonic() < limit, f"the namespaced worker was not ready in 120 s: {_log(log)}"
            time.sleep(0.05)
        info = json.loads((work / "ready").read_text())
        token = info["token"]
        host_pids = _session_pids(proc.pid)
        # its PID means nothing here: another number than its own here, and (ns_last_pid) one that
        # no process of this namespace had when the test started
        assert info["pid"] == last + 1, info
        assert info["pid"] not in host_pids, (info, host_pids)
        store = KVStore(cfg)
        assert store._pool.owner.alive(token)
        _fill(store, "fill-a", 3 * 16)  # three times the pool: every unpinned block evicted, twice
        store._pool.sweep()  # a sweep that asks whether the worker lives: it does
        for i, k in enumerate(pinned_keys):
            assert store.contains(k) == "dram", f"pinned block {i} of the live worker was evicted"
        bufs = [bytearray(sw.block_size(i)) for i in range(job.n_pinned)]
        results = store.get_batch_into(pinned_keys, bufs)
        assert all(r.hit and r.tier == "dram" for r in results), results
        assert all(bytes(b) == sw.value(i, 0) for i, b in enumerate(bufs))
        # its put held before the rename: row and temporary file kept, not swept, not served
        assert store._pool.index.pool_row(held_key.digest)[0] == WRITING
        assert _temps_of(root, token, held_key.digest), "the live worker's temporary file was swept"
        assert store.contains(held_key) is None
        r = store.put_batch([held_key], [sw.value(job.n_pinned, 0)])[0]
        assert r.error is None and not r.stored, r  # a live writer is storing it
        assert monitor.max_bytes <= cap

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        limit = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{p}") for p in host_pids) or store._pool.owner.alive(token):
            assert time.monotonic() < limit, f"the killed worker still runs or holds its lock: {host_pids}"
            time.sleep(0.05)
        # the dead writer's reservation is stale: this put sweeps it and stores the block
        r = store.put_batch([held_key], [sw.value(job.n_pinned, 0)])[0]
        assert (r.stored, r.tier, r.error) == (True, "dram", None), r
        assert not _temps_of(root, token), "the dead worker's temporary files were not swept"
        rows = store._pool.index.pool_rows()
        assert not [d for d, row in rows.items() if row[2] == token], "rows of the dead worker remain"
        leases = store._pool.index._read("SELECT COUNT(*) FROM leases WHERE owner = ?", (token,))
        assert leases[0][0] == 0, "the dead worker's pins remain"
        assert token not in os.listdir(root / "owners"), "the dead worker's lock file was not reaped"
        _fill(store, "fill-b", 2 * 16)  # its blocks no longer pinned: evicted like any other
        assert [store.contains(k) for k in pinned_keys] == [None] * job.n_pinned
        total, _ = sw.scan_disk(str(root / BLOCKS_DIR))
        assert store.stats().tiers["dram"].bytes_used == total <= cap
    finally:
        (work / "stop").touch()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for p in host_pids:
            with suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if store is not None:
            store.close()
        monitor.stop()
        log.close()
    assert not monitor.violations, f"bytes on disk above dram_bytes={cap}: {monitor.violations[:3]}"
    print(f"\nPID namespace: pid {info['pid']} there, max disk bytes {monitor.max_bytes} of {cap}")


def _fill(store: KVStore, name: str, n: int) -> None:
    """Put ``n`` new 16 KiB blocks, four a put; each must be stored in DRAM, within capacity."""
    ks = chain_keys(sw.NS, 0, [name] + list(range(n - 1)))
    cap = store.config.dram_bytes
    for start in range(0, n, 4):
        part = ks[start : start + 4]
        results = store.put_batch(part, [payload(5000 + start + j) for j in range(len(part))])
        assert all(r.stored and r.tier == "dram" and r.error is None for r in results), results
        total, files = sw.scan_disk(str(Path(store.config.dram_root) / BLOCKS_DIR))
        assert total <= cap, files


def _temps_of(root: Path, token: str, digest: str = "") -> list[str]:
    names = os.listdir(root / BLOCKS_DIR)
    return [n for n in names if n.startswith(".") and f".{token}.tmp-" in n and digest in n]


def _log(log: Any) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-2000:]
