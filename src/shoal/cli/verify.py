"""``shoal verify``: re-hash every chunk of every item, and every referenced pack as a whole.

Every manifest is first cross-checked against its own DCP metadata (kind, dtype, shape
and byte size of each item). Each pack is then read once, front to back: its chunks are
hashed as they pass (a chunk that many items or steps share lies at one place and is
hashed once) and every byte also feeds the pack's whole-file BLAKE3, which is checked
against the manifests' pack records and the pack's ``.idx``. Nothing stops at the first
problem: every bad chunk is reported with the step, item, chunk index, pack and offset of
each use of it. A partial manifest (a host tier's copy) is reported for the chunks it does
not place; the ones it places are verified.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import blake3

from shoal.boundary import Boundary
from shoal.cli.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    byte_progress,
    checkpoint_problem,
    human_bytes,
    missing_step,
    open_job,
    print_json,
    read_pointer_strictly,
    stdout_console,
    step_number,
)
from shoal.errors import CheckpointNotFound, ChecksumMismatch, FormatError, MissingFile, ShoalError
from shoal.format import layout
from shoal.format.chunking import expect_digest
from shoal.format.manifest import Manifest, PackRecord
from shoal.format.pack import decode_index
from shoal.records.fetch import ChunkRequest, ChunkSource, Fetcher, SourceFile
from shoal.records.store import CheckpointInfo, list_checkpoints
from shoal.tiers.base import Tier

_BLOCK = 8 << 20
"""Bytes read at a time between chunks (and for packs whose chunks overlap)."""


@dataclass(frozen=True)
class Use:
    """One use of a chunk: chunk ``chunk`` of item ``item`` of ``step``, at ``item_offset`` in the item."""

    step: int
    item: str
    chunk: int
    item_offset: int


@dataclass(frozen=True)
class Problem:
    """One thing wrong, with as much of (step, item, chunks, pack, offsets) as applies."""

    message: str
    step: int | None = None
    item: str | None = None
    chunks: tuple[int, ...] = ()
    pack: str | None = None
    offsets: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "item": self.item,
            "chunks": list(self.chunks),
            "pack": self.pack,
            "offsets": list(self.offsets),
            "message": self.message,
        }


@dataclass
class Report:
    steps: list[int]
    packs: int = 0
    chunks: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _PackWork:
    """What the selected manifests expect of one pack: its record and the chunks they use in it."""

    pack_id: str
    record: PackRecord
    spans: dict[tuple[int, int, str], list[Use]] = field(default_factory=lambda: defaultdict(list))


def select(tier: Tier, step: int | None) -> list[CheckpointInfo]:
    infos = list_checkpoints(tier)
    if step is None:
        if not infos:
            raise CheckpointNotFound(f"no checkpoints under {tier.url}")
        return infos
    chosen = [i for i in infos if i.step == step]
    if not chosen:
        raise missing_step(tier, step)
    return chosen


def _check_latest(tier: Tier, infos: list[CheckpointInfo]) -> list[Problem]:
    where = f"{tier.url}/{layout.LATEST}"
    try:
        latest = read_pointer_strictly(tier, layout.LATEST)
    except ShoalError as e:
        return [Problem(f"{layout.LATEST}: {e}")]
    if latest is None:
        return []
    if latest.step not in {i.step for i in infos}:
        return [Problem(f"{where} names step {latest.step}, which has no manifest", step=latest.step)]
    try:
        commit = read_pointer_strictly(tier, layout.commit_path(latest.step))
    except ShoalError as e:
        return [Problem(f"step {latest.step}: {e}", step=latest.step)]
    if commit is None:
        return [Problem(f"{where} names step {latest.step}, which has no commit record", step=latest.step)]
    if commit.manifest_blake3 != latest.manifest_blake3:
        return [
            Problem(
                f"{where} says step {latest.step}'s manifest has BLAKE3 {latest.manifest_blake3}, "
                f"its commit record says {commit.manifest_blake3}",
                step=latest.step,
            )
        ]
    return []


def _plan(tier: Tier, manifests: list[Manifest]) -> tuple[dict[str, _PackWork], list[Problem]]:
    """Group every chunk use of ``manifests`` by pack and by (offset, length, digest)."""
    packs: dict[str, _PackWork] = {}
    problems: list[Problem] = []
    for m in manifests:
        for pid, rec in sorted(m.packs.items()):
            work = packs.setdefault(pid, _PackWork(pid, rec))
            if work.record != rec:
                problems.append(
                    Problem(
                        f"pack {tier.url}/{layout.pack_path(pid)}: step {m.step}'s manifest records "
                        f"{rec.size} bytes with BLAKE3 {rec.blake3}, an earlier step's records "
                        f"{work.record.size} bytes with BLAKE3 {work.record.blake3}",
                        step=m.step,
                        pack=f"{tier.url}/{layout.pack_path(pid)}",
                    )
                )
        unheld: dict[str, list[int]] = {}
        for key in m.items:
            for i, (dig, item_offset, _) in enumerate(m.chunk_spans(key)):
                loc = m.locations.get(dig)
                if loc is None:  # a partial manifest (a host tier's copy) places only what it holds
                    unheld.setdefault(key, []).append(i)
                    continue
                packs[loc.pack].spans[(loc.offset, loc.length, dig)].append(Use(m.step, key, i, item_offset))
        if unheld:
            problems.append(_partial_problem(tier, m, unheld))
    return packs, problems


def _partial_problem(tier: Tier, m: Manifest, unheld: dict[str, list[int]]) -> Problem:
    """A manifest that does not place every chunk: the step cannot be restored from this tier alone."""
    where = f"{tier.url}/{layout.manifest_path(m.step)}"
    chunks = sum(len(c) for c in unheld.values())
    listed = "; ".join(
        f"item {key!r} chunk(s) {', '.join(map(str, found[:8]))}{' ...' if len(found) > 8 else ''}"
        for key, found in list(unheld.items())[:4]
    )
    more = f"; and {len(unheld) - 4} more item(s)" if len(unheld) > 4 else ""
    first_key, first_chunks = next(iter(unheld.items()))
    return Problem(
        f"step {m.step}: manifest {where} is partial (a host tier's copy): {chunks} chunk(s) of "
        f"{len(unheld)} item(s) have no location under {tier.url}, so the step cannot be restored from "
        f"here ({listed}{more}); the chunks it does place were verified",
        step=m.step,
        item=first_key if len(unheld) == 1 else None,
        chunks=tuple(first_chunks) if len(unheld) == 1 else (),
    )


def _crosscheck(tier: Tier, m: Manifest) -> list[Problem]:
    """The manifest's items must agree with its DCP metadata: kind, dtype, shape and byte size."""
    from shoal.format.crosscheck import check_against_dcp  # imports torch: only when verify runs

    try:
        check_against_dcp(m)
    except FormatError as e:
        where = f"{tier.url}/{layout.manifest_path(m.step)}"
        return [Problem(f"step {m.step}: manifest {where} disagrees with its DCP metadata: {e}", step=m.step)]
    return []


