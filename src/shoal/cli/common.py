"""What every ``shoal`` subcommand shares: addressing a job's checkpoints, consoles, sizes, progress."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from shoal.engine.store import list_steps
from shoal.errors import CheckpointNotFound, ConfigError, ShoalError
from shoal.tiers.base import Tier

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""``verify`` found something wrong."""
EXIT_ERROR = 2
"""An error (shoal's, an I/O error) or bad usage."""
EXIT_INTERRUPTED = 130

DEFAULT_JOB = "default"
"""The job name ``--shared`` uses without ``--job`` (``shoal.Config.job``'s default)."""


class CliError(ShoalError, ValueError):
    """A command line that cannot be carried out as given (bad option value, unusable output path)."""


def add_location_options(parser: argparse.ArgumentParser) -> None:
    """``--shared ROOT``, ``--job JOB`` and ``--storage-options JSON`` (the positional URL is per command)."""
    group = parser.add_argument_group("where the checkpoints are")
    group.add_argument(
        "--shared",
        metavar="ROOT",
        help="shared root, as in shoal.Config(shared=...): a path or an fsspec URL (s3://bucket/run)",
    )
    group.add_argument(
        "--job",
        metavar="JOB",
        help=f"job name, as in shoal.Config(job=...) (default with --shared: {DEFAULT_JOB!r})",
    )
    group.add_argument(
        "--storage-options",
        metavar="JSON",
        help='fsspec storage options as a JSON object, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )


def job_url(args: argparse.Namespace) -> str:
    """The job directory the command addresses: the positional URL, or ``<shared>/<job>``."""
    url: str | None = getattr(args, "url", None)
    if url and args.shared:
        raise CliError(f"give the job directory ({url!r}) or --shared/--job, not both")
    if url:
        if args.job:
            raise CliError(f"--job goes with --shared; {url!r} already names the job directory")
        return url.rstrip("/") or url
    if not args.shared:
        raise CliError(
            "which checkpoints? give the job directory (shoal ls /lustre/run/job42) "
            "or --shared ROOT --job JOB"
        )
    return f"{args.shared.rstrip('/')}/{args.job or DEFAULT_JOB}"


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    raw = args.storage_options
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CliError(f"--storage-options is not valid JSON: {e}") from e
    if not isinstance(options, dict):
        raise CliError(f"--storage-options must be a JSON object, got {type(options).__name__}")
    return options


def open_job(args: argparse.Namespace) -> Tier:
    """The shared tier holding the addressed job's checkpoints."""
    from shoal.tiers import open_tier

    try:
        return open_tier("shared", job_url(args), storage_options(args))
    except ConfigError as e:
        raise CliError(str(e)) from e


def missing_step(tier: Tier, step: int) -> CheckpointNotFound:
    """The error for an unknown ``--step``, naming the steps the tier does hold."""
    steps = list_steps(tier)
    present = ", ".join(map(str, steps[-20:])) if steps else "none"
    more = f" (and {len(steps) - 20} older)" if len(steps) > 20 else ""
    return CheckpointNotFound(
        f"no checkpoint for step {step} under {tier.url}; steps present: {present}{more}"
    )


def stdout_console() -> Console:
    """A console for results: no markup or highlighting of data, wide when not a terminal."""
    console = Console(markup=False, highlight=False, soft_wrap=True)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(markup=False, highlight=False, soft_wrap=True, width=200)
    return console


def stderr_console() -> Console:
    return Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


@contextmanager
def byte_progress(description: str, total: int, *, enabled: bool = True) -> Iterator[Progress]:
    """A progress bar in bytes on stderr (only drawn on a terminal); ``task 0`` is the one to advance."""
    console = stderr_console()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not (enabled and console.is_terminal),
    )
    with progress:
        progress.add_task(description, total=total)
        yield progress


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_ratio(ratio: float) -> str:
    return "inf" if math.isinf(ratio) else f"{ratio:.2f}x"


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)\s*", re.IGNORECASE)
_PREFIXES = "kmgtp"


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"512MiB"`` -> 512 * 2**20, ``"1000"`` -> 1000 (as Hugging Face counts)."""
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    number, unit = float(m.group(1)), m.group(2).lower()
    prefix = unit[:1] if unit[:1] in _PREFIXES else ""
    binary = unit[len(prefix) :].startswith("i")
    if binary and not prefix:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    exponent = _PREFIXES.index(prefix) + 1 if prefix else 0
    size = int(number * (1024 if binary else 1000) ** exponent)
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return size


def print_json(doc: Mapping[str, Any]) -> None:
    """Strict JSON (no NaN or Infinity) on stdout."""
    print(json.dumps(doc, indent=2, allow_nan=False))
