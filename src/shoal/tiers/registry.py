"""The tier registry: tier kind -> the class implementing it, imported when the kind is first used.

Built in: ``dram``, ``local`` and ``shared``. A third party adds a kind with
:func:`register_tier` (a class, or ``"package.module:Class"`` imported on first use, so that
its dependencies load only for jobs that use it); ``docs/tiers.md`` has a worked example.
What the rest of shoal needs to know about a kind it reads from the class's
:class:`~shoal.tiers.base.TierCapabilities` (:func:`read_preference`), never from its name.
"""

from __future__ import annotations

import importlib
import inspect
import re
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from shoal.errors import ConfigError
from shoal.tiers.base import Tier, TierCapabilities

BUILT_IN_TIERS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "dram": "shoal.tiers.dram:DramTier",
        "local": "shoal.tiers.local:PosixTier",
        "shared": "shoal.tiers.shared:FsspecTier",
    }
)
"""The kinds shoal ships, -> ``"module:Class"`` of their implementation."""

_registry: dict[str, str | type[Tier]] = dict(BUILT_IN_TIERS)
_resolved: dict[str, type[Tier]] = {}
_lock = threading.Lock()

TIER_CLASSES: Final[Mapping[str, str | type[Tier]]] = MappingProxyType(_registry)
"""Tier kind -> its class, or the ``"module:Class"`` it is imported from (a read-only view of the
registry: change it with :func:`register_tier` and :func:`unregister_tier`)."""

_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_TARGET = re.compile(rf"{_IDENT}(?:\.{_IDENT})*:{_IDENT}")


def _known() -> str:
    return ", ".join(sorted(_registry))


def _check_kind(kind: object) -> str:
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise ConfigError(
            f"tier kind {kind!r} is not a valid name: use 1 to 32 lowercase letters, digits and '_', "
            f"starting with a letter (like 'dram' or 'nvme_scratch')"
        )
    return kind


