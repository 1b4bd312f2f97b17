"""Tiers: where bytes live. See :mod:`shoal.tiers.base` for the contract.

The registry maps a tier kind to the class implementing it, imported only when that
kind is opened (so ``s3fs`` and friends load only for tiers that use them). A new tier
is one module plus one line in :data:`TIER_CLASSES`; it proves itself by subclassing
:class:`shoal.testing.TierTests`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from shoal.errors import ConfigError
from shoal.tiers.base import FileInfo, Tier, TierCapabilities

TIER_CLASSES: Mapping[str, str] = {
    "dram": "shoal.tiers.dram:DramTier",
    "local": "shoal.tiers.local:PosixTier",
    "shared": "shoal.tiers.shared:FsspecTier",
}
"""Tier kind -> ``"module:Class"`` of its implementation."""


def tier_class(kind: str) -> type[Tier]:
    """The class implementing tier ``kind``; :class:`~shoal.errors.ConfigError` if there is none."""
    try:
        target = TIER_CLASSES[kind]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown tier kind {kind!r}; known kinds are {', '.join(sorted(TIER_CLASSES))}"
        ) from None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):  # pragma: no cover - a broken registry line
        raise TypeError(f"tier registry entry {kind!r} -> {target!r} is not a Tier subclass")
    return cls


def open_tier(kind: str, url: str, storage_options: Mapping[str, Any] | None = None) -> Tier:
    """Open a tier of ``kind`` (``"dram"``, ``"local"`` or ``"shared"``) rooted at ``url``.

    ``storage_options`` go to fsspec and are only accepted by the ``shared`` tier.
    Opening does no I/O for ``dram`` and ``local``; roots are created on first write.
    """
    return tier_class(kind).from_url(url, storage_options)


__all__ = ["TIER_CLASSES", "FileInfo", "Tier", "TierCapabilities", "open_tier", "tier_class"]
