"""A process's place in its host tiers: the run it belongs to, its lock, and what crashed processes left.

docs/design.md section 11. A *run* is one shared root URL + job, with an id recorded once on
shared storage (``<shared>/<job>/RUN``). Every host-tier object of a run lives below that
run's own directory, so a run only ever sees (and deletes) its own state::

    <host root>/<job>/<host_id>/            (host root: Config.dram or Config.local; all 0700)
      locks/r<rank>.lock                    DRAM root only: held (flock) for a Checkpointer's life
      runs/<run-id>/                        one run's host state: the tier root
        RUN.json                            {"format": "shoal-run/1", "run", "shared", "job", "created"}
        slabs/  staged/                     DRAM: staging slabs and their staged indexes
        packs/  steps/                      partner copies (local disk, or DRAM)
        events.jsonl                        local root: the run's event log on this host

A restarted process of the same run (same shared root and job) finds the same id on
shared storage, hence the same directories: the B1 restore from slabs works as before.
A different run (another shared root, or the same one wiped and started afresh) gets a
new id and never sees the old directories; they are logged as skipped, never deleted.
If shared storage cannot be reached, the run is recognised by the ``RUN.json`` files of
the hosts' run directories that name the same shared root and job.

One live process per (DRAM root, job, host, rank): :class:`HostLock`, an ``flock`` the
kernel releases when the process dies. Slabs of a process are named with a per-process
generation (``r<rank>-<gen>-slot-<i>``), so a new process never stages over what a crashed
one left: those slabs (:func:`find_leftovers`) stay until a newer checkpoint of the run
reaches B4, or ``shoal gc --staged`` drops them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

from shoal.errors import FormatError, MissingFile, OwnershipError, ShoalError
from shoal.format import layout
from shoal.format.names import check_identifier
from shoal.format.strict_json import load_json
from shoal.records.small import read_record
from shoal.records.staged import INDEX_SUFFIX, SIDECAR_SUFFIXES, STAGED_DIR, delete_staged
from shoal.tiers.base import Tier
from shoal.tiers.files import check_private, ensure_private_dirs, open_private
from shoal.tiers.roles import Role, open_host_role
from shoal.tiers.slabs import require_slabs

log = logging.getLogger(__name__)

RUN_FORMAT = "shoal-run/1"
RUNS_DIR = "runs"
LOCKS_DIR = "locks"
RUN_FILE = "RUN.json"


@dataclass(frozen=True)
class RunRecord:
    """What ``<shared>/<job>/RUN`` (and each host run directory's ``RUN.json``) says."""

    run: str
    shared: str
    job: str
    created: float

    def encode(self) -> bytes:
        doc = {"format": RUN_FORMAT, "run": self.run, "shared": self.shared, "job": self.job,
               "created": self.created}  # fmt: skip
        return json.dumps(doc).encode()


def new_run_id() -> str:
    return secrets.token_hex(8)


def decode_run(data: bytes, where: str) -> RunRecord:
    """Parse a run record; any malformation is a :class:`FormatError` naming ``where``."""
    doc = load_json(data, f"run record {where}")
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        raise FormatError(f"run record {where}: expected an object with format {RUN_FORMAT!r}")
    run, shared, job, created = (doc.get(k) for k in ("run", "shared", "job", "created"))
    if not isinstance(run, str) or not isinstance(shared, str) or not isinstance(job, str):
        raise FormatError(f"run record {where}: 'run', 'shared' and 'job' must be strings")
    if not isinstance(created, int | float) or isinstance(created, bool):
        raise FormatError(f"run record {where}: 'created' must be a number, got {created!r}")
    try:
        check_identifier(run, f"run id in {where}")
    except ShoalError as e:
        raise FormatError(str(e)) from None
    return RunRecord(run, shared, job, float(created))


def read_shared_run(shared: Tier) -> RunRecord | None:
    """The run record on the shared tier, or None if there is none yet."""
    return read_record(shared, layout.RUN, decode_run, what="run record")


def claim_shared_run(shared: Tier, shared_url: str, job: str) -> RunRecord:
    """The run of ``shared`` (``<shared>/<job>``): the one recorded there, or a new one recorded now.

    Raises what the tier raises when it cannot be read or written (an unwritable or
    file-typed shared root is reported here, when the Checkpointer is built).
    """
    found = read_shared_run(shared)
    if found is not None:
        return found
    record = RunRecord(new_run_id(), shared_url, job, time.time())
    shared.write(layout.RUN, record.encode())
    # Two coordinators racing on a fresh job: both read back what the tier kept.
    kept = read_shared_run(shared)
    if kept is None:
        raise MissingFile(f"run record {shared.url}/{layout.RUN} vanished right after it was written")
    return kept


def host_dir(root: str, job: str, host: str) -> str:
    """``<root>/<job>/<host>``: this host's directory under one host root."""
    return os.path.join(root, job, host)


def run_dir(root: str, job: str, host: str, run: str) -> str:
    """``<root>/<job>/<host>/runs/<run>``: one run's host state under one host root."""
    return os.path.join(host_dir(root, job, host), RUNS_DIR, check_identifier(run, "run id"))


def write_run_file(root: str, directory: str, record: RunRecord) -> None:
    """Record (once) which run a host run directory belongs to, for the fall-back and for listings."""
    path = os.path.join(directory, RUN_FILE)
    if os.path.lexists(path):
        return
    ensure_private_dirs(root, directory, durable=False)
    tmp = f"{path}.tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, record.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


@dataclass(frozen=True)
class HostRun:
    """A run directory found on a host: where, which run, and when it was last touched."""

    path: str
    record: RunRecord | None
    mtime: float
    problem: str | None = None


def list_host_runs(root: str, job: str, host: str) -> list[HostRun]:
    """Every run directory under ``<root>/<job>/<host>/runs`` (nothing if there is none).

    A directory that is not private (another owner, writable by others, a symlink) is
    listed with its problem and never read.
    """
    base = os.path.join(host_dir(root, job, host), RUNS_DIR)
    try:
        names = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            check_private(path, st, directory=True)
            fd = open_private(os.path.join(path, RUN_FILE), os.O_RDONLY)
            try:
                data = os.read(fd, layout.MAX_POINTER_BYTES + 1)
            finally:
                os.close(fd)
            if len(data) > layout.MAX_POINTER_BYTES:
                raise FormatError(f"{path}/{RUN_FILE} is larger than {layout.MAX_POINTER_BYTES} bytes")
            out.append(HostRun(path, decode_run(data, f"{path}/{RUN_FILE}"), st.st_mtime))
        except FileNotFoundError:
            out.append(HostRun(path, None, 0.0, f"{path} has no {RUN_FILE}"))
        except (ShoalError, OSError) as e:
            out.append(HostRun(path, None, 0.0, str(e)))
    return out


def same_run_candidates(runs: Iterable[HostRun], shared_url: str, job: str) -> list[HostRun]:
    """The host runs that name ``shared_url`` and ``job``, newest first."""
    match = [
        r for r in runs if r.record is not None and r.record.shared == shared_url and r.record.job == job
    ]
    return sorted(match, key=lambda r: r.mtime, reverse=True)


def log_foreign_runs(runs: Iterable[HostRun], run: str, where: str) -> list[str]:
    """Log (and return) one line per run directory that is not ``run``'s: skipped, never deleted."""
    lines = []
    for r in runs:
        if r.record is not None and r.record.run == run:
            continue
        if r.record is not None:
            why = f"it belongs to run {r.record.run} (shared root {r.record.shared}, job {r.record.job!r})"
        else:
            why = r.problem or "it names no run"
        lines.append(f"ignoring host state {r.path}: {why}; this run is {run}")
    for line in lines:
        log.info("%s (%s)", line, where)
    return lines


class HostLock:
    """One live process per (DRAM root, job, host, rank): an exclusive ``flock`` on a lock file.

    The kernel drops the lock when the process dies, so a crash never leaves a stale lock.
    The file holds the holder's pid (for the message a second process gets).
    """

    def __init__(self, root: str, job: str, host: str, rank: int) -> None:
        self.root = root
        self.path = os.path.join(host_dir(root, job, host), LOCKS_DIR, f"r{rank}.lock")
        self.job, self.host, self.rank = job, host, rank
        self._fd: int | None = None

    def acquire(self) -> HostLock:
        ensure_private_dirs(self.root, os.path.dirname(self.path), durable=False)
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = os.pread(fd, 64, 0).decode().strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            if holder == str(os.getpid()):
                raise OwnershipError(
                    f"this process already has a Checkpointer open for job {self.job!r} as rank "
                    f"{self.rank} on host {self.host!r} (lock {self.path}); close() it (or use it as a "
                    "context manager) before creating another, or give the new one another Config.job"
                ) from None
            pid = f"pid {holder}" if holder.isdigit() else "another process"
            raise OwnershipError(
                f"lock {self.path} is held by {pid}: a live process already checkpoints job "
                f"{self.job!r} as rank {self.rank} on host {self.host!r} with this DRAM root. Two "
                f"processes must not share one; give this one another Config.job (or another "
                f"Config.dram root), or stop the other first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would race with a new holder."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def new_generation() -> str:
    """A fresh token naming this process's slabs (``r<rank>-<gen>-slot-<i>``)."""
    return secrets.token_hex(4)


@dataclass(frozen=True)
class Leftover:
    """A staged checkpoint an earlier process of this run left in the DRAM tier."""

    slot: str
    """The slot (and slab) name, e.g. ``r0-1a2b3c4d-slot-0``."""
    rank: int | None
    step: int | None
    """The step its staged index names; None if the index is missing or unreadable."""
    index: str | None
    """The staged index's tier path, if there is one."""
    slab_bytes: int


def _slot_rank(slot: str) -> int | None:
    head = slot.split("-", 1)[0]
    return int(head[1:]) if head.startswith("r") and head[1:].isdigit() else None


def find_leftovers(dram: Tier, *, rank: int | None = None, own: Iterable[str] = ()) -> list[Leftover]:
    """Staged checkpoints on ``dram`` (a run's DRAM tier) that no live slot of ``own`` holds.

    With ``rank``, only that rank's. Reads each staged index's step (a bounded read); a slab
    without a readable index is listed with ``step=None``.
    """
    mine = set(own)
    slabs = require_slabs(dram, "find staged leftovers").list_slabs()
    indexes: dict[str, str] = {}
    sidecars: set[str] = set()  # slots with a sidecar of their index (it may be gone: a crash)
    for path in dram.list(STAGED_DIR + "/"):
        name = path.rsplit("/", 1)[-1]
        if name.endswith(INDEX_SUFFIX):
            indexes[name[: -len(INDEX_SUFFIX)]] = path
        for suffix in SIDECAR_SUFFIXES:
            if name.endswith(suffix):
                sidecars.add(name[: -len(suffix)])
    out = []
    for slot in sorted(set(slabs) | set(indexes) | sidecars):
        slot_rank = _slot_rank(slot)
        if slot in mine or (rank is not None and slot_rank != rank):
            continue
        step = None
        if slot in indexes:
            try:
                data = dram.read_small(indexes[slot], layout.MAX_STAGED_BYTES, "staged index")
                doc = load_json(data, f"staged index {dram.url}/{indexes[slot]}")
                step = layout.check_step(doc.get("step")) if isinstance(doc, dict) else None
            except (ShoalError, ValueError) as e:
                log.warning("staged index %s/%s cannot be read: %s", dram.url, indexes[slot], e)
        out.append(Leftover(slot, slot_rank, step, indexes.get(slot), slabs.get(slot, 0)))
    return out


def drop_leftover(dram: Tier, leftover: Leftover) -> None:
    """Delete a leftover: its staged index first (never an index over missing bytes), its sidecars,
    then its slab."""
    slabs = require_slabs(dram, "drop a staged leftover")
    if leftover.index is not None:
        dram.delete(leftover.index)
    delete_staged(dram, leftover.slot)
    slabs.delete_slab(leftover.slot)


def drop_superseded(dram: Tier, leftovers: list[Leftover], newest: int) -> None:
    """Drop each of ``leftovers`` (step ``newest`` of the run is committed); a failure is logged."""
    for left in leftovers:
        try:
            drop_leftover(dram, left)
            log.info("dropped step %s staged by an earlier process (slab %s): step %d is committed",
                     left.step, left.slot, newest)  # fmt: skip
        except ShoalError as e:
            log.warning("could not drop the leftover slab %s: %s", left.slot, e)


__all__ = [
    "HostLeftovers",
    "HostLock",
    "HostRun",
    "Leftover",
    "RunRecord",
    "claim_shared_run",
    "decode_run",
    "drop_leftover",
    "drop_superseded",
    "find_leftovers",
    "host_dir",
    "list_host_runs",
    "lock_holder",
    "log_foreign_runs",
    "new_generation",
    "read_shared_run",
    "run_dir",
    "same_run_candidates",
    "staged_leftovers",
    "write_run_file",
]


@dataclass(frozen=True)
class HostLeftovers:
    """What ``shoal gc --staged`` lists for one run directory of one host."""

    host: str
    run: HostRun
    leftovers: tuple[Leftover, ...]
    live: dict[int, str]
    """Rank -> who holds its lock now (``pid N``): those ranks' slabs belong to a live process."""


def lock_holder(root: str, job: str, host: str, rank: int) -> str | None:
    """``"pid N"`` if a live process holds rank ``rank``'s lock on ``host``, else None."""
    path = os.path.join(host_dir(root, job, host), LOCKS_DIR, f"r{rank}.lock")
    try:
        fd = open_private(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            return f"pid {holder}" if holder.isdigit() else "a live process"
        return None
    finally:
        os.close(fd)


def staged_leftovers(root: str, job: str) -> list[HostLeftovers]:
    """Every staged checkpoint under the DRAM root ``root`` for ``job``, host by host, run by run."""
    out = []
    base = os.path.join(root, job)
    try:
        hosts = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for host in hosts:
        for hr in list_host_runs(root, job, host):
            if hr.problem is not None and hr.record is None and not os.path.isdir(hr.path):
                continue
            tier = open_host_role(Role.STAGING, hr.path, base=root)
            found = tuple(find_leftovers(tier))
            ranks = sorted({left.rank for left in found if left.rank is not None})
            live = {r: h for r in ranks if (h := lock_holder(root, job, host, r)) is not None}
            out.append(HostLeftovers(host, hr, found, live))
    return out
