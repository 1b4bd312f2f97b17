"""The host's block index: one sqlite3 database in the DRAM pool's directory, shared by every
process of this user on the host.

Tables: ``blocks`` (the DRAM pool: digest, payload size, physical bytes, state, owner, last
access, which lower tier holds a copy), ``local`` (the local tier's blocks, for its capacity),
``leases`` (pins: digest, owner, expiry), ``shared`` (the blocks this host's stores wrote to the
shared tier and did not delete, with the removal sequence number they were written under),
``removed`` (tombstones: the sequence number of each block's latest ``remove``) and ``meta``
(format version, capacity, the running byte totals, the removal sequence, whether the contents
are whole). Every change is one ``BEGIN IMMEDIATE`` transaction, so reservations from several
processes are serialised by sqlite's write lock and the totals never pass the capacity. No
transaction handles more than :data:`TXN_KEYS` keys (the store cuts larger batches), so none
holds the lock for long; reads use a second connection and never wait on a writer (WAL).

Owners: every row a process is responsible for (a block it writes or evicts, a pin) names the
token of its :class:`~shoal.kv._owners.OwnerLock`; a row whose owner's lock nobody holds belongs
to a dead process and is swept (:meth:`BlockIndex.sweep_dead`), in any PID namespace.

Eviction order (pool blocks): least recent ``atime`` first; within one batch touched or stored at
one instant, the deepest first: ``depth`` is a block's position in its batch (the caller passes a
prefix's keys head first), so a prefix's tail goes before its head.

States of a pool block: ``WRITING`` (bytes reserved, the file being written by ``owner``),
``READY`` (the file is whole), ``EVICTING`` (claimed by ``owner`` to be written back; still
served, still counted; a pin taken now keeps it), ``DROPPING`` (its eviction is decided: the file
is about to be unlinked; still counted until it is).

Removal order: ``remove`` takes a sequence number (``meta.seq``), records it as the block's
tombstone and deletes the pool and local copies, all in one transaction. Everything that makes a
copy appear from bytes it read earlier (a put, a promotion of a lower-tier hit, a write-back)
carries the sequence number it read before reading its bytes (``since``) and makes its copy
visible (the rename into the pool or the local tier) inside a transaction that first checks for a
tombstone newer than ``since``: if there is one, the copy is discarded. An operation that read
``since`` after the remove committed found no old bytes to read. So a remove wins over every
operation that was under way when it was called, and a put that starts after it returns is not
affected by it. Copies on the
shared tier (an object store cannot rename) are checked after their upload and deleted if a
remove came meanwhile; until then, a host that sees the tombstone does not serve them.

The index is a cache of what the tiers hold: it lives on tmpfs (``synchronous=OFF``), and a
missing, damaged or half-built one is rebuilt from the files (:class:`shoal.kv.pool.DramPool`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from time import perf_counter  # a transaction's hold time (tests move the module's `time` clock)

from shoal.errors import ConfigError, TierError
from shoal.kv._owners import OwnerLock

WRITING, READY, EVICTING, DROPPING = 0, 1, 2, 3
SCHEMA_VERSION = 3
TXN_KEYS = 256
"""The most keys one index transaction handles (a put batch is cut into transactions of this many)."""
LOCK_WAIT_S = 30.0
"""How long a write waits for the host-wide index lock before it is a :class:`TierError`."""
TOMBSTONES = 1 << 16
"""Tombstones kept; older ones are forgotten, and an operation that started before the oldest
kept one is treated as overtaken by a remove (it discards its copy: a miss later, never a stale hit)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS blocks(
    digest TEXT PRIMARY KEY, size INTEGER NOT NULL, phys INTEGER NOT NULL, state INTEGER NOT NULL,
    owner TEXT, atime REAL NOT NULL, depth INTEGER NOT NULL DEFAULT 0, lower TEXT);
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(state, atime, depth DESC);
CREATE INDEX IF NOT EXISTS blocks_owner ON blocks(owner);
CREATE TABLE IF NOT EXISTS local(digest TEXT PRIMARY KEY, phys INTEGER NOT NULL, atime REAL NOT NULL,
    state INTEGER NOT NULL DEFAULT 1, owner TEXT);
CREATE INDEX IF NOT EXISTS local_lru ON local(atime);
CREATE TABLE IF NOT EXISTS leases(id TEXT NOT NULL, digest TEXT NOT NULL, owner TEXT NOT NULL,
    expiry REAL NOT NULL);
