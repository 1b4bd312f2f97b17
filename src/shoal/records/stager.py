"""The stager: copies a rank's items into a pre-faulted, reused DRAM slab (the only part training waits for).

A rank owns a ring of ``dram_slots`` slots; each slot is one slab in the DRAM
tier, mapped once and reused by every later checkpoint staged into it. A slot
is *in flight* from staging until the pipeline is done with it; a save never
stages into an in-flight slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal._torch_private import foreach_copy, unflatten_dense_tensors
from shoal.errors import InvalidName, UnsupportedValue
from shoal.format.names import check_item_key
from shoal.tiers.slabs import SlabLike, SlabStore

_unflatten = unflatten_dense_tensors()
_foreach_copy = foreach_copy()

log = logging.getLogger(__name__)

ALIGN = 64
"""Items start on 64-byte boundaries, enough for every dtype view and for cache lines."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class StageEntry:
    """One item to stage: a tensor (any device, any strides) or opaque bytes."""

    key: str
    payload: torch.Tensor | bytes | bytearray | memoryview


@dataclass(frozen=True)
class StagedItem:
    key: str
    kind: str
    nbytes: int
    offset: int
    rank: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(eq=False)
class Slot:
    """One slab of the ring and the checkpoint staged in it."""

    index: int
    name: str
    slab: SlabLike | None = None
    step: int | None = None
    in_flight: bool = False
    items: list[StagedItem] = field(default_factory=list)

    def view(self, item: StagedItem) -> memoryview:
        assert self.slab is not None
        return self.slab.buffer[item.offset : item.offset + item.nbytes]


def _nbytes(payload: torch.Tensor | bytes | bytearray | memoryview) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return memoryview(payload).nbytes


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def layout(entries: Sequence[StageEntry]) -> tuple[list[int], int]:
    """Offsets of each entry in the slab and the total bytes needed."""
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos = _round_up(pos + _nbytes(e.payload))
    return offsets, pos


def _copy_tensor(buffer: memoryview, offset: int, tensor: torch.Tensor) -> None:
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return
    dst = torch.frombuffer(buffer, dtype=torch.uint8, count=n, offset=offset)
    with torch.no_grad():
        dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    del dst


def _fusable(p: torch.Tensor) -> bool:
    """Whether ``p`` can go through the fused copy: a plain CPU tensor (any strides)."""
    return p.device.type == "cpu" and not p.is_quantized and not p.is_conj() and not p.is_neg()


_PADS: dict[tuple[torch.dtype, int], torch.Tensor] = {}
"""Shape templates (on the meta device: no memory) for the alignment gaps between items."""


def _pad(dtype: torch.dtype, numel: int) -> torch.Tensor:
    pad = _PADS.get((dtype, numel))
    if pad is None:
        pad = _PADS[(dtype, numel)] = torch.empty(numel, dtype=dtype, device="meta")
    return pad


