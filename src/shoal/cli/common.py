"""What every ``shoal`` subcommand shares: addressing a job's checkpoints, consoles, sizes, progress."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
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

from shoal.boundary import Boundary
from shoal.errors import CheckpointNotFound, ConfigError, FormatError, MissingFile, ShoalError
from shoal.format import layout
from shoal.format.layout import MAX_STEP
from shoal.format.manifest import Pointer
from shoal.records.store import CheckpointInfo, list_steps, read_pointer
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


class JobNotFound(CheckpointNotFound):
    """The addressed directory is not a shoal job: it does not exist, or shoal wrote nothing there."""


JOB_RECORDS = (layout.RUN, layout.WRITER, layout.LATEST)
"""The records shoal writes at a job directory's root on shared storage: ``RUN`` when the job's
first ``Checkpointer`` starts, ``WRITER`` when a writer claims the job, ``LATEST`` at the first commit."""
JOB_DIRS = (layout.STEPS_DIR, layout.PACKS_DIR)
"""The directories of a job's checkpoints (manifests and commit records, packs)."""
JOB_MARKERS = frozenset((*JOB_RECORDS, *JOB_DIRS))
"""A directory holding any of these names is a job directory."""
MAX_LISTED_JOBS = 20
"""Jobs a message names at most."""
MAX_PROBED_DIRS = 200
"""Directories of a shared root looked into for jobs at most (one listing each)."""

_EXPECTED = (
    f"a job directory holds a {', '.join(JOB_RECORDS[:-1])} or {JOB_RECORDS[-1]} record, "
    f"or {' and '.join(d + '/' for d in JOB_DIRS)}, which shoal writes at <shared>/<job>"
)


def open_job(args: argparse.Namespace) -> Tier:
    """The shared tier holding the addressed job's checkpoints.

    A directory that is not a job (it does not exist, or holds none of :data:`JOB_MARKERS`) is
    a :class:`JobNotFound` naming what was expected there and the jobs found next to it; a job
    with no checkpoint yet (only its ``RUN`` record) opens.
    """
    from shoal.tiers.roles import Role, open_role

    url = job_url(args)
    options = storage_options(args)
    try:
        tier = open_role(Role.SHARED, url, options)
    except ConfigError as e:
        raise CliError(str(e)) from e
    try:
        if not is_job(tier):
            raise JobNotFound(_no_job(args, url, options))
    except BaseException:
        tier.close()
        raise
    return tier


def is_job(tier: Tier) -> bool:
    """Whether ``tier`` (a job directory on shared storage) holds anything shoal writes for a job."""
    if any(tier.exists(name) for name in JOB_RECORDS):
        return True
    return any(tier.list(f"{d}/") for d in JOB_DIRS)


def _no_job(args: argparse.Namespace, url: str, options: dict[str, Any]) -> str:
    """The one-line message for ``url``, which is not a job: what was expected, which jobs are there."""
    command = getattr(args, "command", None) or "ls"
    here = _probe(url, options)
    if args.shared:
        root: str | None = args.shared.rstrip("/") or args.shared
        head = f"no job {args.job or DEFAULT_JOB!r} under {root}"
        if here == "missing":
            head += f": {url} does not exist"
        elif here == "file":
            head += f": {url} is a file"
        else:
            head += f" (expected {url}: {_EXPECTED})"
        return head + _jobs_note(root, options, command, given="--job")
    if here == "missing":
        head = f"no job at {url}: no such file or directory"
    elif here == "file":
        head = f"no job at {url}: it is a file, not a job directory"
    else:
        inside = _find_jobs(url, options)
        if isinstance(inside, _Jobs) and inside.names:
            first = inside.names[0]
            return (
                f"no job at {url} ({_EXPECTED}); it looks like a shared root: jobs found in it: "
                f"{inside.listed()} (shoal {command} {url}/{first}, or --shared {url} --job {first})"
            )
        head = f"no job at {url} ({_EXPECTED})"
    return head + _jobs_note(parent_url(url), options, command, given=None)


