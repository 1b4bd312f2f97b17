"""Workers of the KV stress tests: spawned processes that hammer one host pool, and a worker run in
another PID namespace (``python -m <this module> <json>``).

The version protocol that makes a stale byte checkable: every key ``i`` has a generation ``g[i]``
(an int64 in a shared mmap'd file), guarded by an ``flock`` on a per-key lock file (the kernel
releases it when a holder is SIGKILLed). A put takes the key's lock, reads ``g`` and stores
``value(i, g)``; a remove takes it, removes, then bumps ``g``. A get takes no lock: it reads ``g``
before and after, and a hit must be ``value(i, g')`` with ``before <= g' <= after``; a hit of an
older generation is a removed value served. ``value`` starts with ``(i, g)`` so any process can
tell which generation it is looking at, then deterministic bytes of ``(i, g)``.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import random
import struct
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shoal import failpoints
from shoal.errors import InsufficientMemory
from shoal.kv import BlockKey, KVConfig, KVStore, chain_keys
from shoal.kv.pool import BLOCKS_DIR, FP_BEFORE_RENAME

NS = "stress-model/bf16-L2-H2-D64-B16"
SMALL = 4 << 10
LARGE = 16 << 10
N_KEYS = 48
_HEAD = struct.Struct("<qq")


def block_size(i: int) -> int:
    """Key-determined, so every process agrees: every third key is a 4 KiB block, the rest 16 KiB."""
    return SMALL if i % 3 == 0 else LARGE


def stress_keys(n: int = N_KEYS, seq: int = 7) -> list[BlockKey]:
    return chain_keys(NS, 0, [f"stress{seq}"] + list(range(n - 1)))


def value(i: int, g: int) -> bytes:
    """The bytes of key ``i`` at generation ``g``: ``(i, g)`` then deterministic noise."""
    size = block_size(i)
    return _HEAD.pack(i, g) + random.Random(i * 1_000_003 + g).randbytes(size - _HEAD.size)


def scan_disk(blocks_dir: str) -> tuple[int, list[tuple[str, int]]]:
    """Physical bytes of every file in the pool's block directory now (temporary files too), and
    the files. Listed first, then each stat'd: a file renamed meanwhile is not counted twice."""
    try:
        names = os.listdir(blocks_dir)
    except FileNotFoundError:
        return 0, []
    files = []
    total = 0
    for name in names:
        try:
            n = os.lstat(os.path.join(blocks_dir, name)).st_blocks * 512
        except FileNotFoundError:
            continue
        total += n
        files.append((name, n))
    return total, files


# -- the shared state of the protocol ---------------------------------------------------------


@dataclass(frozen=True)
class StressSetup:
    config: KVConfig
    work: str
    """A directory: ``gens`` (the generations), ``locks/<i>``, ``events.jsonl``, ``counts/``, ``go``."""
    n_keys: int = N_KEYS
    lease_s: float = 0.5
    max_put: int = 3


def init_work(work: Path, n_keys: int) -> None:
    (work / "locks").mkdir(parents=True)
    (work / "counts").mkdir()
    (work / "ready").mkdir()
    (work / "gens").write_bytes(bytes(8 * n_keys))
    for i in range(n_keys):
        (work / "locks" / str(i)).touch()
    (work / "events.jsonl").touch()


class Shared:
    """One process's view of the generations and the per-key locks."""

    def __init__(self, work: str, n_keys: int) -> None:
        self.n = n_keys
        fd = os.open(os.path.join(work, "gens"), os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, 8 * n_keys)
        finally:
            os.close(fd)
        # one aligned 8-byte load or store per access (struct.pack_into zero-fills first, so a
        # reader in another process could see a generation of 0 in the middle of a bump)
        self._gens = memoryview(self._mm).cast("q")
        self._locks = [os.open(os.path.join(work, "locks", str(i)), os.O_RDWR) for i in range(n_keys)]

    def gen(self, i: int) -> int:
        return int(self._gens[i])

    def bump(self, i: int) -> None:
        self._gens[i] = self._gens[i] + 1

    @contextmanager
    def locked(self, idx: list[int]) -> Iterator[None]:
        """Hold the flocks of ``idx`` (sorted: no lock-order deadlock between processes)."""
        held: list[int] = []
        try:
            for i in sorted(idx):
                fcntl.flock(self._locks[i], fcntl.LOCK_EX)
                held.append(i)
            yield
        finally:
            for i in reversed(held):
                fcntl.flock(self._locks[i], fcntl.LOCK_UN)


