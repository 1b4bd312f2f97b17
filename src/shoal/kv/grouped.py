"""Grouped reads: the ranks of one serving instance read each shared KV block once (docs/design.md §12).

When several ranks of one instance (tensor parallel) need the same blocks, one rank reads each
block from the store and the bytes cross the fabric to the others; a block already in a rank's
host DRAM pool is read by that rank from memory and never crosses the fabric to it.

:meth:`GroupedReader.get_batch_into` is collective over the fabric's ranks (those of one
instance): every rank calls it once per batch, in the same order, each with the keys it needs
(possibly different, overlapping sets, possibly none), and makes the same two all-gathers:

====  =====================  =====================================================
 G1   all-gather wants       each rank: its host, and per wanted key the digest,
                             the size of its buffer and whether its host's DRAM
                             pool holds it (``store.contains``). A key this rank
                             cannot take (a bad buffer) is not sent: it is an
                             error result on this rank only
 G2   plan (pure, no round)  :func:`~shoal.kv._grouped_plan.plan_grouped_read`:
                             DRAM holders read locally; one reader per other
                             block, balanced by bytes among the ranks wanting it;
                             ranks that give one key two sizes: an error on every
                             rank that wants it, nothing read
 G3   read                   each rank's ``store.get_batch_into`` (one batch, its
                             deadline) straight into its own destination buffers;
                             the store verifies every block. Never raises: a
                             failed batch is an error result for each of its keys
 G3'  all-gather status      each reader, per block it sends: hit (with the BLAKE3
                             of the bytes and the tier), miss (with the reason) or
                             error (its type and message); and every rank whether
                             it is past its own deadline. A block its reader did
                             not hit travels nowhere and is the same miss or error
                             on every rank that wanted it; a late rank receives
                             nothing (its fabric blocks are ``deadline`` misses),
                             so no rank waits for a send that never comes
 G4   exchange               :func:`~shoal.kv._grouped_plan.plan_grouped_deliveries`
                             (:mod:`shoal.group.exchange`: each block crosses to
                             each other host once, a relay spreads it inside the
                             host). Every receive is posted at once, straight into
                             its destination buffer; each block is verified again
                             on arrival against the reader's digest: a mismatch is
                             a ``corrupt`` miss on that rank, never served
====  =====================  =====================================================

Local work between the collectives never raises (errors become results), so every rank makes
the same collectives and learns the same outcome for every key. Only a caller error that no
per-key result can carry (``keys`` and ``buffers`` of different lengths) raises, and only after
the rank took part in every collective with no wants, so the other ranks still finish.

A result's ``tier`` is where its reader got the bytes; :meth:`GroupedReader.last_sources` says
which rank that was for each key of the last batch (``GetResult`` has no field for it), and
:meth:`GroupedReader.stats` counts what crossed the fabric.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from shoal import errors as shoal_errors
from shoal.config import Config
from shoal.errors import ChecksumMismatch, ConfigError, ShoalError, TierError
from shoal.format.chunking import digest
from shoal.kv._buffers import writable_view
from shoal.kv._grouped_plan import (
    BlockAssignment,
    GroupedReadPlan,
    RankWants,
    Want,
    plan_grouped_deliveries,
    plan_grouped_read,
)
from shoal.kv._results import DRAM, BlockSizeError, GetResult, MissReason
from shoal.kv.keys import BlockKey

log = logging.getLogger(__name__)

__all__ = ["BlockSource", "GroupFabric", "GroupedReader", "GroupedStats"]


class BlockSource(Protocol):
    """What a grouped read needs of a store (:class:`shoal.kv.store.KVStore` is one)."""

    def get_batch_into(
        self, keys: Sequence[BlockKey], buffers: Sequence[Any], *, deadline: float | None = None
    ) -> list[GetResult]: ...

    def contains(self, key: BlockKey) -> str | None: ...


class GroupFabric(Protocol):
    """The collectives a grouped read uses (:class:`shoal.group.fabric.Fabric` has them)."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def post_sends(self, sends: Sequence[tuple[int, Sequence[memoryview]]]) -> list[Any]: ...

    def post_receives(self, receives: Sequence[tuple[int, memoryview]]) -> list[Any]: ...

    def wait_all(self, works: Sequence[Any]) -> None: ...


