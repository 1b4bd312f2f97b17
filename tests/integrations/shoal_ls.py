"""What ``shoal ls`` says of a job, for the integration tests (the CLI a user would run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.cli.main import main as shoal_cli


def committed(job_url: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[int], int | None]:
    """The steps ``shoal ls`` shows committed (B4) on the shared tier, and LATEST."""
    capsys.readouterr()
    assert shoal_cli(["ls", str(job_url), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return sorted(c["step"] for c in doc["checkpoints"] if c["boundary"] == "RESTARTABLE"), doc["latest"]
