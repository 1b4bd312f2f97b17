"""FSDP2 resharding through shoal: a 4-rank torchtitan run saves, is SIGKILLed, and resumes on 2 ranks.

Both runs use torchtitan's components and :class:`shoal.integrations.torchtitan.ShoalCheckpointManager`
(see ``torchtitan_train.py``): the model's and the optimizer's state dicts are DCP's
``get_model_state_dict`` / ``get_optimizer_state_dict`` of FSDP2 modules (DTensor shards), saved
through ``shoal.Checkpointer.save`` and loaded through ``shoal.Checkpointer.load``, which reshards
them. The 2-rank run leaves the dataloader out (``exclude_from_loading``: torchtitan cannot reshard
a dataloader's position). Checked: the unsharded (full) model and Adam state the 2-rank run loads
equal the 4-rank run's at the step saved, bit-exact; training then continues on 2 ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

from shoal.testing.checkpoints import assert_identical  # noqa: E402
from shoal.testing.multiproc import run_ranks  # noqa: E402

from .shoal_ls import committed  # noqa: E402
from .test_torchtitan import state_of  # noqa: E402
from .torchtitan_train import train  # noqa: E402


@pytest.mark.timeout(400)
def test_four_ranks_save_two_ranks_resume_bit_exact(
    tmp_path: Path, dram_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = {"root": str(tmp_path), "dram": str(dram_root), "steps": 4, "interval": 2, "keep_latest_k": 0}
    report = tmp_path / "four.pt"
    four = {**where, "stop_after": 2, "record": (2,), "kill": True, "report": str(report)}
    hosts4 = ["h0", "h0", "h1", "h1"]
    assert run_ranks(train, hosts=hosts4, kwargs=four, timeout=300, allow_death=[0, 1, 2, 3]) == [None] * 4
    saved = state_of(torch.load(report, weights_only=True)["states"][2])
    assert committed(tmp_path / "shared" / "titan", capsys) == ([2], 2)

    two = {**where, "record_load": True, "record": (4,), "exclude_from_loading": ["dataloader"]}
    run = run_ranks(train, hosts=["h0", "h1"], kwargs=two, timeout=300)[0]
    assert run["loaded"] is True and run["start"] == 2
    loaded = state_of(run["loaded_state"])
    assert loaded["optim"]["state"], "the Adam state is compared, so it must not be empty"
    assert_identical(loaded, saved, "4 -> 2 ranks")
    # training goes on from there: two more steps on 2 ranks, saved at step 4
    after = state_of(run["states"][4])
    assert after["train_state"]["step"] == 4 and math.isfinite(run["loss"])
    assert not torch.equal(after["model"]["output.weight"], saved["model"]["output.weight"])
    assert committed(tmp_path / "shared" / "titan", capsys) == ([2, 4], 4)
