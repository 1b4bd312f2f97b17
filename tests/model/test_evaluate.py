"""Scores of a model's predictions, and the forward split they are computed on."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shoal.errors import ConfigError
from shoal.model import coverage, forward_split, mape, mdape, pinball_loss
from shoal.model.evaluate import (
    Checkpoint,
    calibrated_fit,
    choose_window,
    forward_predictions,
    history,
    prediction_scores,
)
from shoal.model.writers import WriterFit, WriterSample, fit_writers


def test_percentage_errors() -> None:
    assert mape([110.0, 90.0, 100.0], [100.0, 100.0, 100.0]) == pytest.approx(20 / 3)
    assert mdape([110.0, 50.0, 100.0], [100.0, 100.0, 100.0]) == pytest.approx(10.0)


def test_coverage_counts_observations_at_or_below_their_quantile() -> None:
    assert coverage([1.0, 2.0, 3.0, 4.0], [0.5, 2.0, 3.5, 5.0]) == 0.5


def test_pinball_loss_weighs_misses_by_the_quantile() -> None:
    # q = 0.9: under-predicting by 1 costs 0.9, over-predicting by 1 costs 0.1
    assert pinball_loss(0.9, [1.0], [2.0]) == pytest.approx(0.9)
    assert pinball_loss(0.9, [3.0], [2.0]) == pytest.approx(0.1)


def test_the_forward_split_keeps_time_order_and_never_cuts_through_one_time() -> None:
    items = [(t, i) for i, t in enumerate([5, 1, 3, 3, 3, 2, 4])]
    train, test = forward_split(items, 0.5, key=lambda x: x[0])
    assert [t for t, _ in train] == [1, 2, 3, 3, 3] and [t for t, _ in test] == [4, 5]
    assert max(t for t, _ in train) < min(t for t, _ in test)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: mape([1.0], [1.0, 2.0]), "equal, non-empty"),
        (lambda: mdape([1.0], [0.0]), "observed times must be > 0"),
        (lambda: pinball_loss(1.5, [1.0], [1.0]), "quantile q must be in"),
        (lambda: forward_split([1, 2], 1.0, key=float), "fraction must be in"),
        (lambda: forward_split([1, 1], 0.5, key=float), "same time"),
    ],
)
def test_bad_input_is_refused_with_what_was_wrong(call, match) -> None:
    with pytest.raises(ConfigError, match=match):
        call()


# -- the online (forward) evaluation of the writer model ----------------------------------------

MB = 1e6


def _job(
    model: WriterFit, job: str, writers: int, count: int, seed: int, t0: float = 0.0
) -> list[Checkpoint]:
    """``count`` checkpoints of ``writers`` writers of 8 MB, one second apart, drawn from ``model``."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(count):
        samples = tuple(
            WriterSample(seed * 1000 + j, s.nbytes, s.seconds, writers, t0 + j + s.seconds)
            for s in model.simulate(rng, [8 * MB] * writers, 1)
        )
        out.append(Checkpoint(job, samples, t0 + j, t0 + j + max(s.seconds for s in samples), "r"))
    return out


def test_a_checkpoint_reads_its_writers() -> None:
    c = Checkpoint(
        "a", (WriterSample(0, 10, 1.0, 3), WriterSample(0, 20, 3.0, 3), WriterSample(0, 10, 2.0, 3)), 0, 3
    )
    assert (c.writers, c.sizes, c.typical_seconds, c.slowest_seconds) == (3, [10.0, 20.0, 10.0], 2.0, 3.0)


def test_the_history_is_the_jobs_own_checkpoints_that_ended_before() -> None:
    mine = [Checkpoint("a", (WriterSample(k, 1, 1.0, 1),), float(k), k + 0.5) for k in range(5)]
    other = Checkpoint("b", (WriterSample(9, 1, 1.0, 1),), 3.0, 3.5)
    late = Checkpoint("a", (WriterSample(8, 1, 1.0, 1),), 3.2, 4.5)  # still running at 4.0
    target = Checkpoint("a", (WriterSample(7, 1, 1.0, 1),), 4.0, 5.0)
    assert history([*mine, other, late, target], target, 2) == mine[2:4]
    assert history(mine, target, 0) == []


def test_forward_predictions_follow_the_tiers_state_and_cover_their_quantile() -> None:
    # a job at 8 writers; then other tenants take half the tier: the state comes from recent records
    true = WriterFit("lognormal", 50 * MB, 200 * MB, 0.1, 0.1, 0.0, 0)
    busy = WriterFit("lognormal", 50 * MB, 100 * MB, 0.1, 0.1, 0.0, 0)
    train = _job(true, "a", 8, 40, seed=1) + _job(true, "b", 2, 40, seed=2)
    test = _job(busy, "a", 8, 80, seed=3, t0=100.0)
    fit = calibrated_fit(fit_writers([s for c in train for s in c.samples]), train, window=4)
    assert fit.tau == pytest.approx(0.1, rel=0.4)
    preds = forward_predictions(fit, test, train, window=4)
    assert len(preds) == 80  # the first test checkpoint has the training's last ones as history
    late = preds[4:]  # once the history is all of the busy tier
    scores = prediction_scores(late)
    assert scores["n"] == 76 and scores["mape"] < 12.0
    assert 0.8 <= scores["coverage"] <= 1.0
    assert late[-1].state.b_shared == pytest.approx(100 * MB, rel=0.2)
    with pytest.raises(ConfigError, match="no predictions"):
        prediction_scores([])


def test_the_window_is_chosen_by_how_well_it_predicted_the_training_part() -> None:
    # the tier's share flips every 3 checkpoints: the last checkpoint alone predicts best
    rng = np.random.default_rng(5)
    train = []
    for j in range(60):
        model = WriterFit("lognormal", 50 * MB, (200 * MB, 60 * MB)[(j // 3) % 2], 0.05, 0.02, 0.0, 0)
        samples = tuple(
            WriterSample(j, s.nbytes, s.seconds, 8, j + s.seconds)
            for s in model.simulate(rng, [8 * MB] * 8, 1)
        )
        train.append(Checkpoint("a", samples, float(j), j + max(s.seconds for s in samples)))
    fit = fit_writers([s for c in train for s in c.samples])
    window, scores = choose_window(fit, train, (1, 2, 8))
    assert window == 1 and set(scores) == {1, 2, 8} and scores[1] < scores[8]
    with pytest.raises(ConfigError, match="windows must be"):
        choose_window(fit, train, ())


def test_the_state_carries_the_spread_its_jobs_recent_predictions_showed() -> None:
    # two jobs on one tier: one calm (tau 0.03), one bursty (tau 0.4); the fit has one tau for both
    calm = WriterFit("lognormal", 50 * MB, 200 * MB, 0.05, 0.03, 0.0, 0)
    bursty = replace(calm, tau=0.4)
    ckpts = _job(calm, "calm", 8, 40, seed=6) + _job(bursty, "bursty", 8, 40, seed=7)
    fit = fit_writers([s for c in ckpts for s in c.samples])
    preds = forward_predictions(fit, ckpts, [], window=4, spread_window=8)
    spreads = {
        job: [p.state.tau for p in preds if p.checkpoint.job == job][-20:] for job in ("calm", "bursty")
    }
    assert all(t is not None for ts in spreads.values() for t in ts)
    assert float(np.median(spreads["calm"])) < 0.08 < 0.25 < float(np.median(spreads["bursty"]))
    # the first checkpoints have too few predicted ones before them: the fit's tau
    assert preds[0].state.tau is None
