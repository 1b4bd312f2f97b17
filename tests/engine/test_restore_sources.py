"""Restore in one process: DRAM first, verification, repair from another copy, the load report."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

import shoal
from shoal.format import layout
from shoal.testing.checkpoints import assert_state_equal, flip_byte, make_config, zeros_like_state


@pytest.fixture
def config(tmp_path, dram_root) -> shoal.Config:
    return make_config(tmp_path, dram_root)


def _staged_slab(dram_root) -> str:
    """The slab that holds the staged checkpoint, as its staged index says."""
    (index,) = glob.glob(os.path.join(str(dram_root), "**", "staged", "*.json"), recursive=True)
    with open(index) as f:
        doc = json.load(f)
    return os.path.join(os.path.dirname(os.path.dirname(index)), "slabs", doc["slab"] + ".slab")


def test_a_load_in_the_saving_process_reads_its_dram_slab_not_shared_storage(config):
    state = {"w": torch.randn(100_000), "b": torch.arange(1000)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        out = zeros_like_state(state)
        assert ckpt.load(out) == 1
        assert_state_equal(out, state)
        report = ckpt.last_load
        assert report is not None and report.origin == "shared"
        assert set(report.bytes_by_tier) == {"dram"} and report.repaired == 0


def test_the_loaded_event_says_where_the_load_spent_its_time(config):
    """The ``loaded`` event's ``phases``: every part of the load, each a share of the whole, with
    the reads, the digest checks and the copies of a load from DRAM among them."""
    from shoal.records.events import read_events

    state = {"w": torch.randn(1_000_000), "b": torch.arange(1000)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        ckpt.load(zeros_like_state(state))
        assert ckpt.config.event_log is not None
        (loaded,) = read_events(ckpt.config.event_log, kinds=("loaded",))
    phases = loaded["phases"]
    assert set(phases) == {
        "choose", "caller", "agree", "places", "read", "verify", "copy", "rounds", "exchange", "stats",
        "after",
    }  # fmt: skip
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= loaded["seconds"]
    assert phases["read"] > 0 and phases["verify"] > 0 and phases["copy"] > 0


def test_a_corrupt_dram_copy_is_repaired_from_shared_storage(config, dram_root):
    state = {"w": torch.randn(100_000)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        slab = _staged_slab(dram_root)
        flip_byte(slab, 70_000)  # inside chunk 1 of 'w'
        out = zeros_like_state(state)
        assert ckpt.load(out) == 1
        assert_state_equal(out, state)
        report = ckpt.last_load
        assert report is not None and report.repaired == 1
        assert report.bytes_by_tier["shared"] == 64 << 10  # only the bad chunk came from shared storage


def test_with_every_copy_corrupt_the_load_fails_naming_the_item_and_each_copy(config, dram_root, tmp_path):
    state = {"w": torch.randn(100_000)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        slab = _staged_slab(dram_root)
        (pack,) = glob.glob(os.path.join(str(tmp_path), "shared", "**", "*.pack"), recursive=True)
        flip_byte(slab, 70_000)
        flip_byte(pack, 70_000)
        out = zeros_like_state(state)
        with pytest.raises(shoal.ChecksumMismatch) as err:
            ckpt.load(out)
        manifest, shared_url = ckpt.shared.read(layout.manifest_path(1)), ckpt.shared.url
    msg = str(err.value)
    assert "'w' chunk 1" in msg and "slab" in msg and os.path.basename(pack) in msg
    assert torch.count_nonzero(out["w"][16384:32768]) == 0  # the bad bytes never reached the tensor
    # each copy tried is named with its tier, file and offset, and both digests
    chunk = json.loads(manifest)["items"]["w"]["chunks"][1]
    pack_offset = json.loads(manifest)["locations"][chunk][1]
    shared_copy = f"pack {shared_url}/packs/{os.path.basename(pack)} at offset {pack_offset} (shared tier)"
    assert f"item 'w' chunk 1 ({chunk}) read from {shared_copy}: BLAKE3 digest is " in msg
    slab_name = os.path.basename(slab).removesuffix(".slab")
    assert f"item 'w' chunk 1 ({chunk}) read from slab {slab_name} of " in msg
    assert msg.count(f"expected {chunk}") == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_with_shoals_reader_right_after_save_sees_the_checkpoint(config):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(50_000), "step": 7}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(7, state)  # not waited for: the reader finishes it first
        out = zeros_like_state(state)
        reader = shoal.dcp.StorageReader(ckpt)
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert reader.step == 7 and reader.report is not None
        assert_state_equal(out, state)
