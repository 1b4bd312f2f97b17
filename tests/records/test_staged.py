"""The staged index: written once at B1 (columns), DCP metadata and digests as sidecars bound to it."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shoal
from shoal.engine.inventory import read_staged
from shoal.records.hoststate import drop_leftover, find_leftovers
from shoal.records.staged import (
    STAGED_FORMAT,
    StagedIndex,
    chunks_path,
    dcp_path,
    staged_path,
)
from shoal.records.stager import StagedItem
from shoal.testing.checkpoints import make_config
from shoal.tiers.dram import DramTier


def _staged_files(dram_root: Path) -> dict[str, str]:
    """File name -> path of every file in the staged directories under ``dram_root``."""
    found = glob.glob(os.path.join(str(dram_root), "**", "staged", "*"), recursive=True)
    return {os.path.basename(p): p for p in found}


def _run_tier(dram_root: Path) -> DramTier:
    (staged_dir,) = {os.path.dirname(p) for p in _staged_files(dram_root).values()}
    return DramTier(os.path.dirname(staged_dir), base=str(dram_root))


def test_a_save_writes_the_index_once_and_each_sidecar_once(
    tmp_path: Path, dram_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: dict[str, int] = {"index": 0, "dcp": 0, "chunks": 0}
    for name, attr in (("index", "encode"), ("dcp", "encode_dcp"), ("chunks", "encode_chunks")):
        original = getattr(StagedIndex, attr)

        def counted(self: StagedIndex, _o: Any = original, _n: str = name) -> bytes:
            calls[_n] += 1
            data: bytes = _o(self)
            return data

        monkeypatch.setattr(StagedIndex, attr, counted)
    state = {"w": torch.randn(300), "b": torch.arange(7), "step": 3}
    with shoal.Checkpointer(make_config(tmp_path, dram_root, keep_last=None)) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        assert calls == {"index": 1, "dcp": 1, "chunks": 1}
        (rec,) = read_staged(_run_tier(dram_root), run_id=ckpt.runtime.run_id)
    assert rec.step == 1 and rec.dcp is not None
    assert all(i.chunks for i in rec.items)
    manifest = None
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        manifest = ckpt.runtime.resolve_manifest(1)
    assert {i.key: i.chunks for i in rec.items} == {k: r.chunks for k, r in manifest.items.items()}


def _index(step: int, created: float) -> StagedIndex:
    items = [StagedItem("a", "tensor", 8, 0, 0, "float32", (2,)), StagedItem("b", "bytes", 3, 64, 0)]
    return StagedIndex("job", step, 0, 1, "r0-00000000-slot-0", 4, items, created=created, run="run1")


def _dram(dram_root: Path) -> DramTier:
    tier = DramTier(str(dram_root / "run"), base=str(dram_root))
    slab = tier.open_slab("r0-00000000-slot-0", 128, exclusive=True)
    slab.buffer[:67] = bytes(range(67))
    return tier


def test_sidecars_of_an_earlier_step_of_the_slot_are_not_taken(dram_root: Path) -> None:
    dram = _dram(dram_root)
    old = _index(1, 100.0)
    old.dcp = {"old": True}
    old.digests = {"a": ["0" * 64, "1" * 64], "b": ["2" * 64]}
    old.write(dram)
    # A crash between the new index and its sidecars: the old sidecars stay on disk.
    dram.write(staged_path(old.slab), _index(2, 200.0).encode())
    (rec,) = read_staged(dram)
    assert rec.step == 2 and rec.dcp is None
    # Not hashed yet: hashed from the slab now, not taken from step 1's sidecar.
    assert all(i.chunks is not None and "0" * 64 not in i.chunks for i in rec.items)


def test_the_first_write_removes_the_sidecars_an_earlier_step_left(dram_root: Path) -> None:
    dram = _dram(dram_root)
    old = _index(1, 100.0)
    old.dcp = {"old": True}
    old.digests = {"a": ["0" * 64, "1" * 64], "b": ["2" * 64]}
    old.write(dram)
    assert dram.exists(dcp_path(old.slab)) and dram.exists(chunks_path(old.slab))
    new = _index(2, 200.0)
    new.write(dram)
    assert not dram.exists(dcp_path(new.slab)) and not dram.exists(chunks_path(new.slab))
    new.dcp = {"new": True}
    new.digests = {"a": ["3" * 64, "4" * 64], "b": ["5" * 64]}
    new.write(dram)
    (rec,) = read_staged(dram)
    assert rec.dcp == {"new": True}
    assert [i.chunks for i in rec.items] == [("3" * 64, "4" * 64), ("5" * 64,)]
    doc = json.loads(dram.read(staged_path(new.slab)))
    assert doc["format"] == STAGED_FORMAT and "dcp" not in doc and "items" not in doc


def test_a_malformed_chunks_sidecar_leaves_the_items_to_be_hashed_from_the_slab(dram_root: Path) -> None:
    dram = _dram(dram_root)
    idx = _index(1, 100.0)
    idx.write(dram)
    bad = {"format": "shoal-staged-chunks/1", "step": 1, "slab": idx.slab, "created": 100.0}
    dram.write(chunks_path(idx.slab), json.dumps({**bad, "counts": [5, 5], "digests": "ab"}).encode())
    (rec,) = read_staged(dram)
    assert [len(i.chunks or ()) for i in rec.items] == [2, 1]  # 8 bytes in 4-byte chunks, then 3 bytes


def test_the_first_format_is_still_read(dram_root: Path) -> None:
    dram = _dram(dram_root)
    doc = {
        "format": "shoal-staged/1",
        "job": "job",
        "run": "run1",
        "step": 4,
        "rank": 0,
        "world_size": 1,
        "slab": "r0-00000000-slot-0",
        "chunk_size": 4,
        "created": 1.0,
        "items": [
            {"key": "a", "kind": "tensor", "offset": 0, "nbytes": 8, "dtype": "float32", "shape": [2],
             "chunks": ["6" * 64, "7" * 64]},
        ],
        "dcp": {"v1": 1},
    }  # fmt: skip
    dram.write(staged_path("r0-00000000-slot-0"), json.dumps(doc).encode())
    (rec,) = read_staged(dram)
    assert rec.step == 4 and rec.dcp == {"v1": 1} and rec.items[0].chunks == ("6" * 64, "7" * 64)
    assert rec.items[0].shape == (2,)


def test_sidecars_without_an_index_are_leftovers_and_go_with_them(dram_root: Path) -> None:
    dram = _dram(dram_root)
    idx = _index(1, 100.0)
    idx.dcp = {"x": 1}
    idx.write(dram)
    dram.delete(staged_path(idx.slab))  # what close() does today: the index only
    dram.delete_slab(idx.slab)
    (left,) = find_leftovers(dram)
    assert left.slot == idx.slab and left.step is None and left.index is None
    drop_leftover(dram, left)
    assert dram.list("staged/") == []


def test_the_dcp_sidecar_is_the_same_json_whether_its_document_was_seen_before_or_not() -> None:
    doc = {"state_dict_metadata": {"w": [1, 2.5, None, "x"]}, "nested": {"a": {"b": []}}}
    first, second = _index(1, 10.0), _index(2, 20.0)
    first.dcp = second.dcp = doc
    for idx in (first, second, first):
        expected = {
            "format": "shoal-staged-dcp/1",
            "step": idx.step,
            "slab": idx.slab,
            "created": idx.created,
        }
        assert json.loads(idx.encode_dcp()) == {**expected, "dcp": doc}
    other = _index(3, 30.0)
    other.dcp = {"state_dict_metadata": {}}
    assert json.loads(other.encode_dcp())["dcp"] == {"state_dict_metadata": {}}
