"""The interval advisor matches Young's and Daly's formulas and a Monte Carlo of failures."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from shoal.errors import ConfigError
from shoal.model.advisor import (
    CheckpointTiming,
    FailureModel,
    advise_interval,
    advise_intervals,
    daly_interval,
    daly_wall_time,
    daly_waste,
    first_order_waste,
    job_mtbf,
    simulate_waste,
    young_interval,
)

HOUR = 3600.0
DAY = 86400.0

# (interval P, stall C_b, lag L, restart R, job MTBF M), seconds: from no lag to a lag of 2.5 intervals.
POINTS = [
    (240.0, 8.0, 8.0, 0.0, 3600.0),
    (240.0, 8.0, 8.0, 120.0, 3600.0),
    (300.0, 10.0, 60.0, 60.0, 3600.0),
    (500.0, 2.0, 100.0, 300.0, 5000.0),
    (200.0, 5.0, 150.0, 100.0, 2000.0),
    (100.0, 1.0, 250.0, 20.0, 1500.0),
]


def _simulate(
    interval: float, timing: CheckpointTiming, restart: float, mtbf: float, seed: int = 0, jobs: int = 4000
) -> float:
    work = interval * max(200, math.ceil(20 * mtbf / interval))  # whole intervals, ~20 failures a job
    sim = simulate_waste(work, interval, timing, restart, mtbf, rng=np.random.default_rng(seed), jobs=jobs)
    assert sim.standard_error < 0.005 * sim.waste_fraction  # precise enough to judge a 2% match
    return sim.waste_fraction


def test_job_mtbf_divides_the_node_mtbf_by_the_nodes() -> None:
    assert job_mtbf(365 * DAY, 365) == DAY
    assert FailureModel(node_mtbf_s=1000 * HOUR, nodes=250, restart_s=0.0).job_mtbf_s == 4 * HOUR


def test_young_interval_is_sqrt_2cm() -> None:
    assert young_interval(8.0, HOUR) == pytest.approx(240.0)
    assert young_interval(2.0, 61593.75) == pytest.approx(math.sqrt(4 * 61593.75))


def test_daly_interval_follows_dalys_higher_order_formula() -> None:
    stall, mtbf = 60.0, HOUR
    ratio = stall / (2 * mtbf)
    expected = math.sqrt(2 * stall * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall
    assert daly_interval(stall, mtbf) == pytest.approx(expected)
    assert daly_interval(2 * mtbf, mtbf) == mtbf  # C >= 2M: checkpoint once per MTBF
    assert daly_interval(5 * mtbf, mtbf) == mtbf


@pytest.mark.parametrize("stall", [1.0, 8.0, 60.0, 300.0])
@pytest.mark.parametrize(("lag_extra", "restart"), [(0.0, 0.0), (120.0, 600.0)])
def test_daly_interval_is_the_argmin_of_dalys_exact_waste(
    stall: float, lag_extra: float, restart: float
) -> None:
    best = minimize_scalar(
        lambda p: daly_waste(p, stall, stall + lag_extra, restart, HOUR),
        bounds=(1.0, 5 * HOUR),
        method="bounded",
        options={"xatol": 1e-3},
    )
    assert daly_interval(stall, HOUR) == pytest.approx(best.x, rel=1e-3)


def test_lag_equal_to_stall_reduces_to_the_classic_formulas() -> None:
    interval, stall, restart, mtbf, work = 300.0, 10.0, 120.0, HOUR, 30 * HOUR
    assert first_order_waste(interval, stall, stall, restart, mtbf) == pytest.approx(
        stall / interval + (interval / 2 + restart) / mtbf
    )
    classic = mtbf * math.exp(restart / mtbf) * (math.exp((interval + stall) / mtbf) - 1) * work / interval
    assert daly_wall_time(work, interval, stall, stall, restart, mtbf) == pytest.approx(classic)
    advice = advise_interval(CheckpointTiming(stall, stall), FailureModel(10 * mtbf, 10, restart))
    assert advice.effective_restart_s == restart
    assert advice.young_interval_s == pytest.approx(math.sqrt(2 * stall * mtbf))


def test_the_lag_enters_daly_as_extra_restart() -> None:
    """R' = R + (L - C_b): a lag of 50 s past the stall costs what 50 s more restart would."""
    assert daly_waste(300.0, 10.0, 60.0, 100.0, HOUR) == pytest.approx(
        daly_waste(300.0, 10.0, 10.0, 150.0, HOUR)
    )


