"""A manifest against its own DCP metadata: kind, dtype, shape, size and coverage must agree."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shoal.errors import FormatError, ShoalError
from shoal.format.crosscheck import check_against_dcp, check_metadata, item_dtype, item_key
from shoal.format.dcp_codec import encode_metadata
from shoal.format.manifest import ItemRecord, Manifest

_DIGEST = "ab" * 32


def _tensor(
    dtype: torch.dtype, size: list[int], chunks: list[tuple[list[int], list[int]]]
) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=dtype),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def _rec(
    key: str, dtype: torch.dtype | None, shape: list[int] | None, nbytes: int | None = None
) -> ItemRecord:
    if dtype is None:
        return ItemRecord(key, 0, "bytes", nbytes or 100, (_DIGEST,))
    assert shape is not None
    size = nbytes if nbytes is not None else torch.Size(shape).numel() * dtype.itemsize
    return ItemRecord(key, 0, "tensor", size, (_DIGEST,), str(dtype).removeprefix("torch."), tuple(shape))


@dataclasses.dataclass
class Case:
    """A consistent manifest's parts: DCP state_dict_metadata, storage_data, shoal items; mutable."""

    state: dict[str, Any]
    storage: dict[MetadataIndex, Any] | None
    items: dict[str, ItemRecord]

    def manifest(self, *, encode: bool = True) -> Manifest:
        md = Metadata(state_dict_metadata=self.state, storage_data=self.storage)
        return Manifest(
            job="job",
            step=7,
            created=0.0,
            chunk_size=1 << 20,
            items=self.items,
            locations={},
            packs={},
            dcp=encode_metadata(md) if encode else None,
        )


def _good() -> Case:
    return Case(
        state={
            "w": _tensor(torch.float32, [4, 3], [([0, 0], [4, 3])]),
            "emb": _tensor(torch.int64, [4, 5], [([0, 0], [2, 5]), ([2, 0], [2, 5])]),
            "s": _tensor(torch.bfloat16, [], [([], [])]),
            "empty": _tensor(torch.float16, [0, 4], [([0, 0], [0, 4])]),
            "opt": BytesStorageMetadata(),
        },
        storage={
            MetadataIndex("w", [0, 0]): "w",
            MetadataIndex("emb", [0, 0]): "emb@0_0",
            MetadataIndex("emb", [2, 0]): "emb@2_0",
            MetadataIndex("s", []): "s",
            MetadataIndex("empty", [0, 0]): "empty",
            MetadataIndex("opt"): "opt",
        },
        items={
            "w": _rec("w", torch.float32, [4, 3]),
            "emb@0_0": _rec("emb@0_0", torch.int64, [2, 5]),
            "emb@2_0": _rec("emb@2_0", torch.int64, [2, 5]),
            "s": _rec("s", torch.bfloat16, []),
            "empty": _rec("empty", torch.float16, [0, 4]),
            "opt": _rec("opt", None, None),
        },
    )


def _refused(case: Case, *fragments: str) -> FormatError:
    with pytest.raises(FormatError) as info:
        check_against_dcp(case.manifest())
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    assert "step 7" in str(info.value)
    return info.value


def test_a_consistent_manifest_passes() -> None:
    check_against_dcp(_good().manifest())


def test_a_manifest_without_dcp_metadata_has_nothing_to_check() -> None:
    check_against_dcp(dataclasses.replace(_good().manifest(), dcp=None))


def test_item_dtype_disagreeing_with_dcp_is_refused_naming_both() -> None:
    case = _good()
    case.items["w"] = dataclasses.replace(case.items["w"], dtype="int32")
    _refused(case, "item 'w'", "int32", "float32")


def test_dcp_dtype_disagreeing_with_the_item_is_refused() -> None:
    case = _good()
    case.state["w"] = _tensor(torch.int32, [4, 3], [([0, 0], [4, 3])])
    _refused(case, "item 'w'", "dtype float32", "int32")


def test_unknown_item_dtype_is_refused() -> None:
    case = _good()
    case.items["w"] = dataclasses.replace(case.items["w"], dtype="float33")
    _refused(case, "item 'w'", "float33")