class Recorder:
    """Violations and errors as JSON lines (``O_APPEND``: one write each, nothing lost to a later
    SIGKILL), and this worker's counts (replaced atomically, every half second and at the end)."""

    def __init__(self, work: str, wid: int) -> None:
        self.work = work
        self.wid = wid
        self.fd = os.open(os.path.join(work, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self.counts: dict[str, Any] = {
            "wid": wid,
            "ops": 0,
            "puts": 0,
            "put_keys": 0,
            "stored": 0,
            "gets": 0,
            "get_keys": 0,
            "hits": 0,
            "misses": 0,
            "removes": 0,
            "removed_keys": 0,
            "removed_found": 0,
            "pins": 0,
            "unpins": 0,
            "errors": 0,
            "violations": 0,
            "done": False,
        }
        self._last = 0.0

    def event(self, kind: str, **info: Any) -> None:
        line = json.dumps({"kind": kind, "wid": self.wid, "pid": os.getpid(), "t": time.time(), **info})
        os.write(self.fd, (line + "\n").encode())
        self.counts["errors" if kind in ("error", "exception") else "violations"] += 1

    def save(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        path = os.path.join(self.work, "counts", f"{self.wid}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.counts, f)
        os.replace(tmp, path)


# -- the stress worker ------------------------------------------------------------------------


def stress_worker(setup: StressSetup, wid: int, seed: int) -> None:
    """Put, get, remove, pin and unpin overlapping keys until the end time in ``work/go``."""
    rec = Recorder(setup.work, wid)
    try:
        _stress(setup, wid, seed, rec)
    except BaseException:  # noqa: B036 - everything a worker raises is a failure of the test
        rec.event("exception", error=traceback.format_exc())
        rec.save(force=True)
        os._exit(1)
    rec.counts["done"] = True
    rec.save(force=True)


def _stress(setup: StressSetup, wid: int, seed: int, rec: Recorder) -> None:
    rng = random.Random(seed)
    shared = Shared(setup.work, setup.n_keys)
    ks = stress_keys(setup.n_keys)
    cap = setup.config.dram_bytes
    c = rec.counts
    store = KVStore(setup.config)
    Path(setup.work, "ready", str(wid)).touch()
    go = Path(setup.work, "go")
    while not go.exists():
        time.sleep(0.01)
    end_at = float(go.read_text())
    lease = None
    lease_at = 0.0
    while time.time() < end_at:
        c["ops"] += 1
        r = rng.random()
        if lease is not None and (time.monotonic() - lease_at > 0.25 or r < 0.05):
            store.unpin(lease)
            lease = None
            c["unpins"] += 1
        elif r < 0.36:
            _put(store, shared, ks, rng.sample(range(setup.n_keys), rng.randint(1, setup.max_put)), rec)
        elif r < 0.80:
            _get(store, shared, ks, rng.sample(range(setup.n_keys), rng.randint(1, 6)), rec)
        elif r < 0.92:
            _remove(store, shared, ks, rng.sample(range(setup.n_keys), rng.randint(1, 2)), rec)
        elif lease is None:
            # one key a lease: five workers' pins never hold more than part of the pool, so a full
            # pool is always one whose blocks will be evictable soon (a put waits for those)
            idx = rng.sample(range(setup.n_keys), 1)
            lease = store.pin([ks[i] for i in idx], lease_s=setup.lease_s)
            lease_at = time.monotonic()
            c["pins"] += 1
        if c["ops"] % 64 == 0:
            used = store.stats().tiers["dram"].bytes_used or 0
            if used > cap:
                rec.event("index_over_capacity", used=used, cap=cap)
        rec.save()
    if lease is not None:
        store.unpin(lease)
        c["unpins"] += 1
    store.close()


def _put(store: KVStore, shared: Shared, ks: list[BlockKey], idx: list[int], rec: Recorder) -> None:
    c = rec.counts
    with shared.locked(idx):
        gens = [shared.gen(i) for i in idx]
        results = store.put_batch([ks[i] for i in idx], [value(i, g) for i, g in zip(idx, gens, strict=True)])
    c["puts"] += 1
    c["put_keys"] += len(idx)
    for i, g, res in zip(idx, gens, results, strict=True):
        if res.error is not None:
            kind = "insufficient_memory" if isinstance(res.error, InsufficientMemory) else "error"
            rec.event("error", op="put", key=i, gen=g, what=kind, error=repr(res.error))
        elif res.stored:
            c["stored"] += 1
        elif res.tier is None:
            # under the key's lock no remove can be under way: a put reported as overtaken
            rec.event("put_overtaken", key=i, gen=g)


def _get(store: KVStore, shared: Shared, ks: list[BlockKey], idx: list[int], rec: Recorder) -> None:
    c = rec.counts
    before = [shared.gen(i) for i in idx]
    bufs = [bytearray(block_size(i)) for i in idx]
    results = store.get_batch_into([ks[i] for i in idx], bufs)
    after = [shared.gen(i) for i in idx]
    c["gets"] += 1
    c["get_keys"] += len(idx)
    for i, g0, g1, buf, res in zip(idx, before, after, bufs, results, strict=True):
        if res.status == "miss":
            c["misses"] += 1
            continue
        if res.status != "hit":
            rec.event("error", op="get", key=i, error=repr(res.error))
            continue
        c["hits"] += 1
        ki, g = _HEAD.unpack_from(buf)
        if ki != i or not 0 <= g < 1 << 40 or bytes(buf) != value(i, g):
            rec.event("corrupt_hit", key=i, tier=res.tier, before=g0, after=g1, head=[ki, g])
        elif g < g0:
            rec.event("removed_value_served", key=i, tier=res.tier, served=g, before=g0, after=g1)
        elif g > g1:
            rec.event("future_value_served", key=i, tier=res.tier, served=g, before=g0, after=g1)


def _remove(store: KVStore, shared: Shared, ks: list[BlockKey], idx: list[int], rec: Recorder) -> None:
    c = rec.counts
    with shared.locked(idx):
        found = store.remove([ks[i] for i in idx])
        for i in idx:
            shared.bump(i)
    c["removes"] += 1
    c["removed_keys"] += len(idx)
    c["removed_found"] += found


# -- the worker in another PID namespace ------------------------------------------------------


@dataclass(frozen=True)
class NamespacedJob:
    dram_root: str
    dram_bytes: int
    work: str
    """``ready`` (written with this worker's pid, owner token and digests), ``stop`` (it exits)."""
    n_pinned: int
    delay_s: float
    seq: int = 50


def namespaced_keys(job: NamespacedJob) -> list[BlockKey]:
    """The pinned keys, then the key of the put held before its rename."""
    return chain_keys(NS, 0, [f"pidns{job.seq}"] + list(range(job.n_pinned)))


def namespaced_worker(job: NamespacedJob) -> None:
    """Put and pin ``n_pinned`` blocks for an hour, start a put held before its rename (in a
    thread), say ``ready`` and wait for ``stop`` (at most 60 s). Killed by the test meanwhile."""
    ks = namespaced_keys(job)
    store = KVStore(KVConfig(job.dram_root, job.dram_bytes, writeback=False, high_water=1.0))
    pinned, held = ks[: job.n_pinned], ks[job.n_pinned]
    results = store.put_batch(pinned, [value(i, 0) for i in range(job.n_pinned)])
    if not all(r.stored for r in results):
        raise SystemExit(f"the pinned puts did not all store: {results}")
    store.pin(pinned, lease_s=3600)
    failpoints.configure(f"{FP_BEFORE_RENAME}=delay:{job.delay_s}")
    thread = threading.Thread(target=store.put_batch, args=([held], [value(job.n_pinned, 0)]), daemon=True)
    thread.start()
    blocks = os.path.join(job.dram_root, BLOCKS_DIR)
    for _ in range(3000):  # the held put's temporary file is written, its rename not done
        if any(n.startswith(f".{held.digest}.") for n in os.listdir(blocks)):
            break
        time.sleep(0.01)
    else:
        raise SystemExit("the held put never wrote its temporary file")
    info = {
        "pid": os.getpid(),
        "token": store._pool.owner.token,
        "pinned": [k.digest for k in pinned],
        "held": held.digest,
    }
    ready = Path(job.work, "ready")
    ready.with_suffix(".tmp").write_text(json.dumps(info))
    os.replace(ready.with_suffix(".tmp"), ready)
    stop = Path(job.work, "stop")
    end = time.monotonic() + 60
    while not stop.exists() and time.monotonic() < end:
        time.sleep(0.05)
    with suppress(Exception):
        store.close()
    os._exit(0)


def main(argv: list[str]) -> None:
    job = NamespacedJob(**json.loads(argv[1]))
    namespaced_worker(job)


def job_json(job: NamespacedJob) -> str:
    return json.dumps(asdict(job))


if __name__ == "__main__":
    main(sys.argv)
