"""The README's quickstart runs as written (its paths pointed at private temporary directories), and
its resume block, run in a fresh interpreter, restores the model *and* the optimizer bit for bit."""

from __future__ import annotations

import copy
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

from shoal.testing.checkpoints import assert_identical

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

TRAIN_STEP = """
def train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(8, 16, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
"""One deterministic training step (its batch seeded by the step), the same in every process."""

AFTER_RESUME = """
import copy
fresh_model, fresh_opt = FRESH
loaded = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}
train_step(model, opt, 101)
after = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}

# the pattern the quickstart used to show: a fresh optimizer's state_dict() has nothing to load into
old_model = torch.nn.Linear(16, 8)
old_opt = torch.optim.AdamW(old_model.parameters())
with shoal.Checkpointer(cfg) as ckpt:
    old = {"model": old_model.state_dict(), "optim": old_opt.state_dict()}
    ckpt.load(old)
    old_opt.load_state_dict(old["optim"])
torch.save(
    {"fresh": {"model": fresh_model, "optim": fresh_opt}, "loaded": loaded, "after": after,
     "old_pattern_optim_state": old_opt.state_dict()["state"]},
    OUT,
)
print(step)
"""
"""Appended to the resume block: what it restored, one more step, and the old pattern for contrast."""


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _adapt(block: str, replacements: dict[str, str]) -> str:
    """``block`` with each README text replaced, every one of which must be there."""
    for old, new in replacements.items():
        assert block.count(old) == 1, f"the README's quickstart no longer says {old!r}"
        block = block.replace(old, new)
    return block


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}


def test_readme_quickstart_saves_and_its_resume_block_restores_model_and_optimizer_in_a_fresh_process(
    tmp_path: pathlib.Path, dram_root: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = _python_blocks()
    train = next(b for b in blocks if "shoal.Checkpointer(cfg)" in b and "ckpt.save(" in b)
    resume = next(b for b in blocks if "shoal.Checkpointer(cfg)" in b and "set_state_dict(model" in b)
    roots = f"dram={str(dram_root)!r}, local={str(tmp_path / 'local')!r}"
    private = {
        '"/tmp/shoal-quickstart"': repr(str(tmp_path / "shared")),
        "keep_last=3)": f"keep_last=3, {roots})",
        "torch.nn.Linear(1024, 1024)": "torch.nn.Linear(16, 8)",  # small: the test trains it
    }

    # the uninterrupted run: the quickstart as written, training for real, then one step more
    code = TRAIN_STEP + _adapt(train, {**private, "...  # train": "train_step(model, opt, step)"})
    ns: dict[str, Any] = {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        exec(compile(code, str(README), "exec"), ns)
    assert capsys.readouterr().out.splitlines()[-1] == "100"
    saved = _state(ns["model"], ns["opt"])
    ns["train_step"](ns["model"], ns["opt"], 101)
    after = _state(ns["model"], ns["opt"])
    assert saved["optim"]["state"][0]["step"] == 100  # AdamW's moments and step count are in play

    # the resume block in a fresh interpreter, its model initialized differently
    out = tmp_path / "resumed.pt"
    code = _adapt(
        resume,
        {
            **private,
            "opt = torch.optim.AdamW(model.parameters())\n": (
                "opt = torch.optim.AdamW(model.parameters())\n"
                "FRESH = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))\n"
            ),
        },
    )
    prelude = "import copy\nimport torch\ntorch.manual_seed(1)\n"
    script = f"{prelude}{TRAIN_STEP}{code}OUT = {str(out)!r}\n{AFTER_RESUME}"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "SHOAL_FAILPOINTS"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "100", proc.stdout
    resumed = torch.load(out, weights_only=True)

    fresh = resumed["fresh"]
    assert not torch.equal(fresh["model"]["weight"], saved["model"]["weight"])  # loading had work to do
    assert fresh["optim"]["state"] == {}  # a fresh optimizer: no moments, no step count
    assert_identical(resumed["loaded"], saved)  # weights, exp_avg, exp_avg_sq, step, param groups
    assert_identical(resumed["after"], after)  # and training goes on exactly as without the restart
    assert resumed["old_pattern_optim_state"] == {}  # what the quickstart's old pattern restored
