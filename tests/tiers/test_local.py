"""The local (POSIX) tier: rename + fsync commits, error wrapping, root handling."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.errors import InvalidName, MissingFile, TierError
from shoal.tiers.files import AtomicRenameCommit, is_temp_name, temp_sibling
from shoal.tiers.local import PosixTier


def test_root_is_not_created_until_the_first_write(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    tier = PosixTier(root)
    assert tier.list() == []
    assert not tier.exists("x")
    assert not root.exists()
    tier.write("x", b"1")
    assert (root / "x").read_bytes() == b"1"


def test_file_url_is_accepted(tmp_path: Path) -> None:
    tier = PosixTier(f"file://{tmp_path}/r")
    assert tier.url == f"{tmp_path}/r"


def test_root_under_a_regular_file_fails_on_write_naming_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    tier = PosixTier(tmp_path / "file" / "root")
    with pytest.raises(TierError) as err:
        tier.write("packs/p.pack", b"x")
    assert "packs/p.pack" in str(err.value)
    assert str(tmp_path / "file" / "root") in str(err.value)
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(MissingFile):
        tier.read("packs/p.pack")


def test_write_fsyncs_the_file_and_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    tier = PosixTier(tmp_path / "root")
    tier.write("steps/1/manifest.json", b"{}")
    directory = str(tmp_path / "root" / "steps" / "1")
    temp_files = [p for p in synced if is_temp_name(os.path.basename(p))]
    assert len(temp_files) == 1 and os.path.dirname(temp_files[0]) == directory
    assert synced[-1] == directory  # the rename is made durable last
    # each directory created on the way is made durable in its parent
    assert str(tmp_path / "root") in synced and str(tmp_path) in synced


def test_failed_write_removes_its_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = PosixTier(tmp_path)
    tier.write("f", b"old")

    def failing_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device", dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(TierError, match="ENOSPC"):
        tier.write("f", b"new")
    assert sorted(os.listdir(tmp_path)) == ["f"]
    assert tier.read("f") == b"old"


def test_partial_os_writes_are_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def trickle(fd: int, data: memoryview) -> int:
        return real_write(fd, data[:3])

    monkeypatch.setattr(os, "write", trickle)
    tier = PosixTier(tmp_path)
    assert tier.write("f", [b"0123456789", memoryview(b"abcdefgh")]) == 18
    monkeypatch.undo()
    assert tier.read("f") == b"0123456789abcdefgh"


def test_typed_buffers_are_written_as_their_bytes(tmp_path: Path) -> None:
    import numpy as np

    tier = PosixTier(tmp_path)
    array = np.arange(6, dtype=np.float32)
    # typed views are cast to bytes; the strided one is the only part that is copied
    tier.write("a", [array.data, array[::2].data])
    expected = array.tobytes() + array[::2].tobytes()
    assert tier.read("a") == expected


def test_read_range_into_accepts_typed_views(tmp_path: Path) -> None:
    import numpy as np

    tier = PosixTier(tmp_path)
    tier.write("a", np.arange(4, dtype=np.int32).tobytes())
    out = np.zeros(2, dtype=np.int32)
    tier.read_range_into("a", 4, memoryview(out.data))
    assert out.tolist() == [1, 2]
    with pytest.raises(ValueError, match="writable"):
        tier.read_range_into("a", 0, memoryview(b"1234"))
    with pytest.raises(ValueError, match="offset"):
        tier.read_range("a", -1, 2)


def test_temp_files_are_not_listed_and_their_names_refused(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path)
    tier.write("d/f", b"x")
    leftover = temp_sibling(str(tmp_path / "d" / "f"))
    Path(leftover).write_bytes(b"partial")  # what a crashed writer leaves behind
    assert tier.list() == ["d/f"]
    with pytest.raises(InvalidName, match="temporary"):
        tier.write("d/" + os.path.basename(leftover), b"x")


def test_a_directory_in_the_way_is_a_tier_error(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path)
    tier.write("d/f", b"x")
    with pytest.raises(TierError, match="'d'"):
        tier.write("d", b"x")
    with pytest.raises(TierError):
        tier.delete("d")


def test_commit_strategy_reports_rename() -> None:
    assert AtomicRenameCommit().atomic_rename is True
    assert PosixTier("/nonexistent/x").capabilities.atomic_rename


def test_directories_are_created_private_and_files_0600(tmp_path):
    tier = PosixTier(tmp_path / "base" / "job" / "host", base=tmp_path / "base")
    tier.write("steps/1/manifest.json", b"{}")
    for p in [tmp_path / "base", *(tmp_path / "base").rglob("*")]:
        mode = p.stat().st_mode & 0o777
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_a_symlink_in_a_host_tier_is_never_read_and_a_write_replaces_it_without_following(tmp_path):
    from shoal.errors import OwnershipError

    secret = tmp_path / "secret"
    secret.write_bytes(b"do not touch")
    tier = PosixTier(tmp_path / "root")
    tier.write("a", b"x")
    os.symlink(secret, tmp_path / "root" / "link")
    with pytest.raises(OwnershipError, match="symbolic link"):
        tier.read("link")
    with pytest.raises(OwnershipError, match="symbolic link"):
        tier.info("link")
    assert not tier.exists("link") and "link" not in tier.list()
    tier.write("link", b"new")
    assert secret.read_bytes() == b"do not touch"
    assert not os.path.islink(tmp_path / "root" / "link") and tier.read("link") == b"new"


def test_a_file_others_can_write_is_refused(tmp_path):
    from shoal.errors import OwnershipError

    tier = PosixTier(tmp_path / "root")
    tier.write("a", b"x")
    os.chmod(tmp_path / "root" / "a", 0o666)
    with pytest.raises(OwnershipError, match="writable by other users") as info:
        tier.read("a")
    assert "0666" in str(info.value)


def test_an_existing_directory_on_the_way_is_checked(tmp_path):
    from shoal.errors import OwnershipError

    (tmp_path / "base" / "job").mkdir(parents=True)
    os.chmod(tmp_path / "base" / "job", 0o777)
    tier = PosixTier(tmp_path / "base" / "job" / "host", base=tmp_path / "base")
    with pytest.raises(OwnershipError, match="job"):
        tier.write("x", b"1")
