"""Retention: the pure plan (what to keep, what is garbage) and the crash-safe order of deletes."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.engine.retention import run_retention
from shoal.errors import MissingFile, TierError
from shoal.format import layout
from shoal.format.manifest import Manifest
from shoal.format.names import check_relpath
from shoal.records.retention import RetentionPlan, apply_retention, pack_ids_on, plan_retention, retain
from shoal.tiers.base import Data, FileInfo, Tier, TierCapabilities, iter_byte_views

from .retention_helpers import bare_manifest, pack_id


class DictTier(Tier):
    """An in-memory tier that records every delete, in order."""

    kind = "memory"
    capabilities = TierCapabilities(persistent=False, host_local=True, atomic_rename=False)

    def __init__(self, files: Mapping[str, bytes] | None = None) -> None:
        self.files: dict[str, bytes] = dict(files or {})
        self.deleted: list[str] = []

    @property
    def url(self) -> str:
        return "memory://test"

    def write(self, path: str, data: Data) -> int:
        payload = b"".join(bytes(v) for v in iter_byte_views(data))
        self.files[check_relpath(path)] = payload
        return len(payload)

    def read(self, path: str) -> bytes:
        if path not in self.files:
            raise MissingFile(f"{self.url}/{path}")
        return self.files[path]

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        data = self.read(path)[offset : offset + length]
        if len(data) != length:
            raise TierError(f"{self.url}/{path}: short read")
        return data

    def exists(self, path: str) -> bool:
        return path in self.files

    def info(self, path: str) -> FileInfo:
        return FileInfo(path, len(self.read(path)), 0.0)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(p for p in self.files if p.startswith(prefix))

    def delete(self, path: str) -> None:
        self.deleted.append(check_relpath(path))
        self.files.pop(path, None)


def _plan(**overrides: Any) -> RetentionPlan:
    args: dict[str, Any] = {
        "committed": [1, 2, 3, 4, 5],
        "manifests": {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 6)},
        "latest": 5,
        "keep_last": 2,
        "pack_ids": [pack_id(s) for s in range(1, 6)],
        "horizon": 5,
    }
    return plan_retention(**(args | overrides))


# --- plan_retention ------------------------------------------------------------------------------


def test_keeps_the_newest_committed_and_deletes_the_rest() -> None:
    plan = _plan()
    assert plan.keep_steps == (4, 5)
    assert plan.delete_steps == (1, 2, 3)
    assert plan.delete_packs == (pack_id(1), pack_id(2), pack_id(3))
    assert plan.reason == ""


def test_latest_is_kept_even_when_older_than_keep_last() -> None:
    plan = _plan(latest=2)
    assert plan.keep_steps == (2, 4, 5)
    assert plan.delete_steps == (1, 3)
    assert pack_id(2) not in plan.delete_packs


def test_keep_last_none_keeps_everything_committed() -> None:
    plan = _plan(keep_last=None)
    assert plan.keep_steps == (1, 2, 3, 4, 5) and plan.delete_steps == () and plan.delete_packs == ()


@pytest.mark.parametrize("keep_last", [5, 6, 7, 9, 50])
def test_keep_last_at_least_the_history_keeps_everything(keep_last: int) -> None:
    plan = _plan(keep_last=keep_last)
    assert plan.keep_steps == (1, 2, 3, 4, 5) and plan.delete_steps == () and plan.delete_packs == ()


@pytest.mark.parametrize("keep_last", range(1, 8))
def test_keep_last_keeps_exactly_the_newest_n(keep_last: int) -> None:
    assert _plan(keep_last=keep_last).keep_steps == tuple(range(1, 6))[-keep_last:]


def test_keep_last_zero_keeps_only_latest() -> None:
    plan = _plan(keep_last=0, latest=5)
    assert plan.keep_steps == (5,) and plan.delete_steps == (1, 2, 3, 4)
    assert _plan(keep_last=0, latest=None).delete_steps == (1, 2, 3, 4, 5)


def test_negative_keep_last_is_refused() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        _plan(keep_last=-1)


def test_a_pack_shared_with_a_kept_manifest_survives() -> None:
    # Step 5 dedups against the chunks in step 1's pack: that pack must stay.
    manifests = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 6)}
    manifests[5] = bare_manifest(5, [pack_id(5), pack_id(1)])
    plan = _plan(manifests=manifests)
    assert plan.delete_steps == (1, 2, 3)
    assert plan.delete_packs == (pack_id(2), pack_id(3))


def test_packs_newer_than_the_horizon_are_never_touched() -> None:
    # Step 7 is in flight: its pack exists but no manifest refers to it yet.
    plan = _plan(pack_ids=[pack_id(s) for s in range(1, 6)] + [pack_id(7), pack_id(6, 1)], horizon=5)
    assert pack_id(7) not in plan.delete_packs and pack_id(6, 1) not in plan.delete_packs
    plan = _plan(pack_ids=[pack_id(s) for s in range(1, 6)] + [pack_id(7)], horizon=7)
    assert pack_id(7) in plan.delete_packs


def test_steps_newer_than_the_horizon_are_never_deleted() -> None:
    manifests = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 9)}
    plan = _plan(committed=[1, 2, 3, 4, 5], manifests=manifests, horizon=5, keep_last=1)
    assert plan.delete_steps == (1, 2, 3, 4)
    assert not set(plan.delete_steps) & {6, 7, 8}


def test_packs_with_foreign_names_are_left_alone() -> None:
    plan = _plan(pack_ids=[pack_id(s) for s in range(1, 6)] + ["not-a-shoal-pack", "42-x"])
    assert "not-a-shoal-pack" not in plan.delete_packs and "42-x" not in plan.delete_packs


def test_unreadable_kept_manifest_means_no_pack_is_deleted() -> None:
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 6)}
    manifests[4] = None
    plan = _plan(manifests=manifests)
    assert plan.delete_steps == (1, 2, 3)
    assert plan.delete_packs == ()
    assert "4" in plan.reason and "unreadable" in plan.reason


def test_a_damaged_step_older_than_every_kept_step_is_removed_and_gc_goes_on() -> None:
    # Step 3 has no usable manifest (a commit record without it, or garbage): it used to stop all pack GC.
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 6)}
    manifests[3] = None
    plan = _plan(committed=[1, 2, 4, 5], manifests=manifests, problems={3: "manifest.json does not exist"})
    assert plan.keep_steps == (4, 5)
    assert plan.delete_steps == (1, 2, 3)
    assert plan.delete_packs == (pack_id(1), pack_id(2), pack_id(3))
    assert [(d.step, d.removed) for d in plan.damaged] == [(3, True)]
    assert "manifest.json does not exist" in plan.damaged[0].describe() and plan.reason == ""


def test_a_damaged_step_inside_the_window_protects_only_packs_up_to_its_step() -> None:
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 7)}
    manifests[5] = None  # between the kept steps 4 and 6
    orphans = [pack_id(2, 1), pack_id(5, 1), pack_id(6, 1)]  # packs of aborted saves
    plan = _plan(
        committed=[1, 2, 3, 4, 6],
        manifests=manifests,
        latest=6,
        pack_ids=[pack_id(s) for s in range(1, 7)] + orphans,
        horizon=6,
    )
    assert plan.keep_steps == (4, 6)
    assert plan.delete_steps == (1, 2, 3)  # the damaged step stays
    # Step 5 could reference any pack written for steps <= 5: those stay; the newer orphan goes.
    assert plan.delete_packs == (pack_id(6, 1),)
    assert [(d.step, d.removed) for d in plan.damaged] == [(5, False)]
    assert "step 5" in plan.reason and "steps <= 5" in plan.reason


@pytest.mark.parametrize("damaged_step", [7, 9])
def test_a_damaged_step_newer_than_the_newest_kept_is_kept_possibly_being_written(damaged_step: int) -> None:
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 6)}
    manifests[damaged_step] = None
    plan = _plan(manifests=manifests, pack_ids=[pack_id(s) for s in range(1, 6)] + [pack_id(6, 1)], horizon=8)
    assert damaged_step not in plan.delete_steps and plan.delete_steps == (1, 2, 3)
    assert [(d.step, d.removed) for d in plan.damaged] == [(damaged_step, False)]
    assert plan.delete_packs == ()  # every pack was written for a step <= the damaged one


def test_a_damaged_step_older_than_the_window_but_newer_than_the_horizon_stays() -> None:
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 6)}
    manifests[3] = None
    plan = _plan(committed=[1, 2, 4, 5], manifests=manifests, horizon=2)
    assert 3 not in plan.delete_steps and [(d.step, d.removed) for d in plan.damaged] == [(3, False)]


def test_steps_of_another_writer_are_left_alone_and_do_not_count_toward_keep_last() -> None:
    # Writer "b" holds the job; "a" committed 5 and 6 into it (the same Config.job used twice).
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)], "b") for s in range(1, 5)}
    manifests |= {s: bare_manifest(s, [pack_id(s)], "a") for s in (5, 6)}
    manifests[1] = bare_manifest(1, [pack_id(1)], None)  # older format: counts as b's
    plan = _plan(
        committed=range(1, 7),
        manifests=manifests,
        latest=4,
        pack_ids=[pack_id(s) for s in range(1, 7)] + [pack_id(6, 1)],
        horizon=6,
        writer="b",
    )
    assert plan.keep_steps == (3, 4)  # b's two newest; a's 5 and 6 do not push them out
    assert plan.foreign_steps == (5, 6)
    assert plan.delete_steps == (1, 2)
    assert plan.delete_packs == (pack_id(1), pack_id(2), pack_id(6, 1))
    # Without a writer every step is judged alike (the old behaviour, `shoal gc --all-writers`).
    plan = _plan(committed=range(1, 7), manifests=manifests, latest=6, pack_ids=[], horizon=6)
    assert plan.keep_steps == (5, 6) and plan.foreign_steps == ()


def test_an_uncommitted_step_of_another_writer_is_left_alone() -> None:
    # a's manifest without its commit record yet: it may be between manifest and COMMIT.
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)], "b") for s in range(1, 6)}
    manifests[3] = bare_manifest(3, [pack_id(3)], "a")
    plan = _plan(committed=[1, 2, 4, 5], manifests=manifests, writer="b")
    assert plan.delete_steps == (1, 2) and plan.foreign_steps == (3,)
    assert pack_id(3) not in plan.delete_packs


def test_unreadable_committed_step_can_be_deleted_and_gc_goes_on() -> None:
    manifests: dict[int, Manifest | None] = {s: bare_manifest(s, [pack_id(s)]) for s in range(1, 6)}
    manifests[1] = None
    plan = _plan(manifests=manifests)
    assert plan.delete_steps == (1, 2, 3)
    assert plan.delete_packs == (pack_id(1), pack_id(2), pack_id(3))


def test_abandoned_uncommitted_step_below_the_horizon_is_deleted() -> None:
    plan = _plan(committed=[1, 2, 4, 5], keep_last=3)
    assert plan.keep_steps == (2, 4, 5)
    assert plan.delete_steps == (1, 3)


@st.composite
def tier_states(draw: st.DrawFn) -> dict[str, Any]:
    steps = sorted(draw(st.sets(st.integers(0, 30), max_size=10)))
    packs = {s: [pack_id(s, n) for n in range(draw(st.integers(0, 2)))] for s in steps}
    all_packs = [p for ps in packs.values() for p in ps]
    extra = draw(st.lists(st.integers(0, 40), max_size=4))
    manifests: dict[int, Manifest | None] = {}
    for s in steps:
        if draw(st.integers(0, 9)) == 0:
            manifests[s] = None
        else:
            reused = draw(st.lists(st.sampled_from(all_packs), max_size=3)) if all_packs else []
            writer = draw(st.sampled_from([None, "w", "w", "x"]))
            manifests[s] = bare_manifest(s, sorted(set(packs[s] + reused)), writer)
    return {
        "committed": [s for s in steps if draw(st.booleans())],
        "manifests": manifests,
        "latest": draw(st.none() | st.sampled_from(steps)) if steps else None,
        "keep_last": draw(st.none() | st.integers(0, 4)),
        "pack_ids": all_packs + [pack_id(e, 99) for e in extra] + ["foreign"],
        "horizon": draw(st.integers(0, 40)),
        "writer": draw(st.sampled_from([None, "w"])),
    }


@settings(max_examples=500, deadline=None)
@given(tier_states())
def test_retention_plan_is_safe(state: dict[str, Any]) -> None:
    plan = plan_retention(**state)
    manifests: dict[int, Manifest | None] = state["manifests"]
    writer = state["writer"]
    foreign = {
        s
        for s, m in manifests.items()
        if m is not None and writer is not None and m.writer not in (None, writer)
    }
    committed = sorted(set(state["committed"]) - foreign)
    keep_last, latest, horizon = state["keep_last"], state["latest"], state["horizon"]
    newest = committed if keep_last is None else committed[len(committed) - keep_last :]
    deleted = set(plan.delete_steps)
    # The newest keep_last committed checkpoints of this writer and LATEST are kept, and never deleted.
    assert set(newest) <= set(plan.keep_steps)
    if latest is not None:
        assert latest in plan.keep_steps
    assert not deleted & set(plan.keep_steps)
    # Another writer's steps are never deleted.
    assert set(plan.foreign_steps) == foreign
    assert not deleted & foreign
    # Nothing newer than the horizon is touched.
    assert all(s <= horizon for s in deleted)
    for pid in plan.delete_packs:
        step = layout.pack_step(pid)
        assert step is not None and step <= horizon
    # Only steps that exist are deleted; damaged ones only when older than every kept step.
    assert deleted <= set(manifests)
    window = min(plan.keep_steps, default=None)
    damaged = {s for s, m in manifests.items() if m is None}
    assert {d.step for d in plan.damaged} == damaged
    for s in deleted & damaged:
        assert window is None or s < window
    # No pack a surviving step could reference is deleted.
    survivors = [s for s in manifests if s not in deleted]
    for s in survivors:
        m = manifests[s]
        if m is None:
            assert all((layout.pack_step(p) or 0) > s for p in plan.delete_packs)
        else:
            assert not set(m.packs) & set(plan.delete_packs)
    assert set(plan.delete_packs) <= set(state["pack_ids"])
    # And damage never stalls the collection: what no survivor can reference is deleted.
    for d in plan.damaged:
        assert d.removed == (d.step in deleted)
        if d.step <= horizon and (window is None or d.step < window):
            assert d.removed
    protected = max((s for s in survivors if manifests[s] is None), default=-1)
    referenced = {p for s in survivors if (m := manifests[s]) is not None for p in m.packs}
    for pid in set(state["pack_ids"]) - referenced:
        ps = layout.pack_step(pid)
        if ps is not None and protected < ps <= horizon:
            assert pid in plan.delete_packs


# --- apply_retention -----------------------------------------------------------------------------


def _tier_with(steps: list[int], pack_bytes: int = 10) -> DictTier:
    tier = DictTier()
    for s in steps:
        tier.files[layout.manifest_path(s)] = b"{}"
        tier.files[layout.commit_path(s)] = b"{}"
        tier.files[layout.pack_path(pack_id(s))] = b"x" * pack_bytes
        tier.files[layout.index_path(pack_id(s))] = b"{}"
    tier.files[layout.LATEST] = b"{}"
    return tier


def test_apply_deletes_commit_then_manifest_then_packs() -> None:
    tier = _tier_with([1, 2, 3], pack_bytes=7)
    plan = RetentionPlan(keep_steps=(3,), delete_steps=(1, 2), delete_packs=(pack_id(1), pack_id(2)))
    freed = apply_retention(tier, plan)
    assert freed == 14
    order = tier.deleted
    for s in (1, 2):
        assert order.index(layout.commit_path(s)) < order.index(layout.manifest_path(s))
    last_step_delete = max(i for i, p in enumerate(order) if p.startswith(layout.STEPS_DIR + "/"))
    first_pack_delete = min(i for i, p in enumerate(order) if p.startswith(layout.PACKS_DIR + "/"))
    assert last_step_delete < first_pack_delete
    assert sorted(tier.files) == sorted(
        [
            layout.LATEST,
            layout.manifest_path(3),
            layout.commit_path(3),
            layout.pack_path(pack_id(3)),
            layout.index_path(pack_id(3)),
        ]
    )


def test_retain_yields_between_stages_and_leaves_what_the_next_pass_finishes() -> None:
    """Asked to stop after the commit records went: the steps are uncommitted (never committed
    without a manifest), their packs still there and reported as not deleted; the next pass ends it."""
    tier = _tier_with([1, 2, 3], pack_bytes=5)
    plan = RetentionPlan(keep_steps=(3,), delete_steps=(1, 2), delete_packs=(pack_id(1), pack_id(2)))
    answers = iter([False, True])
    assert retain(tier, plan, stop=lambda: next(answers)) == (0, ())
    for s in (1, 2):
        assert layout.commit_path(s) not in tier.files
        assert layout.manifest_path(s) in tier.files and layout.pack_path(pack_id(s)) in tier.files
    assert retain(tier, plan) == (10, (pack_id(1), pack_id(2)))
    assert sorted(p for p in tier.files if p.startswith(layout.PACKS_DIR)) == sorted(
        [layout.pack_path(pack_id(3)), layout.index_path(pack_id(3))]
    )


def test_retain_told_to_stop_at_once_deletes_nothing() -> None:
    tier = _tier_with([1, 2])
    before = dict(tier.files)
    plan = RetentionPlan(keep_steps=(2,), delete_steps=(1,), delete_packs=(pack_id(1),))
    assert retain(tier, plan, stop=lambda: True) == (0, ())
    assert tier.files == before
    assert run_retention(tier, 1, 2, stop=lambda: True) == (0, ())
    assert tier.files == before


def test_apply_tolerates_files_already_gone() -> None:
    tier = _tier_with([1])
    del tier.files[layout.pack_path(pack_id(1))]
    del tier.files[layout.commit_path(1)]
    plan = RetentionPlan(keep_steps=(), delete_steps=(1, 9), delete_packs=(pack_id(1), pack_id(8)))
    assert apply_retention(tier, plan) == 0
    assert tier.files == {layout.LATEST: b"{}"}


def test_apply_an_empty_plan_deletes_nothing() -> None:
    tier = _tier_with([1, 2])
    before = dict(tier.files)
    assert apply_retention(tier, RetentionPlan((1, 2), (), ())) == 0
    assert tier.files == before and tier.deleted == []


def test_apply_logs_why_packs_were_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    tier = _tier_with([1])
    with caplog.at_level(logging.WARNING, logger="shoal.records.retention"):
        apply_retention(tier, RetentionPlan((1,), (), (), reason="unreadable manifests for steps [1]"))
    assert "unreadable manifests" in caplog.text and tier.url in caplog.text


def test_pack_ids_on_lists_packs_and_orphan_indexes() -> None:
    tier = _tier_with([1, 2])
    del tier.files[layout.pack_path(pack_id(2))]
    tier.files[layout.index_path(pack_id(3))] = b"{}"
    tier.files["packs/README"] = b""
    assert pack_ids_on(tier) == [pack_id(1), pack_id(2), pack_id(3)]


def test_plan_then_apply_end_to_end() -> None:
    tier = _tier_with([1, 2, 3, 4])
    manifests = {s: bare_manifest(s, [pack_id(s)] + ([pack_id(1)] if s == 4 else [])) for s in range(1, 5)}
    plan = plan_retention(
        committed=[1, 2, 3, 4],
        manifests=manifests,
        latest=4,
        keep_last=1,
        pack_ids=pack_ids_on(tier),
        horizon=4,
    )
    apply_retention(tier, plan)
    assert pack_ids_on(tier) == [pack_id(1), pack_id(4)]
    assert tier.list(layout.STEPS_DIR + "/") == [layout.commit_path(4), layout.manifest_path(4)]
