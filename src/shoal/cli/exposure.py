"""``shoal exposure``: a finished run's rollback exposure per failure class, from its event log.

The event log is host-local (``events.jsonl`` in the run's directory of the local root), so this
command reads files on this host, never shared storage. ``JOB`` is an event log file, a
directory holding one (a run directory, a job's or a host's local directory), or a job name,
looked up under the local root (``--local``, default ``shoal.Config``'s). Where a directory
holds several logs (several runs or hosts), ``--run`` and ``--host`` choose; otherwise the newest
is read and a note says which. :func:`find_event_log` is shared with ``shoal advise``.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from shoal.cli.common import CliError, print_json, stderr_console, stdout_console
from shoal.config import default_local_root

if TYPE_CHECKING:
    from shoal.model.exposure import ExposureTimeline
    from shoal.records.exposure_log import RunLog

# The event log reader and the exposure model are imported by the functions that use them: they
# import numpy and scipy (seconds), which building the parser (``shoal --help``) must not wait for.

EVENT_LOG = "events.jsonl"
_PATTERNS = (EVENT_LOG, f"runs/*/{EVENT_LOG}", f"*/runs/*/{EVENT_LOG}")
"""Where a log lies below a run directory, a host's local directory and a job's local directory."""


def add_log_options(p: argparse.ArgumentParser) -> None:
    """``JOB``, ``--events``, ``--local``, ``--host``, ``--run``: which event log to read."""
    p.add_argument(
        "source",
        nargs="?",
        metavar="JOB",
        help="an event log file, a directory holding one, or a job name (looked up under the local root)",
    )
    p.add_argument("--events", metavar="PATH", help="the event log file (or a directory holding one)")
    p.add_argument(
        "--local",
        metavar="ROOT",
        help=f"the local root, as in shoal.Config(local=...) (default {default_local_root()})",
    )
    p.add_argument("--host", metavar="HOST", help="the host whose log to read (the coordinator's: rank 0's)")
    p.add_argument(
        "--run", dest="run_id", metavar="RUN", help="the run id, where the local directory holds several"
    )


def find_event_log(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The event log the command line names, and notes on how it was chosen."""
    if getattr(args, "shared", None) or getattr(args, "storage_options", None):
        raise CliError(
            "the event log is host-local: it is not on shared storage; give the log (--events PATH), "
            "the run's local directory, or the job name (looked up under --local ROOT)"
        )
    given = [x for x in (args.source, args.events, args.job) if x]
    if len(given) > 1:
        raise CliError(f"give one of JOB, --events and --job, not {len(given)} ({', '.join(given)})")
    if not given:
        raise CliError(
            "which run? give its event log (--events PATH), its local directory, or the job name "
            "(shoal exposure job42 looks under the local root)"
        )
    target = given[0]
    if os.path.isfile(target):
        return target, []
    if os.path.isdir(target):
        return _log_in(target, args)
    if args.events or os.sep in target or target in (".", ".."):
        raise CliError(f"no event log at {target}: no such file or directory")
    root = args.local or default_local_root()
    directory = os.path.join(root, target)
    if not os.path.isdir(directory):
        raise CliError(
            f"no local directory for job {target!r} at {directory} (the local root: {root}); give "
            "--local ROOT as in the job's shoal.Config, or the event log itself (--events PATH)"
        )
    return _log_in(directory, args)


