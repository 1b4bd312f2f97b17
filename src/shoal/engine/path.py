"""The durability path of each checkpoint: ``partner`` (B2 on a partner host, then the drain) or ``direct``.

docs/design.md sections 4 and 7. The coordinator decides, checkpoint by checkpoint, at plan time
(C2 of :mod:`shoal.engine.group_save`), by asking a :class:`PathPolicy` with what it knows
then (:class:`PathContext`: the job's ranks and hosts, the bytes the ranks staged, and the
records of recent checkpoints). The decision and its reason travel with the plan to every
rank, and go to each rank's handle (``SaveHandle.path``, ``SaveHandle.path_reason``), the
manifest (``Manifest.path``) and the event log (a ``path`` event). ``Config.path`` picks the
default policy (:func:`default_policy`): :class:`RulePolicy` for ``"partner"`` and ``"direct"``,
and for ``"auto"`` :class:`ModelPolicy`, which asks the completion-time model once the job's own
records can fit it (a rule until then).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from shoal.errors import ConfigError
from shoal.model.paths import PathModel, PathPrediction, PathTimes
from shoal.records.events import EventLog

log = logging.getLogger(__name__)

PARTNER = "partner"
DIRECT = "direct"
CHOICES = (PARTNER, DIRECT)


@dataclass(frozen=True)
class PathRecord:
    """What one finished checkpoint showed (the coordinator's own observation)."""

    step: int
    path: str
    logical_bytes: int
    seconds: dict[str, float]
    """Seconds from the save call to each boundary reached, by boundary name (``STAGED``...)."""
    failed: bool = False
    times: PathTimes | None = None
    """The checkpoint's parts and every rank's writer times (the completion-time model's evidence);
    None for a failed checkpoint."""


@dataclass(frozen=True)
class PathContext:
    """What the coordinator knows when it decides a checkpoint's path."""

    step: int
    world_size: int
    hosts: tuple[str, ...]
    logical_bytes: int
    """Bytes the ranks staged for this checkpoint (before dedup)."""
    can_replicate: bool
    """Whether partner copies are possible at all (more than one host, partners found)."""
    recent: Sequence[PathRecord] = field(default_factory=tuple)
    """Recent checkpoints of this process, oldest first (at most ``PathHistory.limit``)."""


@dataclass(frozen=True)
class PathDecision:
    """A policy's answer: the path, and why (for the handle, the manifest and the event log)."""

    path: str
    reason: str
    predictions: Mapping[str, Any] | None = None
    """What a model predicted for each path (JSON-ready; the ``path`` event records it)."""

    def __post_init__(self) -> None:
        if self.path not in CHOICES:
            raise ConfigError(f"a path policy chose {self.path!r}; the paths are {', '.join(CHOICES)}")


@runtime_checkable
class PathPolicy(Protocol):
    """Decides each checkpoint's path on the coordinator. Called from the pipeline's thread."""

    def decide(self, context: PathContext) -> PathDecision: ...


@dataclass(frozen=True)
class RulePolicy:
    """The rule ``Config.path`` names: ``"partner"``, ``"direct"``, or ``"auto"`` (partner across hosts)."""

    path: str = "auto"

    def decide(self, context: PathContext) -> PathDecision:
        if self.path == DIRECT:
            return PathDecision(DIRECT, "Config.path='direct'")
        if self.path == PARTNER:
            return PathDecision(PARTNER, "Config.path='partner'")
        if context.can_replicate:
            return PathDecision(PARTNER, f"path='auto': the job spans {len(context.hosts)} hosts")
        return PathDecision(DIRECT, "path='auto': one host (or no partner possible): no partner copy")


class PathHistory:
    """The coordinator's recent :class:`PathRecord` s (a bounded list; the pipeline appends)."""

    limit = 64

    def __init__(self) -> None:
        self._records: list[PathRecord] = []

    def add(self, record: PathRecord) -> None:
        self._records.append(record)
        del self._records[: -self.limit]

    def recent(self) -> tuple[PathRecord, ...]:
        return tuple(self._records)


class ModelPolicy:
    """``path="auto"`` by the completion-time model: the path with the lower predicted time to B2.

    On the coordinator, each checkpoint: the ``quantile`` (default p90) of the time to B2 by
    each path, from :class:`~shoal.model.paths.PathModel` (the shared tier's writers for
    ``direct``; the partner copies, fabric transfer and host-tier write, for ``partner``; each
    tier's present state from the newest checkpoints), and the lower wins. The choice changes
    only when the other path is predicted at least ``margin`` (a fraction) sooner, so noise
    does not flip it checkpoint by checkpoint.

    Cold start: ``fallback`` (the rule ``"auto"``: partner across hosts) decides until each path
    has a fit from ``min_checkpoints`` checkpoints (the first checkpoint of the process, its
    warm-up, not counted). Every checkpoint drains, so the ``direct`` fit learns whichever path
    is taken; the ``partner`` fit learns during the cold start and whenever partner is chosen.
    The fits are redone every ``refit_every`` checkpoints after one finishes (:meth:`observe`),
    over the history the coordinator keeps (:class:`PathHistory`).

    The decision's reason names both predictions; ``PathDecision.predictions`` (the ``path``
    event) holds them whole, and the ``path_observed`` event the times that followed.
    """

    def __init__(
        self,
        *,
        quantile: float = 0.9,
        min_checkpoints: int = 4,
        refit_every: int = 8,
        margin: float = 0.05,
        fallback: PathPolicy | None = None,
        background: bool = True,
    ) -> None:
        if not 0 < quantile < 1:
            raise ConfigError(f"ModelPolicy quantile must be in (0, 1), got {quantile!r}")
        if min_checkpoints < 2 or refit_every < 1:
            raise ConfigError(
                "ModelPolicy needs min_checkpoints >= 2 and refit_every >= 1, "
                f"got {min_checkpoints} and {refit_every}"
            )
        if not 0 <= margin < 1:
            raise ConfigError(f"ModelPolicy margin must be in [0, 1), got {margin!r}")
        self.quantile = quantile
        self.margin = margin
        self.refit_every = refit_every
        self.fallback = fallback or RulePolicy("auto")
        self.model = PathModel(min_checkpoints=min_checkpoints)
        self.background = background
        self._since_fit = 0
        self._last: str | None = None
        self._fitting: threading.Thread | None = None
        self._ahead: tuple[int, int, dict[str, PathPrediction]] | None = None
        """Predictions made after the newest checkpoint: its step, its bytes, each path's prediction."""

    def decide(self, context: PathContext) -> PathDecision:
        history = _evidence(context.recent)
        if not context.can_replicate or not all(self.model.ready(p) for p in CHOICES):
            rule = self.fallback.decide(context)
            if context.can_replicate:
                return PathDecision(
                    rule.path, f"{rule.reason} (the model is warming up: {len(history)} seen)"
                )
            return rule
        q = self.quantile
        ahead = self._ahead
        if ahead is not None and history and ahead[0] == history[-1].checkpoint and ahead[1] > 0:
            factor = context.logical_bytes / ahead[1]
            predictions = {p: v.scaled(factor) for p, v in ahead[2].items()}
        else:  # none made ahead for the newest checkpoint (the first decision, an update running)
            predictions = {p: self.model.predict(p, q, context.logical_bytes, history) for p in CHOICES}
        path = min(CHOICES, key=lambda p: predictions[p].seconds)
        last = self._last
        if last is not None and predictions[path].seconds > predictions[last].seconds * (1.0 - self.margin):
            path = last  # the other path is not sooner by the margin: keep this one
        self._last = path
        return PathDecision(path, _reason(q, predictions), {p: v.to_json() for p, v in predictions.items()})

    def observe(self, recent: Sequence[PathRecord]) -> None:
        """After a checkpoint finished: refit when due (and while a path still has no fit), then
        predict both paths for a checkpoint like this one.

        With ``background`` (the default) this runs in a thread of its own, one at a time, and
        the decisions go on with what there is: neither a fit (a fraction of a second to a few
        seconds on a busy host) nor a prediction holds up the pipeline, so the next checkpoint's
        B2. The next decision scales the predictions to its own bytes (exact: sizes enter the
        model as ``ln S``); one that finds none made ahead for the newest checkpoint predicts itself.
        """
        self._since_fit += 1
        history = _evidence(recent)
        if not history or (self._fitting is not None and self._fitting.is_alive()):
            return  # an update still running: the next decision predicts for itself
        refit = self._since_fit >= self.refit_every or not all(self.model.ready(p) for p in CHOICES)
        if refit:
            self._since_fit = 0
        if not self.background:
            self._update(history, refit)
            return
        self._fitting = threading.Thread(
            target=self._update, args=(history, refit), name="shoal-path-model", daemon=True
        )
        self._fitting.start()

    def _update(self, history: list[PathTimes], refit: bool) -> None:
        try:
            if refit:
                self.model.refit(history)
            if all(self.model.ready(p) for p in CHOICES):
                newest = history[-1]
                predictions = {
                    p: self.model.predict(p, self.quantile, newest.logical_bytes, history) for p in CHOICES
                }
                self._ahead = (newest.checkpoint, newest.logical_bytes, predictions)
        except Exception:  # a failed update leaves the last fits in place; decisions predict inline
            log.warning("the path model's update failed; the previous fits stay", exc_info=True)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background update under way (tests, benchmarks)."""
        if self._fitting is not None:
            self._fitting.join(timeout)


def _evidence(recent: Sequence[PathRecord]) -> list[PathTimes]:
    """The records a model learns from: finished checkpoints with times, the process's first left out."""
    return [r.times for r in recent[1:] if r.times is not None and not r.failed] if recent else []


def _reason(q: float, predictions: Mapping[str, PathPrediction]) -> str:
    said = ", ".join(f"{p} {v.seconds:.3g} s" for p, v in predictions.items())
    return f"path='auto': the model's p{round(q * 100)} time to B2: {said}"


def record_outcome(
    history: PathHistory, policy: PathPolicy, events: EventLog, decision: PathDecision, record: PathRecord
) -> None:
    """The coordinator, once a checkpoint finished: ``record`` joins the history the policy is
    shown and goes to the policy's ``observe`` when it has one (a model refits there, after the
    checkpoint, not at the next plan); the times observed go to the event log beside the
    prediction the decision made (``path_observed``)."""
    history.add(record)
    observe = getattr(policy, "observe", None)
    if callable(observe):
        try:
            observe(history.recent())
        except Exception:  # a policy's bookkeeping never fails a checkpoint
            log.warning("step %d: the path policy's observe failed", record.step, exc_info=True)
    times = record.times
    if times is not None:
        predicted = (decision.predictions or {}).get(decision.path)
        events.emit(
            "path_observed", record.step, path=decision.path, predicted=predicted,
            pre=times.pre, b2=times.b2, b3=times.b3,
        )  # fmt: skip


def default_policy(path: str) -> PathPolicy:
    """``Config.path``'s policy: the rule for ``"partner"`` and ``"direct"``, the model for ``"auto"``."""
    return ModelPolicy() if path == "auto" else RulePolicy(path)


def decide_path(policy: PathPolicy, context: PathContext) -> PathDecision:
    """Ask ``policy``; a partner path where none is possible becomes direct, saying so."""
    decision = policy.decide(context)
    if not isinstance(decision, PathDecision):
        raise ConfigError(
            f"{type(policy).__name__}.decide returned {type(decision).__name__}, not a PathDecision"
        )
    if decision.path == PARTNER and not context.can_replicate:
        return PathDecision(DIRECT, f"{decision.reason}; but no partner host is possible: direct")
    return decision


__all__ = [
    "CHOICES",
    "DIRECT",
    "ModelPolicy",
    "PARTNER",
    "PathContext",
    "PathDecision",
    "PathHistory",
    "PathPolicy",
    "PathRecord",
    "RulePolicy",
    "decide_path",
    "default_policy",
    "record_outcome",
]
