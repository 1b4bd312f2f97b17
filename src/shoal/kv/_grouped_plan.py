"""Who reads which KV block for a grouped read, and who sends it to whom: pure, every rank alike.

Plain data in, frozen plans out; no I/O, no torch.distributed. :mod:`shoal.kv.grouped` runs the
protocol; this module decides. Every rank of the instance computes the same plans from the same
all-gathered data, so no plan is ever broadcast.

:func:`plan_grouped_read` (after G1, from every rank's :class:`RankWants`) decides, per distinct
block digest:

* every rank whose host's DRAM pool holds the block reads it itself, from memory (it never
  crosses the fabric to that rank);
* the other ranks that want it get it from one *reader*, which is always a rank that wants the
  block itself, so the bytes are read straight into one of its destination buffers (no scratch
  copy): a DRAM holder when there is one (no read from a slower tier at all; holders take turns
  by bytes served), else the wanting rank with the fewest bytes to read from the slower tiers so
  far (ties by rank). Blocks are assigned largest first (then by digest): the greedy keeps every
  rank within one block of the least loaded rank that could have read its last block;
* ranks that give one digest two different sizes get an error, not a read (:class:`SizeConflict`).

:func:`plan_grouped_deliveries` (after G3's status all-gather) turns the blocks read without
error into the fabric exchange of :func:`shoal.group.exchange.plan_exchange`: each block crosses
to each other host that needs it once, and a relay of that host forwards it inside the host.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from shoal.errors import ConfigError
from shoal.group.exchange import ExchangePlan, plan_exchange

__all__ = [
    "BlockAssignment",
    "GroupedReadPlan",
    "RankWants",
    "SizeConflict",
    "Want",
    "plan_grouped_deliveries",
    "plan_grouped_read",
]


@dataclass(frozen=True)
class Want:
    """One block a rank wants: its digest, its size (the rank's buffer), whether its host's DRAM has it."""

    digest: str
    nbytes: int
    in_dram: bool = False


@dataclass(frozen=True)
class RankWants:
    """What one rank contributes to G1: its host and the distinct blocks it wants, in its order."""

    host: str
    wants: tuple[Want, ...]


@dataclass(frozen=True)
class BlockAssignment:
    """One distinct block: who reads it, who reads it locally, who receives it over the fabric."""

    digest: str
    nbytes: int
    reader: int
    """The rank that reads it from its store and sends it (it wants the block itself)."""
    local: tuple[int, ...]
    """Ranks (sorted) reading it from their host's DRAM pool themselves; the reader is one of them
    when ``from_dram``."""
    receivers: tuple[int, ...]
    """Ranks (sorted) that get it over the fabric; never one in ``local``, never the reader."""
    from_dram: bool
    """The reader's host DRAM pool held it at G1 (no read from a slower tier is planned)."""


@dataclass(frozen=True)
class SizeConflict:
    """Ranks gave one block different sizes: every rank that wants it gets an error, nothing is read."""

    digest: str
    sizes: tuple[tuple[int, int], ...]
    """``(rank, nbytes)`` for every rank that wants it, in rank order."""

    def message(self) -> str:
        told = ", ".join(f"rank {r}: {n} bytes" for r, n in self.sizes)
        return (
            f"grouped read: the ranks disagree on the size of block {self.digest} ({told}); "
            f"pass a buffer of the block's size on every rank"
        )


@dataclass(frozen=True)
class GroupedReadPlan:
    """The read half of one grouped read (G2): every rank reads its part."""

    blocks: tuple[BlockAssignment, ...]
    """Every distinct wanted block without a size conflict, by digest."""
    conflicts: tuple[SizeConflict, ...]
    rank_hosts: tuple[str, ...]

    @property
    def world(self) -> int:
        return len(self.rank_hosts)

    def reads_at(self, rank: int) -> list[BlockAssignment]:
        """Blocks ``rank`` reads from its own store: those it reads for others and its DRAM-local ones."""
        return [b for b in self.blocks if b.reader == rank or rank in b.local]

    def slow_bytes(self) -> list[int]:
        """Per rank, the bytes it is planned to read from tiers below DRAM (the balanced load)."""
        load = [0] * self.world
        for b in self.blocks:
            if not b.from_dram:
                load[b.reader] += b.nbytes
        return load

    def fabric_receives(self) -> int:
        """How many (block, rank) deliveries cross the fabric if every read succeeds."""
        return sum(len(b.receivers) for b in self.blocks)


def _check(wants: Sequence[RankWants]) -> None:
    if not wants:
        raise ConfigError("grouped read: the plan needs at least one rank's wants")
    for rank, rw in enumerate(wants):
        seen: set[str] = set()
        for w in rw.wants:
            if w.digest in seen:
                raise ConfigError(f"grouped read: rank {rank} lists block {w.digest} twice; list it once")
            if w.nbytes < 0:
                raise ConfigError(f"grouped read: rank {rank} gives block {w.digest} a size of {w.nbytes}")
            seen.add(w.digest)


def _least(candidates: Sequence[int], load: Sequence[int]) -> int:
    """The candidate with the smallest load, ties by rank."""
    return min(candidates, key=lambda r: (load[r], r))


def plan_grouped_read(wants: Sequence[RankWants]) -> GroupedReadPlan:
    """G2: the reader of every distinct block, its DRAM-local ranks and its fabric receivers.

    ``wants[r]``: rank ``r``'s host and wanted blocks (each digest once per rank). Pure and
    deterministic: the result depends only on ``wants``, never on the order of a set or dict.
    Time is O(total wants log) (a sort) plus, per block, a scan of the ranks that want it.
    """
    _check(wants)
    by_digest: dict[str, list[tuple[int, Want]]] = {}
    for rank, rw in enumerate(wants):
        for w in rw.wants:
            by_digest.setdefault(w.digest, []).append((rank, w))
    conflicts: list[SizeConflict] = []
    sized: list[tuple[int, str]] = []
    for d, entries in by_digest.items():
        if len({w.nbytes for _, w in entries}) > 1:
            conflicts.append(SizeConflict(d, tuple((r, w.nbytes) for r, w in entries)))
        else:
            sized.append((entries[0][1].nbytes, d))
    sized.sort(key=lambda x: (-x[0], x[1]))
    slow = [0] * len(wants)
    served = [0] * len(wants)
    blocks: list[BlockAssignment] = []
    for nbytes, d in sized:
        entries = by_digest[d]
        local = tuple(r for r, w in entries if w.in_dram)
        others = [r for r, w in entries if not w.in_dram]
        if local:
            reader = _least(local, served) if others else local[0]
            if others:
                served[reader] += nbytes
        else:
            reader = _least(others, slow)
            slow[reader] += nbytes
        receivers = tuple(r for r in others if r != reader)
        blocks.append(BlockAssignment(d, nbytes, reader, local, receivers, bool(local)))
    blocks.sort(key=lambda b: b.digest)
    conflicts.sort(key=lambda c: c.digest)
    return GroupedReadPlan(tuple(blocks), tuple(conflicts), tuple(rw.host for rw in wants))


def plan_grouped_deliveries(
    plan: GroupedReadPlan, delivered: Mapping[str, bool], late: Collection[int] = ()
) -> ExchangePlan:
    """G4: the fabric exchange for the blocks whose reader read them (``delivered[digest]`` True).

    A block its reader missed, or failed to read, or read too late travels nowhere: its
    receivers take the reader's outcome instead. A rank in ``late`` (past its own deadline at
    the status all-gather) receives nothing (its fabric blocks are deadline misses), and so
    relays nothing. Every rank passes the same ``delivered`` and ``late`` (both from the status
    all-gather), so every rank computes the same exchange.
    """
    skip = set(late)
    reader_of: dict[str, int] = {}
    needs: list[list[str]] = [[] for _ in range(plan.world)]
    for b in plan.blocks:
        if not b.receivers or not delivered.get(b.digest, False):
            continue
        if all(r in skip for r in b.receivers):
            continue
        reader_of[b.digest] = b.reader
        for r in b.receivers:
            if r not in skip:
                needs[r].append(b.digest)
    return plan_exchange(reader_of, needs, plan.rank_hosts)
