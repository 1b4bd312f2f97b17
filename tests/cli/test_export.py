"""``shoal export``: stock DCP directories and safetensors files from real checkpoints."""

from __future__ import annotations

import json
import pickle
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

import shoal
from shoal.cli.export_safetensors import supported_dtype
from shoal.cli.main import main
from shoal.format import layout
from shoal.testing.checkpoints import assert_state_equal, bits, make_config, rich_state, zeros_like_state
from shoal.tiers.shared import FsspecTier

safetensors_torch = pytest.importorskip("safetensors.torch")


class RowShards(torch.Tensor):
    """A tensor DCP saves as blocks of ``rows`` rows, each its own write item (like a sharded DTensor)."""

    rows: int

    @staticmethod
    def __new__(cls, data: torch.Tensor, rows: int) -> RowShards:
        t = torch.Tensor._make_subclass(cls, data)
        t.rows = rows
        return t

    def _blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        full = self.as_subclass(torch.Tensor)
        for start in range(0, full.shape[0], self.rows):
            yield start, full[start : start + self.rows]

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        full = self.as_subclass(torch.Tensor)
        props = TensorProperties.create_from_tensor(full)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([start] + [0] * (full.dim() - 1))),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size([start] + [0] * (full.dim() - 1)), block.shape),
                    properties=props,
                    size=full.shape,
                ),
            )
            for start, block in self._blocks()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None
        return next(block.contiguous() for start, block in self._blocks() if start == index.offset[0])


@pytest.fixture
def config(tmp_path: Path, dram_root: Path) -> shoal.Config:
    return make_config(tmp_path, dram_root)


def save(config: shoal.Config, *states: dict[str, Any]) -> str:
    """Save ``states`` as steps 1, 2, ... and return the job directory."""
    with shoal.Checkpointer(config) as ckpt:
        for step, state in enumerate(states, start=1):
            ckpt.save(step, state).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    return config.shared_url()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def dcp_load(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming a single process" notice
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[prefix + k] = v
        elif isinstance(v, dict):
            out |= flat_tensors(v, f"{prefix}{k}.")
    return out


def sharded_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": RowShards(torch.randn(10, 6, generator=g), rows=4),
        "emb": RowShards(torch.randn(9, 3, generator=g).bfloat16(), rows=3),
        "b": torch.arange(6),
        "step": 12,
    }


def plain(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.as_subclass(torch.Tensor).clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
    }


# -- dcp -----------------------------------------------------------------------------------------


def test_export_dcp_loads_bit_exact_with_the_stock_filesystem_reader(config, tmp_path, capsys):
    state = rich_state()
    url = save(config, state)
    out_dir = tmp_path / "dcp"
    code, out, err = run(capsys, "export", url, "--format", "dcp", str(out_dir))
    assert code == 0, err
    assert "exported step 1" in out
    assert sorted(p.name for p in out_dir.iterdir()) == [".metadata", "__0_0.distcp"]
    target = zeros_like_state(state)
    dcp_load(target, out_dir)
    assert_state_equal(target, state)
    # and the stock converter reads it too
    dcp_to_torch_save(out_dir, tmp_path / "model.pt")
    assert_state_equal(torch.load(tmp_path / "model.pt", weights_only=False), state)


