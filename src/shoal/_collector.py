"""Pausing Python's cyclic garbage collector around work that allocates much and makes no cycles."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
"""Blocks open now, in every thread."""
_resume = False
"""Whether the collector was enabled when the outermost open block began (and is enabled again
when the last one ends)."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block, then restore it as it was.

    For work that allocates many small containers and makes no reference cycles (planning for
    thousands of ranks; DCP's planning and the staging bookkeeping of a save with thousands of
    items; the background pipeline's per-item tables): left on, the collector would traverse
    every object the process holds, several times. Process-wide, for the block only; what the
    block left behind is collected afterwards as usual. Blocks may overlap across threads (the
    training thread's save and the pipeline thread's checkpoint) and nest: the collector is
    paused while any is open, and enabled again when the last ends, if it was enabled when the
    first began.
    """
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
