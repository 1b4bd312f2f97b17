"""Retention: the pure plan (what to keep, what is garbage) and the crash-safe order of deletes."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.cli.main import main as cli_main
from shoal.engine.fence import WriterRecord
from shoal.engine.pipeline import run_retention
from shoal.engine.retention import RetentionPlan, apply_retention, pack_ids_on, plan_retention, retain
from shoal.errors import MissingFile, TierError
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import Manifest, Pointer
from shoal.format.names import check_relpath
from shoal.tiers import open_tier
from shoal.tiers.base import Data, FileInfo, Tier, TierCapabilities, iter_byte_views
from shoal.tiers.shared import FsspecTier

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
    with caplog.at_level(logging.WARNING, logger="shoal.engine.retention"):
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


# --- damaged steps on a real shared tier: run_retention and `shoal gc` ------------------------------


def _shared(tmp_path: Path) -> Tier:
    return open_tier("shared", str(tmp_path / "shared" / "job"))


def _commit_step(tier: Tier, step: int, *, writer: str | None = None, reuse: tuple[str, ...] = ()) -> str:
    """A committed step on ``tier`` with one pack of its own (10 bytes) and the reused ones; its pack id."""
    pid = pack_id(step)
    tier.write(layout.pack_path(pid), b"x" * 10)
    tier.write(layout.index_path(pid), b"[]")
    data = bare_manifest(step, [pid, *reuse], writer).encode()
    tier.write(layout.manifest_path(step), data)
    pointer = Pointer(step, digest(data)).encode()
    tier.write(layout.commit_path(step), pointer)
    tier.write(layout.LATEST, pointer)
    return pid


def _step_dirs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "shared" / "job" / layout.STEPS_DIR).iterdir())


def _damage(tier: Tier, how: str, step: int) -> None:
    if how == "commit without manifest":
        tier.delete(layout.manifest_path(step))
    elif how == "garbage manifest":
        tier.write(layout.manifest_path(step), b'{"format": "shoal/1.0", "job": ')
    elif how == "digest mismatch":  # a second writer rewrote the manifest of the same step
        tier.write(layout.manifest_path(step), bare_manifest(step, [pack_id(step)], "other").encode())
    else:  # pragma: no cover
        raise AssertionError(how)


DAMAGE = ["commit without manifest", "garbage manifest", "digest mismatch"]


@pytest.mark.parametrize("how", DAMAGE)
def test_run_retention_removes_an_old_damaged_step_and_its_packs_and_directory(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _shared(tmp_path)
    for step in range(1, 6):
        _commit_step(tier, step)
    _damage(tier, how, 2)
    with caplog.at_level(logging.WARNING, logger="shoal.engine.retention"):
        freed, dropped = run_retention(tier, 2, 5)
    assert dropped == (pack_id(1), pack_id(2), pack_id(3)) and freed == 30
    assert _step_dirs(tmp_path) == [f"{4:012d}", f"{5:012d}"]  # emptied step directories are gone too
    assert pack_ids_on(tier) == [pack_id(4), pack_id(5)]
    assert "step 2 is damaged" in caplog.text and "removed" in caplog.text


@pytest.mark.parametrize("how", DAMAGE)
def test_run_retention_keeps_a_damaged_step_in_the_window_and_the_packs_up_to_it(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _shared(tmp_path)
    for step in range(1, 7):
        _commit_step(tier, step)
    tier.write(layout.pack_path(pack_id(6, 1)), b"y" * 7)  # an aborted save's pack, newer than the damage
    _damage(tier, how, 5)
    with caplog.at_level(logging.WARNING, logger="shoal.engine.retention"):
        freed, dropped = run_retention(tier, 2, 6)
    # Kept: 4 and 6 (the damaged 5 does not count); 1..3 go, but their packs may be 5's.
    assert dropped == (pack_id(6, 1),) and freed == 7
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (4, 5, 6)]
    assert pack_ids_on(tier) == [pack_id(s) for s in range(1, 7)]
    assert "step 5 is damaged" in caplog.text and "protecting packs of steps <= 5" in caplog.text


def test_run_retention_for_a_writer_leaves_the_other_writers_steps(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    for step in (1, 2):
        _commit_step(tier, step, writer="a" * 16)
    for step in (3, 4, 5):
        _commit_step(tier, step, writer="b" * 16, reuse=(pack_id(1),))
    _, dropped = run_retention(tier, 1, 5, writer="b" * 16)
    assert dropped == (pack_id(3), pack_id(4))
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (1, 2, 5)]


def _gc(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(["gc", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_gc_reports_each_damaged_step_and_what_it_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = _shared(tmp_path)
    for step in range(1, 7):
        _commit_step(tier, step)
    _damage(tier, "commit without manifest", 2)
    _damage(tier, "garbage manifest", 5)
    code, out, err = _gc(capsys, tier.url, "--keep-last", "2", "--dry-run")
    assert code == 0, err
    assert "would delete damaged step 2 (no checkpoint for step 2" in out
    assert "kept damaged step 5 (" in out and "would protect packs of steps <= 5" in out
    assert "2 damaged step(s), 1 removed" in out
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in range(1, 7)]  # a dry run
    code, out, err = _gc(capsys, tier.url, "--keep-last", "2")
    assert code == 0 and "Traceback" not in err
    assert "deleted damaged step 2" in out and "deleted step 1 (B4 RESTARTABLE)" in out
    assert "step 2 is damaged" in err  # the log line, on stderr
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (4, 5, 6)]
    assert pack_ids_on(tier) == [pack_id(s) for s in range(1, 7)]  # all written no later than step 5


def test_gc_judges_the_steps_of_the_writer_holding_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = _shared(tmp_path)
    a, b = "a" * 16, "b" * 16
    for step in (1, 2, 3):
        _commit_step(tier, step, writer=b)
    for step in (7, 8):  # another job with the same name, further along
        _commit_step(tier, step, writer=a)
    tier.write(layout.LATEST, tier.read(layout.commit_path(3)))
    tier.write(layout.WRITER, WriterRecord(b, "hb", 42, 1.0).encode())
    code, out, err = _gc(capsys, tier.url, "--keep-last", "1")
    assert code == 0, err
    assert f"left step 7 alone: committed by writer {a}" in out and f"writer {b} (host 'hb'" in out
    assert "kept steps 3 (LATEST 3); left 2 step(s) of other writers alone" in out
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (3, 7, 8)]
    code, out, err = _gc(capsys, tier.url, "--keep-last", "1", "--all-writers")
    assert code == 0, err
    assert _step_dirs(tmp_path) == [f"{3:012d}", f"{8:012d}"]  # the newest, and the one LATEST names


def test_gc_that_cannot_run_exits_2_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _shared(tmp_path)
    _commit_step(tier, 1)

    def failing_list(self: Tier, prefix: str = "") -> list[str]:
        raise TierError(f"could not list {prefix!r} in shared tier {self.url}: EIO")

    monkeypatch.setattr(FsspecTier, "list", failing_list)
    code, out, err = _gc(capsys, tier.url, "--keep-last", "1")
    assert code == 2 and "shoal gc: error: could not list" in err and "Traceback" not in err
    assert out == ""


def test_retention_on_a_host_tier_removes_emptied_step_directories(tmp_path: Path) -> None:
    tier = open_tier("local", str(tmp_path / "local" / "job" / "h0"))
    for step in range(1, 5):
        pid = pack_id(step)
        tier.write(layout.pack_path(pid), b"x" * 10)
        tier.write(layout.index_path(pid), b"[]")
        tier.write(layout.manifest_path(step), bare_manifest(step, [pid]).encode())  # no commit records here
    _, dropped = run_retention(tier, 2, 4, manifests_are_commits=True)
    assert dropped == (pack_id(1), pack_id(2))
    steps = tmp_path / "local" / "job" / "h0" / layout.STEPS_DIR
    assert sorted(p.name for p in steps.iterdir()) == [f"{3:012d}", f"{4:012d}"]
