"""The private names of torch that shoal uses (shoal._torch_private): each one is here on this
torch, and one that a torch upgrade takes away fails by name, never as a slow path elsewhere."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from shoal import _torch_private as private
from shoal.dcp import SavePlanner
from shoal.errors import ShoalError


def test_every_private_name_shoal_uses_is_as_expected_on_this_torch() -> None:
    assert private.problems() == []


def test_the_private_copy_helpers_do_what_the_stager_needs() -> None:
    a, b = torch.arange(3.0), torch.ones(2, 2)
    flat = torch.zeros(7)
    views = private.unflatten_dense_tensors()(flat, [a, b])
    private.foreach_copy()(list(views), [a, b])
    assert torch.equal(flat, torch.cat([a, b.flatten()]))
    flat[0] = 9.0  # views, not copies
    assert views[0][0].item() == 9.0


def test_shoal_overrides_the_hook_dcp_calls_for_replicated_items() -> None:
    assert private.DEDUP_HOOK in SavePlanner.__dict__
    assert getattr(DefaultSavePlanner, private.DEDUP_HOOK) is not SavePlanner.__dict__[private.DEDUP_HOOK]
    assert private.plan_caching(DefaultSavePlanner()) is False


def test_a_name_a_torch_upgrade_removed_is_reported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DefaultSavePlanner, private.DEDUP_HOOK)
    monkeypatch.delattr(torch, "_foreach_copy_")
    found = private.problems()
    assert any("_foreach_copy_" in p for p in found), found
    assert any(f"DefaultSavePlanner.{private.DEDUP_HOOK} is gone" in p for p in found), found
    with pytest.raises(
        ShoalError, match=rf"torch {re.escape(torch.__version__)} has no such name: .*_foreach_copy_"
    ):
        private.foreach_copy()


def test_a_planner_without_dcps_caching_switch_is_an_error_not_a_guess() -> None:
    with pytest.raises(ShoalError, match="DefaultSavePlanner._enable_plan_caching"):
        private.plan_caching(object())
