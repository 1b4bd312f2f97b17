"""The durability path of each checkpoint: ``partner`` (B2 on a partner host, then the drain) or ``direct``.

DESIGN.md sections 4 and 7. The coordinator decides, checkpoint by checkpoint, at plan time
(C2 of :mod:`shoal.engine.group_save`), by asking a :class:`PathPolicy` with what it knows
then (:class:`PathContext`: the job's ranks and hosts, the bytes the ranks staged, and the
records of recent checkpoints). The decision and its reason travel with the plan to every
rank, and go to each rank's handle (``SaveHandle.path``, ``SaveHandle.path_reason``), the
manifest (``Manifest.path``) and the event log (a ``path`` event). The default policy is
:class:`RulePolicy` (``Config.path``: ``"auto"`` is "partner when the job spans hosts");
the completion-time model plugs in here as another policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from shoal.errors import ConfigError

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


def default_policy(path: str) -> PathPolicy:
    """The policy of ``Config.path``: the rule, for ``"partner"`` and ``"direct"`` and (for now) ``"auto"``."""
    return RulePolicy(path)


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
    "PARTNER",
    "PathContext",
    "PathDecision",
    "PathHistory",
    "PathPolicy",
    "PathRecord",
    "RulePolicy",
    "decide_path",
    "default_policy",
]
