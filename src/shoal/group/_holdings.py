"""Who holds what: every rank's report reduced to distinct items and unique chunks.

Private to :mod:`shoal.group.planner` (its first stage). Depends only on the reports, so
:class:`~shoal.group.planner.PlanCache` keeps the result while the layout and digests stay
the same. A *slot* is a position in the rank-ordered reports; a *flat position* numbers
the chunks of all distinct items back to back.

Two levels, both exact:

1. **Items.** Each rank is compared with the last similar rank (a *template*), position by
   position, in C: an item with the same key and the same digest tuple is the template's
   item. Ranks that match the same template at the same positions form a *class*, so
   data-parallel replicas add one slot to one list each. Items that differ are looked up
   by their full ``(key, digests)`` in a dictionary. A rank that matches less than half of
   its template becomes a template itself.
2. **Chunks.** A chunk may still appear in two distinct items (a tied weight, zeros). Every
   digest of every distinct item is bucketed by its Python ``hash`` (cached on the string)
   with a numpy sort; equal hashes are then compared as full strings, so a duplicate is
   found if and only if the digests are equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import and_, attrgetter, eq
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from shoal.group.planner import ItemChunks

_KEY = attrgetter("key")
_DIGESTS = attrgetter("digests")
_LENGTHS = attrgetter("lengths")
_NBYTES = attrgetter("nbytes")


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

    items: list[ItemChunks]
    """One object per distinct ``(key, digests)``: the first slot's."""
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
    _key_rank: np.ndarray | None = None
    _digests: list[str] | None = None

    @property
    def total(self) -> int:
        """Chunks of all distinct items."""
        return int(self.count.sum())

    @property
    def digests(self) -> list[str]:
        """Digest at each flat position (built when first needed)."""
        if self._digests is None:
            self._digests = list(chain.from_iterable(map(_DIGESTS, self.items)))
        return self._digests

    def key_rank(self) -> np.ndarray:
        """Per item, the rank of its key in sorted order (equal keys, equal rank)."""
        if self._key_rank is None:
            keys = list(map(_KEY, self.items))
            order = {k: i for i, k in enumerate(sorted(set(keys)))}
            self._key_rank = np.fromiter(map(order.__getitem__, keys), np.int64, len(keys))
        return self._key_rank

    def item_of(self, flat: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.start, flat, side="right") - 1

    def holds(self, slot: int, item: int) -> bool:
        code = int(self.holder[item])
        return code == slot if code >= 0 else slot in self.sets[-1 - code]


@dataclass
class _Template:
    keys: list[str]
    digests: list[tuple[str, ...]]
    items: np.ndarray


