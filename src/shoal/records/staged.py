"""A DRAM slot's staged index: what its slab holds, for a restarted process (docs/design.md section 5).

Written to the DRAM tier next to the host's slabs, once per step and in three files, so that no
step rewrites what an earlier one wrote:

1. ``staged/<slot>.json``, at staging, right after the copy, before ``save`` returns (B1): the
   step, the job's world size, and each item's key, kind, offset in the slab, size, dtype and
   shape, as columns (one JSON list per field);
2. ``staged/<slot>.dcp``, on the coordinator, when DCP's ``finish`` delivers the checkpoint's
   metadata: that metadata;
3. ``staged/<slot>.chunks``, in the background, once the slab is hashed: every chunk's BLAKE3
   digest (one hex string for the slot, and the number of chunks of each item).

Each sidecar names the step, slab and creation time of the index it belongs to; a reader takes
a sidecar only when they match (one left by an earlier step of the slot is ignored). The index
of a slot is deleted before the slot is overwritten (:func:`delete_staged`), so an index never
describes bytes that are not there, and its sidecars go with it. Step 1 makes B1's promise
real: after a crash of the training processes (the host survives), the job can restore the
newest staged checkpoint from the slabs of all its hosts, hashing what was not hashed yet.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.group.digests import Digests
from shoal.tiers.base import Tier

if TYPE_CHECKING:
    from shoal.records.stager import StagedItem

STAGED_DIR = "staged"
"""Where each DRAM slot's staged index lives in the DRAM tier."""
STAGED_FORMAT = "shoal-staged/2"
"""The index: items as columns. ``shoal-staged/1`` (a dict per item, digests and DCP metadata
inline) is still read."""
STAGED_FORMAT_V1 = "shoal-staged/1"
DCP_FORMAT = "shoal-staged-dcp/1"
CHUNKS_FORMAT = "shoal-staged-chunks/1"
INDEX_SUFFIX = ".json"
DCP_SUFFIX = ".dcp"
CHUNKS_SUFFIX = ".chunks"
SIDECAR_SUFFIXES = (DCP_SUFFIX, CHUNKS_SUFFIX)


def staged_path(slot_name: str) -> str:
    return f"{STAGED_DIR}/{slot_name}{INDEX_SUFFIX}"


def dcp_path(slot_name: str) -> str:
    """The sidecar with the DCP metadata of the step staged in ``slot_name``."""
    return f"{STAGED_DIR}/{slot_name}{DCP_SUFFIX}"


def chunks_path(slot_name: str) -> str:
    """The sidecar with the chunk digests of the step staged in ``slot_name``."""
    return f"{STAGED_DIR}/{slot_name}{CHUNKS_SUFFIX}"


def delete_staged(dram: Tier, slot_name: str) -> None:
    """Delete the staged index of ``slot_name``, then its sidecars (the index first, always)."""
    dram.delete(staged_path(slot_name))
    dram.delete(dcp_path(slot_name))
    dram.delete(chunks_path(slot_name))


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
    """The run the slab belongs to (docs/design.md section 11): a restore uses only its own run's."""
    dcp_json: str | None = field(default=None, repr=False, compare=False)
    """:attr:`dcp` as JSON, when its writer has it already (the sidecar is then not encoded again)."""
    _written: set[str] = field(default_factory=set, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _bind(self) -> dict[str, Any]:
        """What ties a sidecar to this index."""
        return {"step": self.step, "slab": self.slab, "created": self.created}

    def encode(self) -> bytes:
        """The index itself (``staged/<slot>.json``): the step and the items, as columns."""
        items = self.items
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
            "columns": {
                "key": [i.key for i in items],
                "kind": [i.kind for i in items],
                "offset": [i.offset for i in items],
                "nbytes": [i.nbytes for i in items],
                "dtype": [i.dtype for i in items],
                "shape": [None if i.shape is None else list(i.shape) for i in items],
            },
        }
        return json.dumps(doc).encode()

    def encode_dcp(self) -> bytes:
        """The DCP sidecar: :attr:`dcp` as :attr:`dcp_json` says it when given (the runtime's
        :meth:`~shoal.records.metacache.MetadataEncoder.json_of`, one text per layout)."""
        body = self.dcp_json if self.dcp_json is not None else json.dumps(self.dcp)
        head = json.dumps({"format": DCP_FORMAT, **self._bind()})
        return f'{head[:-1]}, "dcp": {body}}}'.encode()

    def encode_chunks(self) -> bytes:
        """Every item's digests, in item order: one hex string and each item's number of chunks."""
        parts = [self.digests[i.key] for i in self.items]
        joined = Digests.join(parts)
        doc = {**self._bind(), "counts": [len(p) for p in parts], "digests": joined.raw.hex()}
        return json.dumps({"format": CHUNKS_FORMAT, **doc}).encode()

    def write(self, dram: Tier) -> None:
        """Write what is new since the last call: the index, then the DCP metadata, then the digests.

        The first call (at B1) removes the sidecars an earlier step of the slot left; later
        calls write only a sidecar that was not written yet.
        """
        with self._lock:
            if "index" not in self._written:
                dram.delete(dcp_path(self.slab))
                dram.delete(chunks_path(self.slab))
                dram.write(staged_path(self.slab), self.encode())
                self._written.add("index")
            if self.dcp is not None and "dcp" not in self._written:
                dram.write(dcp_path(self.slab), self.encode_dcp())
                self._written.add("dcp")
            hashed = bool(self.digests) and all(i.key in self.digests for i in self.items)
            if hashed and "chunks" not in self._written:
                dram.write(chunks_path(self.slab), self.encode_chunks())
                self._written.add("chunks")


__all__ = [
    "CHUNKS_FORMAT",
    "DCP_FORMAT",
    "SIDECAR_SUFFIXES",
    "STAGED_DIR",
    "STAGED_FORMAT",
    "StagedIndex",
    "chunks_path",
    "dcp_path",
    "delete_staged",
    "staged_path",
]
