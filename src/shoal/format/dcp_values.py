"""The generic-value layer of the DCP-metadata codec (:mod:`shoal.format.dcp_codec`).

Generic values (``planner_data``, ``storage_data`` values, fields a newer torch added) are
JSON scalars and lists as themselves; every other value is a JSON object with exactly one key
naming its type: ``tuple``, ``size`` (``torch.Size``), ``dict`` (string keys), ``pairs`` (any
other keys), ``float`` (``nan``, ``inf``, ``-inf``) and ``storage_info`` (DCP's
``FileSystemWriter`` entry). Also here: the validators both directions share (dimensions,
chunk bounds, torch enum names) and the dataclass helpers that carry fields one torch version
has and another lacks (``"extra"``). Every failure is a :class:`~shoal.errors.FormatError`
naming the path of the bad field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeGuard, TypeVar, cast

import torch

from shoal._torch_private import storage_info_class
from shoal.errors import FormatError, InvalidName
from shoal.format.names import check_relpath

MAX_DEPTH = 64
"""Deepest nesting of generic values (``planner_data``, ``storage_data``) accepted either way."""

EXTRA = "extra"
"""The optional object holding fields this codec does not know (a newer torch's)."""

_TORCH_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_STORAGE_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_MAX_DIM = 2**63 - 1
_T = TypeVar("_T")


def fail(path: str, message: str) -> NoReturn:
    raise FormatError(f"dcp metadata: {path}: {message}")


def show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def expect(path: str, what: str, value: object) -> NoReturn:
    fail(path, f"expected {what}, got {show(value)}")


def is_dim(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= _MAX_DIM


# --- torch enum-like objects (dtype, layout, memory_format) by name --------------------------------


def torch_name(value: object, kind: type, path: str) -> str:
    """Name of a torch dtype/layout/memory_format, checked to resolve back to the same object."""
    if not isinstance(value, kind):
        expect(path, f"a torch.{kind.__name__}", value)
    name = str(value).removeprefix("torch.")
    if not _TORCH_NAME_RE.fullmatch(name) or vars(torch).get(name) is not value:
        fail(path, f"torch.{kind.__name__} {value} has no public name in torch")
    return name


def torch_object(name: object, kind: type[_T], path: str) -> _T:
    """Look ``name`` up in torch's own namespace (no ``__getattr__``, no imports), checking its type."""
    if not isinstance(name, str):
        expect(path, f"a torch.{kind.__name__} name", name)
    found = vars(torch).get(name) if _TORCH_NAME_RE.fullmatch(name) else None
    if not isinstance(found, kind):
        fail(path, f"unknown torch.{kind.__name__} name {show(name)}")
    return found


# --- shared validators ---------------------------------------------------------------------------


def dims(value: object, path: str, types: tuple[type, ...]) -> list[int]:
    if not (isinstance(value, types) and isinstance(value, list | tuple) and all(is_dim(d) for d in value)):
        expect(path, "a list of non-negative ints", value)
    return list(value)


def check_chunk(size: list[int], offsets: list[int], sizes: list[int], path: str) -> None:
    for field, dims in (("offsets", offsets), ("sizes", sizes)):
        if len(dims) != len(size):
            fail(f"{path}.{field}", f"has {len(dims)} dims but the tensor size {size} has {len(size)}")
    if 0 not in sizes and any(o + s > t for o, s, t in zip(offsets, sizes, size, strict=True)):
        fail(path, f"chunk at offsets {offsets} with sizes {sizes} overruns the tensor size {size}")


def _check_storage_info(relative_path: object, offset: object, length: object, path: str) -> None:
    try:
        check_relpath(relative_path)
    except InvalidName as exc:
        fail(f"{path}.relative_path", str(exc))
    for field, value in (("offset", offset), ("length", length)):
        if not is_dim(value):
            expect(f"{path}.{field}", "a non-negative int", value)


def _check_descriptors(descriptors: object, path: str) -> None:
    if descriptors is None:
        return
    if type(descriptors) not in (list, tuple) or not isinstance(descriptors, list | tuple):
        expect(f"{path}.transform_descriptors", "a list or tuple of strings, or null", descriptors)
    for i, descriptor in enumerate(descriptors):
        if type(descriptor) is not str:
            expect(f"{path}.transform_descriptors[{i}]", "a string", descriptor)


def str_list(value: object, path: str) -> list[str]:
    if type(value) is not list or not all(type(m) is str for m in value):
        expect(path, "a list of strings", value)
    return list(value)


def optional_str(value: object, path: str) -> str | None:
    if value is not None and not isinstance(value, str):
        expect(path, "a string or null", value)
    return value


def key_path(path: str, key: object) -> str:
    return f"{path}[{show(key)}]"


# --- dataclass fields that differ between torch versions -----------------------------------------


def exact_fields(
    obj: object, path: str, names: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Check ``obj`` is a JSON object with exactly the fields ``names`` (plus any of ``optional``)."""
    if type(obj) is not dict:
        expect(path, "an object", obj)
    for name in names:
        if name not in obj:
            fail(path, f"missing field {name!r}")
    for name in obj:
        if name not in names and name not in optional:
            fail(path, f"unexpected field {show(name)}")
    return obj


def _init_fields(obj: object) -> list[str]:
    """The names of the ``__init__`` fields of a dataclass or dataclass instance, in order."""
    if not dataclasses.is_dataclass(obj):
        raise TypeError(f"{obj!r} is not a dataclass")
    return [f.name for f in dataclasses.fields(obj) if f.init]


def encode_extra(obj: object, known: tuple[str, ...], path: str, depth: int = 0) -> dict[str, Any]:
    """``{"extra": {...}}`` for the init fields of dataclass ``obj`` this codec does not know, or ``{}``."""
    extra = {
        name: encode_value(getattr(obj, name), f"{path}.{name}", depth + 1)
        for name in _init_fields(obj)
        if name not in known
    }
    return {EXTRA: extra} if extra else {}


def construct(
    cls: Callable[..., _T], values: dict[str, Any], fields: dict[str, Any], path: str, depth: int = 0
) -> _T:
    """``cls(**values)`` plus the decoded ``"extra"`` of ``fields``, keeping only fields ``cls`` has."""
    extra = fields.get(EXTRA, {})
    if type(extra) is not dict:
        expect(f"{path}.{EXTRA}", "an object", extra)
    accepted = _init_fields(cls)
    kwargs = {name: value for name, value in values.items() if name in accepted}
    for name, value in extra.items():
        if name in values:
            fail(f"{path}.{EXTRA}", f"field {show(name)} is not an extra field")
        decoded = decode_value(value, f"{path}.{EXTRA}[{show(name)}]", depth + 1)
        if name in accepted:
            kwargs[name] = decoded
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        fail(path, f"cannot rebuild {getattr(cls, '__name__', cls)}: {exc}")


# --- DCP's FileSystemWriter entry (a private torch class) -----------------------------------------


class _StorageInfoLike(Protocol):
    """What this codec reads of a ``storage_info`` value: the fields ``FileSystemReader`` reads."""

    relative_path: str
    offset: int
    length: int


# --- generic values ------------------------------------------------------------------------------


def _encode_storage_info(info: _StorageInfoLike, path: str, depth: int) -> dict[str, Any]:
    _check_storage_info(info.relative_path, info.offset, info.length, path)
    descriptors = getattr(info, "transform_descriptors", None)
    _check_descriptors(descriptors, path)
    fields = {
        "relative_path": info.relative_path,
        "offset": info.offset,
        "length": info.length,
        "transform_descriptors": encode_value(descriptors, f"{path}.transform_descriptors", depth + 1),
    }
    return {"storage_info": fields | encode_extra(info, _STORAGE_INFO_FIELDS, path, depth)}


def _decode_storage_info(body: object, path: str, depth: int) -> Any:
    cls = storage_info_class()
    if cls is None:
        fail(path, "this torch has no FileSystemWriter storage info (_StorageInfo) to rebuild the entry as")
    fields = exact_fields(body, f"{path}.storage_info", _STORAGE_INFO_FIELDS, (EXTRA,))
    _check_storage_info(fields["relative_path"], fields["offset"], fields["length"], path)
    descriptors = decode_value(fields["transform_descriptors"], f"{path}.transform_descriptors", depth + 1)
    _check_descriptors(descriptors, path)
    values = {
        "relative_path": fields["relative_path"],
        "offset": fields["offset"],
        "length": fields["length"],
        "transform_descriptors": descriptors,
    }
    return construct(cls, values, fields, f"{path}.storage_info", depth)


def encode_value(value: object, path: str, depth: int = 0) -> Any:
    """Encode a generic value (see the module docstring) into JSON natives."""
    if depth > MAX_DEPTH:
        fail(path, f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float and isinstance(value, float):
        return value if math.isfinite(value) else {"float": str(value)}
    if kind is list and isinstance(value, list):
        return [encode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if kind is torch.Size:
        return {"size": dims(value, path, (torch.Size,))}
    if kind is tuple and isinstance(value, tuple):
        return {"tuple": [encode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
    if kind is dict and isinstance(value, dict):
        items: dict[Any, Any] = value
        if all(type(k) is str for k in items):
            return {"dict": {k: encode_value(v, key_path(path, k), depth + 1) for k, v in items.items()}}
        pairs = [
            [
                encode_value(k, f"{path}.keys()[{i}]", depth + 1),
                encode_value(v, key_path(path, k), depth + 1),
            ]
            for i, (k, v) in enumerate(items.items())
        ]
        return {"pairs": pairs}
    if kind is storage_info_class():
        return _encode_storage_info(cast(_StorageInfoLike, value), path, depth)
    fail(
        path,
        f"cannot encode a value of type {kind.__module__}.{kind.__qualname__} without pickle: {show(value)}",
    )


def _decode_pairs(body: list[Any], path: str, depth: int) -> dict[Any, Any]:
    result: dict[Any, Any] = {}
    for i, pair in enumerate(body):
        if type(pair) is not list or len(pair) != 2:
            expect(f"{path}.pairs[{i}]", "a [key, value] list", pair)
        key = decode_value(pair[0], f"{path}.keys()[{i}]", depth + 1)
        try:
            duplicate = key in result
        except TypeError:
            fail(f"{path}.keys()[{i}]", f"dict key {show(key)} is not hashable")
        if duplicate:
            fail(f"{path}.keys()[{i}]", f"duplicate dict key {show(key)}")
        result[key] = decode_value(pair[1], key_path(path, key), depth + 1)
    return result


def decode_value(obj: object, path: str, depth: int = 0) -> Any:
    """Inverse of :func:`encode_value`, validating every tag and field."""
    if depth > MAX_DEPTH:
        fail(path, f"nested deeper than {MAX_DEPTH} levels")
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if type(obj) is float and isinstance(obj, float):
        if not math.isfinite(obj):
            fail(path, f"non-finite float {obj} must be written as {{'float': {str(obj)!r}}}")
        return obj
    if type(obj) is list:
        return [decode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if type(obj) is not dict or len(obj) != 1:
        expect(path, "a JSON scalar, a list, or an object with exactly one type tag", obj)
    ((tag, body),) = obj.items()
    if tag == "tuple" and type(body) is list:
        return tuple(decode_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(body))
    if tag == "size":
        return torch.Size(dims(body, f"{path}.size", (list,)))
    if tag == "dict" and type(body) is dict and all(type(k) is str for k in body):
        return {k: decode_value(v, key_path(path, k), depth + 1) for k, v in body.items()}
    if tag == "pairs" and type(body) is list:
        return _decode_pairs(body, path, depth)
    if tag == "float" and type(body) is str and body in _NON_FINITE:
        return _NON_FINITE[body]
    if tag == "storage_info":
        return _decode_storage_info(body, path, depth)
    fail(path, f"unknown type tag or malformed body: {show(obj)}")


__all__ = [
    "EXTRA",
    "MAX_DEPTH",
    "check_chunk",
    "construct",
    "decode_value",
    "dims",
    "encode_extra",
    "encode_value",
    "exact_fields",
    "expect",
    "fail",
    "is_dim",
    "key_path",
    "optional_str",
    "show",
    "str_list",
    "torch_name",
    "torch_object",
]
