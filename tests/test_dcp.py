"""shoal under DCP: dcp.save/dcp.load with shoal's storage layer, DTensor and ShardedTensor, resharding."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shoal
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import Pointer
from shoal.testing.checkpoints import assert_state_equal, make_config, rich_state, zeros_like_state


@pytest.fixture
def config(tmp_path, dram_root) -> shoal.Config:
    return make_config(tmp_path, dram_root)


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo process group, as torchrun would give a single-process job."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("no_dist", [True, False])
def test_dcp_save_and_load_with_shoal_storage(config, no_dist, request):
    if not no_dist:
        request.getfixturevalue("process_group")
    state = rich_state(seed=3)
    with shoal.Checkpointer(config) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming a single process" notice
        writer = shoal.dcp.StorageWriter(ckpt, step=11)
        dcp.save(state, storage_writer=writer, planner=shoal.dcp.SavePlanner(), no_dist=no_dist)
        assert writer.handle.done(shoal.Boundary.STAGED)
        writer.handle.wait(shoal.Boundary.RESTARTABLE, timeout=60)
        out = zeros_like_state(state)
        reader = shoal.dcp.StorageReader(ckpt, step=11)
        dcp.load(out, storage_reader=reader, no_dist=no_dist)
        assert reader.step == 11
    # DCP replaces non-tensor values in the dict it is given
    assert_state_equal(out, state)


def test_dtensor_round_trip(config, process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(64, 32)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.randn(32)}
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        target = {"w": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)]), "b": torch.zeros(32)}
        ckpt.load(target)
        assert torch.equal(target["w"].full_tensor(), full)
        assert torch.equal(target["b"], state["b"])
        # resharding: a DTensor checkpoint loads into a plain tensor
        plain = {"w": torch.zeros(64, 32), "b": torch.zeros(32)}
        ckpt.load(plain)
        assert torch.equal(plain["w"], full)


def _sharded(full: torch.Tensor, shards: int):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    rows = full.shape[0] // shards
    local = [
        STShard(
            full[i * rows : (i + 1) * rows].clone(),
            ShardMetadata([i * rows, 0], [rows, full.shape[1]], "rank:0/cpu"),
        )
        for i in range(shards)
    ]
    return init_from_local_shards(local, list(full.shape))


def test_sharded_tensor_saved_in_shards_loads_into_other_layouts(config, process_group):
    full = torch.randn(48, 16)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", (FutureWarning, DeprecationWarning)
        )  # ShardedTensor is deprecated upstream
        state = {"emb": _sharded(full, 2)}
        with shoal.Checkpointer(config) as ckpt:
            ckpt.save(1, state).wait(timeout=60)
            manifest_keys = set(ckpt.runtime.resolve_manifest(1).items)
            assert manifest_keys == {"emb@0_0", "emb@24_0"}  # one item per saved shard
            # two saved shards -> one plain tensor (each read takes one stored item)
            plain = {"emb": torch.zeros(48, 16)}
            ckpt.load(plain)
            assert torch.equal(plain["emb"], full)
            # two shards -> three shards (reads take slices of stored items)
            three = {"emb": _sharded(torch.zeros(48, 16), 3)}
            ckpt.load(three)
            for shard in three["emb"].local_shards():
                r0 = shard.metadata.shard_offsets[0]
                assert torch.equal(shard.tensor, full[r0 : r0 + shard.tensor.shape[0]])
            # and a plain tensor checkpoint loads into shards
            ckpt.save(2, {"emb": full * 2}).wait(timeout=60)
            two = {"emb": _sharded(torch.zeros(48, 16), 2)}
            ckpt.load(two, step=2)
            assert torch.equal(torch.cat([s.tensor for s in two["emb"].local_shards()]), full * 2)


def test_writer_refuses_a_checkpoint_id(config):
    with shoal.Checkpointer(config) as ckpt:
        writer = shoal.dcp.StorageWriter(ckpt, step=1)
        with pytest.raises(ValueError, match="checkpoint_id"):
            writer.reset("/some/path")


def _reseal(config: shoal.Config, step: int, edit) -> None:
    """Rewrite step ``step``'s manifest on the shared tier with ``edit``, and its COMMIT and LATEST to match.

    What a buggy or hostile writer could leave: a manifest whose digest checks out.
    """
    job = Path(config.shared) / config.job
    path = job / layout.manifest_path(step)
    doc = json.loads(path.read_bytes())
    edit(doc)
    data = json.dumps(doc).encode()
    path.write_bytes(data)
    pointer = Pointer(step, digest(data)).encode()
    (job / layout.commit_path(step)).write_bytes(pointer)
    (job / layout.LATEST).write_bytes(pointer)


def _fresh_host(config: shoal.Config, tmp_path: Path, name: str) -> shoal.Config:
    """The same job with empty host tiers of its own: a load consults the shared tier only."""
    return dataclasses.replace(
        config, dram=str(Path(config.dram or tmp_path) / name), local=str(tmp_path / name)
    )


def _set(*path: str, value: object):
    def edit(doc: dict) -> None:
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return edit


def _point_w_at_b(doc: dict) -> None:
    for entry in doc["dcp"]["storage_data"]:
        if entry["fqn"] == "w":
            entry["value"] = "b"


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (_set("items", "w", "dtype", value="int32"), ["item 'w'", "int32", "float32"]),
        (_set("items", "w", "shape", value=[3, 4]), ["item 'w'", "[3, 4]", "[4, 3]"]),
        (_set("items", "w", "kind", value="bytes"), ["item 'w'", "'bytes'", "'tensor'"]),
        (_set("dcp", "state_dict_metadata", "w", "properties", "dtype", value="int32"), ["'w'", "int32"]),
        (_set("dcp", "state_dict_metadata", "w", "size", value=[5, 3]), ["'w'", "12 elements", "15"]),
        (_set("dcp", "state_dict_metadata", "w", "properties", "dtype", value=5), ["properties.dtype"]),
        (_set("dcp", "storage_data", value={"w": "w"}), ["storage_data"]),
        (_point_w_at_b, ["names item 'b'", "expected item 'w'"]),
    ],
    ids=[
        "item-dtype",
        "item-shape",
        "item-kind",
        "dcp-dtype",
        "dcp-size",
        "dcp-malformed",
        "dcp-storage",
        "swap",
    ],
)
def test_manifest_disagreeing_with_its_dcp_metadata_is_refused_before_a_byte_is_copied(
    config, tmp_path, edit, fragments
):
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": w, "b": w + 100}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    _reseal(config, 1, edit)
    out = {"w": torch.zeros(4, 3), "b": torch.zeros(4, 3)}
    with shoal.Checkpointer(_fresh_host(config, tmp_path, "reader")) as ckpt:
        with pytest.raises(shoal.errors.FormatError) as info:
            ckpt.load(out)
        for fragment in fragments:
            assert fragment in str(info.value)
        # DCP's own front door refuses it too (DCP wraps every rank's error in its CheckpointException)
        with warnings.catch_warnings(), pytest.raises(CheckpointException) as wrapped:
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=shoal.dcp.StorageReader(ckpt, step=1), no_dist=True)
        (failure,) = wrapped.value.failures.values()
        assert isinstance(failure[0] if isinstance(failure, tuple) else failure, shoal.errors.FormatError)
    assert torch.equal(out["w"], torch.zeros(4, 3)) and torch.equal(out["b"], torch.zeros(4, 3))


def test_a_missing_step_through_dcp_load_is_checkpoint_not_found_not_dcps_assertion(config):
    with shoal.Checkpointer(config) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        with pytest.raises(CheckpointException) as wrapped:
            dcp.load(
                {"w": torch.zeros(3)}, storage_reader=shoal.dcp.StorageReader(ckpt, step=99), no_dist=True
            )
    (failure,) = wrapped.value.failures.values()
    error = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(error, shoal.errors.CheckpointNotFound), error
    assert "99" in str(error)
