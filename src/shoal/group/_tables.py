"""The planner's first stage: every rank's table reduced to distinct items and their holders.

Private to :mod:`shoal.group.planner`, whose docstring describes the algorithm (stage 1 is
this module): ranks compared with templates, chunks keyed by their digests' first 64 bits and
sorted, repeats confirmed on all 32 bytes, items merged by key and digests. The result is a
:class:`~shoal.group._holdings.Holdings`; :class:`TableStore` serves the second stage
(:mod:`shoal.group._assign`) the keys, digests and lengths of distinct items, and runs of whole
items of a rank's own table as lazy columns (:mod:`shoal.group.digests`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain
from operator import eq
from typing import Any

import numpy as np

from shoal.group._holdings import Holdings, Split, at_items, duplicates_at, holders_of
from shoal.group.digests import DIGEST_SIZE, Digests, ItemDigests, ItemLengths
from shoal.group.plan import ChunkRuns, ChunkTable, ItemChunks

_NONE = np.zeros(0, dtype=np.int64)


class _Hint:
    """What differed between a template and the last rank that matched it: the positions, and the
    template's bytes of the items that were equal (ranges merged) and of those that differed."""

    def __init__(self, u: ChunkTable, differ: np.ndarray) -> None:
        self.differ = differ
        lacks = np.zeros(len(u.keys), dtype=bool)
        lacks[differ] = True
        ranges: list[tuple[int, int]] = []
        for p, (a, n) in enumerate(zip(u.starts.tolist(), u.counts.tolist(), strict=True)):
            if lacks[p] or not n:
                continue
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], a + n)
            else:
                ranges.append((a, a + n))
        ub, ua = u.digests.buffer
        z = DIGEST_SIZE

        def part(a: int, b: int) -> tuple[int, bytes]:
            return a * z, ub[(ua + a) * z : (ua + b) * z]

        self.same = [part(a, b) for a, b in ranges]
        self.spans = [(int(u.starts[p]), int(u.starts[p] + u.counts[p])) for p in differ.tolist()]
        self.diff = [part(a, b) for a, b in self.spans]
        self.lacked = tuple(differ.tolist())

    def holds(self, tb: bytes, ta: int) -> bool:
        """Whether buffer ``tb`` (from digest ``ta``) differs from the template exactly there
        (``startswith`` at an offset: compared in place, nothing copied)."""
        at = ta * DIGEST_SIZE
        return all(tb.startswith(part, at + x) for x, part in self.same) and not any(
            tb.startswith(part, at + x) for x, part in self.diff
        )


