"""Tiers: where bytes live. See :mod:`shoal.tiers.base` for the contract.

* :mod:`shoal.tiers.registry`: tier kind -> implementing class, imported only when that kind
  is opened (so ``s3fs`` and friends load only for tiers that use them);
  :func:`register_tier` adds a third party's kind.
* :mod:`shoal.tiers.roles`: what a tier is used for (staging, host copy, shared) and which
  kind plays each role; :func:`open_role` (:func:`open_host_role` for a host tier at a local
  directory).
* :mod:`shoal.tiers.slabs`: the slab capability (:class:`SlabStore`, :class:`SlabLike`, and
  :class:`MappedSlabs` and :class:`MappedFiles` for a slab's or a host file's bytes without a copy),
  checked with ``isinstance``.

A new tier is one module, one :func:`register_tier` call (one line of
:data:`~shoal.tiers.registry.BUILT_IN_TIERS` for a built-in one) and one subclass of
:class:`shoal.testing.TierTests`; ``docs/tiers.md`` walks through it.
"""

from __future__ import annotations

from shoal.tiers.base import AUTO, FileInfo, Tier, TierCapabilities
from shoal.tiers.registry import (
    BUILT_IN_TIERS,
    TIER_CLASSES,
    check_tier_class,
    open_tier,
    read_preference,
    register_tier,
    tier_class,
    unregister_tier,
)
from shoal.tiers.roles import (
    HOST_COPY,
    ROLE_KINDS,
    SHARED,
    STAGING,
    Role,
    kind_for,
    open_host_role,
    open_role,
)
from shoal.tiers.slabs import MappedFiles, MappedSlabs, SlabLike, SlabStore

__all__ = [
    "AUTO",
    "BUILT_IN_TIERS",
    "HOST_COPY",
    "ROLE_KINDS",
    "SHARED",
    "STAGING",
    "TIER_CLASSES",
    "FileInfo",
    "MappedFiles",
    "MappedSlabs",
    "Role",
    "SlabLike",
    "SlabStore",
    "Tier",
    "TierCapabilities",
    "check_tier_class",
    "kind_for",
    "open_host_role",
    "open_role",
    "open_tier",
    "read_preference",
    "register_tier",
    "tier_class",
    "unregister_tier",
]
