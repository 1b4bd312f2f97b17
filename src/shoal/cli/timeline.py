"""``shoal timeline``: a run's checkpoints and loads as a Chrome trace that Perfetto opens.

Reads every host's event log of the run (host-local files: ``docs/events.md``), merged onto one
clock by :mod:`shoal.obs.runlogs`, and writes the trace :mod:`shoal.obs.timeline` builds.
:func:`add_run_options` and :func:`read_run` are shared with ``shoal report``: the run is
``--events LOG`` (repeated, one per host), or a job's local directory or name (every host's log
below ``<local>/<job>``), or the job's directory on shared storage (its run id read from the
``RUN`` record there, its logs under ``--local``).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from shoal.cli.common import CliError, stderr_console
from shoal.config import default_local_root

if TYPE_CHECKING:
    from shoal.obs.runlogs import RunRecords, StepFilter

# shoal.obs imports the event reader and the exposure model (numpy, scipy: seconds), which
# building the parser (``shoal --help``) must not wait for: imported where used.


def add_run_options(p: argparse.ArgumentParser) -> None:
    """``[RUN]``, ``--events LOG ...``, ``--local ROOT``, ``--run RUN``, ``--steps``: which records."""
    p.add_argument(
        "source",
        nargs="?",
        metavar="RUN",
        help="the job's directory on shared storage (its logs are then found under --local), a job "
        "name (looked up under the local root), a job's or host's local directory, or one event log",
    )
    p.add_argument(
        "--events",
        metavar="LOG",
        action="append",
        default=[],
        help="an event log (events.jsonl) or a directory holding them; repeat it for each host's log",
    )
    p.add_argument(
        "--local",
        metavar="ROOT",
        help=f"the local root, as in shoal.Config(local=...) (default {default_local_root()})",
    )
    p.add_argument("--run", dest="run_id", metavar="RUN", help="the run id, where several runs left logs")
    p.add_argument("--steps", metavar="STEPS", help="only these steps: 3-7, 5, or 1-3,9 (default: all)")


def _is_shared_job(target: str) -> bool:
    """Whether ``target`` names a job directory on shared storage (a URL, or one holding its records)."""
    if "://" in target:
        return True
    from shoal.cli.common import JOB_MARKERS

    return os.path.isdir(target) and any(os.path.exists(os.path.join(target, m)) for m in JOB_MARKERS)


def log_paths(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The event logs the command line names, and notes on how they were chosen."""
    from shoal.obs.runlogs import find_logs

    source: str | None = args.source
    if args.events and (source or args.shared or args.job):
        raise CliError("give the event logs (--events LOG ...) or the run (RUN, --shared, --job), not both")
    if args.events:
        paths: list[str] = []
        notes: list[str] = []
        for p in args.events:
            if os.path.isfile(p):
                paths.append(p)
            elif os.path.isdir(p):
                found, more = find_logs(p, run=args.run_id)
                paths.extend(found)
                notes.extend(more)
            else:
                raise CliError(f"--events {p}: no such file or directory")
        return paths, notes
    if args.shared or (source is not None and _is_shared_job(source)):
        return _logs_of_shared_job(args)
    if source and args.job:
        raise CliError(f"give the run ({source!r}) or --job, not both")
    source = source or args.job
    if source is None:
        raise CliError(
            "which run? give each host's event log (--events LOG, repeated), the job's local "
            "directory, the job name (looked up under --local ROOT), or its directory on shared storage"
        )
    if os.path.isfile(source):
        return [source], []
    if os.path.isdir(source):
        return find_logs(source, run=args.run_id)
    if os.sep in source or source in (".", ".."):
        raise CliError(f"no event log or directory at {source}: no such file or directory")
    root = args.local or default_local_root()
    directory = os.path.join(root, source)
    if not os.path.isdir(directory):
        raise CliError(
            f"no local directory for job {source!r} at {directory} (the local root: {root}); give "
            "--local ROOT as in the job's shoal.Config, or the event logs themselves (--events LOG)"
        )
    return find_logs(directory, run=args.run_id)


