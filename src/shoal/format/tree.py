"""One exact encoding of a nested value whose load target is unknown at load time.

A framework's checkpoint dict must come back with its exact Python types (int keys, tuples,
``OrderedDict``, non-finite floats, dtypes, devices), and a fresh object's ``state_dict()`` is no load
target for it (an optimizer's is empty before its first step). :func:`encode` splits the value into
the *stored* state (nested dicts with string keys whose leaves are its tensors: what
:meth:`shoal.Checkpointer.save` takes) and a JSON *skeleton* holding everything else: each container
and key type, each plain value, each stored tensor's dtype and shape. :func:`targets` builds the load
target from the skeleton, :func:`decode` the value from what was loaded into it. Nothing is pickled:
another type (a subclass too) is an :class:`~shoal.errors.UnsupportedValue` naming its place.

>>> import json
>>> stored, skeleton = encode({1: (torch.ones(2), float("inf")), "lr": 0.5}, where="example")
>>> stored
{'1': {'0': tensor([1., 1.])}}
>>> skeleton = json.loads(json.dumps(skeleton, allow_nan=False))
>>> target = targets(skeleton)  # Checkpointer.load(target) fills it in place; here by hand:
>>> _ = target["1"]["0"].copy_(stored["1"]["0"])
>>> decode(skeleton, target)
{1: (tensor([1., 1.]), inf), 'lr': 0.5}

Skeleton nodes: None, bools, ints, strings and finite floats as themselves, a list as an array, else
an object with one tag: ``tuple``, ``dict`` or ``odict`` (``[key, value]`` pairs), ``float`` (``"inf"``,
``"-inf"``, ``"nan"``), ``dtype``, ``device``, ``tensor`` (``[dtype, shape]``: stored) or ``inline``
(``[dtype, shape, base64 bytes]``: a tensor kept in the skeleton).
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shoal.errors import ConfigError, FormatError, UnsupportedValue

__all__ = ["Path", "decode", "encode", "paths", "targets"]

Path = tuple[str, ...]
"""Where a tensor sits: each dict key (``str(key)``) or list index, as in the stored state."""


def encode(
    value: Any, *, where: str, inline: Callable[[Path], bool] | None = None
) -> tuple[dict[str, Any], Any]:
    """``(stored, skeleton)`` of ``value`` (see the module docstring); ``where`` begins each error.

    ``inline(path)`` true: the tensor at ``path`` goes into the skeleton as its bytes, not into
    ``stored`` (small tensors that need no shoal item). Raises :class:`UnsupportedValue` for a value
    or key of another type; :class:`ConfigError` for two keys of one dict with one string (1, "1").
    """
    stored: dict[str, Any] = {}

    def walk(node: Any, path: Path) -> Any:
        kind = type(node)
        if isinstance(node, torch.Tensor):
            if node.layout != torch.strided:
                raise UnsupportedValue(f"{where}: the tensor at {_show(path)} is {node.layout}, not strided")
            if inline is not None and inline(path):
                raw = node.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                return {"inline": [_dtype_name(node.dtype), list(node.shape), base64.b64encode(raw).decode()]}
            if not path:
                raise UnsupportedValue(f"{where}: the value is a tensor itself; put it in a dict")
            _put(stored, path, node)
            return {"tensor": [_dtype_name(node.dtype), list(node.shape)]}
        if kind is dict or kind is OrderedDict:
            names: dict[str, Any] = {}
            pairs = []
            for key, child in node.items():
                name = str(key)
                if name in names:
                    raise ConfigError(
                        f"{where}: keys {names[name]!r} and {key!r} at {_show(path)} are one name, {name!r}"
                    )
                names[name] = key
                pairs.append([_plain(key, path, where, key=True), walk(child, (*path, name))])
            return {"odict" if kind is OrderedDict else "dict": pairs}
        if kind is list or kind is tuple:
            items = [walk(child, (*path, str(i))) for i, child in enumerate(node)]
            return items if kind is list else {"tuple": items}
        return _plain(node, path, where)

    return stored, walk(value, ())


def targets(skeleton: Any, live: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The load target of ``skeleton``'s stored tensors: an empty tensor of each one's dtype and shape,
    or the tensor at its path in ``live`` (stored-shaped, e.g. ``encode(live_state)[0]``: DTensors
    to load into in place, resharded)."""
    out: dict[str, Any] = {}

    def target(path: Path, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        found = _get(live, path) if live is not None else None
        tensor = found if isinstance(found, torch.Tensor) else torch.empty(shape, dtype=dtype)
        return _put(out, path, tensor)

    _decode(skeleton, (), target)
    return out


def decode(skeleton: Any, loaded: Mapping[str, Any]) -> Any:
    """The value :func:`encode` was given, from its skeleton and ``loaded`` (its targets, loaded)."""

    def tensor(path: Path, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        found = _get(loaded, path)
        if not isinstance(found, torch.Tensor):
            raise FormatError(f"tree: the loaded state has no tensor at {_show(path)}")
        return found

    return _decode(skeleton, (), tensor)


def paths(stored: Mapping[str, Any], path: Path = ()) -> list[Path]:
    """Every tensor's path in a stored-shaped dict."""
    found: list[Path] = []
    for name, child in stored.items():
        found += paths(child, (*path, name)) if isinstance(child, Mapping) else [(*path, name)]
    return found


def _plain(value: Any, path: Path, where: str, *, key: bool = False) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is torch.dtype:
        return {"dtype": _dtype_name(value)}
    if kind is torch.device:
        return {"device": str(value)}
    if key and kind is tuple:
        return {"tuple": [_plain(v, path, where, key=True) for v in value]}
    raise UnsupportedValue(
        f"{where}: the {'key' if key else 'value'} at {_show(path)} is a {kind.__module__}."
        f"{kind.__qualname__}: shoal saves tensors and plain values (None, bool, int, float, str, "
        "torch dtypes and devices; dicts, OrderedDicts, lists and tuples of them) exactly, never a pickle"
    )


def _decode(node: Any, path: Path, tensor: Callable[[Path, torch.dtype, list[int]], torch.Tensor]) -> Any:
    if node is None or type(node) in (bool, int, str, float):
        return node
    if type(node) is list:
        return [_decode(child, (*path, str(i)), tensor) for i, child in enumerate(node)]
    if type(node) is not dict or len(node) != 1:
        raise FormatError(f"tree: skeleton node at {_show(path)} is neither plain nor tagged: {node!r:.80}")
    ((tag, body),) = node.items()
    if tag in ("dict", "odict"):
        keys = [_decode(k, path, tensor) for k, _ in body]
        cls = OrderedDict if tag == "odict" else dict
        return cls((k, _decode(v, (*path, str(k)), tensor)) for k, (_, v) in zip(keys, body, strict=True))
    if tag == "tuple":
        return tuple(_decode(child, (*path, str(i)), tensor) for i, child in enumerate(body))
    if tag == "tensor":
        return tensor(path, _dtype(body[0], path), body[1])
    if tag == "inline":
        dtype, shape, raw = _dtype(body[0], path), body[1], base64.b64decode(body[2], validate=True)
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if tag == "float" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "dtype":
        return _dtype(body, path)
    if tag == "device":
        return torch.device(body)
    raise FormatError(f"tree: unknown skeleton tag {tag!r} at {_show(path)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any, path: Path) -> torch.dtype:
    found = vars(torch).get(name) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise FormatError(f"tree: unknown dtype {name!r:.40} at {_show(path)}")
    return found


def _put(root: dict[str, Any], path: Path, tensor: torch.Tensor) -> torch.Tensor:
    for name in path[:-1]:
        root = root.setdefault(name, {})
    root[path[-1]] = tensor
    return tensor


def _get(root: Mapping[str, Any] | None, path: Path) -> Any:
    for name in path:
        root = root.get(name) if isinstance(root, Mapping) else None
    return root


def _show(path: Path) -> str:
    return "/".join(path) or "the top"
