"""The tier registry: kinds map to lazily imported classes; unknown kinds, bad registrations fail clearly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.errors import ConfigError
from shoal.tiers import (
    AUTO,
    BUILT_IN_TIERS,
    TIER_CLASSES,
    SlabLike,
    SlabStore,
    Tier,
    TierCapabilities,
    open_tier,
    read_preference,
    register_tier,
    tier_class,
    unregister_tier,
)
from shoal.tiers.dram import DramTier
from shoal.tiers.local import PosixTier
from shoal.tiers.shared import FsspecTier

from .memtier import MemoryTier


@pytest.mark.parametrize(("kind", "cls"), [("dram", DramTier), ("local", PosixTier), ("shared", FsspecTier)])
def test_each_kind_opens_its_class(kind: str, cls: type[Tier], tmp_path: Path) -> None:
    tier = open_tier(kind, str(tmp_path / kind))
    assert type(tier) is cls
    assert tier.kind == kind
    assert tier_class(kind) is cls


def test_registry_lists_exactly_the_built_in_kinds() -> None:
    assert sorted(TIER_CLASSES) == ["dram", "local", "shared"]


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown tier kind 'nvme'.*dram, local, shared"):
        open_tier("nvme", "/tmp/x")


def test_storage_options_reach_the_shared_tier(s3_url: str, s3_options: dict[str, Any]) -> None:
    tier = open_tier("shared", s3_url, s3_options)
    assert isinstance(tier, FsspecTier)
    tier.write("f", b"1")
    assert tier.read("f") == b"1"


def test_host_tiers_refuse_storage_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="takes no storage options"):
        open_tier("local", str(tmp_path), {"key": "x"})


# -- third-party registration ----------------------------------------------------------------


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Undo every registration a test makes (third-party kinds removed, built-ins restored)."""
    yield
    for kind, entry in list(TIER_CLASSES.items()):
        if kind not in BUILT_IN_TIERS or entry != BUILT_IN_TIERS[kind]:
            unregister_tier(kind)
    assert dict(TIER_CLASSES) == dict(BUILT_IN_TIERS)


class _NoCapabilities(MemoryTier):
    kind = "nocaps"
    capabilities = None  # type: ignore[assignment]


class _Abstract(Tier):
    kind = "abstract_one"
    capabilities = TierCapabilities(persistent=True, host_local=True, atomic_rename=True)


class _SharedInMemory(MemoryTier):
    kind = "shared"


@pytest.mark.usefixtures("clean_registry")
def test_a_registered_class_opens_by_its_kind(tmp_path: Path) -> None:
    register_tier("memory", MemoryTier)
    assert TIER_CLASSES["memory"] is MemoryTier
    assert tier_class("memory") is MemoryTier
    tier = open_tier("memory", "memory://x")
    assert isinstance(tier, MemoryTier) and tier.kind == "memory"
    unregister_tier("memory")
    with pytest.raises(ConfigError, match="unknown tier kind 'memory'"):
        open_tier("memory", "memory://x")


@pytest.mark.usefixtures("clean_registry")
def test_a_module_class_string_is_imported_when_first_used() -> None:
    register_tier("memory", f"{MemoryTier.__module__}:MemoryTier")
    assert TIER_CLASSES["memory"] == f"{MemoryTier.__module__}:MemoryTier"
    assert tier_class("memory") is MemoryTier
    assert read_preference("memory") == 0


@pytest.mark.usefixtures("clean_registry")
def test_a_kind_is_registered_once_unless_replaced() -> None:
    register_tier("memory", MemoryTier)
    with pytest.raises(ConfigError, match=r"tier kind 'memory' is already registered.*replace=True"):
        register_tier("memory", MemoryTier)
    with pytest.raises(ConfigError, match="'dram' is already registered .*shoal.tiers.dram:DramTier"):
        register_tier("dram", "my_pkg.tiers:Dram")
    register_tier("memory", f"{MemoryTier.__module__}:MemoryTier", replace=True)
    assert isinstance(TIER_CLASSES["memory"], str)


@pytest.mark.parametrize("kind", ["", "Dram", "a:b", "nvme-1", "1st", "x" * 33, 3, None])
def test_kind_names_are_checked(kind: object) -> None:
    with pytest.raises(ConfigError, match="is not a valid name"):
        register_tier(kind, MemoryTier)  # type: ignore[arg-type]
    assert dict(TIER_CLASSES) == dict(BUILT_IN_TIERS)


