"""Restore: inventory, choose, read each chunk once, verify, repair, spread it (docs/design.md section 5).

Collective, on the background fabric, every rank in the same order:

====  =====================  =====================================================
 R1   gather inventories     each host's leader lists its host; the coordinator
                             adds the shared tier
 R2   broadcast choice       the checkpoint to load (its manifest) or the error
 R3   all-gather needs       each rank's item keys (DCP's read plan, or all): the
                             coordinator plans the reads, every rank the deliveries
 R4   broadcast read plan    who reads which chunk from where, in order
  -   read + verify          every chunk this rank uses against its BLAKE3
                             digest; meanwhile the exchange sends each chunk
                             once to every host needing it as soon as it is
                             read, relays spread it inside the host
                             (:mod:`shoal.group.exchange`,
                             :mod:`shoal.engine.spread`); a chunk only other
                             ranks need goes unchecked, its receivers check
                             it before use
 R5   all-gather failures    chunks whose every local source failed, and those
                             that arrived spoiled (none: done, no R4'); the
 R4'  broadcast repairs      coordinator plans them again (or the error naming
                             the item and every source tried); until none
                             fail; the repaired chunks are then exchanged
 R6   all-gather stats       bytes per tier, so every rank can say what it used
====  =====================  =====================================================

A rank reads only its own host's DRAM and local tiers and the shared tier.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal._collector import collector_paused
from shoal.engine.inventory import (
    HostInventory,
    candidates_and_sources,
    host_inventory,
    shared_inventory,
)
from shoal.engine.spread import Spread, SpreadTotals
from shoal.errors import CheckpointNotFound, ChecksumMismatch, RestoreFailed, ShoalError
from shoal.format import layout
from shoal.format.manifest import Manifest
from shoal.group.exchange import plan_exchange
from shoal.group.fabric import Fabric
from shoal.group.readplan import SHARED, Choice, ChunkRead, ReadPlan, Source, choose_checkpoint, plan_reads
from shoal.group.topology import Topology
from shoal.records.events import monotonic
from shoal.records.fetch import ChunkRequest, ChunkSource, Fetcher, SourceFile
from shoal.tiers.base import Tier

log = logging.getLogger(__name__)

_MAX_ROUNDS = 8


@dataclass(frozen=True)
class LoadReport:
    """What a load used: the step, where its metadata came from, and bytes per source."""

    step: int
    origin: str
    bytes_by_tier: Mapping[str, int]
    """Bytes read from each tier kind (``dram``, ``local``, ``shared``), summed over the job."""
    fabric_bytes: int
    """Bytes sent between ranks."""
    repaired: int
    """Chunks whose first source failed verification or reading and that came from another."""
    skipped: tuple[tuple[int, str], ...] = ()
    """Newer checkpoints passed over, with why."""
    committed: bool = False
    """Whether the checkpoint is committed (B4) on the shared tier."""
    complete: bool = False
    """Whether the job read every item of the checkpoint (not a partial load)."""
    relayed_bytes: int = 0
    """Of ``fabric_bytes``, those a rank of the receiver's own host forwarded (a chunk crosses
    to each host that needs it once, then spreads inside the host)."""
    read_seconds: float = 0.0
    """The slowest rank's time reading its chunks (repairs included)."""
    exchange_seconds: float = 0.0
    """The slowest rank's time waiting for the exchange over the fabric after its reads (the
    exchange begins with them: each chunk goes as soon as it is read)."""

    @property
    def shared_bytes(self) -> int:
        return self.bytes_by_tier.get(SHARED, 0)