@dataclass(frozen=True)
class _Jobs:
    """The job directories found right under a root, and what else the listing showed."""

    names: list[str]
    unprobed: int
    """Directories not looked into (past :data:`MAX_PROBED_DIRS`)."""
    root_is_job: bool
    """The root itself holds a job's records: it is a job directory, not a shared root."""

    def listed(self) -> str:
        shown = self.names[:MAX_LISTED_JOBS]
        text = ", ".join(shown)
        if len(self.names) > len(shown):
            text += f" and {len(self.names) - len(shown)} more"
        if self.unprobed:
            text += f" (and {self.unprobed} more directories not looked into)"
        return text


def _jobs_note(root: str | None, options: dict[str, Any], command: str, *, given: str | None) -> str:
    """``; jobs found under ROOT: a, b`` (or that there are none, or why ROOT could not be listed)."""
    if root is None:
        return ""
    found = _find_jobs(root, options)
    if isinstance(found, str):
        return f"; {found}"
    note = ""
    if found.names:
        note = f"; jobs found under {root}: {found.listed()}"
        if given:
            note += f" (choose one with {given} NAME)"
    elif found.root_is_job:
        pass
    elif found.unprobed:
        note = f"; no jobs found under {root} in the {MAX_PROBED_DIRS} directories looked into"
    else:
        note = f"; no jobs found under {root} either"
    if found.root_is_job:
        note += f"; {root} itself is a job directory (shoal {command} {root})"
    return note


def parent_url(url: str) -> str | None:
    """The directory above ``url`` (a path or an fsspec URL), or None at a bucket or the file system root."""
    scheme, sep, rest = url.rpartition("://")
    prefix = f"{scheme}{sep}"
    rest = rest.rstrip("/")
    if "/" not in rest:
        if sep:  # s3://bucket: no parent
            return None
        return "." if rest not in ("", ".") else None
    parent = rest.rsplit("/", 1)[0]
    return prefix + (parent or "/")  # /job: the root


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec file system and path of ``url``, opened as the shared tier opens it (no caches)."""
    import fsspec

    opts = dict(options)
    opts["skip_instance_cache"] = True
    if fsspec.utils.get_protocol(url) not in ("file", "local"):
        opts.setdefault("use_listings_cache", False)
    fs, path = fsspec.url_to_fs(url, **opts)
    return fs, path


_PROBE_ERRORS = (OSError, ValueError, ImportError, RuntimeError, TypeError)
"""What looking at a path that is not a job may fail with (no credentials, no such bucket, ...)."""


def _probe(url: str, options: dict[str, Any]) -> str:
    """``"missing"``, ``"file"`` or ``"directory"`` (also when it cannot be told)."""
    try:
        fs, path = _filesystem(url, options)
        if not fs.exists(path):
            return "missing"
        if fs.isfile(path):
            return "file"
    except _PROBE_ERRORS:
        pass
    return "directory"


def _find_jobs(root: str, options: dict[str, Any]) -> _Jobs | str:
    """The job directories right under ``root`` (one listing each); why not, if it cannot be listed."""
    try:
        fs, path = _filesystem(root, options)
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return f"{root} does not exist either"
    except NotADirectoryError:
        return f"{root} is not a directory"
    except _PROBE_ERRORS as e:
        return f"could not list {root} for jobs: {type(e).__name__}: {' '.join(str(e).split())}"
    names = {_basename(e["name"]) for e in entries if isinstance(e, dict) and "name" in e}
    dirs = sorted(
        str(e["name"]).rstrip("/") for e in entries if isinstance(e, dict) and e.get("type") == "directory"
    )
    jobs = []
    for d in dirs[:MAX_PROBED_DIRS]:
        try:
            inside = {_basename(n) for n in fs.ls(d, detail=False)}
        except _PROBE_ERRORS:
            continue
        if inside & JOB_MARKERS:
            jobs.append(_basename(d))
    return _Jobs(jobs, max(0, len(dirs) - MAX_PROBED_DIRS), bool(names & JOB_MARKERS))


def _basename(name: object) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1]


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


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact integer arithmetic, so any int a manifest holds can be shown."""
    for exponent, unit in enumerate(_UNITS):
        if abs(n) < 1024 ** (exponent + 1) or unit == _UNITS[-1]:
            break
    if exponent == 0:
        return f"{n} B"
    if abs(n) >= 1024 ** len(_UNITS):  # past YiB: no float holds it, Decimal does
        return f"{Decimal(n):.2e} B"
    return f"{n / 1024**exponent:.1f} {unit}"