def _logs_of_shared_job(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The logs of the run recorded at the job's directory on shared storage, under the local root."""
    from shoal.cli.common import open_job
    from shoal.obs.runlogs import find_logs
    from shoal.records.hoststate import read_shared_run

    if args.source and args.shared:
        raise CliError(f"give the job directory ({args.source!r}) or --shared/--job, not both")
    ns = argparse.Namespace(**{**vars(args), "url": args.source if not args.shared else None})
    tier = open_job(ns)
    try:
        record = read_shared_run(tier)
        url = tier.url
    finally:
        tier.close()
    if record is None:
        raise CliError(f"{url} has no RUN record: no Checkpointer has run this job yet")
    root = args.local or default_local_root()
    directory = os.path.join(root, record.job)
    if not os.path.isdir(directory):
        raise CliError(
            f"job {record.job!r} (run {record.run}, from {url}/RUN) has no local directory at "
            f"{directory}: give --local ROOT as in the job's shoal.Config, or the logs (--events LOG)"
        )
    if args.run_id is not None and args.run_id != record.run:
        raise CliError(f"--run {args.run_id}: the job at {url} is run {record.run}")
    return find_logs(directory, run=record.run)


def steps_of(args: argparse.Namespace) -> StepFilter:
    from shoal.errors import ShoalError
    from shoal.obs.runlogs import parse_steps

    try:
        return parse_steps(args.steps)
    except ShoalError as e:
        raise CliError(f"--steps: {e}") from e


def read_run(args: argparse.Namespace) -> RunRecords:
    """The run the command line names, every host's log merged; notes printed on stderr."""
    from shoal.obs.runlogs import load_run

    paths, notes = log_paths(args)
    run = load_run(paths)
    err = stderr_console()
    for note in (*notes, *run.notes):
        err.print(f"note: {note}")
    return run


def check_output(path: str) -> None:
    """``-o``: a file whose directory exists (the write itself reports its own errors)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"-o {path}: the directory {directory} does not exist")
    if os.path.isdir(path):
        raise CliError(f"-o {path}: is a directory; give a file name")


def run(args: argparse.Namespace) -> int:
    from shoal.obs.timeline import build_trace, write_trace

    check_output(args.output)
    steps = steps_of(args)
    records = read_run(args)
    trace = build_trace(records, steps)
    write_trace(trace, args.output)
    spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    hosts = ", ".join(records.hosts())
    stderr_console().print(
        f"trace written to {args.output}: {spans} spans on hosts {hosts} from {len(records.sources)} "
        "log(s); open it in https://ui.perfetto.dev or chrome://tracing"
    )
    return 0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "timeline",
        parents=parents,
        help="a run's checkpoints and loads as a trace for Perfetto (chrome://tracing), from its event logs",
        description="Write a run's checkpoints and loads as a Chrome trace (JSON), which Perfetto "
        "(https://ui.perfetto.dev) and chrome://tracing open: one process per host, one track per "
        "rank, spans for staging, hashing, the plan, partner copies, drain packs, the commit and "
        "loads (reads and exchange), an instant at each boundary, and a counter of the bytes being "
        "written per host. Reads every host's event log of the run; each host's monotonic clock is "
        "mapped onto the wall clock by the median of (t - mono) over its lines, which assumes the "
        "hosts' wall clocks agree (NTP). See docs/observability.md.",
        epilog="examples:\n"
        "  shoal timeline job42 --local /nvme/shoal -o trace.json\n"
        "  shoal timeline --events h0/events.jsonl --events h1/events.jsonl --steps 3-7 -o trace.json\n"
        "  shoal timeline /lustre/run/job42 --local /nvme/shoal -o trace.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_options(p)
    p.add_argument("-o", "--output", metavar="TRACE", required=True, help="the trace file to write (JSON)")
    p.set_defaults(run=run)
