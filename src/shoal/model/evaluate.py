"""How well a model predicts: forward splits, point errors and quantile scores (docs/design.md section 7).

Pure functions over plain numbers. A forward split keeps time order (fit on the past, predict
the future), as a running job would; a random split would let the model see the weather it is
asked to predict.

:func:`forward_predictions` is the online evaluation a running job would do: each checkpoint
predicted from the fitted model and the tier state estimated from the same job's few previous
checkpoints (their records ended before it started), never from anything the job cannot see;
:func:`prediction_scores` scores those predictions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from shoal.errors import ConfigError
from shoal.model.states import StateEstimator, StateRule
from shoal.model.writers import TierState, WriterFit, WriterSample, calibrate_spread

__all__ = [
    "Checkpoint",
    "Prediction",
    "calibrated_fit",
    "choose_window",
    "coverage",
    "forward_predictions",
    "forward_split",
    "history",
    "mape",
    "mdape",
    "pinball_loss",
    "prediction_scores",
]

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


# -- online (forward) evaluation of the writer model -------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of one job on a tier: its writers' samples and when they ran."""

    job: str
    """Which job (a job estimates the tier's state only from its own records)."""
    samples: tuple[WriterSample, ...]
    start: float
    """When its first writer started (the clock of ``end``)."""
    end: float
    """When its last writer ended."""
    regime: str = ""
    """A label for scoring per regime (the harness's conditions; never an input)."""
    probe: float | None = None
    """The rate (bytes per second) a probe of the tier got just before it began, if one was taken
    (a ``+probe`` state rule follows it, :mod:`shoal.model.states`)."""

    @property
    def writers(self) -> int:
        """Its writers on the tier at once (the records' ``concurrency``)."""
        return max(s.writers for s in self.samples)

    @property
    def sizes(self) -> list[float]:
        """Each writer's bytes."""
        return [float(s.nbytes) for s in self.samples]

    @property
    def typical_seconds(self) -> float:
        """The observed median writer's time."""
        return float(np.median([s.seconds for s in self.samples]))

    @property
    def slowest_seconds(self) -> float:
        """The observed slowest writer's time."""
        return max(s.seconds for s in self.samples)


@dataclass(frozen=True)
class Prediction:
    """What the model said of one checkpoint before it ran, beside what it saw."""

    checkpoint: Checkpoint
    state: TierState
    typical: float
    """Predicted median writer, seconds."""
    slowest: float
    """Predicted ``q`` quantile of the slowest writer, seconds."""


def history(checkpoints: Sequence[Checkpoint], target: Checkpoint, window: int) -> list[Checkpoint]:
    """The last ``window`` checkpoints of ``target``'s job that ended before it started."""
    past = [c for c in checkpoints if c.job == target.job and c.end <= target.start and c is not target]
    return sorted(past, key=lambda c: c.end)[-window:] if window > 0 else []


MIN_SPREAD = 0.02
"""The least spread of g a state's own records may set (a few quiet checkpoints prove no calm)."""


def _rule(window: int | StateRule) -> StateRule:
    """A window of checkpoints (the writers of the last ``window`` pooled) or a rule, as a rule."""
    return window if isinstance(window, StateRule) else StateRule("pooled", window)


def _states(
    fit: WriterFit,
    checkpoints: Sequence[Checkpoint],
    pool: Sequence[Checkpoint],
    window: int | StateRule,
    spread_window: int = 0,
) -> list[tuple[Checkpoint, TierState]]:
    """Each of ``checkpoints`` with a history in ``pool``, and the state its history gives.

    The state comes from the job's checkpoints in ``pool`` that ended before it started, by
    ``window`` (:class:`~shoal.model.states.StateRule`; an int ``w``: ``pooled:w``). With
    ``spread_window`` the state also carries the spread of g its job's recent predictions
    showed (:func:`_spread`), when at least 3 of its last ``spread_window`` checkpoints were
    themselves predicted."""
    estimator = StateEstimator(fit, _rule(window))
    residuals: dict[int, tuple[float, int] | None] = {}

    def rate_state(c: Checkpoint) -> TierState | None:
        """The state ``c``'s job's history gives (None: no history)."""
        past = history(pool, c, len(pool))
        return estimator.state([p.samples for p in past], [p.probe for p in past], c.probe) if past else None

    def residual(c: Checkpoint) -> tuple[float, int] | None:
        """ln(observed / predicted) of ``c``'s typical writer, and its writers (None: no history)."""
        if id(c) not in residuals:
            state = rate_state(c)
            residuals[id(c)] = None
            if state is not None:
                predicted = fit.typical(float(np.median(c.sizes)), c.writers, state)
                residuals[id(c)] = (math.log(c.typical_seconds / predicted), len(c.samples))
        return residuals[id(c)]

    out = []
    for c in checkpoints:
        state = rate_state(c)
        if state is None:
            continue
        if spread_window > 0:
            seen = [r for p in history(pool, c, spread_window) if (r := residual(p)) is not None]
            if len(seen) >= 3:
                state = TierState(state.b_shared, _spread(fit, seen))
        out.append((c, state))
    return out