def _warn_unread(step: int, saved: list[str], wanted: set[str]) -> None:
    """Say what a partial load left behind *inside* the parts it loaded (the coordinator, once).

    Loading ``{"model": ...}`` alone from a checkpoint that also holds ``"optim"`` is a choice and
    says nothing. But items missing under a top-level key the target has are usually a mistake
    made silently: a fresh optimizer's ``state_dict()`` has no per-parameter state, so its moments
    are never asked for and training resumes with new ones.
    """
    tops = {key.split(".", 1)[0] for key in wanted}
    unread = [key for key in saved if key not in wanted and key.split(".", 1)[0] in tops]
    if not unread:
        return
    where = sorted({key.split(".", 1)[0] for key in unread})
    log.warning(
        "load of step %d: %d saved item(s) under %s were not in the target and were not read "
        "(%s%s). If the target holds a fresh optimizer's state_dict(), it has no per-parameter "
        "state to load into: build it with "
        "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer) "
        "(or after one step) instead",
        step,
        len(unread),
        ", ".join(repr(w) for w in where),
        ", ".join(unread[:3]),
        ", ..." if len(unread) > 3 else "",
    )


@dataclass
class _Stats:
    by_tier: dict[str, int] = field(default_factory=dict)
    spread: SpreadTotals = field(default_factory=SpreadTotals)
    seconds: tuple[float, float] = (0.0, 0.0)
    """This rank's seconds reading (with repairs) and waiting for the exchange after its reads."""
    marks: tuple[float, float, float] | None = None
    """This rank's reads' start, their end (when it starts waiting for the exchange, which began
    with the reads) and the exchange's end, on the event clock
    (:data:`shoal.records.events.monotonic`)."""
    repaired: int = 0


@dataclass
class RestoreContext:
    """What a rank restores with: the fabric, the current topology and the tiers it can read."""

    fabric: Fabric
    topology: Topology
    host: str
    shared: Tier
    host_tiers: Mapping[str, Tier]
    """This host's host tiers by kind (``local``; ``dram`` when partner copies go to DRAM)."""
    dram: Tier | None
    """The staging tier (a :class:`~shoal.tiers.slabs.SlabStore`), whose slabs serve chunks."""
    run_id: str | None = None
    """This run's id: host-tier state recorded under another run is never used."""


