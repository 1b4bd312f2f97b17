"""DCP ``Metadata`` <-> JSON: exact round trips of real ``dcp.save`` output, and strict rejection."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from shoal.errors import FormatError, ShoalError, UnsupportedFormat
from shoal.format.dcp_codec import (
    CODEC,
    MAX_DEPTH,
    decode_metadata,
    decode_metadata_json,
    encode_metadata,
    encode_metadata_json,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
]
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32"):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        DTYPES.append(getattr(torch, _name))


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32).to(dtype)


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo process group (what DeviceMesh and a distributed ``dcp.save`` need)."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved_metadata(one_rank_group: None, tmp_path_factory: pytest.TempPathFactory) -> Metadata:
    """The ``Metadata`` of a real ``dcp.save`` of a varied state dict, read back from ``.metadata``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0])
    state: dict[str, Any] = {f"dtypes.{str(d).removeprefix('torch.')}": _tensor(d, (3, 2)) for d in DTYPES}
    state.update(
        {
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 5),
            "blob": b"\x00\x01opaque",
            "step": 7,
            "name": "run-42",
            "nested": {"inner": {"w": torch.ones(4)}, "seq": [torch.ones(1), 5, "x"]},
            "dtensor": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]),
            "model.layers.0.weight": torch.randn(8, 4),
        }
    )
    root = tmp_path_factory.mktemp("dcp")
    dcp.save(state, storage_writer=FileSystemWriter(root))
    return FileSystemReader(root).read_metadata()


def _sharded_tensor_entry() -> tuple[TensorStorageMetadata, dict[MetadataIndex, Any]]:
    """What a 4-rank ShardedTensor of shape [8, 6] looks like in DCP metadata (2 x 2 grid)."""
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size([r, c]), sizes=torch.Size([4, 3]))
        for r in (0, 4)
        for c in (0, 3)
    ]
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    storage = TensorStorageMetadata(properties=props, size=torch.Size([8, 6]), chunks=chunks)
    data: dict[MetadataIndex, Any] = {
        MetadataIndex("st", c.offsets, i): _StorageInfo(f"__{i}_0.distcp", 0, 48)
        for i, c in enumerate(chunks)
    }
    return storage, data


def _roundtrip(md: Metadata) -> Metadata:
    text = json.dumps(encode_metadata(md), allow_nan=False)
    return decode_metadata(json.loads(text))


def _assert_same_metadata(a: Metadata, b: Metadata) -> None:
    assert a.version == b.version
    assert a.planner_data == b.planner_data
    assert a.storage_meta == b.storage_meta
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    for fqn, storage in a.state_dict_metadata.items():
        other = b.state_dict_metadata[fqn]
        assert type(other) is type(storage), fqn
        assert other == storage, fqn
        if isinstance(storage, TensorStorageMetadata):
            assert isinstance(other, TensorStorageMetadata)
            assert type(other.size) is torch.Size
            assert other.properties.dtype is storage.properties.dtype
            assert all(type(c.offsets) is torch.Size and type(c.sizes) is torch.Size for c in other.chunks)
    if a.storage_data is None:
        assert b.storage_data is None
        return
    assert list(a.storage_data) == list(b.storage_data)
    for (ka, va), (kb, vb) in zip(a.storage_data.items(), b.storage_data.items(), strict=True):
        assert (ka.fqn, ka.offset, ka.index) == (kb.fqn, kb.offset, kb.index)
        assert type(va) is type(vb)
        assert va == vb
    assert a == b


# --- round trips ---------------------------------------------------------------------------------


def test_real_dcp_save_metadata_round_trips_exactly(saved_metadata: Metadata) -> None:
    md = saved_metadata
    assert isinstance(md.storage_data, dict) and md.storage_data
    assert all(isinstance(v, _StorageInfo) for v in md.storage_data.values())
    _assert_same_metadata(md, _roundtrip(md))
    _assert_same_metadata(md, decode_metadata_json(encode_metadata_json(md)))


