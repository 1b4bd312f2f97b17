"""Scores of a model's predictions, and the forward split they are computed on."""

from __future__ import annotations

import pytest

from shoal.errors import ConfigError
from shoal.model import coverage, forward_split, mape, mdape, pinball_loss


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
