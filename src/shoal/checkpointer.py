"""``shoal.Checkpointer``: the manager API (save, load, latest, close) on top of DCP.

``save`` is two-phase: it returns at B1 once the state is copied into the rank's
pre-faulted DRAM slab, with a :class:`SaveHandle` that the background pipeline
advances through B3 and B4. ``load`` reads through DCP's planner, so DTensor and
ShardedTensor state and resharding work, and verifies every chunk it reads.

A thin client of the engine runtime (:class:`shoal.engine.runtime.Runtime`), like
:mod:`shoal.dcp`: it drives ``dcp.save``/``dcp.load`` with shoal's writer and reader over
the same sessions a user's own ``dcp.save`` would use.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import io
import logging
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.api import CheckpointException

from shoal import dcp as shoal_dcp
from shoal._collector import collector_paused
from shoal.boundary import Boundary
from shoal.config import Config
from shoal.engine.handle import SaveHandle
from shoal.engine.path import PathPolicy
from shoal.engine.restore import LoadReport, sources_in
from shoal.engine.runtime import Runtime
from shoal.errors import ShoalError, UnsupportedValue
from shoal.format import layout
from shoal.format.manifest import Manifest
from shoal.group.topology import Topology
from shoal.tiers.base import Tier
from shoal.tiers.dram import DramTier
from shoal.tiers.local import PosixTier

log = logging.getLogger(__name__)


@contextmanager
def _unwrapped_errors() -> Iterator[None]:
    """Re-raise shoal's own error when DCP wraps it in its ``CheckpointException`` (a BaseException).

    With one failing rank (every failure on one host today) the caller gets the error
    that rank raised, e.g. :class:`InvalidName` or :class:`InsufficientMemory`.
    """
    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        originals = [f[0] if isinstance(f, tuple) else f for f in failures]
        if originals and all(isinstance(o, Exception) for o in originals):
            raise originals[0] from None
        raise


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's 'assuming the intent is to save in a single process' warning: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


_dcp_log_lock = threading.Lock()
_dcp_log_quieted = 0
_dcp_log_level = logging.NOTSET


def _records_go_nowhere(logger: logging.Logger) -> bool:
    """Whether ``logger``'s records reach no one: no filter, only ``NullHandler``s, no propagation."""
    return (
        not logger.propagate
        and not logger.filters
        and all(type(h) is logging.NullHandler for h in logger.handlers)
    )


@contextmanager
def _quiet_dcp_logger() -> Iterator[None]:
    """Skip the two debug records DCP's logging wrapper makes per state-dict key, while nobody reads them.

    ``dcp.save`` wraps the ``state_dict()`` resolution of every key in a logging wrapper that
    emits two DEBUG records to DCP's logger (about 20 us per key). That logger ships at DEBUG
    with only a ``NullHandler`` and does not propagate, so the records are made and dropped.
    While that is so, its level is raised to INFO for the block (exceptions are still logged,
    at ERROR); a logger someone configured (another handler, a filter, propagation) is left
    as it is. Nested and concurrent blocks restore the level once, when the last one ends.
    """
    global _dcp_log_quieted, _dcp_log_level
    try:
        from torch.distributed.checkpoint import logger as dcp_logging

        logger = dcp_logging._dcp_logger
    except (ImportError, AttributeError):  # another torch: nothing to do
        yield
        return
    with _dcp_log_lock:
        quiet = _dcp_log_quieted > 0 or (_records_go_nowhere(logger) and logger.level < logging.INFO)
        if quiet:
            if _dcp_log_quieted == 0:
                _dcp_log_level = logger.level
                logger.setLevel(logging.INFO)
            _dcp_log_quieted += 1
    try:
        yield
    finally:
        if quiet:
            with _dcp_log_lock:
                _dcp_log_quieted -= 1
                if _dcp_log_quieted == 0:
                    logger.setLevel(_dcp_log_level)


_SAVE_PARAMETERS = frozenset({"state_dict", "storage_writer", "process_group", "no_dist", "planner"})


