"""Failpoints: named places in the pipeline where tests inject faults (docs/design.md section 9).

``SHOAL_FAILPOINTS="pipeline.before_commit=raise;stage.after_copy=delay:0.5@rank:1"``
arms points by name; each entry is ``name=action[:arg][@rank:N]`` with actions
``raise`` (an :class:`InjectedFault`, an ``OSError``; ``raise:ENOSPC`` raises it with that
errno, as a full disk would), ``delay:<seconds>`` and ``kill`` (SIGKILL of the process).
With the variable unset, :func:`hit` is one dict lookup. The environment is read once, at
import; tests call :func:`configure` instead.

Points, in the order a checkpoint meets them (``rank`` is the global rank):

========================================  =====================================================
``stage.after_copy``                      items copied into the DRAM slab, before B1
``pipeline.before_hash``                  the background worker picked the checkpoint up
``pipeline.after_replica_pack``           a receiver wrote its replica pack, before its index
``pipeline.before_replica_manifest``      a host leader is about to write the host manifest
``pipeline.after_replicate``              B2 reached on this rank
``pipeline.before_drain``                 before this rank writes its pack to shared storage
``pipeline.after_pack``                   pack written, before its index
``pipeline.before_manifest``              coordinator: before the shared manifest (B3)
``pipeline.before_commit``                coordinator: B3 reached, before ``COMMIT``
``pipeline.before_latest``                coordinator: ``COMMIT`` written, before ``LATEST``
========================================  =====================================================

Storage (any checkpoint, any step):

========================================  =====================================================
``shared.write``                          a POSIX shared-tier file: after its first buffer is
                                          written, before the rest (a disk filling up mid-file)
========================================  =====================================================

The KV-cache block store's points (:mod:`shoal.kv`):

========================================  =====================================================
``kv.pool.before_rename``                 a pool block's temporary file is written, not renamed
``kv.local.read``                         before a block is read from the local tier
``kv.shared.read``                        before a block is read from the shared tier
``kv.shared.write``                       before a block is written to the shared tier
========================================  =====================================================
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

ENV = "SHOAL_FAILPOINTS"


class InjectedFault(OSError):
    """The error a ``raise`` failpoint throws (an OSError, like the I/O faults it stands for)."""


@dataclass(frozen=True)
class _Action:
    kind: str
    arg: float = 0.0
    rank: int | None = None
    errno: int | None = None


_armed: dict[str, _Action] = {}


def parse(spec: str) -> dict[str, _Action]:
    """Parse a ``SHOAL_FAILPOINTS`` value; raise ValueError naming the bad entry."""
    out: dict[str, _Action] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, sep, action = entry.partition("=")
        if not sep or not name:
            raise ValueError(f"{ENV}: entry {entry!r} is not 'name=action'")
        rank = None
        if "@rank:" in action:
            action, _, r = action.partition("@rank:")
            rank = int(r)
        kind, _, arg = action.partition(":")
        if kind not in ("raise", "delay", "kill"):
            raise ValueError(f"{ENV}: entry {entry!r}: action must be raise[:ERRNO], delay:<s> or kill")
        code = None
        if kind == "raise" and arg:
            code = getattr(errno, arg, None)
            if not isinstance(code, int):
                raise ValueError(f"{ENV}: entry {entry!r}: {arg!r} is not an errno name (like ENOSPC)")
            arg = ""
        out[name.strip()] = _Action(kind, float(arg) if arg else 0.0, rank, code)
    return out


def configure(spec: str | None) -> None:
    """Arm the failpoints of ``spec`` (replacing any armed before); None or "" disarms all."""
    global _armed
    _armed = parse(spec) if spec else {}


def hit(name: str, *, rank: int = 0) -> None:
    """Run the action armed at ``name`` for ``rank``, if any."""
    if not _armed:
        return
    action = _armed.get(name)
    if action is None or (action.rank is not None and action.rank != rank):
        return
    if action.kind == "delay":
        time.sleep(action.arg)
    elif action.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.errno is not None:
        raise InjectedFault(action.errno, f"{os.strerror(action.errno)} (failpoint {name}, rank {rank})")
    else:
        raise InjectedFault(f"failpoint {name} (rank {rank})")


def process_rank() -> int:
    """This process's rank as the launcher says (``$RANK``), for points below the engine."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


configure(os.environ.get(ENV))
