"""The chunk fetcher: chunks by digest into destination buffers, verified, repaired from the next source.

Every verified chunk read goes through :class:`Fetcher`: restore (:mod:`shoal.engine.restore`),
:class:`~shoal.records.store.ItemReader` (and so ``shoal export``) and ``shoal verify``.

Each :class:`ChunkRequest` names a chunk (its digest and length), the buffers its bytes go to,
and the places it can be read from, best first (:class:`ChunkSource`: a pack or staging slab
of a tier, and an offset in it). :meth:`Fetcher.fetch` reads every chunk from its first source,
checks its BLAKE3 digest (:func:`shoal.format.chunking.verify`, the one digest check) and only
then copies it into its destinations. A chunk whose read fails (missing file, short read,
any read error) or whose digest does not match is read again from its next source, in a later
round; every failure is recorded, and a chunk whose sources are all spent is reported lost.
A request made with ``check=False`` (a chunk with no destination here, kept only to be sent on:
its receivers check it) is handed back unchecked.

Reads go per contiguous run: the chunks whose current source lies back to back in one file
(pack or slab) are read with one range read (``Tier.read_range_into``,
``DramTier.read_slab_into``) into a scratch buffer of at most ``max_run`` bytes, then
verified and scattered from memoryview slices of it; so many small items cost one read, not
one open each. A run whose read fails is read again chunk by chunk, so a truncated pack loses
only the chunks past its end. Bytes reach a destination only after their digest matched: a
destination of a chunk that was never delivered is left as it was.

A slab of a tier that lends its bytes (:class:`~shoal.tiers.slabs.MappedSlabs`: the DRAM tier)
is not read into the scratch buffer: it is mapped once per fetch, each chunk is verified where
it lies and copied from there into its destinations, one copy per byte. Where the run's chunks
are of :data:`OVERLAP_MIN` or more, the digest of the next one is checked in a helper thread
while this one is copied (the hash runs without the interpreter lock), so the check costs no
time beside the copy where a core is free; smaller chunks are checked inline, and so is every
chunk of a fetcher made with ``overlap=False`` (the restore's, where the host has no core beyond
its ranks: there the helper thread only adds switches).

A fetcher made with ``direct=True`` (the restore's) reads a chunk of :data:`DIRECT_MIN` or more
that has a destination straight into its first destination, checks it there, and copies it
to the others: one copy per byte less than through the scratch buffer. A destination of a
chunk that such a fetcher did not deliver then holds whatever was read (not what it held
before); the restore fills it from another source or fails the load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import NamedTuple

from shoal.errors import ChecksumMismatch, TierError
from shoal.format.chunking import verify
from shoal.tiers.base import Tier
from shoal.tiers.slabs import MappedFiles, MappedSlabs, SlabStore

log = logging.getLogger(__name__)

OVERLAP_MIN = 1 << 20
"""Chunks of a lent run at least this big have the next one's digest checked in a helper thread."""
DIRECT_MIN = 1 << 20
"""Chunks at least this big are read straight into their destination by a ``direct`` fetcher."""
DEFAULT_MAX_RUN = 8 << 20
"""Largest range read (and so scratch buffer), in bytes; a longer chunk is read alone."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file chunks are read from: pack ``path`` of ``tier``, or (``slab``) its staging slab ``path``.

    ``kind`` is what the bytes read from it count under (:attr:`FetchResult.bytes_by_kind`:
    ``dram``, ``local``, ``shared``); ``label`` an optional note for messages ("shared tier",
    "dram tier of host 'h1'").
    """

    tier: Tier
    path: str
    slab: bool = False
    kind: str = ""
    label: str = ""

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset`` (raises if fewer are there)."""
        if not self.slab:
            self.tier.read_range_into(self.path, offset, out)
            return
        if not isinstance(self.tier, SlabStore):
            raise TierError(f"tier {self.tier.url} holds no staging slabs (asked for slab {self.path})")
        self.tier.read_slab_into(self.path, offset, out)

    def mapped(self) -> memoryview | None:
        """The whole file or slab without a copy, where the tier lends it (None: read it with
        :meth:`read_into`)."""
        if self.slab:
            return self.tier.map_slab(self.path) if isinstance(self.tier, MappedSlabs) else None
        return self.tier.map_file(self.path) if isinstance(self.tier, MappedFiles) else None

    def describe(self, offset: int) -> str:
        what = f"slab {self.path} of {self.tier.url}" if self.slab else f"pack {self.tier.url}/{self.path}"
        return f"{what} at offset {offset}" + (f" ({self.label})" if self.label else "")


class ChunkSource(NamedTuple):
    """A chunk's place: ``offset`` bytes into ``file``."""

    file: SourceFile
    offset: int

    def describe(self) -> str:
        return self.file.describe(self.offset)


