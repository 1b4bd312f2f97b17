"""shoal inside Hugging Face Accelerate: ``save_state``/``load_state`` through shoal, end to end.

The two-process test runs ``tests/integrations/accelerate_train.py`` under torchrun (gloo on CPU),
SIGKILLs every process once a checkpoint is committed, restarts it and checks the resumed run
against the killed one's own (uninterrupted) state at a later step, bit for bit. The one-process
tests run an ``Accelerator`` in this process and check each piece of state and each refusal.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

import shoal
from shoal.errors import CheckpointExists, ConfigError, StateMismatch, UnsupportedValue
from shoal.integrations.accelerate import ShoalState, use_shoal

from .shoal_ls import committed

SCRIPT = Path(__file__).with_name("accelerate_train.py")
SRC = Path(shoal.__file__).resolve().parents[1]
SET_VITAL = "ignore:'set_vital' is deprecated:UserWarning"  # torchdata's StatefulDataLoader, on each iterator


def same(a: Any, b: Any, where: str = "") -> None:
    """Assert ``a`` and ``b`` are equal, tensors bit for bit (``torch.equal``), naming where not."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# -- two processes, SIGKILL, restart ------------------------------------------------------


def _torchrun(root: Path, dram: Path, tag: str, *extra: str) -> subprocess.Popen[bytes]:
    args = ["--ckpt-shared", str(root / "shared"), "--ckpt-local", str(root / "local")]
    args += ["--ckpt-dram", str(dram), "--project-dir", str(root / "project")]
    args += ["--dump-dir", str(root / "out"), "--tag", tag, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env["ACCELERATE_TEST_HOST_PER_RANK"] = "1"  # two simulated hosts: each checkpoint goes to its partner
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    log = open(root / f"{tag}.log", "wb")  # noqa: SIM115 (closed with the process below)
    proc = subprocess.Popen([*cmd, str(SCRIPT), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _log(root: Path, tag: str) -> str:
    return (root / f"{tag}.log").read_text(errors="replace")[-4000:]


def _starts(root: Path, tag: str) -> list[dict[str, Any]]:
    return [json.loads((root / "out" / f"{tag}-start-rank{r}.json").read_text()) for r in (0, 1)]


def _kill(proc: subprocess.Popen[bytes], root: Path, tag: str) -> None:
    """SIGKILL torchrun and each worker that said its pid (torchrun starts each in a session of its own)."""
    for path in (root / "out").glob(f"{tag}-start-rank*.json") if proc.poll() is None else []:
        pid = json.loads(path.read_text())["pid"]
        with contextlib.suppress(OSError):  # (gone already: nothing to kill, and no other process's pid)
            if SCRIPT.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
    proc.log.close()  # type: ignore[attr-defined]


@pytest.mark.timeout(400)
def test_two_processes_killed_after_a_commit_resume_bit_exact(
    shm_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path
    (root / "out").mkdir()
    # saves at steps 3, 6, 9 (shoal steps 0, 1, 2; total_limit=2); at step 11 (epoch 2) it writes its
    # state, waits for step 9's checkpoint to be committed and sleeps: then every process is SIGKILLed
    first = _torchrun(root, shm_path, "first", "--steps", "100", "--dump-at", "11", "--hang-at", "11")
    marker = root / "out" / "first-committed"
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert first.poll() is None, (
                f"the first run ended (rc {first.returncode}):\n{_log(root, 'first')}"
            )
            assert time.monotonic() < deadline, f"no commit within 300 s:\n{_log(root, 'first')}"
            time.sleep(0.2)
        assert marker.read_text() == "2"
        started = _starts(root, "first")
        assert [s["resumed"] for s in started] == [None, None] and started[0]["step"] == 0
    finally:
        _kill(first, root, "first")

    # the restart resumes from shoal step 2 (training step 9, mid-epoch 1 of the stateful dataloader),
    # trains to step 12 (saving shoal step 3 there) and writes its state at step 11 again
    second = _torchrun(root, shm_path, "second", "--steps", "12", "--dump-at", "11")
    try:
        assert second.wait(timeout=300) == 0, _log(root, "second")
    finally:
        _kill(second, root, "second")
    for start in _starts(root, "second"):
        assert (start["resumed"], start["step"], start["iteration"]) == (2, 9, 3)
    for rank in (0, 1):
        uninterrupted = torch.load(root / "out" / f"first-rank{rank}.pt", weights_only=True)
        resumed = torch.load(root / "out" / f"second-rank{rank}.pt", weights_only=True)
        assert uninterrupted["progress"]["by_epoch"] == {0: 5, 1: 5, 2: 1}
        for part in ("model", "optimizer", "scheduler", "progress", "torch_rng", "python_rng", "numpy_rng"):
            same(uninterrupted[part], resumed[part], f"rank {rank} {part}")
    # total_limit=2 is shoal's keep_last: of steps 0..3 the shared tier keeps the newest two
    assert committed(root / "shared" / "acc", capsys) == ([2, 3], 3)


# -- one process, in this process -----------------------------------------------------------


class Counter:
    """A registered object whose state has an int-keyed dict, a tuple, a growing list and a tensor."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"n": 0, "seen": {}, "pair": (1, 2.5), "hist": [], "ema": torch.zeros(3)}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's process-wide state singletons, cleared after each test."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _setup(
    root: Path, dram: Path, *, total_limit: int | None = 2
) -> tuple[Accelerator, Any, Any, Any, Any, Counter, ShoalState]:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    set_seed(7)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(root / "project"), automatic_checkpoint_naming=True, total_limit=total_limit
        ),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True),
    )
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.9**e)
    data = DataLoader(
        TensorDataset(torch.randn(48, 6)), batch_size=4, shuffle=True, generator=torch.Generator()
    )
    model, optimizer, scheduler, data = accelerator.prepare(model, optimizer, scheduler, data)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    config = shoal.Config(shared=str(root / "shared"), local=str(root / "local"), dram=str(dram), job="one")
    return accelerator, model, optimizer, scheduler, data, counter, use_shoal(accelerator, config)


def _train(
    accelerator: Accelerator,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    batches: Iterator[Any],
    counter: Counter,
    n: int,
) -> None:
    for _ in range(n):
        (x,) = next(batches)
        loss = model(x).pow(2).mean() + 1e-3 * (random.random() + float(np.random.rand()))
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        st = counter.state
        st["n"] += 1
        value = loss.item()
        st["seen"][st["n"]] = (st["n"] % 3, value)
        st["hist"].append(value)
        st["ema"].mul_(0.9).add_(x.mean(0)[:3])


@pytest.mark.filterwarnings(SET_VITAL)
@pytest.mark.timeout(120)
def test_one_process_every_piece_restored(shm_path: Path, tmp_path: Path, fresh_accelerate: None) -> None:
    acc, model, opt, sched, data, counter, ckpts = _setup(tmp_path, shm_path)
    assert ckpts.checkpointer.config.keep_last == 2  # total_limit
    assert ckpts.resume() is None  # a job with no checkpoint: nothing loaded
    acc.save_state().wait()  # before the first step: the optimizer's state is still empty
    batches = iter(data)
    _train(acc, model, opt, sched, batches, counter, 5)  # 5 of 12 batches into epoch 0
    handle = acc.save_state()
    assert (handle.step, acc.project_configuration.iteration) == (1, 2)
    handle.wait()
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "counter": {
            **counter.state,
            "ema": counter.state["ema"].clone(),
            "hist": list(counter.state["hist"]),
        },
        "rng": (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()),
    }
    ahead = [next(batches)[0] for _ in range(3)]
    draws = (random.random(), float(np.random.rand()), torch.rand(2))
    ckpts.close()

    acc, model, opt, sched, data, counter, ckpts = _setup(tmp_path, shm_path)
    assert ckpts.resume() == 1
    assert acc.project_configuration.iteration == 2
    same(saved["model"], dict(model.state_dict()), "model")
    same(saved["optimizer"], opt.state_dict(), "optimizer")
    same(saved["scheduler"], sched.state_dict(), "scheduler")
    same(saved["counter"], counter.state, "counter")  # int keys, the tuple, the list and the tensor
    same(saved["rng"], (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()), "rng")
    same(draws, (random.random(), float(np.random.rand()), torch.rand(2)), "draws")
    same(ahead, [b[0] for _, b in zip(range(3), data, strict=False)], "the dataloader's next batches")

    # an empty optimizer state loads as empty (into an optimizer that has stepped)
    assert acc.load_state(step=0) == 0 and opt.state_dict()["state"] == {}
    assert acc.project_configuration.iteration == 1
    with pytest.raises(CheckpointExists, match="already holds step 1"):
        acc.save_state()  # would write step 1 again: the first save checks the numbering
    ckpts.close()


@pytest.mark.filterwarnings(SET_VITAL)
@pytest.mark.timeout(120)
def test_one_process_refusals(shm_path: Path, tmp_path: Path, fresh_accelerate: None) -> None:
    acc, model, opt, sched, data, counter, ckpts = _setup(tmp_path, shm_path, total_limit=None)
    assert ckpts.checkpointer.config.keep_last == 3  # no total_limit: Config.keep_last stands
    with pytest.raises(ConfigError, match="checkpoints live in Config.shared"):
        acc.save_state("somewhere")
    with pytest.raises(ConfigError, match="already uses shoal"):
        use_shoal(acc, ckpts.checkpointer.config)
    hook = acc.register_save_state_pre_hook(lambda models, weights, out: None)
    with pytest.raises(ConfigError, match="pre-hook"):
        acc.save_state()
    hook.remove()
    counter.state["bad"] = np.zeros(2)  # would need pickle to load
    with pytest.raises(UnsupportedValue, match="custom"):
        acc.save_state()
    del counter.state["bad"]
    acc.save_state().wait()
    acc.register_for_checkpointing(Counter())
    with pytest.raises(StateMismatch, match="holds 1 custom, the accelerator has 2"):
        acc.load_state()
    ckpts.close()
    assert "save_state" not in vars(acc)  # close gives Accelerate its own methods back