@pytest.mark.parametrize(
    ("key", "shape"), [("w", (3, 4)), ("w", (12,)), ("emb@2_0", (2, 4)), ("s", (1,)), ("empty", (4, 0))]
)
def test_item_shape_disagreeing_with_dcp_is_refused(key: str, shape: tuple[int, ...]) -> None:
    case = _good()
    case.items[key] = dataclasses.replace(case.items[key], shape=shape)
    _refused(case, f"item {key!r}", "shape", str(list(shape)))


@pytest.mark.parametrize("nbytes", [0, 47, 49, 96])
def test_item_size_disagreeing_with_dtype_and_shape_is_refused(nbytes: int) -> None:
    case = _good()
    case.items["w"] = dataclasses.replace(case.items["w"], nbytes=nbytes)
    _refused(case, "item 'w'", f"{nbytes} bytes", "holds 48")


def test_tensor_entry_for_a_bytes_item_is_refused() -> None:
    case = _good()
    case.items["w"] = dataclasses.replace(case.items["w"], kind="bytes")
    _refused(case, "item 'w'", "kind 'bytes'", "'tensor'")


def test_bytes_entry_for_a_tensor_item_is_refused() -> None:
    case = _good()
    case.items["opt"] = _rec("opt", torch.uint8, [100])
    _refused(case, "item 'opt'", "kind 'tensor'", "'bytes'")


def test_storage_entry_pointing_at_another_item_of_the_same_shape_is_refused() -> None:
    case = _good()
    assert case.storage is not None
    case.storage[MetadataIndex("emb", [0, 0])] = "emb@2_0"  # same dtype and shape: would load silently
    _refused(case, "names item 'emb@2_0'", "expected item 'emb@0_0'")


def test_storage_entry_naming_an_item_the_manifest_lacks_is_refused() -> None:
    case = _good()
    assert case.storage is not None
    case.storage[MetadataIndex("w", [0, 0])] = "nope"
    _refused(case, "'nope'", "does not hold")


@pytest.mark.parametrize("value", [None, 3, ["w"]])
def test_storage_entry_that_is_not_an_item_key_is_refused(value: object) -> None:
    case = _good()
    assert case.storage is not None
    case.storage[MetadataIndex("w", [0, 0])] = value
    _refused(case, "'w'", "expected a shoal item key")


def test_storage_entry_for_an_fqn_dcp_does_not_describe_is_refused() -> None:
    case = _good()
    del case.state["w"]
    _refused(case, "'w'", "not in state_dict_metadata")


def test_storage_entry_at_offsets_of_no_saved_chunk_is_refused() -> None:
    case = _good()
    assert case.storage is not None
    del case.storage[MetadataIndex("emb", [2, 0])]
    case.storage[MetadataIndex("emb", [1, 0])] = "emb@1_0"
    case.items["emb@1_0"] = case.items.pop("emb@2_0")
    _refused(case, "'emb'", "no saved chunk at offsets [1, 0]")


def test_bytes_entry_with_offsets_is_refused() -> None:
    case = _good()
    assert case.storage is not None
    del case.storage[MetadataIndex("opt")]
    case.storage[MetadataIndex("opt", [0])] = "opt"
    _refused(case, "'opt'", "a bytes entry has no offsets")


@pytest.mark.parametrize("fqn", ["w", "emb", "opt"])
def test_dcp_entry_without_a_storage_entry_is_refused(fqn: str) -> None:
    case = _good()
    assert case.storage is not None
    gone = [ix for ix in case.storage if ix.fqn == fqn][-1]
    item = case.storage.pop(gone)
    del case.items[item]
    _refused(case, f"{fqn!r}", "no storage_data entry")


def test_storage_data_missing_altogether_is_refused() -> None:
    case = _good()
    case.storage = None
    _refused(case, "no storage_data entry")


def test_manifest_item_that_dcp_does_not_name_is_refused() -> None:
    case = _good()
    case.items["stray"] = _rec("stray", torch.float32, [1])
    _refused(case, "manifest item 'stray'", "not named")


def test_chunks_leaving_a_gap_are_refused() -> None:
    case = _good()
    case.state["emb"] = _tensor(torch.int64, [5, 5], [([0, 0], [2, 5]), ([2, 0], [2, 5])])
    _refused(case, "'emb'", "hold 20 elements, the tensor 25")