@dataclass(slots=True)
class ChunkRequest:
    """One chunk to fetch: ``length`` bytes whose BLAKE3 digest is ``digest``.

    Its verified bytes are copied into every buffer of ``dests`` (each exactly ``length``
    bytes; none: only verify it, or with ``keep`` hand them back); ``sources`` are tried in
    order. ``what`` names the chunk in messages (``"item 'w' of step 3: chunk 1"``); empty,
    the digest does.
    """

    digest: str
    length: int
    dests: Sequence[memoryview]
    sources: Sequence[ChunkSource]
    what: str = ""
    keep: bool = False
    """Hand the verified bytes back (:attr:`FetchResult.kept`): where the source lends them
    (a mapped slab or host file), the source's own bytes, with no copy; else a copy."""
    check: bool = True
    """Check the digest here. Only a chunk with no ``dests``, kept to be sent on, may skip it
    (False): its receivers check it before they use a byte, and report it if it is bad (the
    restore's first reads, where every byte a rank reads for others would be hashed twice)."""

    def __post_init__(self) -> None:
        if not self.check and self.dests:
            raise ValueError(f"{self.describe()}: a chunk with destinations is checked where it is read")

    def describe(self) -> str:
        return self.what or f"chunk {self.digest}"


@dataclass(frozen=True)
class Failure:
    """One failed attempt: reading the chunk from ``source`` raised ``error`` (a read error or a mismatch)."""

    source: ChunkSource
    error: Exception

    def describe(self) -> str:
        """``"<source>: <ErrorType>: <message>"``; a digest mismatch's message already names the source."""
        if isinstance(self.error, ChecksumMismatch):
            return f"ChecksumMismatch: {self.error}"
        return f"{self.source.describe()}: {type(self.error).__name__}: {self.error}"


@dataclass
class FetchResult:
    """What :meth:`Fetcher.fetch` did, per request (by index) and in all."""

    used: list[int | None]
    """Per request, the index in its sources of the one that delivered it; None if none did."""
    failures: dict[int, list[Failure]] = field(default_factory=dict)
    """Per request that had any, its failed attempts in the order tried."""
    reads: int = 0
    """Range reads that succeeded (one per contiguous run, plus the chunk-by-chunk retries)."""
    bytes_read: int = 0
    """Bytes those reads returned."""
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    """Bytes of delivered chunks, by their source file's ``kind``."""
    read_seconds: float = 0.0
    """Seconds in the range reads (the tier's ``read_range_into`` or ``read_slab_into``)."""
    verify_seconds: float = 0.0
    """Seconds checking digests."""
    copy_seconds: float = 0.0
    """Seconds copying verified chunks into their destinations."""
    kept: dict[int, memoryview] = field(default_factory=dict)
    """Per delivered request with ``keep``, its verified bytes (read-only where they are the
    source's own: held, they keep its mapping)."""

    @property
    def lost(self) -> list[int]:
        """Requests no source delivered."""
        return [i for i, u in enumerate(self.used) if u is None]

    def error(self, index: int) -> Exception | None:
        """The last error of request ``index`` (what its last source did), or None."""
        tried = self.failures.get(index)
        return tried[-1].error if tried else None


OnDelivered = Callable[[int, memoryview], None]
"""Called with ``(request index, its verified bytes)`` as each request is delivered, in the order
they are: the bytes are its first destination's, else its kept bytes (``keep``), else a view of
the scratch buffer that is good only during the call."""


