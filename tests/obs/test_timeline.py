"""``shoal timeline`` on a 4-rank, 2-host run: valid trace-event JSON whose spans are the records."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from shoal.boundary import Boundary
from shoal.cli.main import main
from shoal.records.events import CheckpointRecord, WriterRecord

from .obs_run import SAVES, Run

pytestmark = pytest.mark.timeout(240)

# The trace event format's phases used here and the fields each must carry (the "Trace Event
# Format" document: every event has name, ph, ts, pid, tid; X has dur; i has s in g/p/t; C has
# args of numbers; M events are process_name/thread_name/..._sort_index with their args).
COMMON = {"name": str, "ph": str, "ts": (int, float), "pid": int, "tid": int}
METADATA = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
            "thread_sort_index": "sort_index"}  # fmt: skip
US = 1e6


def _trace(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    out = tmp_path / "trace.json"
    code = main(["timeline", *argv, "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "trace written to" in err
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


@pytest.fixture(scope="module")
def trace(obs_run: Run, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("timeline") / "trace.json"
    assert main(["timeline", "test", "--local", str(obs_run.local), "-o", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_every_event_has_the_fields_its_phase_needs(trace: dict[str, Any]) -> None:
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    assert trace["displayTimeUnit"] in ("ms", "ns")
    phases = set()
    for e in trace["traceEvents"]:
        for key, kind in COMMON.items():
            assert isinstance(e.get(key), kind), (key, e)
        assert math.isfinite(e["ts"]) and e["ts"] >= 0, e
        phases.add(e["ph"])
        if e["ph"] == "X":
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0, e
        elif e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, int | float) for v in e["args"].values()), e
        elif e["ph"] == "M":
            assert e["name"] in METADATA and METADATA[e["name"]] in e["args"], e
        else:
            pytest.fail(f"a phase this trace should not hold: {e}")
    assert phases == {"X", "i", "C", "M"}


def test_both_hosts_are_processes_and_every_rank_a_track(trace: dict[str, Any]) -> None:
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["host h0", "host h1"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    by_name = {name: pid for (pid, _), name in threads.items()}
    for rank, host in enumerate(["h0", "h0", "h1", "h1"]):
        assert processes[by_name[f"rank {rank}"]] == f"host {host}"
    named = set(threads)
    for e in trace["traceEvents"]:
        if e["ph"] in ("X", "i"):
            assert (e["pid"], e["tid"]) in named, e  # every span is on a named track


def test_spans_nest_on_every_track_in_time_order(trace: dict[str, Any]) -> None:
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, spans in tracks.items():
        assert [s["ts"] for s in spans] == sorted(s["ts"] for s in spans), key
        open_ends: list[float] = []
        for s in spans:
            while open_ends and open_ends[-1] <= s["ts"] + 1e-3:
                open_ends.pop()
            end = s["ts"] + s["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, (key, s)  # nested, never half over
            open_ends.append(end)


def _wall_us(run: Run, host: str, mono: float) -> float:
    return (mono + run.offset(host) - run.origin) * US


def test_every_write_record_is_one_span_at_its_time(trace: dict[str, Any], obs_run: Run) -> None:
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and "path" in e["args"]]
    by_path: dict[tuple[str, str, int], dict[str, Any]] = {}
    for s in spans:
        key = (s["args"]["tier"], s["args"]["path"], s["args"]["step"])
        assert key not in by_path, s  # one span per file written
        by_path[key] = s
    writes = [e for e in obs_run.every() if isinstance(e, WriterRecord)]
    kinds = {w.what for w in writes}
    assert {"pack", "replica", "manifest", "commit", "latest"} <= kinds
    assert len(spans) == len(writes)
    for w in writes:
        assert w.step is not None
        s = by_path[(w.tier, w.path, w.step)]
        assert s["args"]["step"] == w.step and s["args"]["bytes"] == w.bytes
        assert abs(s["dur"] - w.seconds * US) <= 1.0, (w.where, s)
        assert abs(s["ts"] - _wall_us(obs_run, w.host, w.start)) <= 1.0, (w.where, s)
        assert s["tid"] // 1000 == w.rank
    shared = [w for w in writes if w.tier == "shared"]
    assert len({w.step for w in shared}) == SAVES


def test_each_boundary_is_an_instant_at_the_save_call_plus_its_seconds(
    trace: dict[str, Any], obs_run: Run
) -> None:
    instants = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "i" and e["cat"] == "boundary":
            instants[(e["pid"], e["tid"], e["args"]["step"], e["name"])] = e
    pid = {
        e["args"]["name"].removeprefix("host "): e["pid"]
        for e in trace["traceEvents"]
        if e["name"] == "process_name"
    }
    seen = 0
    for host, events in obs_run.events.items():
        called = {(e.rank, e.step): float(e["called"]) for e in events if e.event == "save_called"}
        for r in events:
            if not isinstance(r, CheckpointRecord):
                continue
            assert r.reached == "RESTARTABLE"
            for name, seconds in r.boundaries.items():
                i = instants[(pid[host], r.rank * 1000, r.step, f"B{int(Boundary[name])} {name}")]
                expected = _wall_us(obs_run, host, called[(r.rank, r.step)] + seconds)
                assert abs(i["ts"] - expected) <= 1.0, (r.where, name, i)
                seen += 1
    assert seen == 4 * SAVES * 4 == len(instants)  # 4 ranks, every save, every boundary


def test_stage_hash_plan_copy_and_load_spans_come_from_their_records(
    trace: dict[str, Any], obs_run: Run
) -> None:
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]

    def named(name: str) -> list[dict[str, Any]]:
        return [s for s in spans if s["name"] == name]

    every = obs_run.every()
    for name, event in (("stage (copy into DRAM)", "staged"), ("hash chunks", "hashed"),
                        ("path decision and plan", "planned"), ("partner copy", "replicate")):  # fmt: skip
        records = [e for e in every if e.event == event]
        assert len(named(name)) == len(records) > 0, name
        got = sorted((s["args"]["step"], s["tid"] // 1000, s["dur"]) for s in named(name))
        want = sorted((e.step, e.rank, (e["end"] - e["start"]) * US) for e in records)
        assert [g[:2] for g in got] == [w[:2] for w in want], name
        for g, w in zip(got, want, strict=True):
            assert abs(g[2] - w[2]) <= 1.0, (name, g, w)
    assert len(named("path decision and plan")) == SAVES  # the coordinator's, one per checkpoint
    loads = named(f"load step {SAVES}")
    assert len(loads) == 4
    for part in ("restore reads", "restore exchange"):
        assert len(named(part)) == 4
        for s in named(part):
            load = next(x for x in loads if (x["pid"], x["tid"]) == (s["pid"], s["tid"]))
            assert load["ts"] <= s["ts"] and s["ts"] + s["dur"] <= load["ts"] + load["dur"] + 1e-3


def test_the_bytes_in_flight_counter_rises_and_returns_to_zero(trace: dict[str, Any]) -> None:
    counters: dict[int, list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "C":
            counters.setdefault(e["pid"], []).append(e)
    assert len(counters) == 2  # both hosts wrote
    for points in counters.values():
        assert all(v >= 0 for p in points for v in p["args"].values())
        assert max(sum(p["args"].values()) for p in points) > 0
        assert all(v == 0 for v in points[-1]["args"].values())


def test_steps_choose_what_is_drawn(obs_run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h0, h1 = obs_run.logs["h0"], obs_run.logs["h1"]
    doc = _trace(tmp_path, capsys, "--events", h0, "--events", h1, "--steps", "2-3")
    steps = {e["args"].get("step") for e in doc["traceEvents"] if e["ph"] in ("X", "i")}
    assert steps == {2, 3}
    assert doc["otherData"]["steps"] == "2-3"
    assert len(doc["otherData"]["clock_offsets"]) == 2


def test_the_shared_job_directory_names_the_run(
    obs_run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _trace(tmp_path, capsys, str(obs_run.shared_job), "--local", str(obs_run.local))
    hosts = sorted(e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name")
    assert hosts == ["host h0", "host h1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "7-3"], "is not a range from a lower to a higher step"),
        (["--steps", "x"], "is not a step or a range"),
        ([], "which run?"),
        (["nosuchjob", "--local", "/nonexistent-root"], "no local directory for job 'nosuchjob'"),
    ],
)
def test_bad_command_lines_say_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = main(["timeline", *argv, "-o", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "t.json").exists()