def test_overlapping_chunks_are_refused_even_when_the_volume_adds_up() -> None:
    case = _good()
    # rows [0, 2) and [1, 3) of 4: 20 elements in all, as many as the tensor, but row 1 twice, row 3 never
    case.state["emb"] = _tensor(torch.int64, [4, 5], [([0, 0], [2, 5]), ([1, 0], [2, 5])])
    assert case.storage is not None
    del case.storage[MetadataIndex("emb", [2, 0])]
    case.storage[MetadataIndex("emb", [1, 0])] = "emb@1_0"
    del case.items["emb@2_0"]
    case.items["emb@1_0"] = _rec("emb@1_0", torch.int64, [2, 5])
    _refused(case, "'emb'")


def test_item_key_of_a_whole_tensor_and_of_a_shard() -> None:
    assert item_key(MetadataIndex("a.b", torch.Size([0, 0])), sharded=False) == "a.b"
    assert item_key(MetadataIndex("a.b", torch.Size([4, 0])), sharded=True) == "a.b@4_0"
    assert item_key(MetadataIndex("opt"), sharded=True) == "opt"


def test_item_dtype_does_not_reach_torch_module_getattr() -> None:
    assert item_dtype("bfloat16", "k") is torch.bfloat16
    for name in ("Tensor", "__getattr__", "nn", None, "load"):
        with pytest.raises(FormatError, match="'k'"):
            item_dtype(name, "k")


def test_malformed_dcp_metadata_is_a_format_error() -> None:
    manifest = _good().manifest()
    assert manifest.dcp is not None
    bad = dict(manifest.dcp)
    del bad["storage_data"]
    with pytest.raises(FormatError, match="storage_data"):
        check_against_dcp(dataclasses.replace(manifest, dcp=bad))


@pytest.mark.timeout(300)  # the scale check: a check quadratic in shards takes hours here, a linear one
# seconds (an elapsed-time assertion broke on busy machines)
def test_thousands_of_shards_check_quickly() -> None:
    n = 20_000
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
        "emb": _tensor(torch.float32, [n, 8], [([i, 0], [1, 8]) for i in range(n)])
    }
    storage: dict[MetadataIndex, Any] = {MetadataIndex("emb", [i, 0]): f"emb@{i}_0" for i in range(n)}
    items = {f"emb@{i}_0": _rec(f"emb@{i}_0", torch.float32, [1, 8]) for i in range(n)}
    manifest = Case(state, storage, items).manifest(encode=False)
    md = Metadata(state_dict_metadata=state, storage_data=storage)
    check_metadata(manifest, md)  # passes: every shard of the metadata is in the manifest


def _blocks(rows: list[int], cols: list[int]) -> list[tuple[list[int], list[int]]]:
    """The grid of blocks cutting a tensor into row bands ``rows`` and column bands ``cols``."""
    out = []
    r0 = 0
    for r in rows:
        c0 = 0
        for c in cols:
            out.append(([r0, c0], [r, c]))
            c0 += c
        r0 += r
    return out


_bands = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(
    rows=_bands, cols=_bands, change=st.sampled_from(["none", "drop", "grow", "shift"]), which=st.integers(0)
)
def test_a_grid_of_chunks_passes_and_any_changed_block_is_refused(
    rows: list[int], cols: list[int], change: str, which: int
) -> None:
    size = [sum(rows), sum(cols)]
    blocks = _blocks(rows, cols)
    i = which % len(blocks)
    edit: dict[str, Callable[[list[int], list[int]], tuple[list[int], list[int]] | None]] = {
        "none": lambda o, s: (o, s),
        "drop": lambda o, s: None,
        "grow": lambda o, s: (o, [s[0] + 1, s[1]]),
        "shift": lambda o, s: ([o[0], o[1] + 1], s),
    }
    changed = edit[change](*blocks[i])
    kept = [b for j, b in enumerate(blocks) if j != i] + ([changed] if changed else [])
    md = _tensor(torch.float32, size, kept)
    storage: dict[MetadataIndex, Any] = {}
    items: dict[str, ItemRecord] = {}
    for o, s in kept:
        sharded = o != [0, 0] or s != size
        key = f"t@{o[0]}_{o[1]}" if sharded else "t"
        storage[MetadataIndex("t", o)] = key
        items[key] = _rec(key, torch.float32, s)
    manifest = Case({"t": md}, storage, items).manifest(encode=False)  # the encoder refuses overruns
    metadata = Metadata(state_dict_metadata={"t": md}, storage_data=storage)
    if change == "none":
        check_metadata(manifest, metadata)
    else:
        with pytest.raises(ShoalError):
            check_metadata(manifest, metadata)
