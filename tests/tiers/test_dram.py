"""The DRAM tier: slabs (reused, growable, pre-faulted) and clear out-of-memory errors."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from shoal.errors import InsufficientMemory, InvalidName
from shoal.tiers.dram import PAGE, DramTier, prefault


def _free_bytes(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def test_slab_buffer_is_writable_and_page_rounded(shm_path: Path) -> None:
    tier = DramTier(shm_path)
    slab = tier.open_slab("slot-0", 10_000)
    assert slab.capacity >= 10_000 and slab.capacity % PAGE == 0
    buf = slab.buffer
    assert not buf.readonly and buf.nbytes == slab.capacity
    buf[:5] = b"hello"
    assert bytes(slab.buffer[:5]) == b"hello"
    assert os.path.getsize(tier.slab_path("slot-0")) == slab.capacity
    del buf
    tier.close()


def test_slab_file_is_reused_after_reopening(shm_path: Path) -> None:
    tier = DramTier(shm_path)
    first = tier.open_slab("s", PAGE)
    first.buffer[:4] = b"keep"
    first.close()
    second = DramTier(shm_path).open_slab("s", PAGE)
    assert bytes(second.buffer[:4]) == b"keep"
    assert second.path == first.path
    assert os.listdir(shm_path / "slabs") == ["s.slab"]
    second.close()


def test_slab_grows_keeping_its_content(shm_path: Path) -> None:
    slab = DramTier(shm_path).open_slab("s", PAGE)
    slab.buffer[PAGE - 3 : PAGE] = b"end"
    old_view = slab.buffer  # an outstanding view must not break growing
    slab.ensure(3 * PAGE + 1)
    assert slab.capacity == 4 * PAGE
    assert bytes(slab.buffer[PAGE - 3 : PAGE]) == b"end"
    assert bytes(slab.buffer[PAGE:]) == bytes(3 * PAGE)
    slab.buffer[-1:] = b"x"
    slab.ensure(PAGE)  # never shrinks
    assert slab.capacity == 4 * PAGE
    assert bytes(old_view[PAGE - 3 : PAGE]) == b"end"
    del old_view
    slab.close()
    slab.close()


def test_huge_slab_raises_insufficient_memory_with_both_numbers(shm_path: Path) -> None:
    tier = DramTier(shm_path)
    free = _free_bytes(shm_path)
    huge = 10 * max(free, 1 << 30)
    with pytest.raises(InsufficientMemory) as err:
        tier.open_slab("huge", huge)
    message = str(err.value)
    assert str(huge) in message
    assert "free" in message and str(shm_path) in message
    assert any(str(n) in message for n in range(free - (64 << 20), free + (64 << 20), PAGE))
    assert isinstance(err.value, MemoryError)
    assert not os.path.exists(tier.slab_path("huge"))


def test_growing_past_free_space_leaves_the_slab_as_it_was(shm_path: Path) -> None:
    tier = DramTier(shm_path)
    slab = tier.open_slab("s", PAGE)
    slab.buffer[:2] = b"ok"
    with pytest.raises(InsufficientMemory):
        slab.ensure(10 * max(_free_bytes(shm_path), 1 << 30))
    assert slab.capacity == PAGE
    assert os.path.getsize(slab.path) == PAGE
    assert bytes(slab.buffer[:2]) == b"ok"
    slab.close()


def test_allocation_failure_removes_a_new_slab_file(shm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When free space looked sufficient but allocation still fails, nothing big is left behind."""

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    tier = DramTier(shm_path)
    with pytest.raises(InsufficientMemory, match=r"needs \d+ bytes"):
        tier.open_slab("s", 16 * PAGE)
    assert not os.path.exists(tier.slab_path("s"))


def test_prefault_keeps_content_without_madvise(shm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shoal.tiers.dram as dram

    slab = DramTier(shm_path).open_slab("s", 4 * PAGE)
    slab.buffer[PAGE : PAGE + 3] = b"abc"
    monkeypatch.setattr(dram, "_MADV_POPULATE_WRITE", None)
    assert slab._mmap is not None
    prefault(slab._mmap, 0, slab.capacity)
    assert bytes(slab.buffer[PAGE : PAGE + 3]) == b"abc"
    slab.close()


def test_slabs_are_not_tier_files(shm_path: Path) -> None:
    tier = DramTier(shm_path)
    slab = tier.open_slab("s", PAGE)
    tier.write("packs/p.pack", b"x")
    assert tier.list() == ["packs/p.pack"]
    assert tier.list("slabs/") == []
    with pytest.raises(InvalidName, match="slabs"):
        tier.write("slabs/s.slab", b"x")
    with pytest.raises(InvalidName, match="slab name"):
        tier.open_slab("../escape", PAGE)
    slab.close()
    tier.delete_slab("s")
    tier.delete_slab("s")
    assert not os.path.exists(tier.slab_path("s"))


def test_dram_tier_is_volatile_and_does_not_fsync(shm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    tier = DramTier(shm_path)
    tier.write("a/b", b"x")
    assert calls == []
    assert tier.capabilities.persistent is False
    assert tier.capabilities.host_local is True


def test_a_full_tmpfs_on_write_is_insufficient_memory(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    tier = DramTier(shm_path)
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(InsufficientMemory, match="packs/p.pack"):
        tier.write("packs/p.pack", b"x")
    monkeypatch.undo()
    assert tier.list() == []


def test_a_failed_prefault_gives_the_memory_back(shm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shoal.tiers.dram as dram

    def failing_prefault(mm: object, start: int, stop: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    tier = DramTier(shm_path)
    slab = tier.open_slab("s", PAGE)
    monkeypatch.setattr(dram, "prefault", failing_prefault)
    with pytest.raises(InsufficientMemory):
        slab.ensure(64 * PAGE)
    assert os.path.getsize(slab.path) == PAGE and slab.capacity == PAGE
    slab.close()


def test_an_exclusive_slab_is_never_written_through_a_file_that_was_there(shm_path: Path) -> None:
    from shoal.errors import OwnershipError

    tier = DramTier(shm_path)
    tier.open_slab("s", PAGE).close()
    with pytest.raises(OwnershipError, match="already exists"):
        tier.open_slab("s", PAGE, exclusive=True)
    os.symlink(shm_path / "elsewhere", shm_path / "slabs" / "t.slab")
    with pytest.raises(OwnershipError, match="symbolic link"):
        tier.open_slab("t", PAGE)
    assert not (shm_path / "elsewhere").exists()
