"""shoal inside PyTorch Lightning 2.6.6: Lightning's own Trainer, launcher and ModelCheckpoint on CPU.

Two processes (gloo) with Lightning's subprocess launcher: DDP killed with SIGKILL once a checkpoint
reached B4, resumed with ``ckpt_path="last"``, bit-exact against an uninterrupted run, with
``save_top_k``/``save_last`` leaving exactly Lightning's files and the shoal steps they name;
ModelParallel (FSDP2 ``fully_shard``) resumed from a pointer, bit-exact. One process: the
``CheckpointIO`` round trip (through the Trainer and value by value), the refusal of a value only
pickle could save, and the fallback when the step a pointer names has no surviving copy.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import shoal  # noqa: E402
from shoal.format import layout  # noqa: E402
from shoal.integrations.lightning import ShoalCheckpointIO  # noqa: E402
from shoal.testing.checkpoints import assert_identical

from .lightning_train import Net  # noqa: E402
from .shoal_ls import committed

SCRIPT = Path(__file__).with_name("lightning_train.py")
SRC = Path(shoal.__file__).resolve().parents[1]


# Lightning's own, raised while it runs (its pytree helper on torch 2.13, its hints about a CPU run)
def LIGHTNING_MARKS(fn: Any) -> Any:
    for mark in (pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),):
        fn = mark(fn)
    return fn


# -- helpers -----------------------------------------------------------------------------------------
def _launch(root: Path, dram: Path, *args: str) -> subprocess.Popen[str]:
    where = {"shared": root / "shared", "local": root / "local", "dram": dram, "ckpt-dir": root / "ckpts"}
    cmd = [sys.executable, str(SCRIPT), *(a for k, v in where.items() for a in (f"--{k}", str(v))), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("SHOAL_HOST_ID", None)
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _run(root: Path, dram: Path, *args: str, kill_on: str | None = None, timeout: float = 240) -> list[str]:
    """Run the script on 2 processes; its output lines. ``kill_on``: SIGKILL its process group (both
    ranks) on the first line starting so."""
    proc = _launch(root, dram, *args)
    lines: list[str] = []
    killed = threading.Event()
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if kill_on is not None and line.startswith(kill_on):
                os.killpg(proc.pid, signal.SIGKILL)
                killed.set()
        proc.wait()
    finally:
        timer.cancel()
        if proc.stdout is not None:
            proc.stdout.close()
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
            os.killpg(proc.pid, signal.SIGKILL)
    output = "\n".join(lines)
    if kill_on is not None:
        assert killed.is_set(), f"never printed {kill_on!r}:\n{output}"
    else:
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{output}"
    return lines


def _tagged(lines: list[str], tag: str) -> list[int | None]:
    found = [line.split()[1:] for line in lines if line.startswith(tag + " ")]
    assert len(found) == 1, f"{tag}: {found}"
    return [None if v == "None" else int(v) for v in found[0]]


def _pointers(ckpt_dir: Path) -> dict[str, int]:
    """Each checkpoint file Lightning left: the shoal step its pointer names."""
    out = {}
    for p in sorted(ckpt_dir.iterdir()):
        doc = json.loads(p.read_bytes())
        assert doc["format"] == "shoal-lightning/2"
        out[p.name] = doc["step"]
    return out


def _assert_same_training_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["global_step"] == expected["global_step"]
    assert actual["model"].keys() == expected["model"].keys()
    for k, v in expected["model"].items():
        assert torch.equal(actual["model"][k], v), k
    got, want = actual["optim"], expected["optim"]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and got["state"]
    for param, slots in want["state"].items():
        assert got["state"][param].keys() == slots.keys()
        for name, v in slots.items():
            assert torch.equal(got["state"][param][name], v), (param, name)


# -- two processes, Lightning's launcher ----------------------------------------------------------------
@pytest.mark.timeout(400)
def test_ddp_sigkilled_after_b4_resumes_from_last_bit_exact_and_retention_is_lightnings(
    tmp_path: Path, shm_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    # the uninterrupted run: 8 steps, a checkpoint every 2, the 2 newest kept and last.ckpt
    out = _run(straight, shm_path / "straight", "--max-steps", "8", "--dump", str(straight / "final.pt"))
    assert _tagged(out, "DONE") == [8]
    # the same run, killed (both ranks, SIGKILL) once step 4 reached B4, during step 5
    out = _run(broken, shm_path / "broken", "--max-steps", "8", "--kill-after", "4", kill_on="SHOAL-B4")
    (b4,) = _tagged(out, "SHOAL-B4")
    assert b4 == 4 and "DONE 8" not in out
    assert _pointers(broken / "ckpts") == {"epoch=0-step=2.ckpt": 2, "epoch=1-step=4.ckpt": 4, "last.ckpt": 4}
    # restarted with ckpt_path="last": restored from shoal's step 4, trained on to 8
    out = _run(
        broken,
        shm_path / "broken",
        "--max-steps",
        "8",
        "--resume",
        "last",
        "--dump",
        str(broken / "final.pt"),
    )
    assert _tagged(out, "RESUMED") == [4, 4]
    assert _tagged(out, "DONE") == [8]
    _assert_same_training_state(torch.load(broken / "final.pt"), torch.load(straight / "final.pt"))
    # save_top_k=2 + save_last: Lightning's files, and exactly the shoal steps they name
    for root in (straight, broken):
        assert _pointers(root / "ckpts") == {
            "epoch=2-step=6.ckpt": 6,
            "epoch=3-step=8.ckpt": 8,
            "last.ckpt": 8,
        }
        assert committed(root / "shared" / "lit", capsys) == ([6, 8], 8)


@pytest.mark.timeout(400)
def test_model_parallel_fsdp2_resumes_from_a_pointer_bit_exact(
    tmp_path: Path, shm_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(
        tmp_path,
        shm_path,
        "--strategy",
        "mp",
        "--max-steps",
        "6",
        "--top-k",
        "-1",
        "--dump",
        str(tmp_path / "a.pt"),
    )
    assert _tagged(out, "DONE") == [6]
    assert _pointers(tmp_path / "ckpts") == {
        "epoch=0-step=2.ckpt": 2,
        "epoch=1-step=4.ckpt": 4,
        "epoch=2-step=6.ckpt": 6,
        "last.ckpt": 6,
    }
    assert committed(tmp_path / "shared" / "lit", capsys) == ([2, 4, 6], 6)
    # every rank loads its shards of step 4 into the live fully_shard model and optimizer
    resume = str(tmp_path / "ckpts" / "epoch=1-step=4.ckpt")
    out = _run(
        tmp_path,
        shm_path,
        "--strategy",
        "mp",
        "--max-steps",
        "6",
        "--every",
        "0",
        "--resume",
        resume,
        "--dump",
        str(tmp_path / "b.pt"),
    )
    assert _tagged(out, "RESUMED") == [4, 4]
    _assert_same_training_state(torch.load(tmp_path / "b.pt"), torch.load(tmp_path / "a.pt"))


# -- one process: the CheckpointIO --------------------------------------------------------------------
ODD = {
    1: "an int key",
    (2, "b"): [1.5, math.inf, -math.inf, None, True, 2**70],
    "int16": torch.tensor([1, -2], dtype=torch.int16),
    "bf16": torch.tensor(3.5, dtype=torch.bfloat16),
    "empty": torch.empty(0, 3),
    "dtype": torch.float16,
    "device": torch.device("cpu"),
    "ordered": OrderedDict(b=1, a=(2, 3)),
}


class RecordingNet(Net):
    """The model of lightning_train.py, keeping a copy of every checkpoint dict Lightning saves."""

    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        super().__init__(sharded=False)
        self.extra = extra or {}
        self.saved: list[dict[str, Any]] = []

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint.update(self.extra)
        self.saved.append(copy.deepcopy(checkpoint))


def _net(extra: dict[str, Any] | None = None) -> RecordingNet:
    L.seed_everything(0, verbose=False)
    return RecordingNet(extra)


def _fit(
    root: Path, dram: Path, model: L.LightningModule, steps: int, resume: str | None = None
) -> L.Trainer:
    config = shoal.Config(shared=str(root / "shared"), local=str(root / "local"), dram=str(dram), job="one")
    checkpoints = ModelCheckpoint(
        dirpath=root / "ckpts",
        every_n_train_steps=2,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    trainer = L.Trainer(
        plugins=[ShoalCheckpointIO(config)],
        devices=1,
        accelerator="cpu",
        max_steps=steps,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
    # not shuffled: one process has no DistributedSampler, whose order depends on the epoch alone
    trainer.fit(model, DataLoader(data, batch_size=4), ckpt_path=resume)
    return trainer


def _final(trainer: L.Trainer) -> dict[str, Any]:
    model = trainer.lightning_module
    assert model is not None
    state = {
        "model": model.state_dict(),
        "optim": trainer.optimizers[0].state_dict(),
        "global_step": trainer.global_step,
    }
    return copy.deepcopy(state)


def _io(root: Path, dram: Path) -> ShoalCheckpointIO:
    return ShoalCheckpointIO(
        shoal.Config(shared=str(root / "shared"), local=str(root / "local"), dram=str(dram), job="one")
    )


@pytest.mark.timeout(300)
@LIGHTNING_MARKS
@pytest.mark.filterwarnings(
    "ignore:Checkpoint directory .* exists and is not empty:UserWarning"
)  # the resume's
def test_checkpoint_io_resumes_from_last_bit_exact_keeps_lightnings_top_k_and_restores_every_value(
    tmp_path: Path, shm_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    model = _net({"odd": ODD})
    _fit(root, shm_path / "run", model, 4)
    assert _pointers(root / "ckpts") == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4, "last.ckpt": 4}
    assert committed(root / "shared" / "one", capsys) == ([2, 4], 4)
    # every file restores exactly the dict Lightning handed over (the two of step 4 each its own)
    # from the one shoal step they share
    first, last = model.saved[-2:]
    assert first["global_step"] == last["global_step"] == 4
    io = _io(root, shm_path / "run")
    try:
        assert_identical(io.load_checkpoint(root / "ckpts" / "epoch=0-step=4.ckpt"), first)
        assert_identical(io.load_checkpoint(root / "ckpts" / "last.ckpt"), last)
        # a .ckpt written by Lightning's own CheckpointIO is loaded by it
        torch.save(last, root / "plain.ckpt")
        assert_identical(io.load_checkpoint(root / "plain.ckpt"), last)
    finally:
        io.teardown()
    # resumed from last.ckpt (step 4) to 6: the same model and optimizer as 6 steps straight
    resumed = _fit(root, shm_path / "run", _net({"odd": ODD}), 6, resume="last")
    straight = _fit(tmp_path / "straight", shm_path / "straight", _net({"odd": ODD}), 6)
    _assert_same_training_state(_final(resumed), _final(straight))
    assert _pointers(root / "ckpts") == {"epoch=0-step=4.ckpt": 4, "epoch=1-step=6.ckpt": 6, "last.ckpt": 6}
    assert committed(root / "shared" / "one", capsys) == ([4, 6], 6)


@pytest.mark.timeout(300)
@LIGHTNING_MARKS
def test_a_value_only_pickle_could_save_is_refused_before_anything_is_written(
    tmp_path: Path, shm_path: Path
) -> None:
    with pytest.raises(shoal.errors.UnsupportedValue, match="mine/1.*object"):
        _fit(tmp_path, shm_path, _net({"mine": [1, object()]}), 2)
    assert not (tmp_path / "ckpts").exists() or not list((tmp_path / "ckpts").iterdir())


@pytest.mark.timeout(300)
@LIGHTNING_MARKS
def test_a_pointer_whose_step_has_no_surviving_copy_loads_the_newest_restorable_older_step(
    tmp_path: Path, shm_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _net()
    _fit(tmp_path, shm_path, model, 4)
    # the copies of step 4 are lost (the DRAM copy went with close(); the shared one now)
    shutil.rmtree(tmp_path / "shared" / "one" / layout.step_dir(4))
    io = _io(tmp_path, shm_path)
    try:
        checkpoint = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
        assert io.checkpointer.last_load is not None and io.checkpointer.last_load.step == 2
    finally:
        io.teardown()
    assert "step 4 is not restorable" in caplog.text and "loading 2, the newest" in caplog.text
    # step 2 as it was saved (its own dict, kept in the step itself)
    assert_identical(checkpoint, model.saved[0])


@pytest.mark.timeout(300)
def test_pointers_share_a_step_which_is_removed_with_the_last_pointer_naming_it(
    tmp_path: Path, shm_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    io = ShoalCheckpointIO(
        shoal.Config(
            shared=str(tmp_path / "shared"), local=str(tmp_path / "local"), dram=str(shm_path), job="one"
        ),
        wait_for=shoal.Boundary.RESTARTABLE,
    )
    ckpts = tmp_path / "ckpts"
    checkpoint = {"global_step": 3, "state_dict": OrderedDict(w=torch.arange(6.0))}
    try:
        io.save_checkpoint(checkpoint, ckpts / "epoch=0-step=3.ckpt")
        assert io.checkpointer.latest() == 3  # wait_for: the pointer is written once the step is at B4
        io.save_checkpoint(checkpoint, ckpts / "last.ckpt")  # the same step: only a pointer
        io.save_checkpoint({**checkpoint, "global_step": 5}, ckpts / "epoch=0-step=5.ckpt")
        io.remove_checkpoint(ckpts / "epoch=0-step=3.ckpt")  # last.ckpt still names step 3
        assert io.checkpointer.wait(60)
        assert committed(tmp_path / "shared" / "one", capsys) == ([3, 5], 5)
        io.save_checkpoint({**checkpoint, "global_step": 5}, ckpts / "last.ckpt")  # 3 named by nothing now
        assert io.checkpointer.wait(60)
        assert _pointers(ckpts) == {"epoch=0-step=5.ckpt": 5, "last.ckpt": 5}
        assert committed(tmp_path / "shared" / "one", capsys) == ([5], 5)
        assert_identical(io.load_checkpoint(ckpts / "last.ckpt"), {**checkpoint, "global_step": 5})
    finally:
        io.teardown()
    # a new run that went back (its own Checkpointer): step 5 is committed already
    again = _io(tmp_path, shm_path)
    try:
        with pytest.raises(shoal.errors.CheckpointExists, match="global_step 5.*new job"):
            again.save_checkpoint({**checkpoint, "global_step": 5}, ckpts / "other.ckpt")
    finally:
        again.teardown()
    assert not (ckpts / "other.ckpt").exists()
