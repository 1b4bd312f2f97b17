"""Owners, replicas and runs: the planner's stages 2 and 3 (private to :mod:`shoal.group.planner`,
whose docstring describes the algorithm).

Input: the :class:`~shoal.group._holdings.Holdings` of the reports, where the slots run
(:class:`Hosts`), what is durable and what hosts hold. Output: the plan's drains and transfers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Container, Mapping, Sequence, Sized
from dataclasses import dataclass, field

import numpy as np

from shoal.group._holdings import Holdings, at_items
from shoal.group.plan import ChunkRuns, DrainAssignment, Transfer


def is_empty(c: Container[str]) -> bool:
    """Whether ``c`` is known to hold nothing: a sized container of length 0 (a bare one may hold any)."""
    return isinstance(c, Sized) and len(c) == 0


def _members(c: Container[str], digests: Sequence[str]) -> np.ndarray:
    """Whether each of ``digests`` is in ``c``, as a bool array."""
    if is_empty(c):
        return np.zeros(len(digests), dtype=bool)
    return np.fromiter(map(c.__contains__, digests), bool, len(digests))


@dataclass
class Hosts:
    """Where the slots run: rank and host index per slot, host names, domain index per host."""

    ranks: list[int]
    slot_host: np.ndarray
    names: list[str]
    domain: np.ndarray


class _SetInfo:
    """Per holder set: its hosts (ascending index), slots by host, domain count, greedy heap."""

    def __init__(self, slots: tuple[int, ...], hosts: Hosts) -> None:
        by_host: dict[int, list[int]] = {}
        for s, h in zip(slots, hosts.slot_host[list(slots)].tolist(), strict=True):
            by_host.setdefault(h, []).append(s)
        self.hosts = sorted(by_host)
        self.by_host = by_host
        self.domains = len(set(hosts.domain[self.hosts].tolist()))
        self.heap: list[tuple[int, int]] | None = None


class SetInfos:
    """:class:`_SetInfo` of each holder set, built when first asked for."""

    def __init__(self, sets: list[tuple[int, ...]], hosts: Hosts) -> None:
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
class Work:
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
    counted: dict[int, np.ndarray] = field(default_factory=dict)
    """Chunks per slot of whole items, by the identity of the item array (see ``_chunk_counts``)."""
    _solo_items: np.ndarray | None = None

    @property
    def solo_items(self) -> np.ndarray:
        """The solo items' numbers (one array, so that counts cached by its identity are reused)."""
        if self._solo_items is None:
            self._solo_items = np.flatnonzero(self.solo)
        return self._solo_items

    @property
    def reused_bytes(self) -> int:
        return int(self.length[self.durable].sum())