def _against(
    t: ChunkTable, u: ChunkTable, same_keys: bool, hints: dict[int, _Hint], tid: int
) -> np.ndarray | None:
    """Positions where ``t``'s items differ from template ``u``'s (number ``tid``); None: compare
    with another template. ``same_keys``: whether the two have equal keys (known from the layouts).

    Equal buffers, keys and counts are a replica (no numpy). A rank that differs where the last
    one did (``hints``: a ZeRO shard in the same items) is confirmed by comparing byte ranges.
    Otherwise a few sampled digests must agree before numpy compares the buffers digest by digest.
    """
    n, m = len(t.keys), t.n_chunks
    if t is u:
        return _NONE
    if n != len(u.keys) or m != u.n_chunks:
        return None
    tb, ta = t.digests.buffer
    ub, ua = u.digests.buffer
    if ta == ua == 0 and len(tb) == len(ub) == m * DIGEST_SIZE:
        equal = tb == ub
    else:
        equal = t.digests.raw == u.digests.raw
    if not equal and m >= 8:
        for r in (0, m // 2, m - 1):
            x, y = (ta + r) * DIGEST_SIZE, (ua + r) * DIGEST_SIZE
            if tb[x : x + DIGEST_SIZE] == ub[y : y + DIGEST_SIZE]:
                break
        else:
            return None
    if t.counts.tobytes() != u.counts.tobytes():
        return None
    if equal and same_keys:
        return _NONE
    hint = hints.get(tid)
    if hint is not None and same_keys and hint.holds(tb, ta):
        return hint.differ
    # Four word comparisons per digest, read as one 32-bit integer: nonzero where they differ.
    neq = (t.digests.words() != u.digests.words()).view(np.uint32).reshape(-1) != 0
    c = np.concatenate([[0], np.cumsum(neq)])
    bad = c[t.starts + t.counts] > c[t.starts]
    if not same_keys:
        bad |= ~np.fromiter(map(eq, t.keys, u.keys), bool, n)
    differ = np.flatnonzero(bad)
    if 2 * (n - len(differ)) < n:
        return None
    if len(differ):
        hints[tid] = _Hint(u, differ)
    return differ


def _head(t: ChunkTable) -> tuple[str, bytes]:
    buf, at = t.digests.buffer
    return t.keys[0], buf[at * DIGEST_SIZE : (at + 1) * DIGEST_SIZE]


class TableStore:
    """Distinct items as (slot, position) in the slots' tables: keys, digests, lengths on demand."""

    def __init__(self, tables: list[ChunkTable], src: np.ndarray, pos: np.ndarray, layout: list[int]):
        self.tables = tables
        self.src, self.pos = src, pos
        self.layout = layout
        """Per slot, the first slot whose table has the same keys (-1: empty)."""
        self._orders: dict[int, tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]] = {}

    def _at(self, i: int) -> tuple[ChunkTable, int]:
        return self.tables[int(self.src[i])], int(self.pos[i])

    def items(self) -> Sequence[ItemChunks]:
        """The distinct items as :class:`ItemChunks`, built on access."""
        return _Items(self)

    def key(self, i: int) -> str:
        t, p = self._at(i)
        return t.keys[p]

    def run(self, i: int, a: int, b: int, whole: bool) -> tuple[Sequence[str], tuple[int, ...]]:
        t, p = self._at(i)
        if whole:
            return t.item_digests(p), t.item_lengths(p)
        d = t.item_digests(p)
        return d[a:b], t.item_lengths(p)[a:b]

    def lengths(self, items: np.ndarray) -> np.ndarray:
        parts = []
        for i in items.tolist():
            t, p = self._at(i)
            a = int(t.starts[p])
            parts.append(t.lengths[a : a + int(t.counts[p])])
        return np.concatenate(parts) if parts else _NONE

    def hexes(self) -> list[str]:
        return list(chain.from_iterable(self.run(i, 0, 0, True)[0] for i in range(len(self.src))))

    def _order(self, slot: int) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
        lid = self.layout[slot]
        got = self._orders.get(lid)
        if got is None:
            t = self.tables[lid]
            order = tuple(sorted(range(len(t.keys)), key=t.keys.__getitem__))
            got = self._orders[lid] = (order, tuple(map(t.keys.__getitem__, order)), (0,) * len(order))
        return got

    def whole_runs(
        self, whole: np.ndarray, slots: np.ndarray, busy: np.ndarray
    ) -> tuple[list[tuple[int, ChunkRuns]], np.ndarray]:
        """Runs of the slots whose runs are all whole items of their own table, built from the
        table: lazy columns, no object per item. Returns those runs, by slot, and which of
        ``whole`` are left to build one by one."""
        n_slots = len(self.tables)
        per_slot = np.bincount(slots, minlength=n_slots)
        ok = per_slot > 0
        ok[slots[at_items(self.src, whole) != slots]] = False
        ok[busy] = False
        if not ok.any():
            return [], np.ones(len(whole), dtype=bool)
        sizes = np.array([len(t.keys) for t in self.tables], dtype=np.int64)
        every = ok & (per_slot == sizes)
        out = []
        tables, layout, orders = self.tables, self.layout, self._orders
        for slot in np.flatnonzero(every).tolist():
            got = orders.get(layout[slot])
            order, keys, starts = got if got is not None else self._order(slot)
            t = tables[slot]
            out.append((slot, ChunkRuns(keys, starts, ItemDigests(t, order), ItemLengths(t, order))))
        some = ok & ~every
        if some.any():
            mine = np.flatnonzero(some[slots])
            by_slot = mine[np.argsort(slots[mine], kind="stable")]
            s_sorted = slots[by_slot]
            cuts = np.flatnonzero(np.append(True, s_sorted[1:] != s_sorted[:-1])).tolist()
            positions = self.pos[whole[by_slot]].tolist()
            for a, b in zip(cuts, [*cuts[1:], len(by_slot)], strict=True):
                t = self.tables[int(s_sorted[a])]
                order = tuple(sorted(positions[a:b], key=t.keys.__getitem__))
                keys = tuple(map(t.keys.__getitem__, order))
                runs = ChunkRuns(keys, (0,) * len(order), ItemDigests(t, order), ItemLengths(t, order))
                out.append((int(s_sorted[a]), runs))
            out.sort(key=_slot)
        return out, ~ok[slots]


