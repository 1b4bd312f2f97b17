"""The writer model: fits recover what generated the records, and its max-of-N matches simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shoal.errors import ConfigError
from shoal.model import TierState, WriterFit, WriterSample, choose_family, estimate_state, fit_writers

MB = 1e6
SIZE = 64 * MB


def _records(model: WriterFit, seed: int, counts=(1, 2, 4, 8, 16), checkpoints=40) -> list[WriterSample]:
    """``checkpoints`` checkpoints at each writer count, drawn from ``model``; ids unique across counts."""
    rng = np.random.default_rng(seed)
    out = []
    for c, n in enumerate(counts):
        for s in model.simulate(rng, [SIZE] * n, checkpoints):
            out.append(WriterSample(c * 1000 + s.checkpoint, s.nbytes, s.seconds, s.writers, c * 1000 + s.t))
    return out


TRUE = {
    "lognormal": WriterFit("lognormal", 50 * MB, 200 * MB, 0.15, 0.3, 0.0, 0),
    "gamma": WriterFit("gamma", 50 * MB, 200 * MB, 0.15, 0.3, 0.0, 0),
}


@pytest.mark.parametrize("family", ["lognormal", "gamma"])
def test_the_fit_recovers_the_parameters_that_made_the_records(family: str) -> None:
    true = TRUE[family]
    fit = fit_writers(_records(true, seed=1), family)
    assert fit.family == family and fit.n == sum(40 * n for n in (1, 2, 4, 8, 16))
    assert fit.b_client == pytest.approx(true.b_client, rel=0.10)
    assert fit.b_shared == pytest.approx(true.b_shared, rel=0.05)
    assert fit.sigma == pytest.approx(true.sigma, rel=0.10)
    assert fit.tau == pytest.approx(true.tau, rel=0.25)  # 200 checkpoints: tau's own spread is ~5%


@pytest.mark.parametrize("family", ["lognormal", "gamma"])
def test_bic_picks_the_family_that_made_the_records(family: str) -> None:
    best, fits = choose_family(_records(TRUE[family], seed=2))
    assert set(fits) == {"lognormal", "gamma"}
    assert best.family == family, {f: round(x.bic, 1) for f, x in fits.items()}


@pytest.mark.parametrize("family", ["lognormal", "gamma"])
@pytest.mark.parametrize("writers", [1, 8])
def test_the_slowest_writers_quantiles_match_a_monte_carlo_of_the_model(family: str, writers: int) -> None:
    model = TRUE[family]
    draws = 20_000
    sim = model.simulate(np.random.default_rng(7), [SIZE] * writers, draws)
    slowest = np.array([s.seconds for s in sim]).reshape(draws, writers).max(axis=1)
    for q in (0.5, 0.9):
        assert model.slowest_quantile(q, [SIZE] * writers) == pytest.approx(
            float(np.quantile(slowest, q)), rel=0.02
        )
    assert model.slowest_cdf(float(np.quantile(slowest, 0.9)), [SIZE] * writers) == pytest.approx(
        0.9, abs=0.01
    )


def test_the_typical_writer_is_bytes_over_its_rate_and_more_writers_share_the_tier() -> None:
    model = TRUE["lognormal"]
    # lognormal: g + e is symmetric around 0, so the median writer takes exactly S / b_eff
    assert model.typical(SIZE, 1) == pytest.approx(SIZE / (50 * MB), rel=1e-6)  # its own ceiling binds
    assert model.typical(SIZE, 8) == pytest.approx(SIZE / (200 * MB / 8), rel=1e-6)  # the tier's share
    busy = TierState(b_shared=100 * MB)  # half the tier left to this job: twice as long at 8 writers
    assert model.typical(SIZE, 8, busy) == pytest.approx(2 * model.typical(SIZE, 8), rel=1e-6)
    # the slowest of many is slower than the typical one, and more writers make it slower still
    assert (
        model.typical(SIZE, 8)
        < model.slowest_quantile(0.5, [SIZE] * 8)
        < model.slowest_quantile(0.5, [SIZE] * 16)
    )


def test_writers_of_different_sizes_wait_for_the_largest() -> None:
    model = TRUE["lognormal"]
    mixed = model.slowest_quantile(0.9, [SIZE, SIZE / 4, SIZE / 4, SIZE / 4])
    assert model.slowest_quantile(0.9, [SIZE / 4] * 4) < mixed < model.slowest_quantile(0.9, [SIZE] * 4)


@pytest.mark.parametrize(
    ("samples", "family", "match"),
    [
        ([], "lognormal", "at least one"),
        ([WriterSample(0, 10, 0.0, 1)], "lognormal", "must be > 0"),
        ([WriterSample(0, 10, 1.0, 0)], "lognormal", "writers >= 1"),
        ([WriterSample(0, 10, 1.0, 1)], "weibull", "family must be one of"),
    ],
)
def test_bad_records_are_refused_with_what_was_wrong(samples, family, match) -> None:
    with pytest.raises(ConfigError, match=match):
        fit_writers(samples, family)


def test_quantiles_outside_zero_one_and_empty_sizes_are_refused() -> None:
    model = TRUE["gamma"]
    with pytest.raises(ConfigError, match="quantile q must be in"):
        model.slowest_quantile(1.0, [SIZE])
    with pytest.raises(ConfigError, match="sizes must be positive"):
        model.slowest_quantile(0.9, [])
    assert math.isclose(model.slowest_cdf(0.0, [SIZE]), 0.0)


@pytest.mark.parametrize("family", ["lognormal", "gamma"])
def test_the_tiers_state_is_estimated_from_recent_records_alone(family: str) -> None:
    fit = fit_writers(_records(TRUE[family], seed=3), family)
    # now other tenants take half the tier: recent checkpoints of 8 writers see 100 MB/s in all
    busy = WriterFit(family, 50 * MB, 100 * MB, 0.15, 0.3, 0.0, 0)
    # 40 checkpoints: their shared g averages out to tau / sqrt(40), about 5% of the rate (1 sd)
    recent = _records(busy, seed=4, counts=(8,), checkpoints=40)
    state = estimate_state(fit, recent)
    assert state.b_shared == pytest.approx(100 * MB, rel=0.15)
    # what the estimate is for: the fitted writers, predicted in the tier's present state
    assert fit.slowest_quantile(0.9, [SIZE] * 8, state) == pytest.approx(
        fit.slowest_quantile(0.9, [SIZE] * 8, TierState(100 * MB)), rel=0.15
    )
    assert fit.slowest_quantile(0.9, [SIZE] * 8, state) > 1.5 * fit.slowest_quantile(0.9, [SIZE] * 8)


def test_records_the_tier_never_bound_say_little_of_its_state() -> None:
    fit = fit_writers(_records(TRUE["lognormal"], seed=5), "lognormal")
    alone = _records(TRUE["lognormal"], seed=6, counts=(1,), checkpoints=20)  # one writer: its NIC binds
    state = estimate_state(fit, alone)
    # no share below the writer's own ceiling fits them better than noise: single writers predict alike
    assert state == fit.state() or state.b_shared > 0.8 * fit.b_client
    assert fit.typical(SIZE, 1, state) == pytest.approx(fit.typical(SIZE, 1), rel=0.2)