def test_export_dcp_writes_the_layout_filesystem_writer_writes(config, tmp_path, capsys):
    state = rich_state()
    url = save(config, state)
    assert run(capsys, "export", url, "--format", "dcp", str(tmp_path / "ours"))[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"), no_dist=True)
    ours = pickle.loads((tmp_path / "ours" / ".metadata").read_bytes())
    stock = pickle.loads((tmp_path / "stock" / ".metadata").read_bytes())
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert ours.planner_data == stock.planner_data
    assert ours.version == stock.version
    assert set(ours.storage_data) == set(stock.storage_data)
    assert {i.relative_path for i in ours.storage_data.values()} == {"__0_0.distcp"}
    sizes = [(tmp_path / d / "__0_0.distcp").stat().st_size for d in ("ours", "stock")]
    assert sizes[0] == sizes[1]


def test_export_dcp_of_a_sharded_tensor_loads_whole(config, tmp_path, capsys):
    state = sharded_state()
    url = save(config, state)
    items = json.loads(Path(url, layout.manifest_path(1)).read_bytes())["items"]
    assert {"w@0_0", "w@4_0", "w@8_0", "emb@6_0"} <= set(items)
    code, _, err = run(capsys, "export", url, "--format", "dcp", str(tmp_path / "out"))
    assert code == 0, err
    expected = plain(state)
    target = zeros_like_state(expected)
    dcp_load(target, tmp_path / "out")
    assert_state_equal(target, expected)


def test_export_picks_the_step(config, tmp_path, capsys):
    first, second = {"w": torch.zeros(5)}, {"w": torch.ones(5)}
    url = save(config, first, second)
    for step, expected in ((None, second), (1, first)):
        out_dir = tmp_path / f"step-{step}"
        argv = ["export", url, "--format", "dcp", str(out_dir)] + (["--step", str(step)] if step else [])
        assert run(capsys, *argv)[0] == 0
        target = {"w": torch.full((5,), 7.0)}
        dcp_load(target, out_dir)
        assert torch.equal(target["w"], expected["w"])
    code, _, err = run(capsys, "export", url, "--format", "dcp", "--step", "5", str(tmp_path / "x"))
    assert code == 2 and "no checkpoint for step 5" in err and "steps present: 1, 2" in err
    assert not (tmp_path / "x").exists()


def test_export_refuses_a_non_empty_directory_unless_overwrite(config, tmp_path, capsys):
    url = save(config, {"w": torch.arange(4)})
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "export", url, "--format", "dcp", str(out_dir))
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert run(capsys, "export", url, "--format", "dcp", "--overwrite", str(out_dir))[0] == 0
    assert (out_dir / "notes.txt").read_text() == "mine" and (out_dir / ".metadata").exists()


def test_a_corrupted_chunk_fails_the_export_and_leaves_nothing_behind(config, tmp_path, capsys):
    url = save(config, {"w": torch.randn(1000), "v": torch.randn(10)})
    manifest = json.loads(Path(url, layout.manifest_path(1)).read_bytes())
    pack, offset, _ = manifest["locations"][manifest["items"]["w"]["chunks"][0]]
    pack_file = Path(url, layout.pack_path(pack))
    data = bytearray(pack_file.read_bytes())
    data[offset] ^= 0xFF
    pack_file.write_bytes(bytes(data))
    for fmt in ("dcp", "safetensors"):
        out_dir = tmp_path / fmt
        code, out, err = run(capsys, "export", url, "--format", fmt, "--all", str(out_dir))
        assert code == 2 and out == ""
        assert "item 'w'" in err and "chunk 0" in err and f"offset {offset}" in err and "Traceback" not in err
        assert not out_dir.exists()


def _runs(manifest: dict[str, Any]) -> int:
    """Back-to-back runs of the chunks a manifest uses, over all its packs."""
    spans = sorted({tuple(loc) for loc in manifest["locations"].values()})
    runs, end = 0, None
    for pack, offset, length in spans:
        if end != (pack, offset):
            runs += 1
        end = (pack, offset + length)
    return runs


def test_export_reads_each_run_of_a_pack_at_once_not_each_item(config, tmp_path, capsys, monkeypatch):
    state = {f"layer{i}": torch.randn(256) for i in range(300)}  # 1 KiB each
    url = save(config, state)
    manifest = json.loads(Path(url, layout.manifest_path(1)).read_bytes())
    runs = _runs(manifest)
    assert runs <= len(manifest["packs"]) < 30  # the items lie back to back in few packs
    reads: list[str] = []
    original = FsspecTier.read_range_into

    def counting(self: FsspecTier, path: str, offset: int, out: memoryview) -> None:
        if path.endswith(".pack"):
            reads.append(path)
        original(self, path, offset, out)

    monkeypatch.setattr(FsspecTier, "read_range_into", counting)
    for fmt in ("dcp", "safetensors"):
        reads.clear()
        code, out, err = run(capsys, "export", url, "--format", fmt, "--all", str(tmp_path / fmt))
        assert code == 0, err
        assert len(reads) == runs, fmt  # one read per run of chunks, verified and scattered
    exported = safetensors_torch.load_file(str(tmp_path / "safetensors" / "model.safetensors"))
    assert exported.keys() == state.keys()
    assert all(torch.equal(bits(exported[k]), bits(v)) for k, v in state.items())


# -- safetensors ---------------------------------------------------------------------------------


def safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, read back with the safetensors package."""
    loaded: dict[str, torch.Tensor] = safetensors_torch.load_file(str(path))
    return loaded


def assert_bit_exact(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Exactly ``expected``'s names, and each tensor's dtype, shape and every byte."""
    assert sorted(loaded) == sorted(expected)
    for name, t in loaded.items():
        assert t.dtype == expected[name].dtype and t.shape == expected[name].shape, name
        assert torch.equal(bits(t), bits(expected[name])), name


