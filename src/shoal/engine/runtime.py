"""The engine runtime: everything one process checkpoints with, built once from a ``Config``.

Both front doors are thin clients of it: :class:`shoal.Checkpointer` (the manager API)
and :mod:`shoal.dcp` (DCP's ``StorageWriter``/``StorageReader``). A :class:`Runtime` holds
this process's lock and run (:mod:`shoal.records.hoststate`), its tiers, the topology, the
background fabric, the DRAM slot ring, the pipeline and the restore context. It opens the
save session (:meth:`Runtime.begin_save`, a :class:`~shoal.engine.session.SaveSession`,
which stages, attaches DCP's metadata and submits or aborts through the methods below) and
the load session (:meth:`Runtime.begin_restore`, a :class:`~shoal.engine.restore.Restore`;
the arrivals of a load made through DCP directly), and has ``latest``, ``exposure`` (local,
never blocks), ``wait`` and ``close``. Which ranks call what, and in which order, is said on
each method; "collective" means every rank calls it, in the same order.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from shoal import failpoints
from shoal.boundary import Boundary
from shoal.config import Config
from shoal.engine.exposure_feed import ExposureFeed
from shoal.engine.handle import SaveHandle
from shoal.engine.path import PathPolicy, default_policy
from shoal.engine.pipeline import Pipeline
from shoal.engine.protocol import Gate, PipelineContext, SaveJob
from shoal.engine.restore import Restore, RestoreContext
from shoal.engine.session import SaveSession
from shoal.errors import (
    CheckpointExists,
    CollectiveMismatch,
    ConfigError,
    OwnershipError,
    RestoreFailed,
    ShoalError,
    StateError,
    TierError,
)
from shoal.format import layout
from shoal.format.chunking import Hasher
from shoal.format.manifest import Manifest
from shoal.group.fabric import Board, Fabric
from shoal.group.topology import topology_for_path
from shoal.model.exposure import Exposure
from shoal.obs.metrics import Metrics, MetricsServer, require_prometheus
from shoal.records.catalog import ChunkCatalog
from shoal.records.events import EventLog, monotonic
from shoal.records.hoststate import (
    HostLock,
    RunRecord,
    claim_shared_run,
    drop_superseded,
    find_leftovers,
    list_host_runs,
    log_foreign_runs,
    new_generation,
    run_dir,
    same_run_candidates,
    write_run_file,
)
from shoal.records.metacache import MetadataEncoder
from shoal.records.staged import StagedIndex, delete_staged
from shoal.records.stager import Slot, SlotRing, StageEntry, stage_into
from shoal.records.store import newest_reached, read_pointer, resolve_manifest
from shoal.tiers.base import Tier
from shoal.tiers.roles import Role, check_role_kind, open_host_role, open_role
from shoal.tiers.roots import check_shared_root

log = logging.getLogger(__name__)


class Runtime:
    """One process's checkpointing engine (collective to build: every rank, once).

    Build it after ``torch.distributed.init_process_group`` if the job is distributed:
    construction takes this rank's lock, agrees on the run and the topology, opens this
    run's host tiers and creates the background group. :meth:`close` finishes in-flight
    work and gives everything back.
    """

    def __init__(self, config: Config, *, path_policy: PathPolicy | None = None) -> None:
        if not isinstance(config, Config):
            raise ConfigError(f"shoal needs a shoal.Config, got {type(config).__name__}")
        self.exposure_feed = ExposureFeed()
        """This process's rollback exposure (:mod:`shoal.engine.exposure_feed`): from when it was built."""
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        cfg = config.resolved(self.rank)
        assert cfg.host_id is not None and cfg.local is not None and cfg.dram is not None
        self.host = cfg.host_id
        if path_policy is not None and not isinstance(path_policy, PathPolicy):
            raise ConfigError(f"path_policy must have a decide(context) method, got {path_policy!r}")
        self.path_policy: PathPolicy = path_policy or default_policy(cfg.path)
        """Decides each checkpoint's path on the coordinator (default:
        :func:`~shoal.engine.path.default_policy`)."""
        self.closed = True  # until construction completes: close() then has nothing to do
        self._host_lock = HostLock(cfg.dram, cfg.job, self.host, self.rank)
        rank_hosts, domains = self._claim_host(cfg)
        try:
            self.shared = open_role(Role.SHARED, cfg.shared_url(), cfg.storage_options)
            self.run_id = self._agree_on_run(cfg)
            self._open(cfg, rank_hosts, domains)
        except BaseException:
            self._stop_metrics()
            self._host_lock.release()
            raise
        self.closed = False

    @property
    def replicating(self) -> bool:
        """Whether checkpoints go through partner hosts (B2 before B3), not straight to shared storage."""
        return self._host_tier is not None

    def _open(self, cfg: Config, rank_hosts: list[str], domains: dict[str, str]) -> None:
        """Open this run's host tiers, the pipeline and the restore (after the run is agreed on)."""
        assert cfg.local is not None and cfg.dram is not None
        run = self.run_id
        self.topology = topology_for_path(
            rank_hosts, path=cfg.path, scheme=cfg.partner_scheme, domains=domains
        )
        # Partner copies are possible in every job of several hosts (with partners in other failure
        # domains); whether a checkpoint makes them is the path policy's choice, checkpoint by
        # checkpoint. Host tiers for them are open wherever they are possible.
        replicate = bool(self.topology.partners)
        self.dram = open_host_role(Role.STAGING, run_dir(cfg.dram, cfg.job, self.host, run), base=cfg.dram)
        self.local = local = open_host_role(
            Role.HOST_COPY, run_dir(cfg.local, cfg.job, self.host, run), base=cfg.local
        )
        """This run's local-disk tier on this host (partner copies, the event log)."""
        record = RunRecord(run, cfg.shared_url(), cfg.job, time.time())
        for root, tier in ((cfg.dram, self.dram), (cfg.local, local)):
            tier.ensure_root()
            write_run_file(root, tier.root, record)
            log_foreign_runs(list_host_runs(root, cfg.job, self.host), run, f"rank {self.rank}")
        if cfg.event_log is None:
            cfg = replace(cfg, event_log=os.path.join(local.root, "events.jsonl"))
        self.config = cfg
        self.metrics_server = self._serve_metrics(cfg)
        """The host's metrics endpoint (``Config.metrics_port``) when this rank serves it, else None."""
        host_tier: Tier | None = None
        if replicate:
            kind = check_role_kind(Role.HOST_COPY, cfg.replicate_to)
            host_tier = next(t for t in (self.dram, local) if t.kind == kind)
        self._host_tier = host_tier
        generation = new_generation()
        self._ring = SlotRing(self.dram, cfg.dram_slots, prefix=f"r{self.rank}-{generation}-")
        self._leftovers = find_leftovers(self.dram, rank=self.rank, own=[s.name for s in self._ring.slots])
        for left in self._leftovers:
            log.info("keeping step %s staged by an earlier process of this run (slab %s) until a newer "
                     "checkpoint reaches B4", left.step, left.slot)  # fmt: skip
        self.events = EventLog(cfg.event_log, host=self.host, rank=self.rank)
        self.events.emit("opened", None, run=run, world_size=self.world_size, start=self.exposure_feed.start)
        if self.rank == 0:
            self.exposure_feed.log_to(self.events)
        fabric = Fabric.create(cfg.collective_timeout)
        context = self._pipeline_context(cfg, fabric, host_tier, replicate=replicate)
        if host_tier is not None and context.is_host_leader:
            context.host_catalog = ChunkCatalog.scan(host_tier, committed_only=False)
        self._pipeline = Pipeline(context, self._ring, keep_last=cfg.keep_last)
        self._restore_context = RestoreContext(
            fabric=fabric,
            topology=self.topology,
            host=self.host,
            shared=self.shared,
            host_tiers={t.kind: t for t in (local, self.dram)},
            dram=self.dram,
            run_id=run,
        )
        self._lock = threading.Lock()
        self._encoder = MetadataEncoder()
        """The last save's encoded DCP metadata, given again while the layout stays the same."""
        self._staging: set[int] = set()
        """Steps staged by a save session whose owner has not submitted or aborted them yet."""
        self._watched: list[SaveHandle] = []
        """Handles of recent saves, until they finish: the newest B4 supersedes leftovers."""
        self._committed: set[int] = set()
        self._warmer: threading.Thread | None = None
        board = Board.for_job(f"shoal/{run}/")
        self._board = board.scoped(self.rank) if board is not None else None
        """Decisions every rank reads without a collective (the gates of saves through DCP)."""
        self._dcp_saves = 0
        self._dcp_loads = 0
        self._calls = 0
        """Collective calls entered so far (:meth:`enter_collective`), alike on every rank."""

    def _serve_metrics(self, cfg: Config) -> MetricsServer | None:
        """``Config.metrics_port``: the host's first rank serves every rank's metrics, from the host's
        event log (``docs/observability.md``). Off (None): nothing is imported, nothing listens.

        Every rank checks that ``prometheus_client`` is there (so all raise alike); a port that
        cannot be bound is logged and the job goes on without metrics (no rank waits for this one).
        """
        if cfg.metrics_port is None:
            return None
        require_prometheus("Config.metrics_port")
        if self.topology.leader(self.host) != self.rank:
            return None
        assert cfg.event_log is not None
        metrics: Metrics | None = None
        try:
            metrics = Metrics(log_path=cfg.event_log)
            server = metrics.serve(cfg.metrics_port, cfg.metrics_addr)
        except (ShoalError, OSError) as e:
            if metrics is not None:
                metrics.close()
            log.error("%s: host %s goes on without a metrics endpoint", e, self.host)
            return None
        log.info("rank %d serves the metrics of host %s at %s", self.rank, self.host, server.url)
        return server

    def _stop_metrics(self) -> None:
        server, self.metrics_server = getattr(self, "metrics_server", None), None
        if server is not None:
            server.close()
            server.metrics.close()

    def _pipeline_context(
        self, cfg: Config, fabric: Fabric, host_tier: Tier | None, *, replicate: bool
    ) -> PipelineContext:
        """What the save protocol runs with on this rank (``_open``, once the run is agreed on)."""
        return PipelineContext(
            fabric=fabric,
            topology=self.topology,
            shared=self.shared,
            host_tier=host_tier,
            chunk_size=cfg.chunk_size,
            replicate=replicate,
            events=self.events,
            hasher=Hasher(cfg.hash_threads),
            dcp_timeout=cfg.collective_timeout,
            dram=self.dram,
            run_id=self.run_id,
            path_policy=self.path_policy,
            drain_streams=cfg.drain_streams,
            drain_pack_bytes=cfg.drain_pack_bytes,
            balance_drain=cfg.balance_drain,
        )

    def _claim_host(self, cfg: Config) -> tuple[list[str], dict[str, str]]:
        """Collective: take this rank's lock; learn every rank's host, domain and host runs.

        Every rank learns every rank's lock problem, so all of them raise together.
        """
        assert cfg.dram is not None and cfg.local is not None
        problem: str | None = None
        error: BaseException | None = None
        candidates: list[tuple[str, float]] = []
        try:
            self._host_lock.acquire()
            for root in (cfg.dram, cfg.local):
                found = list_host_runs(root, cfg.job, self.host)
                candidates += [
                    (r.record.run, r.mtime)
                    for r in same_run_candidates(found, cfg.shared_url(), cfg.job)
                    if r.record is not None
                ]
        except (ShoalError, OSError) as e:
            error = e
            problem = f"rank {self.rank} (host {self.host}): {e}"
        mine = (self.host, cfg.failure_domain or self.host, problem, candidates)
        everyone: list[Any] = [mine]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
        problems = [p for _, _, p, _ in everyone if p]
        if problems:
            self._host_lock.release()
            if error is not None:
                raise error
            raise OwnershipError(f"another rank could not start: {problems[0]}")
        self._host_candidates = sorted(
            {c for _, _, _, cs in everyone for c in cs}, key=lambda c: c[1], reverse=True
        )
        domains: dict[str, str] = {}
        for host, domain, _, _ in everyone:
            if domains.setdefault(host, domain) != domain:
                self._host_lock.release()
                raise ConfigError(
                    f"ranks of host {host!r} disagree on its failure domain ({domains[host]!r}, {domain!r})"
                )
        return [h for h, _, _, _ in everyone], domains

    def _agree_on_run(self, cfg: Config) -> str:
        """Collective: the run id, from ``<shared>/<job>/RUN`` (recorded now if the job is new).

        If the shared tier cannot be used, the run is the newest host run directory that
        names the same shared root and job (a restore from host tiers alone); with none, the
        shared tier's error is raised on every rank, naming the shared root.
        """
        message: tuple[str | None, str | None] = (None, None)
        bad_root = False  # the error is the shared root's own (a file): a ConfigError on every rank
        if self.rank == 0:
            try:
                message = (claim_shared_run(self.shared, cfg.shared_url(), cfg.job).run, None)
            except (ShoalError, OSError) as e:
                if self._host_candidates:
                    run = self._host_candidates[0][0]
                    log.warning(
                        "shared tier %s cannot be used (%s); continuing as run %s, found in the host "
                        "tiers: checkpoints restore from host copies, saves fail until it is back",
                        self.shared.url,
                        e,
                        run,
                    )
                    message = (run, None)
                else:
                    message = (
                        None,
                        f"cannot use the shared root {cfg.shared!r} for job {cfg.job!r}: recording the "
                        f"run at {self.shared.url}/{layout.RUN} failed: {type(e).__name__}: {e}",
                    )
                    try:
                        check_shared_root(cfg)
                    except ConfigError as bad:  # a root that is a file: said in one line instead
                        message, bad_root = (None, str(bad)), True
        if self.world_size > 1:
            box: list[Any] = [(message, bad_root)]
            dist.broadcast_object_list(box, src=0)
            message, bad_root = box[0]
        run, error = message
        if error is not None or run is None:
            raise (ConfigError if bad_root else TierError)(error or "no run id")
        return run

    def in_flight_steps(self) -> list[int]:
        """The steps whose DRAM slots are staged or in flight."""
        return self._ring.in_flight_steps()

    def check_open(self) -> None:
        if self.closed:
            raise StateError(
                f"this Checkpointer (job {self.config.job!r}, rank {self.rank}) is closed; "
                "create a new one to save or load"
            )

    def check_new_step(self, step: int) -> None:
        handle = self._pipeline.in_flight().get(step)
        if step in self._committed or (handle is not None and handle.done(Boundary.RESTARTABLE)):
            raise CheckpointExists(
                f"step {step} is already committed at {self.shared.url}/{layout.step_dir(step)}; "
                "checkpoints are immutable: save under a new step"
            )
        if handle is not None or step in self._staging:
            raise CheckpointExists(f"step {step} is already being checkpointed by this process")
        if self.rank == 0 and self.shared.exists(layout.commit_path(step)):
            raise CheckpointExists(
                f"step {step} already exists at {self.shared.url}/{layout.step_dir(step)}; "
                "checkpoints are immutable: save under a new step, or delete it first"
            )

    def agree_to_skip(self, step: int) -> bool:
        """Collective: refuse an existing step on every rank, and skip on every rank or none."""
        problem = None
        try:
            self.check_new_step(step)
        except CheckpointExists as e:
            problem = str(e)
        busy = self.config.on_busy == "skip" and not self._ring.has_free_slot()
        votes = [(problem, busy)]
        if self.world_size > 1:
            votes = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(votes, (problem, busy))
        problems = [p for p, _ in votes if p]
        if problems:
            raise CheckpointExists(problems[0])
        return any(b for _, b in votes)

    def begin_save(self, step: int, *, started: float | None = None, direct: bool = False) -> SaveSession:
        """A :class:`~shoal.engine.session.SaveSession` for ``step`` on this rank (every rank).

        ``direct``: ``dcp.save`` was called with shoal's writer and no session (the session then
        checks the collective and gates its checkpoint); otherwise the caller has checked and
        submits once ``dcp.save`` returned.
        """
        self.check_open()
        return SaveSession(self, step, started=started, direct=direct)

    def stage(
        self, step: int, entries: Sequence[StageEntry], *, started: float, gate: Gate | None
    ) -> tuple[SaveHandle, SaveJob | None]:
        """Copy ``entries`` into a free DRAM slot (:meth:`SaveSession.stage`); no job if skipped.

        ``gate`` None: the session's owner submits the job once ``dcp.save`` returned on every
        rank. With a gate (``dcp.save`` called directly with shoal's writer) the job goes to the
        pipeline at once and waits there until the rank that runs DCP's ``finish`` opens the
        gate, or the save is abandoned (see :class:`~shoal.engine.protocol.Gate`).
        """
        self.check_open()
        self.resolve_undecided(f"step {step} was staged")
        if step in self._pipeline.in_flight() or step in self._staging:
            raise CheckpointExists(f"step {step} is already being checkpointed by this process")
        called = monotonic() - (time.perf_counter() - started)  # the save call, on the event clock
        self.events.emit("save_called", step, items=len(entries), called=called)
        slot, waited = self._ring.acquire(step, wait=self.config.on_busy == "wait" or gate is not None)
        if slot is None:
            handle = SaveHandle(step, started=started, skipped=True)
            self.events.emit("skipped", step, in_flight=self._ring.in_flight_steps())
            return handle, None
        handle = SaveHandle(step, started=started)
        self.exposure_feed.watch(handle, called)
        copy_start = monotonic()
        try:
            # The slot's staged index describes the checkpoint about to be overwritten: drop it
            # first, so that a crash mid-copy never leaves an index over half-new bytes.
            delete_staged(self.dram, slot.name)
            staged = stage_into(slot, self.dram, entries, rank=self.rank)
        except BaseException:
            self._ring.release(slot)
            raise
        failpoints.hit("stage.after_copy", rank=self.rank)
        job = SaveJob(step, slot, handle, self.config.job)
        job.staged = StagedIndex(
            self.config.job,
            step,
            self.rank,
            self.world_size,
            slot.name,
            self.config.chunk_size,
            staged,
            run=self.run_id,
        )
        try:
            job.staged.write(self.dram)  # B1 survives a crash of this process: the slab is described
        except BaseException:
            self._ring.release(slot)
            raise
        self._warm_other_slots(slot)
        self.events.emit(
            "staged",
            step,
            bytes=sum(s.nbytes for s in staged),
            wait_seconds=waited,
            start=copy_start,
            end=monotonic(),
        )
        self.exposure_feed.saved(step, called)
        if gate is None:
            with self._lock:
                self._staging.add(step)
        else:
            job.gate = gate
            job.dcp_ready.set()  # whatever metadata there is comes with the gate (finish runs first)
            self._pipeline.submit(job)
            self.watch(handle)
        return handle, job

    def exposure(self, step: int | None = None) -> Exposure:
        """This process's rollback exposure now, per failure class (``step``: the current step)."""
        return self.exposure_feed.exposure(step)

    def _warm_other_slots(self, slot: Slot) -> None:
        """Pre-fault the ring's other slabs in the background, sized like the one just used."""
        assert slot.slab is not None
        size = slot.slab.capacity
        if self._warmer is not None and self._warmer.is_alive():
            return
        if self._ring.needs_warming(size):
            self._warmer = threading.Thread(
                target=self._ring.warm, args=(size,), name="shoal-warm", daemon=True
            )
            self._warmer.start()

    def attach_metadata(self, job: SaveJob, metadata: Metadata, *, gated: bool) -> None:
        """DCP's ``finish`` (on DCP's coordinator): keep the encoded metadata for the manifest.

        ``gated`` (``dcp.save`` called directly): open the checkpoint's gate, so that every
        rank's pipeline takes it on; if this fails, the gate fails and every rank skips it.
        """
        step = job.step
        try:
            job.dcp = self._encoder.encode(metadata)
            if job.staged is not None:  # the checkpoint is restorable from DRAM alone from here on
                job.staged.dcp = job.dcp
                job.staged.dcp_json = self._encoder.json_of(job.dcp)
                job.staged.write(self.dram)
        except BaseException as e:
            job.aborted = f"{type(e).__name__}: {e}"
            if gated:
                job.gate.fail(f"DCP's finish of step {step} failed on rank {self.rank}: {job.aborted}")
            raise
        finally:
            job.dcp_ready.set()
        if gated:
            job.gate.open()

    def submit(self, job: SaveJob) -> None:
        """Hand a staged checkpoint to the pipeline; non-coordinators have no DCP metadata to wait for."""
        with self._lock:
            self._staging.discard(job.step)
        job.dcp_ready.set()  # DCP's finish ran (on the coordinator) before dcp.save returned
        self._pipeline.submit(job)

    def abort(self, job: SaveJob, error: BaseException) -> None:
        """Give up a staged checkpoint that was never submitted: free its slot, fail its handle at B1."""
        with self._lock:
            self._staging.discard(job.step)
        self._ring.release(job.slot)
        job.handle.fail(Boundary.STAGED, error)

    def watch(self, handle: SaveHandle) -> None:
        """Remember ``handle`` until it finishes; a B4 drops the leftovers it supersedes."""
        with self._lock:
            self._watched.append(handle)
        self._drop_superseded()

    def _drop_superseded(self, *, consult_shared: bool = False) -> None:
        """Drop staged leftovers of earlier processes superseded by a committed checkpoint of this run.

        A leftover of step s goes once a step >= s of this run reached B4: one this process
        committed, or (with ``consult_shared``, at close) the one ``LATEST`` names. A slab
        whose index is gone (a crash mid-copy) holds nothing restorable and goes then too.
        """
        latest = None
        if consult_shared and self._leftovers:
            try:
                pointer = read_pointer(self.shared, layout.LATEST)
                latest = pointer.step if pointer is not None else None
            except (ShoalError, OSError) as e:
                log.debug("LATEST unreadable while dropping leftovers: %s", e)
        with self._lock:
            watched, self._watched = self._watched, []
            for h in watched:
                if h.done(Boundary.RESTARTABLE):
                    self._committed.add(h.step)
                elif h.error is None and not h.skipped:
                    self._watched.append(h)
            newest = max([*self._committed, *([latest] if latest is not None else [])], default=None)
            if newest is None or not self._leftovers:
                return
            doomed = [left for left in self._leftovers if left.step is None or left.step <= newest]
            self._leftovers = [left for left in self._leftovers if left not in doomed]
        drop_superseded(self.dram, doomed, newest)

    def new_gate(self, sequence: int, step: int) -> Gate:
        """The gate of the ``sequence``-th save through DCP directly (every rank counts alike)."""
        return Gate(self._board, f"save/{sequence}/step-{step}")

    def next_save_sequence(self) -> int:
        """Count a direct save session on this rank (every rank makes one per ``dcp.save``)."""
        with self._lock:
            self._dcp_saves += 1
            return self._dcp_saves

    def next_load_sequence(self) -> int:
        """Count a ``shoal.dcp.StorageReader`` made on this rank (every rank makes one per load)."""
        with self._lock:
            self._dcp_loads += 1
            return self._dcp_loads

    def enter_collective(self, call: str) -> None:
        """Collective: every rank makes ``call`` (``"save(5)"``, ``"load(None)"``) as its next one.

        The front doors' collective methods call this first, before any collective of theirs,
        so that the commonest mistake with collective checkpointing (``if rank == 0:
        ckpt.save(...)``) is an error and not a hang. Raises
        :class:`~shoal.errors.CollectiveMismatch` on every rank that called it when some rank
        did not within ``Config.collective_timeout`` (naming those ranks), or made another call
        in its place (naming both). Costs a few store round trips; free with one rank.
        """
        if self._board is None:
            return
        with self._lock:
            self._calls += 1
            number = self._calls
        timeout = self.config.collective_timeout

        def late(missing: list[int]) -> str:
            return (
                f"ranks {missing} of {self.world_size} did not call {call} within {timeout:.0f} s "
                "(Config.collective_timeout)"
            )

        arrival = self._board.arrive(
            f"call/{number}", self.rank, self.world_size, timeout, call=call, late=late
        )
        if arrival.complete:
            return
        raise CollectiveMismatch(
            f"rank {self.rank}: {call} failed before it began: {arrival.note}. {call.split('(')[0]}() is "
            "collective: every rank must call it, with the same arguments and in the same order "
            "(not under `if rank == 0:`)"
        )

    def arrive(self, sequence: int, phase: str, timeout: float) -> str | None:
        """Every rank reached ``phase`` of the ``sequence``-th load, before any collective of it.

        Returns None once every rank is there, or the note of a rank that failed this phase
        before reaching it (:meth:`abandon`): then no rank starts the phase's collectives, and
        the caller lets DCP report that rank's own error. Raises
        :class:`~shoal.errors.RestoreFailed` naming the ranks that did not come within
        ``timeout`` seconds (their ``dcp.load`` failed before this phase without a word): every
        rank that came fails alike, and the background group is left as it was.
        """
        if self._board is None:
            return None
        arrival = self._board.arrive(
            f"load/{sequence}/{phase}",
            self.rank,
            self.world_size,
            timeout,
            late=lambda missing: f"ranks {missing} did not reach {phase} of this load within {timeout:.0f} s",
        )
        if arrival.late:
            raise RestoreFailed(
                f"{arrival.note} (their dcp.load failed before it, or they did not call it: every "
                "rank must); nothing was read, and the next load can go ahead"
            )
        return None if arrival.complete else arrival.note

    def abandon(self, sequence: int, phase: str, error: BaseException) -> None:
        """This rank failed ``phase`` of the ``sequence``-th load before reaching it: tell the others.

        The ranks waiting at (or coming to) that phase's arrival stop at once (see :meth:`arrive`).
        Local: one store write, never a collective; free with one rank.
        """
        if self._board is None:
            return
        note = f"rank {self.rank} failed in {phase}: {type(error).__name__}: {str(error)[:300]}"
        self._board.close(f"load/{sequence}/{phase}", note)

    def resolve_undecided(self, why: str) -> None:
        """Abandon checkpoints staged through ``dcp.save`` whose ``finish`` never came.

        Called by everything a rank does next (save, load, wait, close): by then DCP's save of
        such a checkpoint has returned on every rank, so a gate still closed means ``finish``
        did not run (a rank's ``write_data`` or ``finish`` failed and ``dcp.save`` raised). A
        decision another rank posted first (``finish`` did run) is kept.
        """
        for job in self._pipeline.jobs():
            if not job.gate.decided:
                job.gate.fail(
                    f"DCP's save of step {job.step} did not complete on every rank (some rank's "
                    f"write_data or finish failed, so dcp.save raised there); abandoned when {why} "
                    f"on rank {self.rank}"
                )

    def begin_restore(self, step: int | None) -> Restore:
        """Collective: the inventory and the choice of checkpoint; the session that reads it.

        Checkpoints in flight are finished first: the restore's collectives share the
        background group with the pipeline's, and a load must see what this job saved.
        """
        self.check_open()
        if step is not None:
            layout.check_step(step)
        self.resolve_undecided("a load began")
        self._pipeline.flush()
        restore = Restore(self._restore_context)
        restore.begin(step)
        # This process continues the history it loads: its writer claim inherits the job's.
        self._pipeline.context.resumed = True
        return restore

    def resolve_manifest(self, step: int | None) -> Manifest:
        """The shared tier's manifest of ``step`` (None: LATEST's), checked against its commit record."""
        return resolve_manifest(self.shared, step)

    def latest(self, boundary: Boundary = Boundary.RESTARTABLE) -> int | None:
        """The newest step known to have reached ``boundary``, or None.

        Counts this process's in-flight checkpoints and what the shared tier proves
        (a manifest for B3, a commit record for B4).
        """
        boundary = Boundary(boundary)
        steps = [s for s, h in self._pipeline.in_flight().items() if h.done(boundary)]
        on_shared = newest_reached(self.shared, boundary)
        return max([*steps, *([] if on_shared is None else [on_shared])], default=None)

    def remove(self, step: int) -> None:
        """Have the pipeline delete ``step`` from this rank's tiers (:meth:`shoal.Checkpointer.remove`)."""
        self.check_open()
        with self._lock:  # once deleted, the step may be saved again (the shared tier's check still holds)
            self._committed.discard(step)
        self._pipeline.remove(step)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every checkpoint this process staged is finished (or failed); False on timeout."""
        self.resolve_undecided("wait() was called")
        return self._pipeline.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish in-flight checkpoints (up to ``timeout``, default ``Config.close_timeout``), then stop."""
        if self.closed:
            return
        self.closed = True
        limit = self.config.close_timeout if timeout is None else timeout
        self.resolve_undecided("the Checkpointer was closed")
        if not self._pipeline.close(limit):
            log.warning(
                "close(): checkpoints %s still in flight after %.0f s",
                sorted(self._pipeline.in_flight()),
                limit,
            )
            self._stop_metrics()
            self._close_policy()
            return
        self._stop_metrics()
        self._close_policy()
        if self._warmer is not None:
            self._warmer.join()
        # Every checkpoint is finished: this process's staged copies are redundant, give /dev/shm
        # back. Leftovers of earlier processes stay unless a newer checkpoint committed.
        self._drop_superseded(consult_shared=True)
        for slot in self._ring.slots:  # the index first: never an index over a slab that is gone
            delete_staged(self.dram, slot.name)
        self._ring.close(release_memory=True)
        for tier in (self.shared, self.dram):
            tier.close()
        self._host_lock.release()

    def _close_policy(self) -> None:
        """The path policy's own resources (the model's worker process), if it has a ``close``."""
        close = getattr(self.path_policy, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # closing never fails on a policy's bookkeeping
                log.warning("the path policy's close failed", exc_info=True)

    def __del__(self) -> None:
        lock = getattr(self, "_host_lock", None)
        if lock is not None and getattr(self, "closed", True):
            lock.release()
