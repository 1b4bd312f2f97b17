"""The save planner: pure functions over plain data, frozen plans out (DESIGN.md section 4).

Input: every rank's chunk list (item key, chunk digests and lengths), the chunks already
durable on the shared tier, and for a group save the :class:`~shoal.group.topology.Topology`
and the chunks each host's tier already holds. Output:

* **dedup**: each unique chunk once, across ranks and against ``durable`` (incremental saves);
* **drain**: one owner per unique new chunk, among the ranks that staged it, balancing the
  bytes each *host* drains (one storage NIC per host), then each rank of the host: a greedy
  that places the most constrained chunks first (fewest hosts hold them: a rank's own shard
  before a replicated weight), then the longest first, each on the least-loaded host holding
  it. That keeps every host within one chunk of the lower bound
  ``max(forced bytes of any host, new bytes / hosts, biggest chunk)`` for the usual mix of
  sharded and replicated state;
* **replication** (group saves): a new chunk already staged on two hosts of different failure
  domains, or staged on one and held by a host of another domain, needs nothing; every other
  new chunk is sent by its drain owner to :meth:`Topology.partner_rank` of the owner.

Scale. The coordinator plans every checkpoint, for up to 16,384 ranks of 1,000 chunks each:
16 million digests, more than pure Python can touch one by one in a second. So:

0. reports come as tuples of hex strings or in the *compact* form
   (:class:`~shoal.group.plan.ChunkTable`: a rank's items as columns, its digests as raw
   bytes in one buffer, what the group save's exchange delivers). Compact reports are
   indexed by :mod:`~shoal.group._tables`, which compares whole ranks with ``memcmp``, keys
   digests by their first 64 bits (a prefix column each rank makes) and sorts those
   (``np.sort``), confirming any repeat on all 32 bytes, and touches no Python object per
   chunk; the rest of this list describes the tuple form, whose result is the same
   :class:`~shoal.group._holdings.Holdings`. Either form gives the same plan;
1. :mod:`~shoal.group._holdings` reduces the reports to *distinct items*: each rank is
   compared with the last similar rank (a *template*) in one pass, item by item (same key,
   same digest tuple, compared exactly); only the items that differ are looked up by their
   full ``(key, digests)``. Data-parallel replicas cost one comparison pass each, a rank's own
   shard one dictionary lookup. Chunks shared between distinct items (a tied weight, zeros)
   are found by sorting the digests' Python hashes with numpy, and confirmed on full strings;
2. :mod:`~shoal.group._assign` works on distinct items: an item held by one rank, all new,
   is drained and sent whole by that rank; only chunks several ranks hold go through the
   greedy. Per-chunk arithmetic is numpy;
3. plans hold chunks as :class:`~shoal.group.plan.ChunkRuns` (a whole item is one run that
   shares the reported digest container; a rank that drains only whole items of its own
   compact report gets runs that read its table, no object per item), and a transfer that
   sends everything its sender drains shares the drain's runs, so plans stay small to build
   and to broadcast.

Digests are never shortened or trusted by hash: equal means equal strings, or all 32 bytes.
:class:`PlanCache` reuses the dedup and the plan while nothing they depend on changes.
"""

from __future__ import annotations

import gc
from collections.abc import Container, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np

from shoal.errors import ConfigError
from shoal.group import _assign as assign
from shoal.group._assign import Hosts
from shoal.group._holdings import Holdings, index_reports, same_reports
from shoal.group._tables import TableStore, index_tables, same_tables
from shoal.group.digests import Digests
from shoal.group.plan import (
    CheckpointPlan,
    ChunkRef,
    ChunkRuns,
    ChunkTable,
    DrainAssignment,
    GroupPlan,
    ItemChunks,
    RankChunks,
    Transfer,
)
from shoal.group.topology import Topology


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while planning, then restore it.

    A plan for thousands of ranks allocates millions of small containers and makes no
    reference cycles; left on, the collector would traverse every report object several
    times (a quarter of the time of a 16,384-rank plan). Process-wide, for the call only.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _ordered(ranks: Sequence[RankChunks]) -> list[RankChunks]:
    ordered = sorted(ranks, key=attrgetter("rank"))
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.rank == b.rank:
            raise ConfigError(f"rank {a.rank} reported its chunks twice")
    return ordered


def _compact(reports: Sequence[Sequence[ItemChunks]]) -> bool:
    return any(isinstance(r, ChunkTable) or (len(r) and isinstance(r[0].digests, Digests)) for r in reports)


def _tables(reports: Sequence[Sequence[ItemChunks]]) -> list[ChunkTable | None] | None:
    """The reports as tables when any is compact (a table, or :class:`Digests` digests), else None.

    Tuple-form reports among compact ones are converted (their hex digests parsed once).
    """
    if not _compact(reports):
        return None
    return [r if isinstance(r, ChunkTable) else ChunkTable.from_items(r) if len(r) else None for r in reports]