def test_real_dcp_save_covers_the_interesting_entries(saved_metadata: Metadata) -> None:
    sdm = saved_metadata.state_dict_metadata
    back = _roundtrip(saved_metadata).state_dict_metadata
    for d in DTYPES:
        entry = back[f"dtypes.{str(d).removeprefix('torch.')}"]
        assert isinstance(entry, TensorStorageMetadata) and entry.properties.dtype is d
    scalar = back["scalar"]
    assert isinstance(scalar, TensorStorageMetadata) and scalar.size == torch.Size([])
    assert scalar.chunks == [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
    empty = back["empty"]
    assert isinstance(empty, TensorStorageMetadata) and empty.size == torch.Size([0, 5])
    for fqn in ("blob", "step", "name", "nested.seq.1", "nested.seq.2"):
        assert type(sdm[fqn]) is BytesStorageMetadata and type(back[fqn]) is BytesStorageMetadata
    dtensor = back["dtensor"]
    assert isinstance(dtensor, TensorStorageMetadata) and dtensor.size == torch.Size([4, 3])
    # DefaultSavePlanner's planner_data maps flattened fqns to tuple paths holding str and int.
    assert _roundtrip(saved_metadata).planner_data["nested.seq.1"] == ("nested", "seq", 1)


def test_storage_meta_checkpoint_id_keeps_its_type() -> None:
    for ckpt in ("/ckpt/step-1", pathlib.Path("/ckpt/step-1"), None):
        md = Metadata({}, storage_meta=StorageMeta(checkpoint_id=ckpt, save_id="s", modules=["a", "b"]))
        back = _roundtrip(md)
        assert back.storage_meta is not None
        assert back.storage_meta.checkpoint_id == ckpt
        assert type(back.storage_meta.checkpoint_id) is type(ckpt) or isinstance(ckpt, pathlib.Path)
        assert back == md


def test_sharded_tensor_chunks_and_storage_infos_round_trip() -> None:
    storage, data = _sharded_tensor_entry()
    data[MetadataIndex("blob")] = _StorageInfo("sub/__0_1.distcp", 96, 7, transform_descriptors=["zstd"])
    md = Metadata({"st": storage, "blob": BytesStorageMetadata()}, planner_data=None, storage_data=data)
    back = _roundtrip(md)
    _assert_same_metadata(md, back)
    assert back.storage_data is not None
    assert [k.index for k in back.storage_data] == [0, 1, 2, 3, None]
    assert back.storage_data[MetadataIndex("blob")].transform_descriptors == ["zstd"]


def test_shoal_storage_data_plain_string_values_and_tuple_planner_data() -> None:
    storage, _ = _sharded_tensor_entry()
    data: dict[MetadataIndex, Any] = {MetadataIndex("st", [0, 0], 0): "st@0,0", MetadataIndex("x"): "x"}
    planner = {"st": ("st",), "opt.state.0.exp_avg": ("opt", "state", 0, "exp_avg")}
    md = Metadata({"st": storage, "x": BytesStorageMetadata()}, planner_data=planner, storage_data=data)
    back = _roundtrip(md)
    _assert_same_metadata(md, back)
    assert back.planner_data == planner and type(back.planner_data["st"]) is tuple


def test_encoding_is_deterministic_ascii_json(saved_metadata: Metadata) -> None:
    first = encode_metadata_json(saved_metadata)
    assert first == encode_metadata_json(saved_metadata)
    assert first.isascii()
    assert json.loads(first)["codec"] == CODEC


def test_unknown_extra_fields_are_dropped_when_this_torch_lacks_them() -> None:
    storage, data = _sharded_tensor_entry()
    md = Metadata({"st": storage}, storage_data=data, storage_meta=StorageMeta())
    obj = encode_metadata(md)
    obj["extra"] = {"future_field": {"tuple": [1, 2]}}
    obj["storage_meta"]["extra"] = {"future_meta": "x"}
    obj["storage_data"][0]["value"]["storage_info"]["extra"] = {"future_info": 3}
    obj["state_dict_metadata"]["st"]["properties"]["extra"] = {"future_prop": True}
    assert decode_metadata(obj) == md


def test_extra_may_not_shadow_a_known_field() -> None:
    obj = encode_metadata(Metadata({}))
    obj["extra"] = {"planner_data": 1}
    with pytest.raises(FormatError, match="extra"):
        decode_metadata(obj)


def test_metadata_without_newer_optional_fields_still_encodes() -> None:
    md = Metadata({}, planner_data=None, storage_data=None, storage_meta=None)
    obj = encode_metadata(md)
    assert obj["version"] is None and obj["storage_meta"] is None and obj["storage_data"] is None
    assert "extra" not in obj
    assert decode_metadata(obj) == md


# --- malformed input -----------------------------------------------------------------------------


@pytest.fixture
def good() -> dict[str, Any]:
    storage, data = _sharded_tensor_entry()
    md = Metadata(
        {"st": storage, "blob": BytesStorageMetadata()},
        planner_data={"st": ("st",), "blob": ("blob",)},
        storage_data=data | {MetadataIndex("blob"): "blob"},
        storage_meta=StorageMeta(checkpoint_id="/ckpt", save_id="s"),
        version="1.0.0",
    )
    return encode_metadata(md)


def _broken(good: dict[str, Any], edit: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    obj = copy.deepcopy(good)
    edit(obj)
    return obj


@pytest.mark.parametrize(
    "codec", [None, 1, "json", "shoal-dcp/0", "shoal-dcp/01", "shoal-dcp/1.0", "SHOAL-DCP/1"]
)
def test_wrong_codec_is_format_error(good: dict[str, Any], codec: object) -> None:
    good["codec"] = codec
    with pytest.raises(FormatError, match="codec") as info:
        decode_metadata(good)
    assert not isinstance(info.value, UnsupportedFormat)


def test_missing_codec_is_format_error(good: dict[str, Any]) -> None:
    del good["codec"]
    with pytest.raises(FormatError, match="codec"):
        decode_metadata(good)


def test_newer_codec_major_is_unsupported_format(good: dict[str, Any]) -> None:
    good["codec"] = "shoal-dcp/2"
    good["something_new"] = {}
    with pytest.raises(UnsupportedFormat, match="upgrade"):
        decode_metadata(good)


def _del(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], object]:
    def edit(obj: dict[str, Any]) -> None:
        target: Any = obj
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]

    return edit