@dataclass(frozen=True)
class GroupedStats:
    """One rank's running totals over its grouped reads."""

    batches: int = 0
    blocks_read: int = 0
    """Blocks this rank read from its own store (for itself, and as reader for others)."""
    bytes_read: int = 0
    bytes_read_below_dram: int = 0
    """Of ``bytes_read``, those its store got from the local or shared tier (the slow reads)."""
    blocks_sent: int = 0
    bytes_sent: int = 0
    """Bytes this rank posted to other ranks (as reader, or relaying inside its host)."""
    blocks_received: int = 0
    bytes_received: int = 0
    corrupt_received: int = 0
    """Blocks that arrived over the fabric and failed verification (misses, never served)."""


@dataclass(frozen=True)
class _Status:
    """A reader's outcome for one block it sends, as it travels in G3' (plain, picklable fields)."""

    digest: str
    status: str
    reason: str | None
    tier: str | None
    content: str | None
    """BLAKE3 of the bytes read (on a hit)."""
    error_type: str | None = None
    error_text: str | None = None


@dataclass
class _Batch:
    """One rank's view of one call: its distinct wants, their buffers and results so far."""

    keys: list[BlockKey]
    buffers: list[Any]
    views: dict[str, memoryview]
    """digest -> the destination buffer of its first occurrence."""
    first: dict[str, int]
    """digest -> index of its first occurrence in ``keys``."""
    results: list[GetResult | None]
    sources: list[int | None]


_REASONS: dict[str, MissReason] = {"absent": "absent", "deadline": "deadline", "corrupt": "corrupt"}


def _rebuild_error(status: _Status, reader: int) -> ShoalError:
    """The reader's error, as the same ShoalError class where shoal.errors has it (else TierError)."""
    text = f"{status.error_text} (read by rank {reader} for a grouped read of block {status.digest})"
    cls = getattr(shoal_errors, status.error_type or "", None)
    if status.error_type == BlockSizeError.__name__:
        cls = BlockSizeError
    if isinstance(cls, type) and issubclass(cls, ShoalError):
        try:
            return cls(text)
        except TypeError:
            pass
    return TierError(text)


def _destination(buf: Any, what: str) -> memoryview | ConfigError:
    """``buf`` as a writable byte view (bytes land in it, never a copy), or why it cannot be one."""
    try:
        view = writable_view(buf, what)
    except ConfigError as e:
        return e
    if view.nbytes == 0:
        return ConfigError(f"{what} is empty; pass a buffer of the block's size")
    return view


def _result_of(key: BlockKey, status: _Status, reader: int) -> GetResult:
    """A receiver's result for a block its reader did not hit: the same miss or error."""
    if status.status == "miss":
        return GetResult(key, "miss", reason=_REASONS.get(status.reason or "", "absent"))
    return GetResult(key, "error", error=_rebuild_error(status, reader))


