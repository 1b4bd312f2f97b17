"""MetadataEncoder: the same Metadata object with equal storage data gives the kept document; else anew."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shoal.format.dcp_codec import encode_metadata
from shoal.records.metacache import MetadataEncoder


def _metadata(n: int = 3) -> Metadata:
    sdm = {
        f"w{i}": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([4]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
        )
        for i in range(n)
    }
    md = Metadata(state_dict_metadata=sdm, planner_data={f"w{i}": (f"w{i}",) for i in range(n)})
    md.storage_data = {MetadataIndex(f"w{i}", (0,)): f"w{i}" for i in range(n)}
    return md


def test_the_same_object_with_equal_storage_data_gives_the_kept_document() -> None:
    enc = MetadataEncoder()
    md = _metadata()
    first = enc.encode(md)
    assert first == encode_metadata(md)
    md.storage_data = dict(md.storage_data)  # what finish() does: a new, equal dict
    assert enc.encode(md) is first and enc.reused == 1


def test_anything_else_is_encoded_anew() -> None:
    enc = MetadataEncoder()
    md = _metadata()
    first = enc.encode(md)
    md.storage_data = {**md.storage_data, MetadataIndex("w0", (0,)): "other"}
    second = enc.encode(md)
    assert second is not first and second == encode_metadata(md)
    twin = _metadata()  # equal, but another object: its parts may differ later
    assert enc.encode(twin) is not second
    md2 = dataclasses.replace(twin, planner_data={"w0": ("w0",)})
    assert enc.encode(md2) == encode_metadata(md2)
    md2.storage_data[MetadataIndex("w1", (0,))] = "changed in place"
    assert enc.encode(md2) == encode_metadata(md2)
    assert enc.reused == 0
