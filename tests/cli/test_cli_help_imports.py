"""``shoal --help`` and every subcommand's ``--help`` build the parser without importing torch or scipy.

Importing torch (with ``torch.distributed.checkpoint``) and scipy takes seconds; the parser needs
neither, so each command module imports them in the functions that run the command. Checked in
a fresh interpreter, by what is in ``sys.modules`` afterwards (never by wall time), with an import
hook that records who imported a heavy module first, so that a failure names the culprit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "scipy", "safetensors", "matplotlib")
"""Modules only a running command may need (torch and scipy: seconds to import)."""

_SCRIPT = """
import argparse, contextlib, io, json, sys, traceback

HEAVY = {heavy!r}
first = {{}}


class Spy:
    # records the import stack of the first import of each heavy module, and imports nothing itself
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in HEAVY and top not in first:
            first[top] = "".join(traceback.format_stack(limit=25)[:-1])
        return None


sys.meta_path.insert(0, Spy())

from shoal.cli.main import build_parser, main

parser = build_parser()
sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
codes = {{}}
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    codes["--help"] = main(["--help"])
    for name in sub.choices:
        codes[name] = main([name, "--help"])
print(json.dumps({{
    "commands": list(sub.choices),
    "codes": codes,
    "loaded": sorted(m for m in HEAVY if m in sys.modules),
    "first": first,
    "help": out.getvalue(),
}}))
"""


def _run() -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(heavy=HEAVY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, object] = json.loads(proc.stdout)
    return doc


def test_help_of_shoal_and_of_every_command_imports_neither_torch_nor_scipy() -> None:
    doc = _run()
    commands = doc["commands"]
    assert isinstance(commands, list)
    assert {"ls", "verify", "gc", "export", "exposure", "advise", "demo"} <= set(commands)
    assert doc["codes"] == {name: 0 for name in ["--help", *commands]}
    first = doc["first"]
    assert isinstance(first, dict)
    culprits = "\n".join(f"{name} first imported by:\n{stack}" for name, stack in first.items())
    assert doc["loaded"] == [], culprits
    assert "torch" not in first and "scipy" not in first, culprits
    text = doc["help"]
    assert isinstance(text, str)
    # the help really was printed: the demo's own options and the export's selection flags
    assert "--lose-at" in text and "--strip-prefix" in text and "--all" in text
