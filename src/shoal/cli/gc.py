"""``shoal gc``: retention by hand: keep the newest committed checkpoints, delete packs nothing uses.

The plan is :func:`shoal.records.retention.plan_retention`, the one the pipeline runs after
each commit, with the horizon at the newest step the job's writer committed (or ``LATEST``):
a pack written for a newer step may belong to a checkpoint still in flight in a running job
and is never touched. ``--dry-run`` prints the same plan and deletes nothing.

Like the pipeline, it judges the steps of the writer that holds the job now (its
``WRITER`` record) and leaves the steps other writers committed alone (``--all-writers``
judges every step). Damaged steps (an unreadable manifest, a commit record without its
manifest or not matching it) are removed when older than every kept step, and otherwise
kept, protecting the packs they could reference; each is reported with what was done.
Exit status: 0 when the pass ran (whatever it found), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from shoal.boundary import Boundary
from shoal.cli.common import (
    DEFAULT_JOB,
    CliError,
    byte_progress,
    human_bytes,
    open_job,
    positive_int,
    stderr_console,
    stdout_console,
)
from shoal.config import default_dram_root
from shoal.errors import FormatError, MissingFile, OwnershipError
from shoal.format import layout
from shoal.records.fence import WriterClaim, read_writer
from shoal.records.retention import RetentionPlan, apply_retention, latest_step, pack_ids_on, plan_retention
from shoal.records.store import list_checkpoints
from shoal.tiers.base import Tier


@dataclass(frozen=True)
class GcPlan:
    """What ``shoal gc`` will do, and what it knows about each step for the report."""

    plan: RetentionPlan
    boundaries: dict[int, Boundary | None]
    latest: int | None
    holder: WriterClaim | None
    """The writer the job's ``WRITER`` record names (whose steps are judged), or None."""
    writers: dict[int, str | None]
    """Step -> the writer its manifest names (None: not recorded, or the manifest is damaged)."""
    warnings: tuple[str, ...] = ()


def plan_gc(tier: Tier, keep_last: int | None, *, all_writers: bool = False) -> GcPlan:
    """The retention plan for ``tier`` (a job directory on shared storage), with what the report needs."""
    warnings: list[str] = []
    holder: WriterClaim | None = None
    if not all_writers:
        try:
            holder = read_writer(tier)
        except FormatError as e:
            warnings.append(f"{e}; judging the steps of every writer")
    infos = list_checkpoints(tier)
    writer = holder.lineage if holder is not None else None
    committed = [i.step for i in infos if i.boundary == Boundary.RESTARTABLE]
    ours = [
        i.step
        for i in infos
        if i.step in committed
        and (writer is None or i.manifest is None or i.manifest.writer is None or i.manifest.writer in writer)
    ]
    latest = latest_step(tier)
    horizon = max([*ours, *([latest] if latest is not None else [])], default=-1)
    plan = plan_retention(
        committed=committed,
        manifests={i.step: i.manifest for i in infos},
        latest=latest,
        keep_last=keep_last,
        pack_ids=pack_ids_on(tier),
        horizon=horizon,
        writer=writer,
        problems={i.step: i.problem for i in infos if i.problem},
    )
    return GcPlan(
        plan,
        {i.step: i.boundary for i in infos},
        latest,
        holder,
        {i.step: i.manifest.writer if i.manifest is not None else None for i in infos},
        tuple(warnings),
    )


def _pack_size(tier: Tier, pack_id: str) -> int:
    try:
        return tier.info(layout.pack_path(pack_id)).size
    except MissingFile:
        return 0  # only its index was left behind


