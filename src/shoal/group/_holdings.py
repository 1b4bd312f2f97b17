"""Who holds what: every rank's report reduced to distinct items and unique chunks.

Private to :mod:`shoal.group.planner` (its first stage). Depends only on the reports, so
:class:`~shoal.group.planner.PlanCache` keeps the result while the layout and digests stay
the same. A *slot* is a position in the rank-ordered reports; a *flat position* numbers
the chunks of all distinct items back to back.

Two levels, both exact:

1. **Items.** Each rank is compared with the last similar rank (a *template*), position by
   position, in one pass that touches each item once (tuple and string comparisons run in
   C): an item with the same key and the same digest tuple is the template's item. Ranks
   that match the same template at the same positions form a *class*, so data-parallel
   replicas add one slot to one list each. Items that differ are looked up by their full
   ``(key, digests)`` in a dictionary. A rank that matches less than half of its template
   is compared with the template where its first differing item was seen (tensor-parallel
   shards alternate templates), and otherwise becomes a template itself. Items with equal
   key and digests are one item: its ``nbytes`` is the first reporter's.
2. **Chunks.** A chunk may still appear in two distinct items (a tied weight, zeros). Every
   digest of every distinct item is bucketed by its Python ``hash`` (cached on the string)
   with a numpy sort; equal hashes are then compared as full strings, so a duplicate is
   found if and only if the digests are equal.

This module reads reports in the tuple form. Compact reports (:class:`~shoal.group.plan.ChunkTable`)
are indexed by :mod:`shoal.group._tables` into the same :class:`Holdings`; what the second stage
reads of the distinct items (keys, digests, lengths) goes through :attr:`Holdings.store`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from shoal.group.plan import ItemChunks

_KEY = attrgetter("key")
_DIGESTS = attrgetter("digests")
_LENGTHS = attrgetter("lengths")
_NBYTES = attrgetter("nbytes")


class TupleStore:
    """Distinct items held as the reported :class:`ItemChunks` objects (the tuple form)."""

    def __init__(self, items: Sequence[ItemChunks]) -> None:
        self.items = items

    def key(self, i: int) -> str:
        return self.items[i].key

    def run(self, i: int, a: int, b: int, whole: bool) -> tuple[Sequence[str], tuple[int, ...]]:
        """Digests and lengths of chunks ``a``..``b - 1`` of item ``i`` (the item's own when ``whole``)."""
        it = self.items[i]
        return (it.digests, it.lengths) if whole else (it.digests[a:b], it.lengths[a:b])

    def lengths(self, items: np.ndarray) -> np.ndarray:
        """The chunk lengths of ``items``, item after item."""
        reps = map(self.items.__getitem__, items.tolist())
        return np.fromiter(chain.from_iterable(map(_LENGTHS, reps)), np.int64)

    def hexes(self) -> list[str]:
        """Every digest, in flat order."""
        return list(chain.from_iterable(map(_DIGESTS, self.items)))

    def whole_runs(
        self, whole: np.ndarray, slots: np.ndarray, busy: np.ndarray
    ) -> tuple[list[tuple[int, Any]], np.ndarray]:
        """Runs built without one object per item: none here (see :mod:`shoal.group._tables`)."""
        return [], np.ones(len(whole), dtype=bool)


@dataclass
class Duplicates:
    """Chunks found at several flat positions."""

    canon: np.ndarray
    """Flat position -> flat position of the first occurrence of its digest."""
    places: dict[int, list[int]]
    """First occurrence -> every flat position of that digest, ascending."""
    holder: dict[int, int]
    """First occurrence -> holder code (as :attr:`Holdings.holder`) of every slot holding it anywhere."""
    items: np.ndarray
    """Distinct items holding a duplicated chunk."""


@dataclass
class Holdings:
    """Distinct items, the slots holding each, and the dedup of their chunks."""

    items: Sequence[ItemChunks]
    """One object per distinct ``(key, digests)``: the first slot's (built on access when compact)."""
    holder: np.ndarray
    """Per item: ``>= 0`` the one slot holding it; ``< 0``: slots ``sets[-1 - holder]``."""
    sets: list[tuple[int, ...]]
    """Holder sets of several slots, each ascending."""
    logical_bytes: int
    count: np.ndarray
    """Chunks per item."""
    nbytes: np.ndarray
    """Sum of the chunk lengths per item."""
    start: np.ndarray
    """Flat position of each item's first chunk."""
    dups: Duplicates | None
    seen: list[Sequence[ItemChunks]] = field(default_factory=list)
    """Per slot, the items the slot was taken to hold (same key and digests as its own, from
    whichever rank reported them first), position by position: what :func:`same_reports`
    compares new reports with."""
    store: Any = None
    """Keys, digests and lengths of the distinct items: a :class:`TupleStore` (tuple form) or a
    :class:`~shoal.group._tables.TableStore` (compact form)."""
    _digests: list[str] | None = None

    def __post_init__(self) -> None:
        if self.store is None:
            self.store = TupleStore(self.items)

    @property
    def digests(self) -> list[str]:
        """Digest (hex) at each flat position (built when first needed)."""
        if self._digests is None:
            self._digests = self.store.hexes()
        return self._digests

    def item_of(self, flat: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.start, flat, side="right") - 1

    def holds(self, slot: int, item: int) -> bool:
        code = int(self.holder[item])
        return code == slot if code >= 0 else slot in self.sets[-1 - code]


@dataclass
class _Template:
    reports: list[ItemChunks]
    """The template rank's own items."""
    keys: list[str]
    digests: list[Sequence[str]]
    """Digests per position: tuples of hex strings or :class:`~shoal.group.digests.Digests`
    (which equal and hash like those tuples)."""
    items: np.ndarray
    """Distinct item of each position."""


class _Items:
    """Distinct items by exact ``(key, digests)``, in order of first appearance.

    Per item it also records, while the item is in cache, its chunk count, its bytes and
    (at each :meth:`flush`) the ``hash`` of each chunk digest, cached on the string by the
    dictionary lookup.
    """

    def __init__(self) -> None:
        self.ids: dict[tuple[str, Sequence[str]], int] = {}
        self.items: list[ItemChunks] = []
        self.origin: list[int] = []
        self.counts: list[int] = []
        self.nbytes: list[int] = []
        self.hashes: list[np.ndarray] = []
        self.hashed = 0
        """Items whose digests' hashes are in ``hashes``: see :meth:`flush`."""

    def flush(self) -> None:
        """Hash the digests of the items added since the last flush, while they are in cache."""
        if self.hashed < len(self.items):
            new = self.items[self.hashed :]
            n = sum(self.counts[self.hashed :])
            self.hashes.append(np.fromiter(map(hash, chain.from_iterable(map(_DIGESTS, new))), np.int64, n))
            self.hashed = len(self.items)

    def one(self, key: str, digests: Sequence[str], item: ItemChunks, template: int) -> int:
        kd = (key, digests)
        i = self.ids.get(kd)
        if i is None:
            if len(item.lengths) != len(digests):
                raise _mismatch(item)
            i = self.ids[kd] = len(self.items)
            self.items.append(item)
            self.origin.append(template)
            self.counts.append(len(digests))
            self.nbytes.append(sum(item.lengths))
        return i

    def all(
        self, keys: list[str], digests: list[Sequence[str]], items: Sequence[ItemChunks], template: int
    ) -> list[int]:
        kds = list(zip(keys, digests, strict=True))
        n0, n = len(self.items), len(kds)
        if not any(map(self.ids.__contains__, kds)):  # all new: one C-level update
            self.ids.update(zip(kds, range(n0, n0 + n), strict=True))
            counts = list(map(len, digests))
            if len(self.ids) == n0 + n and counts == list(map(len, map(_LENGTHS, items))):
                self.items.extend(items)
                self.origin.extend([template] * n)
                self.counts.extend(counts)
                self.nbytes.extend(map(sum, map(_LENGTHS, items)))
                return list(range(n0, n0 + n))
            for kd in kds:  # an item repeated within the rank, or malformed: undo, go one by one
                self.ids.pop(kd, None)
        return [self.one(k, d, it, template) for (k, d), it in zip(kds, items, strict=True)]


def at_items(column: np.ndarray, items: np.ndarray) -> np.ndarray:
    """``column[items]`` for ``items`` distinct and ascending: ``column`` itself (no gather) when
    they are every item (a fully sharded job's solo items)."""
    return column if len(items) == len(column) else column[items]


def _mismatch(item: ItemChunks) -> ValueError:
    return ValueError(
        f"item {item.key!r}: {len(item.digests)} chunk digests but {len(item.lengths)} chunk lengths"
    )


def _compare(items: Sequence[ItemChunks], t: _Template) -> tuple[list[bool], int]:
    """Per position, whether ``items`` has the template's item there; and how many do.

    One pass in which each item is touched once: the reports of thousands of ranks do not
    fit in cache, so passes, not comparisons, are what cost.
    """
    eqs = [it.digests == d and it.key == k for it, d, k in zip(items, t.digests, t.keys, strict=False)]
    return eqs, eqs.count(True)


def _probe(items: Sequence[ItemChunks], t: _Template) -> bool:
    """Whether any of a few sampled positions holds the template's item: a full comparison
    is not worth its pass when none does (every rank of a fully sharded job)."""
    n = min(len(items), len(t.keys))
    if n < 8:
        return True
    for p in (0, n // 4, n // 2, 3 * n // 4, n - 1):
        if items[p].digests == t.digests[p] and items[p].key == t.keys[p]:
            return True
    return False


def _match(
    items: Sequence[ItemChunks], templates: list[_Template], last: int, known: _Items
) -> tuple[int, list[bool], int]:
    """The template to compare ``items`` with, per position whether it matches, and how many do.

    The last template used, else the one where this rank's first differing item was seen (the
    same tensor-parallel shard on another node, say): the closer of the two. (-1, [], 0): none.
    """
    if last < 0:
        return -1, [], 0
    tid, matched = last, 0
    eqs: list[bool] = []
    if _probe(items, templates[last]):
        eqs, matched = _compare(items, templates[last])
    if 2 * matched < len(items):
        p = eqs.index(False) if False in eqs else len(eqs) if eqs else 0
        other = known.ids.get((items[p].key, items[p].digests)) if p < len(items) else None
        alt = known.origin[other] if other is not None else -1
        if alt >= 0 and alt != last and _probe(items, templates[alt]):
            alt_eqs, alt_matched = _compare(items, templates[alt])
            if alt_matched > matched:
                return alt, alt_eqs, alt_matched
    return tid, eqs, matched


def _falses(flags: list[bool], count: int) -> list[int]:
    """Positions of the ``count`` False values in ``flags`` (C-level scans: cheap when few)."""
    out: list[int] = []
    i = -1
    for _ in range(count):
        i = flags.index(False, i + 1)
        out.append(i)
    return out


def index_reports(reports: Sequence[Sequence[ItemChunks]]) -> Holdings:
    """Reduce every slot's items to distinct items and holders, then dedup their chunks."""
    known = _Items()
    templates: list[_Template] = []
    classes: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # (template, positions lacked) -> slots
    extras: list[ItemChunks] = []  # items held outside a template match, and by which slot
    extra_slot: list[int] = []
    seen: list[Sequence[ItemChunks]] = []  # per slot: items equal to its own, position by position
    last = -1
    for slot, its in enumerate(reports):
        if not its:
            seen.append(())
            continue
        n = len(its)
        tid, eqs, matched = _match(its, templates, last, known)
        if tid < 0 or 2 * matched < n:
            tid = len(templates)
            keys = [it.key for it in its]
            digests = [it.digests for it in its]
            gids = np.array(known.all(keys, digests, its, tid), dtype=np.int64)
            templates.append(_Template(list(its), keys, digests, gids))
            classes[(tid, ())] = [slot]
            seen.append(templates[tid].reports)
            known.flush()
            last = tid
            continue
        t = templates[tid]
        t_len = len(t.keys)
        if matched == t_len == n:
            classes[(tid, ())].append(slot)
            seen.append(t.reports)
        else:
            differ = _falses(eqs, len(eqs) - matched)
            classes.setdefault((tid, (*differ, *range(n, t_len))), []).append(slot)
            mine = t.reports[:n]
            for p in chain(differ, range(t_len, n)):
                it = its[p]
                extras.append(it)
                extra_slot.append(slot)
                if p < len(mine):
                    mine[p] = it
                else:
                    mine.append(it)
            seen.append(mine)
        last = tid
    # Items outside template matches are looked up once all templates are known, in one batch.
    extra_item = [known.one(it.key, it.digests, it, -1) for it in extras]
    known.flush()
    nbytes = np.fromiter(map(_NBYTES, known.items), np.int64, len(known.items))
    holder, sets, logical = _holders(nbytes, [t.items for t in templates], classes, extra_item, extra_slot)
    h = _chunks(known, holder, sets, logical)
    h.seen = seen
    return h


def same_reports(h: Holdings, reports: Sequence[Sequence[ItemChunks]]) -> bool:
    """Whether ``reports`` (per slot) have the same items as those ``h`` was built from: same
    keys, nbytes and digest tuples, position by position (full strings, one pass per rank)."""
    if len(reports) != len(h.seen):
        return False
    for its, ref in zip(reports, h.seen, strict=True):
        if len(its) != len(ref):
            return False
        same = [
            a.digests == b.digests and a.key == b.key and a.nbytes == b.nbytes
            for a, b in zip(its, ref, strict=True)
        ]
        if False in same:
            return False
    return True


class Split(Sequence[np.ndarray]):
    """``values`` cut at ``bounds``: part ``i`` is ``values[bounds[i]:bounds[i + 1]]`` (a view).

    The distinct items of every template, back to back: read whole (:meth:`joined`) without
    one array per template.
    """

    def __init__(self, values: np.ndarray, bounds: np.ndarray) -> None:
        self._values, self._bounds = values, bounds

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, i: Any) -> Any:
        return self._values[self._bounds[i] : self._bounds[i + 1]]

    def joined(self) -> np.ndarray:
        """Every part, back to back."""
        return self._values[self._bounds[0] : self._bounds[-1]]

    def sizes(self) -> np.ndarray:
        """The length of each part."""
        return np.diff(self._bounds)


def _joined(template_items: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The items of every template, back to back, and how many each has."""
    if isinstance(template_items, Split):
        return template_items.joined(), template_items.sizes()
    sizes = np.fromiter(map(len, template_items), np.int64, len(template_items))
    return np.concatenate([np.zeros(0, dtype=np.int64), *template_items]), sizes


def _one_class_each(
    template_items: Sequence[np.ndarray], classes: dict[tuple[int, tuple[int, ...]], list[int]], n_items: int
) -> np.ndarray | None:
    """Whether the classes are the templates in order, each whole, and hold items 0, 1, ... once:
    then the number of items of each class, else None."""
    if len(classes) != len(template_items):
        return None
    if any(tid != i or lacked for i, (tid, lacked) in enumerate(classes)):
        return None
    held, sizes = _joined(template_items)
    return sizes if len(held) == n_items and bool((held == np.arange(n_items)).all()) else None


def _holders(
    nbytes: np.ndarray,
    template_items: Sequence[np.ndarray],
    classes: dict[tuple[int, tuple[int, ...]], list[int]],
    extra_item: Sequence[int] | np.ndarray,
    extra_slot: Sequence[int] | np.ndarray,
) -> tuple[np.ndarray, list[tuple[int, ...]], int]:
    """Holder code per item (see :attr:`Holdings.holder`) and the logical bytes of all reports.

    ``nbytes``: each distinct item's reported size; ``template_items``: the distinct item at each
    position of each template; ``classes``: (template, positions lacked) -> slots; extras: items
    held outside a template match, and the slot holding each.
    """
    n_items = len(nbytes)
    class_slots = list(classes.values())
    ex_item, ex_slot = np.array(extra_item, dtype=np.int64), np.array(extra_slot, dtype=np.int64)
    if not len(ex_item) and len(classes) == len(template_items) == n_items == 0:
        return np.zeros(0, dtype=np.int64), [], 0
    sizes = None if len(ex_item) else _one_class_each(template_items, classes, n_items)
    if sizes is not None:
        # Every item held by one class only (a fully sharded job): no per-class numpy.
        per_class = np.fromiter(map(len, class_slots), np.int64, len(class_slots))
        first = np.fromiter(map(itemgetter(0), class_slots), np.int64, len(class_slots))
        in_set = per_class > 1  # held by the class's slots: sets -1, -2, ... in class order
        codes = np.where(in_set, -np.cumsum(in_set, dtype=np.int64), first)
        holder = np.repeat(codes, sizes)
        alone = not in_set.any()
        logical = int(nbytes.sum()) if alone else int((nbytes * np.repeat(per_class, sizes)).sum())
        return holder, [tuple(x) for x in class_slots if len(x) > 1], logical
    # Every (class, item) pair at once: the items of each class's template, less those it lacks.
    helds = [
        np.delete(template_items[tid], lacked) if lacked else template_items[tid] for tid, lacked in classes
    ]
    sizes = np.array([len(x) for x in helds], dtype=np.int64)
    held = np.concatenate([np.zeros(0, dtype=np.int64), *helds])
    cid = np.repeat(np.arange(len(helds), dtype=np.int64), sizes)
    n_slots = np.array([len(x) for x in class_slots], dtype=np.int64)
    logical = int(nbytes[ex_item].sum()) + int((nbytes[held] * n_slots[cid]).sum())
    # First class holding each item; items held by several classes (rare) one by one, in order.
    first_class = np.full(n_items, -1, dtype=np.int64)
    times = np.bincount(held, minlength=n_items)
    once = times[held] == 1
    first_class[held[once]] = cid[once]
    shared: dict[int, list[int]] = {}  # item -> every class holding it, when more than one
    for item, c in zip(held[~once].tolist(), cid[~once].tolist(), strict=True):
        holding = shared.setdefault(item, [])
        if not holding or holding[-1] != c:
            holding.append(c)
    for item, in_order in list(shared.items()):
        first_class[item] = in_order[0]
        if len(in_order) == 1:
            del shared[item]

    sets: list[tuple[int, ...]] = []
    set_ids: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}

    def code(cids: tuple[int, ...], more: tuple[int, ...]) -> int:
        k = set_ids.get((cids, more))
        if k is None:
            slots = sorted(set(chain(more, *map(class_slots.__getitem__, cids))))
            if len(slots) == 1:
                return slots[0]
            k = set_ids[(cids, more)] = len(sets)
            sets.append(tuple(slots))
        return -1 - k

    in_class = first_class >= 0
    class_code = np.zeros(len(class_slots), dtype=np.int64)
    used = np.bincount(first_class[in_class], minlength=len(class_slots)) > 0
    alone_class = used & (n_slots == 1)
    class_code[alone_class] = [class_slots[c][0] for c in np.flatnonzero(alone_class).tolist()]
    several = np.flatnonzero(used & ~alone_class).tolist()
    class_code[several] = [code((c,), ()) for c in several]
    holder = np.where(in_class, class_code[np.maximum(first_class, 0)], 0)
    # Items held outside template matches: one slot and no class is the common case (a rank's shard).
    n_extra = np.bincount(ex_item, minlength=n_items)
    alone = ((n_extra == 1) & ~in_class)[ex_item]
    holder[ex_item[alone]] = ex_slot[alone]
    extras: dict[int, list[int]] = {}
    for item, slot in zip(ex_item[~alone].tolist(), ex_slot[~alone].tolist(), strict=True):
        extras.setdefault(item, []).append(slot)
    for item in set(shared) | set(extras):
        cids = tuple(shared.get(item, [int(first_class[item])] if first_class[item] >= 0 else []))
        holder[item] = code(cids, tuple(extras.get(item, ())))
    return holder, sets, logical


def _chunks(known: _Items, holder: np.ndarray, sets: list[tuple[int, ...]], logical: int) -> Holdings:
    count = np.array(known.counts, dtype=np.int64)
    nbytes = np.array(known.nbytes, dtype=np.int64)
    start = np.cumsum(count) - count
    h = Holdings(known.items, holder, sets, logical, count, nbytes, start, None)
    known.flush()
    hashes = np.concatenate(known.hashes) if known.hashes else np.zeros(0, dtype=np.int64)
    h.dups = _duplicates(h, hashes)
    return h


def _duplicates(h: Holdings, hashes: np.ndarray) -> Duplicates | None:
    """Chunks at several flat positions: equal Python hashes (cached on the strings), then equal
    full strings. Sorting 64-bit integers is the only pass over all chunks."""
    total = len(hashes)
    ordered = np.sort(hashes)
    equal = ordered[1:] == ordered[:-1]
    if not equal.any():
        return None  # every hash differs, so every digest does
    # Digests whose hash is shared; among them, equal full strings are one chunk.
    candidates = np.flatnonzero(np.isin(hashes, ordered[1:][equal])).tolist()
    by_digest: dict[str, list[int]] = {}
    for p in candidates:
        by_digest.setdefault(h.digests[p], []).append(p)
    canon = np.arange(total, dtype=np.int64)
    places: dict[int, list[int]] = {}
    for ps in by_digest.values():
        if len(ps) > 1:
            canon[ps] = ps[0]
            places[ps[0]] = ps
    if not places:
        return None
    return duplicates_at(h, canon, places)


def duplicates_at(h: Holdings, canon: np.ndarray, places: dict[int, list[int]]) -> Duplicates:
    """:class:`Duplicates` of the flat positions ``places`` (first -> all) holding equal digests."""
    holder: dict[int, int] = {}
    set_ids: dict[tuple[int, ...], int] = {}
    for first, ps in places.items():
        slots: set[int] = set()
        for item in h.item_of(np.array(ps)).tolist():
            code = int(h.holder[item])
            slots.update((code,) if code >= 0 else h.sets[-1 - code])
        if len(slots) == 1:
            holder[first] = slots.pop()
            continue
        key = tuple(sorted(slots))
        if key not in set_ids:
            set_ids[key] = len(h.sets)
            h.sets.append(key)
        holder[first] = -1 - set_ids[key]
    flat = np.fromiter(chain.from_iterable(places.values()), np.int64)
    return Duplicates(canon, places, holder, np.unique(h.item_of(flat)))
