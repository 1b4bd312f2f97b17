"""Time to B2 by each path from a job's own checkpoints, and the model policy's choice (``path="auto"``)."""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from shoal.engine.path import DIRECT, PARTNER, ModelPolicy, PathContext, PathRecord, decide_path
from shoal.errors import ConfigError
from shoal.model.paths import PathModel, PathTimes
from shoal.model.writers import TierState, WriterFit, WriterSample

MB = 1_000_000
PRE, OVERHEAD = 0.2, 0.05
RANKS = 8
SHARE = 4 * MB
"""Bytes each of the eight ranks drains, and receives as a partner copy."""
FABRIC = WriterFit("lognormal", b_client=20 * MB, b_shared=1e12, sigma=0.05, tau=0.05, loglik=0.0, n=0)
"""The partner copies: each rank's own 20 MB/s, the fabric never the bound."""


def shared_tier(b_shared: float) -> WriterFit:
    """The shared tier: each writer's ceiling 40 MB/s (above a partner copy's), all of them ``b_shared``."""
    return WriterFit("lognormal", b_client=40 * MB, b_shared=b_shared, sigma=0.08, tau=0.1, loglik=0.0, n=0)


def history(
    rng: np.random.Generator, b_shared: float, path: str, count: int, first: int = 1
) -> list[PathTimes]:
    """``count`` checkpoints as the coordinator records them, with writers drawn from the true models."""
    out = []
    for k in range(first, first + count):
        drain = shared_tier(b_shared).simulate(rng, [SHARE] * RANKS, 1)
        drain_s = tuple(WriterSample(k, s.nbytes, s.seconds, RANKS, float(k)) for s in drain)
        copies: tuple[WriterSample, ...] = ()
        b2 = PRE + OVERHEAD + max(s.seconds for s in drain_s)
        begin = PRE
        if path == PARTNER:
            sim = FABRIC.simulate(rng, [SHARE] * RANKS, 1)
            copies = tuple(WriterSample(k, s.nbytes, s.seconds, RANKS, float(k)) for s in sim)
            b2 = PRE + OVERHEAD + max(s.seconds for s in copies)
            begin = b2
        b3 = begin + max(s.seconds for s in drain_s) + OVERHEAD
        out.append(PathTimes(k, path, RANKS * SHARE, PRE, b2, begin, b3, drain_s, copies))
    return out


def _context(records: list[PathRecord], step: int) -> PathContext:
    return PathContext(step, RANKS, ("a", "b"), RANKS * SHARE, can_replicate=True, recent=tuple(records))


def _records(times: list[PathTimes]) -> list[PathRecord]:
    return [PathRecord(t.checkpoint, t.path, t.logical_bytes, {}, times=t) for t in times]


@functools.cache  # a constant of the true models: bisected once, not in every test that asks
def crossover() -> float:
    """The b_shared at which the true p90 times to B2 of the two paths are equal (bisection, log scale)."""
    partner = FABRIC.slowest_quantile(0.9, [SHARE] * RANKS)
    lo, hi = 1 * MB, 1000 * MB
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        direct = shared_tier(mid).slowest_quantile(0.9, [SHARE] * RANKS)
        lo, hi = (mid, hi) if direct > partner else (lo, mid)
    return (lo * hi) ** 0.5


def test_the_prediction_of_each_path_is_its_parts_plus_the_true_slowest_writer_quantile():
    rng = np.random.default_rng(7)
    times = history(rng, 40 * MB, PARTNER, 40)
    model = PathModel()
    model.refit(times)
    for path, truth in ((DIRECT, shared_tier(40 * MB)), (PARTNER, FABRIC)):
        p = model.predict(path, 0.9, RANKS * SHARE, times)
        expected = PRE + OVERHEAD + truth.slowest_quantile(0.9, [SHARE] * RANKS)
        assert p.seconds == pytest.approx(expected, rel=0.06), path
        assert p.pre == pytest.approx(PRE) and p.overhead == pytest.approx(OVERHEAD, abs=0.02)
        assert p.writers == RANKS and p.typical < p.seconds


