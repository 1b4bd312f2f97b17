"""Who holds what: the result of the planner's first stage, which the second stage reads.

Private to :mod:`shoal.group.planner` (the algorithm is described there, once).
:func:`shoal.group._tables.index_tables` reduces the ranks' tables to :class:`Holdings`:
distinct items, the slots holding each, and the chunks found in several distinct items. A
*slot* is a position in the rank-ordered reports; a *flat position* numbers the chunks of all
distinct items back to back. It depends only on the reports, so
:class:`~shoal.group.planner.PlanCache` keeps it while the layout and digests stay the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from shoal.group._tables import TableStore
    from shoal.group.plan import ChunkTable, ItemChunks


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

    store: TableStore
    """Keys, digests and lengths of the distinct items, read from the tables that hold them."""
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
    seen: Sequence[ChunkTable] = field(default_factory=list)
    """Per slot, the table it was built from: what :func:`~shoal.group._tables.same_tables`
    compares new reports with."""
    _digests: list[str] | None = None

    @property
    def items(self) -> Sequence[ItemChunks]:
        """One :class:`ItemChunks` per distinct ``(key, digests)``, the first slot's, built on
        access (tests, debugging; the planner reads :attr:`store`)."""
        return self.store.items()

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


def at_items(column: np.ndarray, items: np.ndarray) -> np.ndarray:
    """``column[items]`` for ``items`` distinct and ascending: ``column`` itself (no gather) when
    they are every item (a fully sharded job's solo items)."""
    return column if len(items) == len(column) else column[items]


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


def _one_class_each(
    template_items: Split, classes: dict[tuple[int, tuple[int, ...]], list[int]], n_items: int
) -> np.ndarray | None:
    """Whether the classes are the templates in order, each whole, and hold items 0, 1, ... once:
    then the number of items of each class, else None."""
    if len(classes) != len(template_items):
        return None
    if any(tid != i or lacked for i, (tid, lacked) in enumerate(classes)):
        return None
    held, sizes = template_items.joined(), template_items.sizes()
    return sizes if len(held) == n_items and bool((held == np.arange(n_items)).all()) else None


def _one_class_holders(
    nbytes: np.ndarray, class_slots: list[list[int]], sizes: np.ndarray
) -> tuple[np.ndarray, list[tuple[int, ...]], int]:
    """:func:`holders_of` when every item is held by one class only (a fully sharded job)."""
    per_class = np.fromiter(map(len, class_slots), np.int64, len(class_slots))
    first = np.fromiter(map(itemgetter(0), class_slots), np.int64, len(class_slots))
    in_set = per_class > 1  # held by the class's slots: sets -1, -2, ... in class order
    codes = np.where(in_set, -np.cumsum(in_set, dtype=np.int64), first)
    holder = np.repeat(codes, sizes)
    alone = not in_set.any()
    logical = int(nbytes.sum()) if alone else int((nbytes * np.repeat(per_class, sizes)).sum())
    return holder, [tuple(x) for x in class_slots if len(x) > 1], logical


def _first_classes(
    held: np.ndarray, cid: np.ndarray, n_items: int
) -> tuple[np.ndarray, dict[int, list[int]]]:
    """The first class holding each item (-1: none), and every class of the (rare) items held by several."""
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
    return first_class, shared


def holders_of(
    nbytes: np.ndarray,
    template_items: Split,
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
        return _one_class_holders(nbytes, class_slots, sizes)
    # Every (class, item) pair at once: the items of each class's template, less those it lacks.
    helds = [
        np.delete(template_items[tid], lacked) if lacked else template_items[tid] for tid, lacked in classes
    ]
    sizes = np.array([len(x) for x in helds], dtype=np.int64)
    held = np.concatenate([np.zeros(0, dtype=np.int64), *helds])
    cid = np.repeat(np.arange(len(helds), dtype=np.int64), sizes)
    n_slots = np.array([len(x) for x in class_slots], dtype=np.int64)
    logical = int(nbytes[ex_item].sum()) + int((nbytes[held] * n_slots[cid]).sum())
    first_class, shared = _first_classes(held, cid, n_items)

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
