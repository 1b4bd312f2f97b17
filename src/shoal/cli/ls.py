"""``shoal ls``: one row per checkpoint step, with the boundary its files prove and its sizes."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table
from rich.text import Text

from shoal.cli.common import (
    checkpoint_problem,
    dedup_ratio,
    dedup_text,
    human_bytes,
    local_time,
    open_job,
    print_json,
    read_pointer_strictly,
    stderr_console,
    stdout_console,
)
from shoal.errors import ShoalError
from shoal.format import layout
from shoal.records.store import CheckpointInfo, list_checkpoints
from shoal.tiers.base import Tier


def checkpoint_row(info: CheckpointInfo, latest: int | None, problem: str | None = None) -> dict[str, Any]:
    """The JSON-ready record of one step (``None`` where the manifest could not be read)."""
    m = info.manifest
    when = local_time(m.created) if m is not None else None
    return {
        "step": info.step,
        "boundary": info.boundary.name if info.boundary is not None else None,
        "boundary_level": int(info.boundary) if info.boundary is not None else None,
        "latest": info.step == latest,
        "created": m.created if m is not None else None,
        # null too when ``created`` is out of this platform's range of times
        "created_iso": when.isoformat(timespec="seconds") if when is not None else None,
        "items": len(m.items) if m is not None else None,
        "logical_bytes": m.stats.logical_bytes if m is not None else None,
        "written_bytes": m.stats.written_bytes if m is not None else None,
        "unique_bytes": m.stats.unique_bytes if m is not None else None,
        # logical bytes per byte written; null when the step wrote no new bytes (all deduplicated)
        "dedup_ratio": dedup_ratio(m.stats.logical_bytes, m.stats.written_bytes) if m is not None else None,
        "packs": sorted(m.packs) if m is not None else None,
        "problem": problem if problem is not None else info.problem,
    }


def _warn_about_times(tier: Tier, infos: list[CheckpointInfo]) -> list[str]:
    return [
        f"warning: manifest {tier.url}/{layout.manifest_path(i.step)}: created is {i.manifest.created:g}, "
        "not a time this platform can show; listed without it"
        for i in infos
        if i.manifest is not None and local_time(i.manifest.created) is None
    ]


def run(args: argparse.Namespace) -> int:
    tier = open_job(args)
    err = stderr_console()
    try:
        infos = list_checkpoints(tier)
        problems = {i.step: checkpoint_problem(tier, i) for i in infos}
        try:
            pointer = read_pointer_strictly(tier, layout.LATEST)
        except ShoalError as e:  # still list the steps; verify reports it too
            err.print(f"warning: {e}")
            pointer = None
    finally:
        tier.close()
    latest = pointer.step if pointer is not None else None
    if latest is not None and latest not in {i.step for i in infos}:
        err.print(f"warning: {layout.LATEST} names step {latest}, which has no manifest under {tier.url}")
    for warning in _warn_about_times(tier, infos):
        err.print(warning)
    if args.json:
        rows = [checkpoint_row(i, latest, problems[i.step]) for i in infos]
        print_json({"url": tier.url, "latest": latest, "checkpoints": rows})
        return 0
    if not infos:
        err.print(f"no checkpoints under {tier.url}")
        return 0
    table = Table(title=f"checkpoints in {tier.url}", title_justify="left")
    for name in ("step", "boundary", "created", "items", "logical", "written", "unique", "dedup", "problem"):
        right = name in ("step", "items", "logical", "written", "unique", "dedup")
        table.add_column(
            name,
            justify="right" if right else "left",
            no_wrap=name != "problem",
            overflow="fold" if name == "problem" else "ellipsis",
        )
    for info in infos:
        m = info.manifest
        boundary = info.boundary.label if info.boundary is not None else "?"
        if info.step == latest:
            boundary += " LATEST"
        if m is None:
            cells = ["", "", "", "", "", ""]
        else:
            s = m.stats
            when = local_time(m.created)
            cells = [
                when.strftime("%Y-%m-%d %H:%M:%S") if when is not None else "?",
                str(len(m.items)),
                human_bytes(s.logical_bytes),
                human_bytes(s.written_bytes),
                human_bytes(s.unique_bytes),
                dedup_text(s.logical_bytes, s.written_bytes),
            ]
        problem = problems[info.step]
        style = "bold" if info.step == latest else ("red" if problem else "")
        row = [str(info.step), boundary, *cells, problem or ""]
        table.add_row(*(Text(c) for c in row), style=style)
    stdout_console().print(table)
    return 0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ls",
        parents=parents,
        help="list checkpoints: boundary reached, sizes, dedup",
        description="One row per step: the boundary its files prove (B3 PERSISTED: manifest on shared "
        "storage; B4 RESTARTABLE: committed), LATEST, creation time, items, bytes the state holds "
        "(logical), bytes this step wrote, unique bytes, dedup ratio (logical / written; 'all reused' "
        "when the step wrote no new bytes), and why a manifest could not be read.",
    )
    p.add_argument("url", nargs="?", help="the job directory (<shared>/<job>), a path or fsspec URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