def test_sizes_scale_with_the_bytes_of_the_checkpoint_to_come():
    rng = np.random.default_rng(3)
    times = history(rng, 200 * MB, PARTNER, 12)
    model = PathModel()
    model.refit(times)
    once = model.predict(DIRECT, 0.5, RANKS * SHARE, times)
    twice = model.predict(DIRECT, 0.5, 2 * RANKS * SHARE, times)
    assert twice.seconds - PRE - twice.overhead == pytest.approx(
        2 * (once.seconds - PRE - once.overhead), rel=0.02
    )


def test_a_path_without_enough_checkpoints_has_no_fit_and_says_so():
    rng = np.random.default_rng(1)
    model = PathModel()
    model.refit(history(rng, 40 * MB, DIRECT, 10))  # no partner copies at all
    assert model.ready(DIRECT) and not model.ready(PARTNER)
    with pytest.raises(ConfigError, match="no writer fit for the partner path"):
        model.predict(PARTNER, 0.9, 1, [])


@pytest.mark.parametrize("factor, expected", [(3.0, DIRECT), (1 / 3.0, PARTNER)])
def test_the_choice_flips_where_the_criterion_says(factor, expected):
    """Light load (the shared tier well above the crossover): direct; contention (well below): partner."""
    b_shared = crossover() * factor
    rng = np.random.default_rng(11)
    policy = ModelPolicy(min_checkpoints=4, refit_every=1, background=False)
    times = history(rng, b_shared, PARTNER, 12)  # the cold start's partner checkpoints
    policy.observe(_records(times))
    decision = policy.decide(_context(_records(times), 13))
    assert decision.path == expected, decision.reason
    assert decision.predictions is not None and set(decision.predictions) == {PARTNER, DIRECT}
    chosen = decision.predictions[expected]["seconds"]
    other = decision.predictions[DIRECT if expected == PARTNER else PARTNER]["seconds"]
    assert chosen < other and "time to B2" in decision.reason


def test_the_policy_follows_the_tier_state_from_the_newest_checkpoints():
    """Same fits; the shared tier turns contended: the next decisions go to partner, then back."""
    rng = np.random.default_rng(5)
    fast, slow = crossover() * 4, crossover() / 4
    policy = ModelPolicy(min_checkpoints=4, refit_every=1000, background=False)  # no refit after
    times = history(rng, fast, PARTNER, 10)
    policy.observe(_records(times))
    assert policy.decide(_context(_records(times), 11)).path == DIRECT
    for k in range(11, 14):  # each checkpoint observed as it finishes, as the pipeline does
        times += history(rng, slow, DIRECT, 1, first=k)
        policy.observe(_records(times))
    assert policy.decide(_context(_records(times), 14)).path == PARTNER
    for k in range(14, 17):
        times += history(rng, fast, PARTNER, 1, first=k)
        policy.observe(_records(times))
    assert policy.decide(_context(_records(times), 17)).path == DIRECT


def test_until_the_update_after_the_newest_checkpoint_lands_the_previous_decision_stands():
    """The decision is a lookup: with no predictions made after the newest checkpoint it keeps the
    previous path, says so, and shows the predictions it had; the update's landing moves it."""
    rng = np.random.default_rng(5)
    fast, slow = crossover() * 4, crossover() / 4
    policy = ModelPolicy(min_checkpoints=4, refit_every=1000, background=False)
    times = history(rng, fast, PARTNER, 10)
    policy.observe(_records(times))
    assert policy.decide(_context(_records(times), 11)).path == DIRECT
    times += history(rng, slow, DIRECT, 3, first=11)  # finished, not yet observed
    stale = policy.decide(_context(_records(times), 14))
    assert stale.path == DIRECT and "previous decision (direct) stands" in stale.reason, stale.reason
    assert "made after checkpoint 10" in stale.reason and stale.predictions is not None
    policy.observe(_records(times))
    assert policy.decide(_context(_records(times), 14)).path == PARTNER