def split(h: Holdings, durable: Container[str]) -> Work:
    flags = None if is_empty(durable) else _members(durable, h.digests)
    nonempty = h.count > 0
    solo = nonempty & (h.holder >= 0)
    if flags is not None:
        per_item = np.bincount(h.item_of(np.flatnonzero(flags)), minlength=len(h.count))
        solo &= per_item == 0
    if h.dups is not None:
        solo[h.dups.items] = False
    other = np.flatnonzero(nonempty & ~solo)
    counts = h.count[other]
    item = np.repeat(other, counts)
    index = np.arange(len(item), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    flat = h.start[item] + index
    length = h.store.lengths(other)
    holder = h.holder[item]
    if h.dups is not None:
        keep = h.dups.canon[flat] == flat
        flat, item, index, length, holder = flat[keep], item[keep], index[keep], length[keep], holder[keep]
        firsts = np.array(list(h.dups.holder), dtype=np.int64)
        holder[np.searchsorted(flat, firsts)] = list(h.dups.holder.values())
    is_durable = flags[flat] if flags is not None else np.zeros(len(flat), dtype=bool)
    return Work(solo, flat, item, index, length, holder, is_durable, flags)


def owners(h: Holdings, w: Work, hosts: Hosts, info: SetInfos, *, balance: bool = True) -> np.ndarray:
    """The draining slot of every chunk of ``w`` (-1 for durable ones); solo items go to their holder.

    Without ``balance`` a chunk several slots hold goes to the lowest of them (the lowest rank),
    as a writer that deduplicates without regard to the NICs does: for comparison only."""
    n_slots = len(hosts.ranks)
    solo = w.solo_items
    owner = np.full(len(w.flat), -1, dtype=np.int64)
    single = ~w.durable & (w.holder >= 0)
    owner[single] = w.holder[single]
    # Float sums of integer byte counts are exact below 2**53 (8 PiB per rank).
    load = np.zeros(n_slots)
    load += np.bincount(at_items(h.holder, solo), weights=at_items(h.nbytes, solo), minlength=n_slots)
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
        if not balance:
            chosen.append((c, min(min(v) for v in s.by_host.values())))
            continue
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


def _located(h: Holdings, w: Work, chunks: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    """(slot, runs) per slot, by slot: whole items plus single chunks, in (key, index) order.

    Slots that have only whole items of their own table get their runs from the store
    in one step (no object per item); the rest is built here, one run at a time.
    """
    done: list[tuple[int, ChunkRuns]] = []
    if len(whole):
        done, rest = h.store.whole_runs(whole, whole_slots, part_slots)
        if done:
            whole, whole_slots = whole[rest], whole_slots[rest]
    built = _built_runs(h, whole, whole_slots, part_slots, part_items, part_index)
    return sorted(done + built, key=_first) if done and built else done or built  # each by slot


def _built_runs(
    h: Holdings,
    whole: np.ndarray,
    whole_slots: np.ndarray,
    part_slots: np.ndarray,
    part_items: np.ndarray,
    part_index: np.ndarray,
) -> list[tuple[int, ChunkRuns]]:
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
    # Keys ranked among the run items only (equal keys, equal rank).
    names = list(map(h.store.key, run_item.tolist()))
    rank_of = {k: i for i, k in enumerate(sorted(set(names)))}
    key_rank = np.fromiter(map(rank_of.__getitem__, names), np.int64, len(names))
    order = np.lexsort((run_start, run_item, key_rank, run_slot))
    run_slot, run_item = run_slot[order], run_item[order].tolist()
    starts, ends = run_start[order].tolist(), run_end[order].tolist()
    keys = tuple(map(names.__getitem__, order.tolist()))
    # Whole items share the reported digest containers; only partial runs are sliced.
    whole_run = ((run_start[order] == 0) & (run_end[order] == h.count[run_item])).tolist()
    cols = list(map(h.store.run, run_item, starts, ends, whole_run))
    digest_runs = tuple(c[0] for c in cols)
    length_runs = tuple(c[1] for c in cols)
    begins = tuple(starts)
    firsts = np.flatnonzero(np.append(True, run_slot[1:] != run_slot[:-1]))
    bounds = np.append(firsts, len(run_item)).tolist()
    return [
        (slot, ChunkRuns(keys[a:b], begins[a:b], digest_runs[a:b], length_runs[a:b]))
        for slot, a, b in zip(run_slot[firsts].tolist(), bounds[:-1], bounds[1:], strict=True)
    ]


@dataclass
class DrainAssignments:
    """The drains, and per slot its runs and chunk count (transfers reuse the runs when equal)."""

    drains: list[DrainAssignment]
    runs: dict[int, ChunkRuns]
    chunks: np.ndarray


def _chunk_counts(
    h: Holdings,
    whole: np.ndarray,
    part_slots: np.ndarray,
    n_slots: int,
    cache: dict[int, np.ndarray] | None = None,
) -> np.ndarray:
    """Chunks per slot: of the whole items ``whole`` (distinct, ascending; by holder) and one per
    ``part_slots``.

    ``cache`` keeps the whole items' counts by the identity of ``whole`` (drains and transfers
    of the same solo items count them once)."""
    counts = cache.get(id(whole)) if cache is not None else None
    if counts is None:
        counts = np.bincount(at_items(h.holder, whole), weights=at_items(h.count, whole), minlength=n_slots)
        if cache is not None:
            cache[id(whole)] = counts
    return np.rint(counts + np.bincount(part_slots, minlength=n_slots)).astype(np.int64)


def drains(h: Holdings, w: Work, hosts: Hosts, owner: np.ndarray) -> DrainAssignments:
    solo = w.solo_items
    new = np.flatnonzero(owner >= 0)
    item, index = _located(h, w, new, owner[new])
    runs = _runs(h, solo, at_items(h.holder, solo), owner[new], item, index)
    ranks, names, slot_host = hosts.ranks, hosts.names, hosts.slot_host.tolist()
    out = [DrainAssignment(ranks[slot], names[slot_host[slot]], r) for slot, r in runs]
    return DrainAssignments(
        out, dict(runs), _chunk_counts(h, w.solo_items, owner[new], len(hosts.ranks), w.counted)
    )


@dataclass
class Replicas:
    """The chunks that may need a replica (holders in one failure domain), and which are covered.

    ``solo`` are the solo items (all of them qualify), ``chunks`` the qualifying chunks of the
    work; ``covered`` is, for the chunks of the solo items in flat order and then ``chunks``,
    whether a host of another domain already holds it (``held``).
    """

    solo: np.ndarray
    chunks: np.ndarray
    covered: np.ndarray


def replicas(
    h: Holdings, w: Work, hosts: Hosts, info: SetInfos, held: Mapping[str, Container[str]] | None
) -> Replicas:
    solo = w.solo_items
    one_domain = w.holder >= 0
    one_domain[~one_domain] = info.column(-1 - w.holder[~one_domain], lambda s: s.domains) == 1
    chunks = np.flatnonzero(~w.durable & one_domain)
    n_solo_chunks = int(at_items(h.count, solo).sum())
    covered = np.zeros(n_solo_chunks + len(chunks), dtype=bool)
    if not held or all(is_empty(c) for c in held.values()):
        return Replicas(solo, chunks, covered)
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
        if name not in host_index or is_empty(holds):
            continue
        if isinstance(holds, Collection) and len(holds) < len(digests):
            if position is None:
                position = dict(zip(digests, range(len(digests)), strict=True))
            mask = np.zeros(len(digests), dtype=bool)
            mask[np.fromiter((position[d] for d in position.keys() & holds), np.int64)] = True
        else:
            mask = _members(holds, digests)
        covered |= mask & (domain != hosts.domain[host_index[name]])
    return Replicas(solo, chunks, covered)


def transfers(
    h: Holdings,
    w: Work,
    hosts: Hosts,
    owner: np.ndarray,
    r: Replicas,
    partner: Sequence[int],
    drained: DrainAssignments,
) -> list[Transfer]:
    n_solo_chunks = int(at_items(h.count, r.solo).sum())
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
    p_slots, p_items, p_index = map(np.concatenate, (part_slots, part_items, part_index))
    # A slot that sends everything it drains sends the same runs: share the object (and its pickle).
    sent = _chunk_counts(h, whole, p_slots, len(hosts.ranks), w.counted)
    same = (sent == drained.chunks) & (sent > 0)
    whole_holder = at_items(h.holder, whole)
    w_keep, p_keep = ~same[whole_holder], ~same[p_slots]
    built = _runs(h, whole[w_keep], whole_holder[w_keep], p_slots[p_keep], p_items[p_keep], p_index[p_keep])
    shared = [(slot, drained.runs[slot]) for slot in np.flatnonzero(same).tolist()]
    runs = sorted(built + shared, key=_first) if built else shared
    return [Transfer(hosts.ranks[slot], partner[slot], rs) for slot, rs in runs]


def _first(pair: tuple[int, ChunkRuns]) -> int:
    return pair[0]


def plan_parts(
    h: Holdings,
    hosts: Hosts,
    durable: Container[str],
    held: Mapping[str, Container[str]] | None,
    partner: Sequence[int] | None,
    *,
    balance: bool = True,
) -> tuple[Work, list[DrainAssignment], list[Transfer]]:
    w = split(h, durable)
    info = SetInfos(h.sets, hosts)
    owner = owners(h, w, hosts, info, balance=balance)
    drained = drains(h, w, hosts, owner)
    if partner is None:
        return w, drained.drains, []
    r = replicas(h, w, hosts, info, held)
    return w, drained.drains, transfers(h, w, hosts, owner, r, partner, drained)


def unique_bytes(h: Holdings, w: Work) -> int:
    return int(at_items(h.nbytes, w.solo_items).sum()) + int(w.length.sum())