@dataclass
class _Round:
    """One :meth:`Fetcher.fetch`'s state, shared by the helpers of each pass over its requests."""

    requests: Sequence[ChunkRequest]
    at: list[int]
    """Per request, the index of the source it is read from in this pass."""
    result: FetchResult
    on_delivered: OnDelivered | None
    failed: list[int] = field(default_factory=list)
    """The requests that failed at their source in this pass."""

    def fail(self, i: int, error: Exception) -> None:
        """Request ``i`` failed at its current source (a read error or a mismatch)."""
        req = self.requests[i]
        failure = Failure(req.sources[self.at[i]], error)
        log.debug("%s: %s", req.describe(), failure.describe())
        self.result.failures.setdefault(i, []).append(failure)
        self.failed.append(i)

    def delivered(self, i: int, chunk: memoryview) -> None:
        """Request ``i`` is delivered (``chunk``: its bytes); tell ``on_delivered``."""
        self.result.used[i] = self.at[i]
        if self.on_delivered is not None:
            req = self.requests[i]
            self.on_delivered(i, req.dests[0] if req.dests else self.result.kept.get(i, chunk))


OnRead = Callable[[SourceFile, int, memoryview], None]
"""Called with ``(file, offset, bytes)`` after each successful range read, before any check."""


class Fetcher:
    """Fetches chunk requests (see the module docstring); keeps one scratch buffer between calls.

    Not thread-safe: use one per thread. ``on_read`` sees the raw bytes of every read, in the
    order read (per file, by offset): ``shoal verify`` hashes whole packs with it. ``lend``
    (default): take the bytes a tier lends (a mapped DRAM slab or host-tier file) instead of
    reading them into the scratch buffer. ``overlap`` (default): see :attr:`overlap`.
    ``direct``: read large chunks straight into their first destination (see the module).
    """

    def __init__(
        self,
        *,
        max_run: int = DEFAULT_MAX_RUN,
        on_read: OnRead | None = None,
        lend: bool = True,
        overlap: bool = True,
        direct: bool = False,
    ) -> None:
        if max_run <= 0:
            raise ValueError(f"max_run must be positive, got {max_run}")
        self.max_run = max_run
        self.on_read = on_read
        self.lend = lend
        self.overlap = overlap
        self.direct = direct and on_read is None  # shoal verify sees every byte read, in order
        """Check a lent run's next chunk in a helper thread while this one is copied (a
        process whose host has no core to spare checks each chunk inline, then copies it:
        measured 6% faster with 4 ranks on 2 cores)."""
        """Take the bytes a tier lends (a mapped slab or host file) instead of reading them."""
        self._scratch = bytearray()
        self._maps: dict[SourceFile, memoryview | Exception | None] = {}
        """The slabs mapped during one :meth:`fetch` (or why one could not be), dropped at its end."""
        self._checker: ThreadPoolExecutor | None = None

    def fetch(
        self, requests: Sequence[ChunkRequest], *, on_delivered: OnDelivered | None = None
    ) -> FetchResult:
        """Read, verify and place every request; try each failed one at its next source, until done.

        ``on_delivered``: told of each request as soon as it is delivered (the restore starts
        sending a chunk to the ranks that need it while it reads the next)."""
        try:
            return self._fetch(requests, on_delivered)
        finally:
            self._maps.clear()  # the mappings go with their last views
            if self._checker is not None:
                self._checker.shutdown(wait=True)
                self._checker = None

    def _fetch(self, requests: Sequence[ChunkRequest], on_delivered: OnDelivered | None) -> FetchResult:
        result = FetchResult([None] * len(requests))
        at = [0] * len(requests)
        rnd = _Round(requests, at, result, on_delivered)
        pending = [i for i, r in enumerate(requests) if r.sources]
        while pending:
            by_file: dict[SourceFile, list[tuple[int, int]]] = {}
            for i in pending:
                src = requests[i].sources[at[i]]
                by_file.setdefault(src.file, []).append((src.offset, i))
            rnd.failed = []
            for file, spans in by_file.items():
                spans.sort()
                for run in self._runs(spans, requests):
                    self._read_run(file, run, rnd)
            pending = []
            for i in rnd.failed:
                at[i] += 1
                if at[i] < len(requests[i].sources):
                    pending.append(i)
        if result.failures:
            lost = result.lost
            first = next(iter(result.failures.values()))[0]
            log.warning(
                "%d of %d chunk(s) failed at a source (%d of them lost: no source left); first: %s",
                len(result.failures),
                len(requests),
                len(lost),
                first.describe(),
            )
        return result

    def _runs(
        self, spans: list[tuple[int, int]], requests: Sequence[ChunkRequest]
    ) -> list[list[tuple[int, int]]]:
        """One file's ``(offset, request)`` spans, sorted, cut into back-to-back runs of <= ``max_run``."""
        runs: list[list[tuple[int, int]]] = []
        run: list[tuple[int, int]] = []
        end = size = 0
        for offset, i in spans:
            n = requests[i].length
            if run and (offset != end or size + n > self.max_run):
                runs.append(run)
                run = []
            if not run:
                size = 0
            run.append((offset, i))
            end = offset + n
            size += n
        if run:
            runs.append(run)
        return runs

    def _buffer(self, nbytes: int) -> memoryview:
        if len(self._scratch) < nbytes:
            self._scratch = bytearray(nbytes)
        return memoryview(self._scratch)[:nbytes]

    def _read_run(
        self, file: SourceFile, run: list[tuple[int, int]], rnd: _Round, *, direct: bool = True
    ) -> None:
        requests, result = rnd.requests, rnd.result
        direct = direct and self.direct
        start = run[0][0]
        last_offset, last = run[-1]
        t0 = perf_counter()
        try:
            view = self._mapped_range(file, start, last_offset + requests[last].length)
            if view is not None and self.on_read is None:
                result.read_seconds += perf_counter() - t0
                self._deliver_mapped(file, run, view, rnd)
                return
            if view is None and direct and any(self._goes_direct(requests[i]) for _, i in run):
                result.read_seconds += perf_counter() - t0
                rest: list[tuple[int, int]] = []  # small chunks back to back: one run, as usual
                for offset, i in run:
                    if not self._goes_direct(requests[i]):
                        rest.append((offset, i))
                        continue
                    if rest:
                        self._read_run(file, rest, rnd, direct=False)
                        rest = []
                    self._read_direct(file, offset, i, rnd)
                if rest:
                    self._read_run(file, rest, rnd, direct=False)
                return
            if view is None:
                view = self._buffer(last_offset + requests[last].length - start)
                file.read_into(start, view)
        except Exception as e:  # any read error sends the chunks to their next source
            result.read_seconds += perf_counter() - t0
            if len(run) > 1:  # read them one by one: only the unreadable ones fail
                log.debug("reading %d chunks from %s failed (%s); reading them one by one", len(run), file, e)
                for span in run:
                    self._read_run(file, [span], rnd)
                return
            rnd.fail(run[0][1], e)
            return
        result.read_seconds += perf_counter() - t0
        result.reads += 1
        result.bytes_read += view.nbytes
        if self.on_read is not None:
            self.on_read(file, start, view)
        delivered = 0
        for offset, i in run:
            req = requests[i]
            pos = offset - start
            chunk = view[pos : pos + req.length]
            if not self._checked(chunk, file, offset, i, rnd):
                continue
            t2 = perf_counter()
            for dest in req.dests:
                dest[:] = chunk
            if req.keep:  # the scratch buffer is reused: a copy of its own (a mapped source lends it)
                result.kept[i] = chunk if chunk.readonly else memoryview(bytes(chunk))
            result.copy_seconds += perf_counter() - t2
            rnd.delivered(i, chunk)
            delivered += req.length
        if delivered:
            result.bytes_by_kind[file.kind] = result.bytes_by_kind.get(file.kind, 0) + delivered

    @staticmethod
    def _checked(chunk: memoryview, file: SourceFile, offset: int, i: int, rnd: _Round) -> bool:
        """Whether ``chunk`` (request ``i``, read from ``file`` at ``offset``) has its digest; else failed.

        A request that skips the check (``check=False``) passes."""
        req = rnd.requests[i]
        if not req.check:
            return True
        t1 = perf_counter()
        try:
            verify(chunk, req.digest, partial(_what, req, file, offset))  # text on a mismatch
        except ChecksumMismatch as e:
            rnd.fail(i, e)
            return False
        finally:
            rnd.result.verify_seconds += perf_counter() - t1
        return True

    @staticmethod
    def _goes_direct(req: ChunkRequest) -> bool:
        return bool(req.dests) and req.length >= DIRECT_MIN

    def _read_direct(self, file: SourceFile, offset: int, i: int, rnd: _Round) -> None:
        """Read chunk ``i`` into its first destination, check it there, copy it to the others."""
        req, result = rnd.requests[i], rnd.result
        first = req.dests[0]
        t0 = perf_counter()
        try:
            file.read_into(offset, first)
        except Exception as e:
            result.read_seconds += perf_counter() - t0
            rnd.fail(i, e)
            return
        t1 = perf_counter()
        result.read_seconds += t1 - t0
        result.reads += 1
        result.bytes_read += req.length
        if not self._checked(first, file, offset, i, rnd):
            return
        t2 = perf_counter()
        for dest in req.dests[1:]:
            dest[:] = first
        if req.keep:
            result.kept[i] = first
        result.copy_seconds += perf_counter() - t2
        rnd.delivered(i, first)
        result.bytes_by_kind[file.kind] = result.bytes_by_kind.get(file.kind, 0) + req.length

    def _mapped_range(self, file: SourceFile, start: int, end: int) -> memoryview | None:
        """Bytes ``[start, end)`` of ``file`` without a copy, where its tier lends them (mapped once
        per fetch); None: read them. Raises like a read that fails (a missing or short file)."""
        if not self.lend:
            return None
        if file not in self._maps:
            try:
                self._maps[file] = file.mapped()
            except Exception as e:  # remembered: every run of the file fails alike, as its reads would
                self._maps[file] = e
        mapped = self._maps[file]
        if isinstance(mapped, Exception):
            raise mapped
        if mapped is None:
            return None
        if end > mapped.nbytes:
            raise TierError(
                f"{file.describe(start)} ends at byte {mapped.nbytes}, before {end}: a short file"
            )
        return mapped[start:end]

    def _deliver_mapped(
        self, file: SourceFile, run: list[tuple[int, int]], view: memoryview, rnd: _Round
    ) -> None:
        """Verify each chunk of ``run`` where it lies in the mapped ``view`` and copy it into its
        destinations; the next chunk's digest is checked in the helper thread meanwhile."""
        requests, result = rnd.requests, rnd.result
        start = run[0][0]
        result.reads += 1
        result.bytes_read += view.nbytes

        # A helper thread pays only where there is a next chunk big enough to hash while one is
        # copied (BLAKE3 gives up the interpreter lock on large inputs); else the check is inline.
        overlap = self.overlap and len(run) > 1 and min(requests[i].length for _, i in run) >= OVERLAP_MIN

        def check(k: int) -> Future[None]:
            offset, i = run[k]
            req = requests[i]
            chunk = view[offset - start : offset - start + req.length]
            what = partial(_what, req, file, offset)
            if not req.check:
                passed: Future[None] = Future()
                passed.set_result(None)
                return passed
            if overlap:
                return self._check_pool().submit(verify, chunk, req.digest, what)
            done: Future[None] = Future()
            try:
                verify(chunk, req.digest, what)
                done.set_result(None)
            except Exception as e:
                done.set_exception(e)
            return done

        delivered = 0
        pending = check(0)
        for k, (offset, i) in enumerate(run):
            req = requests[i]
            chunk = view[offset - start : offset - start + req.length]
            t1 = perf_counter()
            error = pending.exception()  # waits for the check
            if k + 1 < len(run):
                pending = check(k + 1)
            t2 = perf_counter()
            result.verify_seconds += t2 - t1
            if error is not None:
                if not isinstance(error, ChecksumMismatch):
                    raise error
                rnd.fail(i, error)
                continue
            for dest in req.dests:
                dest[:] = chunk
            if req.keep:
                result.kept[i] = chunk  # the source's own bytes, verified: no copy
            result.copy_seconds += perf_counter() - t2
            rnd.delivered(i, chunk)
            delivered += req.length
        if delivered:
            result.bytes_by_kind[file.kind] = result.bytes_by_kind.get(file.kind, 0) + delivered

    def _check_pool(self) -> ThreadPoolExecutor:
        if self._checker is None:
            self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-verify")
        return self._checker



def _what(req: ChunkRequest, file: SourceFile, offset: int) -> str:
    return f"{req.describe()} read from {file.describe(offset)}"


def fetch_chunks(
    requests: Sequence[ChunkRequest], *, max_run: int = DEFAULT_MAX_RUN, lend: bool = True
) -> FetchResult:
    """:meth:`Fetcher.fetch` with a fresh fetcher."""
    return Fetcher(max_run=max_run, lend=lend).fetch(requests)


__all__ = [
    "DEFAULT_MAX_RUN",
    "ChunkRequest",
    "ChunkSource",
    "FetchResult",
    "Failure",
    "Fetcher",
    "OnDelivered",
    "OnRead",
    "SourceFile",
    "fetch_chunks",
]
