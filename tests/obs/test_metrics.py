"""Prometheus metrics from the event records: scraped over HTTP during a 4-rank, 2-host job and held
against that job's records; observe() on hand-written records; off by default; the KV store's."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import shoal
from shoal.config import ENV_METRICS_PORT, Config
from shoal.errors import ConfigError
from shoal.kv import KVConfig, KVStore, chain_keys
from shoal.kv.pool import BLOCKS_DIR, physical_bytes
from shoal.obs.metrics import LogTail, Metrics
from shoal.records.events import EventLog, monotonic, read_events
from shoal.testing.metrics_scenarios import scraped_saves
from shoal.testing.multiproc import run_ranks

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of a scrape, parsed by prometheus_client's own parser: (name, labels) -> value."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: Samples, name: str, **labels: str) -> float | None:
    return got.get((name, frozenset(labels.items())))


def named(got: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in got.items() if n == name}


def scrape(metrics: Metrics) -> Samples:
    return samples(generate_latest(metrics.registry).decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def approx(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b))


# -- the endpoint of a 4-rank, 2-host job, against its records ---------------------------------


def expected_from(records: Iterable[Any]) -> dict[str, Any]:
    """What the host's endpoint must say, computed from its event log alone."""
    written: dict[tuple[str, str, str], int] = defaultdict(int)
    stall: dict[str, list[float]] = defaultdict(list)
    boundary: dict[tuple[str, str], list[float]] = defaultdict(list)
    staged = within = reused = committed = 0
    restore: list[float] = []
    restore_bytes: dict[str, int] = defaultdict(int)
    observed: dict[str, float] = {}
    exposure: dict[str, Any] = {}
    called: dict[int, float] = {}
    start = None
    for r in records:
        path = r.get("durability_path") or "none"
        if r.event == "write":
            written[(r["tier"], r["what"], path)] += r["bytes"]
        elif r.event == "checkpoint":
            stall[path].append(r["boundaries"]["STAGED"])
            for name, seconds in r["boundaries"].items():
                boundary[(name, path)].append(seconds)
            staged += r["bytes"]
            committed += r.rank == 0 and r["reached"] == "RESTARTABLE"
        elif r.event == "planned":
            within += r["logical_bytes"] - r["unique_bytes"]
            reused += r["reused_bytes"]
        elif r.event == "loaded":
            restore.append(r["seconds"])
            if r.rank == 0:
                for tier, n in r["bytes_by_tier"].items():
                    restore_bytes[tier] += n
        elif r.event == "path_observed":
            observed[r["path"]] = r["b2"]
        elif r.event == "opened" and r.rank == 0:
            start = r["start"]
        elif r.event == "save_called" and r.rank == 0:
            called[r.step] = r["called"]
        elif r.event == "exposure":
            for name, c in r["classes"].items():
                p = c["protected_step"]
                exposure[name] = start if p is None else called[p]  # when the training at risk began
    return {
        "written": written,
        "stall": stall,
        "boundary": boundary,
        "staged": staged,
        "within": within,
        "reused": reused,
        "committed": committed,
        "restore": restore,
        "restore_bytes": restore_bytes,
        "observed": observed,
        "exposure_origin": exposure,
    }


