"""Private host files: the POSIX helpers every host-side writer of shoal uses.

The ``local`` and ``dram`` tiers, the shared tier on a mounted file system, the host state
(:mod:`shoal.records.hoststate`), the event log (:mod:`shoal.records.events`) and the KV pool
(:mod:`shoal.kv`) all write and read files with these:

* owner and mode checks: a directory or file of a host tier must be this user's and writable by
  nobody else (:func:`check_private`, :func:`ensure_private_dirs`: directories 0700, files 0600),
  else :class:`~shoal.errors.OwnershipError` names its path, owner and mode;
* no symlink followed: files are opened with ``O_NOFOLLOW`` and checked by ``fstat``
  (:func:`open_private`, :func:`open_private_stat`);
* ``O_EXCL`` temporary files renamed into place: a write goes to a fresh sibling
  ``.<name>.tmp-<random>`` (:func:`temp_sibling`, never listed: :func:`is_temp_name`, and refused
  as a tier path: :func:`check_tier_path`) and is renamed over its target
  (:class:`AtomicRenameCommit`);
* fsync of files and directories, so that a rename or a new directory survives a crash
  (:func:`fsync_dir`, :func:`makedirs_durable`).

The tier classes themselves live in :mod:`shoal.tiers.local`, :mod:`shoal.tiers.dram` and
:mod:`shoal.tiers.shared`.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import secrets
import stat
from contextlib import suppress

from shoal import failpoints
from shoal.errors import InvalidName, OwnershipError
from shoal.format.names import check_relpath
from shoal.tiers.base import Data, iter_byte_views

_TEMP_NAME = re.compile(r"\..+\.tmp-[0-9a-f]{16}")
MAX_IO = 1 << 30
"""Largest single read/write request; Linux caps one syscall near 2 GiB anyway."""


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (one path segment) is the temporary file of a write in progress."""
    return _TEMP_NAME.fullmatch(name) is not None


def check_tier_path(path: str) -> str:
    """``check_relpath`` plus: never the name of a write in progress. Returns ``path``."""
    check_relpath(path)
    if is_temp_name(path.rsplit("/", 1)[-1]):
        raise InvalidName(f"tier path {path!r} looks like the temporary file of a write in progress")
    return path


def temp_sibling(target: str) -> str:
    """A fresh temporary path next to ``target`` (same directory, so the rename is atomic)."""
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.tmp-{secrets.token_hex(8)}")


def write_all(fd: int, data: Data, *, failpoint: str | None = None) -> int:
    """Write every part of ``data`` to ``fd`` with ``os.write`` (retrying partial writes); return bytes.

    ``failpoint``: a failpoint hit after the first buffer is written (a disk filling up mid-file).
    """
    total = 0
    for i, view in enumerate(iter_byte_views(data)):
        while view.nbytes:
            n = os.write(fd, view[:MAX_IO])
            if n <= 0:  # pragma: no cover - os.write raises instead on Linux
                raise OSError(errno.EIO, "os.write wrote nothing")
            view = view[n:]
            total += n
        if i == 0 and failpoint is not None:
            failpoints.hit(failpoint, rank=failpoints.process_rank())
    return total


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def describe_owner(st: os.stat_result) -> str:
    """``"alice (uid 1000), mode 0755"`` for messages."""
    try:
        name = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        name = "?"
    return f"{name} (uid {st.st_uid}), mode {stat.S_IMODE(st.st_mode):04o}"


def check_private(path: str, st: os.stat_result, *, directory: bool) -> None:
    """Refuse ``path`` (already ``lstat``-ed into ``st``) unless it is ours and nobody else may write it.

    Raises :class:`~shoal.errors.OwnershipError` naming path, owner and mode for a symlink,
    the wrong kind of file, another owner, or group/world write permission.
    """
    uid = os.geteuid()
    kind = "directory" if directory else "file"
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symbolic link; shoal never follows links in its host tiers (expected a {kind})"
    elif directory and not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif not directory and not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != uid:
        problem = f"belongs to another user, not to uid {uid} who runs shoal"
    elif st.st_mode & 0o022:
        problem = "is writable by other users"
    if problem is not None:
        raise OwnershipError(
            f"host-tier {kind} {path} {problem} (owner {describe_owner(st)}); shoal keeps its host tiers "
            f"private: point Config.dram / Config.local at a directory of your own that does not exist "
            f"yet (shoal creates it 0700), or have this one removed if nothing else needs it"
        )


