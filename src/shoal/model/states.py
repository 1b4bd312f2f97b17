"""The tier's present state from a job's own recent checkpoints (docs/design.md section 7).

A prediction needs ``b_shared`` now (:class:`~shoal.model.writers.TierState`): what the tier
gives all writers together under the other tenants' present load. A job sees it only through
its own checkpoints. How many of them to use is a trade: the newest alone follows a step in
the weather at once but carries that checkpoint's own luck (``g``) into the next prediction;
many average the luck out but lag a step. Which wins depends on the tier, so a
:class:`StateRule` names one way, and ``adaptive`` picks among several as the job goes:

* ``pooled:W``: ``b_shared`` refitted over the writers of the last ``W`` checkpoints together
  (:func:`~shoal.model.writers.estimate_state`);
* ``median:W``: each checkpoint's own ``b_shared`` (estimated from its writers alone, once),
  and the median of the last ``W`` of them in log space (``median:all``: of every one the job
  has): one unlucky checkpoint moves it not at all;
* ``matched:W``: as ``median:W``, but each checkpoint's own ``b_shared`` is the one at which
  the model's typical writer takes as long as that checkpoint's median writer did. The
  likelihood weighs every writer; the writers of one checkpoint do not start together, so the
  fit's shape puts its median a few percent from the observed one, the same way checkpoint
  after checkpoint of one job (a bias by ``N``). Matching the median removes it for the typical
  writer, which is what the path decision and the scoring use;
* ``adaptive``: for every checkpoint, the candidate rules (:data:`ADAPTIVE_CANDIDATES`) whose
  forward predictions of the job's own last :data:`ADAPTIVE_LOOKBACK` checkpoints (each from
  the ones before it) had the least mean absolute log error; the longest memory until two of
  their errors are known. Only what the job has seen decides. It is
  :class:`~shoal.model.paths.PathModel`'s rule.

A rule with ``+probe`` (``"matched:all+probe"``) also takes a *probe* of the tier: the rate
one small write got just before each checkpoint began (its bytes over its seconds). The tier's
weather moves the probe and the checkpoint's writers alike, so the rule keeps, over its window,
the median of ``ln b_shared - ln probe`` (each checkpoint's own estimate, as ``matched``, over
the probe taken before it: what the tier gives the job's writers relative to one probe) and
adds the log of the probe now. A probe is one write, with luck of its own: it pays only where
the tier's weather moves the checkpoints more than that luck. So the rule follows the probe
only where, over its window (and :data:`PROBE_MIN_CHECKPOINTS` or more probed checkpoints),
``ln b_shared - ln probe`` spreads less than ``ln b_shared`` alone (median absolute
deviations): where the probes explain what the checkpoints did. Else it is its rule without
the probe. A steady tier is then predicted as before, and a step in the weather is seen at the
checkpoint right after it instead of several checkpoints later.

:class:`StateEstimator` applies a rule to a job's history (oldest first) and remembers each
checkpoint's own estimate and each candidate's predictions, so a running job pays for one new
estimate per checkpoint. Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from shoal.errors import ConfigError
from shoal.model.writers import TierState, WriterFit, WriterSample, estimate_state

__all__ = [
    "ADAPTIVE_CANDIDATES",
    "ADAPTIVE_LOOKBACK",
    "PROBE_MIN_CHECKPOINTS",
    "StateEstimator",
    "StateRule",
]

ALL = 0
"""A rule's window that means every checkpoint the job has."""