def test_the_update_runs_in_a_low_priority_process_and_its_cost_reaches_the_decision():
    """The default update: a worker process at nice 19 and a bounded CPU share; the decision
    names what the update cost (fit, state, prediction, CPU) and where it ran, and costs well
    under a millisecond itself."""
    rng = np.random.default_rng(4)
    policy = ModelPolicy(min_checkpoints=4, cpu_share=0.5)
    try:
        records = _records(history(rng, crossover() * 3, PARTNER, 12))
        policy.observe(records)
        assert policy.wait(timeout=300)
        decision = decide_path(policy, _context(records, 13))
        assert decision.path == DIRECT and decision.cost is not None
        update = decision.cost["update"]
        assert update["where"] == "process" and update["pid"] != os.getpid() and update["nice"] == 19
        assert update["after_checkpoint"] == 12 and update["refit"] is True and update["cpu_share"] == 0.5
        assert update["fit_cpu_s"] > 0 and update["state_s"] > 0 and update["predict_s"] > 0
        # the share: CPU over wall at most 0.5 (plus the pacer's granularity)
        assert update["cpu_s"] <= 0.5 * update["wall_s"] + 0.05, update
        assert decision.cost["when"] == "before the plan" and decision.cost["thread"] == "MainThread"
        assert decision.cost["decide_s"] >= decision.cost["decide_cpu_s"] >= 0  # its size: docs/model.md
        pid = update["pid"]
    finally:
        policy.close()
    with pytest.raises(ProcessLookupError):  # closed: the worker is gone (and reaped)
        os.kill(pid, 0)


def test_a_worker_that_dies_costs_the_update_and_the_next_runs_in_a_thread(caplog):
    rng = np.random.default_rng(4)
    policy = ModelPolicy(min_checkpoints=4)
    try:
        records = _records(history(rng, crossover() * 3, PARTNER, 12))
        policy.observe(records[:6])
        assert policy.wait(timeout=300)
        assert policy._process is not None and policy._process.pid is not None
        os.kill(policy._process.pid, signal.SIGKILL)
        policy._process._reader.join(60)  # type: ignore[union-attr]
        assert "exited with status -9" in caplog.text and "a thread from now on" in caplog.text
        policy.observe(records)
        assert policy.wait(timeout=300)
        decision = decide_path(policy, _context(records, 13))
        assert decision.cost is not None and decision.cost["update"]["where"] == "thread"
        assert decision.cost["update"]["after_checkpoint"] == 12
    finally:
        policy.close()


def test_a_one_host_job_never_runs_the_model():
    rng = np.random.default_rng(4)
    policy = ModelPolicy(min_checkpoints=4)
    records = _records(history(rng, crossover() * 3, PARTNER, 12))
    one_host = PathContext(13, 2, ("a",), RANKS * SHARE, can_replicate=False, recent=tuple(records))
    assert policy.decide(one_host).path == DIRECT
    policy.observe(records)
    assert policy._process is None and not policy.model.fits and policy.wait(0)


def test_the_records_the_worker_reads_round_trip_through_json_bit_for_bit():
    rng = np.random.default_rng(3)
    for times in history(rng, crossover(), PARTNER, 3):
        assert PathTimes.from_json(json.loads(json.dumps(times.to_json()))) == times
    fit = shared_tier(24 * MB)
    assert WriterFit.from_json(json.loads(json.dumps(fit.to_json()))) == fit
    with pytest.raises(ConfigError, match="malformed"):
        PathTimes.from_json({"checkpoint": 1})
    with pytest.raises(ConfigError, match="family"):
        WriterFit.from_json({**fit.to_json(), "family": "cauchy"})


def test_cold_start_uses_the_rule_and_says_the_model_is_warming_up():
    rng = np.random.default_rng(2)
    policy = ModelPolicy(min_checkpoints=4, background=False)
    times = history(rng, 40 * MB, PARTNER, 3)  # the first is the warm-up: two count
    policy.observe(_records(times))
    decision = policy.decide(_context(_records(times), 4))
    assert decision.path == PARTNER and "warming up" in decision.reason and decision.predictions is None
    one_host = PathContext(4, 2, ("a",), 1, can_replicate=False, recent=tuple(_records(times)))
    assert policy.decide(one_host).path == DIRECT


