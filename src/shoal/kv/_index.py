"""The host's block index: one sqlite3 database in the DRAM pool's directory, shared by every
process of this user on the host.

Tables: ``blocks`` (the DRAM pool: digest, payload size, physical bytes, state, owner pid, last
access, which lower tier holds a copy), ``local`` (the local tier's blocks, for its capacity),
``leases`` (pins: digest, owner pid, expiry), ``shared`` (the blocks this host's stores wrote to
the shared tier and did not delete: what ``KVConfig.shared_lookup="host"`` answers from) and
``meta`` (format version, capacity, the running byte totals). Every change is one ``BEGIN
IMMEDIATE`` transaction, so reservations from several processes are serialised by sqlite's write
lock and the totals never pass the capacity.

Eviction order (pool blocks): least recent ``atime`` first; within one batch touched or stored at
one instant, the deepest first: ``depth`` is a block's position in its batch (the caller passes a
prefix's keys head first), so a prefix's tail goes before its head. A block is reusable only if
every block before it is present: evicting a head first would strand its tail.

States of a pool block: ``WRITING`` (bytes reserved, the file being written by ``owner``),
``READY`` (the file is whole), ``EVICTING`` (claimed by ``owner`` to be written back and dropped;
still readable, its bytes still counted). A row whose owner died is swept (:meth:`sweep_dead`).

The index is a cache of what the tiers hold: it lives on tmpfs (``synchronous=OFF``), and a
missing or unreadable one is rebuilt from the files (:class:`shoal.kv.pool.DramPool`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from shoal.errors import ConfigError

WRITING, READY, EVICTING = 0, 1, 2
SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS blocks(
    digest TEXT PRIMARY KEY, size INTEGER NOT NULL, phys INTEGER NOT NULL, state INTEGER NOT NULL,
    owner INTEGER, atime REAL NOT NULL, depth INTEGER NOT NULL DEFAULT 0, lower TEXT);
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(state, atime, depth DESC);
CREATE TABLE IF NOT EXISTS local(digest TEXT PRIMARY KEY, phys INTEGER NOT NULL, atime REAL NOT NULL);
CREATE INDEX IF NOT EXISTS local_lru ON local(atime);
CREATE TABLE IF NOT EXISTS leases(id TEXT NOT NULL, digest TEXT NOT NULL, owner INTEGER NOT NULL,
    expiry REAL NOT NULL);
CREATE INDEX IF NOT EXISTS leases_digest ON leases(digest);
CREATE INDEX IF NOT EXISTS leases_id ON leases(id);
CREATE TABLE IF NOT EXISTS shared(digest TEXT PRIMARY KEY);
"""
_UNPINNED = "NOT EXISTS (SELECT 1 FROM leases l WHERE l.digest = {t}.digest AND l.expiry > ?)"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
    except OSError:
        return True


@dataclass(frozen=True)
class Victim:
    """A pool block claimed for eviction: write it back (unless ``lower`` has it), then drop it."""

    digest: str
    size: int
    phys: int
    lower: str | None


@dataclass
class Reservation:
    """The outcome of :meth:`BlockIndex.reserve` for one digest."""

    digest: str
    outcome: str
    """``reserved`` (write the file, then :meth:`BlockIndex.mark_ready`), ``present`` (stored or being
    stored already), ``full`` (no room even after eviction), ``stale`` (a dead process was writing
    it: sweep the pool, then reserve again)."""
    needed: int = 0
    free: int = 0


