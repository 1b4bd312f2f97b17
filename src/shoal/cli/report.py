"""``shoal report``: a run's checkpoints as one self-contained HTML page of charts and tables.

The run is chosen as for ``shoal timeline`` (:func:`shoal.cli.timeline.add_run_options`): every
host's event log, merged onto one clock. The page is built by :mod:`shoal.obs.report`; it needs
no network to be viewed (inline SVG and CSS, no script).
"""

from __future__ import annotations

import argparse
from typing import Any

from shoal.cli.common import stderr_console
from shoal.cli.timeline import add_run_options, check_output, read_run, steps_of


def run(args: argparse.Namespace) -> int:
    from shoal.obs.report import collect, render, write_report

    check_output(args.output)
    steps = steps_of(args)
    records = read_run(args)
    data = collect(records, steps)
    write_report(render(data), args.output)
    stderr_console().print(
        f"report written to {args.output}: {len(data.rows)} checkpoint(s) on hosts "
        f"{', '.join(records.hosts())}; open it in a browser"
    )
    return 0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        parents=parents,
        help="a run's checkpoints as one HTML page of charts (no network needed to view it)",
        description="Write one self-contained HTML page about a run's checkpoints, from every host's "
        "event log: the time to each boundary (B1..B4) per checkpoint, the rollback exposure per "
        "failure class over the run, the predicted and observed time to B2 with the p90 band, the "
        "path chosen per checkpoint and why, bytes written per tier, the share deduplication "
        "spared, and partner-copy link use; tables with every checkpoint's numbers and the loads; "
        "for a KV store's kv_stats records (shoal.obs.kvlog.KVRecorder), its hit ratio per tier "
        "over time. See docs/observability.md.",
        epilog="examples:\n"
        "  shoal report job42 --local /nvme/shoal -o report.html\n"
        "  shoal report --events h0/events.jsonl --events h1/events.jsonl -o report.html\n"
        "  shoal report /lustre/run/job42 --local /nvme/shoal --steps 100-200 -o report.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_options(p)
    p.add_argument("-o", "--output", metavar="HTML", required=True, help="the HTML file to write")
    p.set_defaults(run=run)
