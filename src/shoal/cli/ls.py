"""``shoal ls``: one row per checkpoint step, with the boundary its files prove and its sizes."""

from __future__ import annotations

import argparse
import datetime as dt
import math
from typing import Any

from rich.table import Table
from rich.text import Text

from shoal.cli.common import human_bytes, human_ratio, open_job, print_json, stderr_console, stdout_console
from shoal.engine.store import CheckpointInfo, list_checkpoints, read_pointer
from shoal.errors import ShoalError
from shoal.format import layout


def checkpoint_row(info: CheckpointInfo, latest: int | None) -> dict[str, Any]:
    """The JSON-ready record of one step (``None`` where the manifest could not be read)."""
    m = info.manifest
    ratio = m.stats.dedup_ratio if m is not None else None
    return {
        "step": info.step,
        "boundary": info.boundary.name if info.boundary is not None else None,
        "boundary_level": int(info.boundary) if info.boundary is not None else None,
        "latest": info.step == latest,
        "created": m.created if m is not None else None,
        "created_iso": _iso(m.created) if m is not None else None,
        "items": len(m.items) if m is not None else None,
        "logical_bytes": m.stats.logical_bytes if m is not None else None,
        "written_bytes": m.stats.written_bytes if m is not None else None,
        "unique_bytes": m.stats.unique_bytes if m is not None else None,
        # logical bytes per byte written; null when the step wrote no new bytes (all deduplicated)
        "dedup_ratio": None if ratio is None or math.isinf(ratio) else ratio,
        "packs": sorted(m.packs) if m is not None else None,
        "problem": info.problem,
    }


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def _created(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def run(args: argparse.Namespace) -> int:
    tier = open_job(args)
    err = stderr_console()
    try:
        infos = list_checkpoints(tier)
        try:
            pointer = read_pointer(tier, layout.LATEST)
        except ShoalError as e:  # still list the steps; verify reports it too
            err.print(f"warning: {e}")
            pointer = None
    finally:
        tier.close()
    latest = pointer.step if pointer is not None else None
    if latest is not None and latest not in {i.step for i in infos}:
        err.print(f"warning: {layout.LATEST} names step {latest}, which has no manifest under {tier.url}")
    if args.json:
        print_json(
            {"url": tier.url, "latest": latest, "checkpoints": [checkpoint_row(i, latest) for i in infos]}
        )
        return 0
    if not infos:
        err.print(f"no checkpoints under {tier.url}")
        return 0
    table = Table(title=f"checkpoints in {tier.url}", title_justify="left")
    for name in ("step", "boundary", "created", "items", "logical", "written", "unique", "dedup", "problem"):
        right = name in ("step", "items", "logical", "written", "unique", "dedup")
        table.add_column(name, justify="right" if right else "left", no_wrap=name != "problem")
    for info in infos:
        m = info.manifest
        boundary = info.boundary.label if info.boundary is not None else "?"
        if info.step == latest:
            boundary += " LATEST"
        if m is None:
            cells = ["", "", "", "", "", ""]
        else:
            s = m.stats
            cells = [
                _created(m.created),
                str(len(m.items)),
                human_bytes(s.logical_bytes),
                human_bytes(s.written_bytes),
                human_bytes(s.unique_bytes),
                human_ratio(s.dedup_ratio),
            ]
        style = "bold" if info.step == latest else ("red" if info.problem else "")
        row = [str(info.step), boundary, *cells, info.problem or ""]
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
        "(logical), bytes this step wrote, unique bytes, dedup ratio (logical / written), and why a "
        "manifest could not be read.",
    )
    p.add_argument("url", nargs="?", help="the job directory (<shared>/<job>), a path or fsspec URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