def _slot(pair: tuple[int, ChunkRuns]) -> int:
    return pair[0]


def _equal_chunks(new_keys: Any, rows: Any) -> list[np.ndarray]:
    """Groups (two or more, ascending) of positions whose digests are equal, all 32 bytes.

    ``new_keys()``: a new array of the first 64 bits of each digest (sorted in place, and made
    again when some repeat); ``rows(positions)``: their full words.
    """
    s = new_keys()
    if len(s) < 2:
        return []
    s.sort()
    same = s[1:] == s[:-1]
    if not same.any():
        return []  # every key differs, so every digest does
    dup = np.unique(s[1:][same])
    del s, same
    keys = new_keys()
    if len(keys) > 1 << 20 and len(dup) < 1 << 20:
        bitmap = np.zeros(1 << 24, dtype=bool)
        bitmap[dup >> np.uint64(40)] = True
        hits = np.flatnonzero(bitmap[keys >> np.uint64(40)])
        at = hits[np.isin(keys[hits], dup)]
    else:
        at = np.flatnonzero(np.isin(keys, dup))
    full = rows(at)
    order = np.lexsort(full.T[::-1])
    f, at = full[order], at[order]
    brk = np.append(True, (f[1:] != f[:-1]).any(axis=1))
    starts = np.flatnonzero(brk)
    sizes = np.diff(np.append(starts, len(at)))
    return [np.sort(at[a : a + n]) for a, n in zip(starts.tolist(), sizes.tolist(), strict=True) if n > 1]


class _Items(Sequence[ItemChunks]):
    """The distinct items as :class:`ItemChunks`, built on access (tests, debugging)."""

    def __init__(self, store: TableStore) -> None:
        self._store = store

    def __len__(self) -> int:
        return len(self._store.src)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        t, p = self._store._at(range(len(self))[i])
        return t[p]

    def __iter__(self) -> Iterator[ItemChunks]:
        return map(self.__getitem__, range(len(self)))


def index_tables(tables: Sequence[ChunkTable]) -> Holdings:
    """Reduce every slot's table to distinct items and holders, then dedup their chunks."""
    tables = list(tables)
    n_slots = len(tables)
    templates: list[int] = []  # slot of each template
    tpl: list[ChunkTable] = []  # and its table
    classes: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    extra_slot: list[int] = []
    extra_pos: list[np.ndarray] = []
    extra_keys: list[np.ndarray] = []  # the prefixes of the extras' digests
    heads: dict[tuple[str, bytes], int] = {}
    hints: dict[int, _Hint] = {}
    layout = [-1] * n_slots  # per slot, the first slot with equal keys: equal layouts, equal keys
    tpl_layout: list[int] = []  # and per template
    by_keys: dict[tuple[str, ...], int] = {}
    last = last_layout = -1
    last_keys: tuple[str, ...] = ()
    for slot, t in enumerate(tables):
        if not t.keys:
            continue
        keys = t.keys
        if keys is last_keys or keys == last_keys:
            lid = layout[slot] = last_layout
        else:
            lid = last_layout = layout[slot] = by_keys.setdefault(keys, slot)
            last_keys = keys
        tid, differ, head = -1, None, None
        if last >= 0:
            tid, differ = last, _against(t, tpl[last], lid == tpl_layout[last], hints, last)
            if differ is None and t.n_chunks:
                head = _head(t)
                alt = heads.get(head, -1)
                if alt >= 0 and alt != last:
                    tid, differ = alt, _against(t, tpl[alt], lid == tpl_layout[alt], hints, alt)
        if differ is None:
            tid = len(templates)
            templates.append(slot)
            tpl.append(t)
            tpl_layout.append(lid)
            if t.n_chunks:
                heads.setdefault(head if head is not None else _head(t), tid)
            classes[(tid, ())] = [slot]
        elif len(differ):
            hint = hints[tid]
            assert hint.differ is differ  # set or confirmed by _against
            classes.setdefault((tid, hint.lacked), []).append(slot)
            extra_slot.append(slot)
            extra_pos.append(differ)
            k = t.prefix
            extra_keys.append(np.concatenate([k[a:b] for a, b in hint.spans]))
        else:
            classes[(tid, ())].append(slot)
        last = tid
    return _dedup(tables, templates, tpl, classes, extra_slot, extra_pos, extra_keys, layout)


