"""DCP's ``Metadata`` encoded to and from JSON, field by field; no pickle anywhere.

``encode_metadata`` turns a :class:`torch.distributed.checkpoint.metadata.Metadata` into a dict
of JSON natives with a fixed key order; ``decode_metadata`` is its exact, strict inverse: every
field is type-checked and any malformed input raises :class:`~shoal.errors.FormatError` naming
the path of the bad field. Layout (``"codec": "shoal-dcp/1"``)::

    {"codec": "shoal-dcp/1", "version": "1.0.0",
     "state_dict_metadata": {
        "w": {"type": "tensor",
              "properties": {"dtype": "bfloat16", "layout": "strided", "requires_grad": false,
                             "memory_format": "contiguous_format", "pin_memory": false},
              "size": [4, 3], "chunks": [{"offsets": [0, 0], "sizes": [4, 3]}]},
        "step": {"type": "bytes"}},
     "planner_data": {"dict": {"w": {"tuple": ["w"]}, "step": {"tuple": ["step"]}}},
     "storage_data": [{"fqn": "w", "offset": [0, 0], "index": 0,
                       "value": {"storage_info": {"relative_path": "__0_0.distcp", "offset": 0,
                                                  "length": 1577, "transform_descriptors": null}}}],
     "storage_meta": {"checkpoint_id": {"path": "/ckpt"}, "save_id": "…", "load_id": null,
                      "modules": []}}

Generic values (``planner_data``, ``storage_data`` values) are JSON scalars and lists as
themselves; every other value is a JSON object with exactly one key naming its type: ``tuple``,
``size`` (``torch.Size``), ``dict`` (string keys), ``pairs`` (any other keys), ``float`` (``nan``,
``inf``, ``-inf``) and ``storage_info`` (DCP's ``FileSystemWriter`` entry). Because a JSON object
is *always* a tag, a user dict holding a key such as ``"tuple"`` can never be mistaken for one.
Only exact types are accepted; anything else raises :class:`FormatError` rather than pickling.
Floats in the JSON must be finite (``NaN``/``Infinity`` literals and overflowing numbers are refused).

Torch versions differ in the fields of these dataclasses (``Metadata.version`` and
``StorageMeta.modules`` are recent). A field this codec does not know (a newer torch) is encoded as a
generic value under an optional ``"extra"`` object next to the known ones, and restored if the reading
torch has that field; a field the reading torch lacks (an older torch) is dropped, since that torch
could not hold it. Known fields the writing torch lacks are written with their defaults.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from shoal.errors import FormatError, UnsupportedFormat
from shoal.format.dcp_values import (
    EXTRA,
    MAX_DEPTH,
    check_chunk,
    construct,
    decode_value,
    dims,
    encode_extra,
    encode_value,
    exact_fields,
    expect,
    fail,
    is_dim,
    key_path,
    optional_str,
    show,
    str_list,
    torch_name,
    torch_object,
)

CODEC = "shoal-dcp/1"
"""Format tag written into every encoded ``Metadata``; decoders refuse newer majors."""

_CODEC_MAJOR = 1
_CODEC_RE = re.compile(r"shoal-dcp/([1-9][0-9]{0,5})")
_METADATA_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
_TOP_FIELDS = ("codec", *_METADATA_FIELDS)
_PROPERTY_FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
_STORAGE_FIELDS = ("properties", "size", "chunks")
_CHUNK_FIELDS = ("offsets", "sizes")
_STORAGE_META_FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


# --- Metadata ------------------------------------------------------------------------------------


def _encode_properties(props: object, path: str) -> dict[str, Any]:
    if type(props) is not TensorProperties:
        expect(path, "TensorProperties", props)
    for flag in ("requires_grad", "pin_memory"):
        if type(getattr(props, flag)) is not bool:
            expect(f"{path}.{flag}", "a bool", getattr(props, flag))
    properties = {
        "dtype": torch_name(props.dtype, torch.dtype, f"{path}.dtype"),
        "layout": torch_name(props.layout, torch.layout, f"{path}.layout"),
        "requires_grad": props.requires_grad,
        "memory_format": torch_name(props.memory_format, torch.memory_format, f"{path}.memory_format"),
        "pin_memory": props.pin_memory,
    }
    return properties | encode_extra(props, _PROPERTY_FIELDS, path)


def _decode_properties(obj: object, path: str) -> TensorProperties:
    props = exact_fields(obj, path, _PROPERTY_FIELDS, (EXTRA,))
    for flag in ("requires_grad", "pin_memory"):
        if type(props[flag]) is not bool:
            expect(f"{path}.{flag}", "a bool", props[flag])
    values = {
        "dtype": torch_object(props["dtype"], torch.dtype, f"{path}.dtype"),
        "layout": torch_object(props["layout"], torch.layout, f"{path}.layout"),
        "requires_grad": props["requires_grad"],
        "memory_format": torch_object(props["memory_format"], torch.memory_format, f"{path}.memory_format"),
        "pin_memory": props["pin_memory"],
    }
    return construct(TensorProperties, values, props, path)


def _encode_storage(value: object, path: str) -> dict[str, Any]:
    if type(value) is BytesStorageMetadata:
        return {"type": "bytes"} | encode_extra(value, (), path)
    if type(value) is not TensorStorageMetadata:
        expect(path, "TensorStorageMetadata or BytesStorageMetadata", value)
    properties = _encode_properties(value.properties, f"{path}.properties")
    size = dims(value.size, f"{path}.size", (torch.Size, tuple, list))
    if type(value.chunks) is not list:
        expect(f"{path}.chunks", "a list of ChunkStorageMetadata", value.chunks)
    chunks = []
    for i, chunk in enumerate(value.chunks):
        where = f"{path}.chunks[{i}]"
        if type(chunk) is not ChunkStorageMetadata:
            expect(where, "ChunkStorageMetadata", chunk)
        offsets = dims(chunk.offsets, f"{where}.offsets", (torch.Size, tuple, list))
        sizes = dims(chunk.sizes, f"{where}.sizes", (torch.Size, tuple, list))
        check_chunk(size, offsets, sizes, where)
        chunks.append({"offsets": offsets, "sizes": sizes} | encode_extra(chunk, _CHUNK_FIELDS, where))
    encoded = {"type": "tensor", "properties": properties, "size": size, "chunks": chunks}
    return encoded | encode_extra(value, _STORAGE_FIELDS, path)


def _decode_storage(obj: object, path: str) -> TensorStorageMetadata | BytesStorageMetadata:
    if type(obj) is dict and obj.get("type") == "bytes":
        fields = exact_fields(obj, path, ("type",), (EXTRA,))
        return construct(BytesStorageMetadata, {}, fields, path)
    fields = exact_fields(obj, path, ("type", *_STORAGE_FIELDS), (EXTRA,))
    if fields["type"] != "tensor":
        expect(f"{path}.type", "'tensor' or 'bytes'", fields["type"])
    properties = _decode_properties(fields["properties"], f"{path}.properties")
    size = dims(fields["size"], f"{path}.size", (list,))
    if type(fields["chunks"]) is not list:
        expect(f"{path}.chunks", "a list of chunks", fields["chunks"])
    chunks = []
    for i, chunk in enumerate(fields["chunks"]):
        where = f"{path}.chunks[{i}]"
        parts = exact_fields(chunk, where, _CHUNK_FIELDS, (EXTRA,))
        offsets = dims(parts["offsets"], f"{where}.offsets", (list,))
        sizes = dims(parts["sizes"], f"{where}.sizes", (list,))
        check_chunk(size, offsets, sizes, where)
        chunk_values = {"offsets": torch.Size(offsets), "sizes": torch.Size(sizes)}
        chunks.append(construct(ChunkStorageMetadata, chunk_values, parts, where))
    values: dict[str, Any] = {"properties": properties, "size": torch.Size(size), "chunks": chunks}
    return construct(TensorStorageMetadata, values, fields, path)


def _encode_storage_data(value: object) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if type(value) is not dict:
        expect("storage_data", "a dict keyed by MetadataIndex, or None", value)
    entries = []
    for i, (index, item) in enumerate(value.items()):
        where = f"storage_data[{i}]"
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            expect(f"{where} key", "a MetadataIndex with a string fqn", index)
        if index.index is not None and not is_dim(index.index):
            expect(f"{where}.index", "a non-negative int or None", index.index)
        offset = None if index.offset is None else dims(index.offset, f"{where}.offset", (torch.Size,))
        encoded = encode_value(item, f"{where}.value")
        entries.append({"fqn": index.fqn, "offset": offset, "index": index.index, "value": encoded})
    return entries


def _decode_storage_data(obj: object) -> dict[MetadataIndex, Any] | None:
    if obj is None:
        return None
    if type(obj) is not list:
        expect("storage_data", "a list of entries or null", obj)
    result: dict[MetadataIndex, Any] = {}
    for i, entry in enumerate(obj):
        where = f"storage_data[{i}]"
        fields = exact_fields(entry, where, ("fqn", "offset", "index", "value"))
        if type(fields["fqn"]) is not str:
            expect(f"{where}.fqn", "a string", fields["fqn"])
        index = fields["index"]
        if index is not None and not is_dim(index):
            expect(f"{where}.index", "a non-negative int or null", index)
        offset = None if fields["offset"] is None else dims(fields["offset"], f"{where}.offset", (list,))
        key = MetadataIndex(fields["fqn"], offset, index)
        if key in result:
            fail(where, f"duplicate entry for fqn {key.fqn!r} at offset {offset}")
        result[key] = decode_value(fields["value"], f"{where}.value")
    return result


def _encode_storage_meta(meta: object) -> dict[str, Any] | None:
    if meta is None:
        return None
    if type(meta) is not StorageMeta:
        expect("storage_meta", "a StorageMeta or None", meta)
    ckpt: Any = meta.checkpoint_id
    if isinstance(ckpt, os.PathLike):
        ckpt = {"path": os.fsdecode(ckpt)}
    elif ckpt is not None and type(ckpt) is not str:
        expect("storage_meta.checkpoint_id", "a string, an os.PathLike or None", ckpt)
    encoded = {
        "checkpoint_id": ckpt,
        "save_id": optional_str(getattr(meta, "save_id", None), "storage_meta.save_id"),
        "load_id": optional_str(getattr(meta, "load_id", None), "storage_meta.load_id"),
        "modules": str_list(getattr(meta, "modules", []), "storage_meta.modules"),
    }
    return encoded | encode_extra(meta, _STORAGE_META_FIELDS, "storage_meta")


def _decode_storage_meta(obj: object) -> StorageMeta | None:
    if obj is None:
        return None
    fields = exact_fields(obj, "storage_meta", _STORAGE_META_FIELDS, (EXTRA,))
    ckpt = fields["checkpoint_id"]
    checkpoint_id: str | pathlib.Path | None
    if type(ckpt) is dict:
        path = exact_fields(ckpt, "storage_meta.checkpoint_id", ("path",))["path"]
        if type(path) is not str:
            expect("storage_meta.checkpoint_id.path", "a string", path)
        checkpoint_id = pathlib.Path(path)
    else:
        checkpoint_id = optional_str(ckpt, "storage_meta.checkpoint_id")
    values = {
        "checkpoint_id": checkpoint_id,
        "save_id": optional_str(fields["save_id"], "storage_meta.save_id"),
        "load_id": optional_str(fields["load_id"], "storage_meta.load_id"),
        "modules": str_list(fields["modules"], "storage_meta.modules"),
    }
    return construct(StorageMeta, values, fields, "storage_meta")


def encode_metadata(md: Metadata) -> dict[str, Any]:
    """Encode DCP ``md`` as a dict of JSON natives (fixed key order, no NaN) for ``json.dumps``.

    Raises :class:`FormatError`, naming the field, for anything that cannot be represented
    without pickle (an arbitrary object in ``planner_data``, a non-``MetadataIndex`` storage key).
    """
    if type(md) is not Metadata:
        expect("<top level>", "a torch.distributed.checkpoint.metadata.Metadata", md)
    if type(md.state_dict_metadata) is not dict:
        expect("state_dict_metadata", "a dict", md.state_dict_metadata)
    state: dict[str, Any] = {}
    for fqn, storage in md.state_dict_metadata.items():
        if type(fqn) is not str:
            expect("state_dict_metadata key", "a string", fqn)
        state[fqn] = _encode_storage(storage, key_path("state_dict_metadata", fqn))
    encoded = {
        "codec": CODEC,
        "version": optional_str(getattr(md, "version", None), "version"),
        "state_dict_metadata": state,
        "planner_data": encode_value(md.planner_data, "planner_data"),
        "storage_data": _encode_storage_data(md.storage_data),
        "storage_meta": _encode_storage_meta(md.storage_meta),
    }
    return encoded | encode_extra(md, _METADATA_FIELDS, "<top level>")


def decode_metadata(obj: Any) -> Metadata:
    """Rebuild the ``Metadata`` that :func:`encode_metadata` encoded, validating every field.

    Raises :class:`UnsupportedFormat` for a newer codec major version and :class:`FormatError`
    (with the path of the bad field) for anything else malformed.
    """
    if type(obj) is not dict:
        expect("<top level>", "an object", obj)
    codec = obj.get("codec")
    match = _CODEC_RE.fullmatch(codec) if type(codec) is str else None
    if match is None:
        expect("codec", f"{CODEC!r}", codec)
    if int(match.group(1)) > _CODEC_MAJOR:
        raise UnsupportedFormat(
            f"dcp metadata: codec {codec!r} is newer than this shoal reads ({CODEC!r}); upgrade shoal"
        )
    fields = exact_fields(obj, "<top level>", _TOP_FIELDS, (EXTRA,))
    state = fields["state_dict_metadata"]
    if type(state) is not dict:
        expect("state_dict_metadata", "an object", state)
    state_dict_metadata = {}
    for fqn, storage in state.items():
        if type(fqn) is not str:
            expect("state_dict_metadata key", "a string", fqn)
        state_dict_metadata[fqn] = _decode_storage(storage, key_path("state_dict_metadata", fqn))
    values = {
        "state_dict_metadata": state_dict_metadata,
        "planner_data": decode_value(fields["planner_data"], "planner_data"),
        "storage_data": _decode_storage_data(fields["storage_data"]),
        "storage_meta": _decode_storage_meta(fields["storage_meta"]),
        "version": optional_str(fields["version"], "version"),
    }
    return construct(Metadata, values, fields, "<top level>")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise FormatError(f"dcp metadata: duplicate JSON object key {show(key)}")
        result[key] = value
    return result


def _reject_constant(name: str) -> NoReturn:
    raise FormatError(f"dcp metadata: JSON literal {name} is not allowed (non-finite floats are tagged)")


def encode_metadata_json(md: Metadata) -> bytes:
    """``encode_metadata`` serialised as compact ASCII JSON (strict: no NaN or Infinity literals).

    Non-ASCII characters are ``\\u`` escapes, so any Python string (even one holding a lone
    surrogate from ``os.fsdecode``) survives the round trip exactly.
    """
    return json.dumps(encode_metadata(md), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def decode_metadata_json(data: bytes | bytearray | str) -> Metadata:
    """Parse JSON text from :func:`encode_metadata_json` (duplicate keys refused) and decode it."""
    hook: Callable[[list[tuple[str, Any]]], dict[str, Any]] = _reject_duplicate_keys
    try:
        obj = json.loads(data, object_pairs_hook=hook, parse_constant=_reject_constant)
    except FormatError:
        raise
    except (ValueError, RecursionError, TypeError) as exc:
        raise FormatError(f"dcp metadata: not valid JSON text: {exc}") from exc
    return decode_metadata(obj)


__all__ = [
    "CODEC",
    "MAX_DEPTH",
    "decode_metadata",
    "decode_metadata_json",
    "encode_metadata",
    "encode_metadata_json",
]
