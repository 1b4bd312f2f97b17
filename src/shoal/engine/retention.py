"""Retention: which checkpoints to keep (``keep_last``) and reachability GC of packs on a tier.

The plan is a pure function of what the tier holds; ``apply_retention`` does the
deletes in a crash-safe order: a step's commit record, then its manifest, then
packs no remaining manifest references. A pack written for a step newer than
``horizon`` may belong to a checkpoint in flight and is never touched, and if
any manifest cannot be read no pack is deleted at all (its references are unknown).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shoal.format import layout
from shoal.format.manifest import Manifest
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPlan:
    keep_steps: tuple[int, ...]
    delete_steps: tuple[int, ...]
    delete_packs: tuple[str, ...]
    reason: str = ""


def plan_retention(
    *,
    committed: Iterable[int],
    manifests: Mapping[int, Manifest | None],
    latest: int | None,
    keep_last: int | None,
    pack_ids: Iterable[str],
    horizon: int,
) -> RetentionPlan:
    """Decide what to delete.

    Args:
        committed: steps with a commit record.
        manifests: every step on the tier -> its manifest, or None if unreadable.
        latest: the step ``LATEST`` names (always kept).
        keep_last: committed checkpoints to keep, newest steps first (None: all; 0: none but ``latest``).
        pack_ids: every pack id present on the tier.
        horizon: the newest step whose packs may be judged; newer ones may be in flight.
    """
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be None or >= 0, got {keep_last}")
    committed = sorted(set(committed))
    # Not committed[-keep_last:]: with keep_last == 0 that slice is the whole list.
    keep = set(committed if keep_last is None else committed[max(0, len(committed) - keep_last) :])
    if latest is not None:
        keep.add(latest)
    # An uncommitted step with an unreadable manifest may be torn mid-write by a live writer: left alone.
    delete = sorted(
        s
        for s, m in manifests.items()
        if s not in keep and s <= horizon and (s in committed or m is not None)
    )
    doomed_steps = set(delete)
    remaining = [s for s in manifests if s not in doomed_steps]
    if any(manifests[s] is None for s in remaining):
        bad = [s for s in remaining if manifests[s] is None]
        return RetentionPlan(
            tuple(sorted(keep)), tuple(delete), (), f"unreadable manifests for steps {bad}: packs left alone"
        )
    referenced: set[str] = set()
    for s in remaining:
        m = manifests[s]
        assert m is not None
        referenced.update(m.packs)
    doomed = []
    for pid in sorted(set(pack_ids)):
        ps = layout.pack_step(pid)
        if pid not in referenced and ps is not None and ps <= horizon:
            doomed.append(pid)
    return RetentionPlan(tuple(sorted(keep)), tuple(delete), tuple(doomed))


def pack_ids_on(tier: Tier) -> list[str]:
    """Ids of every pack (``.pack`` or ``.idx`` file) on ``tier``."""
    ids = set()
    for path in tier.list(layout.PACKS_DIR + "/"):
        name = path.rsplit("/", 1)[-1]
        for ext in (".pack", ".idx"):
            if name.endswith(ext):
                ids.add(name[: -len(ext)])
    return sorted(ids)


def apply_retention(tier: Tier, plan: RetentionPlan) -> int:
    """Delete what ``plan`` says; return bytes of packs freed."""
    for step in plan.delete_steps:
        tier.delete(layout.commit_path(step))
        for path in tier.list(layout.step_dir(step) + "/"):
            tier.delete(path)
    freed = 0
    for pid in plan.delete_packs:
        with contextlib.suppress(FileNotFoundError):
            freed += tier.info(layout.pack_path(pid)).size
        tier.delete(layout.pack_path(pid))
        tier.delete(layout.index_path(pid))
    if plan.delete_steps or plan.delete_packs:
        log.info(
            "retention on %s: deleted steps %s and %d packs (%d bytes)",
            tier.url,
            list(plan.delete_steps),
            len(plan.delete_packs),
            freed,
        )
    if plan.reason:
        log.warning("retention on %s: %s", tier.url, plan.reason)
    return freed
