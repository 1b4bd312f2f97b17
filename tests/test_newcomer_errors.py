"""Errors a new user meets first: each is a ShoalError that says what was wrong and where."""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

import shoal
from shoal.testing.checkpoints import assert_state_equal, make_config, zeros_like_state


@pytest.fixture
def config(tmp_path, dram_root) -> shoal.Config:
    return make_config(tmp_path, dram_root)


def test_config_accepts_paths_as_well_as_strings(tmp_path, dram_root):
    cfg = shoal.Config(shared=tmp_path / "shared", local=tmp_path / "local", dram=pathlib.Path(dram_root))  # type: ignore[arg-type]
    assert cfg.shared == str(tmp_path / "shared") and cfg.dram == str(dram_root)
    with shoal.Checkpointer(cfg) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)


@pytest.mark.parametrize("step", [-1, 10**12, 1.5, "3", True])
def test_a_bad_step_is_a_shoal_error_naming_it(config, step):
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.ShoalError, match="step"):
            ckpt.save(step, {"w": torch.ones(3)})  # type: ignore[arg-type]
        with pytest.raises(shoal.ShoalError, match="step"):
            ckpt.load({"w": torch.ones(3)}, step=step)  # type: ignore[arg-type]


def test_save_and_load_after_close_say_the_checkpointer_is_closed(config):
    ckpt = shoal.Checkpointer(config)
    ckpt.close()
    with pytest.raises(shoal.ShoalError, match="closed"):
        ckpt.save(1, {"w": torch.ones(3)})
    with pytest.raises(shoal.ShoalError, match="closed"):
        ckpt.load({"w": torch.ones(3)})


def test_a_value_that_cannot_be_serialised_names_its_key(config):
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.ShoalError) as info:
            ckpt.save(1, {"w": torch.ones(3), "extra": {"lock": threading.Lock()}})
        assert "extra.lock" in str(info.value)
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)  # the slot was freed


def test_saving_a_committed_step_again_says_it_is_committed(config):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        with pytest.raises(shoal.CheckpointExists, match="already (committed|exists)"):
            ckpt.save(1, {"w": torch.ones(3)})
        ckpt.wait()
        with pytest.raises(shoal.CheckpointExists, match="already"):
            ckpt.save(1, {"w": torch.ones(3)})
        target = zeros_like_state({"w": torch.ones(3)})
        assert ckpt.load(target) == 1
        assert_state_equal(target, {"w": torch.ones(3)})