@pytest.mark.timeout(240)
def test_each_hosts_endpoint_says_what_its_event_records_say(tmp_path: Path) -> None:
    hosts = ["h0", "h0", "h1", "h1"]
    results = run_ranks(scraped_saves, hosts=hosts, kwargs={"root": str(tmp_path)}, timeout=200)
    servers = [r for r in results if r["serves"]]
    assert [r["rank"] for r in servers] == [0, 2]  # each host's first rank, no other
    for out in servers:
        host = out["host"]
        assert out["content_type"].startswith("text/plain")
        got = samples(out["text"])
        records = read_events(out["log"])
        assert {r.rank for r in records} == {i for i, h in enumerate(hosts) if h == host}
        want = expected_from(records)
        at = f"host {host}"

        # bytes written, per tier, kind and path: the write records' sums
        assert want["written"], at
        assert {
            (dict(k)["tier"], dict(k)["what"], dict(k)["path"]): v
            for k, v in named(got, "shoal_written_bytes_total").items()
        } == want["written"], at
        assert {k[2] for k in want["written"]} == {"partner", "direct"}, at

        # the stall: one observation per rank and save, its sum the records' B1 seconds
        assert sum(len(v) for v in want["stall"].values()) == 2 * 2, at  # 2 saves x 2 ranks of the host
        for path, seconds in want["stall"].items():
            assert value(got, "shoal_save_stall_seconds_count", path=path) == len(seconds), at
            assert approx(value(got, "shoal_save_stall_seconds_sum", path=path), sum(seconds)), at
            le_inf = value(got, "shoal_save_stall_seconds_bucket", path=path, le="+Inf")
            assert le_inf == len(seconds), at
        # every boundary of every checkpoint record
        assert len(want["boundary"]) == 8, at  # 4 boundaries x 2 paths
        for (name, path), seconds in want["boundary"].items():
            assert value(got, "shoal_boundary_seconds_count", boundary=name, path=path) == len(seconds)
            assert approx(value(got, "shoal_boundary_seconds_sum", boundary=name, path=path), sum(seconds))
        assert value(got, "shoal_staged_bytes_total") == want["staged"] > 0, at

        # restore: every rank's load seconds; bytes per tier from the coordinator's record
        assert len(want["restore"]) == 2, at
        assert value(got, "shoal_restore_seconds_count") == 2, at
        assert approx(value(got, "shoal_restore_seconds_sum"), sum(want["restore"])), at

        if host == "h0":  # the coordinator's numbers: the job's
            assert value(got, "shoal_checkpoints_total", outcome="committed") == want["committed"] == 2
            # (DCP's planner already stages a replicated item once: "within" is 0 here)
            assert value(got, "shoal_dedup_bytes_total", kind="within") == want["within"]
            assert value(got, "shoal_dedup_bytes_total", kind="reused") == want["reused"] > 0
            assert {dict(k)["tier"]: v for k, v in named(got, "shoal_restore_bytes_total").items()} == (
                want["restore_bytes"]
            )
            assert sum(want["restore_bytes"].values()) > 0
            assert set(want["observed"]) == {"partner", "direct"}
            for path, b2 in want["observed"].items():
                assert value(got, "shoal_observed_b2_seconds", path=path) == b2
            origins = want["exposure_origin"]
            assert set(origins) == {"process", "host", "cluster"}
            for name, origin in origins.items():
                v = value(got, "shoal_exposure_seconds", failure_class=name)
                assert v is not None and out["before"] - origin - 1e-6 <= v <= out["after"] - origin + 1e-6
        else:  # no coordinator records on h1: none of the job's own numbers
            for name in ("shoal_checkpoints_total", "shoal_dedup_bytes_total", "shoal_exposure_seconds"):
                assert named(got, name) == {}, (host, name)


# -- observe() on hand-written records ---------------------------------------------------------


def rec(event: str, step: int | None = 1, rank: int = 0, **fields: Any) -> dict[str, Any]:
    common = {"v": 1, "t": 1.0, "mono": 100.0, "event": event, "step": step, "host": "h0", "rank": rank}
    return {**common, **fields}