@dataclass(frozen=True)
class StateRule:
    """One way to estimate the tier's state from a job's recent checkpoints (see the module)."""

    how: str = "pooled"
    """``pooled``, ``median``, ``matched`` or ``adaptive``."""
    window: int = 2
    """Checkpoints it looks back over (``ALL``, 0: every one); unused by ``adaptive``."""
    probe: bool = False
    """Whether it also follows the probes of the tier (``+probe``, see the module; a ``matched``
    rule only)."""

    def __post_init__(self) -> None:
        if self.how not in ("pooled", "median", "matched", "adaptive"):
            raise ConfigError(f"a state rule is pooled, median, matched or adaptive, got {self.how!r}")
        if self.window < 0 or (self.how == "pooled" and self.window == ALL):
            raise ConfigError(f"a {self.how} state rule needs a window >= 1, got {self.window!r}")
        if self.probe and self.how != "matched":
            raise ConfigError(f"only a matched state rule follows probes ('matched:W+probe'), got {self}")

    @classmethod
    def parse(cls, text: str) -> StateRule:
        """``"pooled:2"``, ``"median:4"``, ``"median:all"``, ``"matched:all"``, ``"matched:all+probe"``
        or ``"adaptive"``."""
        base, plus, extra = text.strip().partition("+")
        if plus and extra != "probe":
            raise ConfigError(f"a state rule's only suffix is '+probe', got {text!r}")
        how, _, window = base.partition(":")
        if how == "adaptive":
            if window:
                raise ConfigError(f"the adaptive state rule takes no window, got {text!r}")
            return cls("adaptive", ALL, probe=bool(plus))
        if window == "all":
            return cls(how, ALL, probe=bool(plus))
        try:
            size = int(window)
        except ValueError:
            size = None
        if how not in ("pooled", "median", "matched") or size is None:
            raise ConfigError(
                "a state rule is 'pooled:W', 'median:W', 'median:all', 'matched:W', 'matched:all' "
                f"(either with '+probe') or 'adaptive', got {text!r}"
            )
        return cls(how, size, probe=bool(plus))

    def __str__(self) -> str:
        if self.how == "adaptive":
            return "adaptive"
        return f"{self.how}:{'all' if self.window == ALL else self.window}" + ("+probe" if self.probe else "")


ADAPTIVE_CANDIDATES = (
    StateRule("median", ALL),
    StateRule("median", 8),
    StateRule("median", 4),
    StateRule("pooled", 2),
    StateRule("pooled", 1),
)
"""What ``adaptive`` chooses among, the longest memory first (its default, and the choice on a tie)."""
ADAPTIVE_LOOKBACK = 6
"""How many of the job's newest checkpoints ``adaptive`` scores the candidates on."""
PROBE_MIN_CHECKPOINTS = 4
"""Probed checkpoints a ``+probe`` rule needs in its window before it may follow the probe."""


def _mad(values: np.ndarray) -> float:
    """The median absolute deviation from the median."""
    return float(np.median(np.abs(values - np.median(values))))


def _key(samples: Sequence[WriterSample]) -> int:
    return samples[0].checkpoint


def _typical_size(samples: Sequence[WriterSample]) -> float:
    return float(np.median([s.nbytes for s in samples]))


def _typical_seconds(samples: Sequence[WriterSample]) -> float:
    return float(np.median([s.seconds for s in samples]))


def _writers(samples: Sequence[WriterSample]) -> int:
    return max(s.writers for s in samples)


