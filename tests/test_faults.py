"""Bad input gets a clear error, and nothing is lost: corruption, bad names, failing storage."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import shoal
from shoal import failpoints
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import Pointer
from shoal.testing.checkpoints import assert_state_equal, make_config, zeros_like_state


@pytest.fixture
def config(tmp_path, dram_root) -> shoal.Config:
    return make_config(tmp_path, dram_root)


@pytest.fixture(autouse=True)
def _disarm():
    yield
    failpoints.configure(None)


def _saved(config, state, step=1):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(step, state).wait(timeout=60)
        return ckpt.shared.url


def _packs(shared_url):
    root = os.path.join(shared_url, layout.PACKS_DIR)
    return sorted(os.path.join(root, p) for p in os.listdir(root) if p.endswith(".pack"))


def test_a_flipped_byte_is_never_loaded_and_the_error_names_item_pack_and_offset(config):
    state = {"w": torch.randn(50_000)}
    url = _saved(config, state)
    (pack,) = _packs(url)
    with open(pack, "r+b") as f:
        f.seek(70_000)
        b = f.read(1)
        f.seek(70_000)
        f.write(bytes([b[0] ^ 0x01]))
    target = {"w": torch.zeros(50_000)}
    with shoal.Checkpointer(config) as ckpt, pytest.raises(shoal.ChecksumMismatch) as err:
        ckpt.load(target)
    msg = str(err.value)
    assert "'w'" in msg and os.path.basename(pack) in msg and "offset 65536" in msg
    # the verified-before-copy read never let the bad chunk reach the tensor
    assert torch.count_nonzero(target["w"][16384:32768]) == 0


def test_a_missing_pack_is_reported_by_name(config):
    url = _saved(config, {"w": torch.randn(1000)})
    (pack,) = _packs(url)
    os.remove(pack)
    with (
        shoal.Checkpointer(config) as ckpt,
        pytest.raises(shoal.CheckpointNotFound, match=os.path.basename(pack)),
    ):
        ckpt.load({"w": torch.zeros(1000)})


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _rewrite_manifest(url: str, step: int, data: bytes) -> None:
    """Replace a manifest and re-point COMMIT and LATEST at it (as a newer writer would)."""
    with open(os.path.join(url, layout.manifest_path(step)), "wb") as f:
        f.write(data)
    ptr = Pointer(step, digest(data)).encode()
    for p in (layout.commit_path(step), layout.LATEST):
        with open(os.path.join(url, p), "wb") as f:
            f.write(ptr)


def test_a_truncated_manifest_is_refused(config):
    url = _saved(config, {"w": torch.randn(1000)})
    path = os.path.join(url, layout.manifest_path(1))
    data = _read(path)
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with shoal.Checkpointer(config) as ckpt, pytest.raises(shoal.ChecksumMismatch, match="manifest"):
        ckpt.load({"w": torch.zeros(1000)})
    _rewrite_manifest(url, 1, data[: len(data) // 2])  # consistent pointers: the JSON itself is bad
    with shoal.Checkpointer(config) as ckpt, pytest.raises(shoal.FormatError, match="not valid JSON"):
        ckpt.load({"w": torch.zeros(1000)})


def test_a_malformed_manifest_names_the_bad_field(config):
    url = _saved(config, {"w": torch.randn(1000)})
    doc = json.loads(_read(os.path.join(url, layout.manifest_path(1))))
    doc["items"]["w"]["nbytes"] = -4
    _rewrite_manifest(url, 1, json.dumps(doc).encode())
    with shoal.Checkpointer(config) as ckpt, pytest.raises(shoal.FormatError, match=r"items\['w'\]\.nbytes"):
        ckpt.load({"w": torch.zeros(1000)})


def test_a_manifest_of_a_newer_major_format_is_refused(config):
    url = _saved(config, {"w": torch.randn(1000)})
    doc = json.loads(_read(os.path.join(url, layout.manifest_path(1))))
    doc["format"] = "shoal/2.0"
    _rewrite_manifest(url, 1, json.dumps(doc).encode())
    with shoal.Checkpointer(config) as ckpt, pytest.raises(shoal.UnsupportedFormat, match="upgrade shoal"):
        ckpt.load({"w": torch.zeros(1000)})


@pytest.mark.parametrize("key", ["a/../b", "/etc/passwd", "bad\x00name", ".."])
def test_unsafe_item_names_are_refused_before_anything_is_written(config, key):
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.InvalidName):
            ckpt.save(1, {key: torch.ones(4)})
        assert ckpt.shared.list() == ["RUN"]  # nothing but the run's record, written at construction
        # the refused save released its slot: the next save goes through
        ckpt.save(1, {"fine": torch.ones(4)}).wait(timeout=60)


def test_dram_tier_too_small_says_how_many_bytes_are_needed_and_free(config, monkeypatch):
    import shoal.tiers.dram as dram_mod

    real = os.statvfs

    class Tiny:
        def __init__(self, st):
            self.f_bsize = self.f_frsize = 4096
            self.f_bavail = self.f_bfree = 10  # 40 KiB free
            self.f_blocks = st.f_blocks

    monkeypatch.setattr(dram_mod.os, "statvfs", lambda p: Tiny(real(p)))
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.InsufficientMemory) as err:
            ckpt.save(1, {"w": torch.zeros(1 << 20)})
        assert "4194304" in str(err.value) and "40960" in str(err.value)
        monkeypatch.undo()
        ckpt.save(1, {"w": torch.zeros(1 << 10)}).wait(timeout=60)


def test_shared_root_vanishing_mid_save_fails_that_checkpoint_only(config, hold_failpoint):
    first = {"w": torch.randn(20_000), "step": 1}
    second = {"w": torch.randn(20_000), "step": 2}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, first).wait(timeout=60)
        root = ckpt.shared.url
        drain = hold_failpoint("pipeline.before_drain")
        handle = ckpt.save(2, second)  # returns at B1; the drain waits until the root is gone
        os.rename(root, root + ".away")
        with open(root, "w") as f:
            f.write("the mount went away")
        drain.release()
        with pytest.raises(shoal.CheckpointFailed, match="step 2 failed before B3") as err:
            handle.wait(timeout=60)
        assert isinstance(err.value.__cause__, shoal.TierError)
        assert handle.failed_at == shoal.Boundary.PERSISTED and handle.reached == shoal.Boundary.STAGED
        os.remove(root)
        os.rename(root + ".away", root)
        out = zeros_like_state(first)
        assert ckpt.load(out, step=1) == 1  # the earlier checkpoint is intact
        assert_state_equal(out, first)
        assert ckpt.load(out) == 2  # step 2 never left DRAM, where it is whole: restorable (B1)
        assert_state_equal(out, second)
        assert ckpt.last_load is not None and ckpt.last_load.origin == "staged"
        ckpt.save(3, second).wait(timeout=60)  # and training's next checkpoint goes through
        out = zeros_like_state(second)
        assert ckpt.load(out) == 3
        assert_state_equal(out, second)


def test_a_shared_root_that_cannot_be_written_is_reported_when_the_checkpointer_is_built(tmp_path, dram_root):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the shared root should be")
    config = make_config(tmp_path, dram_root, shared=str(blocker / "ckpts"))
    with pytest.raises(shoal.ConfigError) as info:  # no host copies: the path itself is the problem
        shoal.Checkpointer(config)
    assert str(blocker) in str(info.value) and "Config.shared" in str(info.value)
    assert "\n" not in str(info.value)


def test_shared_root_lost_mid_run_fails_at_persisted_without_stopping_training(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root)
    with shoal.Checkpointer(config) as ckpt:
        shared = Path(config.shared)
        shared.rename(tmp_path / "shared-gone")
        shared.write_text("a regular file where the shared root was")
        blocker = shared
        handle = ckpt.save(1, {"w": torch.ones(10)})
        assert handle.reached == shoal.Boundary.STAGED
        with pytest.raises(shoal.CheckpointFailed):
            handle.wait(timeout=60)
        assert handle.failed_at == shoal.Boundary.PERSISTED
        assert str(blocker) in str(handle.error)


def test_a_failed_commit_never_moves_latest(config):
    first, second = {"w": torch.randn(5000)}, {"w": torch.randn(5000)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, first).wait(timeout=60)
        failpoints.configure("pipeline.before_commit=raise")
        handle = ckpt.save(2, second)
        with pytest.raises(shoal.CheckpointFailed, match="before B4"):
            handle.wait(timeout=60)
        assert handle.reached == shoal.Boundary.PERSISTED
        assert ckpt.latest() == 1
        out = zeros_like_state(first)
        assert ckpt.load(out, step=ckpt.latest()) == 1
        assert_state_equal(out, first)
        # Step 2 reached B3: every chunk and its manifest are on shared storage, so it is restorable
        # (the newest restorable is what load() picks), though LATEST still names step 1.
        assert ckpt.load(out) == 2
        assert_state_equal(out, second)
        failpoints.configure(None)
        ckpt.save(3, second).wait(timeout=60)
        assert ckpt.latest() == 3


def test_a_pack_deleted_behind_shoals_back_is_written_again_not_referenced(config):
    state = {"w": torch.randn(30_000)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        for p in _packs(ckpt.shared.url):
            os.remove(p)
        ckpt.save(2, state).wait(timeout=60)
        out = zeros_like_state(state)
        assert ckpt.load(out, step=2) == 2
    assert_state_equal(out, state)


def test_close_finishes_in_flight_checkpoints(config):
    failpoints.configure("pipeline.before_drain=delay:0.3")
    ckpt = shoal.Checkpointer(config)
    handle = ckpt.save(1, {"w": torch.ones(100)})
    ckpt.close()
    assert handle.done(shoal.Boundary.RESTARTABLE)


def test_concurrent_waiters_all_see_the_boundary(config):
    failpoints.configure("pipeline.before_drain=delay:0.2")
    with shoal.Checkpointer(config) as ckpt:
        handle = ckpt.save(1, {"w": torch.ones(100)})
        seen = []
        threads = [threading.Thread(target=lambda: seen.append(handle.wait(timeout=30))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [shoal.Boundary.RESTARTABLE] * 4


def test_tiers_left_by_a_crashed_writer_do_not_confuse_the_next_job(config):
    url = _saved(config, {"w": torch.ones(10)})
    # a torn checkpoint: a manifest without a commit record, and an orphan pack
    os.makedirs(os.path.join(url, layout.step_dir(2)))
    with open(os.path.join(url, layout.manifest_path(2)), "w") as f:
        f.write("{")
    shutil.copy(_packs(url)[0], os.path.join(url, layout.pack_path("000000000002-h0-r0-deadbeef")))
    with shoal.Checkpointer(config) as ckpt:
        assert ckpt.latest() == 1
        out = {"w": torch.zeros(10)}
        assert ckpt.load(out) == 1
        ckpt.save(3, {"w": torch.ones(10) * 3}).wait(timeout=60)
        assert ckpt.load(out) == 3


def test_a_failure_between_commit_and_latest_leaves_the_step_at_persisted(config):
    first, second = {"w": torch.randn(5000)}, {"w": torch.randn(5000)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, first).wait(timeout=60)
        failpoints.configure("pipeline.before_latest=raise")
        handle = ckpt.save(2, second)
        with pytest.raises(shoal.CheckpointFailed, match="before B4"):
            handle.wait(timeout=60)
        failpoints.configure(None)
        assert ckpt.latest() == 1 and ckpt.latest(shoal.Boundary.PERSISTED) == 2
        assert not ckpt.shared.exists(layout.commit_path(2))
        out = zeros_like_state(first)
        assert ckpt.load(out, step=ckpt.latest()) == 1
        assert_state_equal(out, first)
        assert ckpt.load(out) == 2  # B3: restorable from shared storage, though not the restart point
        assert_state_equal(out, second)


def test_failpoint_specs_are_validated():
    with pytest.raises(ValueError, match="action must be"):
        failpoints.configure("pipeline.before_drain=explode")
    with pytest.raises(ValueError, match="name=action"):
        failpoints.configure("pipeline.before_drain")