def test_observe_maps_each_record_to_its_metric() -> None:
    m = Metrics()
    boundaries = {"STAGED": 0.5, "REPLICATED": 1.0, "PERSISTED": 2.0, "RESTARTABLE": 2.5}
    for rank in (0, 1):
        m.observe(rec("checkpoint", rank=rank, durability_path="partner", boundaries=boundaries,
                      reached="RESTARTABLE", failed_at=None, error=None, bytes=1000, end=1.0))  # fmt: skip
    m.observe(rec("checkpoint", step=2, durability_path=None, boundaries={"STAGED": 0.25}, reached="STAGED",
                  failed_at="REPLICATED", error="x", bytes=10, end=1.0))  # fmt: skip
    m.observe(rec("write", tier="shared", what="pack", bytes=700, durability_path="direct"))
    m.observe(rec("write", tier="shared", what="pack", bytes=300, durability_path="direct"))
    m.observe(rec("write", tier="local", what="replica", bytes=50, durability_path="partner"))
    m.observe(rec("planned", logical_bytes=1000, unique_bytes=600, reused_bytes=200, new_bytes=400))
    m.observe(rec("skipped", step=3, in_flight=[1]))
    m.observe(rec("skipped", step=3, rank=1, in_flight=[1]))  # the same skip on another rank: counted once
    m.observe(rec("path", path="direct", reason="model",
                  predictions={"partner": {"seconds": 4.0}, "direct": {"seconds": 3.0}}))  # fmt: skip
    m.observe(rec("path_observed", path="direct", predicted=None, pre=0.1, b2=3.5, b3=3.5))
    m.observe(rec("loaded", seconds=1.5, bytes_by_tier={"dram": 10, "shared": 5}))
    m.observe(rec("loaded", rank=1, seconds=0.5, bytes_by_tier={"dram": 10, "shared": 5}))
    m.observe(rec("no_such_event", anything=1))  # ignored
    got = scrape(m)
    assert value(got, "shoal_save_stall_seconds_count", path="partner") == 2
    assert value(got, "shoal_save_stall_seconds_sum", path="partner") == 1.0
    assert value(got, "shoal_save_stall_seconds_count", path="none") == 1  # failed before the path
    assert value(got, "shoal_boundary_seconds_sum", boundary="RESTARTABLE", path="partner") == 5.0
    assert value(got, "shoal_boundary_seconds_bucket", boundary="PERSISTED", path="partner", le="1.0") == 0
    assert value(got, "shoal_boundary_seconds_bucket", boundary="PERSISTED", path="partner", le="2.5") == 2
    assert value(got, "shoal_written_bytes_total", tier="shared", what="pack", path="direct") == 1000
    assert value(got, "shoal_written_bytes_total", tier="local", what="replica", path="partner") == 50
    assert value(got, "shoal_staged_bytes_total") == 2010
    assert value(got, "shoal_dedup_bytes_total", kind="within") == 400
    assert value(got, "shoal_dedup_bytes_total", kind="reused") == 200
    assert value(got, "shoal_checkpoints_total", outcome="committed") == 1  # rank 0's record only
    assert value(got, "shoal_checkpoints_total", outcome="failed") == 1
    assert value(got, "shoal_checkpoints_total", outcome="skipped") == 1
    assert value(got, "shoal_predicted_b2_seconds", path="partner") == 4.0
    assert value(got, "shoal_predicted_b2_seconds", path="direct") == 3.0
    assert value(got, "shoal_observed_b2_seconds", path="direct") == 3.5
    assert value(got, "shoal_restore_seconds_count") == 2 and value(got, "shoal_restore_seconds_sum") == 2.0
    assert value(got, "shoal_restore_bytes_total", tier="dram") == 10  # the job's totals, once
    # a rule's decision predicts nothing: the last prediction does not linger
    m.observe(rec("path", step=2, path="partner", reason="rule", predictions=None))
    assert named(scrape(m), "shoal_predicted_b2_seconds") == {}


def test_the_exposure_gauge_grows_from_the_protecting_save_call() -> None:
    m = Metrics()
    t0 = monotonic()
    m.observe(rec("opened", None, run="r", world_size=1, start=t0 - 100.0))
    got = scrape(m)
    for name in ("process", "host", "cluster"):  # nothing protects anything yet: since the start
        assert 100.0 <= value(got, "shoal_exposure_seconds", failure_class=name) < 100.0 + 60  # type: ignore[operator]
    m.observe(rec("save_called", 7, items=1, called=t0 - 10.0))
    classes = {
        "process": {"seconds": 0.5, "protected_step": 7},
        "host": {"seconds": 10.5, "protected_step": None},  # not the record's: from the start
        "cluster": {"seconds": 3.0, "protected_step": 5},  # a save call it never saw: the record's
    }
    m.observe({**rec("exposure", 7, boundary="STAGED", seconds=0.5, classes=classes), "mono": t0 - 9.5})
    before = monotonic()
    got = scrape(m)
    after = monotonic()
    for name, origin in (("process", t0 - 10.0), ("host", t0 - 100.0), ("cluster", t0 - 9.5 - 3.0)):
        v = value(got, "shoal_exposure_seconds", failure_class=name)
        assert v is not None and before - origin <= v <= after - origin, name
    # another rank's exposure record (there is none in practice) changes nothing
    other = rec("exposure", 8, rank=1, boundary="STAGED", seconds=0.1, classes={"process": {"seconds": 0.0}})
    m.observe(other)
    v = value(scrape(m), "shoal_exposure_seconds", failure_class="process")
    assert v is not None and v >= before - (t0 - 10.0)