class BlockIndex:
    """The sqlite index of one host pool (module docstring). Thread-safe (one connection, a lock)."""

    def __init__(self, path: str, capacity: int, blocks_dir: str | None = None) -> None:
        self.path = path
        self.blocks_dir = blocks_dir
        """Where the pool's block files are (:meth:`release` looks there); None: it does not look."""
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=OFF")
            self._conn.executescript(_SCHEMA)
            self._init_meta(capacity)
        except BaseException:
            self._conn.close()
            raise
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.chmod(path + suffix, 0o600)
        self.capacity = capacity
        self.last_used = 0
        """The pool's bytes in use as the last :meth:`reserve` left them."""

    def _init_meta(self, capacity: int) -> None:
        with self.transaction() as c:
            rows = dict(c.execute("SELECT k, v FROM meta").fetchall())
            if not rows:
                c.executemany(
                    "INSERT INTO meta(k, v) VALUES (?, ?)",
                    [("version", SCHEMA_VERSION), ("capacity", capacity), ("used", 0), ("local_used", 0)],
                )
                return
            if rows.get("version") != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"index version {rows.get('version')} != {SCHEMA_VERSION}")
            if rows.get("capacity") != capacity:
                raise ConfigError(
                    f"the KV pool at {os.path.dirname(self.path)} was created with dram_bytes="
                    f"{rows.get('capacity')}, this store asks for {capacity}: every process of a host must "
                    f"configure the same capacity (or use another dram_root)"
                )

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction (the host-wide write lock), committed on success."""
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    def _read(self, sql: str, args: Sequence[object] = ()) -> list[tuple[object, ...]]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    # -- the pool ---------------------------------------------------------------------------

    def reserve(
        self, items: Sequence[tuple[str, int, int]], writeback: bool, *, keep: Collection[str] = ()
    ) -> tuple[list[Reservation], list[Victim]]:
        """Reserve ``(digest, size, phys)`` for each item in one transaction.

        Returns each item's :class:`Reservation` and the victims claimed (state ``EVICTING``,
        owned by this process) to make room: the caller writes them back / drops them
        (:meth:`release`) and reserves the items marked ``full`` again. No victim is claimed for
        an item that cannot fit even then. The items and ``keep`` (the rest of the caller's put
        batch) are never victims: a block the batch lists and the pool holds is reported
        ``present``, so it must stay (a batch that evicted it would report it stored and lose it).
        """
        now = time.time()
        out: list[Reservation] = []
        claimed: list[Victim] = []
        skip = {d for d, _, _ in items}.union(keep)
        with self.transaction() as c:
            used = _meta(c, "used")
            for digest, size, phys in items:
                row = c.execute("SELECT state, owner FROM blocks WHERE digest = ?", (digest,)).fetchone()
                if row is not None:
                    state, owner = row
                    dead_writer = state == WRITING and owner != self.pid and not pid_alive(int(owner))
                    out.append(Reservation(digest, "stale" if dead_writer else "present"))
                    continue
                if used + phys <= self.capacity:
                    c.execute(
                        "INSERT INTO blocks(digest, size, phys, state, owner, atime) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (digest, size, phys, WRITING, self.pid, now),
                    )
                    used += phys
                    out.append(Reservation(digest, "reserved"))
                    continue
                victims = _lru_unpinned(c, "blocks", used + phys - self.capacity, now, skip=skip)
                free = self.capacity - used
                if victims is None:
                    out.append(Reservation(digest, "full", needed=phys, free=free))
                    continue
                c.executemany(
                    "UPDATE blocks SET state = ?, owner = ? WHERE digest = ?",
                    [(EVICTING, self.pid, v[0]) for v in victims],
                )
                claimed.extend(Victim(*v) for v in victims)
                skip.update(v[0] for v in victims)
                out.append(Reservation(digest, "full", needed=phys, free=free))
            _set_meta(c, "used", used)
        self.last_used = used
        return out, claimed

    def claim_above(self, target: int) -> list[Victim]:
        """Claim LRU unpinned ``READY`` blocks until the bytes not being evicted are <= ``target``."""
        now = time.time()
        with self.transaction() as c:
            used = _meta(c, "used")
            evicting = c.execute("SELECT COALESCE(SUM(phys), 0) FROM blocks WHERE state = ?", (EVICTING,))
            excess = used - int(evicting.fetchone()[0]) - target
            if excess <= 0:
                return []
            victims = _lru_unpinned(c, "blocks", excess, now, partial=True) or []
            c.executemany(
                "UPDATE blocks SET state = ?, owner = ? WHERE digest = ?",
                [(EVICTING, self.pid, v[0]) for v in victims],
            )
        return [Victim(*v) for v in victims]

    def mark_ready(self, written: Sequence[tuple[str, str | None, int]], at: float | None = None) -> None:
        """The files of ``(digest, lower tier holding a copy or None, depth in its put batch)``
        reserved by this process are whole: serve and count them, as used at ``at`` (default now;
        a put batch passes one instant for all its rounds, so its tail is evicted before its head)."""
        if not written:
            return
        now = time.time() if at is None else at
        with self.transaction() as c:
            c.executemany(
                "UPDATE blocks SET state = ?, owner = NULL, atime = ?, depth = ?, lower = ? WHERE digest = ? "
                "AND state = ? AND owner = ?",
                [(READY, now, depth, lower, d, WRITING, self.pid) for d, lower, depth in written],
            )

    def release(
        self,
        digests: Iterable[str],
        *,
        states: Sequence[int] = (EVICTING,),
        owners: Collection[int] | None = None,
    ) -> int:
        """Forget pool rows whose files are gone (the caller deleted them) and free their bytes;
        return bytes freed.

        Only rows still in ``states`` (default ``EVICTING``: the victims an eviction claimed) and,
        with ``owners``, owned by one of them; and a ``READY`` or ``EVICTING`` row only while its
        block file is absent. The row can change between the caller's unlink and this call, and
        freeing it then would leave a file on tmpfs uncounted (the pool over its capacity): a
        victim removed and put again meanwhile (by another thread of this process, so the same
        owner) is ``WRITING`` or ``READY`` again, or claimed anew; a block removed while a put of
        it was under way was renamed into place and marked ``READY`` by that put after the unlink.
        The file's presence is looked at inside the transaction: a put marks its row ``READY``
        only after its rename, and needs this lock to.
        """
        freed = 0
        marks = ",".join("?" * len(states))
        with self.transaction() as c:
            for d in digests:
                row = c.execute(
                    f"SELECT phys, owner, state FROM blocks WHERE digest = ? AND state IN ({marks})",
                    (d, *states),
                ).fetchone()
                if row is None or (owners is not None and row[1] not in owners):
                    continue
                if row[2] != WRITING and self._has_file(d):
                    continue  # written again since the caller's unlink: its bytes stay counted
                c.execute("DELETE FROM blocks WHERE digest = ?", (d,))
                freed += int(row[0])
            _set_meta(c, "used", _meta(c, "used") - freed)
        return freed

    def _has_file(self, digest: str) -> bool:
        return self.blocks_dir is not None and os.path.lexists(os.path.join(self.blocks_dir, digest))

    def unclaim(self, digests: Iterable[str]) -> None:
        """Give claimed victims back (their write-back failed): ``READY`` again, still served."""
        with self.transaction() as c:
            c.executemany(
                "UPDATE blocks SET state = ?, owner = NULL WHERE digest = ? AND state = ? AND owner = ?",
                [(READY, d, EVICTING, self.pid) for d in digests],
            )

    def touch(self, digests: Sequence[str]) -> None:
        """Mark blocks as used at one instant (LRU), in prefix order: the last is evicted first."""
        if digests:
            now = time.time()
            with self.transaction() as c:
                c.executemany(
                    "UPDATE blocks SET atime = ?, depth = ? WHERE digest = ?",
                    [(now, i, d) for i, d in enumerate(digests)],
                )

    def pool_row(self, digest: str) -> tuple[int, int] | None:
        """``(state, phys)`` of a pool block, or None."""
        rows = self._read("SELECT state, phys FROM blocks WHERE digest = ?", (digest,))
        return (int(rows[0][0]), int(rows[0][1])) if rows else None  # type: ignore[call-overload]

    def usage(self) -> tuple[int, int, int, int]:
        """``(pool blocks, pool bytes, local blocks, local bytes)``."""
        rows = self._read(
            "SELECT (SELECT COUNT(*) FROM blocks), (SELECT v FROM meta WHERE k = 'used'), "
            "(SELECT COUNT(*) FROM local), (SELECT v FROM meta WHERE k = 'local_used')"
        )
        a, b, c, d = rows[0]
        return int(a), int(b), int(c), int(d)  # type: ignore[call-overload]

    def evicting_count(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM blocks WHERE state = ?", (EVICTING,))[0][0])  # type: ignore[call-overload]

    # -- leases -----------------------------------------------------------------------------

    def add_lease(self, lease_id: str, digests: Sequence[str], expiry: float) -> None:
        with self.transaction() as c:
            c.executemany(
                "INSERT INTO leases(id, digest, owner, expiry) VALUES (?, ?, ?, ?)",
                [(lease_id, d, self.pid, expiry) for d in digests],
            )

    def drop_lease(self, lease_id: str) -> None:
        with self.transaction() as c:
            c.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    # -- the local tier's accounting --------------------------------------------------------

    def local_reserve(
        self, digest: str, phys: int, capacity: int | None
    ) -> tuple[bool, list[tuple[str, int]]]:
        """Count a local block (unless counted); return (newly counted, LRU victims removed from the
        count to make room, which the caller deletes). Victims are unpinned blocks only."""
        now = time.time()
        with self.transaction() as c:
            if c.execute("SELECT 1 FROM local WHERE digest = ?", (digest,)).fetchone():
                c.execute("UPDATE local SET atime = ? WHERE digest = ?", (now, digest))
                return False, []
            used = _meta(c, "local_used")
            victims: list[tuple[str, int]] = []
            if capacity is not None and used + phys > capacity:
                found = _lru_unpinned(c, "local", used + phys - capacity, now)
                if found is None:
                    raise OverflowError(used + phys - capacity)
                victims = [(v[0], v[2]) for v in found]
                c.executemany("DELETE FROM local WHERE digest = ?", [(v[0],) for v in victims])
                used -= sum(v[1] for v in victims)
            c.execute("INSERT INTO local(digest, phys, atime) VALUES (?, ?, ?)", (digest, phys, now))
            _set_meta(c, "local_used", used + phys)
        return True, victims

    def local_forget(self, digests: Iterable[str]) -> None:
        with self.transaction() as c:
            freed = 0
            for d in digests:
                row = c.execute("SELECT phys FROM local WHERE digest = ?", (d,)).fetchone()
                if row is not None:
                    c.execute("DELETE FROM local WHERE digest = ?", (d,))
                    freed += int(row[0])
            _set_meta(c, "local_used", _meta(c, "local_used") - freed)

    # -- what this host wrote to the shared tier ----------------------------------------------

    def shared_note(self, digest: str) -> None:
        """Record a block this host's store wrote to the shared tier (after the write returned)."""
        with self.transaction() as c:
            c.execute("INSERT OR IGNORE INTO shared(digest) VALUES (?)", (digest,))

    def shared_forget(self, digest: str) -> None:
        with self.transaction() as c:
            c.execute("DELETE FROM shared WHERE digest = ?", (digest,))

    def shared_has(self, digest: str) -> bool:
        return bool(self._read("SELECT 1 FROM shared WHERE digest = ?", (digest,)))

    # -- rebuild and sweep ------------------------------------------------------------------

    def load(
        self, pool: Sequence[tuple[str, int, int, float]], local: Sequence[tuple[str, int, float]]
    ) -> None:
        """Replace the contents with what a scan of the tiers found (``(digest, size, phys, mtime)``
        pool files, ``(digest, phys, mtime)`` local files)."""
        with self.transaction() as c:
            c.execute("DELETE FROM blocks")
            c.execute("DELETE FROM local")
            c.executemany(
                "INSERT INTO blocks(digest, size, phys, state, owner, atime) VALUES (?, ?, ?, ?, NULL, ?)",
                [(d, s, p, READY, t) for d, s, p, t in pool],
            )
            c.executemany("INSERT INTO local(digest, phys, atime) VALUES (?, ?, ?)", local)
            _set_meta(c, "used", sum(p for _, _, p, _ in pool))
            _set_meta(c, "local_used", sum(p for _, p, _ in local))

    def sweep_dead(self) -> tuple[dict[str, int], list[str]]:
        """Drop the leases of dead processes; return the digests a dead process was ``WRITING``
        (with that process: the caller checks their files, and releases the torn ones only while
        still that dead writer's) and the ones it was ``EVICTING`` (now ``READY`` again)."""
        owners = [int(r[0]) for r in self._read("SELECT DISTINCT owner FROM leases")]  # type: ignore[call-overload]
        owners += [int(r[0]) for r in self._read("SELECT DISTINCT owner FROM blocks WHERE owner IS NOT NULL")]  # type: ignore[call-overload]
        dead = sorted({o for o in owners if o != self.pid and not pid_alive(o)})
        if not dead:
            return {}, []
        marks = ",".join("?" * len(dead))
        with self.transaction() as c:
            c.execute(f"DELETE FROM leases WHERE owner IN ({marks})", dead)
            rows = c.execute(
                f"SELECT digest, owner FROM blocks WHERE state = ? AND owner IN ({marks})", (WRITING, *dead)
            )
            writing = {str(r[0]): int(r[1]) for r in rows}
            evicting = [
                r[0]
                for r in c.execute(
                    f"SELECT digest FROM blocks WHERE state = ? AND owner IN ({marks})", (EVICTING, *dead)
                )
            ]
            c.execute(
                f"UPDATE blocks SET state = ?, owner = NULL WHERE state = ? AND owner IN ({marks})",
                (READY, EVICTING, *dead),
            )
        return writing, evicting

    def adopt(self, digests: Sequence[str]) -> None:
        """Take over ``WRITING`` rows of dead processes whose files turned out whole: ``READY``."""
        with self.transaction() as c:
            c.executemany(
                "UPDATE blocks SET state = ?, owner = NULL WHERE digest = ? AND state = ?",
                [(READY, d, WRITING) for d in digests],
            )

    def writers_alive(self) -> set[str]:
        """Digests some live process is writing now (their temporary files must stay)."""
        rows = self._read("SELECT digest, owner FROM blocks WHERE state = ?", (WRITING,))
        return {str(d) for d, o in rows if isinstance(o, int) and pid_alive(o)}