def dedup_text(logical: int, written: int) -> str:
    """The dedup column: logical bytes per byte written, or what a step that wrote nothing means."""
    if written == 0:
        return "all reused" if logical else "-"
    ratio = Decimal(logical) / Decimal(written)
    return f"{ratio:.2f}x" if ratio < 10**6 else f"{ratio:.2e}x"


def dedup_ratio(logical: int, written: int) -> float | None:
    """Logical bytes per byte written, for JSON; None when the step wrote nothing or no float holds it."""
    if written == 0:
        return None
    try:
        ratio = logical / written
    except OverflowError:
        return None
    return ratio if math.isfinite(ratio) else None


def local_time(ts: float) -> dt.datetime | None:
    """``ts`` (seconds since the epoch) in local time, or None if this platform cannot represent it."""
    try:
        return dt.datetime.fromtimestamp(ts).astimezone()
    except (OverflowError, ValueError, OSError):  # out of range for time_t or for datetime
        return None


def step_number(text: str) -> int:
    """``--step``: a checkpoint step, an int in [0, 10**12)."""
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {text!r}") from None
    if not 0 <= step <= MAX_STEP:
        raise argparse.ArgumentTypeError(f"a step is between 0 and {MAX_STEP}, got {step}")
    return step


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``--keep-last``, ``--nodes``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def directory_in_the_way(error: BaseException) -> bool:
    """Whether a missing-file error was a directory where the file should be (not a missing file)."""
    seen: BaseException | None = error
    for _ in range(8):  # the tier's error, wrapped by the reader, wrapped by the caller
        if seen is None:
            break
        if isinstance(seen, IsADirectoryError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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


def directory_at(tier: Tier, path: str) -> bool:
    """Whether ``path``, which a reader found missing, is in fact a directory."""
    try:
        tier.read(path)
    except MissingFile as e:
        return directory_in_the_way(e)
    except (ShoalError, OSError):
        return False
    return False


def read_pointer_strictly(tier: Tier, path: str) -> Pointer | None:
    """``LATEST`` or a ``COMMIT`` record, or None if absent (a directory there is a FormatError).

    :func:`~shoal.records.store.read_pointer` takes a directory where the record should be
    for no record at all; ``ls`` and ``verify`` say what is in the way instead.
    """
    pointer = read_pointer(tier, path)
    if pointer is None and directory_at(tier, path):
        raise FormatError(
            f"{tier.url}/{path} is a directory, not a file; move it away (shoal writes a JSON record there)"
        )
    return pointer


def checkpoint_problem(tier: Tier, info: CheckpointInfo) -> str | None:
    """What is wrong with one listed step, naming the file; None if nothing is."""
    path = layout.manifest_path(info.step)
    if isinstance(info.error, CheckpointNotFound) and directory_at(tier, path):
        return f"{tier.url}/{path} is a directory, not a manifest file; move it away"
    if info.boundary is Boundary.PERSISTED:  # no commit record, or something else in its place
        try:
            read_pointer_strictly(tier, layout.commit_path(info.step))
        except ShoalError as e:
            return str(e)
    m = info.manifest
    if m is not None and m.partial:
        unheld = sum(1 for rec in m.items.values() for d in rec.chunks if d not in m.locations)
        if unheld:
            return (
                f"{tier.url}/{path} is a partial manifest (a host tier's copy): {unheld} chunk(s) have no "
                "location here, so the step cannot be restored from this tier"
            )
    return info.problem