def _spread(fit: WriterFit, residuals: Sequence[tuple[float, int]]) -> float:
    """The spread of g that recent log-errors of the typical writer (and their writer counts) show.

    Each error is g's own deviation plus the median writer's luck, whose variance is about
    ``(pi / 2) sigma^2 / n`` for ``n`` writers: that part is taken out, and the spread is kept
    at least :data:`MIN_SPREAD`.
    """
    errors = np.array([r for r, _ in residuals])
    luck = np.array([math.pi / 2 * fit.sigma**2 / n for _, n in residuals])
    return math.sqrt(max(float(np.mean(errors**2 - luck)), MIN_SPREAD**2))


def calibrated_fit(
    fit: WriterFit,
    train: Sequence[Checkpoint],
    *,
    window: int | StateRule,
    target: str = "writers",
    spread_window: int = 0,
) -> WriterFit:
    """``fit`` with the spread of its shared term as a forward prediction over ``train`` sees it.

    Each training checkpoint with a history gets the state its job's previous checkpoints give
    by ``window`` (a :class:`~shoal.model.states.StateRule`, or ``w`` for ``pooled:w``), and
    ``tau`` is refitted around those states (:func:`~shoal.model.writers.calibrate_spread`,
    with its ``target``: every writer, or each checkpoint's slowest, which refits ``sigma``
    too): the predicted
    quantiles then carry the error of a state estimated from a few recent records, as
    :func:`forward_predictions` uses them. ``fit`` itself is returned when no checkpoint has a
    history. With ``spread_window`` (and ``target="slowest"``), ``sigma`` is then refitted once
    more with each checkpoint's state carrying the spread of g its recent records showed, as
    :func:`forward_predictions` with that ``spread_window`` predicts; the fit's ``tau`` stays for
    states without one.
    """
    pairs = _states(fit, train, train, window)
    if not pairs:
        return fit
    fit = calibrate_spread(fit, [(state, c.samples) for c, state in pairs], target=target)
    if spread_window <= 0 or target == "writers":
        return fit
    own = [(state, c.samples) for c, state in _states(fit, train, train, window, spread_window)]
    own = [(state, samples) for state, samples in own if state.tau is not None]
    return calibrate_spread(fit, own, target=target) if own else fit


def choose_window(
    fit: WriterFit,
    train: Sequence[Checkpoint],
    windows: Sequence[int | StateRule] = (1, 2, 4, 8),
) -> tuple[int | StateRule, dict[int | StateRule, float]]:
    """The history length whose states predict ``train``'s typical writers best (lowest MAPE).

    How many recent checkpoints the tier's state should come from is a trade: few follow a
    change of load or weather sooner, many average out each checkpoint's shared luck ``g``.
    Which wins depends on how fast the tier changes, which only its records tell: each window
    is scored by the MAPE of the typical writer over the training checkpoints, each predicted
    from its own job's previous ones. ``windows`` may also hold
    :class:`~shoal.model.states.StateRule` s (an int ``w`` is ``pooled:w``). Returns the best
    window and every window's MAPE.
    """
    if not windows or min((w for w in windows if isinstance(w, int)), default=1) < 1:
        raise ConfigError(f"windows must be history lengths >= 1, got {list(windows)!r}")
    scores: dict[int | StateRule, float] = {}
    for w in windows:
        pairs = _states(fit, train, train, w)
        if pairs:
            predicted = [fit.typical(float(np.median(c.sizes)), c.writers, st) for c, st in pairs]
            scores[w] = mape(predicted, [c.typical_seconds for c, _ in pairs])
    if not scores:
        raise ConfigError("no training checkpoint has a history to predict it from")
    order = {w: i for i, w in enumerate(windows)}
    return min(scores, key=lambda w: (scores[w], order[w])), scores


def forward_predictions(
    fit: WriterFit,
    tests: Sequence[Checkpoint],
    seen: Sequence[Checkpoint],
    *,
    window: int | StateRule,
    q: float = 0.9,
    spread_window: int = 0,
) -> list[Prediction]:
    """Predict each of ``tests`` as a running job would, just before it started.

    The tier's state comes from the job's checkpoints that ended before the test began (from
    ``seen`` and ``tests`` alike: by then they were the job's own history), by ``window`` (a
    :class:`~shoal.model.states.StateRule`; an int ``w``: the writers of the last ``w`` pooled,
    :func:`~shoal.model.writers.estimate_state`); a checkpoint with no such history is left
    out. Predicts the typical writer (median size, the checkpoint's writer count) and the ``q``
    quantile of the slowest of its writers. With ``spread_window`` the state also carries the
    spread of g the job's last ``spread_window`` predictions showed (when there were 3 or more).
    """
    out = []
    for c, state in _states(fit, tests, list(seen) + list(tests), window, spread_window):
        size = float(np.median(c.sizes))
        out.append(
            Prediction(c, state, fit.typical(size, c.writers, state), fit.slowest_quantile(q, c.sizes, state))
        )
    return out


def prediction_scores(predictions: Sequence[Prediction], q: float = 0.9) -> dict[str, float]:
    """MAPE and MdAPE of the typical writer, coverage and pinball loss of the slowest's quantile."""
    if not predictions:
        raise ConfigError("no predictions to score")
    typical = [p.typical for p in predictions]
    seen_typical = [p.checkpoint.typical_seconds for p in predictions]
    slowest = [p.slowest for p in predictions]
    seen_slowest = [p.checkpoint.slowest_seconds for p in predictions]
    return {
        "n": float(len(predictions)),
        "mape": mape(typical, seen_typical),
        "mdape": mdape(typical, seen_typical),
        "coverage": coverage(slowest, seen_slowest),
        "pinball": pinball_loss(q, slowest, seen_slowest),
    }