def _meta(c: sqlite3.Connection, key: str) -> int:
    return int(c.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()[0])


def _set_meta(c: sqlite3.Connection, key: str, value: int) -> None:
    c.execute("UPDATE meta SET v = ? WHERE k = ?", (value, key))


def _lru_unpinned(
    c: sqlite3.Connection,
    table: str,
    need: int,
    now: float,
    *,
    skip: Collection[str] = (),
    partial: bool = False,
) -> list[tuple[str, int, int, str | None]] | None:
    """LRU unpinned blocks of ``table``, none of ``skip``, whose bytes add up to ``need`` (None if
    they cannot, unless ``partial``); pool blocks must be ``READY``. Rows: ``(digest, size, phys,
    lower)``."""
    if table == "blocks":
        sql = (
            f"SELECT digest, size, phys, lower FROM blocks b WHERE state = {READY} AND "
            f"{_UNPINNED.format(t='b')} ORDER BY atime, depth DESC"
        )
    else:
        sql = f"SELECT digest, 0, phys, NULL FROM local t WHERE {_UNPINNED.format(t='t')} ORDER BY atime"
    found: list[tuple[str, int, int, str | None]] = []
    total = 0
    for row in c.execute(sql, (now,)):
        if row[0] in skip:
            continue
        found.append((str(row[0]), int(row[1]), int(row[2]), row[3]))
        total += int(row[2])
        if total >= need:
            return found
    return found if partial else None
