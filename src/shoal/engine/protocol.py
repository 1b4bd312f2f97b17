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

from shoal.engine.handle import SaveHandle
from shoal.engine.path import PathHistory
from shoal.errors import ShoalError
from shoal.format.chunking import Hasher
from shoal.format.pack import PackIndex
from shoal.group.fabric import Fabric
from shoal.group.planner import PlanCache
from shoal.group.topology import Topology
from shoal.records.catalog import ChunkCatalog, PackPins
from shoal.records.events import EventLog
from shoal.records.staged import StagedIndex
from shoal.records.stager import Slot
from shoal.tiers.base import Tier


class GroupFailure(ShoalError, RuntimeError):
    """A checkpoint failed on some rank; every rank reports the same error."""


class Gate:
    """Whether a staged checkpoint may go on into the group protocol: decided once, by one rank.

    A checkpoint staged through DCP directly (``dcp.save`` with shoal's writer) is handed to
    the pipeline as soon as the rank has staged it, before the rank can know whether DCP's
    save succeeded everywhere: only the rank that runs DCP's ``finish`` learns that. That rank
    decides (``open`` after ``finish``, ``fail`` if ``finish`` failed) and posts the decision on
    the job's :class:`~shoal.group.fabric.Board`; the other ranks' gates read it there. A save
    whose ``finish`` never came (some rank's ``write_data`` failed, so DCP raised on every
    rank) is abandoned by the next thing any rank does (save, load, wait, close). A gate that
    failed makes the pipeline fail the checkpoint at B1 on that rank without a collective, so
    every rank skips it alike and gives its DRAM slot back.
    """

    OPEN = "ok"

    def __init__(self, board: Any = None, key: str | None = None) -> None:
        self._event = threading.Event()
        self._error: str | None = None
        self._board = board
        self._key = key

    @classmethod
    def opened(cls) -> Gate:
        gate = cls()
        gate._event.set()
        return gate

    @property
    def decided(self) -> bool:
        return self._event.is_set()

    @property
    def error(self) -> str | None:
        return self._error

    def _decide(self, verdict: str) -> None:
        if not self._event.is_set():
            self._error = None if verdict == self.OPEN else verdict
            self._event.set()

    def open(self) -> None:
        """This rank ran DCP's ``finish``: the checkpoint goes on (posted for the other ranks)."""
        self._decide(self._post(self.OPEN))

    def fail(self, why: str) -> None:
        """The checkpoint is abandoned (posted; if another rank decided first, its decision holds)."""
        self._decide(self._post(why))

    def _post(self, verdict: str) -> str:
        if self._board is None or self._key is None:
            return verdict
        return str(self._board.post(self._key, verdict))

    def wait(self, poll: float = 0.02) -> str | None:
        """Block until decided; None to go on, or why the checkpoint was abandoned."""
        while not self._event.wait(poll):
            if self._board is not None and self._key is not None:
                verdict = self._board.peek(self._key)
                if verdict is not None:
                    self._decide(verdict)
        return self._error


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
    gate: Gate = field(default_factory=Gate.opened)
    """Whether the checkpoint may enter the group protocol (see :class:`Gate`)."""


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
    dcp: Mapping[str, Any] | None = None
    """The checkpoint's encoded DCP metadata, from the rank that ran DCP's ``finish`` (any rank:
    ``dcp.save(..., coordinator_rank=k)``); None from the others."""
    prefixes: bytes | None = None
    """The first 8 bytes of every digest of ``items``, item after item
    (:meth:`~shoal.group.digests.Digests.prefixes`): the planner's sort keys, made here on every
    rank so that the coordinator does not gather them from millions of digests."""


@dataclass(frozen=True)
class Drained:
    """What a rank tells the coordinator in C6: its drain packs, and how long its writes took.

    The seconds are the completion-time model's evidence (:class:`shoal.engine.path.ModelPolicy`):
    the drain from this rank's first upload's start to its last one's end; the partner copy
    (``partner`` path) over this rank's whole exchange, transfer and host-tier write together.
    """

    packs: list[PackIndex]
    drain_bytes: int = 0
    drain_seconds: float = 0.0
    replica_bytes: int = 0
    replica_seconds: float = 0.0


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
    shared_pins: PackPins = field(default_factory=PackPins)
    """The shared-tier packs the checkpoint in flight reuses (pinned by the coordinator's plan),
    kept apart from those the retention thread deletes."""
    host_catalog: ChunkCatalog | None = None
    dcp_timeout: float = 300.0
    plan_cache: PlanCache = field(default_factory=PlanCache)
    """The coordinator's plans, reused while the layout and the digests stay the same."""
    scratch: bytearray = field(default_factory=bytearray)
    run_id: str | None = None
    """This run's id (``<shared>/<job>/RUN``), recorded in every manifest it writes."""
    path_policy: Any = None
    """The coordinator's :class:`~shoal.engine.path.PathPolicy` (None: the rule of ``Config.path``,
    set by the runtime). ``replicate`` says whether partner copies are possible at all; the
    policy decides, checkpoint by checkpoint, whether this one makes them."""
    path_history: PathHistory = field(default_factory=PathHistory)
    """The coordinator's records of recent checkpoints (the policy's evidence)."""
    resumed: bool = False
    """Whether this process loaded one of the job's checkpoints before its first commit (a
    restart): its writer claim then continues the previous writer's history."""
    drain_streams: int = 1
    """Packs each rank uploads at once for its drain share (``Config.drain_streams``)."""
    balance_drain: bool = True
    """Whether the planner balances the drain over the hosts (``Config.balance_drain``)."""
    drain_pack_bytes: int = 1 << 62
    """About how large a drain pack is (``Config.drain_pack_bytes``); the default: one per rank."""
    writer: Any = None
    """The coordinator's :class:`shoal.records.fence.WriterFence` (None elsewhere): checked before
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