def _set(path: tuple[Any, ...], value: object) -> Callable[[dict[str, Any]], object]:
    def edit(obj: dict[str, Any]) -> None:
        target: Any = obj
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value

    return edit


ST = ("state_dict_metadata", "st")
SD0 = ("storage_data", 0)

MALFORMED: list[tuple[str, Callable[[dict[str, Any]], object], str]] = [
    ("missing planner_data", _del(("planner_data",)), r"<top level>: missing field 'planner_data'"),
    ("missing version", _del(("version",)), "missing field 'version'"),
    ("unknown top field", _set(("surprise",), 1), "unexpected field 'surprise'"),
    ("state not object", _set(("state_dict_metadata",), []), "state_dict_metadata: expected an object"),
    ("missing dtype", _del((*ST, "properties", "dtype")), r"\['st'\]\.properties: missing field 'dtype'"),
    ("missing chunks", _del((*ST, "chunks")), r"\['st'\]: missing field 'chunks'"),
    ("unknown storage type", _set((*ST, "type"), "sparse"), r"\['st'\]\.type"),
    ("size as string", _set((*ST, "size"), "8x6"), r"\['st'\]\.size: expected a list"),
    ("negative size", _set((*ST, "size"), [8, -6]), r"\['st'\]\.size"),
    ("bool in size", _set((*ST, "size"), [True, 6]), r"\['st'\]\.size"),
    ("float in offsets", _set((*ST, "chunks", 0, "offsets"), [0.0, 0]), r"chunks\[0\]\.offsets"),
    ("requires_grad int", _set((*ST, "properties", "requires_grad"), 1), r"properties\.requires_grad"),
    ("dims mismatch", _set((*ST, "chunks", 1, "sizes"), [4]), r"chunks\[1\]\.sizes: has 1 dims"),
    ("chunk overruns", _set((*ST, "chunks", 3, "sizes"), [5, 3]), r"chunks\[3\]: .*overruns"),
    ("chunk not object", _set((*ST, "chunks", 0), [0, 0]), r"chunks\[0\]: expected an object"),
    ("layout as dtype", _set((*ST, "properties", "dtype"), "strided"), "unknown torch.dtype name 'strided'"),
    ("made-up dtype", _set((*ST, "properties", "dtype"), "float33"), "unknown torch.dtype name 'float33'"),
    ("dunder dtype", _set((*ST, "properties", "dtype"), "__class__"), "unknown torch.dtype"),
    ("module as dtype", _set((*ST, "properties", "dtype"), "nn"), "unknown torch.dtype"),
    ("dtype not str", _set((*ST, "properties", "dtype"), 5), "properties.dtype"),
    ("bad layout", _set((*ST, "properties", "layout"), "float32"), "unknown torch.layout"),
    ("bad memory_format", _set((*ST, "properties", "memory_format"), "nhwc"), "unknown torch.memory_format"),
    ("storage_data dict", _set(("storage_data",), {}), "storage_data: expected a list"),
    ("missing fqn", _del((*SD0, "fqn")), r"storage_data\[0\]: missing field 'fqn'"),
    ("fqn not str", _set((*SD0, "fqn"), 3), r"storage_data\[0\]\.fqn"),
    ("negative index", _set((*SD0, "index"), -1), r"storage_data\[0\]\.index"),
    ("offset not list", _set((*SD0, "offset"), "0,0"), r"storage_data\[0\]\.offset"),
    ("duplicate entry", _set((*SD0, "offset"), [4, 3]), r"storage_data\[3\]: duplicate entry"),
    ("dotdot path", _set((*SD0, "value", "storage_info", "relative_path"), "../x"), r"relative_path"),
    ("absolute path", _set((*SD0, "value", "storage_info", "relative_path"), "/etc/x"), r"relative_path"),
    ("nul path", _set((*SD0, "value", "storage_info", "relative_path"), "a\x00b"), r"relative_path"),
    ("negative length", _set((*SD0, "value", "storage_info", "length"), -1), r"value\.length"),
    ("descriptor int", _set((*SD0, "value", "storage_info", "transform_descriptors"), [1]), "transform"),
    ("info missing field", _del((*SD0, "value", "storage_info", "offset")), "missing field 'offset'"),
    ("unknown tag", _set(("planner_data",), {"set": [1, 2]}), "planner_data: unknown type tag"),
    ("two tags", _set(("planner_data",), {"tuple": [], "dict": {}}), "planner_data: expected"),
    ("tuple body", _set(("planner_data",), {"tuple": "ab"}), "planner_data: unknown type tag"),
    ("bad float tag", _set(("planner_data",), {"float": "1.5"}), "planner_data: unknown type tag"),
    ("raw nan", _set(("planner_data",), [math.nan]), r"planner_data\[0\]: non-finite"),
    ("raw inf", _set(("planner_data",), {"dict": {"a": math.inf}}), r"planner_data\['a'\]: non-finite"),
    ("bad pair", _set(("planner_data",), {"pairs": [[1]]}), r"pairs\[0\]"),
    ("unhashable key", _set(("planner_data",), {"pairs": [[[1], 2]]}), "not hashable"),
    ("duplicate pair key", _set(("planner_data",), {"pairs": [[1, 2], [1, 3]]}), "duplicate dict key 1"),
    ("size tag body", _set(("planner_data",), {"size": [-1]}), r"planner_data\.size"),
    ("meta modules", _set(("storage_meta", "modules"), "m"), r"storage_meta\.modules"),
    ("meta save_id", _set(("storage_meta", "save_id"), 5), r"storage_meta\.save_id"),
    ("meta ckpt path", _set(("storage_meta", "checkpoint_id"), {"path": 1}), r"checkpoint_id\.path"),
    ("meta missing", _del(("storage_meta", "load_id")), "storage_meta: missing field 'load_id'"),
    ("version int", _set(("version",), 1), "version: expected a string"),
    ("extra not object", _set(("extra",), [1]), r"<top level>\.extra: expected an object"),
]


