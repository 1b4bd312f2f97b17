"""Who holds what, from compact reports: the planner's first stage for :class:`ChunkTable` input.

Private to :mod:`shoal.group.planner`; the counterpart of :mod:`shoal.group._holdings` (which
reads the tuple form) and builds the same :class:`~shoal.group._holdings.Holdings`, so the
second stage (:mod:`shoal.group._assign`) and the plan do not depend on the form. Nothing here
makes a Python object per chunk, and per item only where items differ from their template:

1. **Ranks.** Each rank's table is compared with the last similar rank's (a *template*): equal
   digest buffers, keys and chunk counts (one ``memcmp`` and a tuple comparison) make a
   data-parallel replica; otherwise, after a few sampled digests agree, numpy compares the two
   buffers digest by digest and the items that differ are *extras* of the rank. A rank that
   matches less than half of its template tries the template whose first digest and key it
   shares (tensor-parallel shards alternate templates), and otherwise becomes a template.
2. **Chunks.** The digests of every template item and every extra are keyed by their first 64
   bits (BLAKE3 output is uniform) and sorted (``np.sort``, not ``argsort``). Keys seen once
   are digests seen once; only the positions of repeated keys are found again (a bitmap, then
   ``np.isin`` on the few hits) and grouped by their full 32 bytes. Equal means all 32 bytes
   equal: a shared key alone merges nothing.
3. **Items.** Two candidate items are one distinct item when they have the same key and the
   same digests: only items all of whose digests repeat (or that have none) can, and only
   those are compared, by key and digest group. The repeats left among distinct items are the
   chunk duplicates of :class:`~shoal.group._holdings.Duplicates` (a tied weight, zeros).

:class:`TableStore` then serves the second stage: keys, digests and lengths of distinct items,
and runs of whole items of a rank's own table as lazy columns (:mod:`shoal.group.digests`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain
from operator import eq
from typing import Any

import numpy as np

from shoal.group._holdings import Holdings, _holders, duplicates_at
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


def _against(t: ChunkTable, u: ChunkTable, hints: dict[int, _Hint], tid: int) -> np.ndarray | None:
    """Positions where ``t``'s items differ from template ``u``'s (number ``tid``); None: compare
    with another template.

    Equal buffers, keys and counts are a replica (no numpy). A rank that differs where the last
    one did (``hints``: a ZeRO shard in the same items) is confirmed by comparing byte ranges.
    Otherwise a few sampled digests must agree before numpy compares the buffers digest by digest.
    """
    n, m = len(t.keys), len(t.digests)
    if t is u:
        return _NONE
    if n != len(u.keys) or m != len(u.digests):
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
    same_keys = t.keys == u.keys
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


def _keys(d: Digests) -> np.ndarray:
    """The first 64 bits of each digest (a strided view of the buffer, no copy)."""
    buf, at = d.buffer
    return np.frombuffer(buf, np.uint64, 4 * len(d), at * DIGEST_SIZE)[::4]


def _present(tables: Sequence[ChunkTable | None], slot: int) -> ChunkTable:
    """The table of ``slot``, which reported items (a template's or an extra's)."""
    t = tables[slot]
    assert t is not None
    return t


def _head(t: ChunkTable) -> tuple[str, bytes]:
    buf, at = t.digests.buffer
    return t.keys[0], buf[at * DIGEST_SIZE : (at + 1) * DIGEST_SIZE]


class TableStore:
    """Distinct items as (slot, position) in the slots' tables: keys, digests, lengths on demand."""

    def __init__(self, tables: list[ChunkTable | None], src: np.ndarray, pos: np.ndarray, layout: list[int]):
        self.tables = tables
        self.src, self.pos = src, pos
        self.layout = layout
        """Per slot, the first slot whose table has the same keys (-1: empty)."""
        self._orders: dict[int, tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]] = {}

    def _at(self, i: int) -> tuple[ChunkTable, int]:
        t = self.tables[int(self.src[i])]
        assert t is not None
        return t, int(self.pos[i])

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
            assert t is not None
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
        ok[slots[self.src[whole] != slots]] = False
        ok[busy] = False
        if not ok.any():
            return [], np.ones(len(whole), dtype=bool)
        sizes = np.array([0 if t is None else len(t.keys) for t in self.tables], dtype=np.int64)
        every = ok & (per_slot == sizes)
        out = []
        for slot in np.flatnonzero(every).tolist():
            order, keys, starts = self._order(slot)
            t = self.tables[slot]
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
                assert t is not None
                order = tuple(sorted(positions[a:b], key=t.keys.__getitem__))
                keys = tuple(map(t.keys.__getitem__, order))
                runs = ChunkRuns(keys, (0,) * len(order), ItemDigests(t, order), ItemLengths(t, order))
                out.append((int(s_sorted[a]), runs))
            out.sort(key=_slot)
        return out, ~ok[slots]


