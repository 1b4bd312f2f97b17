"""Time to B2 by each durability path, predicted from a job's own checkpoints (docs/design.md section 7).

A checkpoint's time to B2 (safe against a host failure), from the save call, is three parts:

* ``pre``: staging, hashing and the plan, the same whichever path is taken;
* the **slowest writer** of the path: on ``direct`` the slowest rank's drain to the shared tier
  (B2 comes with B3 there), on ``partner`` the slowest rank's partner copy (the fabric transfer
  and the write to the partner host's tier, one interval);
* an **overhead** after the slowest writer: the collectives and, on ``direct``, the commit's
  manifest (B3).

The writers follow :mod:`shoal.model.writers` (one :class:`~shoal.model.writers.WriterFit` per
path: the shared tier's for ``direct``, the fabric-and-host-tier's for ``partner``), each with
the tier's present state estimated from the newest checkpoints (:mod:`shoal.model.states`); ``pre``
and the overheads are the medians of what recent checkpoints showed. The ``q`` quantile of the
time to B2 is then ``pre + overhead + Q_q(slowest of the writers)``, the writers' sizes those of the
newest checkpoint scaled to the bytes of this one.

Every checkpoint drains, whichever its path: the shared tier's model learns from all of them.
The partner model learns only from partner checkpoints; a job that stays on ``direct`` keeps
its last fabric fit (the fabric is the job's own, and changes far less than a shared tier).

Pure: numbers in, numbers out; :class:`shoal.engine.path.ModelPolicy` feeds it from the
coordinator's records and turns its predictions into decisions.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import ConfigError
from shoal.model.plain import from_plain, to_plain
from shoal.model.states import StateEstimator, StateRule
from shoal.model.writers import TierState, WriterFit, WriterSample, fit_writers

__all__ = ["PATHS", "PathModel", "PathPrediction", "PathTimes"]

PATHS = ("partner", "direct")


@dataclass(frozen=True)
class PathTimes:
    """One finished checkpoint as the coordinator saw it (seconds from the save call)."""

    checkpoint: int
    path: str
    logical_bytes: int
    pre: float
    """Until the plan was agreed (C2): the part both paths share."""
    b2: float
    """Until B2 (on ``direct``, B3)."""
    drain_begin: float
    """When the drain began: after the plan (``direct``) or after B2 (``partner``)."""
    b3: float | None = None
    drain: tuple[WriterSample, ...] = ()
    """One per draining rank: its bytes, seconds from its first upload's start to its last one's end."""
    replicas: tuple[WriterSample, ...] = ()
    """One per receiving rank (``partner`` only): its received bytes, seconds of its exchange."""

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ConfigError(f"PathTimes.path must be one of {PATHS}, got {self.path!r}")

    @classmethod
    def of(
        cls,
        checkpoint: int,
        path: str,
        logical_bytes: int,
        *,
        pre: float,
        b2: float,
        drain_begin: float,
        b3: float | None,
        drains: Sequence[tuple[int, float]],
        copies: Sequence[tuple[int, float]],
    ) -> PathTimes:
        """From every rank's ``(bytes, seconds)`` of its drain and of its partner copy (ranks that
        wrote nothing left out; each kind's writers are the ranks that wrote it)."""

        def writers(pairs: Sequence[tuple[int, float]]) -> tuple[WriterSample, ...]:
            real = [(b, t) for b, t in pairs if b > 0 and t > 0]
            return tuple(WriterSample(checkpoint, b, t, len(real), float(checkpoint)) for b, t in real)

        return cls(
            checkpoint, path, logical_bytes, pre, b2, drain_begin, b3, writers(drains), writers(copies)
        )

    def to_json(self) -> dict[str, Any]:
        """The record as plain JSON values (writers as ``[bytes, seconds, writers, t]``)."""
        return {
            "checkpoint": self.checkpoint,
            "path": self.path,
            "logical_bytes": self.logical_bytes,
            "pre": self.pre,
            "b2": self.b2,
            "drain_begin": self.drain_begin,
            "b3": self.b3,
            "drain": [[s.nbytes, s.seconds, s.writers, s.t] for s in self.drain],
            "replicas": [[s.nbytes, s.seconds, s.writers, s.t] for s in self.replicas],
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> PathTimes:
        """A record from :meth:`to_json`'s object; :class:`~shoal.errors.ConfigError` says what is wrong."""
        try:
            checkpoint = int(value["checkpoint"])

            def writers(rows: Sequence[Sequence[Any]]) -> tuple[WriterSample, ...]:
                return tuple(
                    WriterSample(checkpoint, int(b), float(t), int(n), float(at)) for b, t, n, at in rows
                )

            b3 = value["b3"]
            return cls(
                checkpoint,
                str(value["path"]),
                int(value["logical_bytes"]),
                float(value["pre"]),
                float(value["b2"]),
                float(value["drain_begin"]),
                None if b3 is None else float(b3),
                writers(value["drain"]),
                writers(value["replicas"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"a checkpoint's path record is malformed ({e!r})") from e

    def overhead(self, path: str) -> float | None:
        """Seconds to ``path``'s B2 beyond ``pre`` and its slowest writer, as this checkpoint showed them.

        ``direct``: from the drain's start to B3, less the slowest drain (the gather and the
        manifest), which every checkpoint shows; ``partner``: from the plan to B2, less the
        slowest partner copy, which only a partner checkpoint shows. None: nothing to subtract.
        """
        if path == "direct":
            if self.b3 is None or not self.drain:
                return None
            return max(0.0, self.b3 - self.drain_begin - max(s.seconds for s in self.drain))
        if self.path != "partner" or not self.replicas:
            return None
        return max(0.0, self.b2 - self.pre - max(s.seconds for s in self.replicas))


@dataclass(frozen=True)
class PathPrediction:
    """The predicted time to B2 by one path, and its parts."""

    path: str
    q: float
    seconds: float
    """The ``q`` quantile of the time to B2."""
    typical: float
    """The median: ``pre + overhead +`` the slowest writer's median."""
    pre: float
    overhead: float
    writers: int
    b_shared: float
    """The tier state the prediction assumed (bytes per second for all writers together)."""
    family: str

    def scaled(self, factor: float) -> PathPrediction:
        """The prediction for writers ``factor`` times as large (exact: sizes enter as ln S)."""
        writers_q = (self.seconds - self.pre - self.overhead) * factor
        writers_typ = (self.typical - self.pre - self.overhead) * factor
        return dataclasses.replace(
            self,
            seconds=self.pre + self.overhead + writers_q,
            typical=self.pre + self.overhead + writers_typ,
        )

    def to_json(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> PathPrediction:
        """A prediction from :meth:`to_json`'s object (:class:`~shoal.errors.ConfigError`: malformed)."""
        return from_plain(cls, value, "a path prediction's JSON")


@dataclass
class PathModel:
    """Writer fits per path over a window of recent checkpoints; predicts either path's time to B2.

    ``state_rule``: how the tier's present state comes from the job's checkpoints
    (:class:`~shoal.model.states.StateRule`; ``adaptive`` by default: it had the lowest error on
    the fidelity sweep's training half).
    ``min_checkpoints``: checkpoints with writers a path's fit needs before it predicts.
    ``pace``: called before every evaluation of a likelihood in a fit or a state estimate (a
    caller that bounds the model's CPU share sleeps there); None: never.
    """

    min_checkpoints: int = 4
    fits: dict[str, WriterFit] = field(default_factory=dict)
    pace: Callable[[], None] | None = None
    state_rule: StateRule = StateRule("adaptive", 0)
    _estimators: dict[str, StateEstimator] = field(default_factory=dict, init=False, repr=False)
    """Per path, the state estimator of its current fit (it remembers each checkpoint's estimate)."""

    def refit(self, history: Sequence[PathTimes]) -> None:
        """Fit each path's writers to ``history`` (oldest first); a path with too few keeps its fit."""
        fits = dict(self.fits)
        for path in PATHS:
            samples = _samples(history, path)
            if len({s.checkpoint for s in samples}) >= self.min_checkpoints:
                fits[path] = _fit(samples, self.pace)
        self.fits = fits  # one swap: a reader in another thread sees the old fits or the new ones

    def ready(self, path: str) -> bool:
        return path in self.fits

    def tier_state(self, path: str, history: Sequence[PathTimes]) -> TierState:
        """``path``'s tier state now, from its writers in ``history`` by :attr:`state_rule`."""
        fit = self._fit_of(path)
        estimator = self._estimators.get(path)
        if estimator is None or estimator.fit is not fit:
            estimator = StateEstimator(fit, self.state_rule, pace=self.pace)
            self._estimators[path] = estimator
        per_checkpoint: dict[int, list[WriterSample]] = {}
        for s in _samples(history, path):
            per_checkpoint.setdefault(s.checkpoint, []).append(s)
        state = estimator.state([per_checkpoint[k] for k in sorted(per_checkpoint)])
        return state if state is not None else fit.state()

    def predict(
        self,
        path: str,
        q: float,
        logical_bytes: int,
        history: Sequence[PathTimes],
        state: TierState | None = None,
    ) -> PathPrediction:
        """``path``'s ``q`` quantile of time to B2 for a checkpoint of ``logical_bytes``, now
        (the tier in ``state``; None: :meth:`tier_state` from ``history``)."""
        fit = self._fit_of(path)
        if state is None:
            state = self.tier_state(path, history)
        sizes = _sizes(history, path, logical_bytes)
        pre = _median([h.pre for h in history[-8:]])
        overhead = _median([o for h in history if (o := h.overhead(path)) is not None][-8:])
        slowest_q = fit.slowest_quantile(q, sizes, state) if sizes else 0.0
        slowest_typ = fit.slowest_quantile(0.5, sizes, state) if sizes else 0.0
        return PathPrediction(
            path, q, pre + overhead + slowest_q, pre + overhead + slowest_typ, pre, overhead,
            len(sizes), state.b_shared, fit.family,
        )  # fmt: skip

    def _fit_of(self, path: str) -> WriterFit:
        fit = self.fits.get(path)
        if fit is None:
            raise ConfigError(f"no writer fit for the {path} path yet: too few checkpoints")
        return fit


SAME_FAMILIES_SIGMA = 0.05
"""Below this spread of one writer (lognormal ``sigma``, about its CV), gamma and lognormal writers
are the same distribution to within the data's resolution: the gamma fit is skipped."""


def _fit(samples: list[WriterSample], pace: Callable[[], None] | None = None) -> WriterFit:
    """Lognormal writers, or gamma ones where they fit better by BIC.

    Where the writers barely vary (a job's own fabric: sigma 0.01 and tau 0.001 were measured) the
    two families cannot be told apart, and the gamma likelihood's fit grows slow (5 s for 27
    writers here, against 0.05 s): only the lognormal one is made (``SAME_FAMILIES_SIGMA``).
    """
    lognormal = fit_writers(samples, "lognormal", pace=pace)
    if lognormal.sigma < SAME_FAMILIES_SIGMA:
        return lognormal
    return min((lognormal, fit_writers(samples, "gamma", pace=pace)), key=lambda f: f.bic)


def _samples(history: Sequence[PathTimes], path: str) -> list[WriterSample]:
    """The writers of ``path`` over ``history``: every checkpoint's drain, or the partner copies."""
    if path == "direct":
        return [s for h in history for s in h.drain]
    return [s for h in history for s in h.replicas]


def _sizes(history: Sequence[PathTimes], path: str, logical_bytes: int) -> list[float]:
    """The writers' sizes the next checkpoint should have: the newest one's with writers, scaled."""
    for h in reversed(history):
        writers = h.drain if path == "direct" else h.replicas
        if writers:
            scale = logical_bytes / h.logical_bytes if h.logical_bytes > 0 else 1.0
            return [max(1.0, s.nbytes * scale) for s in writers]
    return []


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