class _Items:
    """Distinct items by exact ``(key, digests)``, in order of first appearance."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, tuple[str, ...]], int] = {}
        self.items: list[ItemChunks] = []
        self.origin: list[int] = []
        self.hashes: list[tuple[int, ...]] = []
        """``hash`` of every chunk digest of the items, flat: taken while the strings are in cache."""

    def one(self, key: str, digests: tuple[str, ...], item: ItemChunks, template: int) -> int:
        kd = (key, digests)
        i = self.ids.get(kd)
        if i is None:
            i = self.ids[kd] = len(self.items)
            self.items.append(item)
            self.origin.append(template)
            self.hashes.append(tuple(map(hash, digests)))
        return i

    def all(
        self, keys: list[str], digests: list[tuple[str, ...]], items: Sequence[ItemChunks], template: int
    ) -> list[int]:
        kds = list(zip(keys, digests, strict=True))
        n0, n = len(self.items), len(kds)
        if not any(map(self.ids.__contains__, kds)):  # all new: one C-level update
            self.ids.update(zip(kds, range(n0, n0 + n), strict=True))
            if len(self.ids) == n0 + n:
                self.items.extend(items)
                self.origin.extend([template] * n)
                self.hashes.append(tuple(map(hash, chain.from_iterable(digests))))
                return list(range(n0, n0 + n))
            for kd in kds:  # an item repeated within the rank: undo, take the careful path
                self.ids.pop(kd, None)
        return [self.one(k, d, it, template) for (k, d), it in zip(kds, items, strict=True)]


def _compare(keys: list[str], digests: list[tuple[str, ...]], t: _Template) -> tuple[list[bool], int]:
    if keys == t.keys:
        eqs = list(map(eq, digests, t.digests))
    else:
        eqs = list(map(and_, map(eq, keys, t.keys), map(eq, digests, t.digests)))
    return eqs, eqs.count(True)


def _falses(flags: list[bool]) -> list[int]:
    """Positions of False in ``flags`` (C-level scans: cheap when few differ)."""
    out: list[int] = []
    i = -1
    try:
        while True:
            i = flags.index(False, i + 1)
            out.append(i)
    except ValueError:
        return out


def index_reports(reports: Sequence[Sequence[ItemChunks]]) -> Holdings:
    """Reduce every slot's items to distinct items and holders, then dedup their chunks."""
    known = _Items()
    templates: list[_Template] = []
    classes: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # (template, positions lacked) -> slots
    extra_item: list[int] = []  # (item, slot) pairs held outside a template match
    extra_slot: list[int] = []
    last, fast = -1, True
    for slot, its in enumerate(reports):
        if not its:
            continue
        keys = [it.key for it in its]
        digests = [it.digests for it in its]
        n = len(keys)
        tid, matched = -1, 0
        eqs: list[bool] = []
        if last >= 0:
            t = templates[last]
            if fast and digests == t.digests and keys == t.keys:
                classes[(last, ())].append(slot)
                continue
            tid = last
            eqs, matched = _compare(keys, digests, t)
            if 2 * matched < n and False in eqs:
                # Try the template where this rank's first differing item was seen (the same
                # tensor-parallel shard on another node, say); keep the closer of the two.
                p = eqs.index(False)
                other = known.ids.get((keys[p], digests[p]))
                alt = known.origin[other] if other is not None else -1
                if alt >= 0 and alt != last:
                    alt_eqs, alt_matched = _compare(keys, digests, templates[alt])
                    if alt_matched > matched:
                        tid, eqs, matched = alt, alt_eqs, alt_matched
        if tid < 0 or 2 * matched < n:
            tid = len(templates)
            templates.append(
                _Template(keys, digests, np.array(known.all(keys, digests, its, tid), dtype=np.int64))
            )
            classes[(tid, ())] = [slot]
            last, fast = tid, True
            continue
        t_len = len(templates[tid].keys)
        if matched == t_len == n:
            classes[(tid, ())].append(slot)
            fast = True
        else:
            differ = _falses(eqs)
            classes.setdefault((tid, (*differ, *range(n, t_len))), []).append(slot)
            for p in chain(differ, range(t_len, n)):
                extra_item.append(known.one(keys[p], digests[p], its[p], -1))
                extra_slot.append(slot)
            fast = False
        last = tid
    holder, sets, logical = _holders(known.items, templates, classes, extra_item, extra_slot)
    return _chunks(known, holder, sets, logical)


def _holders(
    items: list[ItemChunks],
    templates: list[_Template],
    classes: dict[tuple[int, tuple[int, ...]], list[int]],
    extra_item: list[int],
    extra_slot: list[int],
) -> tuple[np.ndarray, list[tuple[int, ...]], int]:
    """Holder code per item (see :attr:`Holdings.holder`) and the logical bytes of all reports."""
    n_items = len(items)
    nbytes = np.fromiter(map(_NBYTES, items), np.int64, n_items)
    first_class = np.full(n_items, -1, dtype=np.int64)
    shared: dict[int, list[int]] = {}  # item -> every class holding it, when more than one
    class_slots = list(classes.values())
    ex_item, ex_slot = np.array(extra_item, dtype=np.int64), np.array(extra_slot, dtype=np.int64)
    logical = int(nbytes[ex_item].sum())
    for cid, ((tid, lacked), slots) in enumerate(classes.items()):
        held = templates[tid].items
        if lacked:
            held = np.delete(held, lacked)
        logical += int(nbytes[held].sum()) * len(slots)
        fresh = first_class[held] < 0
        first_class[held[fresh]] = cid
        if not fresh.all():
            for item in held[~fresh].tolist():
                shared.setdefault(item, [int(first_class[item])]).append(cid)

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
    used = np.unique(first_class[in_class]).tolist()
    class_code = np.zeros(len(class_slots), dtype=np.int64)
    class_code[used] = [code((c,), ()) for c in used]
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
    items = known.items
    n_items = len(items)
    count = np.fromiter(map(len, map(_DIGESTS, items)), np.int64, n_items)
    n_lengths = np.fromiter(map(len, map(_LENGTHS, items)), np.int64, n_items)
    if not np.array_equal(count, n_lengths):
        bad = items[int(np.flatnonzero(count != n_lengths)[0])]
        raise ValueError(
            f"item {bad.key!r}: {len(bad.digests)} chunk digests but {len(bad.lengths)} chunk lengths"
        )
    nbytes = np.fromiter(map(sum, map(_LENGTHS, items)), np.int64, n_items)
    start = np.cumsum(count) - count
    h = Holdings(items, holder, sets, logical, count, nbytes, start, None)
    h.dups = _duplicates(h, np.fromiter(chain.from_iterable(known.hashes), np.int64, int(count.sum())))
    return h


def _duplicates(h: Holdings, hashes: np.ndarray) -> Duplicates | None:
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