def _dedup(
    tables: list[ChunkTable],
    templates: list[int],
    tpl: list[ChunkTable],
    classes: dict[tuple[int, tuple[int, ...]], list[int]],
    extra_slot: list[int],
    extra_pos: list[np.ndarray],
    extra_keys: list[np.ndarray],
    layout: list[int],
) -> Holdings:
    """Stages 2 and 3 (see the module docstring): candidate items, their chunks, distinct items."""
    n_tpl = np.array([len(t.keys) for t in tpl], dtype=np.int64)
    n_ex = np.array([len(p) for p in extra_pos], dtype=np.int64)
    n_tpl_items = int(n_tpl.sum())
    src, pos = _candidates(templates, n_tpl, extra_slot, extra_pos)
    extras = [(tables[s], p) for s, p in zip(extra_slot, extra_pos, strict=True)]
    nbytes, count, item_bytes = _sizes(tpl, extras)
    start = np.cumsum(count) - count
    total = int(count.sum())

    # First 64 bits of every candidate chunk: the templates' prefix columns whole, the extras'.
    def keys() -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype=np.uint64), *[t.prefix for t in tpl], *extra_keys])

    def rows(flat: np.ndarray) -> np.ndarray:
        """Full words of the chunks at ``flat``: sliced one by one (they are few)."""
        it = np.searchsorted(start, flat, side="right") - 1
        raw = []
        for s, p, k in zip(src[it].tolist(), pos[it].tolist(), (flat - start[it]).tolist(), strict=True):
            t = tables[s]
            buf, at = t.digests.buffer
            x = (at + int(t.starts[p]) + k) * DIGEST_SIZE
            raw.append(buf[x : x + DIGEST_SIZE])
        return np.frombuffer(b"".join(raw), np.uint64).reshape(-1, 4)

    groups = _equal_chunks(keys, rows)
    rep = _same_items(tables, src, pos, count, start, total, groups)
    n_candidates = len(src)
    if rep is None:  # every candidate is a distinct item
        is_rep = np.ones(n_candidates, dtype=bool)
        did = distinct = np.arange(n_candidates, dtype=np.int64)
        d_start = start
    else:
        is_rep = rep == np.arange(n_candidates)
        did = np.cumsum(is_rep) - 1
        distinct = did[rep]
        keep = np.flatnonzero(is_rep)
        src, pos, count, item_bytes, nbytes = (
            src[keep],
            pos[keep],
            count[keep],
            item_bytes[keep],
            nbytes[keep],
        )
        d_start = np.cumsum(count) - count
    bounds = np.append(0, np.cumsum(n_tpl))
    ex_slot = np.repeat(np.array(extra_slot, dtype=np.int64), n_ex)
    holder, sets, logical = holders_of(
        nbytes, Split(distinct, bounds), classes, distinct[n_tpl_items:], ex_slot
    )
    store = TableStore(tables, src, pos, layout)
    h = Holdings(store, holder, sets, logical, count, item_bytes, d_start, None, seen=tables)
    _mark_duplicates(h, groups, start, is_rep, did, d_start)
    return h


