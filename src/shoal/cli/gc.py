"""``shoal gc``: retention by hand: keep the newest committed checkpoints, delete packs nothing uses.

The plan is :func:`shoal.engine.retention.plan_retention`, the one the pipeline runs after
each commit, with the horizon at the newest committed step: a pack written for a newer
step may belong to a checkpoint still in flight in a running job and is never touched.
``--dry-run`` prints the same plan and deletes nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

from shoal.boundary import Boundary
from shoal.cli.common import human_bytes, open_job, stderr_console, stdout_console
from shoal.engine.retention import RetentionPlan, apply_retention, pack_ids_on, plan_retention
from shoal.engine.store import list_checkpoints, read_pointer
from shoal.errors import MissingFile
from shoal.format import layout
from shoal.tiers.base import Tier


def plan_gc(
    tier: Tier, keep_last: int | None
) -> tuple[RetentionPlan, dict[int, Boundary | None], int | None]:
    """The retention plan for ``tier``, each step's boundary, and the step ``LATEST`` names."""
    infos = list_checkpoints(tier)
    committed = [i.step for i in infos if i.boundary == Boundary.RESTARTABLE]
    pointer = read_pointer(tier, layout.LATEST)
    latest = pointer.step if pointer is not None else None
    horizon = max([*committed, *([latest] if latest is not None else [])], default=-1)
    plan = plan_retention(
        committed=committed,
        manifests={i.step: i.manifest for i in infos},
        latest=latest,
        keep_last=keep_last,
        pack_ids=pack_ids_on(tier),
        horizon=horizon,
    )
    return plan, {i.step: i.boundary for i in infos}, latest


def _pack_size(tier: Tier, pack_id: str) -> int:
    try:
        return tier.info(layout.pack_path(pack_id)).size
    except MissingFile:
        return 0  # only its index was left behind


def run(args: argparse.Namespace) -> int:
    tier = open_job(args)
    try:
        plan, boundaries, latest = plan_gc(tier, args.keep_last)
        sizes = {pid: _pack_size(tier, pid) for pid in plan.delete_packs}
        if not args.dry_run:
            apply_retention(tier, plan)
    finally:
        tier.close()
    out = stdout_console()
    verb = "would delete" if args.dry_run else "deleted"
    for step in plan.delete_steps:
        b = boundaries.get(step)
        out.print(f"{verb} step {step} ({b.label if b is not None else 'unreadable manifest'})")
    for pid in plan.delete_packs:
        out.print(f"{verb} pack {tier.url}/{layout.pack_path(pid)} ({human_bytes(sizes[pid])})")
    if plan.reason:
        stderr_console().print(f"warning: {plan.reason}")
    kept = ", ".join(map(str, plan.keep_steps)) or "none"
    freed = human_bytes(sum(sizes.values()))
    out.print(
        f"{'dry run: would free' if args.dry_run else 'freed'} {freed} in {len(plan.delete_packs)} pack(s) "
        f"and {len(plan.delete_steps)} step(s); kept steps {kept}"
        + (f" (LATEST {latest})" if latest is not None else "")
    )
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gc",
        parents=parents,
        help="delete old checkpoints and packs no kept checkpoint uses",
        description="Keep the --keep-last newest committed checkpoints (and the one LATEST names; all of "
        "them without --keep-last), delete the rest, and delete every pack no remaining manifest "
        "references. Packs of steps newer than the newest commit (possibly in flight) are left alone, "
        "and no pack is deleted while any manifest is unreadable.",
    )
    p.add_argument("url", nargs="?", help="the job directory (<shared>/<job>), a path or fsspec URL")
    p.add_argument("--keep-last", type=_at_least_one, metavar="N", help="committed checkpoints to keep")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.set_defaults(run=run)
