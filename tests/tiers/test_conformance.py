"""Every built-in tier passes the conformance suite shipped in :mod:`shoal.testing`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from shoal.testing import TierTests
from shoal.testing.s3 import S3Admin
from shoal.tiers.base import Tier
from shoal.tiers.dram import DramTier
from shoal.tiers.local import PosixTier
from shoal.tiers.shared import FsspecTier


class PosixAround:
    """Ground truth for tiers rooted at a local directory: plain file I/O under the root."""

    def _root(self, tier: Tier) -> Path:
        return Path(getattr(tier, "root", None) or tier.url)

    def write_around(self, tier: Tier, path: str, data: bytes) -> None:
        target = self._root(tier) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def read_around(self, tier: Tier, path: str) -> bytes | None:
        target = self._root(tier) / path
        return target.read_bytes() if target.is_file() else None

    def files_around(self, tier: Tier) -> list[str]:
        root = self._root(tier)
        if not root.exists():
            return []
        return sorted(
            os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files
        )


class TestPosixTier(PosixAround, TierTests):
    kind = "local"

    @pytest.fixture
    def tier(self, tmp_path: Path) -> PosixTier:
        return PosixTier(tmp_path / "root")


class TestDramTier(PosixAround, TierTests):
    kind = "dram"

    @pytest.fixture
    def tier(self, shm_path: Path) -> DramTier:
        return DramTier(shm_path / "root")


class TestFsspecFileTier(TierTests):
    kind = "shared"

    @pytest.fixture
    def tier(self, tmp_path: Path) -> FsspecTier:
        return FsspecTier(f"file://{tmp_path}/root")

    def _root(self, tier: Tier) -> Path:
        return Path(tier.url.removeprefix("file://"))

    write_around = PosixAround.write_around
    read_around = PosixAround.read_around
    files_around = PosixAround.files_around


class TestFsspecS3Tier(TierTests):
    kind = "shared"

    @pytest.fixture
    def tier(self, s3_url: str, s3_options: dict[str, Any], s3_admin: S3Admin) -> FsspecTier:
        self.admin = s3_admin
        return FsspecTier(s3_url, s3_options)

    def _bucket_key(self, tier: Tier, path: str = "") -> tuple[str, str]:
        bucket, _, prefix = tier.url.removeprefix("s3://").partition("/")
        return bucket, f"{prefix}/{path}"

    def write_around(self, tier: Tier, path: str, data: bytes) -> None:
        self.admin.put_object(*self._bucket_key(tier, path), data)

    def read_around(self, tier: Tier, path: str) -> bytes | None:
        return self.admin.get_object(*self._bucket_key(tier, path))

    def files_around(self, tier: Tier) -> list[str]:
        bucket, prefix = self._bucket_key(tier)
        return [key.removeprefix(prefix) for key in self.admin.list_objects(bucket, prefix)]
