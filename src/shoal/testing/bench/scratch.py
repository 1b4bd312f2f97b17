"""Scratch directories for a one-process benchmark: a disk root and a DRAM root, removed after."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["scratch"]


@contextmanager
def scratch(
    prefix: str, root: str | None = None, *, process_group: bool = False
) -> Iterator[tuple[str, str]]:
    """``(disk, dram)``: fresh directories (``disk`` under ``root`` if given, ``dram`` under
    ``/dev/shm`` where there is one), removed on exit. With ``process_group`` a one-rank gloo group
    is made for the block (a framework that insists on ``torch.distributed``) and destroyed after."""
    disk = tempfile.mkdtemp(prefix=prefix, dir=root)
    dram = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    import torch.distributed as dist

    try:
        if process_group:
            dist.init_process_group("gloo", init_method=f"file://{disk}/pg", rank=0, world_size=1)
        yield disk, dram
    finally:
        if process_group and dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(dram, ignore_errors=True)
