"""The README's quickstart runs as written (with its paths pointed at temporary directories)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_quickstart_runs(tmp_path, dram_root, capsys):
    quickstart = next(b for b in _python_blocks() if "shoal.Checkpointer(cfg)" in b)
    code = quickstart.replace('"/tmp/shoal-quickstart"', repr(str(tmp_path / "shared")))
    roots = f"dram={str(dram_root)!r}, local={str(tmp_path / 'local')!r}"
    code = code.replace("keep_last=3)", f"keep_last=3, {roots})")
    assert code != quickstart
    exec(compile(code, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "100" in out.splitlines()[-1]
