"""``shoal export --format dcp``: a checkpoint as a stock PyTorch DCP directory.

Written item by item from verified reads (the chunk fetcher, per contiguous run of a pack;
every chunk's BLAKE3 is checked before its bytes are used) into a local directory, in
exactly the layout torch's ``FileSystemWriter`` writes: one ``__<rank>_0.distcp`` per saving
rank holding each write item back to back (opaque objects as DCP's planner serialized them,
tensors with ``torch.save``), then
``.metadata`` (a pickled DCP ``Metadata`` whose ``storage_data`` maps every item to its
file, offset and length). ``torch.distributed.checkpoint.FileSystemReader(OUT_DIR)`` loads
it, with or without a process group, and ``dcp_to_torch_save`` converts it.
``.metadata`` is written last, through a temporary name, so an interrupted export is
never mistaken for a complete checkpoint. The pickle in ``.metadata`` is DCP's own
interchange format, written here only because stock readers require it; shoal's own
metadata stays JSON.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from shoal._torch_private import storage_info_class
from shoal.cli.source import item_tensor, output_dir, read_in_batches, storage_keys, write_durably
from shoal.errors import FormatError
from shoal.format.manifest import ItemRecord, Manifest
from shoal.records.store import ItemReader
from shoal.tiers.base import Tier

DCP_METADATA = ".metadata"
DCP_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"
"""``Metadata.version`` torch's ``FileSystemWriter`` writes (``CURRENT_DCP_VERSION``)."""


def _check_item_matches(index: MetadataIndex, rec: ItemRecord, md: Metadata) -> None:
    """A tensor write item's stored item must have the chunk's shape and the tensor's dtype."""
    meta = md.state_dict_metadata.get(index.fqn)
    if not isinstance(meta, TensorStorageMetadata):
        if rec.kind != "bytes":
            raise FormatError(
                f"DCP item {index.fqn!r} is an object but its stored item {rec.key!r} is a tensor"
            )
        return
    offsets = tuple(index.offset) if index.offset is not None else (0,) * len(meta.size)
    chunk = next((c for c in meta.chunks if tuple(c.offsets) == offsets), None)
    dtype = str(meta.properties.dtype).removeprefix("torch.")
    if (
        rec.kind != "tensor"
        or chunk is None
        or tuple(chunk.sizes) != tuple(rec.shape or ())
        or dtype != rec.dtype
    ):
        raise FormatError(
            f"DCP item {index.fqn!r} at offsets {list(offsets)} does not match its stored item {rec.key!r} "
            f"({rec.kind} {rec.dtype} {list(rec.shape or ())})"
        )


def export_dcp(
    tier: Tier,
    manifest: Manifest,
    md: Metadata,
    out_dir: Path,
    *,
    overwrite: bool = False,
    advance: Callable[[int], None] = lambda n: None,
) -> Path:
    """Write ``manifest``'s checkpoint as a stock DCP directory at ``out_dir``; return its ``.metadata``."""
    keys = storage_keys(manifest, md)
    for index, key in keys.items():
        _check_item_matches(index, manifest.items[key], md)
    # one file per saving rank, objects first then tensors, as FileSystemWriter lays them out
    by_rank: dict[int, list[str]] = {}
    for key in dict.fromkeys(keys.values()):
        by_rank.setdefault(manifest.items[key].rank, []).append(key)
    for group in by_rank.values():
        group.sort(key=lambda k: manifest.items[k].kind != "bytes")
    with output_dir(out_dir, [DCP_METADATA], overwrite=overwrite) as written:
        reader = ItemReader(tier, manifest)
        storage_info = storage_info_class()
        if storage_info is None:
            raise FormatError(f"torch {torch.__version__} has no DCP storage-info class to export with")
        infos: dict[str, Any] = {}
        for rank, group in sorted(by_rank.items()):
            name = f"__{rank}_0{DCP_SUFFIX}"
            written.append(out_dir / name)
            with open(out_dir / name, "wb") as f:
                for key, data in read_in_batches(reader, group):
                    rec = manifest.items[key]
                    offset = f.tell()
                    if rec.kind == "bytes":
                        f.write(data)
                    else:
                        torch.save(item_tensor(data, rec), f)
                    infos[key] = storage_info(name, offset, f.tell() - offset)
                    advance(rec.nbytes)
                f.flush()
                os.fsync(f.fileno())
        changes: dict[str, Any] = {
            "storage_data": {index: infos[key] for index, key in keys.items()},
            "storage_meta": StorageMeta(checkpoint_id=out_dir, save_id=str(uuid.uuid4())),
        }
        if any(f.name == "version" for f in dataclasses.fields(md)):
            changes["version"] = DCP_VERSION
        exported = dataclasses.replace(md, **changes)
        target = out_dir / DCP_METADATA
        written.append(target)
        write_durably(target, lambda f: pickle.dump(exported, f))
    return target
