"""SavePlanner reuses DCP's plans while the layout is unchanged, and plans again when it changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shoal
from shoal.dcp import SavePlanner, _layout_signature
from shoal.testing.checkpoints import assert_state_equal, make_config, zeros_like_state


def _save_load(ckpt: shoal.Checkpointer, step: int, state: dict[str, Any]) -> None:
    ckpt.save(step, state).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    out = zeros_like_state(state)
    assert ckpt.load(out, step) == step
    assert_state_equal(out, state)


def test_an_unchanged_layout_reuses_the_plans_and_a_changed_one_plans_again(
    tmp_path: Path, dram_root: Path
) -> None:
    cache = SavePlanner.plan_cache
    state: dict[str, Any] = {"a": torch.randn(4, 3), "b": torch.arange(5), "meta": {"epoch": 1}}
    with shoal.Checkpointer(make_config(tmp_path, dram_root, keep_last=None)) as ckpt:
        _save_load(ckpt, 1, state)
        hits = cache.hits
        state["a"] += 1  # new values, same layout
        state["meta"] = {"epoch": 2}
        _save_load(ckpt, 2, state)
        assert cache.hits == hits + 2  # the local plan and the global plan
        changes = [
            lambda s: s.update(a=torch.randn(5, 3)),  # a shape
            lambda s: s.update(b=torch.arange(5, dtype=torch.int32)),  # a dtype
            lambda s: s.update(c=torch.ones(2)),  # a new key
            lambda s: s.pop("c"),  # a key gone
            lambda s: s.update(a=torch.randn(5, 3, requires_grad=True)),  # a flag DCP records
        ]
        for step, change in enumerate(changes, start=3):
            change(state)
            hits = cache.hits
            _save_load(ckpt, step, state)
            assert cache.hits == hits, f"step {step} reused a plan of another layout"
        manifest = ckpt.runtime.resolve_manifest(7)
        assert manifest.dcp is not None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"x": torch.ones(2)}, {"x": torch.ones(3)}),
        ({"x": torch.ones(2)}, {"x": torch.ones(2, dtype=torch.float64)}),
        ({"x": torch.ones(2)}, {"y": torch.ones(2)}),
        ({"x": torch.ones(2)}, {"x": 1.0}),
        ({"x": torch.ones(2)}, {"x": torch.ones(2).requires_grad_()}),
    ],
)
def test_the_signature_tells_layouts_apart(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert _layout_signature(a) != _layout_signature(b)
    assert _layout_signature(a) == _layout_signature({k: v.clone() for k, v in a.items()})


def test_tensor_subclasses_are_never_cached() -> None:
    class Sub(torch.Tensor):
        pass

    assert _layout_signature({"x": torch.ones(2).as_subclass(Sub)}) is None


def test_item_keys_are_computed_again_for_another_list_of_items() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from shoal.dcp import SavePlanner

    _item_keys = SavePlanner.plan_cache.item_keys
    items = [
        WriteItem(MetadataIndex("a.b"), WriteItemType.BYTE_IO),
        WriteItem(MetadataIndex("c"), WriteItemType.BYTE_IO),
    ]
    keys = _item_keys(items)
    assert _item_keys(items) is keys
    others = [WriteItem(MetadataIndex("d"), WriteItemType.BYTE_IO)]
    assert _item_keys(others) != keys and len(_item_keys(others)) == 1
    assert _item_keys(list(items)) == keys  # an equal list: computed again, the same keys
