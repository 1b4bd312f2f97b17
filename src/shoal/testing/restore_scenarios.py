"""Multi-rank restore scenarios (docs/design.md §5), run with :func:`shoal.testing.multiproc.run_ranks`.

Each returns plain data for the test process; the bit-exact comparisons happen in the
ranks themselves. Phases that must look like a crash end with SIGKILL (no ``close``, so
the DRAM slabs and partial work stay as a real failure leaves them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from shoal import failpoints
from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.engine.inventory import read_staged
from shoal.records.events import read_events
from shoal.testing.checkpoints import assert_state_equal, flip_byte, zeros_like_state
from shoal.testing.scenarios import group_config


def model_state(*, tensors: int = 6, numel: int = 40 << 10) -> dict[str, Any]:
    """One model, the same on every rank (N replicas loading one model)."""
    g = torch.Generator().manual_seed(77)
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(tensors)}}


def sharded_state(rank: int, *, shards: int = 8, numel: int = 20 << 10) -> dict[str, Any]:
    """``shards`` tensors of this rank's own (a fully sharded state: 4 ranks hold 32 shards), a
    replicated bias, and the training step."""
    g = torch.Generator().manual_seed(500 + rank)
    own = {f"r{rank}.s{i}": torch.randn(numel, generator=g) for i in range(shards)}
    bias = torch.linspace(-1.0, 1.0, 3000)
    return {"shards": own, "bias": bias, "step": 0}


def train_step(state: Mapping[str, Any], step: int) -> None:
    """A deterministic update in place: the same inputs give bit-identical outputs."""
    for t in state["shards"].values():
        t.mul_(0.999).add_(torch.sin(t) * 1e-3 + step * 1e-4)
    state["bias"].add_(1e-3)
    state["step"] = step  # type: ignore[index]


def load_one_model(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Every rank saves the same model straight to shared storage and closes (giving its DRAM back);
    then every rank loads it: shared storage is the only copy."""
    state = model_state()
    with Checkpointer(group_config(root, path="direct")) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
    with Checkpointer(group_config(root)) as ckpt:
        target = zeros_like_state(state)
        step = ckpt.load(target)
        assert_state_equal(target, state)
        report = ckpt.last_load
        manifest = ckpt.runtime.resolve_manifest(1)
    assert report is not None
    unique = {d: n for key in manifest.items for d, _, n in manifest.chunk_spans(key)}
    return {
        "step": step,
        "by_tier": dict(report.bytes_by_tier),
        "fabric": report.fabric_bytes,
        "relayed": report.relayed_bytes,
        "unique_bytes": sum(unique.values()),
    }


def save_then_crash(rank: int, world: int, *, root: str) -> None:
    """Step 1 commits; step 2 reaches B2 on every rank, its drain is held back, then every process dies."""
    state = sharded_state(rank)
    ckpt = Checkpointer(group_config(root))
    train_step(state, 1)
    ckpt.save(1, state).wait(Boundary.RESTARTABLE, timeout=60)
    train_step(state, 2)
    failpoints.configure("pipeline.before_drain=delay:60")
    ckpt.save(2, state).wait(Boundary.REPLICATED, timeout=60)
    dist.barrier()  # every rank has seen B2
    os.kill(os.getpid(), signal.SIGKILL)


def trained_state(rank: int, step: int) -> dict[str, Any]:
    """The state of ``rank`` after ``step`` training steps (what checkpoint ``step`` holds)."""
    state = sharded_state(rank)
    for s in range(1, step + 1):
        train_step(state, s)
    return state


def crash_at(rank: int, world: int, *, root: str, fault: str, victim: int) -> None:
    """Step 1 commits; during step 2 the failpoint ``fault`` fires on rank ``victim`` (a kill),
    and a few seconds later the launcher tears down every other process of the job (SIGKILL)."""
    ckpt = Checkpointer(group_config(root, collective_timeout=5.0))
    state = trained_state(rank, 1)
    ckpt.save(1, state).wait(Boundary.RESTARTABLE, timeout=60)
    train_step(state, 2)
    dist.barrier()
    threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGKILL)).start()  # the launcher
    if rank == victim:
        failpoints.configure(fault)
    with contextlib.suppress(Exception):
        ckpt.save(2, state).wait(timeout=30)
    time.sleep(30)  # the launcher's kill comes first