@pytest.mark.parametrize(("edit", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_input_is_format_error_naming_the_field(
    good: dict[str, Any], edit: Callable[[dict[str, Any]], object], message: str
) -> None:
    decode_metadata(good)  # the unedited document is fine
    with pytest.raises(FormatError, match=message) as info:
        decode_metadata(_broken(good, edit))
    assert not isinstance(info.value, UnsupportedFormat)
    assert str(info.value).startswith("dcp metadata: ")


@pytest.mark.parametrize("top", [None, [], "codec", 1.0])
def test_top_level_must_be_an_object(top: object) -> None:
    with pytest.raises(FormatError, match="<top level>"):
        decode_metadata(top)


def test_depth_bomb_in_decoded_value_is_refused(good: dict[str, Any]) -> None:
    deep: Any = 0
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    good["planner_data"] = deep
    with pytest.raises(FormatError, match="deeper than"):
        decode_metadata(good)


def test_depth_bomb_in_json_text_is_format_error() -> None:
    with pytest.raises(FormatError, match="not valid JSON"):
        decode_metadata_json(b"[" * 100_000 + b"]" * 100_000)


def test_depth_bomb_is_refused_when_encoding() -> None:
    deep: Any = "leaf"
    for _ in range(MAX_DEPTH + 5):
        deep = {"k": deep}
    with pytest.raises(FormatError, match="deeper than"):
        encode_metadata(Metadata({}, planner_data=deep))


def test_just_under_the_depth_limit_round_trips() -> None:
    deep: Any = "leaf"
    for _ in range(MAX_DEPTH):
        deep = [deep]
    md = Metadata({}, planner_data=deep)
    assert decode_metadata_json(encode_metadata_json(md)) == md


def test_duplicate_json_keys_are_refused(good: dict[str, Any]) -> None:
    text = json.dumps(good)
    doubled = text.replace('"version": "1.0.0"', '"version": "1.0.0", "version": "9"')
    assert doubled != text
    with pytest.raises(FormatError, match="duplicate JSON object key 'version'"):
        decode_metadata_json(doubled)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_json_numbers_are_refused(good: dict[str, Any], literal: str) -> None:
    text = json.dumps(good | {"planner_data": "PLACEHOLDER"}).replace('"PLACEHOLDER"', f"[{literal}]")
    with pytest.raises(FormatError, match="planner_data|literal"):
        decode_metadata_json(text)


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe\x00garbage", b'{"codec": "shoal-dcp/1",}', "[1, 2"])
def test_truncated_or_garbage_json_is_format_error(data: bytes | str) -> None:
    with pytest.raises(FormatError):
        decode_metadata_json(data)


def test_errors_share_the_shoal_root_and_value_error(good: dict[str, Any]) -> None:
    good["codec"] = "shoal-dcp/9"
    with pytest.raises(ShoalError):
        decode_metadata(good)
    with pytest.raises(ValueError):
        decode_metadata_json(b"{")


# --- refusing to encode what would need pickle ---------------------------------------------------


def test_encoder_refuses_unsafe_storage_info_paths() -> None:
    for bad in ("../evil.distcp", "/abs.distcp", "a/../../b"):
        md = Metadata({}, storage_data={MetadataIndex("x"): _StorageInfo(bad, 0, 1)})
        with pytest.raises(FormatError, match=r"storage_data\[0\]\.value\.relative_path"):
            encode_metadata(md)


def test_encoder_refuses_malformed_tensor_metadata() -> None:
    props = TensorProperties(dtype=torch.float32)
    overrun = TensorStorageMetadata(
        props, torch.Size([4]), [ChunkStorageMetadata(torch.Size([2]), torch.Size([3]))]
    )
    with pytest.raises(FormatError, match=r"\['w'\]\.chunks\[0\]: .*overruns"):
        encode_metadata(Metadata({"w": overrun}))
    bad_flag = TensorStorageMetadata(dataclasses.replace(props, requires_grad=1), torch.Size([1]), [])  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=r"properties\.requires_grad"):
        encode_metadata(Metadata({"w": bad_flag}))
    with pytest.raises(FormatError, match="state_dict_metadata key"):
        encode_metadata(Metadata({1: BytesStorageMetadata()}))  # type: ignore[dict-item]
    with pytest.raises(FormatError, match="storage_data"):
        encode_metadata(Metadata({}, storage_data={"x": "y"}))
    with pytest.raises(FormatError, match="<top level>"):
        encode_metadata({"state_dict_metadata": {}})  # type: ignore[arg-type]


def _json_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out: list[tuple[Any, ...]] = []
    for key, child in children:
        out.append((*prefix, key))
        out.extend(_json_paths(child, (*prefix, key)))
    return out


_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_TAGS = st.sampled_from(["tuple", "dict", "pairs", "size", "float", "storage_info", "type", "extra", "path"])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_edit_of_encoded_metadata_decodes_or_is_a_format_error(data: st.DataObject) -> None:
    """Deleting, replacing or renaming any field of real encoded metadata: a Metadata or a FormatError."""
    storage, entries = _sharded_tensor_entry()
    md = Metadata(
        {"st": storage, "blob": BytesStorageMetadata()},
        planner_data={"st": ("st",), "blob": ("blob",), 3: torch.Size([1]), "nan": math.nan},
        storage_data=entries | {MetadataIndex("blob"): "blob"},
        storage_meta=StorageMeta(checkpoint_id=pathlib.Path("/ckpt"), save_id="s"),
        version="1.0.0",
    )
    doc = encode_metadata(md)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _json_paths(doc)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent: Any = doc
        for p in path[:-1]:
            parent = parent[p]
        op = data.draw(st.sampled_from(["delete", "replace", "rename"]))
        if op == "delete":
            del parent[path[-1]]
        elif op == "rename" and isinstance(parent, dict):
            parent[data.draw(_TAGS | st.text(max_size=4))] = parent.pop(path[-1])
        else:
            parent[path[-1]] = data.draw(_ANY_JSON | _TAGS)
    try:
        decoded = decode_metadata(doc)
    except FormatError as e:
        assert str(e).startswith("dcp metadata: ")
    else:
        assert isinstance(decoded, Metadata)