def _index(reports: Sequence[Sequence[ItemChunks]]) -> Holdings:
    """The planner's first stage, for either form of report."""
    tables = _tables(reports)
    return index_reports(reports) if tables is None else index_tables(tables)


def _same(h: Holdings, reports: Sequence[Sequence[ItemChunks]]) -> bool:
    """Whether ``reports`` are those ``h`` was built from (exactly: keys, sizes, digests)."""
    if isinstance(h.store, TableStore):
        tables = _tables(reports)
        return tables is not None and same_tables(h, tables)
    return not _compact(reports) and same_reports(h, reports)


def plan_save(step: int, ranks: Sequence[RankChunks], durable: Container[str]) -> CheckpointPlan:
    """Deduplicate across ranks and against ``durable``; give each new chunk one owner, balanced by host.

    Hosts are those the ranks report, in order of their lowest rank; nothing is replicated.
    """
    with _collector_paused():
        return _plan_save(step, ranks, durable)


def _plan_save(step: int, ranks: Sequence[RankChunks], durable: Container[str]) -> CheckpointPlan:
    ordered = _ordered(ranks)
    names = list(dict.fromkeys(rc.host for rc in ordered))
    index = {name: i for i, name in enumerate(names)}
    hosts = Hosts(
        [rc.rank for rc in ordered],
        np.array([index[rc.host] for rc in ordered], dtype=np.int64),
        names,
        np.arange(len(names), dtype=np.int64),
    )
    h = _index([rc.items for rc in ordered])
    w, drains, _ = assign.plan_parts(h, hosts, durable, None, None)
    return CheckpointPlan(step, tuple(drains), h.logical_bytes, assign.unique_bytes(h, w), w.reused_bytes)


def _group_hosts(ordered: Sequence[RankChunks], topology: Topology) -> Hosts:
    host_index = {name: i for i, name in enumerate(topology.hosts)}
    domain_index: dict[str, int] = {}
    domain = np.array(
        [domain_index.setdefault(topology.domains[h], len(domain_index)) for h in topology.hosts],
        dtype=np.int64,
    )
    ranks = [rc.rank for rc in ordered]  # ascending
    if ranks and not 0 <= ranks[0] <= ranks[-1] < topology.world_size:
        bad = next(r for r in ranks if not 0 <= r < topology.world_size)
        raise ConfigError(f"rank {bad} reported chunks, but the job has {topology.world_size} ranks")
    expected = list(map(topology.rank_hosts.__getitem__, ranks))
    reported = [rc.host for rc in ordered]
    if reported != expected:
        rank, host, theirs = next(x for x in zip(ranks, reported, expected, strict=True) if x[1] != x[2])
        raise ConfigError(f"rank {rank} reports host {host!r}, but the topology puts it on {theirs!r}")
    slot_host = np.fromiter(map(host_index.__getitem__, expected), np.int64, len(expected))
    return Hosts(ranks, slot_host, list(topology.hosts), domain)


def _partners(hosts: Hosts, topology: Topology, replicate: bool) -> list[int] | None:
    """The receiving rank for each slot, or None without replication."""
    if not replicate:
        return None
    if not topology.partners:
        raise ConfigError(
            "replicate=True needs a topology with partners; this one was built with replicate=False "
            f"or for one host ({list(topology.hosts)})"
        )
    return list(map(topology.partner_ranks.__getitem__, hosts.ranks))


def plan_group_save(
    step: int,
    ranks: Sequence[RankChunks],
    durable: Container[str],
    topology: Topology,
    *,
    held: Mapping[str, Container[str]] | None = None,
    replicate: bool = True,
) -> GroupPlan:
    """Plan one group save: dedup, one drain owner per new chunk balanced by host, replicas.

    ``ranks``: every rank's report (any order; each rank at most once; ``host`` as in
    ``topology``). ``durable``: digests already on the shared tier: neither drained nor
    replicated. ``held``: host -> digests its host tier holds from retained checkpoints;
    a new chunk that a host of another failure domain holds needs no transfer. Sets (any
    sized iterable) are intersected in time proportional to the smaller side; a bare
    ``Container`` costs one membership test per chunk that may need a replica. With
    ``replicate`` the topology must have partners. Pure: no I/O, no collectives; raises
    :class:`~shoal.errors.ConfigError` when the reports disagree with the topology.
    """
    with _collector_paused():
        ordered = _ordered(ranks)
        hosts = _group_hosts(ordered, topology)
        partner = _partners(hosts, topology, replicate)
        h = _index([rc.items for rc in ordered])
        w, drains, transfers = assign.plan_parts(h, hosts, durable, held, partner)
        return GroupPlan(
            step, tuple(drains), tuple(transfers), h.logical_bytes, assign.unique_bytes(h, w), w.reused_bytes
        )