CREATE INDEX IF NOT EXISTS leases_digest ON leases(digest);
CREATE INDEX IF NOT EXISTS leases_id ON leases(id);
CREATE TABLE IF NOT EXISTS shared(digest TEXT PRIMARY KEY, gen INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS removed(digest TEXT PRIMARY KEY, seq INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS removed_seq ON removed(seq);
"""
_TABLES = ("meta", "blocks", "local", "leases", "shared", "removed")
_META = ("version", "capacity", "used", "local_used", "seq", "floor", "complete")
_UNPINNED = "NOT EXISTS (SELECT 1 FROM leases l WHERE l.digest = {t}.digest AND l.expiry > ?)"


class IndexDamaged(sqlite3.DatabaseError):
    """The index opened but cannot be trusted (half built, wrong version, inconsistent): rebuild it."""


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
    """``reserved`` (write the file, then :meth:`BlockIndex.commit`), ``present`` (stored or being
    stored already), ``full`` (no room even after eviction), ``stale`` (a dead process was writing
    it: sweep the pool, then reserve again)."""
    needed: int = 0
    free: int = 0


@dataclass(frozen=True)
class Pending:
    """A pool block written to its temporary file, waiting for :meth:`BlockIndex.commit`."""

    digest: str
    tmp: str
    lower: str | None
    depth: int


class BlockIndex:
    """The sqlite index of one host pool (module docstring). Thread-safe: one connection for
    writes and one for reads, each behind a lock."""

    def __init__(self, path: str, capacity: int, blocks_dir: str | None, owner: OwnerLock) -> None:
        self.path = path
        self.blocks_dir = blocks_dir
        """Where the pool's block files are; None: an index without files (tests of the accounting)."""
        self.owner = owner
        self.me = owner.token
        self._lock = threading.Lock()
        self._rlock = threading.Lock()
        self.longest_write_s = 0.0
        """The longest this process held the index's write lock, from ``BEGIN`` granted to ``COMMIT`` done."""
        self._conn = self._connect(LOCK_WAIT_S)
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=OFF")
            self._conn.executescript(_SCHEMA)
            try:
                self._init_meta(capacity)
            except (ConfigError, sqlite3.DatabaseError):
                raise
            except TierError as e:
                if "locked" in str(e.__cause__):
                    raise  # busy, not damaged: never rebuild an index another process holds
                raise IndexDamaged(f"unreadable meta rows: {e}") from e
            except (TypeError, ValueError, KeyError) as e:  # rows a damaged page made up
                raise IndexDamaged(f"unreadable meta rows: {e}") from e
            self._rconn = self._connect(5.0)
        except BaseException:
            self._conn.close()
            raise
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.chmod(path + suffix, 0o600)
        self.capacity = capacity
        self.last_used = 0
        """The pool's bytes in use as the last :meth:`reserve` left them."""

    def _connect(self, timeout: float) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)

    def _init_meta(self, capacity: int) -> None:
        with self.transaction() as c:
            rows = dict(c.execute("SELECT k, v FROM meta").fetchall())
            if not rows:
                if c.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]:
                    raise IndexDamaged("the index has block rows but no meta rows")
                c.executemany(
                    "INSERT INTO meta(k, v) VALUES (?, ?)",
                    [
                        ("version", SCHEMA_VERSION),
                        ("capacity", capacity),
                        ("used", 0),
                        ("local_used", 0),
                        ("seq", 0),
                        ("floor", 0),
                        ("complete", 0),
                    ],
                )
                return
            if rows.get("version") != SCHEMA_VERSION:
                raise IndexDamaged(f"index version {rows.get('version')} != {SCHEMA_VERSION}")
            if set(rows) != set(_META):
                raise IndexDamaged(f"index meta rows {sorted(map(str, rows))} are not {sorted(_META)}")
            if rows.get("capacity") != capacity:
                raise ConfigError(
                    f"the KV pool at {os.path.dirname(self.path)} was created with dram_bytes="
                    f"{rows.get('capacity')}, this store asks for {capacity}: every process of a host must "
                    f"configure the same capacity (or use another dram_root)"
                )

    def check(self) -> None:
        """Raise :class:`sqlite3.DatabaseError` unless the database is sound and was built whole.

        ``PRAGMA quick_check`` reads every page (a damaged page, a truncated file); ``complete``
        is set by the transaction that fills a rebuilt index, so a process killed mid-rebuild
        leaves an index that is refused here and rebuilt again.
        """
        with self._lock:
            try:
                self._check()
            except (TypeError, ValueError, IndexError) as e:  # values a damaged page made up
                raise IndexDamaged(f"unreadable rows: {e}") from e

    def _check(self) -> None:
        rows = self._conn.execute("PRAGMA quick_check").fetchall()
        if rows != [("ok",)]:
            raise IndexDamaged(f"quick_check: {'; '.join(str(r[0]) for r in rows[:3])}")
        names = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not set(_TABLES) <= names:
            raise IndexDamaged(f"tables missing: {sorted(set(_TABLES) - names)}")
        complete = self._conn.execute("SELECT v FROM meta WHERE k = 'complete'").fetchone()
        if complete is None or complete[0] != 1:
            raise IndexDamaged("the index was never filled completely (a rebuild was interrupted)")
        used, rows_sum = self._conn.execute(
            "SELECT (SELECT v FROM meta WHERE k = 'used'), (SELECT COALESCE(SUM(phys), 0) FROM blocks)"
        ).fetchone()
        if used != rows_sum or used > self.capacity_meta():
            raise IndexDamaged(f"the running total {used} is not the rows' {rows_sum}, or above capacity")

    def capacity_meta(self) -> int:
        return int(self._conn.execute("SELECT v FROM meta WHERE k = 'capacity'").fetchone()[0])

    def close(self) -> None:
        with self._lock, self._rlock:
            self._conn.close()
            self._rconn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction (the host-wide write lock), committed on success.

        sqlite's own errors (a lock not granted within :data:`LOCK_WAIT_S`, a page damaged since
        the index was opened) are :class:`TierError` s naming the index.
        """
        with self._lock:
            c = self._conn
            try:
                c.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise self._error("lock", e) from e
            t0 = perf_counter()
            try:
                try:
                    yield c
                except BaseException as err:
                    with suppress(sqlite3.Error):
                        c.execute("ROLLBACK")
                    if isinstance(err, sqlite3.Error):
                        raise self._error("update", err) from err
                    raise
                try:
                    c.execute("COMMIT")
                except sqlite3.Error as e:
                    raise self._error("commit to", e) from e
            finally:
                self.longest_write_s = max(self.longest_write_s, perf_counter() - t0)

    def _error(self, what: str, err: sqlite3.Error) -> TierError:
        if isinstance(err, sqlite3.OperationalError) and "locked" in str(err):
            return TierError(
                f"could not {what} the KV pool index {self.path}: another process held its lock for "
                f"more than {LOCK_WAIT_S:.0f} s ({err})"
            )
        return TierError(
            f"could not {what} the KV pool index {self.path}: {type(err).__name__}: {err}; if it is "
            "damaged, close every store of this pool and open one again (it is rebuilt from the block files)"
        )

    def _read(self, sql: str, args: Sequence[object] = ()) -> list[tuple[object, ...]]:
        """A read on the second connection: it sees the last committed state and waits on no writer."""
        with self._rlock:
            try:
                return self._rconn.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise self._error("read", e) from e

    # -- removal order ------------------------------------------------------------------------

    def seq(self) -> int:
        """The removal sequence now: what an operation about to read bytes carries as ``since``."""
        return int(self._read("SELECT v FROM meta WHERE k = 'seq'")[0][0])  # type: ignore[call-overload]

    def remove(self, digests: Sequence[str], unlink: Callable[[str], bool]) -> set[str]:
        """Remove blocks from the pool and the local tier in one transaction; return those some
        copy of was there.

        Inside it: a tombstone for each digest with a new sequence number, then ``unlink(digest)``
        (the caller deletes the pool and local files; whether one existed), then the rows go and
        their bytes are freed. Anything that reads the sequence number before this commits and
        copies the old bytes is stopped by the tombstone (its commit checks for a newer one);
        anything that reads it after finds no old bytes left to copy, on either tier. A pool or
        local row being written (``WRITING``) is not freed here: its writer's commit finds the
        tombstone and frees it.
        """
        found: set[str] = set()
        with self.transaction() as c:
            seq = _meta(c, "seq") + 1
            _set_meta(c, "seq", seq)
            c.executemany(
                "INSERT OR REPLACE INTO removed(digest, seq) VALUES (?, ?)", [(d, seq) for d in digests]
            )
            freed = local_freed = 0
            for d in digests:
                if unlink(d):
                    found.add(d)
                row = c.execute("SELECT phys, state FROM blocks WHERE digest = ?", (d,)).fetchone()
                if row is not None and row[1] != WRITING:
                    c.execute("DELETE FROM blocks WHERE digest = ?", (d,))
                    freed += int(row[0])
                row = c.execute("SELECT phys, state FROM local WHERE digest = ?", (d,)).fetchone()
                if row is not None and row[1] != WRITING:
                    c.execute("DELETE FROM local WHERE digest = ?", (d,))
                    local_freed += int(row[0])
            if freed:
                _set_meta(c, "used", _meta(c, "used") - freed)
            if local_freed:
                _set_meta(c, "local_used", _meta(c, "local_used") - local_freed)
            self._prune_tombstones(c)
        return found

    def _prune_tombstones(self, c: sqlite3.Connection) -> None:
        n = int(c.execute("SELECT COUNT(*) FROM removed").fetchone()[0])
        if n > TOMBSTONES:
            cut = c.execute(
                "SELECT seq FROM removed ORDER BY seq LIMIT 1 OFFSET ?", (n - TOMBSTONES // 2,)
            ).fetchone()
            if cut is not None:
                c.execute("DELETE FROM removed WHERE seq < ?", (cut[0],))
                _set_meta(c, "floor", max(_meta(c, "floor"), int(cut[0]) - 1))

    def removed_since(self, digests: Iterable[str], since: int) -> set[str]:
        """Those of ``digests`` removed after ``since`` (all of them if ``since`` predates the
        oldest tombstone kept)."""
        return _removed_since(self._read, list(digests), since)

    def stale_shared(self, digests: Sequence[str]) -> set[str]:
        """Those of ``digests`` that a remove on this host took from the shared tier and that no
        upload since has put back: a copy there now is one a remove overtook (not served)."""
        out: set[str] = set()
        for part in _chunks(list(digests), TXN_KEYS):
            marks = ",".join("?" * len(part))
            rows = self._read(
                f"SELECT r.digest FROM removed r LEFT JOIN shared s ON s.digest = r.digest "
                f"WHERE r.digest IN ({marks}) AND (s.digest IS NULL OR s.gen < r.seq)",
                part,
            )
            out.update(str(r[0]) for r in rows)
        return out

    # -- the pool ---------------------------------------------------------------------------

    def reserve(
        self,
        items: Sequence[tuple[str, int, int]],
        *,
        keep: Collection[str] = (),
        resume: list[LruMark | None] | None = None,
    ) -> tuple[list[Reservation], list[Victim], int]:
        """Reserve ``(digest, size, phys)`` for each item (at most :data:`TXN_KEYS`) in one transaction.

        Returns each item's :class:`Reservation`, the victims claimed (state ``EVICTING``, owned by
        this process) to make room, and the removal sequence the reservation was made under (the
        ``since`` of :meth:`commit`). The caller evicts the victims and reserves the items marked
        ``full`` again. No victim is claimed for an item that cannot fit even then. The items and
        ``keep`` (the rest of the caller's put batch) are never victims: a block the batch lists
        and the pool holds is reported ``present``, so it must stay. A ``READY`` row whose file has
        gone (deleted behind the index's back) is forgotten and reserved anew, so a key is never
        stuck as present without bytes. The LRU candidates are read once per call, and ``resume``
        (a one-element list the caller keeps for its whole batch) carries where the scan stopped
        into the next call, so a batch costs time linear in its size.
        """
        now = time.time()
        out: list[Reservation] = []
        claimed: list[Victim] = []
        skip = {d for d, _, _ in items}.union(keep)
        full_bytes = claimed_bytes = 0
        with self.transaction() as c:
            since = _meta(c, "seq")
            used = _meta(c, "used")
            lru = _Candidates(c, "blocks", now, skip, resume[0] if resume else None)
            for digest, size, phys in items:
                row = c.execute(
                    "SELECT state, owner, phys FROM blocks WHERE digest = ?", (digest,)
                ).fetchone()
                if row is not None:
                    state, owner, had = row
                    if state == READY and not self._has_file(digest):
                        c.execute("DELETE FROM blocks WHERE digest = ?", (digest,))
                        used -= int(had)
                    else:
                        dead_writer = state == WRITING and not self.owner.alive(owner)
                        out.append(Reservation(digest, "stale" if dead_writer else "present"))
                        continue
                if used + phys <= self.capacity:
                    c.execute(
                        "INSERT INTO blocks(digest, size, phys, state, owner, atime) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (digest, size, phys, WRITING, self.me, now),
                    )
                    used += phys
                    out.append(Reservation(digest, "reserved"))
                    continue
                # the victims claimed so far make room for the items already found full; this one
                # needs room beyond theirs
                victims = lru.take(used + full_bytes + phys - self.capacity - claimed_bytes)
                if victims is not None:
                    claimed.extend(victims)
                    claimed_bytes += sum(v.phys for v in victims)
                    full_bytes += phys
                out.append(Reservation(digest, "full", needed=phys, free=self.capacity - used))
            lru.close()
            if resume is not None:
                resume[0] = lru.mark
            c.executemany(
                "UPDATE blocks SET state = ?, owner = ? WHERE digest = ? AND state = ?",
                [(EVICTING, self.me, v.digest, READY) for v in claimed],
            )
            _set_meta(c, "used", used)
        self.last_used = used
        return out, claimed, since

    def commit(
        self, pending: Sequence[Pending], since: int, at: float | None = None
    ) -> tuple[list[str], list[str], dict[str, OSError]]:
        """Make written blocks visible: rename each temporary file into place and mark it ``READY``
        (counted, served, used at ``at``: a put batch passes one instant for all its rounds, so its
        tail is evicted before its head) inside one transaction, unless a remove came after
        ``since``. Returns ``(committed, removed, failed renames)``; the caller deletes the
        temporary files of the last two and releases their rows (:meth:`release_mine`)."""
        now = time.time() if at is None else at
        committed: list[str] = []
        failed: dict[str, OSError] = {}
        if not pending:
            return committed, [], failed
        assert self.blocks_dir is not None
        with self.transaction() as c:
            gone = _removed_since(_conn_read(c), [p.digest for p in pending], since)
            for p in pending:
                if p.digest in gone:
                    continue
                row = c.execute("SELECT state, owner FROM blocks WHERE digest = ?", (p.digest,)).fetchone()
                if row is None or row[0] != WRITING or row[1] != self.me:
                    failed[p.digest] = FileNotFoundError(f"the reservation of {p.digest} was taken over")
                    continue
                try:
                    os.rename(p.tmp, os.path.join(self.blocks_dir, p.digest))
                except OSError as e:
                    failed[p.digest] = e
                    continue
                c.execute(
                    "UPDATE blocks SET state = ?, owner = NULL, atime = ?, depth = ?, lower = ? "
                    "WHERE digest = ?",
                    (READY, now, p.depth, p.lower, p.digest),
                )
                committed.append(p.digest)
        return committed, sorted(gone), failed

    def release_mine(self, digests: Iterable[str]) -> int:
        """Free this process's ``WRITING`` reservations that will not be committed (no file was
        renamed into place for them). Returns bytes freed."""
        return self.release(digests, states=(WRITING,), owners={self.me})

    def writing_mine(self, digests: Sequence[str]) -> list[str]:
        """Those of ``digests`` this process holds ``WRITING`` reservations of (uncommitted)."""
        out: list[str] = []
        for part in _chunks(list(digests), TXN_KEYS):
            marks = ",".join("?" * len(part))
            rows = self._read(
                f"SELECT digest FROM blocks WHERE state = ? AND owner = ? AND digest IN ({marks})",
                (WRITING, self.me, *part),
            )
            out += [str(r[0]) for r in rows]
        return out

    def claim_above(self, target: int) -> tuple[list[Victim], int]:
        """Claim LRU unpinned ``READY`` blocks until the bytes not being evicted are <= ``target``
        (at most :data:`TXN_KEYS`); also the removal sequence they were claimed under."""
        now = time.time()
        with self.transaction() as c:
            since = _meta(c, "seq")
            used = _meta(c, "used")
            evicting = c.execute(
                "SELECT COALESCE(SUM(phys), 0) FROM blocks WHERE state IN (?, ?)", (EVICTING, DROPPING)
            )
            excess = used - int(evicting.fetchone()[0]) - target
            if excess <= 0:
                return [], since
            lru = _Candidates(c, "blocks", now, ())
            victims = lru.take(excess, partial=True, limit=TXN_KEYS) or []
            lru.close()
            c.executemany(
                "UPDATE blocks SET state = ?, owner = ? WHERE digest = ? AND state = ?",
                [(EVICTING, self.me, v.digest, READY) for v in victims],
            )
        return victims, since

    def decide_drop(self, digests: Sequence[str]) -> list[str]:
        """The eviction of claimed victims is decided: those still claimed by this process and not
        pinned now become ``DROPPING`` (returned: unlink them, then :meth:`release`); a victim
        pinned since it was claimed is ``READY`` again (a pin taken before this point keeps it)."""
        now = time.time()
        drop: list[str] = []
        with self.transaction() as c:
            for d in digests:
                row = c.execute(
                    f"SELECT {_UNPINNED.format(t='b')} FROM blocks b "
                    "WHERE digest = ? AND state = ? AND owner = ?",
                    (now, d, EVICTING, self.me),
                ).fetchone()
                if row is None:
                    continue
                if row[0]:
                    c.execute("UPDATE blocks SET state = ? WHERE digest = ?", (DROPPING, d))
                    drop.append(d)
                else:
                    c.execute("UPDATE blocks SET state = ?, owner = NULL WHERE digest = ?", (READY, d))
        return drop

    def release(
        self,
        digests: Iterable[str],
        *,
        states: Sequence[int] = (EVICTING, DROPPING),
        owners: Collection[str | None] | None = None,
    ) -> int:
        """Forget pool rows whose files are gone (the caller deleted them) and free their bytes;
        return bytes freed.

        Only rows still in ``states`` and, with ``owners``, owned by one of them; and a row not
        ``WRITING`` only while its block file is absent (looked at inside the transaction): the
        row can change between the caller's unlink and this call (a victim removed and put again
        meanwhile), and freeing it then would leave a file on tmpfs uncounted.
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
            if freed:
                _set_meta(c, "used", _meta(c, "used") - freed)
        return freed

    def _has_file(self, digest: str) -> bool:
        return self.blocks_dir is not None and os.path.lexists(os.path.join(self.blocks_dir, digest))

    def unclaim(self, digests: Iterable[str]) -> None:
        """Give claimed victims back (their write-back failed or was interrupted): ``READY`` again."""
        with self.transaction() as c:
            c.executemany(
                "UPDATE blocks SET state = ?, owner = NULL "
                "WHERE digest = ? AND state IN (?, ?) AND owner = ?",
                [(READY, d, EVICTING, DROPPING, self.me) for d in digests],
            )

    def touch(self, items: Sequence[tuple[str, float, int]]) -> None:
        """Mark blocks as used (LRU): ``(digest, when, depth in its batch)``; the deepest of one
        instant is evicted first. Called off the read path (the store defers it)."""
        for part in _chunks(list(items), TXN_KEYS):
            with self.transaction() as c:
                c.executemany(
                    "UPDATE blocks SET atime = ?, depth = ? WHERE digest = ?", [(t, i, d) for d, t, i in part]
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

    def in_flight_count(self) -> int:
        """Pool blocks that will be evictable or freed soon: being evicted, or being written by
        another process (its put will mark them ``READY`` or free them)."""
        rows = self._read(
            "SELECT COUNT(*) FROM blocks WHERE state IN (?, ?) OR (state = ? AND owner != ?)",
            (EVICTING, DROPPING, WRITING, self.me),
        )
        return int(rows[0][0])  # type: ignore[call-overload]

    # -- leases -----------------------------------------------------------------------------

    def add_lease(self, lease_id: str, digests: Sequence[str], expiry: float) -> None:
        with self.transaction() as c:
            c.executemany(
                "INSERT INTO leases(id, digest, owner, expiry) VALUES (?, ?, ?, ?)",
                [(lease_id, d, self.me, expiry) for d in digests],
            )

    def drop_lease(self, lease_id: str) -> None:
        with self.transaction() as c:
            c.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    # -- the local tier's accounting --------------------------------------------------------

    def local_reserve(
        self, digest: str, phys: int, capacity: int | None
    ) -> tuple[str, list[tuple[str, int]]]:
        """Count a local block before it is written. Returns the outcome (``reserved``: write it,
        then :meth:`local_commit`; ``present``: stored or being stored, nothing to do) and the LRU
        victims removed from the count to make room (the caller deletes their files). Victims are
        unpinned, whole blocks only. A row whose file has gone is counted anew."""
        now = time.time()
        with self.transaction() as c:
            row = c.execute("SELECT state, owner FROM local WHERE digest = ?", (digest,)).fetchone()
            if row is not None:
                if row[0] == WRITING and self.owner.alive(row[1]):
                    return "present", []
                if row[0] == READY and self._local_has(digest):
                    c.execute("UPDATE local SET atime = ? WHERE digest = ?", (now, digest))
                    return "present", []
                c.execute(
                    "UPDATE local SET state = ?, owner = ?, atime = ? WHERE digest = ?",
                    (WRITING, self.me, now, digest),
                )
                return "reserved", []
            used = _meta(c, "local_used")
            victims: list[tuple[str, int]] = []
            if capacity is not None and used + phys > capacity:
                lru = _Candidates(c, "local", now, ())
                found = lru.take(used + phys - capacity)
                lru.close()
                if found is None:
                    raise OverflowError(used + phys - capacity)
                victims = [(v.digest, v.phys) for v in found]
                c.executemany("DELETE FROM local WHERE digest = ?", [(v[0],) for v in victims])
                used -= sum(v[1] for v in victims)
            c.execute(
                "INSERT INTO local(digest, phys, atime, state, owner) VALUES (?, ?, ?, ?, ?)",
                (digest, phys, now, WRITING, self.me),
            )
            _set_meta(c, "local_used", used + phys)
        return "reserved", victims

    local_root: str | None = None
    """The local tier's directory (set by the tier): where :meth:`local_reserve` looks for files."""

    def _local_has(self, digest: str) -> bool:
        if self.local_root is None:
            return True
        return os.path.lexists(os.path.join(self.local_root, digest[:2], digest))

    def local_commit(self, digest: str, since: int, rename: Callable[[], None]) -> bool:
        """Make a written local block visible (``rename``) unless a remove came after ``since``;
        whether it was. On False (or an exception) the caller deletes its temporary file and
        forgets the row (:meth:`local_forget`)."""
        with self.transaction() as c:
            if _removed_since(_conn_read(c), [digest], since):
                return False
            row = c.execute("SELECT state, owner FROM local WHERE digest = ?", (digest,)).fetchone()
            if row is None or row[0] != WRITING or row[1] != self.me:
                return False
            rename()
            c.execute("UPDATE local SET state = ?, owner = NULL WHERE digest = ?", (READY, digest))
        return True

    def local_forget(self, digests: Iterable[str], *, owner: str | None = None) -> None:
        """Stop counting local blocks (their files are gone); with ``owner``, only its ``WRITING`` rows."""
        with self.transaction() as c:
            freed = 0
            for d in digests:
                row = c.execute("SELECT phys, state, owner FROM local WHERE digest = ?", (d,)).fetchone()
                if row is None or (owner is not None and (row[1] != WRITING or row[2] != owner)):
                    continue
                c.execute("DELETE FROM local WHERE digest = ?", (d,))
                freed += int(row[0])
            if freed:
                _set_meta(c, "local_used", _meta(c, "local_used") - freed)

    def local_reconcile(
        self, listing: Callable[[Collection[str]], dict[str, tuple[int, float]]]
    ) -> tuple[int, int]:
        """Make the local count agree with its files, in one transaction. ``listing(counted)``
        (called inside it with the digests counted now) maps every whole block file of the local
        tier to ``(phys, mtime)``. Rows without
        a file are forgotten (unless a live process is writing them); files without a row are
        counted. The total is recomputed from the rows. Returns (rows forgotten, files counted)."""
        with self.transaction() as c:
            rows = {str(r[0]): (int(r[1]), r[2]) for r in c.execute("SELECT digest, state, owner FROM local")}
            files = listing(rows.keys())
            forget = [
                d
                for d, (state, owner) in rows.items()
                if d not in files and (state == READY or not self.owner.alive(owner))
            ]
            c.executemany("DELETE FROM local WHERE digest = ?", [(d,) for d in forget])
            add = [(d, p, t, READY) for d, (p, t) in files.items() if d not in rows]
            c.executemany(
                "INSERT INTO local(digest, phys, atime, state, owner) VALUES (?, ?, ?, ?, NULL)", add
            )
            total = int(c.execute("SELECT COALESCE(SUM(phys), 0) FROM local").fetchone()[0])
            _set_meta(c, "local_used", total)
        return len(forget), len(add)

    # -- what this host wrote to the shared tier ----------------------------------------------

    def shared_note(self, digest: str, since: int) -> bool:
        """Record a block this host's store uploaded to the shared tier (after the upload returned)
        under removal sequence ``since``; False if a remove came meanwhile (delete the upload)."""
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO shared(digest, gen) VALUES (?, ?)", (digest, since))
            return not _removed_since(_conn_read(c), [digest], since)

    def shared_forget(self, digest: str) -> None:
        with self.transaction() as c:
            c.execute("DELETE FROM shared WHERE digest = ?", (digest,))

    def shared_has(self, digest: str) -> bool:
        rows = self._read(
            "SELECT 1 FROM shared s WHERE s.digest = ? AND NOT EXISTS "
            "(SELECT 1 FROM removed r WHERE r.digest = s.digest AND r.seq > s.gen)",
            (digest,),
        )
        return bool(rows)

    # -- rebuild, reconcile, sweep ------------------------------------------------------------

    def load(
        self, pool: Sequence[tuple[str, int, int, float]], local: Sequence[tuple[str, int, float]]
    ) -> None:
        """Replace the contents with what a scan of the tiers found (``(digest, size, phys, mtime)``
        pool files, ``(digest, phys, mtime)`` local files), and mark the index whole, in one
        transaction (a process killed before it commits leaves an index :meth:`check` refuses)."""
        with self.transaction() as c:
            for table in ("blocks", "local", "leases", "shared"):
                c.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed table names
            c.executemany(
                "INSERT INTO blocks(digest, size, phys, state, owner, atime) VALUES (?, ?, ?, ?, NULL, ?)",
                [(d, s, p, READY, t) for d, s, p, t in pool],
            )
            c.executemany(
                "INSERT OR IGNORE INTO local(digest, phys, atime, state, owner) VALUES (?, ?, ?, ?, NULL)",
                [(d, p, t, READY) for d, p, t in local],
            )
            _set_meta(c, "used", sum(p for _, _, p, _ in pool))
            _set_meta(c, "local_used", sum(p for _, p, _ in local))
            # every operation under way before the rebuild carries a sequence number below this
            # floor, so none of them can make a copy appear that a lost tombstone should have stopped
            seq = _meta(c, "seq") + 1
            _set_meta(c, "seq", seq)
            _set_meta(c, "floor", seq)
            _set_meta(c, "complete", 1)

    def pool_rows(self) -> dict[str, tuple[int, int, str | None, int]]:
        """Every pool row: digest -> (state, phys, owner, size)."""
        rows = self._read("SELECT digest, state, phys, owner, size FROM blocks")
        return {str(r[0]): (int(r[1]), int(r[2]), r[3], int(r[4])) for r in rows}  # type: ignore[call-overload, misc]

    def reconcile(
        self, listing: Callable[[], dict[str, tuple[int, int, float] | None]], evict: Callable[[str], None]
    ) -> tuple[int, int, int]:
        """Make the pool rows agree with the files, in one transaction (the files cannot lose a
        row meanwhile: a row goes only after its file, under this lock).

        ``listing()`` (called inside the transaction) maps every digest-named file in the pool to
        ``(size, phys, mtime)`` of a whole block, or None for a torn one (already deleted). Rows
        that are ``READY`` without a file are forgotten; files without a row are counted (newest
        first) while they fit and deleted (``evict``) otherwise. Returns (rows forgotten, files
        counted, files deleted).
        """
        forgotten = counted = deleted = 0
        with self.transaction() as c:
            files = listing()
            rows = {str(r[0]): int(r[1]) for r in c.execute("SELECT digest, state FROM blocks")}
            for d, state in rows.items():
                if state == READY and files.get(d) is None:
                    c.execute("DELETE FROM blocks WHERE digest = ?", (d,))
                    forgotten += 1
            used = int(c.execute("SELECT COALESCE(SUM(phys), 0) FROM blocks").fetchone()[0])
            extra = sorted(
                ((d, f) for d, f in files.items() if f is not None and d not in rows),
                key=lambda item: item[1][2],
                reverse=True,
            )
            for d, (size, phys, mtime) in extra:
                if used + phys <= self.capacity:
                    c.execute(
                        "INSERT INTO blocks(digest, size, phys, state, owner, atime) "
                        "VALUES (?, ?, ?, ?, NULL, ?)",
                        (d, size, phys, READY, mtime),
                    )
                    used += phys
                    counted += 1
                else:
                    evict(d)
                    deleted += 1
            _set_meta(c, "used", used)
        return forgotten, counted, deleted

    def sweep_dead(self) -> tuple[dict[str, str], list[str]]:
        """Drop the leases of dead processes; return the digests a dead process was ``WRITING``
        (with that owner: the caller checks their files, adopts the whole ones and releases the
        rest only while still that dead writer's) and those it was evicting (``EVICTING`` or
        ``DROPPING``: ``READY`` again where the file is still there, else released here)."""
        owners = {r[0] for r in self._read("SELECT DISTINCT owner FROM leases")}
        owners |= {r[0] for r in self._read("SELECT DISTINCT owner FROM blocks WHERE owner IS NOT NULL")}
        owners |= {r[0] for r in self._read("SELECT DISTINCT owner FROM local WHERE owner IS NOT NULL")}
        dead = sorted(str(o) for o in owners if not self.owner.alive(o))
        if not dead:
            return {}, []
        writing: dict[str, str] = {}
        evicting: list[str] = []
        for part in _chunks(dead, 128):
            marks = ",".join("?" * len(part))
            with self.transaction() as c:
                c.execute(f"DELETE FROM leases WHERE owner IN ({marks})", part)
                rows = c.execute(
                    f"SELECT digest, owner FROM blocks WHERE state = ? AND owner IN ({marks})",
                    (WRITING, *part),
                )
                writing.update({str(r[0]): str(r[1]) for r in rows})
                evicting += [
                    str(r[0])
                    for r in c.execute(
                        f"SELECT digest FROM blocks WHERE state IN (?, ?) AND owner IN ({marks})",
                        (EVICTING, DROPPING, *part),
                    )
                ]
                c.execute(
                    f"UPDATE blocks SET state = ?, owner = NULL WHERE state IN (?, ?) AND owner IN ({marks})",
                    (READY, EVICTING, DROPPING, *part),
                )
                # a dead writer's local reservation: its file (if the rename happened) is whole
                c.execute(
                    f"UPDATE local SET state = ?, owner = NULL WHERE state = ? AND owner IN ({marks})",
                    (READY, WRITING, *part),
                )
        # an evictor that died after unlinking left READY rows without files: forget them
        gone = [d for d in evicting if not self._has_file(d)]
        if gone:
            self.release(gone, states=(READY,))
        return writing, evicting

    def adopt(self, digests: Sequence[str]) -> None:
        """Take over ``WRITING`` rows of dead processes whose files turned out whole: ``READY``."""
        with self.transaction() as c:
            c.executemany(
                "UPDATE blocks SET state = ?, owner = NULL WHERE digest = ? AND state = ?",
                [(READY, d, WRITING) for d in digests],
            )

    def owners_in_use(self) -> set[str]:
        """Every owner token some row names (their lock files must stay while they live)."""
        out: set[str] = set()
        for table in ("blocks", "local", "leases"):
            out |= {
                str(r[0]) for r in self._read(f"SELECT DISTINCT owner FROM {table} WHERE owner IS NOT NULL")
            }  # noqa: S608
        return out


LruMark = tuple[float, int]
"""Where an LRU scan of the pool stopped: ``(atime, depth)`` of the first row it did not use."""


class _Candidates:
    """LRU unpinned blocks of one table, read lazily once, handed out in order.

    ``start``: a mark from an earlier transaction of the same put batch, so that a batch cut into
    transactions does not scan again, in each of them, the rows an earlier one went past (the
    batch's own blocks, which are never victims): the whole batch is one pass over the LRU order.
    """

    def __init__(
        self,
        c: sqlite3.Connection,
        table: str,
        now: float,
        skip: Collection[str],
        start: LruMark | None = None,
    ) -> None:
        args: tuple[object, ...] = (now,)
        if table == "blocks":
            after = ""
            if start is not None:
                after = "AND (atime > ? OR (atime = ? AND depth <= ?)) "
                args = (now, start[0], start[0], start[1])
            sql = (
                f"SELECT digest, size, phys, lower, atime, depth FROM blocks b WHERE state = {READY} AND "
                f"{_UNPINNED.format(t='b')} {after}ORDER BY atime, depth DESC"
            )
        else:
            sql = (
                f"SELECT digest, 0, phys, NULL, atime, 0 FROM local t WHERE state = {READY} AND "
                f"{_UNPINNED.format(t='t')} ORDER BY atime"
            )
        self._c = c
        self._sql = sql
        self._args = args
        self._cursor: sqlite3.Cursor | None = None
        self._skip = skip
        self._held: list[tuple[Victim, LruMark]] = []
        self._held_bytes = 0
        self.mark: LruMark | None = start
        """Where a later transaction of the same batch resumes (the first row not used here)."""

    def take(self, need: int, *, partial: bool = False, limit: int | None = None) -> list[Victim] | None:
        """The next candidates whose bytes add up to ``need`` (None, taking nothing, if they cannot,
        unless ``partial``; at most ``limit`` of them)."""
        if need <= 0:
            return []
        if self._cursor is None:
            # rows are claimed at the end of the caller's transaction, so the scan never meets its
            # own updates; the rows it inserts meanwhile are WRITING and never candidates
            self._cursor = self._c.execute(self._sql, self._args)
        while self._held_bytes < need and (limit is None or len(self._held) < limit):
            row = self._cursor.fetchone()
            if row is None:
                break
            if not self._held:
                self.mark = (float(row[4]), int(row[5]))
            if row[0] in self._skip:
                continue
            v = Victim(str(row[0]), int(row[1]), int(row[2]), row[3])
            self._held.append((v, (float(row[4]), int(row[5]))))
            self._held_bytes += v.phys
        if self._held_bytes < need and not partial:
            return None
        out, total = [], 0
        while self._held and total < need:
            v, _ = self._held.pop(0)
            out.append(v)
            total += v.phys
        self._held_bytes -= total
        if self._held:
            self.mark = self._held[0][1]
        return out

    def close(self) -> None:
        if self._cursor is not None:
            self._cursor.close()


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _conn_read(c: sqlite3.Connection) -> Callable[[str, Sequence[object]], list[tuple[object, ...]]]:
    return lambda sql, args: c.execute(sql, args).fetchall()


def _removed_since(
    read: Callable[[str, Sequence[object]], list[tuple[object, ...]]], digests: list[str], since: int
) -> set[str]:
    if not digests:
        return set()
    floor = int(read("SELECT v FROM meta WHERE k = 'floor'", ())[0][0])  # type: ignore[call-overload]
    if since < floor:
        return set(digests)
    out: set[str] = set()
    for part in _chunks(digests, TXN_KEYS):
        marks = ",".join("?" * len(part))
        rows = read(f"SELECT digest FROM removed WHERE seq > ? AND digest IN ({marks})", (since, *part))
        out.update(str(r[0]) for r in rows)
    return out


def _meta(c: sqlite3.Connection, key: str) -> int:
    return int(c.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()[0])


def _set_meta(c: sqlite3.Connection, key: str, value: int) -> None:
    c.execute("UPDATE meta SET v = ? WHERE k = ?", (value, key))