def test_export_safetensors_writes_the_model_only_named_as_its_state_dict(config, tmp_path, capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model.register_buffer("table", torch.randn(5, 3).bfloat16())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # the optimizer now has moments (exp_avg, exp_avg_sq) as large as the model
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    url = save(config, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3})
    out_dir = tmp_path / "st"
    code, out, err = run(capsys, "export", url, "--format", "safetensors", str(out_dir))
    assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == ["model.safetensors"]
    loaded = safetensors_file(out_dir / "model.safetensors")
    assert_bit_exact(loaded, expected)  # no optimizer moment, no 'model.' prefix
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    fresh.register_buffer("table", torch.zeros(5, 3, dtype=torch.bfloat16))
    fresh.load_state_dict(loaded, strict=True)  # the names are the model's own
    assert "the model, the tensors under 'model', named without 'model.'" in out
    assert err == (
        "note: exported the model only (the tensors under 'model', named without 'model.'); "
        "left out optim, epoch (--all exports every tensor, names as stored)\n"
    )


def test_export_safetensors_of_the_model_names_what_it_skips_in_it(config, tmp_path, capsys):
    state = rich_state()
    url = save(config, state)
    code, out, err = run(capsys, "export", url, "--format", "safetensors", str(tmp_path / "st"))
    assert code == 0, err
    tensors = state["model"]
    unsupported = {k for k, t in tensors.items() if not supported_dtype(t.dtype)}
    assert_bit_exact(
        safetensors_file(tmp_path / "st" / "model.safetensors"),
        {k: t for k, t in tensors.items() if k not in unsupported},
    )
    assert "objects that are not tensors" not in err  # optim.lr, epoch, ...: not the model's
    for name in unsupported:
        assert f"model.{name}" in err
    assert "left out optim, nested, epoch, name" in err


def test_export_safetensors_all_holds_every_tensor_as_stored_and_names_what_it_skips(
    config, tmp_path, capsys
):
    state = rich_state()
    url = save(config, state)
    code, out, err = run(capsys, "export", url, "--format", "safetensors", "--all", str(tmp_path / "st"))
    assert code == 0, err
    assert "every tensor, names as stored" in out
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["model.safetensors"]
    tensors = flat_tensors(state)
    unsupported = {k for k, t in tensors.items() if not supported_dtype(t.dtype)}
    loaded = safetensors_file(tmp_path / "st" / "model.safetensors")
    assert {"optim.state.0.exp_avg", "optim.state.0.step", "nested.deeper.t", "model.f32"} <= set(loaded)
    assert_bit_exact(loaded, {k: t for k, t in tensors.items() if k not in unsupported})
    assert "skipped 4 objects that are not tensors: optim.lr, nested.deeper.list_obj, epoch, name" in err
    for name in unsupported:
        assert name in err
    assert "note:" not in err