@pytest.mark.parametrize(("interval", "stall", "lag", "restart", "mtbf"), POINTS)
def test_daly_waste_matches_the_simulation(
    interval: float, stall: float, lag: float, restart: float, mtbf: float
) -> None:
    simulated = _simulate(interval, CheckpointTiming(stall, lag), restart, mtbf)
    assert daly_waste(interval, stall, lag, restart, mtbf) == pytest.approx(simulated, rel=0.02)


@pytest.mark.parametrize(("interval", "stall", "lag", "restart", "mtbf"), POINTS)
def test_first_order_waste_is_close_while_p_is_small_against_m(
    interval: float, stall: float, lag: float, restart: float, mtbf: float
) -> None:
    exact = daly_waste(interval, stall, lag, restart, mtbf)
    first = first_order_waste(interval, stall, lag, restart, mtbf)
    # The first order overstates: it ignores failures hitting the rework itself (W/(1-W) terms).
    assert exact <= first <= exact / (1 - exact) + 0.01


def test_daly_interval_is_near_the_argmin_of_the_simulated_waste() -> None:
    stall, lag, restart, mtbf = 8.0, 40.0, 60.0, HOUR
    optimum = daly_interval(stall, mtbf)
    timing = CheckpointTiming(stall, lag)
    waste = {f: _simulate(f * optimum, timing, restart, mtbf, seed=7) for f in (0.5, 0.7, 1.0, 1.4, 2.0)}
    noise = 0.005 * waste[1.0] * 2  # twice the simulation's bound on one standard error
    assert waste[1.0] <= min(waste.values()) + noise
    assert waste[0.5] > waste[1.0] + noise
    assert waste[2.0] > waste[1.0] + noise


def test_a_larger_lag_raises_the_waste_but_not_the_optimal_interval() -> None:
    failures = FailureModel(node_mtbf_s=512 * HOUR, nodes=128, restart_s=300.0)
    short, long = CheckpointTiming(5.0, 20.0), CheckpointTiming(5.0, 320.0)
    advice = advise_intervals({"B2": short, "B3": long}, failures)
    assert advice["B2"].optimal_interval_s == advice["B3"].optimal_interval_s
    assert advice["B2"].young_interval_s == advice["B3"].young_interval_s
    assert advice["B3"].waste_at_optimum > advice["B2"].waste_at_optimum
    mtbf = failures.job_mtbf_s
    for interval in (60.0, 300.0, 1200.0):  # first order: the lag adds (L2 - L1) / M at every interval
        gap = first_order_waste(interval, 5.0, 320.0, 300.0, mtbf) - first_order_waste(
            interval, 5.0, 20.0, 300.0, mtbf
        )
        assert gap == pytest.approx(300.0 / mtbf)
    interval = advice["B2"].optimal_interval_s
    assert _simulate(interval, long, 300.0, mtbf) > _simulate(interval, short, 300.0, mtbf)


@pytest.mark.parametrize("spread", [30.0, 60.0])
def test_the_lag_spread_does_not_enter_at_first_order(spread: float) -> None:
    interval, stall, lag, restart, mtbf = 300.0, 10.0, 60.0, 60.0, HOUR
    simulated = _simulate(interval, CheckpointTiming(stall, lag, spread), restart, mtbf, seed=3)
    assert daly_waste(interval, stall, lag, restart, mtbf) == pytest.approx(simulated, rel=0.02)


def test_the_simulation_is_reproducible_from_its_seed() -> None:
    def run() -> float:
        timing = CheckpointTiming(8.0, 30.0, 10.0)
        return simulate_waste(
            10 * HOUR, 240.0, timing, 60.0, HOUR, rng=np.random.default_rng(11), jobs=50
        ).waste_fraction

    assert run() == run()


def test_the_simulation_refuses_a_job_that_does_not_finish() -> None:
    with pytest.raises(ConfigError, match="max_failures=5"):
        simulate_waste(
            100 * HOUR,
            10 * HOUR,
            CheckpointTiming(1.0, 1.0),
            0.0,
            60.0,
            rng=np.random.default_rng(0),
            max_failures=5,
        )


def test_advice_reports_steps_accelerator_hours_and_the_current_interval() -> None:
    failures = FailureModel(node_mtbf_s=365 * DAY, nodes=512, restart_s=600.0)
    advice = advise_interval(
        CheckpointTiming(stall_s=2.0, lag_s=30.0, lag_spread_s=5.0),
        failures,
        name="partner",
        current_interval_s=1800.0,
        step_time_s=4.0,
        accelerators_per_node=8,
    )
    assert advice.name == "partner"
    assert advice.optimal_interval_s == daly_interval(2.0, failures.job_mtbf_s)
    assert advice.optimal_interval_steps == round(advice.optimal_interval_s / 4.0)
    assert advice.effective_restart_s == 628.0
    assert advice.accelerators == 4096
    assert advice.waste_at_optimum == daly_waste(
        advice.optimal_interval_s, 2.0, 30.0, 600.0, failures.job_mtbf_s
    )
    assert advice.waste_at_current is not None and advice.waste_at_current > advice.waste_at_optimum
    assert advice.waste_accelerator_hours_per_day_at_optimum == pytest.approx(
        advice.waste_at_optimum * 4096 * 24
    )
    assert advice.waste_accelerator_hours_per_day_at_current == pytest.approx(
        advice.waste_at_current * 4096 * 24
    )


