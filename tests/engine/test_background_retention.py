"""Retention on the shared tier runs beside the next checkpoint, and never deletes what that one reuses.

The races are forced, not hoped for: the retention thread is held at a chosen point of its pass
(after its listing of the steps, or after it claimed the packs it will delete) while the next
checkpoint plans, reuses an old pack and commits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shoal
import shoal.engine.retention as retention_mod
from shoal.cli.verify import verify
from shoal.format import layout
from shoal.records.catalog import PackPins
from shoal.records.events import read_events
from shoal.records.store import list_checkpoints
from shoal.testing.checkpoints import assert_state_equal, make_config, zeros_like_state

# -- PackPins ---------------------------------------------------------------------------------


def test_a_pinned_pack_is_not_claimed_and_a_claimed_one_is_not_pinned() -> None:
    pins = PackPins()
    assert pins.pin(3, {"p1", "p2"}) == frozenset()
    since = pins.mark()
    assert pins.claim(("p1", "p3"), since) == ("p3",)
    assert pins.pin(4, {"p3", "p2"}) == frozenset({"p3"})  # being deleted: the plan must not reuse it
    assert pins.pinned() == {"p1", "p2"}
    pins.deleted(("p3",))
    assert pins.pin(5, {"p3"}) == frozenset()  # the claim is over (the presence check decides now)


def test_a_pack_released_after_the_pass_began_is_not_claimed_by_that_pass() -> None:
    pins = PackPins()
    pins.pin(3, {"p1"})
    since = pins.mark()  # the pass lists the steps: step 3 has not committed yet
    pins.release(3)  # step 3 commits, its manifest referring to p1
    assert pins.claim(("p1",), since) == ()  # the pass could not have seen that reference
    assert pins.claim(("p1",), pins.mark()) == ("p1",)  # the next pass lists step 3: its own plan decides


# -- the races, through a Checkpointer ---------------------------------------------------------


class _Gate:
    """Holds the retention thread at one call until :meth:`open`; other threads pass freely."""

    def __init__(self) -> None:
        self.armed = False
        self.reached = threading.Event()
        self._go = threading.Event()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            if self.armed and threading.current_thread().name.startswith("shoal-retention"):
                self.armed = False
                self.reached.set()
                assert self._go.wait(60), "the test never opened the gate"
            return fn(*args, **kwargs)

        return gated

    def open(self) -> None:
        self._go.set()


def _packs_of(ckpt: shoal.Checkpointer, step: int) -> set[str]:
    info = next(i for i in list_checkpoints(ckpt.shared) if i.step == step)
    assert info.manifest is not None
    return set(info.manifest.packs)


def _present(ckpt: shoal.Checkpointer, pid: str) -> bool:
    return ckpt.shared.exists(layout.pack_path(pid)) and ckpt.shared.exists(layout.index_path(pid))


@pytest.fixture
def states() -> Iterator[dict[int, dict[str, Any]]]:
    g = torch.Generator().manual_seed(7)
    a = {"w": torch.randn(100_000, generator=g)}
    b = {"w": torch.randn(100_000, generator=g)}
    yield {1: a, 2: b, 3: {"w": a["w"].clone()}}  # step 3 is step 1 again: all of it dedups


def _save(ckpt: shoal.Checkpointer, step: int, state: dict[str, Any]) -> None:
    assert ckpt.save(step, state).wait(shoal.Boundary.RESTARTABLE, timeout=60) == shoal.Boundary.RESTARTABLE


def _load_bit_exact(ckpt: shoal.Checkpointer, step: int, state: dict[str, Any]) -> None:
    out = zeros_like_state(state)
    assert ckpt.load(out, step=step) == step
    assert_state_equal(out, state)


def test_a_pack_reused_by_a_checkpoint_that_commits_during_the_pass_survives_it(
    tmp_path: Path, dram_root: Path, states: dict[int, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass lists the steps, step 3 reuses step 1's pack and commits, then the pass deletes step 1."""
    gate = _Gate()
    monkeypatch.setattr(retention_mod, "pack_ids_on", gate.wrap(retention_mod.pack_ids_on))
    config = make_config(tmp_path, dram_root, keep_last=1)
    with shoal.Checkpointer(config) as ckpt:
        _save(ckpt, 1, states[1])
        assert ckpt.wait(timeout=60)
        old = _packs_of(ckpt, 1)
        gate.armed = True
        _save(ckpt, 2, states[2])  # its pass lists steps 1 and 2, and waits
        assert gate.reached.wait(60)
        _save(ckpt, 3, states[3])  # reuses step 1's pack and commits while that pass waits
        assert _packs_of(ckpt, 3) == old, "step 3 should have reused step 1's pack"
        gate.open()
        assert ckpt.wait(timeout=60)
        assert not ckpt.shared.exists(layout.manifest_path(1))  # the pass did run: step 1 is gone
        assert all(_present(ckpt, pid) for pid in old)  # but not the pack step 3 refers to
        _load_bit_exact(ckpt, 3, states[3])
        assert verify(ckpt.shared, 3, progress=False).ok


@pytest.mark.parametrize("rescan", [False, True], ids=["same-catalog", "catalog-scanned-again"])
def test_a_pack_being_deleted_is_written_again_rather_than_reused(
    tmp_path: Path,
    dram_root: Path,
    states: dict[int, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    rescan: bool,
) -> None:
    """The pass claims step 1's pack, then step 3 (the same bytes) plans: it may not point at that pack.

    ``rescan``: the coordinator's catalog is built again from the tier before step 3 (as after a
    failed commit), so it names the claimed pack, which is still there.
    """
    gate = _Gate()
    monkeypatch.setattr(retention_mod, "retain", gate.wrap(retention_mod.retain))
    config = make_config(tmp_path, dram_root, keep_last=1, event_log=str(tmp_path / "events.jsonl"))
    with shoal.Checkpointer(config) as ckpt:
        _save(ckpt, 1, states[1])
        assert ckpt.wait(timeout=60)
        old = _packs_of(ckpt, 1)
        gate.armed = True
        _save(ckpt, 2, states[2])  # its pass claims step 1's pack, and waits before deleting
        assert gate.reached.wait(60)
        if rescan:
            ckpt.runtime._pipeline.context.shared_catalog = None
        _save(ckpt, 3, states[3])
        assert not _packs_of(ckpt, 3) & old, "step 3 points at a pack retention is deleting"
        gate.open()
        assert ckpt.wait(timeout=60)
        assert not any(_present(ckpt, pid) for pid in old)  # deleted, as claimed
        _load_bit_exact(ckpt, 3, states[3])
    planned = {e["step"]: e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "planned"}
    assert planned[3]["new_bytes"] == planned[3]["logical_bytes"]  # every byte written again
