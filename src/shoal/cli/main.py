"""``shoal``: inspect, verify, garbage-collect and export a job's checkpoints on shared storage.

Exit status: 0 success; 1 ``verify`` found problems; 2 an error (shoal's errors and
I/O errors print one line on stderr, no traceback unless ``--debug``; bad usage);
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from shoal import __version__
from shoal.cli import export, gc, ls, verify
from shoal.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, add_location_options
from shoal.errors import ShoalError

_EPILOG = """\
Checkpoints are addressed by their job directory on shared storage, as a positional
argument (shoal ls /lustre/run/job42, shoal ls s3://bucket/run/job42) or as shoal.Config
names them (shoal ls --shared /lustre/run --job job42).

examples:
  shoal ls /lustre/run/job42
  shoal verify --shared s3://bucket/run --job job42 --storage-options '{"anon": false}'
  shoal gc /lustre/run/job42 --keep-last 3 --dry-run
  shoal export /lustre/run/job42 --format dcp ./job42-dcp
  shoal export /lustre/run/job42 --format safetensors --strip-prefix model. ./hf
"""


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    add_location_options(common)
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Inspect, verify, garbage-collect and export shoal checkpoints.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (ls, verify, gc, export):
        module.add_parser(sub, [common])
    # dispatched before parsing (its own argparse takes the rest); listed here for --help
    sub.add_parser("demo", help="run the demo (shoal demo --help for its options)", add_help=False)
    return parser


def _run_demo(rest: list[str]) -> int:
    from shoal import demo

    try:
        demo.main(rest)
    except SystemExit as e:
        return _exit_code(e)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ShoalError as e:
        print(f"shoal demo: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


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
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(args_list)
        # argparse takes each positional once: `export URL --format dcp OUT` leaves OUT over
        intermixed = getattr(args, "intermixed", None)
        if extra and intermixed and not any(x.startswith("-") for x in extra):
            getattr(args, intermixed).extend(extra)
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help, --version, usage errors
        return _exit_code(e)
    try:
        with _log_to_stderr(debug=args.debug):
            code: int = args.run(args)
        return code
    except KeyboardInterrupt:
        print("shoal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # shoal ls | head
        return EXIT_ERROR
    except (ShoalError, OSError) as e:
        if args.debug:
            traceback.print_exc()
        print(f"shoal {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
