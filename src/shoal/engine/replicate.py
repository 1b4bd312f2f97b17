"""Partner copies (B2): chunks cross the fabric into a verified pack on the partner's host tier.

The group-save sequencer (:mod:`shoal.engine.group_save`) calls these between C2 and C5:

* :func:`exchange` on every rank: post this rank's sends, receive this rank's own transfers
  into one pack on its host tier (each chunk verified as it arrives, through
  :func:`~shoal.records.packwriter.write_pack`), wait for the sends;
* :func:`host_manifests` on the coordinator: one partial manifest per host, from the packs
  every rank reported in C3;
* :func:`write_host_manifest` on each host's leader: that manifest, plus the chunks the host
  already held from earlier checkpoints, written to the host tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from shoal import failpoints
from shoal.engine.path import PARTNER
from shoal.engine.protocol import PipelineContext
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import ItemRecord, decode_manifest
from shoal.format.manifest_build import ManifestHeader, TierChunks, build_manifest
from shoal.format.pack import PackIndex
from shoal.group.plan import ChunkRef, GroupPlan
from shoal.records.events import monotonic
from shoal.records.packwriter import write_pack

__all__ = ["exchange", "host_manifests", "write_host_manifest"]

ViewOf = Callable[[ChunkRef], memoryview]
"""Where a rank finds a chunk's bytes in its own staged state."""


def exchange(
    ctx: PipelineContext, plan: GroupPlan, step: int, view_of: ViewOf
) -> tuple[PackIndex | None, list[tuple[str, Exception]]]:
    """Send and receive this rank's transfers; returns the pack received (or None) and the errors.

    Errors are ``(phase, exception)``: a failed receive still drains what is coming, so that
    the senders finish, and the sends are always waited for.
    """
    sends = [(t.dst_rank, [view_of(c) for c in t.runs]) for t in plan.sends_from(ctx.rank)]
    incoming = [(t.src_rank, list(t.runs)) for t in plan.receives_at(ctx.rank)]
    receives = [(src, [c.length for c in chunks]) for src, chunks in incoming]
    expected = [c for _, chunks in incoming for c in chunks]
    errors: list[tuple[str, Exception]] = []
    index: PackIndex | None = None
    t0 = monotonic()
    try:
        works = ctx.fabric.post_sends(sends)
    except Exception as e:
        return None, [("replicate (send)", e)]
    if len(ctx.scratch) < ctx.chunk_size:
        ctx.scratch = bytearray(ctx.chunk_size)
    stream = ctx.fabric.receive(receives, ctx.scratch)
    try:
        if expected:
            start = monotonic()
            index = _receive_pack(ctx, step, expected, stream)
            _emit_replica(ctx, plan, step, index, start)
    except Exception as e:
        errors.append(("replicate (receive)", e))
        for _ in stream:  # let the senders finish: drain what is still coming
            pass
    finally:
        try:
            ctx.fabric.wait_all(works)
        except Exception as e:
            errors.append(("replicate (send)", e))
    _emit(ctx, plan, step, expected, t0)
    return index, errors


def _receive_pack(
    ctx: PipelineContext, step: int, expected: list[ChunkRef], stream: Iterable[memoryview]
) -> PackIndex:
    assert ctx.host_tier is not None
    return write_pack(
        ctx.host_tier,
        layout.new_pack_id(step, ctx.host, ctx.rank),
        expected,
        stream,
        what=f"step {step}: replica from a partner",
        check=True,
        failpoint="pipeline.after_replica_pack",
        rank=ctx.rank,
    )


def _emit_replica(ctx: PipelineContext, plan: GroupPlan, step: int, index: PackIndex, start: float) -> None:
    """The writer record of the replica pack this rank received (``docs/events.md``)."""
    end = monotonic()
    receivers = {t.dst_rank for t in plan.transfers}
    assert ctx.host_tier is not None
    ctx.events.emit(
        "write",
        step,
        tier=ctx.host_tier.kind,
        what="replica",
        path=layout.pack_path(index.pack_id),
        bytes=index.size,
        start=start,
        end=end,
        seconds=end - start,
        writers=len(receivers),
        concurrency=len(receivers),
        host_concurrency=sum(1 for r in receivers if ctx.topology.host_of(r) == ctx.host),
        durability_path=PARTNER,
        sources=sorted({t.src_rank for t in plan.receives_at(ctx.rank)}),
    )


def _emit(ctx: PipelineContext, plan: GroupPlan, step: int, expected: list[ChunkRef], start: float) -> None:
    sent = sum(t.nbytes for t in plan.sends_from(ctx.rank))
    if not (sent or expected):
        return
    ctx.events.emit(
        "replicate",
        step,
        tier=ctx.host_tier.kind if ctx.host_tier else None,
        sent_bytes=sent,
        received_bytes=sum(c.length for c in expected),
        start=start,
        end=(end := monotonic()),
        seconds=end - start,
        writers=len({t.dst_rank for t in plan.transfers}),
    )


def host_manifests(
    ctx: PipelineContext, header: ManifestHeader, items: Sequence[ItemRecord], results: Sequence[object]
) -> dict[str, bytes]:
    """One partial manifest per host: every item, the locations of the chunks that host's tier holds."""
    by_host: dict[str, list[PackIndex]] = {h: [] for h in ctx.topology.hosts}
    for rank, result in enumerate(results):
        if isinstance(result, PackIndex):
            by_host[ctx.topology.host_of(rank)].append(result)
    return {
        host: build_manifest(header, items, [TierChunks.of_packs(indexes)], partial=True).encode()
        for host, indexes in by_host.items()
    }


def write_host_manifest(ctx: PipelineContext, step: int, data: bytes) -> None:
    """Write this host's manifest, adding the chunks it already held from earlier checkpoints.

    The plan skips replicating a chunk the partner host already holds; this host's manifest
    must then reference the pack that holds it, or retention could delete that pack with the
    older manifest and B2 would silently stop being true.
    """
    assert ctx.host_tier is not None
    where = f"{ctx.host_tier.url}/{layout.manifest_path(step)}"
    manifest = decode_manifest(data, where)
    catalog = ctx.host_catalog
    if catalog is not None and len(catalog):
        holdings = [
            TierChunks(manifest.locations, manifest.packs),
            TierChunks(catalog.locations, catalog.packs),
        ]
        header = ManifestHeader.of(manifest)
        manifest = build_manifest(header, list(manifest.items.values()), holdings, partial=True)
        data = manifest.encode()
    failpoints.hit("pipeline.before_replica_manifest", rank=ctx.rank)
    ctx.host_tier.write(layout.manifest_path(step), data)
    if catalog is not None:
        catalog.add_manifest(manifest, manifest_digest=digest(data))
