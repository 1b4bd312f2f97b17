"""A manifest checked against its own DCP metadata before a byte is loaded (docs/design.md section 11).

A manifest describes each stored item twice: shoal's record (kind, dtype, shape, byte
size, chunk digests) and DCP's ``Metadata`` (what the state dict held: each tensor's
dtype, size and saved chunks, and ``storage_data``, which maps each saved chunk to the
shoal item holding its bytes). Both are written together by the coordinator, so they
agree; a manifest where they do not (a bug, or a stranger's forgery) would otherwise load
wrong values silently (float32 bytes read as int32) or crash deep inside torch. Every
check here is pure: no I/O, no torch.distributed.

What must agree, for every ``storage_data`` entry ``index -> key``:

* ``key`` is a string naming an item of the manifest, and it is the key shoal's writer
  derives from ``index`` (:func:`item_key`), so an entry cannot point at another item of
  the same dtype and shape;
* ``index.fqn`` is in ``state_dict_metadata``; a tensor entry names one saved chunk
  (its offsets) and a bytes entry none;
* kind: a tensor entry's item is a ``tensor`` item, a bytes entry's a ``bytes`` item;
* dtype: the item's dtype is a torch dtype and equals DCP's ``properties.dtype``;
* shape: the item's shape equals the chunk's sizes;
* size: the item's ``nbytes`` equals numel times the dtype's element size.

And both ways round: every DCP tensor chunk and bytes entry has a ``storage_data`` entry
(else the load would find nothing to read), every manifest item is named by one (a
manifest and its DCP metadata that list different items describe different checkpoints),
and each tensor's chunks tile its size exactly (no gap, which would leave part of the
destination unloaded, and no overlap, which would make the result depend on read order).

A manifest without DCP metadata has nothing to check here; the DCP loader refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from shoal.errors import FormatError, InvalidName
from shoal.format.dcp_codec import decode_metadata
from shoal.format.manifest import Manifest
from shoal.format.names import check_item_key

__all__ = ["check_against_dcp", "check_metadata", "item_dtype", "item_key"]


def item_key(index: MetadataIndex, *, sharded: bool) -> str:
    """The shoal item key of a DCP write item: its FQN, plus ``@<offsets>`` for a tensor shard.

    >>> item_key(MetadataIndex("w", torch.Size([4, 0])), sharded=True)
    'w@4_0'
    """
    key = (
        index.fqn
        if not sharded or index.offset is None
        else f"{index.fqn}@{'_'.join(map(str, index.offset))}"
    )
    return check_item_key(key)


def item_dtype(name: str | None, key: str) -> torch.dtype:
    """The torch dtype an item record names, or :class:`FormatError` naming the item."""
    dtype = vars(torch).get(name) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"item {key!r}: dtype {name!r} is not a torch dtype known to this torch")
    return dtype


def check_against_dcp(manifest: Manifest) -> None:
    """Check that ``manifest``'s items agree with its DCP metadata (see the module docstring).

    Raises :class:`FormatError` for malformed DCP metadata (naming the field) or for the
    first disagreement (naming the step, the item and both values). Pure; returns None.
    """
    if manifest.dcp is None:
        return
    check_metadata(manifest, decode_metadata(manifest.dcp))


def check_metadata(manifest: Manifest, metadata: Metadata) -> None:
    """:func:`check_against_dcp` for metadata already decoded from ``manifest.dcp``."""
    where = f"step {manifest.step} of job {manifest.job!r}"
    state = metadata.state_dict_metadata
    storage: Mapping[Any, Any] = metadata.storage_data or {}
    if not isinstance(storage, Mapping):
        raise FormatError(f"{where}: DCP storage_data is a {type(storage).__name__}, expected a mapping")
    chunks_of: dict[str, dict[tuple[int, ...], list[ChunkStorageMetadata]]] = {}
    for fqn, md in state.items():  # DCP's own metadata first: each tensor's chunks tile it
        if not isinstance(md, TensorStorageMetadata | BytesStorageMetadata):
            raise FormatError(
                f"{where}: DCP entry {fqn!r} is a {type(md).__name__}, not tensor or bytes metadata"
            )
        if isinstance(md, TensorStorageMetadata):
            _check_tiling(fqn, md, where)
            by_offsets = chunks_of.setdefault(fqn, {})
            for c in md.chunks:
                by_offsets.setdefault(tuple(c.offsets), []).append(c)
    named: set[str] = set()
    for index, key in storage.items():
        _check_entry(manifest, state, chunks_of, index, key, where)
        named.add(key)
    for fqn, md in state.items():
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise FormatError(
                    f"{where}: DCP entry {fqn!r} (bytes) has no storage_data entry: no item holds its bytes"
                )
            continue
        for chunk in md.chunks:
            if MetadataIndex(fqn, chunk.offsets) not in storage:
                raise FormatError(
                    f"{where}: DCP tensor {fqn!r}: the chunk at offsets {list(chunk.offsets)} "
                    f"(sizes {list(chunk.sizes)}) has no storage_data entry: no item holds its bytes"
                )
    for key in manifest.items:
        if key not in named:
            raise FormatError(
                f"{where}: manifest item {key!r} is not named by the DCP metadata's storage_data "
                "(the manifest and its DCP metadata list different items)"
            )


def _check_entry(
    manifest: Manifest,
    state: Mapping[str, Any],
    chunks_of: Mapping[str, Mapping[tuple[int, ...], list[ChunkStorageMetadata]]],
    index: Any,
    key: Any,
    where: str,
) -> None:
    if not isinstance(index, MetadataIndex):
        raise FormatError(f"{where}: DCP storage_data key {index!r} is not a MetadataIndex")
    entry = f"DCP storage_data entry for {index.fqn!r}" + (
        "" if index.offset is None else f" at offsets {list(index.offset)}"
    )
    if not isinstance(key, str):
        raise FormatError(f"{where}: {entry}: expected a shoal item key (a string), got {key!r}")
    rec = manifest.items.get(key)
    if rec is None:
        raise FormatError(f"{where}: {entry} names item {key!r}, which the manifest does not hold")
    md = state.get(index.fqn)
    if md is None:
        raise FormatError(f"{where}: {entry} (item {key!r}): {index.fqn!r} is not in state_dict_metadata")
    if isinstance(md, BytesStorageMetadata):
        if index.offset is not None:
            raise FormatError(f"{where}: {entry} (item {key!r}): a bytes entry has no offsets")
        _check_key(index, key, sharded=False, where=where, entry=entry)
        if rec.kind != "bytes":
            raise FormatError(
                f"{where}: item {key!r}: the manifest says kind {rec.kind!r}, "
                f"its DCP metadata says 'bytes' ({index.fqn!r} is not a tensor)"
            )
        return
    if rec.kind != "tensor":
        raise FormatError(
            f"{where}: item {key!r}: the manifest says kind {rec.kind!r}, "
            f"its DCP metadata says 'tensor' ({index.fqn!r})"
        )
    found = [] if index.offset is None else chunks_of.get(index.fqn, {}).get(tuple(index.offset), [])
    chunk = found[0] if len(found) == 1 else None  # two chunks at one offset: reported as an overlap
    if chunk is None:
        offsets = None if index.offset is None else list(index.offset)
        raise FormatError(
            f"{where}: {entry} (item {key!r}): tensor {index.fqn!r} has no saved chunk at offsets {offsets} "
            f"(its chunks start at {[list(c.offsets) for c in md.chunks][:8]})"
        )
    sharded = any(o != 0 for o in chunk.offsets) or tuple(chunk.sizes) != tuple(md.size)
    _check_key(index, key, sharded=sharded, where=where, entry=entry)
    try:
        dtype = item_dtype(rec.dtype, key)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    if dtype != md.properties.dtype:
        raise FormatError(
            f"{where}: item {key!r}: the manifest says dtype {rec.dtype}, "
            f"its DCP metadata says {str(md.properties.dtype).removeprefix('torch.')}"
        )
    shape = tuple(chunk.sizes)
    if rec.shape != shape:
        raise FormatError(
            f"{where}: item {key!r}: the manifest says shape {list(rec.shape or ())}, "
            f"its DCP metadata says {list(shape)} (tensor {index.fqn!r}, chunk at {list(chunk.offsets)})"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if rec.nbytes != nbytes:
        raise FormatError(
            f"{where}: item {key!r}: the manifest says {rec.nbytes} bytes, but a {list(shape)} "
            f"{str(dtype).removeprefix('torch.')} tensor holds {nbytes}"
        )


def _check_key(index: MetadataIndex, key: str, *, sharded: bool, where: str, entry: str) -> None:
    try:
        expected = item_key(index, sharded=sharded)
    except InvalidName as e:
        raise FormatError(f"{where}: {entry}: no valid item key: {e}") from e
    if key != expected:
        raise FormatError(f"{where}: {entry} names item {key!r}, expected item {expected!r}")


def _check_tiling(fqn: str, md: TensorStorageMetadata, where: str) -> None:
    """The chunks of tensor ``fqn`` cover its size exactly once (no gap, no overlap)."""
    size = tuple(md.size)
    total = math.prod(size)
    boxes = []
    for c in md.chunks:
        start, extent = tuple(c.offsets), tuple(c.sizes)
        if len(start) != len(size) or len(extent) != len(size):
            raise FormatError(
                f"{where}: DCP tensor {fqn!r}: chunk at {list(start)} does not have the {len(size)} dims "
                f"of the tensor size {list(size)}"
            )
        if any(o + s > t for o, s, t in zip(start, extent, size, strict=True)):
            raise FormatError(
                f"{where}: DCP tensor {fqn!r}: chunk at {list(start)} with sizes {list(extent)} "
                f"overruns the tensor size {list(size)}"
            )
        if math.prod(extent):
            boxes.append((start, extent))
    covered = sum(math.prod(extent) for _, extent in boxes)
    if covered != total:
        raise FormatError(
            f"{where}: DCP tensor {fqn!r} of size {list(size)}: its chunks hold {covered} elements, "
            f"the tensor {total}"
        )
    pair = _overlap(boxes) if len(boxes) > 1 else None
    if pair is not None:
        a, b = pair
        raise FormatError(
            f"{where}: DCP tensor {fqn!r}: chunks at {list(a[0])} (sizes {list(a[1])}) and "
            f"{list(b[0])} (sizes {list(b[1])}) overlap"
        )


_Box = tuple[tuple[int, ...], tuple[int, ...]]


def _overlap(boxes: list[_Box]) -> tuple[_Box, _Box] | None:
    """Two boxes that overlap, or None: a sweep along the dim that separates the most boxes."""
    dims = len(boxes[0][0])
    if dims == 0:
        return (boxes[0], boxes[1])
    axis = max(range(dims), key=lambda d: len({b[0][d] for b in boxes}))
    ordered = sorted(boxes, key=lambda b: b[0][axis])
    for i, (start, extent) in enumerate(ordered):
        end = start[axis] + extent[axis]
        for other in ordered[i + 1 :]:
            if other[0][axis] >= end:
                break
            (o_start, o_extent) = other
            if all(
                start[d] < o_start[d] + o_extent[d] and o_start[d] < start[d] + extent[d] for d in range(dims)
            ):
                return ((start, extent), other)
    return None