def _candidates(
    templates: list[int], n_tpl: np.ndarray, extra_slot: list[int], extra_pos: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Candidate items: every template's items, then the extras; their source table and position."""
    n_ex = np.array([len(p) for p in extra_pos], dtype=np.int64)
    src = np.concatenate(
        [
            np.repeat(np.array(templates, dtype=np.int64), n_tpl),
            np.repeat(np.array(extra_slot, dtype=np.int64), n_ex),
        ]
    )
    n_tpl_items = int(n_tpl.sum())
    pos = np.concatenate(
        [np.arange(n_tpl_items, dtype=np.int64) - np.repeat(np.cumsum(n_tpl) - n_tpl, n_tpl), *extra_pos]
    )
    return src, pos


def _sizes(
    tpl: list[ChunkTable], extras: list[tuple[ChunkTable, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate item: its size, its chunk count and the bytes its chunks cover."""

    def column(name: str) -> np.ndarray:
        """A per-item column of the candidates: templates' whole, extras' at their positions."""
        parts = [getattr(t, name) for t in tpl] + [getattr(t, name)[p] for t, p in extras]
        return np.concatenate([_NONE, *parts]).astype(np.int64, copy=False)

    nbytes = column("nbytes")
    chunk_sizes = {t.chunk_size for t in tpl} | {t.chunk_size for t, _ in extras}
    if None in chunk_sizes:
        return nbytes, column("counts"), column("item_bytes")
    # chunk counts follow the sizes, and the items' bytes are their sizes
    one = chunk_sizes.pop() if len(chunk_sizes) == 1 else None
    count = -(-nbytes // one) if one is not None else column("counts")
    return nbytes, count, nbytes


def _mark_duplicates(
    h: Holdings,
    groups: list[np.ndarray],
    start: np.ndarray,
    is_rep: np.ndarray,
    did: np.ndarray,
    d_start: np.ndarray,
) -> None:
    """Chunks of several candidates: record them as duplicates where they are in distinct items."""
    places: dict[int, list[int]] = {}
    for g in groups:
        it = np.searchsorted(start, g, side="right") - 1
        mine = is_rep[it]
        if mine.sum() > 1:
            at = (d_start[did[it[mine]]] + (g[mine] - start[it[mine]])).tolist()
            places[at[0]] = at
    if places:
        canon = np.arange(int(h.count.sum()), dtype=np.int64)
        for p0, ps in places.items():
            canon[ps] = p0
        h.dups = duplicates_at(h, canon, places)


def _same_items(
    tables: list[ChunkTable],
    src: np.ndarray,
    pos: np.ndarray,
    count: np.ndarray,
    start: np.ndarray,
    total: int,
    groups: list[np.ndarray],
) -> np.ndarray | None:
    """Per candidate item, the first candidate with the same key and digests (itself if none);
    None when that is every candidate itself."""
    rep = np.arange(len(src), dtype=np.int64)
    maybe = np.flatnonzero(count == 0)
    if groups:
        gid = np.full(total, -1, dtype=np.int64)
        for k, g in enumerate(groups):
            gid[g] = k
        c = np.concatenate([[0], np.cumsum(gid >= 0)])
        all_dup = (c[start + count] - c[start] == count) & (count > 0)
        maybe = np.union1d(maybe, np.flatnonzero(all_dup))
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    merged = False
    for i in maybe.tolist():
        t = tables[int(src[i])]
        a = int(start[i])
        sig = (t.keys[int(pos[i])], tuple(gid[a : a + int(count[i])].tolist()) if groups else ())
        rep[i] = first = seen.setdefault(sig, i)
        merged |= first != i
    return rep if merged else None


def same_tables(h: Holdings, tables: Sequence[ChunkTable]) -> bool:
    """Whether ``tables`` equal (columns, digest bytes) those ``h`` was built from, slot by slot."""
    return len(tables) == len(h.seen) and all(map(ChunkTable.same, tables, h.seen))


__all__ = ["Digests", "TableStore", "index_tables", "same_tables"]
