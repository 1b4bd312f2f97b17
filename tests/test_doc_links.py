"""The repository explains itself: every link and file reference in README.md and docs/*.md resolves
inside the repository, and no tracked file sends a reader to a design file the repository does not have.

* a relative Markdown link ``[text](path)`` or ``[text](path#anchor)`` names a file of the repository,
  and its anchor a heading of that file (GitHub's slugs: lowercase, spaces to ``-``, punctuation other
  than ``-`` and ``_`` dropped, ``-1``, ``-2`` for repeated headings);
* a textual reference (``see docs/events.md``, ``(see tiers.md)``, a path in backticks such as
  ```benchmarks/stall.py```) names a file that exists;
* no tracked file mentions the old out-of-tree design file or a ``../shared/`` path.

Each failure names ``file:line``.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, s3:, ...
PATH = r"[A-Za-z0-9_][A-Za-z0-9_./-]*\.[A-Za-z0-9]{1,8}"
SEE = re.compile(rf"\bsee\s+`?(?P<path>{PATH})(?:#(?P<anchor>[A-Za-z0-9_-]+))?`?", re.IGNORECASE)
"""``see docs/events.md``, ``see `docs/events.md` ``, ``(see tiers.md)``, ``see model.md#fidelity``."""
REPO_DIRS = ("docs/", "src/", "tests/", "benchmarks/", ".ci/")
"""A backticked path starting with one of these is a repository file (``docs/cluster.md``)."""
FORBIDDEN = ("DESIGN.md", "../shared/")
"""Case-sensitive: ``docs/design.md``, the repository's own design page, never matches."""


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def resolve(source: Path, target: str) -> Path | None:
    """``target`` relative to ``source``'s folder, else to the repository root; None if neither exists."""
    for base in (source.parent, ROOT):
        candidate = (base / target).resolve()
        if candidate.exists() and candidate.is_relative_to(ROOT):
            return candidate
    return None


def check_anchor(where: str, file: Path, anchor: str, shown: str) -> list[str]:
    if file.suffix != ".md" or anchor in anchors(file):
        return []
    return [f"{where}: {shown}: {rel(file)} has no heading with the anchor #{anchor}"]


def link_problems(path: Path) -> list[str]:
    problems: list[str] = []
    for n, line in prose_lines(path):
        where = f"{rel(path)}:{n}"
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1)
            if EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            if not file_part:
                problems += check_anchor(where, path, anchor, f"link ({target})")
                continue
            file = (path.parent / file_part).resolve()
            if not file.exists() or not file.is_relative_to(ROOT):
                problems.append(f"{where}: link ({target}): {file_part} is not a file of the repository")
            elif anchor:
                problems += check_anchor(where, file, anchor, f"link ({target})")
    return problems


def reference_problems(path: Path) -> list[str]:
    problems: list[str] = []
    for n, line in prose_lines(path):
        where = f"{rel(path)}:{n}"
        for m in SEE.finditer(line):
            target = m.group("path").rstrip(".")
            file = resolve(path, target)
            if file is None:
                problems.append(f"{where}: 'see {target}': no such file in the repository")
            elif m.group("anchor"):
                problems += check_anchor(where, file, m.group("anchor"), f"'see {target}'")
        for m in INLINE_CODE.finditer(line):
            text = m.group(2).strip()
            if text.startswith(REPO_DIRS) and re.fullmatch(PATH + "/?", text) and resolve(path, text) is None:
                problems.append(f"{where}: `{text}`: no such file in the repository")
    return problems


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_every_relative_link_names_a_file_and_heading_that_exist(doc: Path) -> None:
    problems = link_problems(doc)
    assert not problems, "links that lead nowhere:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_every_textual_file_reference_resolves(doc: Path) -> None:
    problems = reference_problems(doc)
    assert not problems, "references to files the repository does not have:\n" + "\n".join(problems)


def tracked_files() -> list[Path]:
    """The repository's files: tracked, plus new ones git does not ignore."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): no list of tracked files")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_file_mentions_a_design_file_outside_the_repository() -> None:
    problems: list[str] = []
    for path in tracked_files():
        if path.resolve() == THIS or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        if not any(word in text for word in FORBIDDEN):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for word in FORBIDDEN:
                if word in line:
                    problems.append(f"{rel(path)}:{n}: mentions {word!r}: {line.strip()[:100]}")
    assert not problems, (
        "files that send a reader outside the repository (write docs/design.md#<section> instead):\n"
        + "\n".join(problems)
    )


def test_the_slugs_are_githubs() -> None:
    assert slug("7. The completion-time model and `auto`") == "7-the-completion-time-model-and-auto"
    assert slug("`path` and `path_observed`: every path decision, auditable") == (
        "path-and-path_observed-every-path-decision-auditable"
    )
    assert slug("The emulated cluster's S3 server") == "the-emulated-clusters-s3-server"
