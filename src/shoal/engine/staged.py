"""A DRAM slot's staged index: what its slab holds, for a restarted process (DESIGN.md section 5).

Written to the DRAM tier (``staged/<slot>.json``, next to the host's slabs) in three steps:

1. at staging, right after the copy, before ``save`` returns (B1): the step, the job's world
   size, and each item's key, kind, offset in the slab, size, dtype and shape;
2. on the coordinator, when DCP's ``finish`` delivers the checkpoint's metadata: that too;
3. in the background, once the slab is hashed: every chunk's BLAKE3 digest.

The index of a slot is deleted before the slot is overwritten, so an index never describes
bytes that are not there. Step 1 makes B1's promise real: after a crash of the training
processes (the host survives), the job can restore the newest staged checkpoint from the
slabs of all its hosts, hashing what was not hashed yet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.stager import StagedItem
from shoal.tiers.base import Tier

STAGED_DIR = "staged"
"""Where each DRAM slot's staged index lives in the DRAM tier."""
STAGED_FORMAT = "shoal-staged/1"


def staged_path(slot_name: str) -> str:
    return f"{STAGED_DIR}/{slot_name}.json"


@dataclass
class StagedIndex:
    """The staged index of one slot (mutable while its checkpoint is in flight)."""

    job: str
    step: int
    rank: int
    world_size: int
    slab: str
    chunk_size: int
    items: list[StagedItem]
    created: float = field(default_factory=time.time)
    digests: dict[str, Sequence[str]] = field(default_factory=dict)
    """Item key -> chunk digests, once hashed."""
    dcp: Mapping[str, Any] | None = None
    """The checkpoint's DCP metadata (coordinator only)."""
    run: str | None = None
    """The run the slab belongs to (DESIGN.md section 11): a restore uses only its own run's."""

    def encode(self) -> bytes:
        doc = {
            "format": STAGED_FORMAT,
            "job": self.job,
            "run": self.run,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "slab": self.slab,
            "chunk_size": self.chunk_size,
            "created": self.created,
            "items": [
                {
                    "key": i.key,
                    "kind": i.kind,
                    "offset": i.offset,
                    "nbytes": i.nbytes,
                    "dtype": i.dtype,
                    "shape": None if i.shape is None else list(i.shape),
                    "chunks": list(self.digests[i.key]) if i.key in self.digests else None,
                }
                for i in self.items
            ],
            "dcp": self.dcp,
        }
        return json.dumps(doc).encode()

    def write(self, dram: Tier) -> None:
        dram.write(staged_path(self.slab), self.encode())


__all__ = ["STAGED_DIR", "STAGED_FORMAT", "StagedIndex", "staged_path"]
