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
import logging
import time
from collections.abc import Mapping
from typing import Any

from shoal import dcp as shoal_dcp
from shoal.boundary import Boundary
from shoal.config import Config
from shoal.driver import check_state, load_state, save_state
from shoal.engine.handle import SaveHandle
from shoal.engine.path import PathPolicy
from shoal.engine.restore import LoadReport, Restore, sources_in
from shoal.engine.runtime import Runtime
from shoal.format import layout
from shoal.group.topology import Topology
from shoal.model.exposure import Exposure
from shoal.records.events import monotonic
from shoal.tiers.base import Tier
from shoal.tiers.dram import DramTier
from shoal.tiers.local import PosixTier
from shoal.tiers.roots import check_host_roots

log = logging.getLogger(__name__)


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
        if isinstance(config, Config):  # (anything else: the runtime says what it needs)
            check_host_roots(config)
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

        ``state_dict`` is a mapping of names to tensors and values, nested as deep as needed
        (``{"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": 3}``); a value
        with a ``state_dict()`` method is saved as what it returns. A value that is neither a
        tensor nor such a container is saved with ``torch.save`` and, by default, loaded back with
        ``torch.load(weights_only=True)``, which refuses classes it was not told to trust. Such
        a value is therefore refused *here*, before anything is staged, not at a load months
        later (a checkpoint that cannot be loaded without turning safety off is not a
        checkpoint): the :class:`~shoal.errors.UnsupportedValue` names its key and class and
        the ways out: ``torch.serialization.add_safe_globals([TheClass])`` before saving and
        loading, or ``Config(allow_pickle=True)`` where whoever can write the checkpoints is
        trusted. With ``Config.allow_pickle`` nothing is checked. Plain values (numbers,
        strings, ``None``, dtypes, devices, and lists, tuples and dicts of them) are accepted on
        sight; anything else is tried once, saved and loaded back in memory.

        Raises:
            CheckpointExists: ``step`` is committed on the shared tier or in flight.
            UnsupportedValue: ``state_dict`` is not a mapping; a value cannot be serialised, or
                (unless ``Config.allow_pickle``) would be refused by the default load.
            InvalidName: an item name is unsafe (``..`` segment, absolute path, NUL), or two
                entries of the state flatten to one name (``1`` and ``"1"``, ``"a.b"`` and ``a``/``b``).
            InsufficientMemory: the DRAM tier cannot hold the state.
        """
        started = time.perf_counter()
        rt = self.runtime
        rt.check_open()
        layout.check_step(step)
        check_state(state_dict, f"save({step})")
        rt.enter_collective(f"save({step})")
        rt.resolve_undecided(f"save({step}) was called")
        if rt.agree_to_skip(step):
            handle = SaveHandle(step, started=started, skipped=True)
            rt.events.emit("skipped", step, in_flight=rt.in_flight_steps())
            log.warning("step %d skipped: every DRAM slot is in flight (%s)", step, rt.in_flight_steps())
            return handle
        session = rt.begin_save(step, started=started)
        writer = shoal_dcp.StorageWriter(self, step, session=session)
        try:
            save_state(state_dict, writer, step=step, no_dist=self.world_size == 1)
        except BaseException as e:
            session.abort(e)
            raise
        # dcp.save returned: every rank has staged (DCP's last collective saw every write).
        return session.submit()

    def stage_state(self, writer: shoal_dcp.StorageWriter, state_dict: Mapping[str, Any]) -> None:
        """Plan and stage ``state_dict`` through ``writer`` as :meth:`save` does (collective).

        What :meth:`shoal.dcp.StorageWriter.stage` calls for ``dcp.async_save``: the same checks,
        the same ``dcp.save`` path and cost as :meth:`save`; the writer's own session submits.
        """
        self.runtime.check_open()
        check_state(state_dict, f"dcp.async_save(step {writer.step})")
        save_state(state_dict, writer, step=writer.step, no_dist=self.world_size == 1)

    # -- load ----------------------------------------------------------------
    def load(
        self, state_dict: Mapping[str, Any], step: int | None = None, *, heal: bool = True, cast: bool = False
    ) -> int:
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

        ``cast``: allow a stored tensor to be cast to its target's dtype; otherwise a dtype
        mismatch raises :class:`~shoal.errors.StateMismatch`. A target tensor of another shape
        than the stored one always does (before anything is read).

        Raises:
            CheckpointNotFound: nothing restorable (or no such step); says what is missing.
            StateMismatch: a target tensor's shape (or, without ``cast``, dtype) is not the stored
                one's, or a stored tensor's target is no tensor (names key, stored and target).
            UnsupportedValue: ``state_dict`` is not a mapping.
            ChecksumMismatch: every copy of a chunk is corrupt (names item, packs, offsets).
            RestoreFailed: a chunk could not be read from any copy (names every place tried).
        """
        rt = self.runtime
        rt.check_open()
        if step is not None:
            layout.check_step(step)
        check_state(state_dict, "load()" if step is None else f"load(step {step})")
        rt.enter_collective(f"load({step})")
        t0, start = time.perf_counter(), monotonic()
        # Chosen here, not inside dcp.load, so a missing checkpoint raises CheckpointNotFound as itself.
        restore = rt.begin_restore(step)
        reader = shoal_dcp.StorageReader(self, cast=cast, session=restore)
        target = state_dict if isinstance(state_dict, dict) else dict(state_dict)
        load_state(target, reader, no_dist=self.world_size == 1)
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
            read_seconds=report.read_seconds,
            exchange_seconds=report.exchange_seconds,
            start=start,
            end=monotonic(),
            rank_bytes=restore.rank_bytes,
            phases=_phases(restore, time.perf_counter()),
            **_rank_spans(restore.rank_spans),
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

    def latest(self, boundary: Boundary = Boundary.RESTARTABLE) -> int | None:
        """The newest step known to have reached ``boundary``, or None.

        Counts this process's in-flight checkpoints and what the shared tier proves
        (a manifest for B3, a commit record for B4).
        """
        return self.runtime.latest(boundary)

    def remove(self, step: int) -> None:
        """Delete checkpoint ``step``, whatever ``Config.keep_last`` would keep (call it on every rank).

        For a framework that decides itself which checkpoints to keep (a best-k by a metric).
        Not a collective (no rank waits for another): each rank's pipeline deletes the step from
        the tiers that rank looks after (the coordinator: shared storage; a host's leader: its
        partner copies) in a retention pass run between checkpoints, queued now. Chunks that
        other checkpoints share stay. Two steps are never deleted at once, only later: the one
        ``LATEST`` names (the job's restart point) and one still in flight; each is deleted by the
        first retention pass after a newer checkpoint committed. Saving ``step`` again cancels
        the removal. Returns without waiting for the deletion; :meth:`wait` waits for it too.

        Raises:
            InvalidName: ``step`` is not a valid step number.
            StateError: this Checkpointer is closed.
        """
        layout.check_step(step)
        self.runtime.remove(step)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every checkpoint this process staged is finished (or failed); False on timeout."""
        return self.runtime.wait(timeout)

    def exposure(self, step: int | None = None) -> Exposure:
        """How much training a failure now would throw away, per failure class (never blocks).

        ``process`` (a crash of the training processes) rolls back to the newest checkpoint
        at B1 STAGED (its copy in the host's DRAM survives); ``host`` (the loss of one host) to
        the newest at B2 REPLICATED (a partner holds a copy); ``cluster`` (every compute host
        lost) to the newest at B4 RESTARTABLE (committed on shared storage). Each class's
        ``seconds`` is the time since that checkpoint's save was called (since this
        Checkpointer was built, if none), ``steps`` the current step (``step``, default the
        newest saved) minus its step, ``protected_step`` its step. Local to this process: every
        rank sees the same checkpoints reach the same boundaries. See ``docs/exposure.md``.
        """
        return self.runtime.exposure(step)

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


def _phases(restore: Restore, now: float) -> dict[str, float]:
    """This rank's seconds in each part of the load (:attr:`Restore.phases`), and ``after``: from
    the fetch to ``load``'s return (DCP's finish, values placed in the state)."""
    phases = dict(restore.phases)
    if restore.fetched_at is not None:
        phases["after"] = now - restore.fetched_at
    return phases


def _rank_spans(spans: tuple[float, float, float] | None) -> dict[str, float]:
    """The ``loaded`` record's per-rank read and exchange times (docs/events.md), when measured."""
    if spans is None:
        return {}
    read_start, read_end, exchange_end = spans
    return {"read_start": read_start, "read_end": read_end, "exchange_end": exchange_end}