def _check_commit_records(tier: Tier, infos: list[CheckpointInfo]) -> list[Problem]:
    """A step that reads as uncommitted (B3) because something other than a record is in the way."""
    problems = []
    for info in infos:
        if info.boundary is Boundary.PERSISTED:
            try:
                read_pointer_strictly(tier, layout.commit_path(info.step))
            except ShoalError as e:
                problems.append(Problem(f"step {info.step}: {e}", step=info.step))
    return problems


def _uses_problem(message: str, where: str, uses: Iterable[Use], offset: int, length: int) -> list[Problem]:
    return [
        Problem(
            f"step {u.step} item {u.item!r} chunk {u.chunk} "
            f"(item bytes {u.item_offset}..{u.item_offset + length}): {message}",
            step=u.step,
            item=u.item,
            chunks=(u.chunk,),
            pack=where,
            offsets=(offset,),
        )
        for u in uses
    ]


def _missing_pack(where: str, work: _PackWork) -> list[Problem]:
    per_item: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for (offset, _, _), uses in work.spans.items():
        for u in uses:
            per_item[(u.step, u.item)].append((u.chunk, offset))
    steps = sorted({s for s, _ in per_item})
    problems = [
        Problem(
            f"pack {where} is missing: it holds {len(work.spans)} chunks used by {len(per_item)} items "
            f"of steps {', '.join(map(str, steps))}",
            pack=where,
        )
    ]
    for (step, item), found in sorted(per_item.items()):
        found.sort()
        chunks = tuple(c for c, _ in found)
        offsets = tuple(o for _, o in found)
        listed = ", ".join(f"{c} (pack offset {o})" for c, o in found[:8])
        more = f" and {len(found) - 8} more" if len(found) > 8 else ""
        problems.append(
            Problem(
                f"step {step} item {item!r} chunk(s) {listed}{more}: pack {where} is missing",
                step=step,
                item=item,
                chunks=chunks,
                pack=where,
                offsets=offsets,
            )
        )
    return problems


