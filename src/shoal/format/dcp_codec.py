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

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeGuard, TypeVar

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

from shoal.errors import FormatError, InvalidName, UnsupportedFormat
from shoal.format.names import check_relpath

CODEC = "shoal-dcp/1"
"""Format tag written into every encoded ``Metadata``; decoders refuse newer majors."""

MAX_DEPTH = 64
"""Deepest nesting of generic values (``planner_data``, ``storage_data``) accepted either way."""

_CODEC_MAJOR = 1
_CODEC_RE = re.compile(r"shoal-dcp/([1-9][0-9]{0,5})")
_TORCH_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_METADATA_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
_TOP_FIELDS = ("codec", *_METADATA_FIELDS)
_PROPERTY_FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
_STORAGE_FIELDS = ("properties", "size", "chunks")
_CHUNK_FIELDS = ("offsets", "sizes")
_STORAGE_META_FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")
_STORAGE_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
_EXTRA = "extra"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_MAX_DIM = 2**63 - 1
_T = TypeVar("_T")


def _fail(path: str, message: str) -> NoReturn:
    raise FormatError(f"dcp metadata: {path}: {message}")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expect(path: str, what: str, value: object) -> NoReturn:
    _fail(path, f"expected {what}, got {_show(value)}")


def _is_dim(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= _MAX_DIM


# --- torch enum-like objects (dtype, layout, memory_format) by name --------------------------------


def _torch_name(value: object, kind: type, path: str) -> str:
    """Name of a torch dtype/layout/memory_format, checked to resolve back to the same object."""
    if not isinstance(value, kind):
        _expect(path, f"a torch.{kind.__name__}", value)
    name = str(value).removeprefix("torch.")
    if not _TORCH_NAME_RE.fullmatch(name) or vars(torch).get(name) is not value:
        _fail(path, f"torch.{kind.__name__} {value} has no public name in torch")
    return name


def _torch_object(name: object, kind: type[_T], path: str) -> _T:
    """Look ``name`` up in torch's own namespace (no ``__getattr__``, no imports), checking its type."""
    if not isinstance(name, str):
        _expect(path, f"a torch.{kind.__name__} name", name)
    found = vars(torch).get(name) if _TORCH_NAME_RE.fullmatch(name) else None
    if not isinstance(found, kind):
        _fail(path, f"unknown torch.{kind.__name__} name {_show(name)}")
    return found


# --- shared validators ---------------------------------------------------------------------------


def _dims(value: object, path: str, types: tuple[type, ...]) -> list[int]:
    if not (isinstance(value, types) and isinstance(value, list | tuple) and all(_is_dim(d) for d in value)):
        _expect(path, "a list of non-negative ints", value)
    return list(value)


def _check_chunk(size: list[int], offsets: list[int], sizes: list[int], path: str) -> None:
    for field, dims in (("offsets", offsets), ("sizes", sizes)):
        if len(dims) != len(size):
            _fail(f"{path}.{field}", f"has {len(dims)} dims but the tensor size {size} has {len(size)}")
    if 0 not in sizes and any(o + s > t for o, s, t in zip(offsets, sizes, size, strict=True)):
        _fail(path, f"chunk at offsets {offsets} with sizes {sizes} overruns the tensor size {size}")


def _check_storage_info(relative_path: object, offset: object, length: object, path: str) -> None:
    try:
        check_relpath(relative_path)
    except InvalidName as exc:
        _fail(f"{path}.relative_path", str(exc))
    for field, value in (("offset", offset), ("length", length)):
        if not _is_dim(value):
            _expect(f"{path}.{field}", "a non-negative int", value)


def _check_descriptors(descriptors: object, path: str) -> None:
    if descriptors is None:
        return
    if type(descriptors) not in (list, tuple) or not isinstance(descriptors, list | tuple):
        _expect(f"{path}.transform_descriptors", "a list or tuple of strings, or null", descriptors)
    for i, descriptor in enumerate(descriptors):
        if type(descriptor) is not str:
            _expect(f"{path}.transform_descriptors[{i}]", "a string", descriptor)


def _str_list(value: object, path: str) -> list[str]:
    if type(value) is not list or not all(type(m) is str for m in value):
        _expect(path, "a list of strings", value)
    return list(value)


def _optional_str(value: object, path: str) -> str | None:
    if value is not None and not isinstance(value, str):
        _expect(path, "a string or null", value)
    return value


def _key_path(path: str, key: object) -> str:
    return f"{path}[{_show(key)}]"


# --- dataclass fields that differ between torch versions -----------------------------------------


def _fields(obj: object, path: str, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check ``obj`` is a JSON object with exactly the fields ``names`` (plus any of ``optional``)."""
    if type(obj) is not dict:
        _expect(path, "an object", obj)
    for name in names:
        if name not in obj:
            _fail(path, f"missing field {name!r}")
    for name in obj:
        if name not in names and name not in optional:
            _fail(path, f"unexpected field {_show(name)}")
    return obj


def _encode_extra(obj: object, known: tuple[str, ...], path: str, depth: int = 0) -> dict[str, Any]:
    """``{"extra": {...}}`` for the init fields of dataclass ``obj`` this codec does not know, or ``{}``."""
    extra = {
        f.name: _encode_value(getattr(obj, f.name), f"{path}.{f.name}", depth + 1)
        for f in dataclasses.fields(obj)  # type: ignore[arg-type]
        if f.init and f.name not in known
    }
    return {_EXTRA: extra} if extra else {}


def _construct(
    cls: Callable[..., _T], values: dict[str, Any], fields: dict[str, Any], path: str, depth: int = 0
) -> _T:
    """``cls(**values)`` plus the decoded ``"extra"`` of ``fields``, keeping only fields ``cls`` has."""
    extra = fields.get(_EXTRA, {})
    if type(extra) is not dict:
        _expect(f"{path}.{_EXTRA}", "an object", extra)
    accepted = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs = {name: value for name, value in values.items() if name in accepted}
    for name, value in extra.items():
        if name in values:
            _fail(f"{path}.{_EXTRA}", f"field {_show(name)} is not an extra field")
        decoded = _decode_value(value, f"{path}.{_EXTRA}[{_show(name)}]", depth + 1)
        if name in accepted:
            kwargs[name] = decoded
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        _fail(path, f"cannot rebuild {getattr(cls, '__name__', cls)}: {exc}")


# --- DCP's FileSystemWriter entry (a private torch class) -----------------------------------------


class _StorageInfoLike(Protocol):
    """What this codec reads of a ``storage_info`` value: the fields ``FileSystemReader`` reads."""

    relative_path: str
    offset: int
    length: int


@functools.cache
def _storage_info_class() -> type[Any] | None:
    """DCP's private ``torch.distributed.checkpoint.filesystem._StorageInfo``, or None if this torch lacks it.

    The one place shoal names that private class. ``FileSystemReader`` itself only reads the fields
    (``relative_path``, ``offset``, ``length``, ``transform_descriptors``), but the codec needs the
    class itself both ways round: the encoder accepts exactly that type (anything else would need
    pickle), and the decoder must rebuild an instance of it, so that decoded metadata equals the
    original (dataclass equality compares classes) and pickles, as DCP's own ``.metadata`` file does,
    to a class every torch reader has. torch has no public name for it. If a torch release drops it,
    metadata holding no such entries (all of shoal's own) still encodes and decodes; an encoded
    ``storage_info`` entry is then refused as a :class:`FormatError`.
    """
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError:
        return None
    if not dataclasses.is_dataclass(_StorageInfo):
        return None
    fields = {f.name for f in dataclasses.fields(_StorageInfo)}
    return _StorageInfo if set(_STORAGE_INFO_FIELDS[:3]) <= fields else None


# --- generic values ------------------------------------------------------------------------------


def _encode_storage_info(info: _StorageInfoLike, path: str, depth: int) -> dict[str, Any]:
    _check_storage_info(info.relative_path, info.offset, info.length, path)
    descriptors = getattr(info, "transform_descriptors", None)
    _check_descriptors(descriptors, path)
    fields = {
        "relative_path": info.relative_path,
        "offset": info.offset,
        "length": info.length,
        "transform_descriptors": _encode_value(descriptors, f"{path}.transform_descriptors", depth + 1),
    }
    return {"storage_info": fields | _encode_extra(info, _STORAGE_INFO_FIELDS, path, depth)}


def _decode_storage_info(body: object, path: str, depth: int) -> Any:
    cls = _storage_info_class()
    if cls is None:
        _fail(path, "this torch has no FileSystemWriter storage info (_StorageInfo) to rebuild the entry as")
    fields = _fields(body, f"{path}.storage_info", _STORAGE_INFO_FIELDS, (_EXTRA,))
    _check_storage_info(fields["relative_path"], fields["offset"], fields["length"], path)
    descriptors = _decode_value(fields["transform_descriptors"], f"{path}.transform_descriptors", depth + 1)
    _check_descriptors(descriptors, path)
    values = {
        "relative_path": fields["relative_path"],
        "offset": fields["offset"],
        "length": fields["length"],
        "transform_descriptors": descriptors,
    }
    return _construct(cls, values, fields, f"{path}.storage_info", depth)


def _encode_value(value: object, path: str, depth: int = 0) -> Any:
    """Encode a generic value (see the module docstring) into JSON natives."""
    if depth > MAX_DEPTH:
        _fail(path, f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float and isinstance(value, float):
        return value if math.isfinite(value) else {"float": str(value)}
    if kind is list and isinstance(value, list):
        return [_encode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if kind is torch.Size:
        return {"size": _dims(value, path, (torch.Size,))}
    if kind is tuple and isinstance(value, tuple):
        return {"tuple": [_encode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
    if kind is dict and isinstance(value, dict):
        items: dict[Any, Any] = value
        if all(type(k) is str for k in items):
            return {"dict": {k: _encode_value(v, _key_path(path, k), depth + 1) for k, v in items.items()}}
        pairs = [
            [
                _encode_value(k, f"{path}.keys()[{i}]", depth + 1),
                _encode_value(v, _key_path(path, k), depth + 1),
            ]
            for i, (k, v) in enumerate(items.items())
        ]
        return {"pairs": pairs}
    if kind is _storage_info_class():
        return _encode_storage_info(value, path, depth)  # type: ignore[arg-type]
    _fail(
        path,
        f"cannot encode a value of type {kind.__module__}.{kind.__qualname__} without pickle: {_show(value)}",
    )


def _decode_pairs(body: list[Any], path: str, depth: int) -> dict[Any, Any]:
    result: dict[Any, Any] = {}
    for i, pair in enumerate(body):
        if type(pair) is not list or len(pair) != 2:
            _expect(f"{path}.pairs[{i}]", "a [key, value] list", pair)
        key = _decode_value(pair[0], f"{path}.keys()[{i}]", depth + 1)
        try:
            duplicate = key in result
        except TypeError:
            _fail(f"{path}.keys()[{i}]", f"dict key {_show(key)} is not hashable")
        if duplicate:
            _fail(f"{path}.keys()[{i}]", f"duplicate dict key {_show(key)}")
        result[key] = _decode_value(pair[1], _key_path(path, key), depth + 1)
    return result


def _decode_value(obj: object, path: str, depth: int = 0) -> Any:
    """Inverse of :func:`_encode_value`, validating every tag and field."""
    if depth > MAX_DEPTH:
        _fail(path, f"nested deeper than {MAX_DEPTH} levels")
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if type(obj) is float and isinstance(obj, float):
        if not math.isfinite(obj):
            _fail(path, f"non-finite float {obj} must be written as {{'float': {str(obj)!r}}}")
        return obj
    if type(obj) is list:
        return [_decode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if type(obj) is not dict or len(obj) != 1:
        _expect(path, "a JSON scalar, a list, or an object with exactly one type tag", obj)
    ((tag, body),) = obj.items()
    if tag == "tuple" and type(body) is list:
        return tuple(_decode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(body))
    if tag == "size":
        return torch.Size(_dims(body, f"{path}.size", (list,)))
    if tag == "dict" and type(body) is dict and all(type(k) is str for k in body):
        return {k: _decode_value(v, _key_path(path, k), depth + 1) for k, v in body.items()}
    if tag == "pairs" and type(body) is list:
        return _decode_pairs(body, path, depth)
    if tag == "float" and type(body) is str and body in _NON_FINITE:
        return _NON_FINITE[body]
    if tag == "storage_info":
        return _decode_storage_info(body, path, depth)
    _fail(path, f"unknown type tag or malformed body: {_show(obj)}")


# --- Metadata ------------------------------------------------------------------------------------


def _encode_properties(props: object, path: str) -> dict[str, Any]:
    if type(props) is not TensorProperties:
        _expect(path, "TensorProperties", props)
    for flag in ("requires_grad", "pin_memory"):
        if type(getattr(props, flag)) is not bool:
            _expect(f"{path}.{flag}", "a bool", getattr(props, flag))
    properties = {
        "dtype": _torch_name(props.dtype, torch.dtype, f"{path}.dtype"),
        "layout": _torch_name(props.layout, torch.layout, f"{path}.layout"),
        "requires_grad": props.requires_grad,
        "memory_format": _torch_name(props.memory_format, torch.memory_format, f"{path}.memory_format"),
        "pin_memory": props.pin_memory,
    }
    return properties | _encode_extra(props, _PROPERTY_FIELDS, path)


def _decode_properties(obj: object, path: str) -> TensorProperties:
    props = _fields(obj, path, _PROPERTY_FIELDS, (_EXTRA,))
    for flag in ("requires_grad", "pin_memory"):
        if type(props[flag]) is not bool:
            _expect(f"{path}.{flag}", "a bool", props[flag])
    values = {
        "dtype": _torch_object(props["dtype"], torch.dtype, f"{path}.dtype"),
        "layout": _torch_object(props["layout"], torch.layout, f"{path}.layout"),
        "requires_grad": props["requires_grad"],
        "memory_format": _torch_object(props["memory_format"], torch.memory_format, f"{path}.memory_format"),
        "pin_memory": props["pin_memory"],
    }
    return _construct(TensorProperties, values, props, path)


def _encode_storage(value: object, path: str) -> dict[str, Any]:
    if type(value) is BytesStorageMetadata:
        return {"type": "bytes"} | _encode_extra(value, (), path)
    if type(value) is not TensorStorageMetadata:
        _expect(path, "TensorStorageMetadata or BytesStorageMetadata", value)
    properties = _encode_properties(value.properties, f"{path}.properties")
    size = _dims(value.size, f"{path}.size", (torch.Size, tuple, list))
    if type(value.chunks) is not list:
        _expect(f"{path}.chunks", "a list of ChunkStorageMetadata", value.chunks)
    chunks = []
    for i, chunk in enumerate(value.chunks):
        where = f"{path}.chunks[{i}]"
        if type(chunk) is not ChunkStorageMetadata:
            _expect(where, "ChunkStorageMetadata", chunk)
        offsets = _dims(chunk.offsets, f"{where}.offsets", (torch.Size, tuple, list))
        sizes = _dims(chunk.sizes, f"{where}.sizes", (torch.Size, tuple, list))
        _check_chunk(size, offsets, sizes, where)
        chunks.append({"offsets": offsets, "sizes": sizes} | _encode_extra(chunk, _CHUNK_FIELDS, where))
    encoded = {"type": "tensor", "properties": properties, "size": size, "chunks": chunks}
    return encoded | _encode_extra(value, _STORAGE_FIELDS, path)


def _decode_storage(obj: object, path: str) -> TensorStorageMetadata | BytesStorageMetadata:
    if type(obj) is dict and obj.get("type") == "bytes":
        fields = _fields(obj, path, ("type",), (_EXTRA,))
        return _construct(BytesStorageMetadata, {}, fields, path)
    fields = _fields(obj, path, ("type", *_STORAGE_FIELDS), (_EXTRA,))
    if fields["type"] != "tensor":
        _expect(f"{path}.type", "'tensor' or 'bytes'", fields["type"])
    properties = _decode_properties(fields["properties"], f"{path}.properties")
    size = _dims(fields["size"], f"{path}.size", (list,))
    if type(fields["chunks"]) is not list:
        _expect(f"{path}.chunks", "a list of chunks", fields["chunks"])
    chunks = []
    for i, chunk in enumerate(fields["chunks"]):
        where = f"{path}.chunks[{i}]"
        parts = _fields(chunk, where, _CHUNK_FIELDS, (_EXTRA,))
        offsets = _dims(parts["offsets"], f"{where}.offsets", (list,))
        sizes = _dims(parts["sizes"], f"{where}.sizes", (list,))
        _check_chunk(size, offsets, sizes, where)
        chunk_values = {"offsets": torch.Size(offsets), "sizes": torch.Size(sizes)}
        chunks.append(_construct(ChunkStorageMetadata, chunk_values, parts, where))
    values: dict[str, Any] = {"properties": properties, "size": torch.Size(size), "chunks": chunks}
    return _construct(TensorStorageMetadata, values, fields, path)


def _encode_storage_data(value: object) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if type(value) is not dict:
        _expect("storage_data", "a dict keyed by MetadataIndex, or None", value)
    entries = []
    for i, (index, item) in enumerate(value.items()):
        where = f"storage_data[{i}]"
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            _expect(f"{where} key", "a MetadataIndex with a string fqn", index)
        if index.index is not None and not _is_dim(index.index):
            _expect(f"{where}.index", "a non-negative int or None", index.index)
        offset = None if index.offset is None else _dims(index.offset, f"{where}.offset", (torch.Size,))
        encoded = _encode_value(item, f"{where}.value")
        entries.append({"fqn": index.fqn, "offset": offset, "index": index.index, "value": encoded})
    return entries


def _decode_storage_data(obj: object) -> dict[MetadataIndex, Any] | None:
    if obj is None:
        return None
    if type(obj) is not list:
        _expect("storage_data", "a list of entries or null", obj)
    result: dict[MetadataIndex, Any] = {}
    for i, entry in enumerate(obj):
        where = f"storage_data[{i}]"
        fields = _fields(entry, where, ("fqn", "offset", "index", "value"))
        if type(fields["fqn"]) is not str:
            _expect(f"{where}.fqn", "a string", fields["fqn"])
        index = fields["index"]
        if index is not None and not _is_dim(index):
            _expect(f"{where}.index", "a non-negative int or null", index)
        offset = None if fields["offset"] is None else _dims(fields["offset"], f"{where}.offset", (list,))
        key = MetadataIndex(fields["fqn"], offset, index)
        if key in result:
            _fail(where, f"duplicate entry for fqn {key.fqn!r} at offset {offset}")
        result[key] = _decode_value(fields["value"], f"{where}.value")
    return result


def _encode_storage_meta(meta: object) -> dict[str, Any] | None:
    if meta is None:
        return None
    if type(meta) is not StorageMeta:
        _expect("storage_meta", "a StorageMeta or None", meta)
    ckpt: Any = meta.checkpoint_id
    if isinstance(ckpt, os.PathLike):
        ckpt = {"path": os.fsdecode(ckpt)}
    elif ckpt is not None and type(ckpt) is not str:
        _expect("storage_meta.checkpoint_id", "a string, an os.PathLike or None", ckpt)
    encoded = {
        "checkpoint_id": ckpt,
        "save_id": _optional_str(getattr(meta, "save_id", None), "storage_meta.save_id"),
        "load_id": _optional_str(getattr(meta, "load_id", None), "storage_meta.load_id"),
        "modules": _str_list(getattr(meta, "modules", []), "storage_meta.modules"),
    }
    return encoded | _encode_extra(meta, _STORAGE_META_FIELDS, "storage_meta")


def _decode_storage_meta(obj: object) -> StorageMeta | None:
    if obj is None:
        return None
    fields = _fields(obj, "storage_meta", _STORAGE_META_FIELDS, (_EXTRA,))
    ckpt = fields["checkpoint_id"]
    checkpoint_id: str | pathlib.Path | None
    if type(ckpt) is dict:
        path = _fields(ckpt, "storage_meta.checkpoint_id", ("path",))["path"]
        if type(path) is not str:
            _expect("storage_meta.checkpoint_id.path", "a string", path)
        checkpoint_id = pathlib.Path(path)
    else:
        checkpoint_id = _optional_str(ckpt, "storage_meta.checkpoint_id")
    values = {
        "checkpoint_id": checkpoint_id,
        "save_id": _optional_str(fields["save_id"], "storage_meta.save_id"),
        "load_id": _optional_str(fields["load_id"], "storage_meta.load_id"),
        "modules": _str_list(fields["modules"], "storage_meta.modules"),
    }
    return _construct(StorageMeta, values, fields, "storage_meta")


def encode_metadata(md: Metadata) -> dict[str, Any]:
    """Encode DCP ``md`` as a dict of JSON natives (fixed key order, no NaN) for ``json.dumps``.

    Raises :class:`FormatError`, naming the field, for anything that cannot be represented
    without pickle (an arbitrary object in ``planner_data``, a non-``MetadataIndex`` storage key).
    """
    if type(md) is not Metadata:
        _expect("<top level>", "a torch.distributed.checkpoint.metadata.Metadata", md)
    if type(md.state_dict_metadata) is not dict:
        _expect("state_dict_metadata", "a dict", md.state_dict_metadata)
    state: dict[str, Any] = {}
    for fqn, storage in md.state_dict_metadata.items():
        if type(fqn) is not str:
            _expect("state_dict_metadata key", "a string", fqn)
        state[fqn] = _encode_storage(storage, _key_path("state_dict_metadata", fqn))
    encoded = {
        "codec": CODEC,
        "version": _optional_str(getattr(md, "version", None), "version"),
        "state_dict_metadata": state,
        "planner_data": _encode_value(md.planner_data, "planner_data"),
        "storage_data": _encode_storage_data(md.storage_data),
        "storage_meta": _encode_storage_meta(md.storage_meta),
    }
    return encoded | _encode_extra(md, _METADATA_FIELDS, "<top level>")


def decode_metadata(obj: Any) -> Metadata:
    """Rebuild the ``Metadata`` that :func:`encode_metadata` encoded, validating every field.

    Raises :class:`UnsupportedFormat` for a newer codec major version and :class:`FormatError`
    (with the path of the bad field) for anything else malformed.
    """
    if type(obj) is not dict:
        _expect("<top level>", "an object", obj)
    codec = obj.get("codec")
    match = _CODEC_RE.fullmatch(codec) if type(codec) is str else None
    if match is None:
        _expect("codec", f"{CODEC!r}", codec)
    if int(match.group(1)) > _CODEC_MAJOR:
        raise UnsupportedFormat(
            f"dcp metadata: codec {codec!r} is newer than this shoal reads ({CODEC!r}); upgrade shoal"
        )
    fields = _fields(obj, "<top level>", _TOP_FIELDS, (_EXTRA,))
    state = fields["state_dict_metadata"]
    if type(state) is not dict:
        _expect("state_dict_metadata", "an object", state)
    state_dict_metadata = {}
    for fqn, storage in state.items():
        if type(fqn) is not str:
            _expect("state_dict_metadata key", "a string", fqn)
        state_dict_metadata[fqn] = _decode_storage(storage, _key_path("state_dict_metadata", fqn))
    values = {
        "state_dict_metadata": state_dict_metadata,
        "planner_data": _decode_value(fields["planner_data"], "planner_data"),
        "storage_data": _decode_storage_data(fields["storage_data"]),
        "storage_meta": _decode_storage_meta(fields["storage_meta"]),
        "version": _optional_str(fields["version"], "version"),
    }
    return _construct(Metadata, values, fields, "<top level>")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise FormatError(f"dcp metadata: duplicate JSON object key {_show(key)}")
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