class Restore:
    """One load's collective session: :meth:`begin` chooses, :meth:`fetch` fills buffers."""

    def __init__(self, ctx: RestoreContext) -> None:
        self.ctx = ctx
        self.manifest: Manifest | None = None
        self.choice: Choice | None = None
        self.report: LoadReport | None = None
        self._sources: dict[str, list[Source]] = {}
        self._tried: dict[str, list[str]] = {}
        self._complete = False
        self._needs: list[list[str]] = []
        """Per rank, the item keys it reads (R3)."""
        self._stats = _Stats()
        ranks_here = ctx.topology.rank_hosts.count(ctx.host)
        self._fetcher = Fetcher(overlap=_cores() > ranks_here, direct=True)
        """Checks the next chunk in a helper thread only where the host has cores beyond its ranks."""
        self._files: dict[tuple[str, str | None, str, bool], SourceFile | str] = {}
        """Each source file this rank reads, once made (or why it cannot read it)."""
        self._first_use: dict[str, tuple[str, int]] = {}
        """Per digest this rank places, the first (item key, chunk index) it fills: for messages."""
        self.phases: dict[str, float] = {}
        """This rank's seconds in each part of the load (the ``loaded`` event's ``phases``):
        ``choose`` (inventory and choice, R1-R2), ``caller`` (between the choice and the fetch:
        the caller's planning, DCP's for a load), ``agree`` (the read plan, R3-R4), ``places``,
        ``read``, ``verify`` and ``copy`` (the fetcher's range reads, digest checks and copies
        into the destinations), ``rounds`` (the rest of the read rounds: requests, repairs'
        collectives R5-R4'),
        ``exchange``, ``stats`` (R6)."""
        self._chosen_at: float | None = None
        self.fetched_at: float | None = None
        """``perf_counter`` when :meth:`fetch` returned."""

    @property
    def rank_spans(self) -> tuple[float, float, float] | None:
        """This rank's reads' start, their end and the exchange's end (event clock), once fetched."""
        return self._stats.marks

    @property
    def rank_bytes(self) -> int:
        """The bytes this rank read from the tiers (before the exchange)."""
        return sum(self._stats.by_tier.values())

    @property
    def rank(self) -> int:
        return self.ctx.fabric.rank

    # -- R1, R2 ------------------------------------------------------------------------------
    def begin(self, step: int | None) -> Manifest:
        """Collective: take the inventory and agree on the checkpoint to load; returns its manifest."""
        t0 = time.perf_counter()
        with collector_paused():  # decoding manifests and indexes: objects by the million, no cycles
            manifest = self._begin(step)
        self._chosen_at = time.perf_counter()
        self.phases["choose"] = self._chosen_at - t0
        return manifest

    def _begin(self, step: int | None) -> Manifest:
        ctx = self.ctx
        inv: HostInventory | str | None = None
        if ctx.topology.leader(ctx.host) == self.rank:
            try:
                inv = host_inventory(ctx.host, ctx.host_tiers, ctx.dram, run_id=ctx.run_id)
            except Exception as e:
                inv = f"rank {self.rank} ({ctx.host}): inventory failed: {type(e).__name__}: {e}"
        gathered = ctx.fabric.gather((inv, step))
        message: tuple[Manifest, Choice] | Exception | None = None
        if ctx.fabric.is_coordinator:
            assert gathered is not None
            invs = [i for i, _ in gathered]
            asked = {r: s for r, (_, s) in enumerate(gathered)}
            if len(set(asked.values())) > 1:
                message = CheckpointNotFound(
                    f"the ranks asked to load different steps ({_steps_by_rank(asked)}); a load is "
                    "collective: every rank must ask for the same step (or all for the newest, None)"
                )
            else:
                message = self._guarded(lambda: self._choose(invs, step))
        message = ctx.fabric.broadcast(message)
        if isinstance(message, Exception):
            raise message
        assert message is not None
        self.manifest, self.choice = message
        return self.manifest

    def _choose(self, invs: list[Any], step: int | None) -> tuple[Manifest, Choice]:
        """Coordinator: merge the inventories and pick the checkpoint (raises what a load should)."""
        errors = [i for i in invs if isinstance(i, str)]
        hosts = [i for i in invs if isinstance(i, HostInventory)]
        for h in hosts:
            for p in h.problems:
                log.warning("inventory of host %s: %s", h.host, p)
        shared = shared_inventory(self.ctx.shared)
        inv = candidates_and_sources(hosts, shared)
        bad = shared.unreadable
        if step is not None and step in bad and not any(c.step == step for c in inv.candidates):
            raise bad[step]
        try:
            choice = choose_checkpoint(inv.candidates, inv.sources, step, gone=inv.gone)
        except CheckpointNotFound as e:
            newer = [s for s in bad if step is None or s == step]
            if newer:
                raise bad[max(newer)] from e  # the newest checkpoint is there, but its metadata is bad
            if not inv.candidates:
                looked = [self.ctx.shared.url, *sorted({u for h in hosts for u in h.looked})]
                e = CheckpointNotFound(f"{e}; looked in {', '.join(looked)}")
            extra = [*errors, *([shared.problem] if shared.problem else [])]
            if extra:
                raise CheckpointNotFound(f"{e} (also: {'; '.join(extra)})") from e
            raise e from None
        passed = [(s, f"its metadata cannot be read: {bad[s]}") for s in bad if s > choice.step]
        if passed:
            merged = tuple(sorted([*choice.skipped, *passed], reverse=True))
            choice = dataclasses.replace(choice, skipped=merged)
        for s, why in choice.skipped:
            log.warning("not restoring step %d: %s", s, why)
        self._sources = inv.sources
        return inv.manifests[(choice.step, choice.origin)], choice

    # -- R3..R6 ------------------------------------------------------------------------------
    def fetch(self, dests: Mapping[str, memoryview], *, problem: str | None = None) -> LoadReport:
        """Collective: fill each ``dests[key]`` (exactly the item's bytes) with item ``key``'s verified bytes.

        Every rank must call it, even with nothing to read; ``problem`` (a rank's bad read
        request) fails the load on every rank with that message.
        """
        assert self.manifest is not None and self.choice is not None
        phases, start = self.phases, time.perf_counter()
        if self._chosen_at is not None:
            phases["caller"] = start - self._chosen_at
        with collector_paused():  # plans, requests and views by the thousand, no cycles
            plan = self._agree_plan(dests, problem)  # R3, R4
            agreed = time.perf_counter()
            places = self._places(dests)
            held: dict[str, memoryview] = {}
            t0, m0 = time.perf_counter(), monotonic()
            phases["agree"], phases["places"] = agreed - start, t0 - agreed
            phases["exchange"] = 0.0
            error = self._read_rounds(plan, places, held)  # read + exchange, R5, R4', exchange again
            t2 = time.perf_counter()
            waited = phases["exchange"]
            fetcher = sum(phases.get(k, 0.0) for k in ("read", "verify", "copy"))
            phases["rounds"] = max(0.0, t2 - t0 - fetcher - waited)
            self._stats.seconds = (t2 - t0 - waited, waited)
            m2 = monotonic()
            self._stats.marks = (m0, m2 - waited, m2)
            report = self._finish(error)  # R6
            self.fetched_at = time.perf_counter()
            phases["stats"] = self.fetched_at - t2
            return report

    def _agree_plan(self, dests: Mapping[str, memoryview], problem: str | None) -> ReadPlan:
        """R3 (every rank's needs, or its problem) and R4 (the coordinator's read plan)."""
        ctx, manifest = self.ctx, self.manifest
        assert manifest is not None
        if problem is None:
            problem = self._check_dests(manifest, dests)
        needs = ctx.fabric.all_gather((sorted(dests), problem))  # R3
        self._needs = [keys for keys, _ in needs]
        plan: ReadPlan | Exception | str | None = None
        if ctx.fabric.is_coordinator:
            problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(needs) if p]
            plan = "; ".join(problems) if problems else self._guarded(lambda: self._plan(self._needs))
            if isinstance(plan, ReadPlan):
                wanted = {k for keys in self._needs for k in keys}
                full = all(k in wanted or not rec.nbytes for k, rec in manifest.items.items())
                plan = dataclasses.replace(plan, complete=full)
                if not full:
                    _warn_unread(manifest.step, list(manifest.items), wanted)
        plan = self._agree(plan)  # R4
        self._complete = plan.complete
        return plan

    def _places(self, dests: Mapping[str, memoryview]) -> dict[str, list[memoryview]]:
        """Where each digest goes in this rank's buffers."""
        manifest = self.manifest
        assert manifest is not None
        places: dict[str, list[memoryview]] = {}
        first_use = self._first_use
        for key, view in dests.items():
            for i, (d, off, n) in enumerate(manifest.chunk_spans(key)):
                mine = places.get(d)
                if mine is None:
                    places[d] = [view[off : off + n]]
                    first_use[d] = (key, i)
                else:
                    mine.append(view[off : off + n])
        return places

    def _read_rounds(
        self, plan: ReadPlan, places: Mapping[str, list[memoryview]], held: dict[str, memoryview]
    ) -> str | None:
        """Read this rank's part of ``plan`` while the exchange spreads it, then repairs (R5, R4')
        until none fail, and the repaired chunks' exchange; the error that spoiled a received
        chunk, if any.

        The first exchange is planned from the first read plan and runs during the reads: each
        chunk goes as soon as it is read (:class:`~shoal.engine.spread.Spread`). It ends before
        R5, so no collective runs while chunks are in flight. A chunk some rank failed to read
        went out as a placeholder; a chunk only other ranks need went out unchecked (its
        receivers check it). What arrived spoiled is reported at R5 beside what failed, and read
        again, checked this time (from the same copies, so the reader finds the bad one and
        goes on to the next); it goes again from its new reader in an exchange after the repairs.
        """
        ctx = self.ctx
        reader_of = {r.digest: reader for reader, reads in plan.reads.items() for r in reads}
        spread = self._spread(reader_of, places, plan)
        errors: dict[str, str] = {}
        repaired: dict[str, int] = {}
        for round_ in range(_MAX_ROUNDS):
            failed = self._read(plan.reads_at(self.rank), places, held, repairing=round_ > 0, spread=spread)
            spoiled: list[tuple[str, str]] = []
            if spread is not None:
                errors.update(self._wait(spread))
                spread = None
                spoiled = list(errors.items())
            # R5 on every rank: where nothing failed anywhere (the usual case) no repair plan
            # needs to be broadcast, so a clean load pays one collective here, not two.
            reports = ctx.fabric.all_gather((failed, spoiled))
            if not any(f or s for f, s in reports):
                break
            repair: ReadPlan | Exception | None = None
            if ctx.fabric.is_coordinator:
                repair = self._guarded(lambda p=plan, r=reports: self._replan(p, r))
            repair = self._agree(repair)  # R4'
            if not repair.reads:
                break
            plan = repair
            repaired.update((r.digest, reader) for reader, reads in plan.reads.items() for r in reads)
        else:
            step = self.manifest.step if self.manifest is not None else "?"
            raise RestoreFailed(f"step {step}: chunks still failing after {_MAX_ROUNDS} rounds")
        error = next((e for d, e in errors.items() if d not in repaired), None)
        again = self._spread(repaired, places, None) if repaired else None
        if again is not None:  # the repaired chunks, from their new readers, after every read
            for d in repaired:
                if d in held:
                    again.ready(d, held[d])
            late = self._wait(again)  # on every rank, whatever happened before: its peers wait on it
            error = error or next(iter(late.values()), None)
        return error

    def _finish(self, error: str | None) -> LoadReport:
        """R6: every rank's stats (and exchange error), summed into the load's report."""
        manifest, choice = self.manifest, self.choice
        assert manifest is not None and choice is not None
        stats = self.ctx.fabric.all_gather(
            (
                self._stats.by_tier,
                self._stats.spread.fabric,
                self._stats.repaired,
                error,
                self._stats.spread.relayed,
                self._stats.seconds,
            )
        )  # R6
        errors = [f"rank {r}: {s[3]}" for r, s in enumerate(stats) if s[3]]
        if errors:
            raise RestoreFailed("; ".join(errors))
        by_tier: dict[str, int] = {}
        for tiers, *_ in stats:
            for k, v in tiers.items():
                by_tier[k] = by_tier.get(k, 0) + v
        self.report = LoadReport(
            manifest.step,
            choice.origin,
            by_tier,
            sum(s[1] for s in stats),
            sum(s[2] for s in stats),
            choice.skipped,
            choice.committed,
            self._complete,
            sum(s[4] for s in stats),
            max(s[5][0] for s in stats),
            max(s[5][1] for s in stats),
        )
        return self.report

    @staticmethod
    def _check_dests(manifest: Manifest, dests: Mapping[str, memoryview]) -> str | None:
        for key, view in dests.items():
            rec = manifest.items.get(key)
            if rec is None:
                return f"step {manifest.step} has no item {key!r}"
            if view.nbytes != rec.nbytes:
                return f"item {key!r} is {rec.nbytes} bytes, its destination holds {view.nbytes}"
        return None

    def _guarded(self, fn: Any) -> Any:
        """Coordinator work whose error every rank must raise: the error, as a value to broadcast."""
        try:
            return fn()
        except ShoalError as e:
            return e
        except Exception as e:  # a bug must not leave the other ranks waiting in a collective
            log.exception("restore: unexpected error on the coordinator")
            return RestoreFailed(f"{type(e).__name__}: {e}")

    def _agree(self, plan: ReadPlan | Exception | str | None) -> ReadPlan:
        plan = self.ctx.fabric.broadcast(plan)
        if isinstance(plan, Exception):
            raise plan
        if isinstance(plan, str):
            raise RestoreFailed(plan)
        assert isinstance(plan, ReadPlan)
        return plan

    def _plan(self, needs: list[list[str]]) -> ReadPlan:
        manifest = self.manifest
        assert manifest is not None
        per_rank: dict[int, list[str]] = {}
        lengths: dict[str, int] = {}
        for rank, keys in enumerate(needs):
            mine = per_rank.setdefault(rank, [])
            for key in keys:
                for d, _, n in manifest.chunk_spans(key):
                    mine.append(d)
                    lengths[d] = n
        return plan_reads(per_rank, lengths, self._sources, self.ctx.topology.rank_hosts)

    def _replan(
        self, plan: ReadPlan, reports: list[tuple[list[tuple[str, list[str]]], list[tuple[str, str]]]]
    ) -> ReadPlan:
        """Plan again the chunks that failed (without the sources that failed, or say what is lost)
        and those that arrived spoiled (R5's ``reports``: each rank's failures and what it received
        spoiled); these keep their sources: read again, checked, the bad copy is passed over."""
        manifest = self.manifest
        assert manifest is not None
        failed: dict[str, list[str]] = {}
        for rank_failures, _ in reports:
            for d, tried in rank_failures:
                failed.setdefault(d, []).extend(tried)
        spoiled: dict[str, list[str]] = {}
        for _, rank_spoiled in reports:
            for d, error in rank_spoiled:
                if d not in failed:
                    spoiled.setdefault(d, []).append(f"ChecksumMismatch: {error}")
        for d, texts in spoiled.items():
            self._tried.setdefault(d, []).extend(texts)
        if not failed and not spoiled:
            return ReadPlan({})
        by_digest = {r.digest: r for reads in plan.reads.values() for r in reads}
        tried_sources: dict[str, set[Source]] = {}
        for d in failed:
            tried_sources[d] = set(by_digest[d].sources)
            self._tried.setdefault(d, []).extend(failed[d])
            # Sources this reader could not reach are no use to anyone else either.
            self._sources[d] = [s for s in self._sources.get(d, []) if s not in tried_sources[d]]
        lost = [d for d in failed if not self._sources[d]]
        if lost:
            corrupt = all("ChecksumMismatch" in t for d in lost for t in self._tried[d])
            raise (ChecksumMismatch if corrupt else RestoreFailed)(self._lost_message(lost))
        per_rank: dict[int, list[str]] = {}
        for d in [*failed, *spoiled]:
            for c in by_digest[d].consumers:
                per_rank.setdefault(c, []).append(d)
        lengths = {d: by_digest[d].length for d in [*failed, *spoiled]}
        return plan_reads(per_rank, lengths, self._sources, self.ctx.topology.rank_hosts)

    def _lost_message(self, lost: list[str]) -> str:
        manifest = self.manifest
        assert manifest is not None
        lines = []
        for d in lost[:5]:
            where = [
                f"item {key!r} chunk {i}"
                for key, rec in manifest.items.items()
                for i, c in enumerate(rec.chunks)
                if c == d
            ]
            lines.append(f"{', '.join(where[:3])} ({d}): tried {'; '.join(self._tried.get(d, []))}")
        more = f" (and {len(lost) - 5} more chunks)" if len(lost) > 5 else ""
        return f"step {manifest.step}: no good copy left of " + " | ".join(lines) + more

    # -- reading -----------------------------------------------------------------------------
    def _source_file(self, s: Source) -> SourceFile | str:
        """The file ``s`` names on this rank's tiers, or why this rank cannot read it."""
        key = (s.tier, s.host, s.path, s.slab)
        found = self._files.get(key)
        if found is not None:
            return found
        ctx = self.ctx
        made: SourceFile | str
        if s.host is None:
            made = SourceFile(ctx.shared, layout.pack_path(s.path), kind=SHARED, label="shared tier")
        elif s.host != ctx.host:
            made = f"{s.describe()}: not on this rank's host {ctx.host!r}"
        elif s.slab:
            label = f"{s.tier} tier of host {s.host!r}"
            dram = ctx.dram
            made = SourceFile(dram, s.path, slab=True, kind=s.tier, label=label) if dram else "no DRAM tier"
        else:
            tier = ctx.host_tiers.get(s.tier)
            label = f"{s.tier} tier of host {s.host!r}"
            path = layout.pack_path(s.path)
            made = SourceFile(tier, path, kind=s.tier, label=label) if tier else f"no {s.tier} tier here"
        self._files[key] = made
        return made

    def _request(
        self, r: ChunkRead, dest: list[memoryview], *, check: bool = True
    ) -> tuple[ChunkRequest, list[str]]:
        """The fetcher's request for ``r`` (the sources this rank can read), and the others, described.

        ``check=False``: a chunk only other ranks need is sent on unchecked (they check it)."""
        sources: list[ChunkSource] = []
        unusable: list[str] = []
        for s in r.sources:
            file = self._source_file(s)
            if isinstance(file, str):
                if s.host is None or s.host == self.ctx.host:
                    unusable.append(f"{s.describe()}: {file}")
                continue
            sources.append(ChunkSource(file, s.offset))
        use = self._first_use.get(r.digest)
        what = f"item {use[0]!r} chunk {use[1]} ({r.digest})" if use else ""
        keep = not dest
        request = ChunkRequest(r.digest, r.length, dest, sources, what, keep=keep, check=check or not keep)
        return request, unusable

    def _read(
        self,
        reads: tuple[ChunkRead, ...],
        places: Mapping[str, list[memoryview]],
        held: dict[str, memoryview],
        *,
        repairing: bool = False,
        spread: Spread | None = None,
    ) -> list[tuple[str, list[str]]]:
        """Read and verify this rank's chunks; return ``(digest, [what was tried])`` for each that failed.

        One fetch (:class:`~shoal.records.fetch.Fetcher`) for all of them: per contiguous run of
        a pack or slab, verified before any byte reaches a destination. A chunk only other ranks
        need is kept as the fetcher hands it back, to send: the source's own bytes where its
        tier lends them (a DRAM slab, a host tier's pack), else a copy. ``repairing``: these
        chunks failed on another host first (each counts as repaired). ``spread``: told of each
        chunk as soon as it is verified, to send it on.
        """
        requests: list[ChunkRequest] = []
        unusable: list[list[str]] = []
        for r in reads:
            # The first reads send what only other ranks need unchecked: its receivers check it
            # (and report it for a repair, R5). A repair's reads check everything they send.
            req, bad = self._request(r, places.get(r.digest) or [], check=repairing or spread is None)
            requests.append(req)
            unusable.append(bad)
        t0 = time.perf_counter()
        on_delivered = None
        if spread is not None:
            ready = spread.ready

            def on_delivered(i: int, chunk: memoryview) -> None:
                ready(requests[i].digest, chunk)

        result = self._fetcher.fetch(requests, on_delivered=on_delivered)
        log.debug(
            "read %d chunks (%d bytes) in %d reads in %.4f s",
            len(requests),
            result.bytes_read,
            result.reads,
            time.perf_counter() - t0,
        )
        for tier, n in result.bytes_by_kind.items():
            self._stats.by_tier[tier] = self._stats.by_tier.get(tier, 0) + n
        self._add_phase("read", result.read_seconds)
        self._add_phase("verify", result.verify_seconds)
        self._add_phase("copy", result.copy_seconds)
        failed = []
        for i, req in enumerate(requests):
            tried = unusable[i] + [f.describe() for f in result.failures.get(i, ())]
            used = result.used[i]
            if used is None:
                failed.append(
                    (req.digest, tried or [f"rank {self.rank}: no source reachable from {self.ctx.host}"])
                )
                continue
            held[req.digest] = req.dests[0] if req.dests else result.kept[i]
            if used or tried or repairing:
                self._stats.repaired += 1
        return failed

    def _add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    # -- the exchange ------------------------------------------------------------------------
    def _spread(
        self, reader_of: Mapping[str, int], places: Mapping[str, list[memoryview]], plan: ReadPlan | None
    ) -> Spread | None:
        """The exchange of the chunks in ``reader_of`` (digest -> its reader), its receives posted.

        The plan (:func:`~shoal.group.exchange.plan_exchange`) sends each chunk once to every
        other host that needs it; that host's relay forwards it inside the host. Every rank
        computes it alike, from the agreed readers and needs; with ``plan`` (the read plan),
        each reader's chunks go in the order it reads them. None on a one-rank fabric.
        """
        ctx = self.ctx
        if ctx.fabric.world_size == 1:
            return None
        manifest = self.manifest
        assert manifest is not None
        items = manifest.items
        needs_all = [sorted({d for k in ks for d in items[k].chunks if d in reader_of}) for ks in self._needs]
        lengths: dict[str, int] = {}
        for key in {k for keys in self._needs for k in keys}:
            for d, _, n in manifest.chunk_spans(key):
                lengths[d] = n
        order = _read_order(plan, ctx.topology.rank_hosts) if plan is not None else None
        step = manifest.step
        return Spread(
            ctx.fabric,
            plan_exchange(reader_of, needs_all, ctx.topology.rank_hosts, order),
            places,
            lengths,
            lambda d, how: f"step {step}: chunk {d} arrived {how}",
            self._stats.spread,
        )

    def _wait(self, spread: Spread) -> dict[str, str]:
        """The rest of ``spread`` after this rank's reads (timed as the ``exchange`` phase)."""
        t0 = time.perf_counter()
        try:
            return spread.finish()
        finally:
            self._add_phase("exchange", time.perf_counter() - t0)