class GroupedReader:
    """Grouped reads over one instance's ranks (module docstring: the G1-G4 contract).

    Built once per rank with that rank's store (its host's pool and lower tiers) and the
    instance's fabric; ``host`` names the rank's host for the exchange (ranks of one host share
    its fabric link), by default :meth:`shoal.Config.resolved`'s host id (``$SHOAL_HOST_ID`` or
    the hostname). Not thread-safe: one batch at a time per rank, as every collective.
    """

    def __init__(self, store: BlockSource, fabric: GroupFabric, *, host: str | None = None) -> None:
        self.store = store
        self.fabric = fabric
        self.host = host or Config(shared="-").resolved(fabric.rank).host_id or "host"
        self._stats = GroupedStats()
        self._last_sources: tuple[int | None, ...] = ()

    def stats(self) -> GroupedStats:
        """This rank's running totals (not collective)."""
        return self._stats

    def last_sources(self) -> tuple[int | None, ...]:
        """Per key of the last batch: the rank that read it from its store (this rank or another),
        or None where nothing was read (a bad buffer, a size conflict)."""
        return self._last_sources

    def get_batch_into(
        self, keys: Sequence[BlockKey], buffers: Sequence[Any], *, deadline: float | None = None
    ) -> list[GetResult]:
        """Collective (every rank of the fabric, once per batch, same order): fill ``buffers[i]``
        with the block of ``keys[i]``; a result per key, as :meth:`KVStore.get_batch_into` gives.

        ``deadline`` (this rank's ``time.monotonic()`` instant) bounds this rank's reads, and a
        block still to come over the fabric when this rank reaches G3' past it is a ``deadline``
        miss. Raises :class:`~shoal.errors.ConfigError` only when ``keys`` and ``buffers``
        differ in length, after taking part in every collective.
        """
        bad_call = len(keys) != len(buffers)
        batch = self._prepare([] if bad_call else list(keys), [] if bad_call else list(buffers))
        wants = self.fabric.all_gather((self.host, self._wants(batch)))  # G1
        plan = plan_grouped_read([RankWants(h, tuple(Want(*w) for w in ws)) for h, ws in wants])  # G2
        self._conflicts(plan, batch)
        mine = self._read(plan, batch, deadline)  # G3
        late = deadline is not None and time.monotonic() > deadline
        gathered = self.fabric.all_gather((late, mine))  # G3'
        self._exchange(plan, batch, gathered)  # G4
        self._finish(batch)
        if bad_call:
            raise ConfigError(
                f"GroupedReader.get_batch_into on rank {self.fabric.rank}: {len(keys)} keys but "
                f"{len(buffers)} buffers; pass one buffer per key"
            )
        assert all(r is not None for r in batch.results)
        return [r for r in batch.results if r is not None]

    def _prepare(self, keys: list[BlockKey], buffers: list[Any]) -> _Batch:
        """This rank's distinct wants; a key whose buffer is unusable is an error result now."""
        batch = _Batch(keys, buffers, {}, {}, [None] * len(keys), [None] * len(keys))
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            d = key.digest
            if d in batch.first:
                continue
            view = _destination(buf, f"buffer {i} for block {d} (grouped read, rank {self.fabric.rank})")
            if isinstance(view, ConfigError):
                batch.results[i] = GetResult(key, "error", error=view)
                continue
            batch.first[d] = i
            batch.views[d] = view
        return batch

    def _wants(self, batch: _Batch) -> tuple[tuple[str, int, bool], ...]:
        """G1's payload: (digest, buffer size, in this host's DRAM) per distinct usable want."""
        out = []
        for d, i in batch.first.items():
            try:
                in_dram = self.store.contains(batch.keys[i]) == DRAM
            except Exception:  # a failing lookup only loses the shortcut; the read will tell
                in_dram = False
            out.append((d, batch.views[d].nbytes, in_dram))
        return tuple(out)

    def _conflicts(self, plan: GroupedReadPlan, batch: _Batch) -> None:
        for c in plan.conflicts:
            if c.digest in batch.first:
                i = batch.first[c.digest]
                batch.results[i] = GetResult(batch.keys[i], "error", error=ConfigError(c.message()))

    def _read(self, plan: GroupedReadPlan, batch: _Batch, deadline: float | None) -> tuple[_Status, ...]:
        """G3: this rank's reads in one store batch; the status of each block it sends to others."""
        me = self.fabric.rank
        reads = plan.reads_at(me)
        keys = [batch.keys[batch.first[b.digest]] for b in reads]
        try:
            got = self.store.get_batch_into(keys, [batch.views[b.digest] for b in reads], deadline=deadline)
            if len(got) != len(keys):
                raise TierError(f"the store gave {len(got)} results for {len(keys)} keys")
        except Exception as e:  # errors as values: every key of the batch is an error, on every rank
            err = e if isinstance(e, ShoalError) else TierError(f"{type(e).__name__}: {e}")
            log.warning(
                "grouped read on rank %d: the store's batch of %d blocks failed: %s", me, len(keys), e
            )
            got = [GetResult(k, "error", error=err) for k in keys]
        out: list[_Status] = []
        read_bytes = slow_bytes = 0
        for b, res in zip(reads, got, strict=True):
            i = batch.first[b.digest]
            batch.results[i] = res
            batch.sources[i] = me
            if res.hit:
                read_bytes += res.nbytes
                slow_bytes += res.nbytes if res.tier != DRAM else 0
            if b.reader == me and b.receivers:
                out.append(self._status_of(b, res, batch.views[b.digest]))
        self._stats = replace(
            self._stats,
            blocks_read=self._stats.blocks_read + sum(1 for r in got if r.hit),
            bytes_read=self._stats.bytes_read + read_bytes,
            bytes_read_below_dram=self._stats.bytes_read_below_dram + slow_bytes,
        )
        return tuple(out)

    @staticmethod
    def _status_of(block: BlockAssignment, res: GetResult, view: memoryview) -> _Status:
        if res.hit:  # the digest the store verified the bytes against, if it says; else their own
            return _Status(block.digest, "hit", None, res.tier, res.payload_digest or digest(view))
        err = res.error
        return _Status(
            block.digest,
            res.status,
            res.reason,
            None,
            None,
            type(err).__name__ if err is not None else None,
            str(err) if err is not None else None,
        )

    def _exchange(self, plan: GroupedReadPlan, batch: _Batch, gathered: Sequence[Any]) -> None:
        """G4: outcomes agreed in G3', then the transfers; every arrival verified before it counts."""
        me = self.fabric.rank
        late = [r for r, (is_late, _) in enumerate(gathered) if is_late]
        status_of: dict[str, _Status] = {s.digest: s for _, statuses in gathered for s in statuses}
        delivered = {d: s.status == "hit" for d, s in status_of.items()}
        for b in plan.blocks:
            if me not in b.receivers or b.digest not in batch.first:
                continue
            i = batch.first[b.digest]
            batch.sources[i] = b.reader
            s = status_of[b.digest]
            if s.status != "hit":
                batch.results[i] = _result_of(batch.keys[i], s, b.reader)
            elif me in late:
                batch.results[i] = GetResult(batch.keys[i], "miss", reason="deadline")
        exchange = plan_grouped_deliveries(plan, delivered, late)
        incoming = exchange.incoming_at(me)
        receives = self.fabric.post_receives([(x.src, batch.views[x.digest]) for x in incoming])
        sends = [(x.dst, [batch.views[x.digest]]) for x in exchange.sends_at(me)]
        forwards = exchange.forwards_at(me)
        works = self.fabric.post_sends(sends)
        sent = [batch.views[x.digest].nbytes for x in exchange.sends_at(me)]
        got = corrupt = 0
        for x, work in zip(incoming, receives, strict=True):
            work.wait()
            view = batch.views[x.digest]
            if x.digest in forwards:
                relay = [(dst, [view]) for dst in forwards[x.digest]]
                works += self.fabric.post_sends(relay)
                sent += [view.nbytes] * len(relay)
            i = batch.first[x.digest]
            res = self._arrived(batch.keys[i], view, status_of[x.digest], x.src)
            batch.results[i] = res
            got += view.nbytes
            corrupt += not res.hit
        self.fabric.wait_all(works)
        self._stats = replace(
            self._stats,
            blocks_sent=self._stats.blocks_sent + len(sent),
            bytes_sent=self._stats.bytes_sent + sum(sent),
            blocks_received=self._stats.blocks_received + len(incoming),
            bytes_received=self._stats.bytes_received + got,
            corrupt_received=self._stats.corrupt_received + corrupt,
        )

    def _arrived(self, key: BlockKey, view: memoryview, status: _Status, src: int) -> GetResult:
        """A block that came over the fabric: a hit only if it hashes to what its reader read."""
        actual = digest(view)
        if actual == status.content:
            return GetResult(key, "hit", tier=status.tier, nbytes=view.nbytes, payload_digest=actual)
        err = ChecksumMismatch(
            f"grouped read: block {key.digest} from rank {src} to rank {self.fabric.rank} hashes to "
            f"{actual}, its reader read {status.content}; it is a miss (recompute it), never served"
        )
        log.warning("%s", err)
        return GetResult(key, "miss", error=err, reason="corrupt")

    def _finish(self, batch: _Batch) -> None:
        """Repeated keys of the batch get a copy of their first occurrence's block; stats, sources."""
        for i, key in enumerate(batch.keys):
            if batch.results[i] is not None:
                continue
            j = batch.first[key.digest]
            first = batch.results[j]
            assert first is not None
            batch.sources[i] = batch.sources[j]
            view = _destination(batch.buffers[i], f"buffer {i} for block {key.digest} (a repeated key)")
            size = batch.views[key.digest].nbytes
            if first.hit and isinstance(view, memoryview) and view.nbytes == size:
                view[:] = batch.views[key.digest]
                batch.results[i] = first
            elif first.hit:
                err = (
                    view
                    if isinstance(view, ConfigError)
                    else BlockSizeError(
                        f"grouped read of block {key.digest} on rank {self.fabric.rank}: key {i} repeats key "
                        f"{j}, whose block is {size} bytes, but its buffer is {view.nbytes} bytes",
                        size,
                    )
                )
                batch.results[i] = GetResult(key, "error", error=err)
            else:
                batch.results[i] = first
        self._last_sources = tuple(batch.sources)
        self._stats = replace(self._stats, batches=self._stats.batches + 1)