def _check_index(tier: Tier, work: _PackWork, where: str) -> list[Problem]:
    """The pack's ``.idx`` must exist, parse, and agree with the manifests on digest, size and chunks."""
    path = layout.index_path(work.pack_id)
    idx_where = f"{tier.url}/{path}"
    try:
        index = decode_index(tier.read_small(path, layout.MAX_INDEX_BYTES, "pack index"), idx_where)
    except MissingFile:
        return [Problem(f"pack index {idx_where} is missing", pack=where)]
    except ShoalError as e:
        return [Problem(str(e), pack=where)]
    problems = []
    if (index.size, index.blake3) != (work.record.size, work.record.blake3):
        problems.append(
            Problem(
                f"pack index {idx_where} says {index.size} bytes with BLAKE3 {index.blake3}; "
                f"the manifests say {work.record.size} bytes with BLAKE3 {work.record.blake3}",
                pack=where,
            )
        )
    listed = {(e.offset, e.length, e.digest) for e in index.entries}
    absent = sorted(span for span in work.spans if span not in listed)
    if absent:
        off, length, dig = absent[0]
        problems.append(
            Problem(
                f"pack index {idx_where} does not list {len(absent)} chunk(s) the manifests place in "
                f"the pack (first: {dig} at offset {off}, {length} bytes)",
                pack=where,
                offsets=tuple(a[0] for a in absent),
            )
        )
    return problems


class _WholePack:
    """A pack's whole-file BLAKE3, fed with the fetcher's reads as they pass (gaps read here).

    Each pack byte is read once while the reads come in file order; after an overlap or a
    failed read the digest is taken again over the whole file at the end.
    """

    def __init__(self, tier: Tier, path: str, advance: Callable[[int], None]) -> None:
        self.tier, self.path, self.advance = tier, path, advance
        self.hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        self.streaming = True
        self.pos = self.nread = 0
        self._scratch: memoryview | None = None

    def on_read(self, file: SourceFile, offset: int, view: memoryview) -> None:
        self.counted(view.nbytes)
        if not self.streaming:
            return
        if offset < self.pos:
            self.streaming = False
            return
        try:
            self.feed(self.pos, offset)
        except (ShoalError, OSError):
            self.streaming = False  # the chunks there fail on their own; the digest is taken again
            return
        self.hasher.update(view)
        self.pos = offset + view.nbytes

    def counted(self, n: int) -> None:
        self.nread += n
        self.advance(n)

    def feed(self, start: int, stop: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_BLOCK))
        for at in range(start, stop, _BLOCK):
            view = self._scratch[: min(_BLOCK, stop - at)]
            self.tier.read_range_into(self.path, at, view)
            self.counted(view.nbytes)
            self.hasher.update(view)

    def check(self, size: int, expected: str, where: str) -> list[Problem]:
        """Finish the digest of the pack's ``size`` bytes; a problem unless it is ``expected``."""
        try:
            if self.streaming:
                self.feed(self.pos, size)
            else:
                self.hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
                self.feed(0, size)
            expect_digest(
                self.hasher.hexdigest(), expected, f"pack {where}: whole-file BLAKE3 (all {size} bytes)"
            )
        except ChecksumMismatch as e:
            return [Problem(str(e), pack=where)]
        except (ShoalError, OSError) as e:
            return [Problem(f"pack {where}: read failed: {e}", pack=where)]
        return []


def _check_chunks(
    tier: Tier, path: str, spans: list[tuple[tuple[int, int, str], list[Use]]], whole: _WholePack
) -> list[Problem]:
    """Read and verify each span with the chunk fetcher (per contiguous run), feeding ``whole``."""
    where = f"{tier.url}/{path}"
    file = SourceFile(tier, path)
    requests = [ChunkRequest(d, n, (), [ChunkSource(file, off)], "chunk") for (off, n, d), _ in spans]
    longest = max((n for (_, n, _), _ in spans), default=0)
    result = Fetcher(max_run=max(longest, _BLOCK), on_read=whole.on_read).fetch(requests)
    problems: list[Problem] = []
    for i in result.lost:
        (offset, length, _), uses = spans[i]
        error = result.error(i)
        if isinstance(error, ChecksumMismatch):
            msg = f"pack {where} offset {offset} length {length}: {error}"
        else:
            msg = f"pack {where} offset {offset}: read failed: {error}"
        problems += _uses_problem(msg, where, uses, offset, length)
    return problems