def test_a_record_it_cannot_read_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()
    with caplog.at_level(logging.WARNING, logger="shoal.obs.metrics"):
        m.observe(rec("write", tier="shared", what="pack", bytes="many", durability_path=None))
        m.observe(rec("checkpoint", durability_path="direct", boundaries={"STAGED": "soon"}, bytes=-1))
        m.observe(["not", "a", "record"])  # type: ignore[arg-type]
    got = scrape(m)
    assert named(got, "shoal_written_bytes_total") == {}
    assert named(got, "shoal_save_stall_seconds_count") == {}
    assert value(got, "shoal_staged_bytes_total") == 0
    assert "not', 'a', 'record" in caplog.text


def test_a_raising_listener_is_logged_and_the_log_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "events.jsonl")
    events = EventLog(path, host="h0", rank=0)
    seen: list[dict[str, Any]] = []

    def broken(record: dict[str, Any]) -> None:
        raise RuntimeError("a listener's bug")

    events.add_listener(broken)
    events.add_listener(seen.append)
    with caplog.at_level(logging.DEBUG, logger="shoal.records.events"):
        events.emit("staged", 1, bytes=10, wait_seconds=0.0)
        events.emit("staged", 2, bytes=20, wait_seconds=0.0)
    assert [r["step"] for r in seen] == [1, 2]  # the next listener still ran, each time
    assert [e.step for e in read_events(path)] == [1, 2]  # and the records were written
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "a listener's bug" in caplog.text  # once with its traceback
    events.remove_listener(broken)
    events.remove_listener(seen.append)
    events.emit("staged", 3, bytes=30, wait_seconds=0.0)
    assert len(seen) == 2 and events.listeners == ()
    with pytest.raises(shoal.ShoalError, match="callable"):
        events.add_listener("not a function")  # type: ignore[arg-type]


def test_metrics_listening_to_a_checkpointer_and_a_broken_listener_do_not_stop_saves(
    tmp_path: Path, dram_root: Path
) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    cfg = Config(shared=str(tmp_path / "shared"), local=str(tmp_path / "local"), dram=str(dram_root), job="j")
    with shoal.Checkpointer(cfg) as ckpt:
        ckpt.runtime.events.add_listener(metrics.observe)
        ckpt.runtime.events.add_listener(lambda record: 1 / 0)
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait(shoal.Boundary.RESTARTABLE, 60)
        ckpt.wait()
        records = read_events(ckpt.config.event_log or "")
    got = samples(generate_latest(registry).decode())
    packs = sum(r["bytes"] for r in records if r.event == "write" and r["what"] == "pack")
    assert value(got, "shoal_written_bytes_total", tier="shared", what="pack", path="direct") == packs > 0
    assert value(got, "shoal_checkpoints_total", outcome="committed") == 2
    with pytest.raises(ConfigError, match="cannot register"):
        Metrics(registry)  # the names are taken


# -- serving: opt-in, the environment, off by default -------------------------------------------


