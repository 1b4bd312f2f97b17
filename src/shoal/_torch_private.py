"""Every private name of PyTorch that shoal uses, in one place, checked against the torch it runs on.

torch gives no stability promise for these, so each is named here once, with what shoal needs of
it, and :func:`problems` says which of them this torch lacks or has changed. A torch upgrade that
breaks one therefore fails ``tests/test_torch_private.py`` by name, instead of making shoal slower
or wrong somewhere else. Accessors raise :class:`~shoal.errors.ShoalError` naming the private name
and the torch version when it is gone.

========================================  ======================================================
private name                              what shoal uses it for
========================================  ======================================================
``torch._C._nn.unflatten_dense_tensors``  views of a run of tensors in one staging buffer
``torch._foreach_copy_``                  one copy call for a run of tensors (the stager)
``dcp._nested_dict.flatten_state_dict``   the flattened names a save will store (the driver)
``dcp._version._derived_version``         reset after a failed pre-2.4 flattening (the driver)
``dcp.filesystem._StorageInfo``           DCP's own metadata entries, encoded and exported
``dcp._fsspec_filesystem.Fsspec*``        the fsspec baselines of the benchmarks
``DefaultSavePlanner._dedup_save_plans``  the host-balanced choice of a replicated item's writer
``DefaultSavePlanner._enable_plan_caching`` DCP's own plan cache (shoal's is off while it is on)
========================================  ======================================================

(``dcp`` is ``torch.distributed.checkpoint``.)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

# DCP's fsspec writer and reader (the benchmarks' baseline) have no public name: named here once.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from shoal.errors import ShoalError

TESTED_TORCH = ("2.6", "2.13")
"""The oldest and newest torch releases these names were checked against."""

_STORAGE_INFO_FIELDS = ("relative_path", "offset", "length")


def _gone(name: str, why: str) -> ShoalError:
    return ShoalError(
        f"torch {torch.__version__} {why}: shoal uses the private {name} (checked on torch "
        f"{TESTED_TORCH[0]} to {TESTED_TORCH[1]}; see shoal._torch_private)"
    )


def _attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _gone(f"{module}.{name}", "has no such name") from None


def unflatten_dense_tensors() -> Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]]:
    """``torch._C._nn.unflatten_dense_tensors``: ``(flat, templates)`` -> views of ``flat``."""
    return _attr("torch._C._nn", "unflatten_dense_tensors")


def foreach_copy() -> Callable[[list[torch.Tensor], list[torch.Tensor]], None]:
    """``torch._foreach_copy_``: ``(dsts, srcs)``, every pair copied in one call."""
    return _attr("torch", "_foreach_copy_")


def flatten_state_dict() -> Callable[[Any], tuple[dict[str, Any], dict[str, Any]]]:
    """DCP's ``flatten_state_dict``: the flat names (and their paths) a save stores."""
    return _attr("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")


def reset_derived_version() -> None:
    """Clear DCP's module-wide ``_derived_version`` switch if a failed flattening left it set."""
    module = importlib.import_module("torch.distributed.checkpoint._version")
    if getattr(module, "_derived_version", None) is not None:
        setattr(module, "_derived_version", None)  # noqa: B010 (a module attribute torch types do not declare)


@functools.cache
def storage_info_class() -> type[Any] | None:
    """DCP's ``filesystem._StorageInfo`` dataclass, or None if this torch has none with its fields.

    The codec needs the class itself (the encoder accepts exactly it; the decoder rebuilds it, so
    that decoded metadata equals DCP's own and pickles to a class every torch reader has).
    """
    try:
        cls = _attr("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    except ShoalError:
        return None
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        return None
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls if set(_STORAGE_INFO_FIELDS) <= fields else None


DEDUP_HOOK = "_dedup_save_plans"
"""The method of DCP's ``DefaultSavePlanner`` that :class:`shoal.dcp.SavePlanner` overrides."""
PLAN_CACHING = "_enable_plan_caching"
"""The attribute of DCP's ``DefaultSavePlanner`` that says whether DCP caches plans itself."""


def plan_caching(planner: object) -> bool:
    """Whether DCP's own plan cache is on for ``planner`` (a ``DefaultSavePlanner``)."""
    try:
        return bool(getattr(planner, PLAN_CACHING))
    except AttributeError:
        raise _gone(f"DefaultSavePlanner.{PLAN_CACHING}", "has no such attribute") from None


def problems() -> list[str]:
    """What this torch lacks or has changed of the names above (empty when all is as expected)."""
    found: list[str] = []
    checks: list[tuple[str, Callable[[], object]]] = [
        ("unflatten_dense_tensors", unflatten_dense_tensors),
        ("_foreach_copy_", foreach_copy),
        ("flatten_state_dict", flatten_state_dict),
    ]
    for name, get in checks:
        try:
            get()
        except ShoalError as e:
            found.append(f"{name}: {e}")
    version = importlib.import_module("torch.distributed.checkpoint._version")
    if not hasattr(version, "_derived_version"):
        found.append("torch.distributed.checkpoint._version._derived_version is gone")
    if storage_info_class() is None:
        found.append(f"torch.distributed.checkpoint.filesystem._StorageInfo lacks {_STORAGE_INFO_FIELDS}")
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    hook = getattr(DefaultSavePlanner, DEDUP_HOOK, None)
    if hook is None:
        found.append(f"DefaultSavePlanner.{DEDUP_HOOK} is gone (shoal's host balance would never run)")
    else:
        params = list(inspect.signature(hook).parameters)
        if params != ["self", "all_plans"]:
            found.append(f"DefaultSavePlanner.{DEDUP_HOOK} takes {params}, not (self, all_plans)")
        callers = [
            name
            for name, fn in inspect.getmembers(DefaultSavePlanner, inspect.isfunction)
            if name != DEDUP_HOOK and f"self.{DEDUP_HOOK}(" in inspect.getsource(fn)
        ]
        if not callers:
            found.append(f"no method of DefaultSavePlanner calls self.{DEDUP_HOOK}() any more")
    if not hasattr(DefaultSavePlanner(), PLAN_CACHING):
        found.append(f"DefaultSavePlanner has no {PLAN_CACHING} attribute")
    return found


__all__ = [
    "DEDUP_HOOK",
    "FsspecReader",
    "FsspecWriter",
    "PLAN_CACHING",
    "TESTED_TORCH",
    "flatten_state_dict",
    "foreach_copy",
    "plan_caching",
    "problems",
    "reset_derived_version",
    "storage_info_class",
    "unflatten_dense_tensors",
]