def _copy_run(buffer: memoryview, start: int, run: list[tuple[int, int, torch.Tensor]]) -> None:
    """Copy a run of same-dtype tensors laid out back to back from ``start`` with three torch calls.

    ``run``: (offset, nbytes, tensor), offsets ascending, each at the aligned end of the one before.
    One ``frombuffer`` of the run's bytes, one ``unflatten_dense_tensors`` for every item's view
    (the alignment gaps as shape templates) and one ``_foreach_copy_``: a handful of GIL releases
    for the whole run instead of five per item.
    """
    dtype = run[0][2].dtype
    size = run[0][2].element_size()
    end = run[-1][0] + run[-1][1]
    templates: list[torch.Tensor] = []
    at = start
    for off, n, t in run:
        if off > at:  # the gap is a whole number of elements: offsets are ALIGN-aligned, ALIGN % size == 0
            templates.append(_pad(dtype, (off - at) // size))
        templates.append(t)
        at = off + n
    flat = torch.frombuffer(buffer, dtype=dtype, count=(end - start) // size, offset=start)
    views = _unflatten(flat, templates)
    dsts = [v for v, t in zip(views, templates, strict=True) if t.device.type != "meta"]
    with torch.no_grad():
        _foreach_copy(dsts, [t for _, _, t in run])
    del flat, views, dsts


def _copy_tensors(buffer: memoryview, tensors: list[tuple[int, int, torch.Tensor]]) -> None:
    """Copy ``tensors`` (offset, nbytes, tensor; in slab order) into ``buffer``.

    Consecutive plain CPU tensors of one dtype go through :func:`_copy_run` together; any
    other tensor (another device, quantized, a lazy conjugate or negative view) on its own.
    """
    run: list[tuple[int, int, torch.Tensor]] = []

    def flush() -> None:
        if run:
            _copy_run(buffer, run[0][0], run)
            run.clear()

    for off, n, t in tensors:
        if n == 0:
            continue
        if not _fusable(t) or ALIGN % t.element_size():
            flush()
            _copy_tensor(buffer, off, t)
            continue
        if run and (run[-1][2].dtype != t.dtype or _round_up(run[-1][0] + run[-1][1]) != off):
            flush()
        run.append((off, n, t))
    flush()


def stage_into(slot: Slot, dram: SlabStore, entries: Sequence[StageEntry], *, rank: int) -> list[StagedItem]:
    """Copy ``entries`` into ``slot``'s slab (growing it if the state grew); return what was staged."""
    seen: set[str] = set()
    for e in entries:
        check_item_key(e.key)
        if e.key in seen:
            raise InvalidName(f"item key {e.key!r} appears twice in one checkpoint")
        seen.add(e.key)
    offsets, total = layout(entries)
    if slot.slab is None:
        slot.slab = dram.open_slab(slot.name, max(total, ALIGN), exclusive=True)
    elif slot.slab.capacity < total:
        slot.slab.ensure(total + total // 16)
    buffer = slot.slab.buffer
    staged = []
    tensors: list[tuple[int, int, torch.Tensor]] = []
    for e, off in zip(entries, offsets, strict=True):
        p = e.payload
        if isinstance(p, torch.Tensor):
            if p.is_sparse or p.layout != torch.strided:
                raise UnsupportedValue(
                    f"item {e.key!r}: only strided (dense) tensors can be staged, got {p.layout}"
                )
            n = _nbytes(p)
            tensors.append((off, n, p))
            staged.append(StagedItem(e.key, "tensor", n, off, rank, dtype_name(p.dtype), tuple(p.shape)))
        else:
            view = memoryview(p).cast("B")
            buffer[off : off + view.nbytes] = view
            staged.append(StagedItem(e.key, "bytes", view.nbytes, off, rank))
    _copy_tensors(buffer, tensors)
    del buffer, tensors
    slot.items = staged
    return staged


class SlotRing:
    """The ring of DRAM slots of one rank. Thread-safe: the pipeline releases, the trainer acquires."""

    def __init__(self, dram: SlabStore, count: int, *, prefix: str) -> None:
        self._dram = dram
        self._slots = [Slot(i, f"{prefix}slot-{i}") for i in range(count)]
        self._cond = threading.Condition()
        self._next = 0

    @property
    def slots(self) -> list[Slot]:
        return list(self._slots)

    def acquire(self, step: int, *, wait: bool, timeout: float | None = None) -> tuple[Slot | None, float]:
        """Take a free slot for ``step``; return it (None if skipped or timed out) and seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            while True:
                for k in range(len(self._slots)):
                    slot = self._slots[(self._next + k) % len(self._slots)]
                    if not slot.in_flight:
                        self._next = (slot.index + 1) % len(self._slots)
                        slot.in_flight = True
                        slot.step = step
                        slot.items = []
                        return slot, time.perf_counter() - t0
                if not wait:
                    return None, time.perf_counter() - t0
                remaining = None if timeout is None else timeout - (time.perf_counter() - t0)
                if remaining is not None and remaining <= 0:
                    return None, time.perf_counter() - t0
                self._cond.wait(remaining)

    def release(self, slot: Slot) -> None:
        with self._cond:
            slot.in_flight = False
            self._cond.notify_all()

    def has_free_slot(self) -> bool:
        """Whether a save could stage now without waiting."""
        with self._cond:
            return any(not s.in_flight for s in self._slots)

    def in_flight_steps(self) -> list[int]:
        with self._cond:
            return [s.step for s in self._slots if s.in_flight and s.step is not None]

    def warm(self, nbytes: int) -> None:
        """Create (or grow) every idle slot's slab to ``nbytes`` now, pre-faulted.

        Run in the background after the first save, so that the second save does not
        pay first-touch page faults in a fresh slot. A slot being warmed is reserved
        (a save that needs it waits for it, as for any in-flight slot).
        """
        for slot in self._slots:
            with self._cond:
                if slot.in_flight or (slot.slab is not None and slot.slab.capacity >= nbytes):
                    continue
                slot.in_flight = True
                slot.step = None
            try:
                if slot.slab is None:
                    slot.slab = self._dram.open_slab(slot.name, nbytes, exclusive=True)
                else:
                    slot.slab.ensure(nbytes)
            except Exception as e:  # the save that needs this slot will report it
                log.warning("could not pre-allocate DRAM slot %s (%d bytes): %s", slot.name, nbytes, e)
            finally:
                self.release(slot)

    def needs_warming(self, nbytes: int) -> bool:
        """Whether some idle slot has no slab of ``nbytes`` yet."""
        with self._cond:
            return any(not s.in_flight and (s.slab is None or s.slab.capacity < nbytes) for s in self._slots)

    def close(self, *, release_memory: bool = False) -> None:
        """Unmap every slab (the ring must not be used afterwards).

        With ``release_memory`` the slab files of every slot are deleted too (those an
        earlier process of this rank left, as well), returning their memory to ``/dev/shm``;
        call it only when nothing staged is still needed (every checkpoint finished), and
        after deleting the slots' staged indexes (:func:`shoal.records.staged.delete_staged`:
        never an index over a slab that is gone). Without it the slabs stay for a restarted
        process.
        """
        with self._cond:
            for slot in self._slots:
                if slot.slab is not None:
                    slot.slab.close()
                if release_memory:
                    self._dram.delete_slab(slot.name)  # also one an earlier process of this rank left
                slot.slab = None