def check_tier_class(kind: str, cls: object, where: str = "") -> type[Tier]:
    """Return ``cls`` if it can implement tier ``kind``, else raise :class:`~shoal.errors.ConfigError`.

    It must be a concrete subclass of :class:`~shoal.tiers.base.Tier` whose ``kind`` attribute
    is ``kind`` and which states its :class:`~shoal.tiers.base.TierCapabilities` as a class
    attribute. ``where`` names where ``cls`` came from, for the message.
    """
    src = f" ({where})" if where else ""
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(
            f"tier kind {kind!r}{src}: {cls!r} is not a subclass of shoal.tiers.Tier; a tier class "
            f"derives from shoal.tiers.Tier (or one of the built-in tiers)"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ConfigError(
            f"tier kind {kind!r}{src}: {cls.__qualname__} is abstract; it does not implement {missing}"
        )
    if cls.kind != kind:
        raise ConfigError(
            f"tier kind {kind!r}{src}: {cls.__qualname__}.kind is {cls.kind!r}; set kind = {kind!r} on "
            f"the class (tiers report their kind in events and restore plans)"
        )
    caps = getattr(cls, "capabilities", None)
    if not isinstance(caps, TierCapabilities):
        raise ConfigError(
            f"tier kind {kind!r}{src}: {cls.__qualname__}.capabilities is {caps!r}; state the kind's "
            f"capabilities as a class attribute, e.g. capabilities = TierCapabilities(persistent=True, "
            f"host_local=True, atomic_rename=True)"
        )
    return cls


def register_tier(kind: str, cls: type[Tier] | str, *, replace: bool = False) -> None:
    """Make tier ``kind`` open as ``cls`` (a :class:`~shoal.tiers.base.Tier` subclass or ``"module:Class"``).

    A class is checked now (:func:`check_tier_class`); a ``"module:Class"`` string is imported
    and checked the first time the kind is used, so that its dependencies load only then.
    Raises :class:`~shoal.errors.ConfigError` for an invalid kind name, a kind already
    registered (built in or not) unless ``replace``, or a ``cls`` that cannot be a tier.
    """
    _check_kind(kind)
    if not replace:
        _check_free(kind)
    where = "register_tier"
    if isinstance(cls, str):
        if not _TARGET.fullmatch(cls):
            raise ConfigError(
                f"tier kind {kind!r}: {cls!r} does not name a class; write 'package.module:ClassName'"
            )
        entry: str | type[Tier] = cls
    elif isinstance(cls, type):
        entry = check_tier_class(kind, cls, where)
    else:
        raise ConfigError(
            f"tier kind {kind!r}: register_tier needs a Tier subclass or a 'package.module:ClassName' "
            f"string, got {type(cls).__name__} {cls!r}"
        )
    with _lock:
        if not replace:
            _check_free(kind)
        _registry[kind] = entry
        _resolved.pop(kind, None)


def _check_free(kind: str) -> None:
    current = _registry.get(kind)
    if current is not None:
        raise ConfigError(
            f"tier kind {kind!r} is already registered (as {_describe(current)}); choose another kind, "
            f"or pass replace=True to replace it"
        )


def unregister_tier(kind: str) -> None:
    """Remove a kind added with :func:`register_tier`; a replaced built-in kind gets its own class back.

    Raises :class:`~shoal.errors.ConfigError` for a kind not registered, or a built-in kind
    that was never replaced (built-in kinds cannot be removed).
    """
    with _lock:
        if kind not in _registry:
            raise ConfigError(f"tier kind {kind!r} is not registered; registered kinds are {_known()}")
        if kind in BUILT_IN_TIERS:
            if _registry[kind] == BUILT_IN_TIERS[kind]:
                raise ConfigError(f"tier kind {kind!r} is built in and cannot be unregistered")
            _registry[kind] = BUILT_IN_TIERS[kind]
        else:
            del _registry[kind]
        _resolved.pop(kind, None)


def _describe(entry: str | type[Tier]) -> str:
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


def tier_class(kind: str) -> type[Tier]:
    """The class implementing tier ``kind``; :class:`~shoal.errors.ConfigError` if there is none.

    A kind registered as ``"module:Class"`` is imported (and checked) here, once.
    """
    with _lock:
        try:
            done = _resolved.get(kind)
            entry = _registry[kind]
        except (KeyError, TypeError):
            raise ConfigError(f"unknown tier kind {kind!r}; known kinds are {_known()}") from None
    if done is not None:
        return done
    if isinstance(entry, str):
        module_name, _, class_name = entry.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(
                f"tier kind {kind!r}: cannot import module {module_name!r} (from {entry!r}): {e}"
            ) from e
        try:
            found = getattr(module, class_name)
        except AttributeError:
            raise ConfigError(
                f"tier kind {kind!r}: module {module_name!r} has no {class_name!r} (from {entry!r})"
            ) from None
        cls = check_tier_class(kind, found, entry)
    else:
        cls = entry
    with _lock:
        if _registry.get(kind) is entry:  # not replaced meanwhile
            _resolved[kind] = cls
    return cls


def read_preference(kind: str) -> int:
    """Where tier ``kind`` comes when a chunk can be read from several (lower first): its class's
    ``capabilities.read_preference``. :class:`~shoal.errors.ConfigError` for an unknown kind."""
    return tier_class(kind).capabilities.read_preference


def open_tier(kind: str, url: str, storage_options: Mapping[str, Any] | None = None) -> Tier:
    """Open a tier of ``kind`` (``"dram"``, ``"local"``, ``"shared"`` or a registered one) rooted at ``url``.

    ``storage_options`` go to fsspec and are only accepted by the ``shared`` tier.
    Opening does no I/O for ``dram`` and ``local``; roots are created on first write.
    Code that opens a tier for a *role* (the job's shared tier, ...) uses
    :func:`shoal.tiers.roles.open_role` instead, which picks the kind.
    """
    return tier_class(kind).from_url(url, storage_options)


__all__ = [
    "BUILT_IN_TIERS",
    "TIER_CLASSES",
    "check_tier_class",
    "open_tier",
    "read_preference",
    "register_tier",
    "tier_class",
    "unregister_tier",
]
