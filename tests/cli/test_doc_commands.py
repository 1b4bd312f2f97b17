"""Every ``shoal`` command line shown in README.md and docs/*.md parses with the real parser.

The lines are taken from fenced code blocks: those starting with ``shoal ``, ``$ shoal ``,
``.venv/bin/shoal `` or ``python -m shoal.cli `` (a trailing backslash continues a line).
Each is split as a POSIX shell splits it (comments dropped; a pipe, ``;``, ``&&`` or a
redirection ends the command), placeholders (``<job-dir>``, ``N``, ``...``) are replaced with
values of the right kind, and the arguments go through :func:`shoal.cli.main.parse_args` (the
parser ``shoal`` runs); ``shoal demo`` lines through the demo's own parser. argparse must accept
each one: a usage error (SystemExit 2) fails the test and names the file, the line and the
message argparse printed.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PREFIXES = ("$ ", "> ")
"""Prompts a shown command line may start with."""
COMMANDS = ("shoal", ".venv/bin/shoal", "python -m shoal.cli", "python3 -m shoal.cli")
"""How a shown command line may invoke the CLI."""
PLACEHOLDER_VALUES = {"n": "3", "step": "100", "seconds": "600", "hours": "8760", "size": "5GB"}
"""``<...>`` placeholders (by their lowercased text) that stand for a number; any other is a path."""
SKIP: dict[str, str] = {}
"""Shown command lines (exactly as extracted) that cannot be made to parse, with the reason."""

_FENCE = re.compile(r"^\s*(```|~~~)")
_PLACEHOLDER = re.compile(r"<([A-Za-z][A-Za-z0-9_ .-]*)>")
_FD_REDIRECT = re.compile(r"(?<=\s)\d+(?=[<>])")
_SHELL_OPERATOR = re.compile(r"^[();<>|&]+$")


@dataclass(frozen=True)
class Shown:
    """A ``shoal`` command line in a fenced block of a document."""

    path: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.text}"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _fenced_lines(path: Path) -> list[tuple[int, str]]:
    """The lines inside fenced code blocks, with their 1-based line numbers; continuations joined."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        m = _FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            pending = None
            continue
        if fence is None:
            continue
        if pending is not None:
            start, text = pending
            line = text + " " + line.strip()
            number = start
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        out.append((number, line))
    return out


def shown_commands() -> list[Shown]:
    found = []
    for path in DOCS:
        for number, line in _fenced_lines(path):
            text = line.strip()
            for prompt in PREFIXES:
                text = text.removeprefix(prompt)
            if any(text.startswith(command + " ") or text == command for command in COMMANDS):
                found.append(Shown(path, number, text))
    return found


def _value(placeholder: str) -> str:
    name = placeholder.strip().lower()
    for key, value in PLACEHOLDER_VALUES.items():
        if name == key or name.endswith(f"-{key}") or name.endswith(f"_{key}"):
            return value
    return f"/placeholder/{re.sub(r'[^a-z0-9]+', '-', name).strip('-') or 'x'}"


def argv_of(text: str) -> list[str]:
    """The arguments after the command, as a shell would pass them, placeholders filled in."""
    text = _PLACEHOLDER.sub(lambda m: _value(m.group(1)), text)  # before '<' and '>' mean redirection
    text = _FD_REDIRECT.sub("", text)  # `2>/dev/null`: the 2 is no argument
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    for i, token in enumerate(tokens):
        if _SHELL_OPERATOR.match(token):
            tokens = tokens[:i]
            break
    command = next(c for c in COMMANDS if text == c or text.startswith(c + " "))
    return [token for token in tokens[len(command.split()) :] if token not in ("...", "…")]


def parse(argv: list[str]) -> tuple[int, str]:
    """The exit status argparse gives ``argv`` (0 when it parses), and what it printed."""
    from shoal.cli.main import parse_args

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            if argv[:1] == ["demo"]:
                _parse_demo(argv[1:])
            else:
                parse_args(argv)
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 2), printed.getvalue()
    return 0, printed.getvalue()


def _parse_demo(rest: list[str]) -> None:
    """Parse ``shoal demo``'s arguments with its own parser, without running the demo."""
    import shoal.demo

    ran: list[object] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shoal.demo, "run", lambda *args, **kwargs: ran.append((args, kwargs)))
        shoal.demo.main(rest)
    assert len(ran) == 1


COMMAND_LINES = shown_commands()


def test_the_documents_show_command_lines() -> None:
    # a broken extractor would pass every line it did not find
    assert len(COMMAND_LINES) >= 10, [str(c) for c in COMMAND_LINES]
    assert any(c.path.name == "README.md" for c in COMMAND_LINES)
    shown = {c.text for c in COMMAND_LINES}
    stale = sorted(set(SKIP) - shown)
    assert not stale, f"SKIP lists lines no document shows any more: {stale}"


@pytest.mark.parametrize("shown", COMMAND_LINES, ids=lambda c: c.where)
def test_a_shown_command_line_parses(shown: Shown) -> None:
    if shown.text in SKIP:
        pytest.skip(SKIP[shown.text])
    argv = argv_of(shown.text)
    code, printed = parse(argv)
    assert code == 0, f"{shown}\nargparse rejects {argv}:\n{printed}"


@pytest.mark.parametrize(
    ("text", "argv"),
    [
        ("shoal ls /lustre/run/job42   # steps", ["ls", "/lustre/run/job42"]),
        ("shoal ls --shared s3://b/r --storage-options '{\"a\": 1}'", ["ls", "--shared", "s3://b/r",
                                                                    "--storage-options", '{"a": 1}']),
        ("shoal verify <job-dir> --step <N> | tail -1", ["verify", "/placeholder/job-dir", "--step", "3"]),
        ("shoal gc <path> ... --dry-run 2>/dev/null", ["gc", "/placeholder/path", "--dry-run"]),
        ("shoal export <job dir> --format dcp <out> > log", ["export", "/placeholder/job-dir", "--format",
                                                              "dcp", "/placeholder/out"]),
        (".venv/bin/shoal --help", ["--help"]),
        ("python -m shoal.cli ls x && echo ok", ["ls", "x"]),
    ],
)  # fmt: skip
def test_the_extraction_splits_as_a_shell_does(text: str, argv: list[str]) -> None:
    assert argv_of(text) == argv


def test_a_usage_error_is_caught() -> None:
    assert parse(["ls", "--step", "3"])[0] == 2  # the README's old `shoal ls --step`
    assert parse(["export", "/x/job", "--format", "dcp", "out"]) == (0, "")
    assert parse(["demo", "--steps", "5"]) == (0, "")
    assert parse(["demo", "--no-such-option"])[0] == 2


def test_continued_lines_are_joined(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n```bash\n$ shoal gc /x/job \\\n    --keep-last 2 \\\n    --dry-run\nshoal ls /x\n```\n"
    )
    assert _fenced_lines(doc) == [(3, "$ shoal gc /x/job  --keep-last 2  --dry-run"), (6, "shoal ls /x")]
