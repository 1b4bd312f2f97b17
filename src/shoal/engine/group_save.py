"""One checkpoint's trip through the background pipeline, on every rank (docs/design.md section 4).

Every rank runs :meth:`GroupSave.run` for the same checkpoint, in step order, and
makes the same sequence of collectives on the background group:

====  ======================  =====================================================
 C1   gather reports          each rank's items and chunk digests (and, from each
                              host's leader, the chunks its host tier holds)
      (B1 is now global)      every rank has staged: it reported
 C2   broadcast plan          the coordinator's :class:`GroupPlan` (or the error)
  -   replicate               chunks stream to partner ranks; receivers write a pack
 C3   gather replica packs    to their host tier (fsync'd), verified chunk by chunk
 C4   broadcast manifests     one partial manifest per host, written by its leader
 C5   all-gather acks         B2: every new chunk and the manifest on two hosts
  -   drain                   each drain owner writes one pack to the shared tier
 C6   gather drain packs
      commit (coordinator)    check every referenced pack is there whole and that this
                              process holds the job (``WRITER``); manifest (B3),
                              ``COMMIT`` then ``LATEST`` (B4), the writer checked before each
 C7   broadcast outcome       every rank's handle learns B3 / B4 or the failure
====  ======================  =====================================================

Local work never raises past its phase: an error becomes the rank's contribution
to the next collective, so every rank takes the same path and the checkpoint fails
at the same boundary everywhere. With the ``direct`` path (or one host) C3-C5 are
skipped and B2 is reached with B3.

This module is the sequencer: the collectives, their order and the error paths. The work
between them is done by reusable parts: :mod:`shoal.engine.replicate` (partner copies and
host manifests), :func:`shoal.records.packwriter.write_pack` (every pack, replica or drain),
:func:`shoal.format.manifest_build.build_manifest` (manifests, pure) and
:class:`shoal.records.commit.CheckpointCommit` (manifest, ``COMMIT``, ``LATEST`` and the
rollback).

The commit writes nothing when a pack the manifest would reference is missing or short
(the checkpoint fails before B3, naming the packs, and the next save rescans the shared
tier and writes those chunks again), nor once another process holds the job
(:mod:`shoal.records.fence`: the checkpoint fails with :class:`~shoal.errors.WriterFenced`;
packs it drained stay unreferenced until the job's retention reclaims them).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, chain
from typing import Any

from shoal import failpoints
from shoal._version import __version__
from shoal.boundary import Boundary
from shoal.engine import replicate
from shoal.engine.path import PARTNER, PathContext, PathDecision, PathRecord, decide_path, record_outcome
from shoal.engine.protocol import (
    Drained,
    GroupFailure,
    PipelineContext,
    RankReport,
    ReportItem,
    SaveJob,
    check_errors,
    describe,
)
from shoal.format import layout
from shoal.format.manifest import ItemRecord, Stats, WorldInfo
from shoal.format.manifest_build import ManifestHeader, TierChunks, build_manifest
from shoal.format.pack import PackIndex
from shoal.group.digests import Digests
from shoal.group.plan import ChunkRef, ChunkTable, GroupPlan, RankChunks
from shoal.model.paths import PathTimes
from shoal.records.catalog import ChunkCatalog, pack_problems
from shoal.records.commit import CheckpointCommit
from shoal.records.events import monotonic
from shoal.records.fence import WriterFence, after_failed_commit
from shoal.records.packwriter import drain_parts, slab_runs, write_pack

log = logging.getLogger(__name__)

__all__ = ["GroupSave", "emit_checkpoint"]


class GroupSave:
    """The protocol above for one checkpoint on one rank. Call :meth:`run` once."""

    def __init__(self, ctx: PipelineContext, job: SaveJob) -> None:
        self.ctx = ctx
        self.job = job
        self.step = job.step
        self.items = {item.key: item for item in job.slot.items}
        self.local_error: Exception | None = None
        self.dcp: Mapping[str, Any] | None = None
        """The coordinator's copy of the checkpoint's DCP metadata (from the C1 reports)."""
        self.plan: GroupPlan | None = None
        self.decision: PathDecision | None = None
        """This checkpoint's plan and path (from C2)."""
        self.coordination_seconds = 0.0
        self.collectives = 0
        self.marks: dict[str, float] = {}
        """``perf_counter`` times of the protocol's steps on this rank (for the path policy's records)."""
        self.logical_bytes = 0
        """The coordinator's: bytes every rank staged (before dedup), from the C1 reports."""
        self.replica: tuple[int, float] | None = None
        """This rank's partner copy: bytes received and seconds of its exchange."""
        self.results: list[Any] | None = None
        """The coordinator's C6 gather: every rank's :class:`Drained` (or error)."""

    def _collective(self, op: Any, obj: Any) -> Any:
        """One control-message collective, timed (the coordination overhead the event log reports)."""
        t0 = time.perf_counter()
        try:
            return op(obj)
        finally:
            self.coordination_seconds += time.perf_counter() - t0
            self.collectives += 1

    # -- the protocol ------------------------------------------------------------------------
    def run(self) -> None:
        """Advance ``job.handle`` as far as the checkpoint gets; never raises."""
        ctx, h = self.ctx, self.job.handle
        target = Boundary.STAGED
        try:
            failpoints.hit("pipeline.before_hash", rank=ctx.rank)
            report = self._report()
            reports = self._collective(ctx.fabric.gather, report)  # C1
            if reports is not None:  # the coordinator: DCP's metadata, its own or the finish rank's
                self.dcp = self._own_dcp() or next((r.dcp for r in reports if r.dcp is not None), None)
            h.reach_at_least(Boundary.STAGED)  # every rank has staged and reported
            self.marks["staged"] = time.perf_counter()
            self._emit_boundary(Boundary.STAGED)
            target = Boundary.REPLICATED if ctx.replicate else Boundary.PERSISTED
            plan, decision = self._agree_on_plan(reports)  # C2
            self.plan, self.decision = plan, decision
            self.marks["planned"] = time.perf_counter()
            h.set_path(decision.path, decision.reason)
            ctx.events.emit(
                "path",
                self.step,
                path=decision.path,
                reason=decision.reason,
                predictions=decision.predictions,
                cost=decision.cost,
            )
            replicate = decision.path == PARTNER
            target = Boundary.REPLICATED if replicate else Boundary.PERSISTED
            if replicate:
                self._replicate_phase(plan, reports)  # C3..C5
                self._reach(Boundary.REPLICATED)
                failpoints.hit("pipeline.after_replicate", rank=ctx.rank)
                target = Boundary.PERSISTED
            self.marks["drain_begin"] = time.perf_counter()
            drained = self._guard("drain", lambda: self._drained(plan))
            results = self.results = self._collective(ctx.fabric.gather, drained)  # C6
            outcome: dict[str, Any] | None = None
            if ctx.fabric.is_coordinator:
                assert results is not None and reports is not None
                outcome = self._commit(reports, results)
            outcome = self._collective(ctx.fabric.broadcast, outcome)  # C7
            assert outcome is not None
            if outcome["reached"] is not None and outcome["reached"] >= Boundary.PERSISTED:
                self._reach(Boundary.PERSISTED)
                target = Boundary.RESTARTABLE
            if outcome["error"]:
                raise GroupFailure(outcome["error"])
            self._reach(Boundary.RESTARTABLE)
            self._emit_coordination()
        except Exception as e:
            if isinstance(e, GroupFailure) and self.local_error is not None:
                if self.ctx.fabric.world_size == 1:
                    e = self.local_error  # one rank: the error itself, not a summary of it
                else:
                    e.__cause__ = self.local_error
            log.error("step %d failed before %s: %s: %s", self.step, target.label, type(e).__name__, e)
            self.ctx.events.emit("failed", self.step, boundary=target.name, error=f"{type(e).__name__}: {e}")
            h.fail(target, e)
        finally:
            self._record_path()
            emit_checkpoint(ctx, self.job, None if self.decision is None else self.decision.path)
            self._log_summary()

    def _log_summary(self) -> None:
        """Coordinator: one INFO line per checkpoint that reached B4 (what an operator tails)."""
        h, plan = self.job.handle, self.plan
        if not self.ctx.fabric.is_coordinator or plan is None or h.reached is not Boundary.RESTARTABLE:
            return
        times = h.times
        mib = 1 << 20
        log.info(
            "step %d: stall %.3f s, B4 after %.3f s, %.1f MiB new, %.1f MiB deduplicated of %.1f MiB, "
            "path %s",
            self.step,
            times.get(Boundary.STAGED, 0.0),
            times.get(Boundary.RESTARTABLE, 0.0),
            plan.new_bytes / mib,
            (plan.logical_bytes - plan.new_bytes) / mib,
            plan.logical_bytes / mib,
            None if self.decision is None else self.decision.path,
        )

    def _record_path(self) -> None:
        """Coordinator: what this checkpoint showed, for the path policy (:func:`record_outcome`)."""
        ctx, decision, h = self.ctx, self.decision, self.job.handle
        if not ctx.fabric.is_coordinator or decision is None:
            return
        record = PathRecord(
            self.step,
            decision.path,
            sum(s.nbytes for s in self.job.slot.items),
            {b.name: t for b, t in h.times.items()},
            failed=h.error is not None,
            times=None if h.error is not None else self._path_times(),
        )
        record_outcome(ctx.path_history, ctx.path_policy, ctx.events, decision, record)

    def _path_times(self) -> PathTimes | None:
        """This checkpoint's :class:`~shoal.model.paths.PathTimes`, from the coordinator's marks and C6."""
        ht, marks, results, decision = self.job.handle.times, self.marks, self.results, self.decision
        b2 = ht.get(Boundary.REPLICATED)
        if decision is None or results is None or b2 is None or Boundary.STAGED not in ht:
            return None
        base = ht[Boundary.STAGED] - marks["staged"]  # perf_counter -> seconds from the save call
        drained = [r for r in results if isinstance(r, Drained)]
        return PathTimes.of(
            self.step,
            decision.path,
            self.logical_bytes,
            pre=base + marks["planned"],
            b2=b2,
            drain_begin=base + marks["drain_begin"],
            b3=ht.get(Boundary.PERSISTED),
            drains=[(r.drain_bytes, r.drain_seconds) for r in drained],
            copies=[(r.replica_bytes, r.replica_seconds) for r in drained],
        )

    def _emit_coordination(self) -> None:
        self.ctx.events.emit(
            "coordination",
            self.step,
            seconds=self.coordination_seconds,
            collectives=self.collectives,
            world_size=self.ctx.fabric.world_size,
        )

    def _local(self, phase: str, e: Exception) -> str:
        """Remember an error raised on this rank; return its description for the other ranks."""
        if self.local_error is None:
            self.local_error = e
        return describe(self.ctx.rank, phase, e)

    def _guard(self, phase: str, fn: Any) -> Any:
        """Run local work; an exception becomes an error string for the next collective."""
        try:
            return fn()
        except Exception as e:
            log.debug("step %d: %s failed on rank %d", self.step, phase, self.ctx.rank, exc_info=True)
            return self._local(phase, e)

    def _reach(self, boundary: Boundary) -> None:
        self.job.handle.reach_at_least(boundary)
        self._emit_boundary(boundary)

    def _emit_boundary(self, boundary: Boundary) -> None:
        seconds = self.job.handle.times.get(boundary)
        self.ctx.events.emit("boundary", self.step, boundary=boundary.name, seconds=seconds)

    # -- C1: hash and report -----------------------------------------------------------------
    def _report(self) -> RankReport:
        ctx = self.ctx
        held = None
        if ctx.is_host_leader and ctx.host_catalog is not None:
            held = frozenset(ctx.host_catalog.locations)
        try:
            t0, start = time.perf_counter(), monotonic()
            staged = self.job.slot.items
            hexes = [ctx.hasher.hash_item(self.job.slot.view(s), ctx.chunk_size) for s in staged]
            # One buffer of raw digests for the rank; each item's digests are a view of it.
            every = Digests.from_hex(list(chain.from_iterable(hexes)))
            bounds = [0, *accumulate(map(len, hexes))]
            items = tuple(
                ReportItem(s.key, s.kind, s.nbytes, s.dtype, s.shape, every[a:b])
                for s, a, b in zip(staged, bounds[:-1], bounds[1:], strict=True)
            )
            nbytes = sum(s.nbytes for s in self.job.slot.items)
            ctx.events.emit(
                "hashed",
                self.step,
                bytes=nbytes,
                seconds=time.perf_counter() - t0,
                start=start,
                end=monotonic(),
            )
            self._write_staged_index(items)
            # Only another rank's metadata travels (dcp.save's coordinator_rank != 0): the
            # coordinator's own is not pickled into its own gather.
            dcp = None if ctx.fabric.is_coordinator else self._own_dcp()
            return RankReport(ctx.rank, ctx.host, items, held, dcp=dcp, prefixes=every.prefixes())
        except Exception as e:
            return RankReport(ctx.rank, ctx.host, (), held, self._local("hash", e))

    def _write_staged_index(self, items: tuple[ReportItem, ...]) -> None:
        """Add the chunk digests to the slot's staged index (written at B1; docs/design.md section 5)."""
        staged = self.job.staged
        if self.ctx.dram is None or staged is None:
            return
        staged.digests = {i.key: i.digests for i in items}
        staged.write(self.ctx.dram)

    # -- C2: plan ----------------------------------------------------------------------------
    def _agree_on_plan(self, reports: list[RankReport] | None) -> tuple[GroupPlan, PathDecision]:
        ctx = self.ctx
        message: tuple[GroupPlan, PathDecision] | str | None = None
        if ctx.fabric.is_coordinator:
            assert reports is not None
            errors = [r.error for r in reports if r.error]
            message = "; ".join(errors) if errors else self._guard("plan", lambda: self._plan(reports))
        message = self._collective(ctx.fabric.broadcast, message)
        if isinstance(message, str):
            raise GroupFailure(message)
        assert isinstance(message, tuple)
        return message

    def _decide_path(self, reports: list[RankReport]) -> PathDecision:
        """Coordinator: this checkpoint's path, from the policy (docs/design.md section 4, step 3)."""
        ctx = self.ctx
        self.logical_bytes = sum(i.nbytes for r in reports for i in r.items)
        context = PathContext(
            step=self.step,
            world_size=ctx.fabric.world_size,
            hosts=tuple(ctx.topology.hosts),
            logical_bytes=self.logical_bytes,
            can_replicate=ctx.replicate,
            recent=ctx.path_history.recent(),
        )
        return decide_path(ctx.path_policy, context)

    def _plan(self, reports: list[RankReport]) -> tuple[GroupPlan, PathDecision]:
        ctx = self.ctx
        start = monotonic()
        decision = self._decide_path(reports)
        catalog = self._pin_reused(reports)
        # Compact planner input: per rank, its items as columns over the rank's digest buffer,
        # with the digest prefixes the rank made (the planner's sort keys).
        ranks = [
            RankChunks(
                r.rank,
                r.host,
                ChunkTable.uniform(
                    [i.key for i in r.items],
                    [i.nbytes for i in r.items],
                    ctx.chunk_size,
                    Digests.join([i.digests for i in r.items]),
                    r.prefixes,
                ),
            )
            for r in reports
        ]
        held = {r.host: r.held for r in reports if r.held is not None}
        t0 = time.perf_counter()
        hits = ctx.plan_cache.hits
        plan = ctx.plan_cache.lookup_or_plan(
            self.step,
            ranks,
            catalog.locations,
            ctx.topology,
            held=held,
            replicate=decision.path == PARTNER,
            balance=ctx.balance_drain,
        )
        ctx.events.emit(
            "planned",
            self.step,
            seconds=time.perf_counter() - t0,
            new_bytes=plan.new_bytes,
            replicated_bytes=plan.replicated_bytes,
            reused_bytes=plan.reused_bytes,
            plan_reused=ctx.plan_cache.hits > hits,
            logical_bytes=plan.logical_bytes,
            unique_bytes=plan.unique_bytes,
            dedup_bytes=plan.logical_bytes - plan.new_bytes,
            start=start,
            end=monotonic(),
        )
        return plan, decision

    def _pin_reused(self, reports: list[RankReport]) -> ChunkCatalog:
        """Pin the shared packs this checkpoint may reuse, and check that each is there whole.

        Retention runs beside this checkpoint (:class:`~shoal.records.catalog.PackPins`). A
        pack it has claimed is dropped from the catalog: its chunks are written again. One it
        deleted before the pin is missing from the listing that follows: the catalog is built
        again from the tier, twice at most; after that nothing is reused. One check per pack,
        one listing in all.
        """
        ctx = self.ctx
        for _ in range(3):
            if ctx.shared_catalog is None:
                ctx.shared_catalog = ChunkCatalog.scan(ctx.shared)
            catalog = ctx.shared_catalog
            if not len(catalog):
                return catalog  # nothing to reuse: no digest to look up
            reused = catalog.records_holding(d for r in reports for i in r.items for d in i.digests)
            claimed = ctx.shared_pins.pin(self.step, reused)
            catalog.drop_packs(claimed)
            problems = pack_problems(ctx.shared, {p: rec for p, rec in reused.items() if p not in claimed})
            if not problems:
                return catalog
            log.warning(
                "packs vanished from %s (%s); their chunks will be written again",
                ctx.shared.url,
                "; ".join(problems.values()),
            )
            ctx.shared_catalog = None  # rebuilt from what the tier holds now
        log.warning("packs keep vanishing from %s: this checkpoint reuses nothing", ctx.shared.url)
        ctx.shared_catalog = ChunkCatalog()
        return ctx.shared_catalog

    # -- C3..C5: replicate -------------------------------------------------------------------
    def _view(self, ref: ChunkRef) -> memoryview:
        off = ref.index * self.ctx.chunk_size
        return self.job.slot.view(self.items[ref.key])[off : off + ref.length]

    def _slab(self) -> memoryview:
        slab = self.job.slot.slab
        assert slab is not None
        return slab.buffer

    def _replicate_phase(self, plan: GroupPlan, reports: list[RankReport] | None) -> None:
        ctx = self.ctx
        t0 = time.perf_counter()
        index, errors = replicate.exchange(ctx, plan, self.step, self._view)
        if index is not None:
            self.replica = (index.size, time.perf_counter() - t0)
        written = next((self._local(phase, e) for phase, e in errors), None) if errors else index
        results = self._collective(ctx.fabric.gather, written)  # C3
        manifests: dict[str, bytes] | str | None = None
        if ctx.fabric.is_coordinator:
            assert results is not None and reports is not None
            failed = [r for r in results if isinstance(r, str)]
            manifests = (
                "; ".join(failed)
                if failed
                else self._guard(
                    "replica manifests",
                    lambda: replicate.host_manifests(ctx, self._header(), _items(reports), results),
                )
            )
        manifests = self._collective(ctx.fabric.broadcast, manifests)  # C4
        if isinstance(manifests, str):
            raise GroupFailure(manifests)
        assert manifests is not None
        ack = None
        if ctx.is_host_leader:
            ack = self._guard(
                "write replica manifest",
                lambda: replicate.write_host_manifest(ctx, self.step, manifests[ctx.host]),
            )
        check_errors(self._collective(ctx.fabric.all_gather, ack))  # C5

    # -- C6, C7: drain and commit ------------------------------------------------------------
    def _drained(self, plan: GroupPlan) -> Drained:
        """This rank's C6 message: its drain packs, and the seconds of its drain and partner copy."""
        t0 = time.perf_counter()
        packs = self._drain(plan) or []
        seconds = time.perf_counter() - t0 if packs else 0.0
        copied, copy_seconds = self.replica or (0, 0.0)
        return Drained(packs, sum(p.size for p in packs), seconds, copied, copy_seconds)

    def _drain(self, plan: GroupPlan) -> list[PackIndex] | None:
        """Write this rank's drain packs to the shared tier, straight from the slab.

        The rank's share goes out as packs of about ``ctx.drain_pack_bytes``
        (:func:`~shoal.records.packwriter.drain_parts`), ``ctx.drain_streams`` of them uploaded at
        once: one stream rarely fills a storage NIC, and an object store that handles an object
        only once its whole body has arrived leaves the link idle meanwhile unless another
        upload is under way.
        """
        ctx = self.ctx
        failpoints.hit("pipeline.before_drain", rank=ctx.rank)
        mine = plan.drain_for(ctx.rank)
        if mine is None or not len(mine.runs):
            return None
        chunks = list(mine.runs)
        parts = drain_parts([c.length for c in chunks], pack_bytes=ctx.drain_pack_bytes)
        hosts = [ctx.topology.host_of(d.rank) for d in plan.drains if len(d.runs)]
        streams = min(len(parts), ctx.drain_streams)  # every draining rank counted alike
        writers, on_host = len(hosts) * streams, hosts.count(ctx.host) * streams
        slab = self._slab()

        def one(lo: int, hi: int) -> PackIndex:
            part = chunks[lo:hi]
            pack_id = layout.new_pack_id(self.step, ctx.host, ctx.rank)
            starts = [self.items[c.key].offset + c.index * ctx.chunk_size for c in part]
            start = monotonic()
            index = write_pack(
                ctx.shared,
                pack_id,
                part,
                slab_runs(slab, starts, part),
                what=f"step {self.step}: drain",
                failpoint="pipeline.after_pack",
                rank=ctx.rank,
            )
            self._emit_write("pack", layout.pack_path(pack_id), index.size, start, writers, on_host)
            return index

        if len(parts) == 1:
            return [one(*parts[0])]
        with ThreadPoolExecutor(streams, thread_name_prefix=f"shoal-drain-r{ctx.rank}") as pool:
            futures = [pool.submit(one, lo, hi) for lo, hi in parts]
            return [f.result() for f in futures]  # the first error, after every upload ended

    def _emit_write(
        self, what: str, path: str, nbytes: int, start: float, writers: int, on_host: int
    ) -> None:
        """One writer record: a pack or file this rank wrote to the shared tier (``docs/events.md``)."""
        end = monotonic()
        self.ctx.events.emit(
            "write",
            self.step,
            tier=self.ctx.shared.kind,
            what=what,
            path=path,
            bytes=nbytes,
            start=start,
            end=end,
            seconds=end - start,
            writers=writers,
            concurrency=writers,
            host_concurrency=on_host,
            durability_path=None if self.decision is None else self.decision.path,
        )

    def _commit(self, reports: list[RankReport], results: list[Any]) -> dict[str, Any]:
        """Coordinator: the manifest from what was drained and what was kept, then the commit.

        :class:`~shoal.records.commit.CheckpointCommit` writes manifest (B3), ``COMMIT`` and
        ``LATEST`` (B4), after checking that every referenced pack is there and that this
        process holds the job. After a failure, :func:`~shoal.records.fence.after_failed_commit`
        says which error to report and whether the claim stands.
        """
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            return {"reached": None, "error": "; ".join(errors)}
        ctx = self.ctx
        commit: CheckpointCommit | None = None
        try:
            assert ctx.shared_catalog is not None
            commit = CheckpointCommit(ctx.shared, self._fence(), self.step, rank=ctx.rank, record=self._wrote)
            drained = TierChunks.of_packs(i for r in results if isinstance(r, Drained) for i in r.packs)
            kept = TierChunks(ctx.shared_catalog.locations, ctx.shared_catalog.packs)
            manifest = build_manifest(self._header(), _items(reports), [drained, kept])
            commit.commit(manifest.encode(), manifest.packs)
            ctx.shared_catalog.add_manifest(manifest, manifest_digest=commit.manifest_digest)
            return {"reached": Boundary.RESTARTABLE, "error": None}
        except Exception as e:
            ctx.shared_catalog = None  # rebuild from what the tier really holds
            if isinstance(ctx.writer, WriterFence):
                e, ctx.writer = after_failed_commit(ctx.writer, ctx.shared, e, f"commit step {self.step}")
            reached = None if commit is None else commit.reached
            return {"reached": reached, "error": self._local("commit", e)}

    def _fence(self) -> WriterFence:
        """This process's claim on the job, made now if this is its first commit (coordinator only)."""
        ctx = self.ctx
        if ctx.writer is None:
            ctx.writer = WriterFence.claim(ctx.shared, host=ctx.host, pid=os.getpid(), resumed=ctx.resumed)
        fence: WriterFence = ctx.writer
        return fence

    def _wrote(self, what: str, path: str, nbytes: int, seconds: float) -> None:
        """The commit's writes (manifest, ``COMMIT``, ``LATEST``): one writer, just finished."""
        self._emit_write(what, path, nbytes, monotonic() - seconds, 1, 1)

    def _own_dcp(self) -> Mapping[str, Any] | None:
        """The DCP metadata this rank's ``finish`` delivered, if it ran DCP's finish."""
        return self.job.dcp if self.job.dcp_ready.is_set() and not self.job.aborted else None

    def _header(self) -> ManifestHeader:
        """The checkpoint's manifest header; its DCP metadata from the C1 report of the finish rank.

        Checkpoints reach the protocol only once their gate opened, that is after ``finish``:
        the rank that ran it reported the metadata in C1. A save made without DCP metadata (a
        test driving the pipeline directly) has none.
        """
        if self.job.aborted:
            raise GroupFailure(f"step {self.step}: the save was aborted: {self.job.aborted}")
        assert self.plan is not None
        topo = self.ctx.topology
        plan = self.plan
        return ManifestHeader(
            job=self.job.job,
            step=self.step,
            created=self.job.created,
            chunk_size=self.ctx.chunk_size,
            world=WorldInfo(topo.world_size, topo.hosts, max(len(topo.ranks_on(h)) for h in topo.hosts)),
            stats=Stats(plan.logical_bytes, plan.unique_bytes, plan.new_bytes),
            shoal_version=__version__,
            dcp=self.dcp,
            run=self.ctx.run_id,
            path=None if self.decision is None else self.decision.path,
            writer=None if self.ctx.writer is None else self.ctx.writer.writer_id,
        )


def emit_checkpoint(ctx: PipelineContext, job: SaveJob, path: str | None) -> None:
    """The checkpoint record of ``job`` on this rank, once it finished (reached B4 or failed)."""
    h = job.handle
    failed_at = h.failed_at
    ctx.events.emit(
        "checkpoint",
        job.step,
        durability_path=path,
        boundaries={b.name: t for b, t in sorted(h.times.items())},
        reached=None if h.reached is None else h.reached.name,
        failed_at=None if failed_at is None else failed_at.name,
        error=None if h.error is None else f"{type(h.error).__name__}: {h.error}",
        bytes=sum(s.nbytes for s in job.slot.items),
        end=monotonic(),
    )


def _items(reports: list[RankReport]) -> list[ItemRecord]:
    """Every rank's reported items as manifest records."""
    return [
        ItemRecord(i.key, r.rank, i.kind, i.nbytes, tuple(i.digests), i.dtype, i.shape)
        for r in reports
        for i in r.items
    ]
