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

Scale. The planner runs on the coordinator for every checkpoint, at up to 16,384 ranks with
1,000 chunks each: 16 million digests. Nothing here is per chunk *and* per rank in Python:

1. ranks are compared item by item, in C, with the last similar rank (a *template*); items
   equal to the template's (same key, same digest tuple, compared exactly) join its distinct
   item without hashing. Only the items that differ are looked up by their full key and
   digests. Data-parallel replicas therefore cost one comparison pass; a rank's own shards
   cost one dictionary lookup each;
2. chunk-level dedup and all per-chunk arithmetic run over *distinct* items only, with one
   dictionary of the full digests and numpy arrays; a chunk held by one rank is assigned to
   it without the greedy, which runs only over chunks several ranks hold;
3. plans hold chunks as :class:`ChunkRuns`: a whole item is one run sharing the reported
   digest tuple, so plans stay small to build and to send.

Digests are never shortened or hashed into something weaker: equal means equal strings.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from operator import attrgetter, getitem
from typing import cast

import numpy as np

from shoal.errors import ConfigError
from shoal.group._holdings import Holdings, index_reports
from shoal.group.topology import Topology


@dataclass(frozen=True)
class ItemChunks:
    """One staged item as its rank reports it."""

    key: str
    nbytes: int
    digests: tuple[str, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class RankChunks:
    rank: int
    host: str
    items: tuple[ItemChunks, ...]


@dataclass(frozen=True)
class ChunkRef:
    """Where a rank finds a chunk in its own staged state."""

    digest: str
    key: str
    index: int
    length: int


@dataclass(frozen=True)
class ChunkRuns:
    """Chunks as runs of consecutive chunks of one item, stored as columns.

    Run ``i`` holds chunks ``starts[i]``, ``starts[i] + 1``, ... of item ``keys[i]``, with
    digests ``digests[i]`` and lengths ``lengths[i]``; runs are in (key, start) order.
    Iterating yields one :class:`ChunkRef` per chunk.
    """

    keys: tuple[str, ...] = ()
    starts: tuple[int, ...] = ()
    digests: tuple[tuple[str, ...], ...] = ()
    lengths: tuple[tuple[int, ...], ...] = ()

    def __iter__(self) -> Iterator[ChunkRef]:
        for key, start, digests, lengths in zip(
            self.keys, self.starts, self.digests, self.lengths, strict=True
        ):
            for i, (d, n) in enumerate(zip(digests, lengths, strict=True)):
                yield ChunkRef(d, key, start + i, n)

    def __len__(self) -> int:
        return sum(map(len, self.digests))

    @property
    def nbytes(self) -> int:
        return sum(map(sum, self.lengths))


@dataclass(frozen=True)
class DrainAssignment:
    """The chunks one rank writes to the shared tier, from its own staged state."""

    rank: int
    host: str
    runs: ChunkRuns

    @property
    def chunks(self) -> tuple[ChunkRef, ...]:
        return tuple(self.runs)

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


@dataclass(frozen=True)
class Transfer:
    """One point-to-point stream of chunks, found in the *sender's* staged state."""

    src_rank: int
    dst_rank: int
    runs: ChunkRuns

    @property
    def chunks(self) -> tuple[ChunkRef, ...]:
        return tuple(self.runs)

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


_KEY = attrgetter("key")
_NBYTES = attrgetter("nbytes")
_DIGESTS = attrgetter("digests")
_LENGTHS = attrgetter("lengths")


def _bytes_per_host(drains: Sequence[DrainAssignment]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in drains:
        out[d.host] = out.get(d.host, 0) + d.nbytes
    return out


def _drain_for(drains: Sequence[DrainAssignment], rank: int) -> DrainAssignment | None:
    i = bisect_left(drains, rank, key=attrgetter("rank"))
    return drains[i] if i < len(drains) and drains[i].rank == rank else None


@dataclass(frozen=True)
class CheckpointPlan:
    """A plan without replication (:func:`plan_save`): who drains which new chunk."""

    step: int
    drains: tuple[DrainAssignment, ...]
    """One per rank that drains anything, by rank."""
    logical_bytes: int
    unique_bytes: int
    reused_bytes: int
    """Unique bytes already durable: not written again."""

    @property
    def new_bytes(self) -> int:
        return sum(d.nbytes for d in self.drains)

    def drain_for(self, rank: int) -> DrainAssignment | None:
        return _drain_for(self.drains, rank)

    def bytes_per_host(self) -> dict[str, int]:
        """Drain bytes per host (hosts that drain nothing are left out)."""
        return _bytes_per_host(self.drains)


@dataclass(frozen=True)
class GroupPlan:
    """The plan of one group save: drains to shared storage and transfers to partner hosts."""

    step: int
    drains: tuple[DrainAssignment, ...]
    """One per rank that drains anything, by rank."""
    transfers: tuple[Transfer, ...]
    """One per (sender, receiver) pair, by sender then receiver."""
    logical_bytes: int
    unique_bytes: int
    reused_bytes: int
    """Unique bytes already durable on the shared tier: neither drained nor replicated."""

    @property
    def new_bytes(self) -> int:
        return self.unique_bytes - self.reused_bytes

    @property
    def replicated_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def drain_for(self, rank: int) -> DrainAssignment | None:
        return _drain_for(self.drains, rank)

    def sends_from(self, rank: int) -> tuple[Transfer, ...]:
        get = attrgetter("src_rank")
        return self.transfers[
            bisect_left(self.transfers, rank, key=get) : bisect_right(self.transfers, rank, key=get)
        ]

    def receives_at(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.dst_rank == rank)

    def bytes_per_host(self) -> dict[str, int]:
        """Drain bytes per host (hosts that drain nothing are left out)."""
        return _bytes_per_host(self.drains)


# -- the plan from the holdings: membership, owners, replicas, runs --------------------------
def _is_empty(c: Container[str]) -> bool:
    try:
        return len(c) == 0  # type: ignore[arg-type]
    except TypeError:
        return False


def _members(c: Container[str], digests: Sequence[str]) -> np.ndarray:
    """Whether each of ``digests`` is in ``c``, as a bool array."""
    if _is_empty(c):
        return np.zeros(len(digests), dtype=bool)
    return np.fromiter(map(c.__contains__, digests), bool, len(digests))


@dataclass
class _Hosts:
    """Where the slots run: rank and host index per slot, host names, domain index per host."""

    ranks: list[int]
    slot_host: np.ndarray
    names: list[str]
    domain: np.ndarray


class _SetInfo:
    """Per holder set: its hosts (ascending index), slots by host, domain count, greedy heap."""

    def __init__(self, slots: tuple[int, ...], hosts: _Hosts) -> None:
        by_host: dict[int, list[int]] = {}
        for s, h in zip(slots, hosts.slot_host[list(slots)].tolist(), strict=True):
            by_host.setdefault(h, []).append(s)
        self.hosts = sorted(by_host)
        self.by_host = by_host
        self.domains = len(set(hosts.domain[self.hosts].tolist()))
        self.heap: list[tuple[int, int]] | None = None


class _SetInfos:
    """:class:`_SetInfo` of each holder set, built when first asked for."""

    def __init__(self, sets: list[tuple[int, ...]], hosts: _Hosts) -> None:
        self._sets, self._hosts = sets, hosts
        self._info: dict[int, _SetInfo] = {}

    def __getitem__(self, k: int) -> _SetInfo:
        info = self._info.get(k)
        if info is None:
            info = self._info[k] = _SetInfo(self._sets[k], self._hosts)
        return info

    def column(self, ks: np.ndarray, field: Callable[[_SetInfo], int]) -> np.ndarray:
        """``field`` of the set of each of ``ks``."""
        unique, inverse = np.unique(ks, return_inverse=True)
        values = np.fromiter((field(self[k]) for k in unique.tolist()), np.int64, len(unique))
        return values[inverse.reshape(-1)]


@dataclass
class _Work:
    """A layout split by ``durable``: *solo* items, drained whole by their one holder, and chunks.

    An item is solo when one slot holds it, none of its chunks is durable and none appears
    elsewhere; the rest is handled chunk by chunk (first occurrences only), in flat order.
    """

    solo: np.ndarray
    flat: np.ndarray
    item: np.ndarray
    index: np.ndarray
    length: np.ndarray
    holder: np.ndarray
    durable: np.ndarray
    flags: np.ndarray | None
    """Durable flag per flat position; None when ``durable`` was empty."""

    @property
    def reused_bytes(self) -> int:
        return int(self.length[self.durable].sum())


def _split(h: Holdings, durable: Container[str]) -> _Work:
    flags = None if _is_empty(durable) else _members(durable, h.digests)
    nonempty = h.count > 0
    solo = nonempty & (h.holder >= 0)
    if flags is not None:
        per_item = np.bincount(h.item_of(np.flatnonzero(flags)), minlength=len(h.items))
        solo &= per_item == 0
    if h.dups is not None:
        solo[h.dups.items] = False
    other = np.flatnonzero(nonempty & ~solo)
    counts = h.count[other]
    item = np.repeat(other, counts)
    index = np.arange(len(item), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    flat = h.start[item] + index
    length = np.fromiter(
        chain.from_iterable(map(attrgetter("lengths"), map(h.items.__getitem__, other.tolist()))),
        np.int64,
        len(item),
    )
    holder = h.holder[item]
    if h.dups is not None:
        keep = h.dups.canon[flat] == flat
        flat, item, index, length, holder = flat[keep], item[keep], index[keep], length[keep], holder[keep]
        firsts = np.array(list(h.dups.holder), dtype=np.int64)
        holder[np.searchsorted(flat, firsts)] = list(h.dups.holder.values())
    is_durable = flags[flat] if flags is not None else np.zeros(len(flat), dtype=bool)
    return _Work(solo, flat, item, index, length, holder, is_durable, flags)


def _owners(h: Holdings, w: _Work, hosts: _Hosts, info: _SetInfos) -> np.ndarray:
    """The draining slot of every chunk of ``w`` (-1 for durable ones); solo items go to their holder."""
    n_slots = len(hosts.ranks)
    solo = np.flatnonzero(w.solo)
    owner = np.full(len(w.flat), -1, dtype=np.int64)
    single = ~w.durable & (w.holder >= 0)
    owner[single] = w.holder[single]
    # Float sums of integer byte counts are exact below 2**53 (8 PiB per rank).
    load = np.zeros(n_slots)
    load += np.bincount(h.holder[solo], weights=h.nbytes[solo], minlength=n_slots)
    load += np.bincount(w.holder[single], weights=w.length[single], minlength=n_slots)
    slot_load = np.rint(load).astype(np.int64)
    multi = np.flatnonzero(~w.durable & (w.holder < 0))
    if not len(multi):
        return owner
    host_load_arr = np.rint(np.bincount(hosts.slot_host, weights=slot_load, minlength=len(hosts.names)))
    sets = -1 - w.holder[multi]
    spread = info.column(sets, lambda s: len(s.hosts))
    order = np.lexsort((multi, -w.length[multi], spread))
    rank_load, host_load = slot_load.tolist(), host_load_arr.astype(np.int64).tolist()
    chosen = []
    picks = zip(multi[order].tolist(), sets[order].tolist(), w.length[multi][order].tolist(), strict=True)
    for c, k, n in picks:
        s = info[k]
        if len(s.hosts) == 1:
            host = s.hosts[0]
        else:
            heap = s.heap
            if heap is None:
                heap = s.heap = [(host_load[x], x) for x in s.hosts]
                heapq.heapify(heap)
            while heap[0][0] != host_load[heap[0][1]]:  # stale: another set's chunk landed there
                heapq.heapreplace(heap, (host_load[heap[0][1]], heap[0][1]))
            host = heap[0][1]
        slots = s.by_host[host]
        slot = slots[0] if len(slots) == 1 else min(slots, key=rank_load.__getitem__)
        host_load[host] += n
        rank_load[slot] += n
        if s.heap is not None:
            heapq.heapreplace(s.heap, (host_load[host], host))
        chosen.append((c, slot))
    cs, slots_chosen = zip(*chosen, strict=True)
    owner[list(cs)] = slots_chosen
    return owner


def _located(h: Holdings, w: _Work, chunks: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(item, index) where each of ``slots`` finds each of ``chunks`` (of ``w``) in its own state.

    Only a chunk found in several distinct items can differ from ``w``'s (its first occurrence):
    the slot finds it at the first occurrence it holds.
    """
    item, index = w.item[chunks], w.index[chunks]
    if h.dups is not None:
        places = h.dups.places
        for i in np.flatnonzero(np.isin(w.flat[chunks], list(places))).tolist():
            slot = int(slots[i])
            ps = places[int(w.flat[chunks[i]])]
            for it, p in zip(h.item_of(np.array(ps)).tolist(), ps, strict=True):
                if h.holds(slot, it):
                    item[i], index[i] = it, p - int(h.start[it])
                    break
    return item, index


def _runs(
    h: Holdings,
    whole: np.ndarray,
    whole_slots: np.ndarray,
    part_slots: np.ndarray,
    part_items: np.ndarray,
    part_index: np.ndarray,
) -> list[tuple[int, ChunkRuns]]:
    """(slot, runs) per slot, by slot: whole items plus single chunks, in (key, index) order."""
    if len(part_slots):
        order = np.lexsort((part_index, part_items, part_slots))
        slots, items, index = part_slots[order], part_items[order], part_index[order]
        brk = np.ones(len(slots), dtype=bool)
        brk[1:] = (slots[1:] != slots[:-1]) | (items[1:] != items[:-1]) | (index[1:] != index[:-1] + 1)
        first = np.flatnonzero(brk)
        sizes = np.diff(np.append(first, len(slots)))
        run_slot = np.concatenate([whole_slots, slots[first]])
        run_item = np.concatenate([whole, items[first]])
        run_start = np.concatenate([np.zeros(len(whole), dtype=np.int64), index[first]])
        run_end = np.concatenate([h.count[whole], index[first] + sizes])
    else:
        run_slot, run_item = whole_slots, whole
        run_start, run_end = np.zeros(len(whole), dtype=np.int64), h.count[whole]
    if not len(run_slot):
        return []
    order = np.lexsort((run_start, run_item, h.key_rank()[run_item], run_slot))
    run_slot, run_item = run_slot[order], run_item[order].tolist()
    starts, ends = run_start[order].tolist(), run_end[order].tolist()
    reps = list(map(h.items.__getitem__, run_item))
    keys = list(map(_KEY, reps))
    cuts = list(map(slice, starts, ends))
    # A slice of a whole tuple is the tuple itself: whole items share the reported digests.
    digests = cast("list[tuple[str, ...]]", list(map(getitem, map(_DIGESTS, reps), cuts)))
    lengths = cast("list[tuple[int, ...]]", list(map(getitem, map(_LENGTHS, reps), cuts)))
    firsts = np.flatnonzero(np.append(True, run_slot[1:] != run_slot[:-1]))
    bounds = np.append(firsts, len(run_item)).tolist()
    return [
        (slot, ChunkRuns(tuple(keys[a:b]), tuple(starts[a:b]), tuple(digests[a:b]), tuple(lengths[a:b])))
        for slot, a, b in zip(run_slot[firsts].tolist(), bounds[:-1], bounds[1:], strict=True)
    ]


def _drains(h: Holdings, w: _Work, hosts: _Hosts, owner: np.ndarray) -> list[DrainAssignment]:
    solo = np.flatnonzero(w.solo)
    new = np.flatnonzero(owner >= 0)
    item, index = _located(h, w, new, owner[new])
    return [
        DrainAssignment(hosts.ranks[slot], hosts.names[int(hosts.slot_host[slot])], runs)
        for slot, runs in _runs(h, solo, h.holder[solo], owner[new], item, index)
    ]


@dataclass
class _Replicas:
    """The chunks that may need a replica (holders in one failure domain), and which are covered.

    ``solo`` are the solo items (all of them qualify), ``chunks`` the qualifying chunks of the
    work; ``covered`` is, for the chunks of the solo items in flat order and then ``chunks``,
    whether a host of another domain already holds it (``held``).
    """

    solo: np.ndarray
    chunks: np.ndarray
    covered: np.ndarray


def _replicas(
    h: Holdings, w: _Work, hosts: _Hosts, info: _SetInfos, held: Mapping[str, Container[str]] | None
) -> _Replicas:
    solo = np.flatnonzero(w.solo)
    one_domain = w.holder >= 0
    one_domain[~one_domain] = info.column(-1 - w.holder[~one_domain], lambda s: s.domains) == 1
    chunks = np.flatnonzero(~w.durable & one_domain)
    n_solo_chunks = int(h.count[solo].sum())
    covered = np.zeros(n_solo_chunks + len(chunks), dtype=bool)
    if not held or all(_is_empty(c) for c in held.values()):
        return _Replicas(solo, chunks, covered)
    # Digest and domain of each candidate chunk: the solo items' chunks, then the work's.
    counts = h.count[solo]
    flat = np.repeat(h.start[solo], counts) + (
        np.arange(n_solo_chunks, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    flat = np.concatenate([flat, w.flat[chunks]])
    digests = list(map(h.digests.__getitem__, flat.tolist()))
    holder = np.concatenate([np.repeat(h.holder[solo], counts), w.holder[chunks]])
    host = hosts.slot_host[np.maximum(holder, 0)]
    in_set = holder < 0  # all of a set's hosts are in one domain here: take its first
    host[in_set] = info.column(-1 - holder[in_set], lambda s: s.hosts[0])
    domain = hosts.domain[host]
    host_index = {name: i for i, name in enumerate(hosts.names)}
    position: dict[str, int] | None = None
    for name, holds in held.items():
        if name not in host_index or _is_empty(holds):
            continue
        if isinstance(holds, Collection) and len(holds) < len(digests):
            if position is None:
                position = dict(zip(digests, range(len(digests)), strict=True))
            mask = np.zeros(len(digests), dtype=bool)
            mask[np.fromiter((position[d] for d in position.keys() & holds), np.int64)] = True
        else:
            mask = _members(holds, digests)
        covered |= mask & (domain != hosts.domain[host_index[name]])
    return _Replicas(solo, chunks, covered)


def _transfers(
    h: Holdings, w: _Work, hosts: _Hosts, owner: np.ndarray, r: _Replicas, partner: Sequence[int]
) -> list[Transfer]:
    n_solo_chunks = int(h.count[r.solo].sum())
    whole = r.solo
    part_slots, part_items, part_index = [], [], []
    if r.covered[:n_solo_chunks].any():
        # Solo items some of whose chunks are held elsewhere: send the rest chunk by chunk.
        counts = h.count[r.solo]
        item = np.repeat(r.solo, counts)
        index = np.arange(n_solo_chunks, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        hit = r.covered[:n_solo_chunks]
        partial = np.unique(item[hit])
        whole = np.setdiff1d(r.solo, partial)
        send = ~hit & np.isin(item, partial)
        part_items.append(item[send])
        part_index.append(index[send])
        part_slots.append(h.holder[item[send]])
    chunks = r.chunks[~r.covered[n_solo_chunks:]]
    slots = owner[chunks]
    item, index = _located(h, w, chunks, slots)
    part_slots.append(slots)
    part_items.append(item)
    part_index.append(index)
    runs = _runs(h, whole, h.holder[whole], *map(np.concatenate, (part_slots, part_items, part_index)))
    return [Transfer(hosts.ranks[slot], partner[slot], runs) for slot, runs in runs]


def _plan_parts(
    h: Holdings,
    hosts: _Hosts,
    durable: Container[str],
    held: Mapping[str, Container[str]] | None,
    partner: Sequence[int] | None,
) -> tuple[_Work, _Replicas | None, list[DrainAssignment], list[Transfer]]:
    w = _split(h, durable)
    info = _SetInfos(h.sets, hosts)
    owner = _owners(h, w, hosts, info)
    drains = _drains(h, w, hosts, owner)
    if partner is None:
        return w, None, drains, []
    r = _replicas(h, w, hosts, info, held)
    return w, r, drains, _transfers(h, w, hosts, owner, r, partner)


def _unique_bytes(h: Holdings, w: _Work) -> int:
    return int(h.nbytes[w.solo].sum()) + int(w.length.sum())


def _ordered(ranks: Sequence[RankChunks]) -> list[RankChunks]:
    ordered = sorted(ranks, key=attrgetter("rank"))
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.rank == b.rank:
            raise ConfigError(f"rank {a.rank} reported its chunks twice")
    return ordered


def plan_save(step: int, ranks: Sequence[RankChunks], durable: Container[str]) -> CheckpointPlan:
    """Deduplicate across ranks and against ``durable``; give each new chunk one owner, balanced by host.

    Hosts are those the ranks report, in order of their lowest rank; nothing is replicated.
    """
    ordered = _ordered(ranks)
    names = list(dict.fromkeys(rc.host for rc in ordered))
    index = {name: i for i, name in enumerate(names)}
    hosts = _Hosts(
        [rc.rank for rc in ordered],
        np.array([index[rc.host] for rc in ordered], dtype=np.int64),
        names,
        np.arange(len(names), dtype=np.int64),
    )
    h = index_reports([rc.items for rc in ordered])
    w, _, drains, _ = _plan_parts(h, hosts, durable, None, None)
    return CheckpointPlan(step, tuple(drains), h.logical_bytes, _unique_bytes(h, w), w.reused_bytes)


def _group_hosts(ordered: Sequence[RankChunks], topology: Topology) -> _Hosts:
    host_index = {name: i for i, name in enumerate(topology.hosts)}
    domain_index: dict[str, int] = {}
    domain = np.array(
        [domain_index.setdefault(topology.domains[h], len(domain_index)) for h in topology.hosts],
        dtype=np.int64,
    )
    slot_host = []
    for rc in ordered:
        if not 0 <= rc.rank < topology.world_size:
            raise ConfigError(f"rank {rc.rank} reported chunks, but the job has {topology.world_size} ranks")
        if rc.host != topology.rank_hosts[rc.rank]:
            raise ConfigError(
                f"rank {rc.rank} reports host {rc.host!r}, but the topology puts it on "
                f"{topology.rank_hosts[rc.rank]!r}"
            )
        slot_host.append(host_index[rc.host])
    return _Hosts(
        [rc.rank for rc in ordered], np.array(slot_host, dtype=np.int64), list(topology.hosts), domain
    )


def _partners(hosts: _Hosts, topology: Topology, replicate: bool) -> list[int] | None:
    """The receiving rank for each slot, or None without replication."""
    if not replicate:
        return None
    if not topology.partners:
        raise ConfigError(
            "replicate=True needs a topology with partners; this one was built with replicate=False "
            f"or for one host ({list(topology.hosts)})"
        )
    return [topology._partner_rank[r] for r in hosts.ranks]


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
    ordered = _ordered(ranks)
    hosts = _group_hosts(ordered, topology)
    partner = _partners(hosts, topology, replicate)
    h = index_reports([rc.items for rc in ordered])
    w, _, drains, transfers = _plan_parts(h, hosts, durable, held, partner)
    return GroupPlan(
        step, tuple(drains), tuple(transfers), h.logical_bytes, _unique_bytes(h, w), w.reused_bytes
    )


def _same_flags(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return not (a is not None and a.any()) and not (b is not None and b.any())
    return np.array_equal(a, b)


class PlanCache:
    """Reuses the previous group plan when nothing it was computed from has changed.

    ``lookup_or_plan`` takes the arguments of :func:`plan_group_save`, keeps the last
    layout and plan, and on each call compares, exactly (full strings, no hashes):

    * the layout signature: ``(rank, host, key, nbytes)`` of every item of every rank;
    * every chunk digest of every item (equal digests mean equal chunks, so equal lengths);
    * the topology and ``replicate``;
    * whether each chunk is in ``durable``, and, for each new chunk that may need a
      replica, whether a host of another failure domain holds it (``held``).

    Same layout and digests: the dedup of the reports is reused. Same membership, topology
    and ``replicate`` too: the previous plan is returned with the new ``step``. Otherwise
    owners and transfers are computed again. One coordinator thread owns a cache.
    """

    def __init__(self) -> None:
        self.hits = 0
        """Lookups that returned the previous plan."""
        self.partial_hits = 0
        """Lookups that reused the dedup but planned again (membership or topology changed)."""
        self.misses = 0
        self._layout: list[tuple[int, str, list[str], list[int], list[tuple[str, ...]]]] | None = None
        self._holdings: Holdings | None = None
        self._last: tuple[Topology, bool, np.ndarray | None, np.ndarray | None, GroupPlan] | None = None

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
        ordered = _ordered(ranks)
        hosts = _group_hosts(ordered, topology)
        partner = _partners(hosts, topology, replicate)
        layout = [
            (
                rc.rank,
                rc.host,
                list(map(_KEY, rc.items)),
                list(map(_NBYTES, rc.items)),
                list(map(_DIGESTS, rc.items)),
            )
            for rc in ordered
        ]
        if self._holdings is not None and layout == self._layout:
            h, same_layout = self._holdings, True
        else:
            h = self._holdings = index_reports([rc.items for rc in ordered])
            self._layout, self._last, same_layout = layout, None, False
        w = _split(h, durable)
        info = _SetInfos(h.sets, hosts)
        r = _replicas(h, w, hosts, info, held) if partner is not None else None
        covered = r.covered if r is not None else None
        last = self._last
        if (
            last is not None
            and last[0] == topology
            and last[1] == replicate
            and _same_flags(last[2], w.flags)
            and _same_flags(last[3], covered)
        ):
            self.hits += 1
            return replace(last[4], step=step)
        if same_layout:
            self.partial_hits += 1
        else:
            self.misses += 1
        owner = _owners(h, w, hosts, info)
        drains = _drains(h, w, hosts, owner)
        transfers = (
            _transfers(h, w, hosts, owner, r, partner) if r is not None and partner is not None else []
        )
        plan = GroupPlan(
            step, tuple(drains), tuple(transfers), h.logical_bytes, _unique_bytes(h, w), w.reused_bytes
        )
        self._last = (topology, replicate, w.flags, covered, plan)
        return plan


__all__ = [
    "CheckpointPlan",
    "ChunkRef",
    "ChunkRuns",
    "DrainAssignment",
    "GroupPlan",
    "ItemChunks",
    "PlanCache",
    "RankChunks",
    "Transfer",
    "plan_group_save",
    "plan_save",
]
