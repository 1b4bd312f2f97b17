"""``shoal``: inspect, verify, garbage-collect and export a job's checkpoints on shared storage;
read a run's event log for its rollback exposure and the checkpoint interval to use.

Exit status: 0 success; 1 ``verify`` found problems; 2 could not run: bad usage, or an
error, printed as one line on stderr that names the place (shoal's errors, I/O errors and
malformed metadata); an unexpected exception is an "internal error", still one line and
exit 2; 130 interrupted. No traceback is shown unless asked for with ``--debug`` or
``SHOAL_DEBUG=1`` in the environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

from shoal import __version__
from shoal.cli import advise, export, exposure, gc, ls, report, timeline, verify
from shoal.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, add_location_options
from shoal.errors import ShoalError

DEBUG_ENV = "SHOAL_DEBUG"
"""Set to 1 to show tracebacks (and debug logging) as ``--debug`` does, e.g. for ``shoal demo``."""

EXPECTED_ERRORS: tuple[type[Exception], ...] = (ShoalError, OSError, UnicodeError, json.JSONDecodeError)
"""What a command may fail with for a reason outside shoal: bad data, I/O, the environment."""

_EPILOG = """\
Checkpoints are addressed by their job directory on shared storage, as a positional
argument (shoal ls /lustre/run/job42, shoal ls s3://bucket/run/job42) or as shoal.Config
names them (shoal ls --shared /lustre/run --job job42).

examples:
  shoal ls /lustre/run/job42
  shoal verify --shared s3://bucket/run --job job42 --storage-options '{"anon": false}'
  shoal gc /lustre/run/job42 --keep-last 3 --dry-run
  shoal export /lustre/run/job42 --format dcp ./job42-dcp
  shoal export /lustre/run/job42 --format safetensors ./hf      (the model: the tensors under 'model')
  shoal export /lustre/run/job42 --format safetensors --all ./everything
  shoal exposure job42 --local /nvme/shoal          (host-local: reads the run's event log)
  shoal advise job42 --node-mtbf 8760 --nodes 64 --restart 600 --accelerators-per-node 8
  shoal timeline job42 --local /nvme/shoal -o trace.json     (every host's log: open it in Perfetto)
  shoal report job42 --local /nvme/shoal -o report.html      (one HTML page of charts)
"""


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help=f"show tracebacks and debug logging (or set {DEBUG_ENV}=1)"
    )
    add_location_options(common)
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Inspect, verify, garbage-collect and export shoal checkpoints.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (ls, verify, gc, export, exposure, advise, timeline, report):
        module.add_parser(sub, [common])
    # dispatched before parsing (its own argparse takes the rest); listed here for --help
    sub.add_parser("demo", help="run the demo (shoal demo --help for its options)", add_help=False)
    return parser


def parse_args(argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse a command line (not ``demo``'s) as :func:`main` does; SystemExit as argparse raises it.

    argparse takes each positional once: ``export URL --format dcp OUT`` leaves ``OUT`` over,
    which goes to the command's ``intermixed`` list.
    """
    parser = parser or build_parser()
    args, extra = parser.parse_known_args(list(argv))
    intermixed = getattr(args, "intermixed", None)
    if extra and intermixed and not any(x.startswith("-") for x in extra):
        getattr(args, intermixed).extend(extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _run_demo(rest: list[str]) -> int:
    from shoal import demo

    try:
        demo.main(rest)
    except SystemExit as e:
        return _exit_code(e)
    except KeyboardInterrupt:
        print("shoal demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the last resort: one line, never a traceback
        return _report("demo", e, debug=_debug_env())
    return EXIT_OK


def _debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _report(command: str, error: Exception, *, debug: bool) -> int:
    """Print ``error`` as one line on stderr (with its traceback when ``debug``); return exit status 2."""
    if debug:
        traceback.print_exception(error)
    if isinstance(error, EXPECTED_ERRORS):
        print(f"shoal {command}: error: {_one_line(error)}", file=sys.stderr)
    else:
        hint = "" if debug else f"; rerun with --debug (or {DEBUG_ENV}=1) to see the traceback"
        print(
            f"shoal {command}: internal error: {type(error).__name__}: {_one_line(error)} "
            f"(a bug in shoal, please report it{hint})",
            file=sys.stderr,
        )
    return EXIT_ERROR


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return EXIT_OK
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return EXIT_ERROR


@contextmanager
def _log_to_stderr(*, debug: bool) -> Iterator[None]:
    """Show shoal's log records (warnings; everything with ``--debug``) on stderr while a command runs.

    The handler goes on the ``shoal`` logger and comes off afterwards: ``main`` may run
    inside another program (or a test), whose logging it must leave as it found it.
    """
    logger = logging.getLogger("shoal")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.DEBUG if debug else logging.WARNING)
    level = logger.level
    logger.addHandler(handler)
    if debug:
        logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shoal`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status (never exits)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        return _run_demo(args_list[1:])
    try:
        args = parse_args(args_list)
    except SystemExit as e:  # --help, --version, usage errors
        return _exit_code(e)
    debug = bool(args.debug) or _debug_env()
    try:
        with _log_to_stderr(debug=debug):
            code: int = args.run(args)
        return code
    except KeyboardInterrupt:
        print(f"shoal {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # shoal ls | head
        _silence_stdout()
        return EXIT_ERROR
    except SystemExit as e:  # a library that exits: still return, as promised
        return _exit_code(e)
    except Exception as e:  # noqa: BLE001 - the last resort: one line, never a traceback
        return _report(args.command, e, debug=debug)


def _silence_stdout() -> None:
    """After the reader of stdout went away, send what is left to /dev/null so exit stays quiet."""
    stream = sys.__stdout__
    if stream is None or sys.stdout is not stream:  # running inside another program (a test): leave it be
        return
    with suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
