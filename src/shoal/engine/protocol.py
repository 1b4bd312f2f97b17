"""The data of the group-save protocol: jobs, reports, the per-rank context, and its errors.

Kept apart from :mod:`shoal.engine.group_save` (the protocol's steps) so that the pipeline
and the checkpointer can name these types without the protocol's machinery.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.catalog import ChunkCatalog
from shoal.engine.events import EventLog
from shoal.engine.handle import SaveHandle
from shoal.engine.staged import StagedIndex
from shoal.engine.stager import Slot
from shoal.errors import ShoalError
from shoal.format.chunking import Hasher
from shoal.group.fabric import Fabric
from shoal.group.planner import PlanCache
from shoal.group.topology import Topology
from shoal.tiers.base import Tier


class GroupFailure(ShoalError, RuntimeError):
    """A checkpoint failed on some rank; every rank reports the same error."""


@dataclass(eq=False)
class SaveJob:
    """One staged checkpoint handed to the pipeline (on every rank)."""

    step: int
    slot: Slot
    handle: SaveHandle
    job: str
    created: float = field(default_factory=time.time)
    dcp: Mapping[str, Any] | None = None
    dcp_ready: threading.Event = field(default_factory=threading.Event)
    """Set by DCP's ``finish`` (coordinator) once ``dcp`` holds the encoded metadata, or an abort."""
    aborted: str | None = None
    staged: StagedIndex | None = None
    """The slot's staged index, written at B1 and completed as the checkpoint goes on."""


@dataclass(frozen=True)
class ReportItem:
    """One staged item as its rank reports it: its chunks' BLAKE3 digests, in order.

    ``digests`` reads as a sequence of hex strings. A rank's report holds them as
    :class:`~shoal.group.digests.Digests`, views of one buffer of raw bytes for the whole rank
    (32 bytes a digest), so that the exchange pickles that buffer once instead of a string per
    chunk, and the coordinator plans from it without parsing (a tuple of hex strings works too).
    """

    key: str
    kind: str
    nbytes: int
    dtype: str | None
    shape: tuple[int, ...] | None
    digests: Sequence[str]


@dataclass(frozen=True)
class RankReport:
    """What a rank tells the coordinator in C1."""

    rank: int
    host: str
    items: tuple[ReportItem, ...]
    held: frozenset[str] | None = None
    error: str | None = None
    prefixes: bytes | None = None
    """The first 8 bytes of every digest of ``items``, item after item
    (:meth:`~shoal.group.digests.Digests.prefixes`): the planner's sort keys, made here on every
    rank so that the coordinator does not gather them from millions of digests."""


@dataclass
class PipelineContext:
    """Everything the protocol needs on one rank; owned by the pipeline, used by one thread."""

    fabric: Fabric
    topology: Topology
    shared: Tier
    host_tier: Tier | None
    """Where partner copies land (local disk or DRAM); None when nothing is replicated."""
    chunk_size: int
    replicate: bool
    events: EventLog
    hasher: Hasher
    dram: Tier | None = None
    """The host's DRAM tier: each slot's staged index (``staged/<slot>.json``) is kept there."""
    shared_catalog: ChunkCatalog | None = None
    host_catalog: ChunkCatalog | None = None
    dcp_timeout: float = 300.0
    plan_cache: PlanCache = field(default_factory=PlanCache)
    """The coordinator's plans, reused while the layout and the digests stay the same."""
    scratch: bytearray = field(default_factory=bytearray)
    run_id: str | None = None
    """This run's id (``<shared>/<job>/RUN``), recorded in every manifest it writes."""
    resumed: bool = False
    """Whether this process loaded one of the job's checkpoints before its first commit (a
    restart): its writer claim then continues the previous writer's history."""
    writer: Any = None
    """The coordinator's :class:`shoal.engine.fence.WriterFence` (None elsewhere): checked before
    every commit, ``LATEST`` move and retention pass on the shared tier."""

    @property
    def rank(self) -> int:
        return self.fabric.rank

    @property
    def host(self) -> str:
        return self.topology.host_of(self.rank)

    @property
    def is_host_leader(self) -> bool:
        return self.topology.leader(self.host) == self.rank


def describe(rank: int, phase: str, e: BaseException) -> str:
    return f"rank {rank} ({phase}): {type(e).__name__}: {e}"


def check_errors(errors: Sequence[str | None]) -> None:
    bad = [e for e in errors if e]
    if bad:
        raise GroupFailure("; ".join(bad))
