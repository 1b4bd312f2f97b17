"""The tier registry: kinds map to lazily imported classes; unknown kinds fail clearly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal.errors import ConfigError
from shoal.tiers import TIER_CLASSES, Tier, open_tier, tier_class
from shoal.tiers.dram import DramTier
from shoal.tiers.local import PosixTier
from shoal.tiers.shared import FsspecTier


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
