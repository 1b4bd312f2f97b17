"""The shared (fsspec) tier: commit strategy per file system, uploads that fail leave nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.errors import MissingFile, TierError
from shoal.testing.s3 import S3Admin
from shoal.tiers.files import AtomicRenameCommit
from shoal.tiers.shared import FsspecTier, ObjectPutCommit

MiB = 1 << 20


class Boom(RuntimeError):
    pass


def _failing_after(parts: list[bytes]) -> Iterator[bytes]:
    yield from parts
    raise Boom("source failed")


def _bucket_of(url: str) -> str:
    return url.removeprefix("s3://").split("/", 1)[0]


def test_object_store_commits_with_one_upload(s3_url: str, s3_options: dict[str, Any]) -> None:
    tier = FsspecTier(s3_url, s3_options)
    assert isinstance(tier._commit, ObjectPutCommit)
    assert tier.capabilities.atomic_rename is False
    assert tier.capabilities.persistent and not tier.capabilities.host_local


def test_local_path_commits_with_rename_and_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    tier = FsspecTier(str(tmp_path / "shared"))
    assert isinstance(tier._commit, AtomicRenameCommit)
    assert tier.capabilities.atomic_rename is True
    tier.write("steps/1/COMMIT", b"{}")
    assert synced[-1] == str(tmp_path / "shared" / "steps" / "1")
    assert (tmp_path / "shared" / "steps" / "1" / "COMMIT").read_bytes() == b"{}"


def test_failed_single_put_leaves_no_object(
    s3_url: str, s3_options: dict[str, Any], s3_admin: S3Admin
) -> None:
    tier = FsspecTier(s3_url, s3_options)
    with pytest.raises(Boom):
        tier.write("packs/p.pack", _failing_after([b"x" * 1000]))
    assert s3_admin.list_objects(_bucket_of(s3_url)) == []


def test_failed_multipart_upload_is_aborted(
    s3_url: str, s3_options: dict[str, Any], s3_admin: S3Admin
) -> None:
    tier = FsspecTier(s3_url, {**s3_options, "default_block_size": 5 * MiB})
    tier.write("packs/p.pack", b"old")
    aborted: list[str] = []
    real_abort = tier.fs.abort_mpu

    def recording_abort(bucket: str, key: str, upload_id: str) -> None:
        aborted.append(key)
        real_abort(bucket, key, upload_id)

    tier.fs.abort_mpu = recording_abort
    with pytest.raises(Boom):
        tier.write("packs/p.pack", _failing_after([os.urandom(6 * MiB), os.urandom(6 * MiB)]))
    assert aborted == ["root/packs/p.pack"]  # a multipart upload was started, then aborted
    bucket = _bucket_of(s3_url)
    assert s3_admin.list_multipart_uploads(bucket) == []
    assert s3_admin.list_objects(bucket) == ["root/packs/p.pack"]
    assert tier.read("packs/p.pack") == b"old"


def test_multipart_upload_round_trips(s3_url: str, s3_options: dict[str, Any]) -> None:
    tier = FsspecTier(s3_url, {**s3_options, "default_block_size": 5 * MiB})
    parts = [os.urandom(3 * MiB) for _ in range(4)]
    assert tier.write("big", parts) == 12 * MiB
    assert tier.read("big") == b"".join(parts)


def test_listings_are_never_cached(s3_url: str, s3_options: dict[str, Any], s3_admin: S3Admin) -> None:
    tier = FsspecTier(s3_url, s3_options)
    tier.write("steps/1/manifest.json", b"{}")
    assert tier.list("steps/") == ["steps/1/manifest.json"]
    assert tier.exists("steps/1/manifest.json")
    s3_admin.put_object(_bucket_of(s3_url), "root/steps/2/manifest.json", b"{}")  # another host
    assert tier.list("steps/") == ["steps/1/manifest.json", "steps/2/manifest.json"]
    s3_admin.client.delete_object(Bucket=_bucket_of(s3_url), Key="root/steps/1/manifest.json")
    assert not tier.exists("steps/1/manifest.json")
    with pytest.raises(MissingFile):
        tier.info("steps/1/manifest.json")


def test_each_tier_has_its_own_file_system(s3_url: str, s3_options: dict[str, Any]) -> None:
    assert FsspecTier(s3_url, s3_options).fs is not FsspecTier(s3_url, s3_options).fs


def test_info_reports_a_real_mtime(s3_url: str, s3_options: dict[str, Any], tmp_path: Path) -> None:
    for tier in (FsspecTier(s3_url, s3_options), FsspecTier(str(tmp_path))):
        tier.write("f", b"abc")
        info = tier.info("f")
        assert info.size == 3
        assert info.mtime > 1e9


def test_missing_bucket_is_a_tier_error_naming_the_url(s3_endpoint: str, s3_options: dict[str, Any]) -> None:
    url = "s3://no-such-bucket-shoal/root"
    tier = FsspecTier(url, s3_options)
    with pytest.raises(TierError) as err:
        tier.write("f", b"x")
    assert url in str(err.value) and "'f'" in str(err.value)


def test_unknown_protocol_is_a_tier_error() -> None:
    with pytest.raises(TierError, match="nosuchproto"):
        FsspecTier("nosuchproto://bucket/root")
