"""docs/tiers.md runs as written: its tier module, the registration example, and its conformance subclass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "tiers.md"


def _blocks() -> tuple[dict[str, str], list[str]]:
    """The doc's python blocks: those naming a file (``# file: x.py``) by name, then the others."""
    files: dict[str, str] = {}
    scripts: list[str] = []
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        first, _, rest = block.partition("\n")
        if first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = rest
        else:
            scripts.append(block)
    return files, scripts


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_tier_docs_examples_run(tmp_path: Path) -> None:
    files, scripts = _blocks()
    assert sorted(files) == ["scratch_tier.py", "test_scratch_tier.py"]
    assert len(scripts) == 1
    for name, text in files.items():
        (tmp_path / name).write_text(text)

    script = _run([sys.executable, "-c", scripts[0]], tmp_path)
    assert script.returncode == 0, script.stdout + script.stderr
    assert "ScratchTier(" in script.stdout

    suite = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_scratch_tier.py"], tmp_path
    )
    out = suite.stdout + suite.stderr
    assert suite.returncode == 0, out
    passed = re.search(r"(\d+) passed", out)
    assert passed is not None and int(passed.group(1)) >= 30, out  # the whole suite ran, not a few tests
    assert "failed" not in out and "error" not in out.lower()