def _read_order(plan: ReadPlan, rank_hosts: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per digest, where its reader reads it in its fetch: (the file's turn, the offset in it).

    The fetcher reads a rank's chunks file by file, in the order their files first appear in
    the rank's reads, each file by offset; a chunk's file is its first source the reader's host
    can reach. Every rank computes the same from the agreed plan; where a reader's fetch goes
    otherwise (a source that fails), only how soon its sends go changes, not what is sent.
    """
    order: dict[str, tuple[int, int]] = {}
    for reader, reads in plan.reads.items():
        host = rank_hosts[reader]
        files: dict[tuple[str, str | None, str, bool], int] = {}
        for r in reads:
            s = next((s for s in r.sources if s.host is None or s.host == host), None)
            if s is None:
                continue
            turn = files.setdefault((s.tier, s.host, s.path, s.slab), len(files))
            order[r.digest] = (turn, s.offset)
    return order


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def sources_in(report: LoadReport) -> str:
    """A one-line account of a load's sources, for logs and the CLI."""
    parts = [f"{tier} {n / 2**20:.1f} MiB" for tier, n in sorted(report.bytes_by_tier.items()) if n]
    return f"step {report.step} (metadata from {report.origin}): " + (", ".join(parts) or "nothing read")


__all__ = ["LoadReport", "Restore", "RestoreContext", "RestoreFailed", "sources_in"]


def _steps_by_rank(asked: dict[int, int | None]) -> str:
    """``"step 3 on ranks [2, 3], step 4 on ranks [0, 1]"``, for the message."""
    by_step: dict[int | None, list[int]] = {}
    for rank, step in asked.items():
        by_step.setdefault(step, []).append(rank)
    return ", ".join(
        f"{'the newest' if s is None else f'step {s}'} on ranks {ranks}"
        for s, ranks in sorted(by_step.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    )
