"""docs/observability.md's timeline and report examples run as written, in order (the report's
continues the timeline's). The Metrics section's examples run in test_metrics.py."""

from __future__ import annotations

import pathlib
import re
import tempfile

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "observability.md"
VIEWS = DOC.read_text().split("\n## Reading a run's logs", 1)[1]
BLOCKS = re.findall(r"```python\n(.*?)```", VIEWS, re.S)


def test_the_page_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.timeout(120)
def test_the_examples_run_and_print_what_they_say(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' mkdtemp lands here
    namespace: dict[str, object] = {}
    for i, block in enumerate(BLOCKS):
        exec(compile(block, f"{DOC}:block{i}", "exec"), namespace)
        out = capsys.readouterr().out
        for comment in re.findall(r"print\(.*\)\s+# (.*)", block):
            assert comment.strip() in out, (i, comment, out)
        assert out.strip(), f"block {i} printed nothing"