def verify_pack(
    tier: Tier, work: _PackWork, advance: Callable[[int], None]
) -> tuple[int, int, list[Problem]]:
    """Hash every used chunk of one pack and the whole pack; return (chunks, bytes read, problems)."""
    path = layout.pack_path(work.pack_id)
    where = f"{tier.url}/{path}"
    try:
        size = tier.info(path).size
    except MissingFile:
        return 0, 0, _missing_pack(where, work)
    except (ShoalError, OSError) as e:
        return 0, 0, [Problem(f"pack {where}: cannot look at it: {e}", pack=where)]
    problems = _check_index(tier, work, where)
    expected = work.record
    if size != expected.size:
        problems.append(
            Problem(
                f"pack {where} is {size} bytes; the manifests say {expected.size} (truncated?)", pack=where
            )
        )
    whole = _WholePack(tier, path, advance)
    inside = []
    for (offset, length, dig), uses in sorted(work.spans.items()):
        if offset + length > size:
            msg = f"pack {where} offset {offset} length {length} lies past the end of the pack ({size} bytes)"
            problems += _uses_problem(msg, where, uses, offset, length)
            whole.streaming = False
        else:
            inside.append(((offset, length, dig), uses))
    problems += _check_chunks(tier, path, inside, whole)
    if size == expected.size:
        problems += whole.check(size, expected.blake3, where)
    return len(work.spans), whole.nread, problems


def verify(tier: Tier, step: int | None = None, *, jobs: int = 4, progress: bool = True) -> Report:
    """Verify ``step`` (None: every step) on ``tier``; see the module docstring."""
    infos = select(tier, step)
    report = Report([i.step for i in infos])
    manifests = []
    for info in infos:
        if info.manifest is None:
            report.problems.append(
                Problem(f"step {info.step}: {checkpoint_problem(tier, info)}", step=info.step)
            )
        else:
            manifests.append(info.manifest)
    if step is None or any(m.step == step for m in manifests):
        latest = _check_latest(tier, infos)
        report.problems += [p for p in latest if step is None or p.step == step]
    report.problems += _check_commit_records(tier, infos)
    report.problems += [p for m in manifests for p in _crosscheck(tier, m)]
    packs, problems = _plan(tier, manifests)
    report.problems += problems
    report.packs = len(packs)
    total = sum(w.record.size for w in packs.values())
    with byte_progress("verifying", total, enabled=progress) as bar:
        task = bar.task_ids[0]

        def advance(n: int) -> None:
            bar.advance(task, n)

        pool = ThreadPoolExecutor(max_workers=max(1, jobs))
        try:
            results = pool.map(lambda w: verify_pack(tier, w, advance), [packs[p] for p in sorted(packs)])
            for chunks, nread, found in results:
                report.chunks += chunks
                report.bytes_read += nread
                report.problems += found
        finally:  # on Ctrl-C, start no more packs
            pool.shutdown(wait=True, cancel_futures=True)
    return report


def run(args: argparse.Namespace) -> int:
    tier = open_job(args)
    try:
        report = verify(tier, args.step, jobs=args.jobs, progress=not args.json)
    finally:
        tier.close()
    if args.json:
        print_json(
            {
                "url": tier.url,
                "ok": report.ok,
                "steps": report.steps,
                "packs": report.packs,
                "chunks": report.chunks,
                "bytes_read": report.bytes_read,
                "problems": [p.to_json() for p in report.problems],
            }
        )
        return EXIT_OK if report.ok else EXIT_PROBLEMS
    out = stdout_console()
    for p in report.problems:
        out.print(f"PROBLEM: {p.message}")
    steps = ", ".join(map(str, report.steps))
    summary = (
        f"steps {steps}: {report.packs} packs, {report.chunks} chunks, {human_bytes(report.bytes_read)} "
        f"re-hashed under {tier.url}"
    )
    if report.ok:
        out.print(f"OK: {summary}")
        return EXIT_OK
    out.print(f"FAILED: {len(report.problems)} problem(s); {summary}")
    return EXIT_PROBLEMS


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        parents=parents,
        help="re-hash every chunk and pack; exit 1 on any problem",
        description="Re-hash every chunk of every item of the chosen steps, and every pack they use as a "
        "whole file, against the digests in the manifests and pack indexes. Prints every problem "
        "(step, item, chunk index, pack, offset); exit status 0 if all is well, 1 otherwise.",
    )
    p.add_argument("url", nargs="?", help="the job directory (<shared>/<job>), a path or fsspec URL")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_number, help="verify this step only")
    which.add_argument("--all", action="store_true", help="verify every step (the default)")
    p.add_argument("--jobs", type=int, default=4, metavar="N", help="packs verified at once (default 4)")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(run=run)