def test_the_margin_keeps_the_path_when_the_other_is_barely_sooner():
    rng = np.random.default_rng(9)
    policy = ModelPolicy(min_checkpoints=4, refit_every=1, margin=0.5, background=False)
    times = history(rng, crossover() * 1.3, PARTNER, 12)  # direct sooner, but by less than half
    policy.observe(_records(times))
    policy._last = PARTNER
    assert policy.decide(_context(_records(times), 13)).path == PARTNER
    policy.margin = 0.0
    assert policy.decide(_context(_records(times), 13)).path == DIRECT


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ConfigError, match="quantile"):
        ModelPolicy(quantile=1.0)
    with pytest.raises(ConfigError, match="min_checkpoints"):
        ModelPolicy(min_checkpoints=1)
    with pytest.raises(ConfigError, match="margin"):
        ModelPolicy(margin=1.0)
    with pytest.raises(ConfigError, match="PathTimes.path"):
        PathTimes(1, "sideways", 1, 0.0, 0.0, 0.0)


def test_a_tier_state_moves_the_prediction_as_the_formula_says():
    """Sanity of the parts: halving b_shared where it binds doubles the writers' time."""
    fit = shared_tier(24 * MB)
    one = fit.typical(SHARE, RANKS, TierState(24 * MB))
    two = fit.typical(SHARE, RANKS, TierState(12 * MB))
    assert two == pytest.approx(2 * one, rel=1e-6)


def test_a_background_refit_leaves_the_caller_at_once_and_lands_whole():
    rng = np.random.default_rng(4)
    policy = ModelPolicy(min_checkpoints=4)
    try:
        records = _records(history(rng, crossover() * 3, PARTNER, 12))
        policy.observe(records)  # returns before the fit is done (a process of its own)
        assert policy.wait(timeout=300)  # generous: it only runs out when the fit never lands
        assert all(policy.model.ready(p) for p in (PARTNER, DIRECT))
        assert policy.decide(_context(records, 13)).path == DIRECT
    finally:
        policy.close()


def test_the_predictions_made_ahead_are_the_ones_the_decision_would_make_itself():
    """After a checkpoint the policy predicts both paths for the next one; the decision scales
    them to its bytes, and they equal a prediction made at decision time."""
    rng = np.random.default_rng(6)
    policy = ModelPolicy(min_checkpoints=4, refit_every=1, background=False)
    times = history(rng, crossover(), PARTNER, 12)
    policy.observe(_records(times))
    context = PathContext(
        13, RANKS, ("a", "b"), 3 * RANKS * SHARE, can_replicate=True, recent=tuple(_records(times))
    )
    ahead = policy.decide(context).predictions
    assert ahead is not None
    for path in (PARTNER, DIRECT):
        now = policy.model.predict(path, 0.9, 3 * RANKS * SHARE, times[1:])
        assert ahead[path]["seconds"] == pytest.approx(now.seconds, rel=1e-6)
        assert ahead[path]["typical"] == pytest.approx(now.typical, rel=1e-6)


_ORPHAN_PARENT = """
import sys, numpy as np
sys.path[:0] = [{tests!r}]
from model.test_paths import history, crossover, _records, PARTNER
from shoal.engine.path import ModelPolicy
policy = ModelPolicy(min_checkpoints=4)
policy.observe(_records(history(np.random.default_rng(4), crossover() * 3, PARTNER, 12)))
assert policy.wait(300)
print(policy._process.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_worker_whose_coordinator_is_killed_exits_by_itself(tmp_path):
    """SIGKILL the process that started the worker: its pipe ends, and the worker exits."""
    import subprocess
    import sys
    import time

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT.format(tests=tests)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.communicate()  # reaps it and closes its pipes
    for _ in range(600):  # generous: it exits at once; only a worker that never exits runs this out
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{worker}/stat").read_text().split()[2] == "Z":
            return  # exited, waiting for init to reap it
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError(f"the worker {worker} outlived its killed coordinator by 60 s")
