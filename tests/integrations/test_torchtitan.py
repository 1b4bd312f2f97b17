"""torchtitan's CheckpointManager through shoal: two FSDP2 ranks (gloo), SIGKILLed, resumed bit-exact.

torchtitan's ``Trainer`` needs CUDA (see ``torchtitan_train.py``), so each run drives torchtitan's
own components and its checkpoint manager as the Trainer does: ``load(step=load_step)``, then
``save(step, last_step=...)`` after every step. Three runs of two ranks (hosts ``h0``, ``h1``):

1. the reference: torchtitan's own ``CheckpointManager`` (DCP to its folder), steps 1..8;
2. in the same processes, shoal, ``async_mode="disabled"``, with no shoal checkpoint yet:
   ``initial_load_path`` loads the reference's own DCP checkpoint of step 2
   (``initial_load_model_only=False``), then steps 3..5 (a save at 4), SIGKILLed once step 4 is
   committed;
3. shoal again, ``async_mode="async_with_pinned_mem"``: ``load()`` resumes step 4 and trains to 8
   (saves 6 and 8, ``interval=2``); then ``load(step=6)``, as a restart with ``load_step=6`` does.

Checked: the resumed step; model AND optimizer state (unsharded) bit-exact against the reference at
steps 8 and 6; what is committed on the shared tier after each run (``interval``, and
``keep_latest_k=2``: steps 6 and 8 only at the end).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan")

from shoal.testing.checkpoints import assert_identical
from shoal.testing.multiproc import run_ranks  # noqa: E402

from .shoal_ls import committed
from .torchtitan_train import train, train_runs  # noqa: E402

HOSTS = ["h0", "h1"]


def state_of(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.mark.timeout(400)
def test_sigkill_then_resume_is_bit_exact_with_retention_and_load_step(
    tmp_path: Path, dram_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = {"root": str(tmp_path), "dram": str(dram_root), "steps": 8, "interval": 2, "keep_latest_k": 2}
    job_url = tmp_path / "shared" / "titan"

    # the reference, then the first shoal run, in the same two processes (one launch)
    stock = {"stock": True, "record": (6, 8), "keep_latest_k": 0}  # it keeps its step 2
    initial = {
        "initial_load_path": str(tmp_path / "stock" / "ckpt" / "step-2"),
        "initial_load_model_only": False,
    }
    first = {**initial, "async_mode": "disabled", "stop_after": 5, "kill": True}
    runs = {"runs": [stock, first], "report": str(tmp_path / "report")}
    assert (
        run_ranks(train_runs, hosts=HOSTS, kwargs={**where, **runs}, timeout=240, allow_death=[0, 1])
        == [None] * 2
    )
    ref = torch.load(tmp_path / "report.0", weights_only=True)
    assert ref["loaded"] is False and sorted(ref["states"]) == [6, 8]
    began = torch.load(tmp_path / "report.1", weights_only=True)
    assert began["loaded"] is True and began["start"] == 2  # torchtitan's own checkpoint of step 2
    assert committed(job_url, capsys) == ([4], 4)  # the save at step 4 reached B4 before the kill

    second = {**where, "async_mode": "async_with_pinned_mem", "record": (8,), "reload": 6}
    run = run_ranks(train, hosts=HOSTS, kwargs=second, timeout=240)[0]
    assert run["loaded"] is True and run["start"] == 4
    # pinned-memory mode is shoal's async one (its own slab): step 6 through dcp.async_save, then
    # the last step (8) synchronously, as torchtitan saves a last step
    assert run["async_mode"] == "async" and run["async_saves"] == 1
    at8, want8 = state_of(run["states"][8]), state_of(ref["states"][8])
    assert at8["train_state"] == {"step": 8, "ntokens_seen": 8 * 2 * 16}
    assert_identical(at8, want8, "step 8")
    assert at8["optim"]["state"], "the optimizer state is compared, so it must not be empty"
    # load_step=6: the checkpoint of step 6, bit-exact
    assert run["reloaded"] is True
    assert_identical(state_of(run["reloaded_state"]), state_of(ref["states"][6]), "load_step 6")
    assert committed(job_url, capsys) == ([6, 8], 8)  # keep_latest_k=2: steps 2 and 4 are gone


def test_a_bad_keep_latest_k_or_step_id_is_refused_before_anything_starts() -> None:
    from torchtitan.config.job_config import Checkpoint

    from shoal.errors import ConfigError
    from shoal.integrations.torchtitan import ShoalCheckpointManager, _step_of

    with pytest.raises(ConfigError, match="keep_latest_k must be an int >= 0, got -1"):
        ShoalCheckpointManager(None, [], None, None, {}, Checkpoint(enable=True, keep_latest_k=-1), None)
    assert _step_of("/ckpt/step-12") == 12
    with pytest.raises(ConfigError, match="names no step"):
        _step_of("/ckpt/ft-replicat-0/latest")


@pytest.mark.timeout(300)
def test_torchtitans_own_trainer_resumes_load_step_bit_exact(
    tmp_path: Path, dram_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from .torchtitan_trainer import trainer_resumes

    out = run_ranks(
        trainer_resumes, hosts=HOSTS, kwargs={"root": str(tmp_path), "dram": str(dram_root)}, timeout=240
    )
    first, resumed = out[0]["first"], out[0]["resumed"]
    assert first["manager"] == resumed["manager"] == "ShoalCheckpointManager"  # built by the Trainer
    assert first["loaded"] is None and resumed["loaded"] == 4  # --checkpoint.load_step=4
    want, got = state_of(first["state"]), state_of(resumed["state"])
    assert got["train_state"]["step"] == 8 and got["optim"]["state"]
    assert_identical(got, want, "Trainer at step 8")
    assert committed(tmp_path / "shared" / "trainer", capsys) == ([4, 6, 8], 8)  # keep_latest_k=3
