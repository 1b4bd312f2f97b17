"""The writer model: fits recover what generated the records, and its max-of-N matches simulation."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from shoal.errors import ConfigError
from shoal.model import TierState, WriterFit, WriterSample, choose_family, estimate_state, fit_writers
from shoal.model.writers import calibrate_spread

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


# -- a fixed cost per write, and the spread of g around estimated states -----------------------

LATENT = WriterFit("lognormal", 50 * MB, 200 * MB, 0.1, 0.2, 0.0, 0, latency=0.05, n_params=5)


def _sized(model: WriterFit, seed: int, checkpoints: int = 20) -> list[WriterSample]:
    """Checkpoints of 1 to 16 writers of 4, 16 and 64 MB each (a latency shows against size)."""
    rng = np.random.default_rng(seed)
    out = []
    for c, (n, size) in enumerate((n, s) for n in (1, 4, 16) for s in (4 * MB, 16 * MB, 64 * MB)):
        for s in model.simulate(rng, [size] * n, checkpoints):
            out.append(WriterSample(c * 1000 + s.checkpoint, s.nbytes, s.seconds, n, c * 1000 + s.t))
    return out


def test_a_fixed_cost_per_write_is_recovered_and_bic_keeps_it_only_where_it_is() -> None:
    records = _sized(LATENT, seed=11, checkpoints=16)
    best, fits = choose_family(records, latency=True)
    fit = fits["lognormal+latency"]  # fit_writers(records, "lognormal", latency=True): fitted once, here
    assert fit.family == "lognormal" and fit.latency == pytest.approx(0.05, rel=0.15) and fit.n_params == 5
    assert fit.b_shared == pytest.approx(200 * MB, rel=0.05)
    assert fit.b_client == pytest.approx(50 * MB, rel=0.10)
    assert fit.typical(4 * MB, 1) == pytest.approx(0.05 + 4 / 50, rel=0.05)
    assert best.latency > 0 and set(fits) >= {"gamma+latency"}  # (at sigma 0.1 the families look alike)
    plain = replace(LATENT, latency=0.0, n_params=4)
    best, _ = choose_family(_sized(plain, seed=12, checkpoints=16), latency=True)
    assert best.latency == 0.0  # a latency that explains nothing does not pay its parameter


def test_the_slowest_writer_with_a_latency_matches_a_monte_carlo_of_the_model() -> None:
    draws = 20_000
    sim = LATENT.simulate(np.random.default_rng(8), [4 * MB] * 8, draws)
    slowest = np.array([s.seconds for s in sim]).reshape(draws, 8).max(axis=1)
    assert LATENT.slowest_quantile(0.9, [4 * MB] * 8) == pytest.approx(
        float(np.quantile(slowest, 0.9)), rel=0.02
    )


def test_the_spread_around_estimated_states_is_what_the_states_leave_unexplained() -> None:
    # the tier's share moves between blocks of checkpoints (other tenants come and go); g's own
    # spread within that is tau = 0.1
    rng = np.random.default_rng(13)
    pairs, records = [], []
    for block, b_shared in enumerate((200 * MB, 80 * MB, 140 * MB, 50 * MB)):
        model = WriterFit("lognormal", 50 * MB, b_shared, 0.1, 0.1, 0.0, 0)
        for c in range(30):
            writers = model.simulate(rng, [SIZE] * 8, 1)
            pairs.append((TierState(b_shared), writers))
            records += [WriterSample(block * 100 + c, s.nbytes, s.seconds, 8, s.t) for s in writers]
    one_state = fit_writers(records, "lognormal")
    assert one_state.tau > 0.3  # the blocks' different shares, read as weather
    calibrated = calibrate_spread(one_state, pairs)
    assert calibrated.tau == pytest.approx(0.1, rel=0.25)
    assert (calibrated.b_client, calibrated.sigma) == (one_state.b_client, one_state.sigma)
    with pytest.raises(ConfigError, match="at least one"):
        calibrate_spread(one_state, [])


def test_a_state_that_carries_its_own_spread_widens_or_narrows_the_prediction() -> None:
    model = TRUE["lognormal"]  # tau 0.3
    calm, bursty = TierState(model.b_shared, tau=0.05), TierState(model.b_shared, tau=0.6)
    sizes = [SIZE] * 8
    assert (
        model.slowest_quantile(0.9, sizes, calm)
        < model.slowest_quantile(0.9, sizes)
        < model.slowest_quantile(0.9, sizes, bursty)
    )
    assert model.typical(SIZE, 8, calm) == pytest.approx(model.typical(SIZE, 8), rel=1e-6)  # the median stays
    sim = model.simulate(np.random.default_rng(9), [SIZE], 4000, calm)
    assert float(np.std(np.log([s.seconds for s in sim]))) == pytest.approx(math.hypot(0.15, 0.05), rel=0.05)


@pytest.mark.parametrize("family", ["lognormal", "gamma"])
def test_the_writers_own_spread_is_read_from_the_gap_between_median_and_slowest(family: str) -> None:
    # the states given are the true ones: sigma from the order statistics, tau from the slowest
    true = WriterFit(family, 50 * MB, 200 * MB, 0.1, 0.2, 0.0, 0)
    rng = np.random.default_rng(14)
    pairs = [(true.state(), true.simulate(rng, [SIZE] * n, 1)) for n in (4, 8, 16) for _ in range(60)]
    rough = replace(true, sigma=0.3, tau=0.5)  # where a fit of every writer might have put them
    by_order = calibrate_spread(rough, pairs, target="order")
    assert by_order.sigma == pytest.approx(0.1, rel=0.15) and by_order.tau == pytest.approx(0.2, rel=0.25)
    by_slowest = calibrate_spread(rough, pairs, target="slowest")
    assert by_slowest.sigma == pytest.approx(0.1, rel=0.3) and by_slowest.tau == pytest.approx(0.2, rel=0.25)
    own = [(TierState(s.b_shared, tau=0.2), w) for s, w in pairs]  # states with their own spread: sigma alone
    assert calibrate_spread(rough, own, target="order").tau == rough.tau
    with pytest.raises(ConfigError, match="target must be"):
        calibrate_spread(rough, pairs, target="median")