def restore_after_crash(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Restart: load the newest restorable checkpoint and the committed step 1, both bit for bit."""
    with Checkpointer(group_config(root)) as ckpt:
        target = zeros_like_state(sharded_state(rank))
        step = ckpt.load(target)
        assert_state_equal(target, trained_state(rank, step))  # never torn
        report = ckpt.last_load
        assert report is not None
        older = zeros_like_state(sharded_state(rank))
        assert ckpt.load(older, step=1) == 1  # the earlier committed checkpoint is not lost
        assert_state_equal(older, trained_state(rank, 1))
        return {"step": step, "origin": report.origin, "by_tier": dict(report.bytes_by_tier)}


def restore_and_resume(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Restart: load the newest restorable checkpoint, check it bit for bit, train on, compare."""
    expected = sharded_state(rank)
    train_step(expected, 1)
    train_step(expected, 2)
    with Checkpointer(group_config(root)) as ckpt:
        target = zeros_like_state(sharded_state(rank))
        step = ckpt.load(target)
        report = ckpt.last_load
        assert_state_equal(target, expected)
        heal = ckpt.last_heal  # the restored step, saved again to reach B2..B4
        healed = None
        if heal is not None:
            with contextlib.suppress(Exception):
                heal.wait(timeout=60)
            healed = {"reached": int(heal.reached or 0), "error": repr(heal.error) if heal.error else None}
        for s in (3, 4):  # resumed training matches an uninterrupted run
            train_step(target, s)
            train_step(expected, s)
        assert_state_equal(target, expected)
        assert report is not None
        return {
            "healed": healed,
            "latest": ckpt.latest(),
            "step": step,
            "origin": report.origin,
            "by_tier": dict(report.bytes_by_tier),
            "fabric": report.fabric_bytes,
            "repaired": report.repaired,
        }


def _timed_load(
    ckpt: Checkpointer, target: dict[str, Any]
) -> tuple[float, dict[str, int], int, dict[str, float]]:
    """One load: its seconds, bytes per tier and over the fabric, and this rank's phases (from
    its ``loaded`` event)."""
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.load(target, heal=False)
    seconds = time.perf_counter() - t0
    report = ckpt.last_load
    assert report is not None and ckpt.config.event_log is not None
    loaded = [e for e in read_events(ckpt.config.event_log, kinds=("loaded",)) if e.rank == ckpt.rank]
    phases = dict(loaded[-1].get("phases") or {}) if loaded else {}
    return seconds, dict(report.bytes_by_tier), report.fabric_bytes, phases


def _timed_copy(state: dict[str, Any], target: dict[str, Any]) -> float:
    """Every rank at once copies its state into its (already touched) target: memcpy of the same bytes."""
    sources = [t for group in state.values() for t in group.values()]
    dests = [t for group in target.values() for t in group.values()]
    for d, s in zip(dests, sources, strict=True):
        d.copy_(s)  # first touch and warm caches, outside the timing
    dist.barrier()
    t0 = time.perf_counter()
    for d, s in zip(dests, sources, strict=True):
        d.copy_(s)
    seconds = time.perf_counter() - t0
    for d in dests:
        d.zero_()
    return seconds


def bench_restore(rank: int, world: int, *, root: str, dram: str, mib_per_rank: int) -> dict[str, Any]:
    """Benchmark: restore a checkpoint of ``mib_per_rank`` MiB of this rank's own shards from DRAM,
    from partner copies and from shared storage; then DCP's own save/load of the same state."""
    import torch.distributed.checkpoint as torch_dcp

    n = mib_per_rank << 18  # float32 elements
    g = torch.Generator().manual_seed(rank)
    state = {"shards": {f"r{rank}.t{i}": torch.randn(n // 8, generator=g) for i in range(8)}}
    target = zeros_like_state(state)
    cfg = group_config(root, dram=dram, chunk_size=4 << 20, dram_slots=1)
    out: dict[str, Any] = {"memcpy": _timed_copy(state, target)}
    with Checkpointer(cfg) as ckpt:
        ckpt.save(1, state).wait(Boundary.RESTARTABLE, timeout=600)
        out["dram"] = _timed_load(ckpt, target)  # the slabs are still staged
    assert_state_equal(target, state)
    with Checkpointer(cfg) as ckpt:  # slabs given back at close: partner copies and shared storage
        out["partner"] = _timed_load(ckpt, target)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(os.path.join(root, "local"), ignore_errors=True)
    dist.barrier()
    with Checkpointer(cfg) as ckpt:
        out["shared"] = _timed_load(ckpt, target)
    assert_state_equal(target, state)
    path = os.path.join(root, "dcp-baseline")
    torch_dcp.save(state, storage_writer=torch_dcp.FileSystemWriter(path))
    dist.barrier()
    t0 = time.perf_counter()
    torch_dcp.load(target, storage_reader=torch_dcp.FileSystemReader(path))
    out["dcp"] = (time.perf_counter() - t0, {}, 0, {})
    assert_state_equal(target, state)
    return out


def save_row_sharded(rank: int, world: int, *, root: str) -> None:
    """A DTensor sharded by rows over every rank, plus a replicated model, saved through DCP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 1000, dtype=torch.float32).reshape(64, 1000)
    state = {"emb": distribute_tensor(full, mesh, [Shard(0)]), **model_state()}
    with Checkpointer(group_config(root)) as ckpt:
        ckpt.save(1, state).wait(Boundary.RESTARTABLE, timeout=60)


def load_resharded(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Load at another world size through ``dcp.load`` and shoal's reader: each rank its new rows."""
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shoal import dcp as shoal_dcp

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 1000, dtype=torch.float32).reshape(64, 1000)
    target = {
        "emb": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
        **zeros_like_state(model_state()),
    }
    with Checkpointer(group_config(root)) as ckpt:
        reader = shoal_dcp.StorageReader(ckpt)
        torch_dcp.load(target, storage_reader=reader)
        assert torch.equal(target["emb"].to_local(), full.chunk(world)[rank])
        assert_state_equal({"model": target["model"]}, model_state())
        assert reader.report is not None
        return {"step": reader.step, "by_tier": dict(reader.report.bytes_by_tier)}


def repair_across_hosts(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """A chunk of rank 0's shard is corrupt in h0's DRAM slab and on shared storage: the load
    repairs it from h1's partner copy (re-planned on the other host) and is bit-exact."""

    state = trained_state(rank, 1)
    with Checkpointer(group_config(root)) as ckpt:
        ckpt.save(1, state).wait(Boundary.RESTARTABLE, timeout=60)
        dist.barrier()
        if rank == 0:
            manifest = ckpt.runtime.resolve_manifest(1)
            key = next(k for k, rec in manifest.items.items() if "r0.s" in k and rec.rank == 0)
            d = manifest.items[key].chunks[0]
            dram = ckpt.runtime.dram
            (rec,) = [r for r in read_staged(dram, run_id=ckpt.runtime.run_id) if r.rank == 0 and r.step == 1]
            (item,) = [i for i in rec.items if i.chunks and i.chunks[0] == d]
            flip_byte(dram.slab_path(rec.slab), item.offset + 5)
            loc = manifest.locations[d]
            flip_byte(os.path.join(ckpt.shared.url, "packs", loc.pack + ".pack"), loc.offset + 5)
        dist.barrier()
        report = _load_bit_exact(ckpt, state)
        return {"repaired": report.repaired, "by_tier": dict(report.bytes_by_tier)}


def _load_bit_exact(ckpt: Checkpointer, state: dict[str, Any]) -> Any:
    """Load step 1 (not healed) into zeros, compare with ``state`` bit for bit; the load's report."""
    target = zeros_like_state(state)
    assert ckpt.load(target, heal=False) == 1
    assert_state_equal(target, state)
    report = ckpt.last_load
    assert report is not None
    return report


def spoil_copies(paths: list[str], chunks: list[bytes]) -> int:
    """Flip a byte of every copy of each of ``chunks`` in every file under ``paths``; how many."""
    spoiled = 0
    for top in paths:
        for folder, _, names in os.walk(top):
            for name in names:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    data = f.read()
                for chunk in chunks:
                    at = data.find(chunk[:64])
                    while at >= 0:
                        flip_byte(path, at + 5)
                        spoiled += 1
                        at = data.find(chunk[:64], at + 1)
    return spoiled


def repair_replicated_across_hosts(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Every rank loads one model, and every copy on host h0 and on shared storage is damaged: each
    chunk an h0 rank reads fails there after the exchange has begun (its receivers get a
    placeholder that does not verify), is read again on h1 and sent again; the load is bit-exact."""
    state = model_state(tensors=4)
    with Checkpointer(group_config(root)) as ckpt:
        ckpt.save(1, state).wait(timeout=60)  # every boundary: on shared storage too
        dist.barrier()
        if rank == 0:
            raw = [t.numpy().tobytes() for t in state["model"].values()]
            chunk = ckpt.config.chunk_size
            pieces = [b[i : i + chunk] for b in raw for i in range(0, len(b), chunk)]
            spoiled = spoil_copies(
                [os.path.join(root, "dram", "test", "h0"), os.path.join(root, "local", "test", "h0"),
                 os.path.join(root, "shared")],
                pieces,
            )  # fmt: skip
            assert spoiled >= 2 * len(pieces), spoiled  # h0's copies and the shared one
        dist.barrier()
        report = _load_bit_exact(ckpt, state)
        return {
            "repaired": report.repaired,
            "by_tier": dict(report.bytes_by_tier),
            "fabric": report.fabric_bytes,
            "unique_bytes": sum(len(b) for b in (t.numpy().tobytes() for t in state["model"].values())),
        }


def first_chunk_of_rank_zero(step: int, chunk_size: int) -> bytes:
    """The first chunk of rank 0's first shard in checkpoint ``step`` (to find its copies on disk)."""
    return trained_state(0, step)["shards"]["r0.s0"].numpy().tobytes()[:chunk_size]


def load_step_one(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Restart: load the committed step 1 (not healed), bit for bit; what the load used."""
    with Checkpointer(group_config(root)) as ckpt:
        target = zeros_like_state(sharded_state(rank))
        assert ckpt.load(target, step=1, heal=False) == 1
        assert_state_equal(target, trained_state(rank, 1))
        report = ckpt.last_load
        assert report is not None
        return {"repaired": report.repaired, "by_tier": dict(report.bytes_by_tier)}