def _slot(pair: tuple[int, ChunkRuns]) -> int:
    return pair[0]


def _equal_chunks(keys: Any, rows: Any) -> list[np.ndarray]:
    """Groups (two or more, ascending) of positions whose digests are equal, all 32 bytes.

    ``keys()``: a new array of the first 64 bits of each digest (sorted in place: called
    again when some repeat); ``rows(positions)``: their full words.
    """
    s = keys()
    if len(s) < 2:
        return []
    s.sort()
    same = s[1:] == s[:-1]
    if not same.any():
        return []  # every key differs, so every digest does
    dup = np.unique(s[1:][same])
    del s
    keys = keys()
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


def index_tables(tables: Sequence[ChunkTable | None]) -> Holdings:
    """Reduce every slot's table to distinct items and holders, then dedup their chunks."""
    tables = list(tables)
    n_slots = len(tables)
    templates: list[int] = []  # slot of each template
    tpl: list[ChunkTable] = []  # and its table
    classes: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    extra_slot: list[int] = []
    extra_pos: list[np.ndarray] = []
    extra_keys: list[np.ndarray] = []  # the first 64 bits of the extras' digests
    heads: dict[tuple[str, bytes], int] = {}
    hints: dict[int, _Hint] = {}
    layout = [-1] * n_slots
    by_keys: dict[tuple[str, ...], int] = {}
    last = last_layout = -1
    for slot, t in enumerate(tables):
        if t is None or not len(t):
            continue
        lt = tables[last_layout] if last_layout >= 0 else None
        if lt is not None and (t.keys is lt.keys or t.keys == lt.keys):
            layout[slot] = last_layout
        else:
            last_layout = layout[slot] = by_keys.setdefault(t.keys, slot)
        tid, differ, head = -1, None, None
        if last >= 0:
            tid, differ = last, _against(t, tpl[last], hints, last)
            if differ is None and len(t.digests):
                head = _head(t)
                alt = heads.get(head, -1)
                if alt >= 0 and alt != last:
                    tid, differ = alt, _against(t, tpl[alt], hints, alt)
        if differ is None:
            tid = len(templates)
            templates.append(slot)
            tpl.append(t)
            if len(t.digests):
                heads.setdefault(head if head is not None else _head(t), tid)
            classes[(tid, ())] = [slot]
        elif len(differ):
            hint = hints[tid]
            assert hint.differ is differ  # set or confirmed by _against
            classes.setdefault((tid, hint.lacked), []).append(slot)
            extra_slot.append(slot)
            extra_pos.append(differ)
            k = _keys(t.digests)
            extra_keys.append(np.concatenate([k[a:b] for a, b in hint.spans]))
        else:
            classes[(tid, ())].append(slot)
        last = tid
    return _dedup(tables, templates, tpl, classes, extra_slot, extra_pos, extra_keys, layout)


class _Split(Sequence[np.ndarray]):
    """``values`` cut at ``bounds``: part ``i`` is ``values[bounds[i]:bounds[i + 1]]`` (a view)."""

    def __init__(self, values: np.ndarray, bounds: list[int]) -> None:
        self._values, self._bounds = values, bounds

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, i: Any) -> Any:
        return self._values[self._bounds[i] : self._bounds[i + 1]]