@pytest.mark.parametrize(
    ("kind", "cls", "message"),
    [
        ("thing", dict, "dict'> is not a subclass of shoal.tiers.Tier"),
        ("thing", 42, "needs a Tier subclass or a 'package.module:ClassName' string, got int 42"),
        ("abstract_one", _Abstract, "_Abstract is abstract; it does not implement delete, exists"),
        ("nocaps", _NoCapabilities, r"_NoCapabilities.capabilities is None; state the kind's capabilities"),
        ("other", MemoryTier, "MemoryTier.kind is 'memory'; set kind = 'other' on the class"),
        ("thing", "no_colon", "'no_colon' does not name a class; write 'package.module:ClassName'"),
        ("thing", "pkg.mod:", "does not name a class"),
        ("thing", "pkg..mod:Cls", "does not name a class"),
    ],
)
def test_what_cannot_be_a_tier_is_refused_at_registration(kind: str, cls: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        register_tier(kind, cls)  # type: ignore[arg-type]
    assert kind not in TIER_CLASSES


@pytest.mark.usefixtures("clean_registry")
@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "no_such_module_for_shoal:Tier",
            "tier kind 'late': cannot import module 'no_such_module_for_shoal'",
        ),
        ("shoal.tiers.base:Nope", "tier kind 'late': module 'shoal.tiers.base' has no 'Nope'"),
        ("collections:OrderedDict", r"tier kind 'late' \(collections:OrderedDict\): .* is not a subclass"),
        ("shoal.tiers.local:PosixTier", "PosixTier.kind is 'local'; set kind = 'late' on the class"),
    ],
)
def test_a_bad_module_class_string_fails_clearly_when_used(target: str, message: str) -> None:
    register_tier("late", target)
    for _ in range(2):  # not cached as if it had worked
        with pytest.raises(ConfigError, match=message):
            open_tier("late", "/tmp/x")
    with pytest.raises(ConfigError, match=message):
        read_preference("late")


@pytest.mark.usefixtures("clean_registry")
def test_a_replaced_built_in_kind_comes_back_when_unregistered() -> None:
    register_tier("shared", _SharedInMemory, replace=True)
    assert tier_class("shared") is _SharedInMemory
    unregister_tier("shared")
    assert tier_class("shared") is FsspecTier
    with pytest.raises(ConfigError, match="'shared' is built in and cannot be unregistered"):
        unregister_tier("shared")
    with pytest.raises(ConfigError, match="'memory' is not registered; registered kinds are dram, local"):
        unregister_tier("memory")


def test_read_preference_comes_from_the_classes() -> None:
    assert [read_preference(k) for k in ("dram", "local", "shared")] == [0, 1, 2]
    assert read_preference("local") == PosixTier.capabilities.read_preference
    with pytest.raises(ConfigError, match="unknown tier kind 'nvme'"):
        read_preference("nvme")


# -- capabilities ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("persistent", "host_local", "expected"),
    [(False, True, 0), (True, True, 1), (True, False, 2), (False, False, 2)],
)
def test_read_preference_is_derived_unless_stated(persistent: bool, host_local: bool, expected: int) -> None:
    caps = TierCapabilities(persistent=persistent, host_local=host_local, atomic_rename=True)
    assert caps.read_preference == expected
    assert TierCapabilities(persistent, host_local, True, read_preference=7).read_preference == 7
    assert TierCapabilities(persistent, host_local, True, read_preference=AUTO).read_preference == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"read_preference": -2}, "read_preference must be an int >= 0"),
        ({"read_preference": 1.5}, "read_preference must be an int >= 0"),
        ({"read_preference": True}, "read_preference must be an int >= 0"),
        ({"persistent": 1}, "TierCapabilities.persistent must be True or False, got 1"),
        ({"host_local": None}, "TierCapabilities.host_local must be True or False"),
    ],
)
def test_capabilities_are_checked(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"persistent": True, "host_local": True, "atomic_rename": True, **kwargs}
    with pytest.raises(ConfigError, match=message):
        TierCapabilities(**args)


def test_the_slab_capability_is_a_protocol(tmp_path: Path, shm_path: Path) -> None:
    dram = DramTier(shm_path)
    assert isinstance(dram, SlabStore)
    assert not isinstance(PosixTier(tmp_path), SlabStore)
    assert not isinstance(FsspecTier(str(tmp_path)), SlabStore)
    slab = dram.open_slab("s", 10)
    assert isinstance(slab, SlabLike)
    assert not isinstance(object(), SlabLike)
    slab.close()
