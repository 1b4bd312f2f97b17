"""Roles: staging, host copy and shared map to tier kinds in one place, and each role's needs are checked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.errors import ConfigError
from shoal.tiers import TierCapabilities, register_tier, unregister_tier
from shoal.tiers.dram import DramTier
from shoal.tiers.local import PosixTier
from shoal.tiers.roles import (
    HOST_COPY,
    ROLE_KINDS,
    SHARED,
    STAGING,
    Role,
    as_role,
    check_role_kind,
    kind_for,
    open_role,
)
from shoal.tiers.shared import FsspecTier

from .memtier import MemoryTier


class _SharedInMemory(MemoryTier):
    kind = "shared"


class _VolatileJobWide(MemoryTier):
    kind = "volatile_net"
    capabilities = TierCapabilities(persistent=False, host_local=False, atomic_rename=False)


@pytest.fixture
def shared_in_memory() -> Iterator[None]:
    register_tier("shared", _SharedInMemory, replace=True)
    yield
    unregister_tier("shared")


def test_each_role_has_one_kind() -> None:
    assert dict(ROLE_KINDS) == {STAGING: "dram", HOST_COPY: "local", SHARED: "shared"}
    assert [kind_for(r) for r in Role] == ["dram", "local", "shared"]
    assert kind_for("host_copy") == "local"
    assert as_role("staging") is STAGING


def test_an_unknown_role_names_the_roles() -> None:
    with pytest.raises(
        ConfigError, match="unknown tier role 'scratch'; the roles are staging, host_copy, shared"
    ):
        kind_for("scratch")


def test_open_role_opens_the_kind_that_plays_it(tmp_path: Path, shm_path: Path) -> None:
    assert type(open_role(SHARED, str(tmp_path / "shared"))) is FsspecTier
    assert type(open_role(HOST_COPY, str(tmp_path / "local"))) is PosixTier
    assert type(open_role(HOST_COPY, str(shm_path / "copy"), kind="dram")) is DramTier  # replicate_to="dram"
    assert type(open_role(STAGING, str(shm_path / "stage"))) is DramTier


@pytest.mark.parametrize(
    ("role", "kind", "message"),
    [
        (STAGING, "local", "'local' \\(PosixTier\\) cannot be the staging tier: it keeps no slabs"),
        (STAGING, "shared", "cannot be the staging tier: it is not host-local"),
        (HOST_COPY, "shared", "cannot be the host_copy tier: it is not host-local"),
        (SHARED, "dram", "'dram' \\(DramTier\\) cannot be the shared tier: it is host-local"),
        (SHARED, "nvme", "unknown tier kind 'nvme'"),
    ],
)
def test_a_kind_that_cannot_play_a_role_is_refused(
    role: Role, kind: str, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_role_kind(role, kind)
    with pytest.raises(ConfigError, match=message):
        open_role(role, str(tmp_path / "x"), kind=kind)
    assert not (tmp_path / "x").exists()


def test_the_kinds_of_the_roles_can_play_them() -> None:
    for role in Role:
        assert check_role_kind(role, kind_for(role)) == kind_for(role)


@pytest.mark.usefixtures("shared_in_memory")
def test_a_replaced_kind_is_checked_against_its_role() -> None:
    with pytest.raises(
        ConfigError, match="'shared' \\(_SharedInMemory\\) cannot be the shared tier: it is host-local"
    ):
        open_role(SHARED, "memory://x")


def test_the_shared_role_needs_a_persistent_tier() -> None:
    register_tier("volatile_net", _VolatileJobWide)
    try:
        with pytest.raises(ConfigError, match="cannot be the shared tier: it is not persistent"):
            open_role(SHARED, "memory://x", kind="volatile_net")
    finally:
        unregister_tier("volatile_net")
