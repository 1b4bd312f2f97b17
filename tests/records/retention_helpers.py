"""Helpers shared by the retention and pack-list tests: pack ids and bare manifests by step."""

from __future__ import annotations

import time

from shoal.format.chunking import digest
from shoal.format.manifest import Manifest, PackRecord


def pack_id(step: int, n: int = 0) -> str:
    """A well-formed pack id of ``step`` (the ``n``-th of its packs)."""
    return f"{step:012d}-host-r0-{n:08x}"


def bare_manifest(step: int, packs: list[str], writer: str | None = None) -> Manifest:
    """A manifest of ``step`` with no items that references ``packs`` (10 bytes each)."""
    return Manifest(
        job="job",
        step=step,
        created=time.time(),
        chunk_size=4 << 20,
        items={},
        locations={},
        packs={p: PackRecord(10, digest(p.encode())) for p in packs},
        writer=writer,
    )