def ensure_private_dirs(base: str, directory: str, *, durable: bool) -> None:
    """Create ``directory`` 0700 (and every missing level from ``base`` down), checking each level.

    ``base`` is the trusted base: it and every level below it down to ``directory`` must be
    real directories owned by this user and writable by no one else
    (:func:`check_private`); levels above ``base`` (``/dev/shm``, ``/tmp``) are created if
    missing but not checked. With ``durable`` the parent of each new level is fsync'd.
    """
    base = os.path.abspath(base)
    directory = os.path.abspath(directory)
    if directory != base and not directory.startswith(base.rstrip("/") + "/"):
        raise InvalidName(f"host-tier directory {directory} is not below its root {base}")
    parent = os.path.dirname(base)
    if not os.path.isdir(parent):
        makedirs_durable(parent, durable=durable)
    levels = [base]
    rest = directory[len(base) :].strip("/")
    for part in rest.split("/") if rest else []:
        levels.append(os.path.join(levels[-1], part))
    for level in levels:
        try:
            os.mkdir(level, PRIVATE_DIR_MODE)
        except FileExistsError:
            check_private(level, os.lstat(level), directory=True)
            continue
        os.chmod(level, PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask
        if durable:
            fsync_dir(os.path.dirname(level))


def open_private(path: str, flags: int) -> int:
    """``os.open`` without following a symlink; the file must be ours and not writable by others.

    Raises :class:`~shoal.errors.OwnershipError` (and closes the descriptor) otherwise.
    ``FileNotFoundError`` propagates for a missing file.
    """
    return open_private_stat(path, flags)[0]


def open_private_stat(path: str, flags: int) -> tuple[int, os.stat_result]:
    """:func:`open_private`, and the ``fstat`` it checked (a reader that needs the size has it)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            check_private(path, os.lstat(path), directory=False)
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        check_private(path, st, directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def fsync_dir(directory: str) -> None:
    """fsync ``directory`` so that a rename or creation inside it is durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(directory: str, *, durable: bool) -> None:
    """Create ``directory`` and missing parents; with ``durable``, fsync each new entry's parent."""
    missing = []
    current = directory
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            continue
        if durable:
            fsync_dir(os.path.dirname(path))


class AtomicRenameCommit:
    """Commit by temporary sibling, fsync, :func:`os.replace`, directory fsync (POSIX).

    ``durable=False`` skips both fsyncs (for tiers that do not survive a reboot anyway,
    like ``dram``); the rename still makes the write atomic for readers.
    """

    atomic_rename = True

    def __init__(
        self,
        *,
        durable: bool = True,
        failpoint: str | None = None,
        private_base: str | None = None,
    ) -> None:
        self.durable = durable
        self.failpoint = failpoint
        self.private_base = private_base
        """With a base, directories are made private below it and files are created 0600
        (host tiers); without one, the umask decides (the shared tier: users share it on purpose)."""

    def write(self, target: str, data: Data) -> int:
        """Write ``data`` to the absolute path ``target`` atomically; return the bytes written.

        Missing parent directories are created. On any exception (including one raised
        by ``data`` while it is consumed) the temporary file is removed, ``target`` keeps
        its earlier content, and the exception propagates unchanged.
        """
        directory = os.path.dirname(target)
        if self.private_base is not None:
            ensure_private_dirs(self.private_base, directory, durable=self.durable)
            mode = PRIVATE_FILE_MODE
        else:
            makedirs_durable(directory, durable=self.durable)
            mode = 0o666  # the umask decides
        tmp = temp_sibling(target)
        # O_EXCL | O_NOFOLLOW: never write through a name someone else prepared; the rename
        # below replaces whatever is at ``target`` (a planted symlink too) without following it.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            try:
                total = write_all(fd, data, failpoint=self.failpoint)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        if self.durable:
            fsync_dir(directory)
        return total


def check_prefix(prefix: str) -> str:
    """Validate a ``list`` prefix: ``""`` or a relative path, optionally ending in ``/``."""
    if prefix == "":
        return prefix
    check_relpath(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def remove_empty_dirs_below(top: str) -> None:
    """Remove ``top`` and every directory below it that is (or becomes) empty; follow no link."""
    if os.path.islink(top) or not os.path.isdir(top):
        return
    for directory, _, _ in os.walk(top, topdown=False):
        with suppress(OSError):  # not empty (or gone): leave it
            os.rmdir(directory)