def _same_flags(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Equal flag arrays, None standing for all False."""
    if a is None or b is None:
        return not (a is not None and a.any()) and not (b is not None and b.any())
    return np.array_equal(a, b)


@dataclass(frozen=True)
class _Planned:
    """What the cached plan was computed from, besides the reports."""

    topology: Topology
    replicate: bool
    durable: np.ndarray | None
    covered: np.ndarray | None
    plan: GroupPlan


class PlanCache:
    """Reuses the previous group plan when nothing it was computed from has changed.

    ``lookup_or_plan`` takes the arguments of :func:`plan_group_save`, keeps the last
    layout and plan, and on each call compares, exactly (full strings or bytes, no hashes):

    * the layout signature: ``(rank, host, key, nbytes)`` of every item of every rank;
    * every chunk digest of every item (equal digests mean equal chunks, so equal lengths);
      compact reports are compared table by table (columns and digest buffers);
    * the topology and ``replicate``;
    * whether each chunk is in ``durable``, and, for each new chunk that may need a
      replica, whether a host of another failure domain holds it (``held``).

    Same layout and digests: the dedup of the reports is reused. Same membership, topology
    and ``replicate`` too: the previous plan is returned with the new ``step``. Otherwise
    owners and transfers are computed again. The comparison is one pass over every item of
    every rank, so a hit costs about what the first stage of planning does; what it saves is
    the rest (hashing new digests, owners, runs). The cache keeps the distinct items of the
    last reports alive (for a fully sharded job, all of them) until the next lookup. One
    coordinator thread owns a cache.
    """

    def __init__(self) -> None:
        self.hits = 0
        """Lookups that returned the previous plan."""
        self.partial_hits = 0
        """Lookups that reused the dedup but planned again (membership or topology changed)."""
        self.misses = 0
        self._ranks: list[tuple[int, str]] = []
        self._holdings: Holdings | None = None
        self._last: _Planned | None = None

    def lookup_or_plan(
        self,
        step: int,
        ranks: Sequence[RankChunks],
        durable: Container[str],
        topology: Topology,
        *,
        held: Mapping[str, Container[str]] | None = None,
        replicate: bool = True,
    ) -> GroupPlan:
        with _collector_paused():
            return self._lookup_or_plan(step, ranks, durable, topology, held, replicate)

    def _lookup_or_plan(
        self,
        step: int,
        ranks: Sequence[RankChunks],
        durable: Container[str],
        topology: Topology,
        held: Mapping[str, Container[str]] | None,
        replicate: bool,
    ) -> GroupPlan:
        ordered = _ordered(ranks)
        hosts = _group_hosts(ordered, topology)
        partner = _partners(hosts, topology, replicate)
        who = [(rc.rank, rc.host) for rc in ordered]
        reports = [rc.items for rc in ordered]
        h = self._holdings
        same_layout = h is not None and who == self._ranks and _same(h, reports)
        if h is None or not same_layout:
            h = self._holdings = _index(reports)
            self._ranks, self._last = who, None
        w = assign.split(h, durable)
        info = assign.SetInfos(h.sets, hosts)
        r = assign.replicas(h, w, hosts, info, held) if partner is not None else None
        covered = r.covered if r is not None else None
        last = self._last
        if (
            last is not None
            and last.topology == topology
            and last.replicate == replicate
            and _same_flags(last.durable, w.flags)
            and _same_flags(last.covered, covered)
        ):
            self.hits += 1
            return replace(last.plan, step=step)
        if same_layout:
            self.partial_hits += 1
        else:
            self.misses += 1
        owner = assign.owners(h, w, hosts, info)
        drained = assign.drains(h, w, hosts, owner)
        transfers = (
            [] if r is None or partner is None else assign.transfers(h, w, hosts, owner, r, partner, drained)
        )
        plan = GroupPlan(
            step,
            tuple(drained.drains),
            tuple(transfers),
            h.logical_bytes,
            assign.unique_bytes(h, w),
            w.reused_bytes,
        )
        self._last = _Planned(topology, replicate, w.flags, covered, plan)
        return plan


__all__ = [  # the plan's data types live in shoal.group.plan; importing them from here still works
    "CheckpointPlan",
    "ChunkRef",
    "ChunkRuns",
    "ChunkTable",
    "Digests",
    "DrainAssignment",
    "GroupPlan",
    "ItemChunks",
    "PlanCache",
    "RankChunks",
    "Transfer",
    "plan_group_save",
    "plan_save",
]