def _log_in(directory: str, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The one event log below ``directory`` that ``--run``/``--host`` allow (the newest of several)."""
    found = sorted(
        {p for pattern in _PATTERNS for p in glob.glob(os.path.join(glob.escape(directory), pattern))}
    )
    chosen = [p for p in found if _matches(directory, p, args.run_id, args.host)]
    if not chosen:
        what = f" of run {args.run_id!r}" if args.run_id else ""
        what += f" of host {args.host!r}" if args.host else ""
        raise CliError(
            f"no event log ({EVENT_LOG}){what} under {directory}: give the log itself (--events PATH)"
            + (f"; logs there: {', '.join(found)}" if found else "")
        )
    newest = max(chosen, key=os.path.getmtime)
    if len(chosen) == 1:
        return newest, []
    return newest, [
        f"{len(chosen)} event logs under {directory}: reading the newest, {newest} "
        "(choose with --run RUN and --host HOST, or --events PATH)"
    ]


def _matches(directory: str, path: str, run: str | None, host: str | None) -> bool:
    """Whether ``path`` (``[<host>/]runs/<run>/events.jsonl`` under ``directory``) is ``run``/``host``'s."""
    parts = os.path.relpath(path, directory).split(os.sep)
    run_name = parts[-2] if len(parts) >= 3 else None
    host_name = parts[-4] if len(parts) >= 4 else None
    if run is not None and run_name not in (None, run):
        return False
    return host is None or host_name in (None, host)


def read_log(args: argparse.Namespace) -> RunLog:
    """The run the command line names, its notes printed on stderr."""
    from shoal.records.exposure_log import COORDINATOR, read_run_log

    path, notes = find_event_log(args)
    log = read_run_log(path, rank=COORDINATOR)
    err = stderr_console()
    for note in (*notes, *log.notes):
        err.print(f"note: {note}")
    return log


def seconds_text(value: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``, ``95`` -> ``"95.0 s"``, ``5400`` -> ``"1.50 h"``."""
    size = abs(value)
    if size < 1.0:
        return f"{value * 1000:.3g} ms"
    if size < 120.0:
        return f"{value:.1f} s"
    if size < 7200.0:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.2f} h"


def timeline_doc(log: RunLog, timeline: ExposureTimeline) -> dict[str, Any]:
    """``--json``: the run's timeline (``ExposureTimeline.to_json``), the log and the notes."""
    from shoal.records.exposure_log import COORDINATOR

    failed = sum(1 for c in log.checkpoints if c.failed_at is not None or not c.finished)
    return {
        "events": log.source,
        "rank": COORDINATOR,
        "failed_or_unfinished": failed,
        "notes": list(log.notes),
        **timeline.to_json(),
    }


def timeline_table(log: RunLog, timeline: ExposureTimeline) -> Table:
    """One row per failure class: its boundary, the peak, mean and integral, the exposure at the end."""
    from shoal.model.exposure import LEVEL_NAMES

    title = (
        f"rollback exposure of {log.source} over {seconds_text(timeline.duration)}, "
        f"{timeline.checkpoints} save(s)"
    )
    table = Table(title=title, title_justify="left")
    for name in ("failure", "boundary", "peak", "mean", "integral", "at end", "steps", "rolls back to",
                 "checkpoints"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("failure", "boundary") else "right", no_wrap=True)
    for c in timeline.classes.values():
        end = c.at_end
        table.add_row(
            *(
                Text(x)
                for x in (
                    c.failure,
                    f"B{c.boundary_level} {LEVEL_NAMES[c.boundary_level]}",
                    seconds_text(c.peak_seconds),
                    seconds_text(c.mean_seconds),
                    f"{c.integral:.4g} s²",
                    seconds_text(end.seconds),
                    "?" if end.steps is None else str(end.steps),
                    "start" if end.protected_step is None else f"step {end.protected_step}",
                    str(c.checkpoints),
                )
            )
        )
    return table


def plot_timeline(timeline: ExposureTimeline, path: str) -> None:
    """The sawtooth of every class, seconds against time since the start, as a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib, or shoal's dev extra)"
        ) from None
    fig, ax = plt.subplots(figsize=(9, 4))
    try:
        for c in timeline.classes.values():
            xs = [t - timeline.start for t, _ in c.points]
            ax.plot(xs, [v for _, v in c.points], label=f"{c.failure} (B{c.boundary_level})")
        ax.set_xlabel("seconds since the run's start")
        ax.set_ylabel("exposure (seconds of training lost)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise CliError(f"--plot: cannot write {path}: {e}") from e
    finally:
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    log = read_log(args)
    timeline = log.timeline()
    if args.plot:
        plot_timeline(timeline, args.plot)
    if args.json:
        print_json(timeline_doc(log, timeline))
    else:
        stdout_console().print(timeline_table(log, timeline))
    if args.plot:
        stderr_console().print(f"plot written to {args.plot}")
    return 0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "exposure",
        parents=parents,
        help="a finished run's rollback exposure per failure class, from its event log",
        description="How much training a failure would have thrown away over a run, per failure class: "
        "process (back to the newest checkpoint at B1 STAGED), host (B2 REPLICATED), cluster "
        "(B4 RESTARTABLE). Per class: the peak, the mean and the time integral of the exposure "
        "(seconds since the protecting checkpoint's save call), the exposure at the run's end, and "
        "the checkpoints that reached the boundary. Reads the coordinator's (rank 0's) host-local "
        "event log. See docs/exposure.md.",
    )
    add_log_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (with the sawtooth's points)")
    p.add_argument("--plot", metavar="PNG", help="also plot every class's sawtooth to PNG (needs matplotlib)")
    p.set_defaults(run=run)