@functools.cache
def _dcp_save_state_dict() -> Callable[..., Any] | None:
    """DCP's ``_save_state_dict`` (what ``dcp.save`` runs after resolving ``Stateful`` values), when
    this torch has it with the parameters shoal passes; else None (``dcp.save`` is used)."""
    try:
        from torch.distributed.checkpoint import state_dict_saver

        fn: Callable[..., Any] = state_dict_saver._save_state_dict
        parameters = set(inspect.signature(fn).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return fn if parameters >= _SAVE_PARAMETERS else None


def _resolved(state: Mapping[str, Any]) -> dict[str, Any]:
    """``dcp.save``'s shallow copy of ``state``, each ``Stateful`` value replaced by its ``state_dict()``."""
    from torch import Tensor
    from torch.distributed.checkpoint.stateful import Stateful

    # type(v) is Tensor: a plain tensor is never Stateful, and the protocol check costs ~5 us a key.
    return {
        k: v if type(v) is Tensor else (v.state_dict() if isinstance(v, Stateful) else v)
        for k, v in state.items()
    }


def _dcp_save(state: Mapping[str, Any], writer: shoal_dcp.StorageWriter, *, no_dist: bool) -> None:
    """``dcp.save(state, storage_writer=writer, planner=shoal_dcp.SavePlanner(), no_dist=no_dist)``.

    While DCP's logger reaches no one, without ``dcp.save``'s logging wrapper around every key
    (a closure, a ``uuid4`` and two records each, about 15 us a key, and more when the pipeline
    thread holds the GIL): the ``Stateful`` values are resolved as ``dcp.save`` does, and DCP's
    ``_save_state_dict`` is called directly. Otherwise, or with another torch, ``dcp.save`` itself.
    """
    from torch.distributed.checkpoint import logger as dcp_logging

    planner = shoal_dcp.SavePlanner()
    direct = _dcp_save_state_dict()
    logger = getattr(dcp_logging, "_dcp_logger", None)
    if direct is None or not isinstance(logger, logging.Logger) or not _records_go_nowhere(logger):
        torch_dcp.save(dict(state), storage_writer=writer, planner=planner, no_dist=no_dist)
        return
    import torch.distributed as dist

    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    direct(
        state_dict=_resolved(state),
        storage_writer=writer,
        process_group=None,
        no_dist=no_dist,
        planner=planner,
    )


class Checkpointer:
    """Saves and loads a job's checkpoints through shoal's tiers.

    Create one per process, after ``torch.distributed.init_process_group`` if the
    job is distributed: construction is collective (it creates shoal's background
    gloo group and learns which ranks share a host). ``save`` and ``load`` are
    collective too: every rank calls them with the same step, in the same order.
    Use it as a context manager, or call :meth:`close`; at interpreter exit,
    in-flight checkpoints are finished (up to ``Config.close_timeout`` seconds).

    ``path_policy`` decides each checkpoint's durability path (``partner`` or ``direct``) on
    the coordinator (:class:`shoal.engine.path.PathPolicy`); by default the rule of
    ``Config.path``. Every rank passes one (only the coordinator's is asked).
    """

    def __init__(self, config: Config, *, path_policy: PathPolicy | None = None) -> None:
        self.runtime = Runtime(config, path_policy=path_policy)
        """The engine this Checkpointer drives (shared with ``shoal.dcp``'s writer and reader)."""
        self.last_load: LoadReport | None = None
        """What the last :meth:`load` used: step, metadata origin, bytes per tier."""
        self.last_heal: SaveHandle | None = None
        """The save that heals the last checkpoint :meth:`load` restored, if it was uncommitted."""
        atexit.register(self._at_exit)

    # -- what the runtime is -------------------------------------------------
    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def config(self) -> Config:
        """The config, resolved for this rank (host id, roots, event log)."""
        return self.runtime.config

    @property
    def host(self) -> str:
        return self.runtime.host

    @property
    def run_id(self) -> str:
        """This run's id (``<shared>/<job>/RUN``)."""
        return self.runtime.run_id

    @property
    def shared(self) -> Tier:
        return self.runtime.shared

    @property
    def dram(self) -> DramTier:
        """This run's DRAM tier on this host."""
        return self.runtime.dram

    @property
    def local(self) -> PosixTier:
        """This run's local-disk tier on this host (partner copies, the event log)."""
        return self.runtime.local

    @property
    def topology(self) -> Topology:
        return self.runtime.topology

    @property
    def replicating(self) -> bool:
        """Whether checkpoints go through partner hosts (B2 before B3), not straight to shared storage."""
        return self.runtime.replicating

    def __repr__(self) -> str:
        return f"Checkpointer(shared={self.shared.url!r}, host={self.host!r}, rank={self.rank})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- save ----------------------------------------------------------------
    def save(self, step: int, state_dict: Mapping[str, Any]) -> SaveHandle:
        """Stage ``state_dict`` as checkpoint ``step`` and return at B1 (collective).

        The returned handle reaches B2 when every new chunk and the manifest are on two
        hosts, B3 when they are on shared storage and B4 when the commit record and
        ``LATEST`` are written. If every DRAM slot is still in flight, ``save`` waits
        (``Config.on_busy="wait"``, time counted in the handle's B1 time) or returns a
        skipped handle (``"skip"``, decided by all ranks together).

        Raises:
            CheckpointExists: ``step`` is committed on the shared tier or in flight.
            InvalidName: an item name is unsafe (``..`` segment, absolute path, NUL).
            InsufficientMemory: the DRAM tier cannot hold the state.
        """
        started = time.perf_counter()
        rt = self.runtime
        rt.check_open()
        layout.check_step(step)
        rt.resolve_undecided(f"save({step}) was called")
        if rt.agree_to_skip(step):
            handle = SaveHandle(step, started=started, skipped=True)
            rt.events.emit("skipped", step, in_flight=rt.in_flight_steps())
            log.warning("step %d skipped: every DRAM slot is in flight (%s)", step, rt.in_flight_steps())
            return handle
        writer = shoal_dcp.StorageWriter(self, step, _started=started, _managed=True)
        try:
            with collector_paused(), _quiet_dcp_logger(), _quiet_no_dist(), _unwrapped_errors():
                _dcp_save(state_dict, writer, no_dist=self.world_size == 1)
        except BaseException as e:
            rt.abort(step, e)
            if isinstance(e, TypeError | AttributeError | pickle.PicklingError) and not isinstance(
                e, ShoalError
            ):
                bad = _unserialisable(state_dict)
                if bad is not None:
                    raise UnsupportedValue(
                        f"step {step}: the value at {bad[0]!r} ({bad[1]}) cannot be saved: it cannot be "
                        f"serialised ({type(e).__name__}: {e}); save tensors, or values that pickle"
                    ) from e
            raise
        # dcp.save returned: every rank has staged (DCP's last collective saw every write).
        rt.submit(step)
        handle = writer.handle
        handle._reach_at_least(Boundary.STAGED)
        rt.watch(handle)
        return handle

    # -- load ----------------------------------------------------------------
    def load(self, state_dict: Mapping[str, Any], step: int | None = None, *, heal: bool = True) -> int:
        """Load checkpoint ``step`` (None: the newest restorable) into ``state_dict`` in place (collective).

        The job takes an inventory of what survives (this job's DRAM slabs, every host's
        partner copies, the shared tier) and loads the newest checkpoint whose every chunk
        is still somewhere, reading each chunk once in the job, from the nearest copy, and
        sending it over the fabric to the ranks that need it. Checkpoints this process
        saved are finished first. Tensors are filled in place, resharded if the saved
        layout differs; non-tensor values are replaced in ``state_dict``. Every chunk is
        verified against its BLAKE3 digest; a bad copy is replaced by another. Returns the
        step loaded; :attr:`last_load` says which sources served it.

        With ``heal`` (the default), a checkpoint restored that was not committed on shared
        storage (it had reached B1, B2 or B3 only) is saved again under its step, as loaded:
        the pipeline re-establishes two copies, drains what shared storage lacks (chunks it
        holds are not written again) and commits it. :attr:`last_heal` is that save's handle;
        ``load`` returns at its B1. A partial load (some items not read) is never healed.

        Raises:
            CheckpointNotFound: nothing restorable (or no such step); says what is missing.
            ChecksumMismatch: every copy of a chunk is corrupt (names item, packs, offsets).
            RestoreFailed: a chunk could not be read from any copy (names every place tried).
        """
        rt = self.runtime
        rt.check_open()
        t0 = time.perf_counter()
        # Chosen here, not inside dcp.load, so a missing checkpoint raises CheckpointNotFound as itself.
        restore = rt.begin_restore(step)
        reader = shoal_dcp.StorageReader(self, _restore=restore)
        target = state_dict if isinstance(state_dict, dict) else dict(state_dict)
        with _quiet_no_dist(), _unwrapped_errors():
            torch_dcp.load(target, storage_reader=reader, no_dist=self.world_size == 1)
        report = restore.report
        assert reader.step is not None and report is not None
        self.last_load = report
        rt.events.emit(
            "loaded",
            reader.step,
            seconds=time.perf_counter() - t0,
            origin=report.origin,
            bytes_by_tier=dict(report.bytes_by_tier),
            fabric_bytes=report.fabric_bytes,
            repaired=report.repaired,
        )
        log.info("loaded %s", sources_in(report))
        self.last_heal = None
        if heal and not report.committed:
            self.last_heal = self._heal(reader.step, report, target)
        return reader.step

    def _heal(self, step: int, report: LoadReport, state: dict[str, Any]) -> SaveHandle | None:
        """Save a restored, uncommitted checkpoint again so that it reaches B2..B4 (collective)."""
        if not report.complete:
            log.warning("step %d was loaded in part: not healing it (its copies stay as they are)", step)
            return None
        log.info("healing step %d (restored from %s): saving it again to reach B2..B4", step, report.origin)
        self.runtime.events.emit("heal", step, origin=report.origin)
        return self.save(step, state)

    def _resolve_manifest(self, step: int | None) -> Manifest:
        """The shared tier's manifest of ``step`` (None: LATEST's), checked against its commit record."""
        return self.runtime.resolve_manifest(step)

    def latest(self, boundary: Boundary = Boundary.RESTARTABLE) -> int | None:
        """The newest step known to have reached ``boundary``, or None.

        Counts this process's in-flight checkpoints and what the shared tier proves
        (a manifest for B3, a commit record for B4).
        """
        return self.runtime.latest(boundary)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every checkpoint this process staged is finished (or failed); False on timeout."""
        return self.runtime.wait(timeout)

    # -- close -----------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Finish in-flight checkpoints (up to ``timeout``, default ``Config.close_timeout``), then stop."""
        atexit.unregister(self._at_exit)
        self.runtime.close(timeout)

    def _at_exit(self) -> None:
        try:
            self.close()
        except Exception as e:  # pragma: no cover - interpreter shutdown
            log.warning("shoal: close at exit failed: %s", e)


def _unserialisable(state: Mapping[str, Any], prefix: str = "") -> tuple[str, str] | None:
    """The first non-tensor value in ``state`` (nested mappings and lists) that does not pickle.

    Only called after a save failed, to name the key: the walk costs one trial pickle per value.
    """
    import torch

    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, Mapping):
            found = _unserialisable(value, name + ".")
        elif isinstance(value, list | tuple):
            found = _unserialisable({str(i): v for i, v in enumerate(value)}, name + ".")
        else:
            found = None
            try:
                torch.save(value, io.BytesIO())
            except Exception:
                found = (name, type(value).__name__)
        if found is not None:
            return found
    return None
