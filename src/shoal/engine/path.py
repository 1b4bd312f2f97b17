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

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from shoal.engine.path_worker import ModelWorker, Pacer, run_update
from shoal.errors import ConfigError
from shoal.model.paths import PathModel, PathPrediction, PathTimes
from shoal.model.writers import WriterFit
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
    cost: Mapping[str, Any] | None = None
    """What deciding cost (JSON-ready; the ``path`` event records it): :func:`decide_path` adds
    the decision's own seconds and thread; a model policy the update its predictions came from."""

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

    **Nothing of the model runs inside a save.** After each checkpoint (:meth:`observe`) an
    update refits the writers when due (every ``refit_every`` checkpoints, and while a path has
    no fit yet), estimates each tier's present state and predicts both paths for a checkpoint
    like the newest one. With ``background`` (the default) the update runs in a process of its
    own (:mod:`shoal.engine.path_worker`: ``nice 19``, at most ``cpu_share`` of one core), one at
    a time; ``worker="thread"`` runs it in a thread instead (the coordinator's interpreter lock
    is then shared with it), and ``background=False`` in :meth:`observe` itself. The decision
    at plan time is a lookup: the newest update's predictions, scaled to this checkpoint's bytes
    (exact: sizes enter the model as ``ln S``). Where the update after the newest checkpoint
    has not landed yet, the previous decision stands, and its reason says so.

    Cold start: ``fallback`` (the rule ``"auto"``: partner across hosts) decides until each path
    has a fit from ``min_checkpoints`` checkpoints (the first checkpoint of the process, its
    warm-up, not counted). Every checkpoint drains, so the ``direct`` fit learns whichever path
    is taken; the ``partner`` fit learns during the cold start and whenever partner is chosen.
    A job that cannot make partner copies (one host) never runs the model.

    The decision's reason names both predictions; ``PathDecision.predictions`` (the ``path``
    event) holds them whole, ``PathDecision.cost`` what the decision and the update behind it
    cost and where they ran, and the ``path_observed`` event the times that followed.
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
        worker: str = "process",
        cpu_share: float = 0.5,
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
        if worker not in ("process", "thread"):
            raise ConfigError(f"ModelPolicy worker must be 'process' or 'thread', got {worker!r}")
        if not 0 < cpu_share <= 1:
            raise ConfigError(f"ModelPolicy cpu_share must be in (0, 1], got {cpu_share!r}")
        self.quantile = quantile
        self.margin = margin
        self.refit_every = refit_every
        self.fallback = fallback or RulePolicy("auto")
        self.model = PathModel(min_checkpoints=min_checkpoints)
        self.background = background
        self.worker = worker
        self.cpu_share = cpu_share
        self._since_fit = 0
        self._last: str | None = None
        self._replicable = True
        self._ahead: tuple[int, int, dict[str, PathPrediction]] | None = None
        """Predictions made after the newest checkpoint: its step, its bytes, each path's prediction."""
        self._cost: dict[str, Any] | None = None
        """What the newest update that landed cost, and where it ran."""
        self._busy = threading.Condition()
        self._pending = 0
        """Updates submitted and not yet answered (0 or 1)."""
        self._sequence = 0
        self._process: ModelWorker | None = None
        self._in_process: int | None = None
        """The update the worker process was given last (its sequence number)."""
        self._process_failed: str | None = None
        self._thread_pacer: Pacer | None = None

    def decide(self, context: PathContext) -> PathDecision:
        self._replicable = context.can_replicate
        ahead = self._ahead
        if not context.can_replicate or ahead is None:
            rule = self.fallback.decide(context)
            if context.can_replicate:
                seen = len(_evidence(context.recent))
                return PathDecision(rule.path, f"{rule.reason} (the model is warming up: {seen} seen)")
            return rule
        at, nbytes, made = ahead
        factor = context.logical_bytes / nbytes if nbytes > 0 and context.logical_bytes > 0 else 1.0
        predictions = {p: v.scaled(factor) for p, v in made.items()}
        newest = _newest_evidence(context.recent)
        cost = None if self._cost is None else {"update": dict(self._cost)}
        as_json = {p: v.to_json() for p, v in predictions.items()}
        last = self._last
        if last is not None and newest is not None and newest != at:
            reason = (
                f"{_reason(self.quantile, predictions)} (made after checkpoint {at}); the update "
                f"after checkpoint {newest} has not landed: the previous decision ({last}) stands"
            )
            return PathDecision(last, reason, as_json, cost)
        path = min(CHOICES, key=lambda p: predictions[p].seconds)
        if last is not None and predictions[path].seconds > predictions[last].seconds * (1.0 - self.margin):
            path = last  # the other path is not sooner by the margin: keep this one
        self._last = path
        return PathDecision(path, _reason(self.quantile, predictions), as_json, cost)

    def observe(self, recent: Sequence[PathRecord]) -> None:
        """After a checkpoint finished: start the model's update (see the class), unless one is
        still running (the decisions go on with what there is) or the job cannot replicate."""
        self._since_fit += 1
        history = _evidence(recent)
        if not history or not self._replicable:
            return
        with self._busy:
            if self._pending:
                return  # an update still running: the next decisions keep the previous one
            refit = self._since_fit >= self.refit_every or not all(self.model.ready(p) for p in CHOICES)
            if refit:
                self._since_fit = 0
            self._pending = 1
            self._sequence += 1
            sequence = self._sequence
        if not self.background:
            self._run_here(history, refit, sequence, "inline")
            return
        if self.worker == "process" and self._process_failed is None:
            try:
                self._submit(history, refit, sequence)
                return
            except OSError as e:
                self._worker_failed(f"cannot use a worker process ({e})")
        threading.Thread(
            target=self._run_here, args=(history, refit, sequence, "thread"), name="shoal-path-model",
            daemon=True,
        ).start()  # fmt: skip

    def _submit(self, history: list[PathTimes], refit: bool, sequence: int) -> None:
        if self._process is None:
            process = ModelWorker(
                min_checkpoints=self.model.min_checkpoints,
                state_rule=str(self.model.state_rule),
                cpu_share=self.cpu_share,
                on_answer=self._answered,
                on_exit=self._worker_exited,
            )
            process.start()
            self._process = process
        self._in_process = sequence
        self._process.submit(
            {
                "id": sequence,
                "refit": refit,
                "quantile": self.quantile,
                "history": [h.to_json() for h in history],
            }
        )

    def _run_here(self, history: list[PathTimes], refit: bool, sequence: int, where: str) -> None:
        """The update in this process (a thread, or :meth:`observe` itself)."""
        answer: dict[str, Any] = {"id": sequence}
        try:
            if where == "thread" and self._thread_pacer is None:
                self._thread_pacer = Pacer(self.cpu_share)
            pacer = self._thread_pacer if where == "thread" else None
            answer.update(run_update(self.model, history, refit=refit, quantile=self.quantile, pacer=pacer))
            answer["cost"].update(where=where, thread=threading.current_thread().name)
        except Exception:  # a failed update leaves the last fits in place
            log.warning("the path model's update failed; the previous fits stay", exc_info=True)
            answer["error"] = "failed (logged)"
        self._answered(answer)

    def _answered(self, answer: Mapping[str, Any]) -> None:
        """An update's answer (any thread): the fits and the predictions ahead swap in whole."""
        try:
            if answer.get("error"):
                if answer["error"] != "failed (logged)":
                    log.warning("the path model's update failed; the previous fits stay: %s", answer["error"])
                return
            fits = {p: WriterFit.from_json(f) for p, f in answer["fits"].items()}
            self.model.fits = {**self.model.fits, **fits}
            ahead = answer.get("ahead")
            if ahead is not None:
                made = {p: PathPrediction.from_json(v) for p, v in ahead["predictions"].items()}
                self._ahead = (int(ahead["checkpoint"]), int(ahead["logical_bytes"]), made)
            self._cost = dict(answer["cost"])
        except Exception:
            log.warning("the path model's update answered nonsense; the previous fits stay", exc_info=True)
        finally:
            with self._busy:
                if answer.get("id") == self._sequence:
                    self._pending = 0
                self._busy.notify_all()

    def _worker_exited(self, message: str) -> None:
        if message != "closed":
            self._worker_failed(message)
        with self._busy:
            if self._in_process == self._sequence:  # lost with the worker: the next observe starts another
                self._pending = 0
            self._busy.notify_all()

    def _worker_failed(self, message: str) -> None:
        if self._process_failed is None:
            log.warning("the path model's %s: its updates run in a thread from now on", message)
        self._process_failed = message

    @property
    def last_update(self) -> Mapping[str, Any] | None:
        """What the newest update that landed cost, and where it ran (``PathDecision.cost["update"]``)."""
        return self._cost

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for an update under way (tests, benchmarks); False if it is still running."""
        with self._busy:
            return self._busy.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        """End the worker process, if one was started (the Checkpointer's close calls this)."""
        process, self._process = self._process, None
        if process is not None:
            process.close()


def _evidence(recent: Sequence[PathRecord]) -> list[PathTimes]:
    """The records a model learns from: finished checkpoints with times, the process's first left out."""
    return [r.times for r in recent[1:] if r.times is not None and not r.failed] if recent else []


def _newest_evidence(recent: Sequence[PathRecord]) -> int | None:
    """The newest checkpoint :func:`_evidence` would show the model (None: none)."""
    for r in reversed(recent[1:]):
        if r.times is not None and not r.failed:
            return r.times.checkpoint
    return None


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
    start, cpu = time.perf_counter(), time.thread_time()
    decision = policy.decide(context)
    seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu
    if not isinstance(decision, PathDecision):
        raise ConfigError(
            f"{type(policy).__name__}.decide returned {type(decision).__name__}, not a PathDecision"
        )
    if decision.path == PARTNER and not context.can_replicate:
        decision = PathDecision(
            DIRECT, f"{decision.reason}; but no partner host is possible: direct", decision.predictions,
            decision.cost,
        )  # fmt: skip
    cost = {
        **(decision.cost or {}),
        "decide_s": seconds,
        "decide_cpu_s": cpu_seconds,
        "thread": threading.current_thread().name,
        "when": "before the plan",
    }
    return dataclasses.replace(decision, cost=cost)


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
