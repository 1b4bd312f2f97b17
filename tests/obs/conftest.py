"""One 4-rank, 2-host run (several saves, then a load) shared by the timeline and report tests."""

from __future__ import annotations

import pytest

from shoal.records.events import read_events
from shoal.testing.multiproc import run_ranks
from shoal.testing.obs_scenarios import saves_then_load

from .obs_run import HOSTS, SAVES, Run


@pytest.fixture(scope="session")
def obs_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("obs-run")
    results = run_ranks(saves_then_load, hosts=HOSTS, kwargs={"root": str(root), "saves": SAVES}, timeout=240)
    logs = {r["host"]: r["events"] for r in results}
    assert sorted(logs) == ["h0", "h1"]
    events = {h: read_events(p) for h, p in logs.items()}
    return Run(root, root / "local", root / "shared" / "test", logs, events)
