"""Commits that cannot lie: a fenced writer commits nothing, and B4 only covers bytes that are there."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shoal
from shoal import failpoints
from shoal.engine.group_save import GroupSave
from shoal.errors import MissingFile, WriterFenced
from shoal.format import layout
from shoal.records.fence import WriterFence, read_writer
from shoal.records.store import list_checkpoints, read_pointer
from shoal.testing.checkpoints import assert_state_equal, make_config, zeros_like_state
from shoal.tiers import open_tier
from shoal.tiers.base import Tier


@pytest.fixture(autouse=True)
def _disarm() -> Iterator[None]:
    yield
    failpoints.configure(None)


def _config(tmp_path: Path, dram_root: Path, host: str, **overrides: Any) -> shoal.Config:
    """A Config on the test's one shared root and job, with host-private DRAM and local roots."""
    dram = dram_root / host
    dram.mkdir(mode=0o700, exist_ok=True)
    return make_config(tmp_path, dram, host_id=host, local=str(tmp_path / f"local-{host}"), **overrides)


def _state(seed: int, n: int = 60_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(n // 3, generator=g), "step": seed}


def _finish(handle: shoal.SaveHandle) -> shoal.SaveHandle:
    with contextlib.suppress(shoal.CheckpointFailed):
        handle.wait(timeout=60)
    assert handle.finished
    return handle


def _on_failpoint(
    monkeypatch: pytest.MonkeyPatch, name: str, step: int, action: Callable[[], object]
) -> None:
    """Run ``action`` once, when the pipeline meets failpoint ``name`` while working on ``step``."""
    real_hit, real_run = failpoints.hit, GroupSave.run
    current = [-1]
    done: list[str] = []

    def run(self: GroupSave) -> None:
        current[0] = self.step
        real_run(self)

    def hit(point: str, *, rank: int = 0) -> None:
        if point == name and current[0] == step and not done:
            done.append(point)
            action()
        real_hit(point, rank=rank)

    monkeypatch.setattr(GroupSave, "run", run)
    monkeypatch.setattr(failpoints, "hit", hit)


def _referenced_packs_all_exist(shared: Tier) -> list[str]:
    """Every pack some manifest on ``shared`` references; asserts each is there."""
    packs = []
    for info in list_checkpoints(shared):
        assert info.manifest is not None, info.problem
        for pid in info.manifest.packs:
            assert shared.exists(layout.pack_path(pid)), f"step {info.step} references missing pack {pid}"
            assert shared.exists(layout.index_path(pid)), f"step {info.step}: index of {pid} missing"
            packs.append(pid)
    return packs


def _latest(shared: Tier) -> int | None:
    pointer = read_pointer(shared, layout.LATEST)
    return None if pointer is None else pointer.step


# -- two writers on one job ---------------------------------------------------------------------------


def test_two_writers_on_one_job_never_interleave(
    tmp_path: Path, dram_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg_a = _config(tmp_path, dram_root, "a", keep_last=1)
    cfg_b = _config(tmp_path, dram_root, "b", keep_last=1)
    state = _state(0)
    with shoal.Checkpointer(cfg_a) as a, shoal.Checkpointer(cfg_b) as b:
        shared = a.shared
        assert read_writer(shared) is None  # constructing does not claim the job: a loader fences nobody
        assert _finish(a.save(1, state)).error is None
        a_writer = read_writer(shared)
        assert a_writer is not None and a_writer.host == "a"
        with caplog.at_level(logging.WARNING, logger="shoal.records.fence"):
            assert _finish(b.save(2, state)).error is None  # the same bytes: it reuses a's packs
        assert f"takes over the job from writer {a_writer.writer}" in caplog.text
        b_writer = read_writer(shared)
        assert b_writer is not None and b_writer.host == "b"
        for step in (3, 5):
            state["w"][step] += 1.0
            handle = _finish(a.save(step, state))
            assert isinstance(handle.error, WriterFenced), handle.error
            assert handle.failed_at == shoal.Boundary.PERSISTED  # nothing new in the job's steps
            msg = str(handle.error)
            assert f"writer {b_writer.writer} (host 'b'" in msg and "same Config.job" in msg
            assert a.latest() != step and _latest(shared) not in (3, 5)
            assert not shared.list(layout.step_dir(step) + "/")
            state["w"][step + 1] += 1.0
            assert _finish(b.save(step + 1, state)).error is None
            assert _latest(shared) == step + 1
            assert a.wait(60) and b.wait(60)
            # b's keep_last=1 deleted b's older steps, never a's step 1 nor any pack a manifest needs.
            present = {i.step for i in list_checkpoints(shared)}
            assert present == {1, step + 1}, present
            _referenced_packs_all_exist(shared)
        assert read_writer(shared) == b_writer
    # Both writers' committed steps load bit-exact in a fresh process.
    with shoal.Checkpointer(_config(tmp_path, dram_root, "c")) as fresh:
        out = zeros_like_state(state)
        assert fresh.load(out) == 6
        assert_state_equal(out, state)
        first = zeros_like_state(state)
        assert fresh.load(first, step=1) == 1
        assert_state_equal(first, _state(0))


def test_a_takeover_between_commit_record_and_latest_takes_the_commit_back(
    tmp_path: Path, dram_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, dram_root, "a", keep_last=None)
    shared = open_tier("shared", cfg.shared_url())
    _on_failpoint(
        monkeypatch,
        "pipeline.before_latest",
        2,
        lambda: WriterFence.claim(shared, host="elsewhere", pid=9),
    )
    with shoal.Checkpointer(cfg) as ckpt:
        assert _finish(ckpt.save(1, _state(1))).error is None
        handle = _finish(ckpt.save(2, _state(2)))
        assert isinstance(handle.error, WriterFenced) and "host 'elsewhere'" in str(handle.error)
        assert handle.reached == shoal.Boundary.PERSISTED  # the manifest is there, the commit is not
        assert not shared.exists(layout.commit_path(2)) and _latest(shared) == 1
        assert ckpt.latest() == 1
        # Once fenced, always fenced: the next save commits nothing either.
        handle = _finish(ckpt.save(3, _state(3)))
        assert isinstance(handle.error, WriterFenced) and not shared.list(layout.step_dir(3) + "/")
    assert _latest(shared) == 1


def test_a_fenced_writer_runs_no_retention(
    tmp_path: Path, dram_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _config(tmp_path, dram_root, "a", keep_last=1)
    shared = open_tier("shared", cfg.shared_url())
    real_run = GroupSave.run

    def run_then_lose_the_job(self: GroupSave) -> None:
        real_run(self)
        if self.step == 3:  # committed; another process claims the job before retention runs
            WriterFence.claim(shared, host="elsewhere", pid=9)

    monkeypatch.setattr(GroupSave, "run", run_then_lose_the_job)
    with shoal.Checkpointer(cfg) as ckpt, caplog.at_level(logging.WARNING, logger="shoal.engine.pipeline"):
        for step in (1, 2, 3):
            assert _finish(ckpt.save(step, _state(step))).error is None
            assert ckpt.wait(60)
        # Retention after step 2 deleted step 1; after step 3 it did not run: step 2 is still there.
        assert {i.step for i in list_checkpoints(shared)} == {2, 3}
    assert "retention on" in caplog.text and "skipped (nothing deleted)" in caplog.text


def test_a_process_that_only_loads_does_not_fence_the_trainer(tmp_path: Path, dram_root: Path) -> None:
    with shoal.Checkpointer(_config(tmp_path, dram_root, "a")) as trainer:
        assert _finish(trainer.save(1, _state(1))).error is None
        with shoal.Checkpointer(_config(tmp_path, dram_root, "reader")) as reader:
            out = zeros_like_state(_state(1))
            assert reader.load(out) == 1
        assert _finish(trainer.save(2, _state(2))).error is None
        record = read_writer(trainer.shared)
        assert record is not None and record.host == "a"


# -- B4 only over bytes that are there -------------------------------------------------------------


def test_a_job_directory_removed_before_the_drain_never_reaches_b4(
    tmp_path: Path, dram_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, dram_root, "a", keep_last=None)
    job_dir = Path(cfg.shared_url())
    state = _state(7)
    with shoal.Checkpointer(cfg) as ckpt:
        assert _finish(ckpt.save(1, state)).error is None
        old_packs = [i.manifest.packs for i in list_checkpoints(ckpt.shared) if i.manifest][0]
        # Step 2 changes one chunk and reuses the rest from step 1's packs, planned while they are
        # there; then the whole job directory goes before the drain.
        _on_failpoint(monkeypatch, "pipeline.before_drain", 2, lambda: shutil.rmtree(job_dir))
        state["w"][0] += 1.0
        handle = _finish(ckpt.save(2, state))
        assert isinstance(handle.error, MissingFile), handle.error
        assert handle.failed_at == shoal.Boundary.PERSISTED and handle.reached == shoal.Boundary.STAGED
        msg = str(handle.error)
        assert "step 2 not committed" in msg
        assert all(pid in msg for pid in old_packs), (msg, list(old_packs))
        assert not ckpt.shared.exists(layout.manifest_path(2)) and _latest(ckpt.shared) is None
        assert ckpt.latest() is None
        # The next save writes every chunk again and commits.
        state["w"][1] += 1.0
        assert _finish(ckpt.save(3, state)).error is None
        assert _latest(ckpt.shared) == 3
        _referenced_packs_all_exist(ckpt.shared)
    with shoal.Checkpointer(_config(tmp_path, dram_root, "fresh")) as fresh:
        out = zeros_like_state(state)
        assert fresh.load(out) == 3
        assert_state_equal(out, state)


def test_a_reused_pack_cut_short_before_the_drain_fails_the_commit_naming_it(
    tmp_path: Path, dram_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, dram_root, "a", keep_last=None)
    state = _state(8)
    with shoal.Checkpointer(cfg) as ckpt:
        assert _finish(ckpt.save(1, state)).error is None
        (pid,) = [p for i in list_checkpoints(ckpt.shared) if i.manifest for p in i.manifest.packs]
        pack = Path(cfg.shared_url(), layout.pack_path(pid))

        def truncate() -> None:
            with open(pack, "r+b") as f:
                f.truncate(1000)

        _on_failpoint(monkeypatch, "pipeline.before_drain", 2, truncate)
        state["w"][0] += 1.0
        handle = _finish(ckpt.save(2, state))
        assert isinstance(handle.error, MissingFile), handle.error
        assert f"{layout.pack_path(pid)} is 1000 bytes" in str(handle.error)
        assert not ckpt.shared.exists(layout.manifest_path(2)) and _latest(ckpt.shared) == 1
        assert _finish(ckpt.save(3, state)).error is None  # rescanned: the short pack is not reused
        _referenced_packs_all_exist(ckpt.shared)
        out = zeros_like_state(state)
        assert ckpt.load(out, step=3) == 3
        assert_state_equal(out, state)


def test_a_missing_writer_record_is_claimed_again_at_the_next_save(
    tmp_path: Path, dram_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _config(tmp_path, dram_root, "a", keep_last=None)
    shared = open_tier("shared", cfg.shared_url())
    _on_failpoint(monkeypatch, "pipeline.before_commit", 2, lambda: shared.delete(layout.WRITER))
    with shoal.Checkpointer(cfg) as ckpt, caplog.at_level(logging.WARNING, logger="shoal.records.fence"):
        assert _finish(ckpt.save(1, _state(1))).error is None
        first = read_writer(shared)
        handle = _finish(ckpt.save(2, _state(2)))
        assert isinstance(handle.error, WriterFenced) and "is missing" in str(handle.error)
        assert not shared.exists(layout.commit_path(2)) and _latest(shared) == 1
        assert "claims the job again" in caplog.text
        assert _finish(ckpt.save(3, _state(3))).error is None
        again = read_writer(shared)
        assert again is not None and first is not None and again.writer != first.writer
        assert _latest(shared) == 3
