"""``shoal advise``: the checkpoint interval to use, from a run's own measurements.

Reads the coordinator's event log (found as ``shoal exposure`` finds it), measures per durability
path the stall (rank 0's ``staged`` minus its save call) and the lag to each failure class's
boundary, takes the run's median gap between save calls as the current interval (or
``--interval``), and asks :func:`shoal.model.advisor.advise_intervals` for Young's and Daly's
intervals and the expected waste at the current and at the optimal interval. The work is done by
:func:`shoal.records.exposure_log.advise_run`; this module parses the command line and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from shoal.cli.common import positive_int, print_json, stdout_console
from shoal.cli.exposure import add_log_options, read_log, seconds_text

if TYPE_CHECKING:
    from shoal.model.advisor import FailureModel, IntervalAdvice
    from shoal.records.exposure_log import PathAdvice, RunAdvice

# The advisor and the event log reader are imported by the functions that use them: they import
# numpy and scipy (seconds), which building the parser (``shoal --help``) must not wait for.

SECONDS_PER_HOUR = 3600.0


def _number(text: str, what: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of {what}: {text!r}") from None
    if not value == value or value in (float("inf"), float("-inf")) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else '> 0'} {what}, got {text!r}")
    return value


def _hours(text: str) -> float:
    return _number(text, "hours", zero=False)


def _seconds(text: str) -> float:
    return _number(text, "seconds", zero=False)


def _seconds_or_zero(text: str) -> float:
    return _number(text, "seconds", zero=True)


def failure_model(args: argparse.Namespace) -> FailureModel:
    """The failures the command line describes (``--node-mtbf`` is in hours)."""
    from shoal.model.advisor import FailureModel

    return FailureModel(args.node_mtbf * SECONDS_PER_HOUR, args.nodes, args.restart)


def _advice_doc(advice: IntervalAdvice, path: PathAdvice) -> dict[str, Any]:
    from shoal.model.exposure import LEVEL_NAMES

    lag = path.measured.lags[advice.name]
    return {"boundary": LEVEL_NAMES[lag.boundary_level], "boundary_level": lag.boundary_level,
            "lag_checkpoints": lag.checkpoints, **dataclasses.asdict(advice)}  # fmt: skip


def advice_doc(advice: RunAdvice) -> dict[str, Any]:
    """``--json``: the failures, the save gap, and per path its measurements and advice per class."""
    f = advice.failures
    paths = {
        name: {
            "checkpoints": p.measured.checkpoints,
            "stall_s": p.measured.stall_s,
            "stall_spread_s": p.measured.stall_spread_s,
            "current_interval_s": p.current_interval_s,
            "step_time_s": p.step_time_s,
            "classes": {c: _advice_doc(a, p) for c, a in p.advice.items()},
        }
        for name, p in advice.paths.items()
    }
    return {
        "events": advice.source,
        "failures": {
            "node_mtbf_s": f.node_mtbf_s,
            "nodes": f.nodes,
            "restart_s": f.restart_s,
            "job_mtbf_s": f.job_mtbf_s,
        },
        "save_gap_s": advice.save_gap_s,
        "save_gap_given": advice.gap_given,
        "notes": list(advice.notes),
        "paths": paths,
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _hours_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def path_table(name: str, path: PathAdvice, advice: RunAdvice) -> Table:
    """One durability path: a row per failure class, the intervals and the waste at each."""
    from shoal.model.exposure import LEVEL_NAMES

    m = path.measured
    gap = "-" if advice.save_gap_s is None else seconds_text(advice.save_gap_s)
    how = "given" if advice.gap_given else "measured"
    title = (
        f"path {name}: {m.checkpoints} checkpoint(s), stall {seconds_text(m.stall_s)} "
        f"± {seconds_text(m.stall_spread_s)}, save gap {gap} ({how}), "
        f"job MTBF {seconds_text(advice.failures.job_mtbf_s)}"
    )
    table = Table(title=title, title_justify="left")
    columns = ("failure", "boundary", "lag", "Young", "Daly", "Daly steps", "waste now", "waste at Daly",
               "acc-h/day now", "acc-h/day at Daly")  # fmt: skip
    for column in columns:
        table.add_column(
            column, justify="left" if column in ("failure", "boundary") else "right", no_wrap=True
        )
    for cls, a in path.advice.items():
        lag = m.lags[cls]
        cells = (
            cls,
            f"B{lag.boundary_level} {LEVEL_NAMES[lag.boundary_level]}",
            f"{seconds_text(a.lag_s)} ± {seconds_text(a.lag_spread_s)}",
            seconds_text(a.young_interval_s),
            seconds_text(a.optimal_interval_s),
            "-" if a.optimal_interval_steps is None else str(a.optimal_interval_steps),
            _percent(a.waste_at_current),
            _percent(a.waste_at_optimum),
            _hours_text(a.waste_accelerator_hours_per_day_at_current),
            _hours_text(a.waste_accelerator_hours_per_day_at_optimum),
        )
        table.add_row(*(Text(c) for c in cells))
    return table


def run(args: argparse.Namespace) -> int:
    from shoal.records.exposure_log import advise_run

    failures = failure_model(args)
    log = read_log(args)
    advice = advise_run(
        log, failures, interval_s=args.interval, accelerators_per_node=args.accelerators_per_node
    )
    if args.json:
        print_json(advice_doc(advice))
        return 0
    console = stdout_console()
    for name, path in advice.paths.items():
        console.print(path_table(name, path, advice))
    return 0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "advise",
        parents=parents,
        help="the checkpoint interval to use (Young, Daly) from a run's event log and its failure rate",
        description="From a run's event log: per durability path the stall (training blocked per save) "
        "and the lag to each failure class's boundary (process B1, host B2, cluster B4), the current "
        "interval (the median gap between save calls, or --interval); then Young's and Daly's optimal "
        "intervals and the expected waste (fraction of the job's time, and accelerator-hours per day "
        "with --accelerators-per-node) at the current and at the optimal interval. The work between "
        "saves is the gap minus the stall. See docs/exposure.md.",
    )
    add_log_options(p)
    need = p.add_argument_group("the failures (required)")
    need.add_argument(
        "--node-mtbf", metavar="HOURS", type=_hours, required=True, help="one node's MTBF, in hours"
    )
    need.add_argument("--nodes", metavar="N", type=positive_int, required=True, help="the job's node count")
    need.add_argument(
        "--restart",
        metavar="SECONDS",
        type=_seconds_or_zero,
        required=True,
        help="seconds from a failure until training runs again (reschedule, reload)",
    )
    p.add_argument(
        "--accelerators-per-node",
        metavar="K",
        type=positive_int,
        help="accelerators per node, for the waste in accelerator-hours per day",
    )
    p.add_argument(
        "--interval",
        metavar="SECONDS",
        type=_seconds,
        help="the seconds between save calls to judge (default: the run's median gap)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
