"""benchmarks/model_paths.py's report: the rate sweep's points and what deciding cost, from the records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "model_paths.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_model_paths", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_the_sweep_moves_one_factor_at_a_time_around_the_base(bench):
    base = bench.RatePoint(150.0, 110.0, 220.0, 8.0)
    points = bench.rate_points(base)
    assert points[0] == base and len(set(points)) == len(points) == 7
    for p in points[1:]:
        moved = {
            "fabric": p.fabric_mbit != base.fabric_mbit,
            "storage": (p.host_storage_mbit, p.storage_mbit) != (base.host_storage_mbit, base.storage_mbit),
            "shard": p.shard_mib != base.shard_mib,
        }
        assert sum(moved.values()) == 1, p  # the storage side moves as one: host links and the aggregate
        if moved["storage"]:
            assert p.host_storage_mbit / base.host_storage_mbit == p.storage_mbit / base.storage_mbit
    assert {p.fabric_mbit for p in points} == {55.0, 110.0, 275.0}
    assert {p.shard_mib for p in points} == {4.0, 8.0, 16.0}
    assert base.label == "F110 S150/220 8MiB"


def _cost(decide: float, after: int, refit: bool, cpu: float) -> dict:
    update = {"after_checkpoint": after, "refit": refit, "cpu_s": cpu, "wall_s": 2 * cpu, "where": "process"}
    return {"decide_s": decide, "update": update}


def test_decision_costs_count_each_update_once_and_the_stale_decisions(bench):
    saves = [{"step": s, "reason": "path='auto': ..."} for s in range(7, 11)]
    saves[2]["reason"] += "; the update after checkpoint 8 has not landed: the previous decision stands"
    run = {
        "costs": {
            "7": _cost(0.0002, 6, True, 0.8),
            "8": _cost(0.0001, 7, False, 0.05),
            "9": _cost(0.0003, 7, False, 0.05),  # the update after 8 not landed: 7's again
            "10": _cost(0.0001, 9, False, 0.07),
        }
    }
    c = bench.decision_costs(run, saves)
    assert c["decide_max_s"] == 0.0003 and c["decide_mean_s"] == pytest.approx(0.000175)
    assert c["refit_cpu_s"] == 0.8 and c["update_cpu_s"] == pytest.approx(0.06)
    assert c["stale"] == 1 and c["where"] == ["process"]
    assert bench.decision_costs({}, saves) == {}  # a run from before the records had costs


def _run(path: str, b2: list[float], costs: dict | None = None) -> dict:
    saves = [
        {"step": k + 1, "saved": 10.0 * k, "skipped": False, "path": path, "reason": "",
         "times": {"1": 0.1, "2": t, "3": t + 0.5, "4": t + 0.6}}
        for k, t in enumerate(b2)
    ]  # fmt: skip
    return {"saves": saves, "costs": costs or {}}


def test_the_report_sets_each_model_policy_against_the_better_fixed_path(bench):
    warmup = 2
    result = {
        "regime": {"name": "N=4 quiet"},
        "policies": {
            "direct": _run("direct", [2.0, 2.2, 1.8, 2.0]),
            "partner": _run("partner", [1.0, 1.2, 0.8, 1.0]),
            # the model's first `warmup` saves are its cold start: not counted
            "auto": _run("partner", [9.0, 9.0, 1.1, 1.3, 0.9, 1.1], {"3": _cost(0.0002, 2, True, 0.5)}),
            "auto-thread": _run("partner", [9.0, 9.0, 1.2, 1.4, 1.0, 1.2]),
        },
    }
    (row,) = bench.summarize([result], warmup)
    assert row["winner"] == "partner" and set(row["models"]) == {"auto", "auto-thread"}
    auto, thread = row["models"]["auto"], row["models"]["auto-thread"]
    assert auto["picks_winner"] == 1.0 and auto["mean_vs_best"] == pytest.approx(1.1)
    assert thread["mean_vs_best"] == pytest.approx(1.2) and thread["cost"] == {}
    assert auto["cost"]["refit_cpu_s"] == 0.5 and row["auto_vs_best"] == auto["mean_vs_best"]
    bench._print([row])  # the tables print from a row (and from one without auto-thread)


def test_every_policy_counts_the_same_steps_and_a_second_job_of_a_path_measures_the_noise(bench):
    warmup = 2
    run = lambda path, b2: {**_run(path, b2), "warmup_steps": warmup}  # noqa: E731 - recorded since 12-06
    result = {
        "regime": {"name": "N=4 quiet"},
        "policies": {
            # the store's periodic stall falls on step 3 of every job: every policy counts it
            "direct": run("direct", [9.0, 9.0, 3.0, 2.0, 2.0, 2.0]),
            "partner": run("partner", [9.0, 9.0, 2.0, 1.0, 1.0, 1.0]),
            "partner-again": run("partner", [9.0, 9.0, 2.0, 1.1, 1.1, 1.1]),
            "auto": run("partner", [9.0, 9.0, 2.0, 1.0, 1.0, 1.0]),
        },
    }
    (row,) = bench.summarize([result], warmup)
    assert row["policies"]["partner"]["b2"]["mean"] == pytest.approx(1.25)
    assert row["models"]["auto"]["mean_vs_best"] == pytest.approx(1.0)
    assert row["controls"]["partner"]["mean"] == pytest.approx(1.325 / 1.25)
    assert "direct" not in row["controls"]
    bench._print([row])
