"""The save planner: pure functions over plain data, frozen plans out (docs/design.md section 4).

Input: every rank's report, a :class:`~shoal.group.plan.RankChunks` whose items are one
:class:`~shoal.group.plan.ChunkTable` (keys and sizes per item, every chunk digest as 32 raw
bytes in one buffer, and the 8-byte digest prefixes the rank made: what the group save's
exchange delivers); the digests already durable on the shared tier; the
:class:`~shoal.group.topology.Topology`; and the digests each host's tier already holds.
Output, a :class:`~shoal.group.plan.GroupPlan`:

* **dedup**: each unique chunk once, across ranks and against ``durable`` (incremental saves);
* **drain**: one owner per unique new chunk, among the ranks that staged it, balancing the
  bytes each *host* drains (one storage NIC per host), then each rank of the host;
* **replication**: a new chunk already staged on two hosts of different failure domains, or
  staged on one and held by a host of another domain, needs nothing; every other new chunk is
  sent by its drain owner to :meth:`~shoal.group.topology.Topology.partner_rank` of the owner.

Digests are never shortened or trusted by hash: equal means all 32 bytes equal.

How it works (described here once; each private module names its stage). The coordinator
plans every checkpoint of jobs of thousands of ranks of a thousand chunks each, so no stage
makes a Python object per chunk, and per item only where items differ from their template.
The numbers behind that (16,384 ranks, stage by stage) are in ``docs/benchmarks.md``,
"The group-save planner alone" and its "Why the planner is built the way it is (scale)".

1. **Who holds what** (:mod:`shoal.group._tables`, giving a
   :class:`~shoal.group._holdings.Holdings`). A *slot* is a rank's position in rank order.

   a. *Ranks.* Each rank's table is compared with the last similar rank's (a *template*):
      equal digest buffers, keys and chunk counts (one ``memcmp`` and a tuple comparison)
      make a data-parallel replica; a rank that differs where the previous one did (a ZeRO
      shard in the same items) is confirmed by comparing byte ranges; otherwise, after a few
      sampled digests agree, numpy compares the two buffers digest by digest and the items
      that differ are *extras* of the rank. Ranks that match one template at the same
      positions form a *class*. A rank that matches less than half of its template tries the
      template whose first key and digest it shares (tensor-parallel shards alternate
      templates), and otherwise becomes a template itself.
   b. *Chunks.* The digests of every template item and every extra are keyed by their first
      64 bits (BLAKE3 output is uniform), read from the tables' prefix columns, and sorted in
      place (``np.sort``). Keys seen once are digests seen once; only the positions of
      repeated keys are found again (a bitmap, then ``np.isin`` on the few hits) and grouped
      by their full 32 bytes. A shared key alone merges nothing.
   c. *Items.* Candidate items with the same key and the same digests are one distinct item
      (its ``nbytes`` is the first reporter's): only items all of whose digests repeat (or
      that have none) can be, and only those are compared. The repeats left among distinct
      items are chunk *duplicates* (a tied weight, zeros).

2. **Owners and replicas** (:mod:`shoal.group._assign`). *Solo* items (held by one slot, no
   chunk durable or found in another item: a rank's own shard) are drained and sent whole by
   their holder, with numpy sums and no loop. Every other chunk is handled one by one (first
   occurrences, in flat order), and only chunks several slots hold go through the greedy:
   the most constrained first (fewest hosts hold them: a rank's own shard before a replicated
   weight), then the longest first, each on the least-loaded host holding it (one lazily
   refreshed heap per holder set), then the least-loaded rank of that host. That keeps every
   host within one chunk of the lower bound ``max(forced bytes of any host, new bytes /
   hosts, biggest chunk)`` for the usual mix of sharded and replicated state. A chunk needs a
   replica when every host holding it is in one failure domain and no host of another domain
   holds it already (``held``).

3. **Runs.** Plans hold chunks as :class:`~shoal.group.plan.ChunkRuns`. A rank that drains
   only whole items of its own table gets runs that read the table (no object per item), and
   a transfer that sends everything its sender drains shares the drain's runs, so plans stay
   small to build and to broadcast.

:class:`PlanCache` reuses stage 1 while the tables stay the same, and the whole plan while
nothing else it depends on changes.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np

from shoal._collector import collector_paused
from shoal.errors import ConfigError
from shoal.group import _assign as assign
from shoal.group._assign import Hosts
from shoal.group._holdings import Holdings
from shoal.group._tables import index_tables, same_tables
from shoal.group.plan import (
    ChunkTable,
    GroupPlan,
    RankChunks,
)
from shoal.group.topology import Topology


def _ordered(ranks: Sequence[RankChunks]) -> list[RankChunks]:
    """The reports by rank; each rank once, each a table."""
    ordered = sorted(ranks, key=attrgetter("rank"))
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.rank == b.rank:
            raise ConfigError(f"rank {a.rank} reported its chunks twice")
    bad = next((rc for rc in ordered if not isinstance(rc.items, ChunkTable)), None)
    if bad is not None:
        raise TypeError(
            f"rank {bad.rank} reports its items as {type(bad.items).__name__}; the planner reads one "
            "ChunkTable per rank (ChunkTable.uniform builds one from keys, sizes and digests)"
        )
    return ordered


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
    balance: bool = True,
) -> GroupPlan:
    """Plan one group save: dedup, one drain owner per new chunk balanced by host, replicas.

    ``ranks``: every rank's report (any order; each rank at most once; ``host`` as in
    ``topology``; ``items`` a :class:`ChunkTable`). ``durable``: digests already on the
    shared tier: neither drained nor replicated. ``held``: host -> digests its host tier
    holds from retained checkpoints; a new chunk that a host of another failure domain holds
    needs no transfer. Sets (any sized iterable) are intersected in time proportional to the
    smaller side; a bare ``Container`` costs one membership test per chunk that may need a
    replica. With ``replicate`` the topology must have partners. Without ``balance`` a chunk
    several ranks hold is drained by the lowest of them, whatever its host's load (the
    balanced export switched off, for comparisons). Pure: no I/O, no
    collectives; raises :class:`~shoal.errors.ConfigError` when the reports disagree with the
    topology.
    """
    with collector_paused():
        ordered = _ordered(ranks)
        hosts = _group_hosts(ordered, topology)
        partner = _partners(hosts, topology, replicate)
        h = index_tables([rc.items for rc in ordered])
        w, drains, transfers = assign.plan_parts(h, hosts, durable, held, partner, balance=balance)
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
    balance: bool
    durable: np.ndarray | None
    covered: np.ndarray | None
    plan: GroupPlan


class PlanCache:
    """Reuses the previous group plan when nothing it was computed from has changed.

    ``lookup_or_plan`` takes the arguments of :func:`plan_group_save`, keeps the last
    layout and plan, and on each call compares, exactly (full strings or bytes, no hashes):

    * the layout signature: ``(rank, host, key, nbytes)`` of every item of every rank;
    * every chunk digest of every item (equal digests mean equal chunks, so equal lengths),
      table by table (columns and digest buffers);
    * the topology, ``replicate`` and ``balance``;
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
        balance: bool = True,
    ) -> GroupPlan:
        with collector_paused():
            return self._lookup_or_plan(step, ranks, durable, topology, held, replicate, balance)

    def _lookup_or_plan(
        self,
        step: int,
        ranks: Sequence[RankChunks],
        durable: Container[str],
        topology: Topology,
        held: Mapping[str, Container[str]] | None,
        replicate: bool,
        balance: bool,
    ) -> GroupPlan:
        ordered = _ordered(ranks)
        hosts = _group_hosts(ordered, topology)
        partner = _partners(hosts, topology, replicate)
        who = [(rc.rank, rc.host) for rc in ordered]
        tables = [rc.items for rc in ordered]
        h = self._holdings
        same_layout = h is not None and who == self._ranks and same_tables(h, tables)
        if h is None or not same_layout:
            h = self._holdings = index_tables(tables)
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
            and last.balance == balance
            and _same_flags(last.durable, w.flags)
            and _same_flags(last.covered, covered)
        ):
            self.hits += 1
            return replace(last.plan, step=step)
        if same_layout:
            self.partial_hits += 1
        else:
            self.misses += 1
        owner = assign.owners(h, w, hosts, info, balance=balance)
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
        self._last = _Planned(topology, replicate, balance, w.flags, covered, plan)
        return plan


__all__ = ["PlanCache", "plan_group_save"]
