"""``shoal report``: a self-contained page whose charts are drawn and whose numbers are the records,
checked in a real headless Chromium (skipped, saying why, where Chromium or selenium is missing)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.boundary import Boundary
from shoal.cli.main import main
from shoal.obs.report import CHARTS, collect, render
from shoal.obs.runlogs import load_run
from shoal.records.events import CheckpointRecord, WriterRecord

from .obs_run import SAVES, Run

pytestmark = pytest.mark.timeout(240)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def report(obs_run: Run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "report.html"
    assert main(["report", "test", "--local", str(obs_run.local), "-o", str(out)]) == 0
    return out


def test_the_page_is_self_contained_with_every_chart(report: Path) -> None:
    html = report.read_text()
    assert html.startswith("<!DOCTYPE html>")
    refs = re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]+)""", html, flags=re.I)
    assert refs == [], refs  # nothing fetched: no script, style sheet, image or font from elsewhere
    assert not re.search(r"https?://", html.replace("chrome://tracing", ""))
    assert "<script" not in html.lower() and "<link" not in html.lower()
    for name in CHARTS:
        block = re.search(rf'<svg data-chart="{name}"[^>]*>\s*<title>([^<]+)</title>', html)
        assert block and block.group(1).strip(), name
        assert 'class="no-data"' not in html.split(f'data-chart="{name}"', 1)[1].split("</svg>", 1)[0], name
    for step in range(1, SAVES + 1):
        assert f'<tr data-step="{step}">' in html


def _record(run: Run, step: int) -> CheckpointRecord:
    return next(
        e for e in run.events["h0"] if isinstance(e, CheckpointRecord) and e.rank == 0 and e.step == step
    )


def _planned(run: Run, step: int) -> Any:
    return next(e for e in run.events["h0"] if e.event == "planned" and e.step == step)


def test_the_tables_hold_each_checkpoints_records(report: Path, obs_run: Run) -> None:
    html = report.read_text()
    for step in range(1, SAVES + 1):
        row = re.search(rf'<tr data-step="{step}">(.*?)</tr>', html).group(1)  # type: ignore[union-attr]
        cells = dict(re.findall(r'<td data-field="([^"]+)"[^>]*>([^<]*)</td>', row))
        rec = _record(obs_run, step)
        for b in Boundary:
            assert cells[b.name] == f"{rec.boundaries[b.name] * 1000:.1f}", (step, b)
        staged = sum(e.bytes for e in obs_run.every() if isinstance(e, CheckpointRecord) and e.step == step)
        assert cells["staged_bytes"] == f"{staged:,}"
        planned = _planned(obs_run, step)
        assert cells["dedup_bytes"] == f"{planned['logical_bytes'] - planned['new_bytes']:,}"
        packs = sum(e.bytes for e in obs_run.every() if isinstance(e, WriterRecord) and e.step == step
                    and e.what == "pack")  # fmt: skip
        assert cells["written:shared drain packs"] == f"{packs:,}"


