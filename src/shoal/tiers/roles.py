"""Roles: what shoal uses a tier *for*, and the one place that says which tier kind plays each.

* :data:`STAGING`: where a rank's items are copied when ``save`` is called (B1), and slabs
  live; the ``dram`` tier.
* :data:`HOST_COPY`: where a partner host keeps its copy of another host's chunks (B2);
  the ``local`` tier, or ``dram`` with ``Config.replicate_to="dram"``.
* :data:`SHARED`: the job-wide tier every host reaches (B3, B4; what a fresh job restores
  from); the ``shared`` tier.

Code opens a tier for a role with :func:`open_role` (or asks :func:`kind_for`), never with a
kind written out: a kind says how bytes are stored, a role what they are there for. A host tier
(staging, host copy) rooted at a local directory under a configured root is opened with
:func:`open_host_role`, which passes that root on as the trusted base of the private checks. Each
role also has needs (:func:`check_role_kind`), so a kind registered in place of a built-in
one (``register_tier("shared", ..., replace=True)``) is refused for a role it cannot play.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, overload

from shoal.errors import ConfigError
from shoal.tiers.base import Tier
from shoal.tiers.registry import tier_class
from shoal.tiers.slabs import SlabStore

if TYPE_CHECKING:  # the host tiers are imported when one is opened (the dram tier loads numpy)
    from shoal.tiers.dram import DramTier
    from shoal.tiers.local import PosixTier


class Role(str, enum.Enum):
    """What a tier is used for; see the module docstring."""

    STAGING = "staging"
    HOST_COPY = "host_copy"
    SHARED = "shared"


STAGING: Final = Role.STAGING
HOST_COPY: Final = Role.HOST_COPY
SHARED: Final = Role.SHARED

ROLE_KINDS: Final[Mapping[Role, str]] = MappingProxyType(
    {Role.STAGING: "dram", Role.HOST_COPY: "local", Role.SHARED: "shared"}
)
"""Role -> the tier kind that plays it unless configured otherwise."""


def as_role(role: Role | str) -> Role:
    """``role`` as a :class:`Role` (its value, like ``"host_copy"``, is accepted too)."""
    try:
        return Role(role)
    except ValueError:
        raise ConfigError(
            f"unknown tier role {role!r}; the roles are {', '.join(r.value for r in Role)}"
        ) from None


def kind_for(role: Role | str) -> str:
    """The tier kind that plays ``role`` by default (``ROLE_KINDS``)."""
    return ROLE_KINDS[as_role(role)]


def _unmet(role: Role, cls: type[Tier]) -> str | None:
    """What tier class ``cls`` lacks for ``role``, or None."""
    caps = cls.capabilities
    if role in (Role.STAGING, Role.HOST_COPY) and not caps.host_local:
        return "it is not host-local (capabilities.host_local is false)"
    if role is Role.STAGING and not issubclass(cls, SlabStore):
        return "it keeps no slabs (it is not a shoal.tiers.SlabStore)"
    if role is Role.SHARED:
        if caps.host_local:
            return "it is host-local, and every host of the job must reach the shared tier"
        if not caps.persistent:
            return "it is not persistent (capabilities.persistent is false)"
    return None


def check_role_kind(role: Role | str, kind: str) -> str:
    """Return ``kind`` if tier kind ``kind`` can play ``role``, else raise :class:`~shoal.errors.ConfigError`.

    Staging needs a host-local slab store; a host copy a host-local tier; the shared role a
    persistent tier that is not host-local.
    """
    r = as_role(role)
    cls = tier_class(kind)
    why = _unmet(r, cls)
    if why is not None:
        raise ConfigError(f"tier kind {kind!r} ({cls.__qualname__}) cannot be the {r.value} tier: {why}")
    return kind


def open_role(
    role: Role | str,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    kind: str | None = None,
) -> Tier:
    """Open the tier that plays ``role``, rooted at ``url``.

    ``kind`` overrides :func:`kind_for` (``Config.replicate_to`` picks the host copy's); it is
    checked with :func:`check_role_kind` before anything is opened.
    """
    chosen = check_role_kind(role, kind_for(role) if kind is None else kind)
    return tier_class(chosen).from_url(url, storage_options)


@overload
def open_host_role(
    role: Literal[Role.STAGING],
    root: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    kind: str | None = None,
) -> DramTier: ...


@overload
def open_host_role(
    role: Role | str,
    root: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    kind: str | None = None,
) -> PosixTier: ...


def open_host_role(
    role: Role | str,
    root: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    kind: str | None = None,
) -> PosixTier:
    """Open the host tier that plays ``role`` (staging or host copy) at the local directory ``root``.

    ``base`` is the trusted base of the private checks (:class:`~shoal.tiers.local.PosixTier`): the
    configured root (``Config.dram``, ``Config.local``) the tier lies under; it defaults to
    ``root``. ``kind`` overrides :func:`kind_for` and is checked with :func:`check_role_kind`, as
    for :func:`open_role`. A host tier opened from a directory is a POSIX one: the staging tier's
    class must be a :class:`~shoal.tiers.dram.DramTier`, a host copy's a ``PosixTier``; the shared
    role is no host role (:func:`open_role` opens it). Nothing is created on disk.
    """
    r = as_role(role)
    if r is Role.SHARED:
        raise ConfigError("the shared tier is not a host tier; open it with open_role(SHARED, url)")
    chosen = check_role_kind(r, kind_for(r) if kind is None else kind)
    cls = tier_class(chosen)
    need: type[PosixTier]
    if r is Role.STAGING:
        from shoal.tiers.dram import DramTier

        need = DramTier
    else:
        from shoal.tiers.local import PosixTier

        need = PosixTier
    if not issubclass(cls, need):
        raise ConfigError(
            f"tier kind {chosen!r} ({cls.__qualname__}) cannot be opened as the {r.value} tier at the "
            f"directory {os.fspath(root)}: it is not a {need.__name__}"
        )
    return cls(root, base=base)


__all__ = [
    "HOST_COPY",
    "ROLE_KINDS",
    "SHARED",
    "STAGING",
    "Role",
    "as_role",
    "check_role_kind",
    "kind_for",
    "open_host_role",
    "open_role",
]
