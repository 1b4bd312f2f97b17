"""shoal as Megatron's local checkpoint manager: two ranks (gloo), SIGKILLed, resumed bit-exact.

Megatron-LM's trainer cannot run here (see ``megatron_train.py``): each rank drives megatron.core's
GPTModel, its ``MCoreTensorAwareStateDict`` and :class:`ShoalLocalCheckpointManager` (an NVRx
``BaseCheckpointManager``) as Megatron-LM's ``save_checkpoint``/``load_checkpoint`` do. Two runs on
two simulated hosts (``h0``, ``h1``: each checkpoint goes to the partner host too):

1. iterations 1..3, one save each (1 through NVRx's async request, whose process is forked as
   megatron.core's async caller does and ends once the checkpoint is committed, each commit delayed
   by a failpoint; 2 and 3 returning at B1), on to an uninterrupted iteration 4, then every rank
   SIGKILLed once iteration 2 is committed;
2. a fresh model: ``find_latest()`` is 3 (the newest every rank can restore: its DRAM slabs
   survived the crash), ``load()`` gives it back; model, optimizer and RNG bit-exact against the
   killed run's after 3, and after a 4th iteration against its uninterrupted 4th; save 4.

Checked too: the ids NVRx's contract names, ``keep_last=2`` on the shared tier (3 and 4 committed
at the end), and the refusals that need no process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("nvidia_resiliency_ext")
pytest.importorskip("megatron.core")

import shoal  # noqa: E402
from shoal.errors import ConfigError  # noqa: E402
from shoal.integrations.megatron import ShoalLocalCheckpointManager, use_shoal  # noqa: E402
from shoal.testing.multiproc import run_ranks  # noqa: E402

from .megatron_train import basic_round_trip, resume, train_then_die  # noqa: E402
from .shoal_ls import committed

HOSTS = ["h0", "h1"]


@pytest.mark.timeout(300)
def test_sigkill_then_find_latest_and_load_are_bit_exact(
    tmp_path: Path, dram_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = {"root": str(tmp_path), "dram": str(dram_root)}
    slow_commit = {"SHOAL_FAILPOINTS": "pipeline.before_commit=delay:1.0"}  # the async process must wait
    died = run_ranks(
        train_then_die, hosts=HOSTS, kwargs=where, env=slow_commit, timeout=240, allow_death=[0, 1]
    )
    assert died == [None, None]
    steps, _ = committed(tmp_path / "shared" / "gpt", capsys)
    assert 2 in steps and max(steps) <= 3, steps  # 1 and 2 committed (1 maybe retired); 3 maybe

    out = run_ranks(resume, hosts=HOSTS, kwargs=where, timeout=240)
    assert [o["found"] for o in out] == [3, 3]
    assert [o["ckpt_id"] for o in out] == [[3, 0, ""], [3, 1, ""]]  # (iteration, rank, session_id)
    assert committed(tmp_path / "shared" / "gpt", capsys) == ([3, 4], 4)  # keep_last=2


def test_refusals_before_any_collective() -> None:
    config = shoal.Config(shared="/nonexistent", job="x")
    with pytest.raises(ConfigError, match="replication"):
        ShoalLocalCheckpointManager(config, repl_strategy=object())
    with pytest.raises(ConfigError, match="on_busy"):
        ShoalLocalCheckpointManager(shoal.Config(shared="/nonexistent", on_busy="skip"))


def test_use_shoal_replaces_the_manager_megatron_lm_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers import local_manager

    monkeypatch.setattr(local_manager, "LocalCheckpointManager", local_manager.LocalCheckpointManager)
    use_shoal(shoal.Config(shared="/nonexistent", job="x"))
    build = local_manager.LocalCheckpointManager
    assert build is not ShoalLocalCheckpointManager and callable(build)
    with pytest.raises(ConfigError, match="replication"):  # Megatron-LM's call with --replication
        build("/local/ckpt", repl_strategy=object())


@pytest.mark.timeout(120)
def test_basic_tensor_aware_state_dict_round_trip(tmp_path: Path, dram_root: Path) -> None:
    run_ranks(
        basic_round_trip, hosts=["h0"], kwargs={"root": str(tmp_path), "dram": str(dram_root)}, timeout=100
    )