class StateEstimator:
    """A rule applied to one fit: :meth:`state` of a job from its checkpoints so far.

    ``history`` arguments are a job's checkpoints oldest first, each its writers' samples (one
    :attr:`~shoal.model.writers.WriterSample.checkpoint` each: the estimator remembers its work
    by it, so a number must not be reused for other records under the same estimator).
    ``pace``: as :func:`~shoal.model.writers.estimate_state`'s.
    """

    def __init__(self, fit: WriterFit, rule: StateRule, *, pace: Callable[[], None] | None = None) -> None:
        self.fit = fit
        self.rule = rule
        self.pace = pace
        self._own: dict[int, float] = {}
        """Per checkpoint, ln b_shared from its own writers."""
        self._matched: dict[int, float] = {}
        """Per checkpoint, ln b_shared at which the typical writer matches its median writer."""
        self._errors: dict[tuple[StateRule, int], float | None] = {}
        """Per candidate and checkpoint, |ln(observed / predicted)| of its typical writer."""
        self.last_choice: StateRule | None = None
        """The rule ``adaptive`` used for the newest state (else the rule itself)."""

    def state(
        self,
        history: Sequence[Sequence[WriterSample]],
        probes: Sequence[float | None] | None = None,
        probe: float | None = None,
    ) -> TierState | None:
        """The tier state for the job's next checkpoint (None: no history yet).

        ``probes``: the rate (bytes per second) a probe of the tier got just before each
        checkpoint of ``history`` (None where there was none); ``probe``: the one just taken,
        before the next. A ``+probe`` rule uses them (see the module); without them it is its
        rule without the probe."""
        if probes is not None and len(probes) != len(history):
            raise ConfigError(f"{len(probes)} probes for {len(history)} checkpoints: one per checkpoint")
        pairs = list(zip(history, probes if probes is not None else [None] * len(history), strict=True))
        pairs = [(h, p) for h, p in pairs if h]
        if not pairs:
            return None
        history = [h for h, _ in pairs]
        rule = self._choose(history) if self.rule.how == "adaptive" else self.rule
        self.last_choice = rule
        if rule.probe and probe is not None:
            followed = self._follow_probe(rule, pairs, probe)
            if followed is not None:
                return followed
        return self._apply(rule, history)

    def _follow_probe(
        self, rule: StateRule, pairs: Sequence[tuple[Sequence[WriterSample], float | None]], probe: float
    ) -> TierState | None:
        """The ``+probe`` state (see the module), or None where no checkpoint had a probe before it."""
        probed = [(self.matched(h), math.log(p)) for h, p in pairs if p is not None and p > 0]
        window = probed if rule.window == ALL else probed[-rule.window :]
        if len(window) < PROBE_MIN_CHECKPOINTS or probe <= 0:
            return None
        alone = np.array([b for b, _ in window])
        relative = alone - np.array([r for _, r in window])
        if _mad(relative) >= _mad(alone):  # the probes explain nothing the checkpoints did
            return None
        return TierState(math.exp(float(np.median(relative)) + math.log(probe)))

    def own(self, samples: Sequence[WriterSample]) -> float:
        """ln b_shared that one checkpoint's writers alone give (remembered)."""
        key = _key(samples)
        value = self._own.get(key)
        if value is None:
            value = math.log(estimate_state(self.fit, samples, pace=self.pace).b_shared)
            self._own[key] = value
        return value

    def matched(self, samples: Sequence[WriterSample]) -> float:
        """ln b_shared at which the fit's typical writer takes the checkpoint's median time (remembered).

        Where no ``b_shared`` near the checkpoint's own estimate gets there (the writers were
        bound by ``b_client``, not the tier), it is that estimate (:meth:`own`).
        """
        key = _key(samples)
        value = self._matched.get(key)
        if value is None:
            value = self._match(samples)
            self._matched[key] = value
        return value

    def _match(self, samples: Sequence[WriterSample]) -> float:
        own = self.own(samples)
        size, writers = _typical_size(samples), _writers(samples)
        target = math.log(_typical_seconds(samples))

        def gap(log_b: float) -> float:
            if self.pace is not None:
                self.pace()
            return math.log(self.fit.typical(size, writers, TierState(math.exp(log_b)))) - target

        lo, hi = own - 2.0, own + 2.0
        if gap(lo) * gap(hi) > 0:  # the tier's share does not decide this writer's time
            return own
        return float(optimize.brentq(gap, lo, hi, xtol=1e-6))

    def _apply(self, rule: StateRule, history: Sequence[Sequence[WriterSample]]) -> TierState:
        if rule.how == "pooled":
            recent = [s for h in history[-rule.window :] for s in h]
            return estimate_state(self.fit, recent, pace=self.pace)
        window = history if rule.window == ALL else history[-rule.window :]
        each = self.matched if rule.how == "matched" else self.own
        return TierState(math.exp(float(np.median([each(h) for h in window]))))

    def _error(self, rule: StateRule, history: Sequence[Sequence[WriterSample]], k: int) -> float | None:
        """How far ``rule``, from ``history[:k]``, was from checkpoint ``k``'s typical writer."""
        key = (rule, _key(history[k]))
        if key not in self._errors:
            target = history[k]
            error = None
            if k > 0:
                state = self._apply(rule, history[:k])
                predicted = self.fit.typical(_typical_size(target), _writers(target), state)
                error = abs(math.log(_typical_seconds(target) / predicted))
            self._errors[key] = error
        return self._errors[key]

    def _choose(self, history: Sequence[Sequence[WriterSample]]) -> StateRule:
        first = range(max(1, len(history) - ADAPTIVE_LOOKBACK), len(history))
        scores: dict[StateRule, float] = {}
        for rule in ADAPTIVE_CANDIDATES:
            errors = [e for k in first if (e := self._error(rule, history, k)) is not None]
            if len(errors) >= 2:
                scores[rule] = float(np.mean(errors))
        if not scores:
            return ADAPTIVE_CANDIDATES[0]
        return min(ADAPTIVE_CANDIDATES, key=lambda r: scores.get(r, math.inf))
