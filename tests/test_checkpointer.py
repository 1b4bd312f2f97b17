"""Checkpointer on one host: bit-exact round trips, boundaries, incremental saves, retention, events."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch

import shoal
from shoal import failpoints
from shoal.format import layout
from shoal.records.events import read_events
from shoal.testing.checkpoints import (
    assert_state_equal,
    make_config,
    pack_bytes_on,
    rich_state,
    zeros_like_state,
)


@pytest.fixture
def config(tmp_path, dram_root) -> shoal.Config:
    return make_config(tmp_path, dram_root)


def test_round_trip_is_bit_exact_for_every_dtype_and_shape(config):
    state = rich_state()
    with shoal.Checkpointer(config) as ckpt:
        handle = ckpt.save(1, state)
        handle.wait(shoal.Boundary.RESTARTABLE, timeout=60)
        target = zeros_like_state(state)
        assert ckpt.load(target) == 1
    assert_state_equal(target, state)


def test_save_returns_at_staged_and_boundaries_come_in_order(config):
    with shoal.Checkpointer(config) as ckpt:
        handle = ckpt.save(7, {"w": torch.randn(1000)})
        assert handle.done(shoal.Boundary.STAGED)
        assert handle.wait(shoal.Boundary.RESTARTABLE, timeout=60) == shoal.Boundary.RESTARTABLE
        t = handle.times
        assert list(t) == list(shoal.Boundary)
        assert t[shoal.Boundary.STAGED] <= t[shoal.Boundary.REPLICATED] <= t[shoal.Boundary.PERSISTED]
        assert t[shoal.Boundary.PERSISTED] <= t[shoal.Boundary.RESTARTABLE]
        assert ckpt.latest() == 7
        assert ckpt.latest(shoal.Boundary.PERSISTED) == 7
        latest = json.loads(ckpt.shared.read(layout.LATEST))
        assert latest["step"] == 7


def test_state_mutated_after_save_returns_does_not_change_the_checkpoint(config):
    w = torch.arange(100_000, dtype=torch.float32)
    expected = w.clone()
    with shoal.Checkpointer(config) as ckpt:
        handle = ckpt.save(1, {"w": w})
        w.add_(1.0)  # training goes on at once
        handle.wait(timeout=60)
        out = {"w": torch.zeros_like(w)}
        ckpt.load(out)
    assert torch.equal(out["w"], expected)


def test_unchanged_state_writes_no_chunk_payload_again(config):
    state = {"a": torch.randn(300_000), "b": torch.randn(50_000).to(torch.bfloat16), "step": 3}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        first = pack_bytes_on(ckpt.shared)
        assert first >= 300_000 * 4
        ckpt.save(2, state).wait(timeout=60)
        assert pack_bytes_on(ckpt.shared) == first
        manifest = json.loads(ckpt.shared.read(layout.manifest_path(2)))
        assert manifest["stats"]["written_bytes"] == 0
        # one changed element rewrites one chunk of one item, nothing else
        state["a"][5] += 1
        ckpt.save(3, state).wait(timeout=60)
        assert pack_bytes_on(ckpt.shared) - first == config.chunk_size
        for step in (1, 2, 3):
            out = zeros_like_state(state)
            ckpt.load(out, step=step)
        assert_state_equal(out, state)


def test_keep_last_deletes_old_checkpoints_but_keeps_every_chunk_retained_ones_need(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root, keep_last=2)
    base = torch.randn(200_000)
    states = {}
    with shoal.Checkpointer(config) as ckpt:
        for step in range(1, 6):
            base[step * 1000] = step  # every step changes one chunk, shares the rest
            states[step] = {"w": base.clone(), "step": step}
            ckpt.save(step, states[step]).wait(timeout=60)
        assert ckpt.wait(timeout=60)  # retention runs after B4, in the background
        steps = sorted(layout.step_of_path(p) for p in ckpt.shared.list("steps/") if p.endswith("/COMMIT"))
        assert steps == [4, 5]
        for step in (4, 5):
            out = zeros_like_state(states[step])
            assert ckpt.load(out, step=step) == step
            assert_state_equal(out, states[step])
        with pytest.raises(shoal.CheckpointNotFound):
            ckpt.load(zeros_like_state(states[1]), step=1)


def _committed(ckpt: shoal.Checkpointer) -> list[int]:
    return sorted(layout.step_of_path(p) for p in ckpt.shared.list("steps/") if p.endswith("/COMMIT"))


def test_remove_deletes_a_kept_step_but_never_latest_before_a_newer_commit(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root, keep_last=None)
    base = torch.randn(200_000)
    states = {}
    with shoal.Checkpointer(config) as ckpt:
        for step in (1, 2, 3):
            base[step * 1000] = step  # every step changes one chunk, shares the rest with the others
            states[step] = {"w": base.clone(), "step": step}
            ckpt.save(step, states[step]).wait(timeout=60)
        assert ckpt.wait(timeout=60)
        ckpt.remove(2)
        assert ckpt.wait(timeout=60)  # the removal pass ran
        assert _committed(ckpt) == [1, 3]
        assert not ckpt.shared.exists(layout.manifest_path(2))
        ckpt.remove(3)  # LATEST: the restart point stays until a newer checkpoint commits
        assert ckpt.wait(timeout=60)
        assert _committed(ckpt) == [1, 3] and ckpt.latest() == 3
        base[4000] = 4
        states[4] = {"w": base.clone(), "step": 4}
        ckpt.save(4, states[4]).wait(timeout=60)
        assert ckpt.wait(timeout=60)
        assert _committed(ckpt) == [1, 4]
        for step in (1, 4):  # the chunks step 2 and 3 shared with them are still there
            out = zeros_like_state(states[step])
            assert ckpt.load(out, step=step) == step
            assert_state_equal(out, states[step])
        with pytest.raises(shoal.CheckpointNotFound):
            ckpt.load(zeros_like_state(states[2]), step=2)
        ckpt.save(2, states[2]).wait(timeout=60)  # a removed step may be saved again, and is kept
        assert ckpt.wait(timeout=60)
        assert _committed(ckpt) == [1, 2, 4]
        with pytest.raises(shoal.errors.InvalidName, match="step"):
            ckpt.remove(-1)


def test_saving_an_existing_step_is_refused(config):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(5, {"w": torch.ones(3)}).wait(timeout=60)
        with pytest.raises(shoal.CheckpointExists, match="step 5"):
            ckpt.save(5, {"w": torch.zeros(3)})
    with shoal.Checkpointer(config) as again, pytest.raises(shoal.CheckpointExists):
        again.save(5, {"w": torch.zeros(3)})


def test_a_new_checkpointer_loads_what_an_earlier_one_committed(config):
    state = {"w": torch.randn(1000), "meta": {"lr": 0.1, "name": "run"}}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(10, state)
    with shoal.Checkpointer(config) as fresh:
        out = zeros_like_state(state)
        assert fresh.load(out) == 10
        assert fresh.latest() == 10
    assert_state_equal(out, state)


def test_load_with_nothing_saved_says_where_it_looked(config):
    with (
        shoal.Checkpointer(config) as ckpt,
        pytest.raises(shoal.CheckpointNotFound, match=re.escape(config.shared)),
    ):
        ckpt.load({"w": torch.zeros(1)})


def test_event_log_records_the_timeline(config):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": torch.randn(10_000)}).wait(timeout=60)
        path = ckpt.config.event_log
    assert path is not None and os.path.exists(path)
    events = [e for e in read_events(path) if e["step"] == 1]
    names = [e["event"] for e in events]
    assert names[0] == "save_called"
    assert [e["boundary"] for e in events if e["event"] == "boundary"] == [
        "STAGED",
        "PERSISTED",
        "RESTARTABLE",
    ]
    writes = [e for e in events if e["event"] == "write"]
    assert {w["what"] for w in writes} >= {"pack", "manifest", "commit", "latest"}
    pack = next(w for w in writes if w["what"] == "pack")
    assert pack["bytes"] == 40_000 and pack["writers"] == 1 and pack["seconds"] >= 0


def test_skip_when_every_slot_is_in_flight(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root, dram_slots=1, on_busy="skip")
    failpoints.configure("pipeline.before_drain=delay:1.0")
    try:
        with shoal.Checkpointer(config) as ckpt:
            first = ckpt.save(1, {"w": torch.ones(10)})
            second = ckpt.save(2, {"w": torch.ones(10)})
            assert second.skipped
            with pytest.raises(shoal.CheckpointFailed, match="skipped"):
                second.wait(timeout=5)
            first.wait(timeout=60)
    finally:
        failpoints.configure(None)


def test_shared_tier_on_s3_round_trip_and_incremental(tmp_path, dram_root, s3_url, s3_options, s3_admin):
    config = make_config(tmp_path, dram_root, shared=s3_url, storage_options=s3_options)
    state = {"w": torch.randn(100_000), "b": torch.arange(10), "note": "on s3"}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        first = pack_bytes_on(ckpt.shared)
        ckpt.save(2, state).wait(timeout=60)
        assert pack_bytes_on(ckpt.shared) == first  # nothing re-uploaded
        assert ckpt.latest() == 2
    with shoal.Checkpointer(config) as fresh:
        out = zeros_like_state(state)
        assert fresh.load(out) == 2
    assert_state_equal(out, state)


def test_close_gives_the_dram_slabs_back(config):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": torch.randn(10_000)}).wait(timeout=60)
        slabs = os.path.join(ckpt.dram.url, "slabs")
        assert os.listdir(slabs)  # the slab of the save (and the warmed spare) live in /dev/shm
        staged = os.path.join(ckpt.dram.url, "staged")
        assert os.listdir(staged)  # with the index of what the slot holds
        ckpt.wait()
    assert os.listdir(slabs) == [] and os.listdir(staged) == []


def test_a_large_drain_goes_out_as_several_packs_in_flight_at_once(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root, drain_pack_bytes=128 << 10, drain_streams=3)
    state = {"w": torch.randn(256 << 10), "b": torch.arange(10)}  # 1 MiB + 80 bytes
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        packs = [p for p in ckpt.shared.list(layout.PACKS_DIR + "/") if p.endswith(".pack")]
        assert len(packs) == 8  # round(1 MiB / 128 KiB), each about the same size
        assert pack_bytes_on(ckpt.shared) == 4 * (256 << 10) + 80
        writes = [
            e for e in read_events(ckpt.config.event_log) if e["event"] == "write" and e["what"] == "pack"
        ]
        assert len(writes) == 8 and {w["concurrency"] for w in writes} == {3}
    with shoal.Checkpointer(config) as fresh:  # the slabs went back at close: from the packs
        out = zeros_like_state(state)
        assert fresh.load(out) == 1
        assert fresh.last_load is not None and fresh.last_load.shared_bytes == 4 * (256 << 10) + 80
    assert_state_equal(out, state)


def test_one_failing_pack_upload_fails_the_checkpoint_and_commits_nothing(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root, drain_pack_bytes=128 << 10, drain_streams=2)
    failpoints.configure("pipeline.after_pack=raise")
    try:
        with shoal.Checkpointer(config) as ckpt:
            handle = ckpt.save(1, {"w": torch.randn(256 << 10)})
            with pytest.raises(shoal.CheckpointFailed, match="after_pack"):
                handle.wait(timeout=60)
            assert ckpt.latest() is None and not ckpt.shared.exists(layout.commit_path(1))
    finally:
        failpoints.configure(None)


@pytest.mark.parametrize(
    ("field", "value"), [("drain_streams", 0), ("drain_streams", 65), ("drain_pack_bytes", 1024)]
)
def test_drain_settings_out_of_range_are_refused(tmp_path, dram_root, field, value):
    with pytest.raises(shoal.ConfigError, match=f"Config.{field}"):
        make_config(tmp_path, dram_root, **{field: value})


def test_a_load_that_leaves_saved_optimizer_state_behind_says_so(tmp_path, dram_root, caplog):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        ckpt.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait(timeout=60)
        fresh = torch.optim.Adam(torch.nn.Linear(4, 3).parameters())
        with caplog.at_level(logging.WARNING, logger="shoal.engine.restore"):
            ckpt.load({"model": torch.nn.Linear(4, 3).state_dict()})  # the model alone: a choice
        assert not [r for r in caplog.records if "not read" in r.getMessage()]
        with caplog.at_level(logging.WARNING, logger="shoal.engine.restore"):
            ckpt.load({"model": torch.nn.Linear(4, 3).state_dict(), "optim": fresh.state_dict()})
        (warning,) = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
        assert "load of step 1: 6 saved item(s) under 'optim' were not in the target" in warning
        assert "optim.state.0.step, optim.state.0.exp_avg" in warning
        assert "get_optimizer_state_dict" in warning


def test_the_coordinator_logs_one_line_per_checkpoint_with_stall_b4_bytes_and_path(
    tmp_path, dram_root, caplog
):
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
    config = make_config(tmp_path, dram_root)
    with caplog.at_level(logging.INFO, logger="shoal.engine.group_save"), shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        ckpt.save(2, state).wait(timeout=60)  # the same bytes: all deduplicated
        ckpt.wait(60)
    lines = [r.getMessage() for r in caplog.records if r.name == "shoal.engine.group_save"]
    summary = [m for m in lines if re.match(r"step \d: stall ", m)]
    assert len(summary) == 2, lines
    assert re.fullmatch(
        r"step 1: stall \d+\.\d{3} s, B4 after \d+\.\d{3} s, "
        r"1\.0 MiB new, 0\.0 MiB deduplicated of 1\.0 MiB, path direct",
        summary[0],
    )
    assert "step 2:" in summary[1] and "0.0 MiB new, 1.0 MiB deduplicated of 1.0 MiB" in summary[1]