def _dedup(
    tables: list[ChunkTable | None],
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
    # Candidate items: every template's items, then the extras; their source table and position.
    src = np.concatenate(
        [
            np.repeat(np.array(templates, dtype=np.int64), n_tpl),
            np.repeat(np.array(extra_slot, dtype=np.int64), n_ex),
        ]
    )
    pos = np.concatenate(
        [np.arange(n_tpl_items, dtype=np.int64) - np.repeat(np.cumsum(n_tpl) - n_tpl, n_tpl), *extra_pos]
    )
    extras = [(_present(tables, s), p) for s, p in zip(extra_slot, extra_pos, strict=True)]

    def column(name: str) -> np.ndarray:
        """A per-item column of the candidates: templates' whole, extras' at their positions."""
        parts = [getattr(t, name) for t in tpl] + [getattr(t, name)[p] for t, p in extras]
        return np.concatenate([_NONE, *parts]).astype(np.int64, copy=False)

    count, nbytes = column("counts"), column("nbytes")
    uniform = all(t.chunk_size is not None for t in tpl) and all(t.chunk_size is not None for t, _ in extras)
    item_bytes = nbytes if uniform else column("item_bytes")  # equal when chunk lengths follow sizes
    start = np.cumsum(count) - count
    total = int(count.sum())
    # First 64 bits of every candidate chunk: template buffers whole, extras gathered.
    keys = [_keys(t.digests) for t in tpl] + extra_keys

    def all_keys() -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype=np.uint64), *keys])

    offset = np.array([0 if t is None else t.digests.buffer[1] for t in tables], dtype=np.int64)

    def rows(flat: np.ndarray) -> np.ndarray:
        """Full words of the chunks at ``flat``: sliced one by one (they are few)."""
        it = np.searchsorted(start, flat, side="right") - 1
        which = zip(src[it].tolist(), pos[it].tolist(), strict=True)
        first = [int(_present(tables, s).starts[p]) for s, p in which]
        at = ((offset[src[it]] + np.array(first, dtype=np.int64) + flat - start[it]) * DIGEST_SIZE).tolist()
        bufs = [_present(tables, s).digests.buffer[0] for s in src[it].tolist()]
        raw = b"".join([b[x : x + DIGEST_SIZE] for b, x in zip(bufs, at, strict=True)])
        return np.frombuffer(raw, np.uint64).reshape(-1, 4)

    groups = _equal_chunks(all_keys, rows)
    rep = _same_items(tables, src, pos, count, start, total, groups)
    is_rep = rep == np.arange(len(rep))
    merged = not is_rep.all()
    did = np.cumsum(is_rep) - 1 if merged else np.arange(len(rep), dtype=np.int64)
    distinct = did[rep] if merged else did
    bounds = [0, *np.cumsum(n_tpl).tolist()]
    ex_slot = np.repeat(np.array(extra_slot, dtype=np.int64), n_ex)
    if merged:
        keep = np.flatnonzero(is_rep)
        src, pos, count, item_bytes, nbytes = (
            src[keep],
            pos[keep],
            count[keep],
            item_bytes[keep],
            nbytes[keep],
        )
    holder, sets, logical = _holders(
        nbytes, _Split(distinct, bounds), classes, distinct[n_tpl_items:], ex_slot
    )
    store = TableStore(tables, src, pos, layout)
    d_start = np.cumsum(count) - count if merged else start
    h = Holdings(_Items(store), holder, sets, logical, count, item_bytes, d_start, None, store=store)
    h.seen = [() if t is None else t for t in tables]
    places: dict[int, list[int]] = {}
    old_start = np.cumsum(column("counts")) - column("counts") if merged else start
    for g in groups:
        it = np.searchsorted(old_start, g, side="right") - 1
        mine = is_rep[it]
        if mine.sum() > 1:
            at = (d_start[did[it[mine]]] + (g[mine] - old_start[it[mine]])).tolist()
            places[at[0]] = at
    if places:
        canon = np.arange(int(count.sum()), dtype=np.int64)
        for p0, ps in places.items():
            canon[ps] = p0
        h.dups = duplicates_at(h, canon, places)
    return h


def _same_items(
    tables: list[ChunkTable | None],
    src: np.ndarray,
    pos: np.ndarray,
    count: np.ndarray,
    start: np.ndarray,
    total: int,
    groups: list[np.ndarray],
) -> np.ndarray:
    """Per candidate item, the first candidate with the same key and digests (itself if none)."""
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
    for i in maybe.tolist():
        t = tables[int(src[i])]
        assert t is not None
        a = int(start[i])
        sig = (t.keys[int(pos[i])], tuple(gid[a : a + int(count[i])].tolist()) if groups else ())
        rep[i] = seen.setdefault(sig, i)
    return rep


def same_tables(h: Holdings, tables: Sequence[ChunkTable | None]) -> bool:
    """Whether ``tables`` equal (columns, digest bytes) those ``h`` was built from, slot by slot."""
    if len(tables) != len(h.seen):
        return False
    for t, ref in zip(tables, h.seen, strict=True):
        if t is None or ref is None or not isinstance(ref, ChunkTable):
            if (t is None or not len(t)) and (ref is None or not len(ref)):
                continue
            return False
        if not t.same(ref):
            return False
    return True


__all__ = ["Digests", "TableStore", "index_tables", "same_tables"]
