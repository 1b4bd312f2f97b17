"""How well a model predicts: forward splits, point errors and quantile scores (DESIGN.md section 7).

Pure functions over plain numbers. A forward split keeps time order (fit on the past, predict
the future), as a running job would; a random split would let the model see the weather it is
asked to predict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from shoal.errors import ConfigError

__all__ = ["coverage", "forward_split", "mape", "mdape", "pinball_loss"]

T = TypeVar("T")


def forward_split(items: Sequence[T], fraction: float, key: Callable[[T], float]) -> tuple[list[T], list[T]]:
    """``items`` in time order (``key``), cut after the first ``fraction`` of them: (train, test).

    Items with equal keys stay on one side (a checkpoint's writers all end up in train or all in
    test when ``key`` is the checkpoint's time).
    """
    if not 0 < fraction < 1:
        raise ConfigError(f"fraction must be in (0, 1), got {fraction!r}")
    ordered = sorted(items, key=key)
    if len(ordered) < 2:
        raise ConfigError(f"a split needs at least 2 items, got {len(ordered)}")
    cut = max(1, min(len(ordered) - 1, round(fraction * len(ordered))))
    while 0 < cut < len(ordered) and key(ordered[cut]) == key(ordered[cut - 1]):
        cut += 1
    if cut >= len(ordered):
        raise ConfigError("every item has the same time: nothing is left to test on")
    return ordered[:cut], ordered[cut:]


def _pair(predicted: Sequence[float], observed: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    p, o = np.asarray(predicted, dtype=float), np.asarray(observed, dtype=float)
    if p.shape != o.shape or p.ndim != 1 or not len(p):
        raise ConfigError(
            f"predicted and observed must be equal, non-empty lists, got {p.shape} and {o.shape}"
        )
    if (o <= 0).any():
        raise ConfigError("observed times must be > 0 for a relative error")
    return p, o


def mape(predicted: Sequence[float], observed: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent: mean(|p - o| / o) * 100."""
    p, o = _pair(predicted, observed)
    return float(np.mean(np.abs(p - o) / o) * 100.0)


def mdape(predicted: Sequence[float], observed: Sequence[float]) -> float:
    """Median absolute percentage error, in percent (robust to a few stragglers)."""
    p, o = _pair(predicted, observed)
    return float(np.median(np.abs(p - o) / o) * 100.0)


def coverage(predicted_quantiles: Sequence[float], observed: Sequence[float]) -> float:
    """The share of ``observed`` at or below their predicted quantile (a p90 should give about 0.9)."""
    p, o = _pair(predicted_quantiles, observed)
    return float(np.mean(o <= p))


def pinball_loss(q: float, predicted_quantiles: Sequence[float], observed: Sequence[float]) -> float:
    """The mean pinball (quantile) loss of predicted ``q`` quantiles: lower is better, in seconds."""
    if not 0 < q < 1:
        raise ConfigError(f"quantile q must be in (0, 1), got {q!r}")
    p, o = _pair(predicted_quantiles, observed)
    diff = o - p
    return float(np.mean(np.maximum(q * diff, (q - 1) * diff)))
