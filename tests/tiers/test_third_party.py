"""A third party's tier: one module (``memtier.py``), one registry line, one conformance subclass."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shoal.testing import TierTests
from shoal.tiers import Tier, open_tier, read_preference, register_tier, unregister_tier
from shoal.tiers.roles import Role, open_role

from .memtier import MemoryTier


@pytest.fixture(autouse=True, scope="module")
def _memory_kind() -> Iterator[None]:
    register_tier("memory", MemoryTier)  # the one registry line
    yield
    unregister_tier("memory")


class TestMemoryTier(TierTests):
    kind = "memory"

    @pytest.fixture
    def tier(self) -> Tier:
        return open_tier("memory", "memory://conformance")

    def _files(self, tier: Tier) -> dict[str, tuple[bytes, float]]:
        assert isinstance(tier, MemoryTier)
        return tier.files

    def write_around(self, tier: Tier, path: str, data: bytes) -> None:
        self._files(tier)[path] = (data, 0.0)

    def read_around(self, tier: Tier, path: str) -> bytes | None:
        entry = self._files(tier).get(path)
        return None if entry is None else entry[0]

    def files_around(self, tier: Tier) -> list[str]:
        return sorted(self._files(tier))


def test_the_registered_kind_is_read_first_and_can_stage() -> None:
    assert read_preference("memory") == 0  # derived: a volatile host tier
    staging = open_role(Role.STAGING, "memory://staging", kind="memory")
    assert isinstance(staging, MemoryTier)
    host_copy = open_role(Role.HOST_COPY, "memory://copy", kind="memory")
    assert isinstance(host_copy, MemoryTier)