def run_staged(args: argparse.Namespace) -> int:
    """``shoal gc --staged``: list (and with ``--drop``, drop) what crashed processes left staged in DRAM."""
    # the DRAM tier imports numpy: only for --staged, so that the parser builds fast
    from shoal.records.hoststate import HostLock, drop_leftover, staged_leftovers
    from shoal.tiers.roles import Role, open_host_role

    root = args.dram or default_dram_root()
    job = args.job or DEFAULT_JOB
    out, err = stdout_console(), stderr_console()
    found = staged_leftovers(root, job)
    listed = dropped = 0
    freed = 0
    for entry in found:
        record = entry.run.record
        where = (
            f"run {record.run} (shared {record.shared})"
            if record
            else f"{entry.run.path} ({entry.run.problem})"
        )
        for left in entry.leftovers:
            if args.step is not None and left.step != args.step:
                continue
            listed += 1
            step = "no staged index" if left.step is None else f"step {left.step}"
            holder = entry.live.get(left.rank) if left.rank is not None else None
            size = human_bytes(left.slab_bytes)
            line = f"host {entry.host}, {where}: rank {left.rank}, {step}, slab {left.slot} ({size})"
            if holder is not None:
                out.print(f"{line}: in use by {holder}, kept")
                continue
            if not args.drop:
                out.print(line)
                continue
            if args.dry_run:
                out.print(f"would drop {line}")
                continue
            lock = HostLock(root, job, entry.host, left.rank if left.rank is not None else 0)
            try:
                lock.acquire()  # a process of this rank starting now waits for us, or is refused
            except OwnershipError as e:
                err.print(f"warning: kept {line}: {e}")
                continue
            try:
                drop_leftover(open_host_role(Role.STAGING, entry.run.path, base=root), left)
            finally:
                lock.release()
            dropped += 1
            freed += left.slab_bytes
            out.print(f"dropped {line}")
    if not listed:
        out.print(f"no staged checkpoints under {os.path.join(root, job)}")
    elif args.drop:
        verb = "would drop" if args.dry_run else f"dropped {dropped}, freed {human_bytes(freed)}"
        out.print(f"{listed} staged checkpoint slab(s) found; {verb}")
    else:
        out.print(
            f"{listed} staged checkpoint slab(s) found; they stay until a newer checkpoint of their run "
            "reaches B4 (--drop removes them; --step N only that step's)"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.staged:
        return run_staged(args)
    if args.drop or args.dram or args.step is not None:
        raise CliError("--drop, --dram and --step go with --staged")
    tier = open_job(args)
    try:
        gc = plan_gc(tier, args.keep_last, all_writers=args.all_writers)
        plan = gc.plan
        sizes = {pid: _pack_size(tier, pid) for pid in plan.delete_packs}
        if not args.dry_run:
            with byte_progress("deleting", sum(sizes.values())) as bar:
                task = bar.task_ids[0]
                apply_retention(tier, plan, progress=lambda n: bar.advance(task, n))
    finally:
        tier.close()
    out, err = stdout_console(), stderr_console()
    for warning in gc.warnings:
        err.print(f"warning: {warning}")
    verb = "would delete" if args.dry_run else "deleted"
    damaged = {d.step: d for d in plan.damaged}
    for step in plan.delete_steps:
        if step in damaged:
            out.print(f"{verb} damaged step {step} ({damaged[step].problem})")
        else:
            b = gc.boundaries.get(step)
            out.print(f"{verb} step {step} ({b.label if b is not None else 'no boundary'})")
    for d in plan.damaged:
        if not d.removed:
            out.print(
                f"kept damaged step {d.step} ({d.problem}): inside the kept window or possibly being "
                f"written; {'would protect' if args.dry_run else 'protected'} packs of steps <= {d.step}"
            )
    holder = gc.holder.describe() if gc.holder is not None else "the job's writer"
    for step in plan.foreign_steps:
        out.print(
            f"left step {step} alone: committed by writer {gc.writers.get(step)}, not by {holder} "
            "(--all-writers judges it too)"
        )
    for pid in plan.delete_packs:
        out.print(f"{verb} pack {tier.url}/{layout.pack_path(pid)} ({human_bytes(sizes[pid])})")
    kept = ", ".join(map(str, plan.keep_steps)) or "none"
    freed = human_bytes(sum(sizes.values()))
    extra = ""
    if plan.foreign_steps:
        extra += f"; left {len(plan.foreign_steps)} step(s) of other writers alone"
    if plan.damaged:
        extra += f"; {len(plan.damaged)} damaged step(s), {sum(d.removed for d in plan.damaged)} removed"
    out.print(
        f"{'dry run: would free' if args.dry_run else 'freed'} {freed} in {len(plan.delete_packs)} pack(s) "
        f"and {len(plan.delete_steps)} step(s); kept steps {kept}"
        + (f" (LATEST {gc.latest})" if gc.latest is not None else "")
        + extra
    )
    return 0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gc",
        parents=parents,
        help="delete old checkpoints and packs no kept checkpoint uses",
        description="Keep the --keep-last newest committed checkpoints (and the one LATEST names; all of "
        "them without --keep-last), delete the rest, and delete every pack no remaining manifest "
        "references. Packs of steps newer than the newest commit (possibly in flight) are left alone. "
        "Steps committed by a writer other than the one holding the job (its WRITER record) are left "
        "alone unless --all-writers is given. A damaged step (unreadable manifest, commit record "
        "without its manifest) is removed when older than every kept step; otherwise it is kept and "
        "the packs written up to its step are kept with it. Exit status 0 when the pass ran, 2 when "
        "it could not.",
    )
    p.add_argument("url", nargs="?", help="the job directory (<shared>/<job>), a path or fsspec URL")
    p.add_argument("--keep-last", type=positive_int, metavar="N", help="committed checkpoints to keep")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.add_argument(
        "--all-writers",
        action="store_true",
        help="judge the steps of every writer, not only those of the writer holding the job "
        "(for steps left by an earlier process of the same job)",
    )
    staged = p.add_argument_group("staged checkpoints crashed processes left in DRAM")
    staged.add_argument(
        "--staged",
        action="store_true",
        help="list the staged checkpoints (DRAM slabs) of the job that no live process holds; "
        "they are kept until a newer checkpoint of their run reaches B4",
    )
    staged.add_argument(
        "--dram", metavar="ROOT", help="the DRAM root, as Config.dram (default /dev/shm/shoal-<uid>)"
    )
    staged.add_argument("--step", type=int, metavar="N", help="with --staged: only step N's")
    staged.add_argument(
        "--drop", action="store_true", help="with --staged: delete them (never a live process's)"
    )
    p.set_defaults(run=run)
