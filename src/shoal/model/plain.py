"""Flat dataclasses of the model to and from plain JSON values (the path model's worker speaks JSON)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from shoal.errors import ConfigError

T = TypeVar("T")

_KINDS = {"float": float, "int": int, "str": str}


def to_plain(obj: Any) -> dict[str, Any]:
    """A flat dataclass of numbers and strings as a dict (field name -> value)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def from_plain(cls: type[T], value: Mapping[str, Any], what: str) -> T:
    """``cls`` from :func:`to_plain`'s dict, each field converted to its declared type;
    :class:`~shoal.errors.ConfigError` names ``what`` and the problem when a field is missing or
    is not a number (or string) of that type."""
    try:
        fields = {f.name: _KINDS[str(f.type)](value[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{what} is malformed ({e!r}): {dict(value)!r}") from e
    return cls(**fields)
