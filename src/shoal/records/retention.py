"""Retention: which checkpoints to keep (``keep_last``) and reachability GC of packs on a tier.

The plan is a pure function of what the tier holds; ``apply_retention`` does the
deletes in a crash-safe order: a step's commit record, then its manifest, then
packs no remaining manifest references. A pack written for a step newer than
``horizon`` may belong to a checkpoint in flight and is never touched.

Damage does not stop the collection (docs/design.md section 11). A *damaged* step is one
whose manifest cannot be used: unreadable or malformed, missing under a commit
record (two writers leave that), or not the one its commit record names.

* A damaged step older than every kept step (and not newer than ``horizon``) is
  removed like any other old step.
* A damaged step inside the retained window, or newer than ``horizon`` (possibly
  being written), is kept, and protects the packs it could reference: those written
  for its step or earlier (a pack id starts with its step). Other packs are judged as
  usual.

Steps another writer committed (a manifest whose ``writer`` is not the one
retention runs for) are left alone: they are never deleted, do not count toward
``keep_last``, and the packs they reference stay. Manifests without a writer (older
format) count as the writer's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shoal.errors import FormatError
from shoal.format import layout
from shoal.records.packlist import list_packs
from shoal.records.store import read_pointer
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)


class StepRefs(Protocol):
    """What retention reads of a step's manifest: a :class:`~shoal.format.manifest.Manifest`, or the
    :class:`~shoal.records.packlist.StepSummary` kept of it."""

    @property
    def writer(self) -> str | None: ...

    @property
    def packs(self) -> Collection[str]: ...


@dataclass(frozen=True)
class DamagedStep:
    """A step retention found damaged, and what it does with it."""

    step: int
    problem: str
    removed: bool
    """True: deleted (older than every kept step). False: kept, protecting packs of steps <= ``step``."""

    def describe(self) -> str:
        action = "removed" if self.removed else f"kept, protecting packs of steps <= {self.step}"
        return f"step {self.step} is damaged ({self.problem}): {action}"


@dataclass(frozen=True)
class RetentionPlan:
    keep_steps: tuple[int, ...]
    delete_steps: tuple[int, ...]
    delete_packs: tuple[str, ...]
    reason: str = ""
    """Why packs were left alone that might be garbage (damaged steps kept); empty if none."""
    damaged: tuple[DamagedStep, ...] = ()
    """Every damaged step, in step order, and whether it is deleted (then also in ``delete_steps``)."""
    foreign_steps: tuple[int, ...] = ()
    """Steps another writer committed: left alone, with the packs they reference."""


def plan_retention(
    *,
    committed: Iterable[int],
    manifests: Mapping[int, StepRefs | None],
    latest: int | None,
    keep_last: int | None,
    pack_ids: Iterable[str],
    horizon: int,
    writer: str | Collection[str] | None = None,
    problems: Mapping[int, str] | None = None,
    drop: Collection[int] = (),
) -> RetentionPlan:
    """Decide what to delete.

    Args:
        committed: steps with a commit record.
        manifests: every step on the tier -> its manifest (or its summary), or None if it cannot be
            used (damaged).
        latest: the step ``LATEST`` names (always kept).
        keep_last: committed checkpoints to keep, newest steps first (None: all; 0: none but ``latest``).
        pack_ids: every pack id present on the tier.
        horizon: the newest step whose packs may be judged; newer ones may be in flight.
        writer: the writer retention runs for (an id, or the ids of its lineage: itself and the
            writers it continues); steps whose manifest names another are left alone (None:
            every step counts as the writer's own).
        problems: step -> what is wrong with it, for damaged steps (for messages only).
        drop: steps the user removed (:meth:`shoal.Checkpointer.remove`): deleted even when among the
            ``keep_last`` newest, but never the one ``LATEST`` names, one newer than ``horizon``, or
            another writer's.
    """
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be None or >= 0, got {keep_last}")
    problems = problems or {}
    mine = None if writer is None else ({writer} if isinstance(writer, str) else set(writer))
    foreign = {
        s
        for s, m in manifests.items()
        if m is not None and mine is not None and m.writer is not None and m.writer not in mine
    }
    ours = sorted(set(committed) - foreign)
    # Not ours[-keep_last:]: with keep_last == 0 that slice is the whole list.
    keep = set(ours if keep_last is None else ours[max(0, len(ours) - keep_last) :]) - set(drop)
    if latest is not None:
        keep.add(latest)
    window = min(keep, default=None)
    damaged = tuple(
        DamagedStep(
            s, problems.get(s) or "unreadable manifest", s <= horizon and (window is None or s < window)
        )
        for s in sorted(s for s, m in manifests.items() if m is None)
    )  # a kept one (s in keep) is never removed: window <= s
    delete = sorted(
        {d.step for d in damaged if d.removed}
        | {s for s, m in manifests.items() if m is not None and s not in keep | foreign and s <= horizon}
    )
    doomed_steps = set(delete)
    referenced: set[str] = set()
    protected_through = -1
    for s, m in manifests.items():
        if s in doomed_steps:
            continue
        if m is None:
            protected_through = max(protected_through, s)  # it could reference any pack written by then
        else:
            referenced.update(m.packs)
    doomed = []
    for pid in sorted(set(pack_ids)):
        ps = layout.pack_step(pid)
        if pid not in referenced and ps is not None and protected_through < ps <= horizon:
            doomed.append(pid)
    reason = "; ".join(d.describe() for d in damaged if not d.removed)
    return RetentionPlan(
        tuple(sorted(keep)), tuple(delete), tuple(doomed), reason, damaged, tuple(sorted(foreign))
    )


def latest_step(tier: Tier) -> int | None:
    """The step ``LATEST`` names on ``tier``, or None if there is none or it is unreadable (logged)."""
    try:
        pointer = read_pointer(tier, layout.LATEST)
    except FormatError as e:
        log.warning("retention on %s: %s; going on without it", tier.url, e)
        return None
    return None if pointer is None else pointer.step


def pack_ids_on(tier: Tier) -> list[str]:
    """Ids of every pack (``.pack`` or ``.idx`` file) on ``tier`` (:func:`~.packlist.list_packs`)."""
    return sorted(list_packs(tier).ids)


@runtime_checkable
class RemovesEmptyDirs(Protocol):
    """A tier whose directories are real (a POSIX file system) and can drop the empty ones."""

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove the empty directories at and below ``prefix`` (a relative directory path)."""
        ...


_PACK_BATCH = 500
"""Packs per delete request batch when someone follows the progress (an object store's bulk delete
takes 1,000 keys: a pack and its index are two)."""


def _delete(
    tier: Tier,
    plan: RetentionPlan,
    stop: Callable[[], bool] | None,
    progress: Callable[[int], None] | None = None,
) -> int | None:
    """The deletes of :func:`retain`, stage by stage; the bytes freed, or None if ``stop`` said stop."""
    if stop is not None and stop():
        return None
    if plan.delete_steps:
        tier.delete_many([layout.commit_path(step) for step in plan.delete_steps])
        if stop is not None and stop():
            return None
        dirs = {layout.step_dir(step) + "/" for step in plan.delete_steps}
        listed = tier.list(layout.STEPS_DIR + "/") if len(dirs) > 1 else tier.list(next(iter(dirs)))
        tier.delete_many([p for p in listed if any(p.startswith(d) for d in dirs)])
        if isinstance(tier, RemovesEmptyDirs):
            for step in plan.delete_steps:
                tier.remove_empty_dirs(layout.step_dir(step))
    if not plan.delete_packs:
        return 0
    if stop is not None and stop():
        return None
    sizes = tier.list_sizes(layout.PACKS_DIR + "/")
    freed = sum(sizes.get(layout.pack_path(pid), 0) for pid in plan.delete_packs)
    batch = len(plan.delete_packs) if progress is None else _PACK_BATCH
    for at in range(0, len(plan.delete_packs), batch):
        pids = plan.delete_packs[at : at + batch]
        tier.delete_many([p for pid in pids for p in (layout.pack_path(pid), layout.index_path(pid))])
        if progress is not None:
            progress(sum(sizes.get(layout.pack_path(pid), 0) for pid in pids))
    return freed


def apply_retention(tier: Tier, plan: RetentionPlan, *, progress: Callable[[int], None] | None = None) -> int:
    """Delete what ``plan`` says; return bytes of packs freed (``shoal gc``; see :func:`retain`).

    ``progress`` is called with the bytes of each batch of packs deleted (for a progress bar).
    """
    return retain(tier, plan, progress=progress)[0]


def retain(
    tier: Tier,
    plan: RetentionPlan,
    *,
    stop: Callable[[], bool] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, tuple[str, ...]]:
    """Delete what ``plan`` says; return bytes of packs freed and the packs deleted.

    Called by the pipeline after each commit (coordinator on shared, host leaders on
    their tier) and by ``shoal gc``. Emptied step directories are removed where the tier
    has directories (:class:`RemovesEmptyDirs`).

    Three stages, each one batch (:meth:`~shoal.tiers.base.Tier.delete_many`: a few requests
    on an object store, however many files): the deleted steps' commit records, then the rest
    of their files, then the packs. A step is never left committed without its manifest. ``stop``
    is asked before each stage: when it says so the rest waits for the next pass (what is left
    is what a next plan finds again: steps not yet uncommitted, or packs no kept step references).
    With ``progress``, the packs go in batches of a few hundred and ``progress(bytes)`` is called
    after each.
    """
    done = _delete(tier, plan, stop, progress)
    if done is None:
        return 0, ()
    freed = done
    if plan.delete_steps or plan.delete_packs:
        log.info(
            "retention on %s: deleted steps %s and %d packs (%d bytes)",
            tier.url,
            list(plan.delete_steps),
            len(plan.delete_packs),
            freed,
        )
    if plan.damaged:
        log.warning("retention on %s: %s", tier.url, "; ".join(d.describe() for d in plan.damaged))
    elif plan.reason:
        log.warning("retention on %s: %s", tier.url, plan.reason)
    if plan.foreign_steps:
        log.info(
            "retention on %s: steps %s were committed by another writer: left alone, with their packs",
            tier.url,
            list(plan.foreign_steps),
        )
    return freed, plan.delete_packs


__all__ = [
    "DamagedStep",
    "RemovesEmptyDirs",
    "RetentionPlan",
    "StepRefs",
    "apply_retention",
    "retain",
    "latest_step",
    "pack_ids_on",
    "plan_retention",
]