def test_advice_without_optional_inputs_leaves_them_none() -> None:
    advice = advise_interval(CheckpointTiming(2.0, 2.0), FailureModel(365 * DAY, 64, 60.0))
    assert advice.optimal_interval_steps is None
    assert advice.current_interval_s is None and advice.waste_at_current is None
    assert advice.accelerators is None and advice.waste_accelerator_hours_per_day_at_optimum is None


def test_aiturbo_a_58x_shorter_stall_cuts_the_waste_by_points_not_58x() -> None:
    """One failure an hour, a stall of 10 s cut 58x: the waste drops ~6.3 points, ~sqrt(58)x."""
    mtbf = HOUR

    def waste(stall: float, restart: float) -> float:
        return daly_waste(daly_interval(stall, mtbf), stall, stall, restart, mtbf)

    before, after = waste(10.0, 0.0), waste(10.0 / 58, 0.0)
    first_order_drop = math.sqrt(2 * 10.0 / mtbf) * (1 - 58**-0.5)  # sqrt(2C/M) before minus after
    assert before - after == pytest.approx(first_order_drop, rel=0.05)
    assert 0.05 < before - after < 0.07
    assert before / after < math.sqrt(58)
    assert waste(10.0, 300.0) / waste(10.0 / 58, 300.0) < 2  # a restart cost shrinks the ratio further


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: CheckpointTiming(-1.0, 5.0), "stall_s must be >= 0, got -1.0"),
        (lambda: CheckpointTiming(5.0, 2.0), "lag_s (2.0) must be >= stall_s (5.0)"),
        (lambda: CheckpointTiming(5.0, 5.0, 1.0), "lag_spread_s (1.0) must be 0"),
        (lambda: CheckpointTiming(5.0, 9.0, -1.0), "lag_spread_s must be >= 0, got -1.0"),
        (lambda: CheckpointTiming(5.0, float("nan")), "lag_s must be a finite number of seconds, got nan"),
        (lambda: FailureModel(HOUR, 0, 0.0), "nodes must be a whole number >= 1, got 0"),
        (lambda: FailureModel(HOUR, 2.5, 0.0), "nodes must be a whole number >= 1, got 2.5"),  # type: ignore[arg-type]
        (lambda: FailureModel(0.0, 4, 0.0), "node_mtbf_s must be > 0, got 0.0"),
        (
            lambda: FailureModel(HOUR, 4, float("inf")),
            "restart_s must be a finite number of seconds, got inf",
        ),
        (lambda: young_interval(0.0, HOUR), "stall_s must be > 0, got 0.0"),
        (lambda: daly_interval(1.0, -HOUR), "mtbf_s must be > 0, got -3600.0"),
        (lambda: daly_waste(0.0, 1.0, 1.0, 0.0, HOUR), "interval_s must be > 0, got 0.0"),
        (lambda: first_order_waste(60.0, 1.0, 1.0, True, HOUR), "restart_s must be a finite number"),
        (lambda: advise_intervals({}, FailureModel(HOUR, 1, 0.0)), "timings must name at least one"),
        (
            lambda: advise_interval(CheckpointTiming(1.0, 1.0), FailureModel(HOUR, 1, 0.0), step_time_s=0.0),
            "step_time_s must be > 0, got 0.0",
        ),
        (
            lambda: advise_interval(
                CheckpointTiming(1.0, 1.0), FailureModel(HOUR, 1, 0.0), current_interval_s=-5.0
            ),
            "current_interval_s must be > 0, got -5.0",
        ),
        (
            lambda: advise_interval(
                CheckpointTiming(1.0, 1.0), FailureModel(HOUR, 1, 0.0), accelerators_per_node=0
            ),
            "accelerators_per_node must be a whole number >= 1, got 0",
        ),
        (
            lambda: simulate_waste(
                HOUR, 60.0, CheckpointTiming(1.0, 1.0), 0.0, HOUR, rng=np.random.default_rng(0), jobs=0
            ),
            "jobs must be a whole number >= 1, got 0",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_argument_and_value(call: object, named: str) -> None:
    assert callable(call)
    with pytest.raises(ConfigError) as raised:
        call()
    assert named in str(raised.value)