def test_the_port_comes_from_the_field_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_METRICS_PORT, raising=False)
    assert Config(shared="/s").resolved().metrics_port is None
    monkeypatch.setenv(ENV_METRICS_PORT, "9464")
    assert Config(shared="/s").resolved().metrics_port == 9464
    assert Config(shared="/s", metrics_port=9000).resolved().metrics_port == 9000  # the field wins
    monkeypatch.setenv(ENV_METRICS_PORT, "http")
    with pytest.raises(ConfigError, match=ENV_METRICS_PORT):
        Config(shared="/s").resolved()
    for bad in (-1, 65536, True, "9464", 1.5):
        with pytest.raises(ConfigError, match="Config.metrics_port"):
            Config(shared="/s", metrics_port=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Config.metrics_addr"):
        Config(shared="/s", metrics_addr=None)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_the_environment_variable_opens_the_endpoint_until_close(
    tmp_path: Path, dram_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv(ENV_METRICS_PORT, str(port))
    cfg = Config(
        shared=str(tmp_path / "shared"),
        local=str(tmp_path / "local"),
        dram=str(dram_root),
        job="j",
        metrics_addr="127.0.0.1",
    )
    url = f"http://127.0.0.1:{port}/metrics"
    with shoal.Checkpointer(cfg) as ckpt:
        assert ckpt.runtime.metrics_server is not None and ckpt.runtime.metrics_server.port == port
        ckpt.save(1, {"w": torch.ones(1000)}).wait(shoal.Boundary.RESTARTABLE, 60)
        ckpt.wait()
        with urllib.request.urlopen(url, timeout=30) as reply:
            got = samples(reply.read().decode())
        records = read_events(ckpt.config.event_log or "", kinds=["checkpoint"])
        assert value(got, "shoal_save_stall_seconds_sum", path="direct") == records[0]["boundaries"]["STAGED"]
        # a second process of the host cannot take the port: it goes on without metrics
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)  # closed with the Checkpointer


def test_a_port_taken_is_logged_and_the_job_goes_on(
    tmp_path: Path, dram_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = Config(shared=str(tmp_path / "s"), local=str(tmp_path / "l"), dram=str(dram_root),
                     metrics_port=port, metrics_addr="127.0.0.1")  # fmt: skip
        with caplog.at_level(logging.ERROR, logger="shoal.engine.runtime"), shoal.Checkpointer(cfg) as ckpt:
            assert ckpt.runtime.metrics_server is None
            ckpt.save(1, {"w": torch.ones(10)}).wait(shoal.Boundary.RESTARTABLE, 60)
    assert f"127.0.0.1:{port}" in caplog.text and "Config.metrics_port" in caplog.text


OFF = """
import os, sys, torch, shoal
cfg = shoal.Config(shared={shared!r}, local={local!r}, dram={dram!r}, job="j")
with shoal.Checkpointer(cfg) as ckpt:
    ckpt.save(1, {{"w": torch.ones(10)}}).wait(shoal.Boundary.RESTARTABLE, 60)
    off = (ckpt.config.metrics_port, ckpt.runtime.metrics_server, ckpt.runtime.events.listeners)
import shoal.cli.main, shoal.kv, shoal.dcp, shoal.obs.metrics
print(repr(off), ",".join(sorted(m for m in sys.modules if m.split(".")[0] == "prometheus_client")))
"""


@pytest.mark.timeout(120)
def test_metrics_are_off_by_default_and_import_nothing(tmp_path: Path, dram_root: Path) -> None:
    code = OFF.format(shared=str(tmp_path / "s"), local=str(tmp_path / "l"), dram=str(dram_root))
    env = {k: v for k, v in os.environ.items() if k != ENV_METRICS_PORT}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "(None, None, ())", done.stdout


# -- following a host's log ---------------------------------------------------------------------


def test_the_tail_reads_every_record_once_across_rotations_and_torn_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    writer = EventLog(path, host="h0", rank=0, max_bytes=1500)
    writer.emit("before", 0)  # written before the tail was made: not its business
    tail = LogTail(path)
    other = EventLog(path, host="h0", rank=1, max_bytes=1500)  # a second process of the host
    seen: list[tuple[int, int]] = []
    for i in range(1, 41):
        (writer if i % 2 else other).emit("tick", i, pad="x" * 40)
        if i % 7 == 0:  # reads in between; by the end the log rotated several times
            seen += [(r["rank"], r["step"]) for r in tail.read()]
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "event": "half-wri')  # a process died mid-line
    writer2 = EventLog(path, host="h0", rank=0, max_bytes=1 << 20)
    writer2.emit("tick", 41)  # closes the torn line and says so (a `torn` marker)
    seen += [(r["rank"], r["step"]) for r in tail.read()]
    assert os.path.exists(path + ".1")
    assert [s for _, s in seen] == list(range(1, 42))
    assert [r for r, _ in seen[:4]] == [0, 1, 0, 1]
    future = {"v": 99, "event": "tick", "step": 42, "host": "h0", "rank": 0, "t": 0, "mono": 0}
    with open(path, "a") as f:
        f.write(json.dumps(future) + "\n")
    assert tail.read() == []  # a newer shoal's record: skipped
    tail.close()


def test_metrics_from_a_log_file_see_what_was_appended_at_each_scrape(tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    writer = EventLog(path, host="h0", rank=3)
    writer.emit("write", 1, tier="shared", what="pack", bytes=5, durability_path="direct")
    m = Metrics(log_path=path)  # from the end of the log as it is now
    writer.emit("write", 2, tier="shared", what="pack", bytes=7, durability_path="direct")
    assert value(scrape(m), "shoal_written_bytes_total", tier="shared", what="pack", path="direct") == 7
    writer.emit("write", 3, tier="shared", what="pack", bytes=11, durability_path="direct")
    assert value(scrape(m), "shoal_written_bytes_total", tier="shared", what="pack", path="direct") == 18
    m.close()


# -- the KV store --------------------------------------------------------------------------------

BLOCK = 16 << 10


def kv_keys(n: int) -> list[Any]:
    return chain_keys("test-model/bf16", 0, ["seq"] + list(range(n - 1)))


def test_kv_hits_misses_corrupt_and_fetch_times_per_tier(shm_path: Path, tmp_path: Path) -> None:
    m = Metrics()
    cfg = KVConfig(str(shm_path / "pool"), 8 * physical_bytes(BLOCK), local_root=str(tmp_path / "l"))
    ks = kv_keys(4)
    with KVStore(cfg) as store:
        m.bind_kv(store)
        store.put_batch(ks[:3], [bytes([i]) * BLOCK for i in range(3)])
        bufs = [bytearray(BLOCK) for _ in ks]
        assert [r.status for r in store.get_batch_into(ks, bufs)] == ["hit", "hit", "hit", "miss"]
        with open(shm_path / "pool" / BLOCKS_DIR / ks[0].digest, "r+b") as f:
            f.seek(200)
            f.write(b"\xff\x00\xff")
        assert store.get_batch_into(ks[:1], bufs[:1])[0].reason == "corrupt"
        stats = store.stats()
        got = scrape(m)
    for tier, s in stats.tiers.items():
        assert value(got, "shoal_kv_hits_total", tier=tier) == s.hits, tier
        assert value(got, "shoal_kv_misses_total", tier=tier) == s.misses, tier
        assert value(got, "shoal_kv_read_bytes_total", tier=tier) == s.bytes_read, tier
    assert value(got, "shoal_kv_hits_total", tier="dram") == 3
    assert value(got, "shoal_kv_misses_total", tier="local") == 2  # the absent key, then the corrupt one
    assert value(got, "shoal_kv_used_bytes", tier="dram") == stats.tiers["dram"].bytes_used
    assert value(got, "shoal_kv_corrupt_total", tier="dram") == 1 == stats.corrupt
    # two calls, both of which had to ask the local tier (a key the pool did not hold)
    assert value(got, "shoal_kv_fetch_seconds_count", tier="local") == 2
    total = value(got, "shoal_kv_fetch_seconds_sum", tier="local")
    assert total is not None and total > 0
    got = scrape(m)  # a closed store says nothing more; the scrape still works
    assert named(got, "shoal_kv_hits_total") == {}
    with pytest.raises(ConfigError, match="KV store"):
        m.bind_kv(object())  # type: ignore[arg-type]


def test_observe_documentation_example_runs() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
    text = doc.read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```python\n")[1:]
    assert blocks, "docs/observability.md's Metrics section has no python example"
    for block in blocks:
        code = block.split("```", 1)[0]
        exec(compile(textwrap.dedent(code), str(doc), "exec"), {})