def test_export_safetensors_without_a_model_key_lists_the_top_level_keys(config, tmp_path, capsys):
    g = torch.Generator().manual_seed(3)
    net = {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}
    url = save(config, {"net": net, "opt": {"m": torch.zeros(4)}, "step": 9})
    code, out, err = run(capsys, "export", url, "--format", "safetensors", str(tmp_path / "st"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err == (
        "shoal export: error: step 1 has no 'model' state dict to export as the model; its top-level "
        "keys: net, opt, step; choose what to export with --strip-prefix KEY. (the tensors under KEY, "
        "named without it) or --all (every tensor, names as stored)\n"
    )
    assert not (tmp_path / "st").exists()
    code, out, err = run(
        capsys, "export", url, "--format", "safetensors", "--strip-prefix", "net.", str(tmp_path / "st")
    )
    assert code == 0, err
    assert "the tensors under 'net.', named without it" in out
    assert_bit_exact(safetensors_file(tmp_path / "st" / "model.safetensors"), net)


def test_export_safetensors_of_a_model_that_is_one_tensor_says_so(config, tmp_path, capsys):
    url = save(config, {"model": torch.ones(3), "step": 1})
    code, _, err = run(capsys, "export", url, "--format", "safetensors", str(tmp_path / "st"))
    assert (
        code == 2 and "('model' is a single item, not a state dict); its top-level keys: model, step" in err
    )
    code, _, err = run(capsys, "export", url, "--format", "safetensors", "--all", str(tmp_path / "st"))
    assert code == 0, err
    assert_bit_exact(safetensors_file(tmp_path / "st" / "model.safetensors"), {"model": torch.ones(3)})


def test_export_safetensors_all_and_strip_prefix_are_one_choice(config, tmp_path, capsys):
    code, _, err = run(
        capsys, "export", "/x/job", "--format", "safetensors", "--all", "--strip-prefix", "m.", str(tmp_path)
    )
    assert code == 2 and "not allowed with argument" in err


def test_export_safetensors_strip_prefix_that_matches_nothing_lists_the_top_level_keys(
    config, tmp_path, capsys
):
    url = save(config, rich_state())
    code, _, err = run(
        capsys, "export", url, "--format", "safetensors", "--strip-prefix", "ema.", str(tmp_path / "st")
    )
    assert code == 2 and "step 1 has no tensors to export under 'ema.'" in err
    assert "its top-level keys: model, optim, nested, epoch, name" in err and "--all" in err
    assert not (tmp_path / "st").exists()


def test_export_safetensors_assembles_shards_and_splits_files_by_size(config, tmp_path, capsys):
    state = sharded_state()
    url = save(config, {"model": state})
    out_dir = tmp_path / "st"
    code, _, err = run(
        capsys, "export", url, "--format", "safetensors", "--max-shard-size", "100B", str(out_dir)
    )
    assert code == 0, err
    assert "skipped 1 objects that are not tensors: model.step" in err
    index = json.loads((out_dir / "model.safetensors.index.json").read_bytes())
    expected = {k: v for k, v in plain(state).items() if isinstance(v, torch.Tensor)}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    assert set(index["weight_map"]) == set(expected) == {"w", "emb", "b"}
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]  # 240 B, 54 B, 48 B
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded |= safetensors_file(out_dir / name)
    assert_bit_exact(loaded, expected)


def test_export_safetensors_strip_prefix_selects_and_renames(config, tmp_path, capsys):
    state = rich_state()
    url = save(config, state)
    out_dir = tmp_path / "st"
    code, _, err = run(
        capsys, "export", url, "--format", "safetensors", "--strip-prefix", "optim.state.", str(out_dir)
    )
    assert code == 0, err
    assert_bit_exact(safetensors_file(out_dir / "model.safetensors"), flat_tensors(state["optim"]["state"]))
    assert "note:" not in err
    # an empty prefix, as before: every tensor, names as stored (what --all does)
    code, _, err = run(
        capsys, "export", url, "--format", "safetensors", "--strip-prefix", "", str(tmp_path / "everything")
    )
    assert code == 0, err
    assert run(capsys, "export", url, "--format", "safetensors", "--all", str(tmp_path / "all"))[0] == 0
    every = safetensors_file(tmp_path / "everything" / "model.safetensors")
    assert_bit_exact(every, safetensors_file(tmp_path / "all" / "model.safetensors"))
    assert "optim.state.0.exp_avg" in every and "model.f32" in every


def test_export_safetensors_strict_refuses_what_it_cannot_hold(config, tmp_path, capsys):
    url = save(config, {"model": {"w": torch.ones(3), "epoch": 3}})
    code, _, err = run(capsys, "export", url, "--format", "safetensors", "--strict", str(tmp_path / "st"))
    assert code == 2 and "objects that are not tensors: model.epoch" in err
    assert not (tmp_path / "st").exists()


def test_export_safetensors_without_the_package_says_how_to_get_it(config, tmp_path, capsys, monkeypatch):
    url = save(config, {"w": torch.ones(3)})
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    code, _, err = run(capsys, "export", url, "--format", "safetensors", str(tmp_path / "st"))
    assert code == 2 and "pip install safetensors" in err


# -- object storage ------------------------------------------------------------------------------


def test_ls_verify_and_export_over_s3_with_storage_options(s3_url, s3_options, dram_root, tmp_path, capsys):
    config = make_config(tmp_path, dram_root, shared=s3_url, storage_options=s3_options)
    state = {"w": torch.randn(50_000), "b": torch.arange(10), "epoch": 2}
    url = save(config, state)
    options = json.dumps(s3_options)
    code, out, err = run(capsys, "ls", url, "--storage-options", options, "--json")
    assert code == 0, err
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [1]
    assert run(capsys, "verify", "--shared", s3_url, "--job", "test", "--storage-options", options)[0] == 0
    code, _, err = run(
        capsys, "export", url, "--storage-options", options, "--format", "dcp", str(tmp_path / "d")
    )
    assert code == 0, err
    target = zeros_like_state(state)
    dcp_load(target, tmp_path / "d")
    assert_state_equal(target, state)
