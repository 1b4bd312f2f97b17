"""Pausing Python's cyclic garbage collector around work that allocates much and makes no cycles."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block, then restore it as it was.

    For work that allocates many small containers and makes no reference cycles (planning for
    thousands of ranks; DCP's planning and the staging bookkeeping of a save with thousands of
    items): left on, the collector would traverse every object the process holds, several times.
    Process-wide, for the block only; what the block left behind is collected afterwards as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
