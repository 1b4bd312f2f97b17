"""``dcp.async_save`` through shoal's writer (its ``AsyncStager``): returns at B1, completes at a boundary."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import shoal
from shoal.testing.checkpoints import assert_state_equal, make_config, zeros_like_state
from shoal.testing.multiproc import run_ranks

# DCP's own warning for every save of a single process (no_dist), which these tests make on purpose.
single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"model": {"w": torch.randn(300_000, generator=g), "b": torch.randn(17, generator=g)}, "epoch": 3}


def _copy(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()}, "epoch": state["epoch"]}


@single_process
def test_async_save_returns_at_b1_and_its_future_completes_at_b4(tmp_path, dram_root):
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        state = _state()
        expected = _copy(state)
        writer = shoal.dcp.StorageWriter(ckpt, 1)
        fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
        assert writer.handle.reached is not None  # staged when async_save returned
        state["model"]["w"].add_(1.0)  # the next training step: the checkpoint keeps what was staged
        fut.result(timeout=60)
        assert writer.handle.reached == shoal.Boundary.RESTARTABLE
        assert ckpt.latest() == 1
        out = zeros_like_state(expected)
        assert ckpt.load(out, step=1) == 1
        assert_state_equal(out, expected)


@single_process
def test_a_writer_stages_once_and_refuses_bad_settings(tmp_path, dram_root):
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        with pytest.raises(shoal.errors.ConfigError, match="durable_at"):
            shoal.dcp.StorageWriter(ckpt, 1, durable_at=shoal.Boundary.STAGED)
        with pytest.raises(shoal.errors.ConfigError, match="timeout"):
            shoal.dcp.StorageWriter(ckpt, 1, timeout=0)
        writer = shoal.dcp.StorageWriter(ckpt, 1)
        with pytest.raises(shoal.errors.UnsupportedValue, match="checkpoint process"):
            pickle.dumps(writer)  # DCP's process checkpointer, before shoal staged: said, not a crash there
        dcp.async_save(_state(), storage_writer=writer, no_dist=True).result(timeout=60)
        with pytest.raises(shoal.errors.StateError, match="staged its save already"):
            writer.stage(_state())


@single_process
def test_an_explicit_async_stager_still_saves_through_shoal(tmp_path, dram_root):
    """Given DCP's own stager, DCP copies first and shoal's writer stages that copy (two copies, correct)."""
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        state = _state()
        expected = _copy(state)
        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            writer = shoal.dcp.StorageWriter(ckpt, 4)
            dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True).result(timeout=60)
        finally:
            stager.close()
        writer.handle.wait(timeout=60)
        out = zeros_like_state(expected)
        assert ckpt.load(out, step=4) == 4
        assert_state_equal(out, expected)


def _check(results: list[dict]) -> None:
    assert len(results) == 2
    for r in results:
        assert r["returned_at"] == "STAGED"
        # held back before the drain: the B2 future completed with the checkpoint on two hosts only
        assert r["at_b2_future"] == "REPLICATED"
        assert r["at_b4_future"] == "RESTARTABLE" and r["latest_after_b4_future"] == 1
        assert r["failed"] is not None and "CheckpointFailed" in r["failed"], r["failed"]
        assert "pipeline.before_drain" in r["failed"]
        assert r["latest_after_failure"] == 2  # the failed step never became the restart point


def test_thread_checkpointer_on_two_hosts_b2_b4_and_a_failed_drain(tmp_path):
    from shoal.testing.async_save import boundaries_and_failure

    results = run_ranks(
        boundaries_and_failure,
        hosts=["h0", "h1"],
        kwargs={"root": str(tmp_path), "kind": "thread", "hold": 3.0},
        timeout=240,
    )
    _check(results)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_process_checkpointer_on_two_hosts_b2_b4_and_a_failed_drain(tmp_path):
    """DCP's process checkpointer: ranks launched by torchrun, as a user runs them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "shoal.testing.async_save", str(tmp_path), "process", "4",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1]
    _check(results)