def _bare_log(path: Path) -> Path:
    """Saves with boundary times only (no writes, plans, predictions or partner copies); 30 skipped."""

    def line(event: str, step: int | None, mono: float, **fields: Any) -> str:
        base = {
            "v": 1,
            "t": 1.0e9 + mono,
            "mono": mono,
            "event": event,
            "step": step,
            "host": "h0",
            "rank": 0,
        }
        return json.dumps({**base, **fields})

    def done(step: int, mono: float, boundaries: dict[str, float]) -> str:
        return line("checkpoint", step, mono, durability_path="direct", boundaries=boundaries,
                    reached="RESTARTABLE", failed_at=None, error=None, bytes=100, end=mono)  # fmt: skip

    every = {"STAGED": 1.0, "REPLICATED": 2.0, "PERSISTED": 2.0, "RESTARTABLE": 2.5}
    lines = [
        line("opened", None, 100.0, start=100.0),
        line("save_called", 10, 110.0, called=110.0),
        done(10, 112.5, every),
        line("save_called", 30, 260.0, called=260.0),
        line("skipped", 30, 260.1, in_flight=[]),
        line("save_called", 40, 310.0, called=310.0),
        done(40, 312.5, every),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_empty_data_says_no_data_rather_than_breaking(tmp_path: Path) -> None:
    html = render(collect(load_run([str(_bare_log(tmp_path / "events.jsonl"))])))
    for name in ("b2_prediction", "bytes_per_tier", "dedup", "link_use"):
        chart = html.split(f'data-chart="{name}"', 1)[1].split("</svg>", 1)[0]
        assert 'class="no-data"' in chart, name
    for name in ("boundaries", "exposure"):
        assert 'class="no-data"' not in html.split(f'data-chart="{name}"', 1)[1].split("</svg>", 1)[0]
    assert '<tr data-step="40">' in html and '<tr data-step="30">' not in html  # 30 was skipped


def test_a_run_without_the_coordinators_log_is_refused(
    obs_run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["report", "--events", obs_run.logs["h1"], "-o", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert code == 2 and "no events of rank 0" in err, err


# -- in a real browser --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install selenium)"
    )
    for exe in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)) and not shutil.which(os.path.basename(exe)):
            pytest.skip(f"{exe} is missing (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
                 "--window-size=1280,1000"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def test_in_chromium_every_chart_is_drawn_and_shows_the_records(
    browser: Any, report: Path, obs_run: Run
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(report.as_uri())
    severe = [entry for entry in browser.get_log("browser") if entry.get("level") == "SEVERE"]
    assert severe == []
    charts = {
        c.get_attribute("data-chart"): c for c in browser.find_elements(By.CSS_SELECTOR, "svg[data-chart]")
    }
    assert sorted(charts) == sorted(CHARTS)
    for name, chart in charts.items():
        assert chart.size["width"] > 100 and chart.size["height"] > 100, name
        marks = chart.find_elements(By.CSS_SELECTOR, "polyline.series, circle, rect.bar, rect.band")
        assert marks, f"chart {name} drew nothing"
        assert not chart.find_elements(By.CSS_SELECTOR, ".no-data"), name
    step = SAVES  # the last checkpoint, which the model's prediction chose
    row = browser.find_element(By.CSS_SELECTOR, f'table[data-table="checkpoints"] tr[data-step="{step}"]')
    shown = {td.get_attribute("data-field"): td.text for td in row.find_elements(By.TAG_NAME, "td")}
    rec = _record(obs_run, step)
    for b in Boundary:
        assert float(shown[b.name]) == pytest.approx(rec.boundaries[b.name] * 1000, abs=0.051), b
    staged = sum(e.bytes for e in obs_run.every() if isinstance(e, CheckpointRecord) and e.step == step)
    assert int(shown["staged_bytes"].replace(",", "")) == staged
    planned = _planned(obs_run, step)
    assert int(shown["dedup_bytes"].replace(",", "")) == planned["dedup_bytes"] > 0
    # the boundary chart's marks of that checkpoint say the same seconds on hover
    tips = [t.get_attribute("textContent") for t in charts["boundaries"].find_elements(By.TAG_NAME, "title")]
    b1 = rec.boundaries["STAGED"]
    tip = next(t for t in tips if t.startswith(f"step {step}: B1 STAGED after "))
    value, unit = tip.rsplit(" ", 2)[-2:]
    scale = {"ms": 1e-3, "s": 1.0, "min": 60.0}[unit]  # the axis's unit: ms when every time is under 1 s
    assert float(value) * scale == pytest.approx(b1, rel=1e-3), tip
    path_row = browser.find_element(By.CSS_SELECTOR, f'table[data-table="paths"] tr[data-step="{step}"]')
    decision = next(e for e in obs_run.events["h0"] if e.event == "path" and e.rank == 0 and e.step == step)
    assert decision["reason"] in path_row.text


def _kv_run(shm_path: Path, tmp_path: Path) -> tuple[Path, Any]:
    """A KV store followed by a KVRecorder: three rounds of lookups, hitting more each round."""
    from shoal.kv import KVConfig, KVStore, chain_keys
    from shoal.kv.pool import physical_bytes
    from shoal.obs.kvlog import KVRecorder
    from shoal.records.events import EventLog

    block = 16 << 10
    log = tmp_path / "kv" / "events.jsonl"
    log.parent.mkdir()
    keys = chain_keys("test-model/bf16", 0, ["seq", *range(7)])
    cfg = KVConfig(str(shm_path / "pool"), 16 * physical_bytes(block), local_root=str(tmp_path / "l"))
    with KVStore(cfg) as store:
        recorder = KVRecorder(store, EventLog(str(log), host="h0"), every=1e-6)
        bufs = [bytearray(block) for _ in keys]
        for held in (2, 4, 8):  # the first `held` keys are in the store: 2, 4, then 8 hits of 8
            store.put_batch(keys[:held], [bytes([i]) * block for i in range(held)])
            store.get_batch_into(keys, bufs)
        recorder.close()
        stats = store.stats()
    return log, stats


def test_a_kv_stores_records_become_its_hit_ratio_per_tier_over_time(shm_path, tmp_path, browser) -> None:
    from selenium.webdriver.common.by import By

    from shoal.obs.report import KV_CHARTS

    log, stats = _kv_run(shm_path, tmp_path)
    out = tmp_path / "kv.html"
    assert main(["report", "--events", str(log), "-o", str(out)]) == 0
    html = out.read_text()
    assert 'data-checkpoints="none"' in html  # no checkpoint charts for a KV store's log
    browser.get(out.as_uri())
    assert [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"] == []
    charts = {
        c.get_attribute("data-chart"): c for c in browser.find_elements(By.CSS_SELECTOR, "svg[data-chart]")
    }
    assert sorted(charts) == sorted(KV_CHARTS)
    tips = [
        t.get_attribute("textContent")
        for t in charts["kv_hits"].find_elements(By.CSS_SELECTOR, "circle title")
    ]
    assert [t for t in tips if t.startswith("dram:")] == [
        "dram: 2 of 8 blocks (25.0%)",
        "dram: 4 of 8 blocks (50.0%)",
        "dram: 8 of 8 blocks (100.0%)",
    ]
    for tier, s in stats.tiers.items():  # the table holds the store's own counters at the end
        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-tier="{tier}"]')
        cells = {
            td.get_attribute("data-field"): td.get_attribute("data-value")
            for td in row.find_elements(By.TAG_NAME, "td")
        }
        assert int(cells["hits"]) == s.hits and int(cells["misses"]) == s.misses, tier
