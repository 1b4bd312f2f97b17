"""Who is alive: one lock file per process that uses a pool, held for as long as it runs.

A PID says nothing across PID namespaces (two containers sharing ``/dev/shm`` see each other's
PIDs as absent, or as some unrelated process) and is reused after a process exits. An ``flock``
on a file is neither: the kernel holds it for exactly as long as the process (or anything it
handed the descriptor to) lives, whatever namespace looks at it. So each process that opens a
pool creates ``owners/<token>`` (a fresh random token), ``flock``\\ s it exclusively and keeps the
descriptor open; every row the index attributes to a process (a reservation being written, a
victim being evicted, a pin) names that token. "Is the owner of this row alive?" is then "does
someone hold the lock on ``owners/<token>``?": a process that can take the lock itself knows
the owner is gone. A forked child closes its copy of the descriptor, so a parent's death is
seen even while its children run.

The token also names the temporary files of the owner's writes (``.<digest>.<token>.tmp-<hex>``),
so a sweep can tell a live writer's file from a dead one's without asking anyone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import threading
import weakref
from contextlib import suppress

from shoal.errors import TierError
from shoal.tiers.files import PRIVATE_FILE_MODE, ensure_private_dirs, open_private

OWNERS_DIR = "owners"
_TOKEN = re.compile(r"[0-9a-f]{16}")
_live: weakref.WeakSet[OwnerLock] = weakref.WeakSet()
_live_lock = threading.Lock()


def is_token(name: str) -> bool:
    return _TOKEN.fullmatch(name) is not None


def temp_name(digest: str, token: str) -> str:
    """The temporary file name of ``token``'s write of block ``digest`` (a tier's temp-name form)."""
    return f".{digest}.{token}.tmp-{secrets.token_hex(8)}"


def temp_owner(name: str) -> tuple[str, str] | None:
    """``(digest, owner token)`` of a temporary file named by :func:`temp_name`, else None."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "" and is_token(parts[2]) and parts[3].startswith("tmp-"):
        return parts[1], parts[2]
    return None


class OwnerLock:
    """This process's liveness lock in a pool directory (module docstring)."""

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, OWNERS_DIR)
        try:
            ensure_private_dirs(root, self.dir, durable=False)
            self.token = secrets.token_hex(8)
            path = os.path.join(self.dir, self.token)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd: int | None = os.open(path, flags, PRIVATE_FILE_MODE)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError as e:
            raise TierError(f"could not create this process's owner lock in {self.dir}: {e}") from e
        self.pid = os.getpid()
        with _live_lock:
            _live.add(self)

    def alive(self, token: object) -> bool:
        """Whether the owner ``token`` still runs (True for this process's own token).

        Anything that is not a token of this form (a row written by an older shoal, garbage) is
        dead: nobody can hold its lock.
        """
        if token == self.token and self._fd is not None:
            return True
        if not isinstance(token, str) or not is_token(token):
            return False
        try:
            fd = open_private(os.path.join(self.dir, token), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True  # cannot tell (a planted file is refused by the owner check): keep its rows
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        finally:
            os.close(fd)  # also drops the shared lock we may have taken
        return False

    def reap(self, token: str) -> None:
        """Remove a dead owner's lock file (after its rows were cleaned up)."""
        if is_token(token) and token != self.token and not self.alive(token):
            with suppress(OSError):
                os.unlink(os.path.join(self.dir, token))

    def listed(self) -> list[str]:
        """Tokens with a lock file (live or not yet reaped)."""
        try:
            return [n for n in os.listdir(self.dir) if is_token(n)]
        except FileNotFoundError:
            return []

    def close(self) -> None:
        """Give the lock up (this process stops owning anything in the pool)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with suppress(OSError):
                os.unlink(os.path.join(self.dir, self.token))
            os.close(fd)

    def _forget_in_child(self) -> None:
        """After ``fork``: the child owns nothing, and must not keep its parent alive."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with suppress(OSError):
                os.close(fd)


def _after_fork_in_child() -> None:
    for owner in list(_live):
        owner._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
