"""Per-item cost: many small tensors, consecutive saves, shoal against DCP and torch.save, in one run.

For a state of ``--count`` float32 tensors of ``--bytes`` bytes each it measures, per consecutive save
(every tensor changes before every save, so nothing deduplicates):
  * shoal, back to back: ``Checkpointer.save`` until it returns (B1), the next save called right after
    (the background work of earlier checkpoints competes with it: this is the case that must stay
    flat), plus each checkpoint's time to B4 (committed), read from its handle after the last save;
  * shoal, each after the previous B4: the same, but each save waits for the previous checkpoint's B4
    first (the retention that follows B4 still overlaps the next save);
  * ``dcp.async_save`` with ``FileSystemWriter``: default (the writer stages a fresh copy), with ONE
    reused ``DefaultStager`` (synchronous staging into cached storages), and with one reused
    ``DefaultStager`` staging in its thread (stall until ``staging_completion``). Stall = until it
    returns; completion = until its upload future is done. Each save after the previous one completed
    (as DCP requires when a stager is reused: its cached storages are being written until then);
  * ``dcp.save`` with ``FileSystemWriter`` (synchronous: stall = the whole write, fsync'd);
  * ``torch.save`` of the dict to one file (the whole write, not fsync'd).
Then load of the last checkpoint into a zeroed copy of the state (median of ``--loads``, checked equal):
shoal's ``Checkpointer.load`` in the process that saved (where its report says it read from) and in a
fresh ``Checkpointer`` with empty DRAM and local tiers (shared tier only), ``dcp.load`` with
``FileSystemReader``, ``torch.load``.
Single process, no process group. Prints Markdown tables.

With ``--stages`` it runs shoal alone instead, with a wall-clock timer (and the garbage collector's
time inside it) around each stage of the foreground save, the background pipeline, retention and
load (a few calls per checkpoint, so the timers cost nothing measurable), once with every checkpoint
finished (``Checkpointer.wait``) before the next save and once back to back. Stages are found by name
in shoal's modules; one that is not there any more is reported and skipped.

``--gc-off`` disables Python's automatic garbage collector for the whole run (every contender), to
show its share. ``--gil-probe`` only stages ``--count`` tensors the way shoal's stager does (a few torch
calls per item) and fused (three calls in all), alone and beside a thread running Python bytecode.

Usage: ``python benchmarks/small_tensors.py --count 20000 --bytes 1024 --saves 10``;
``python benchmarks/small_tensors.py --count 20000 --bytes 1024 --saves 5 --stages``;
``python benchmarks/small_tensors.py --count 20000 --gil-probe``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from dcp_baselines import make_stager, timed_async_save

import shoal
from shoal.engine.restore import LoadReport

Series = list[float]


def make_state(count: int, nbytes: int) -> dict[str, torch.Tensor]:
    numel = max(1, nbytes // 4)
    return {f"layers.{i}.weight": torch.randn(numel) for i in range(count)}


def mutate(state: dict[str, torch.Tensor]) -> None:
    """Every tensor gets new bytes (one fused op: not timed, and cheap next to the background)."""
    torch._foreach_add_(list(state.values()), 1.0)


def zeroed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def shm_dir(prefix: str) -> str:
    """A fresh private directory (mode 0700) under /dev/shm for shoal's DRAM tier."""
    return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def timed_loads(
    load: Callable[[dict[str, torch.Tensor]], object], state: dict[str, torch.Tensor], loads: int
) -> Series:
    out = []
    for _ in range(loads):
        target = zeroed(state)
        t0 = time.perf_counter()
        load(target)
        out.append(time.perf_counter() - t0)
        if not same(target, state):
            raise AssertionError("the loaded state differs from the saved one")
    return out


def shoal_run(
    state: dict[str, torch.Tensor], root: str, saves: int, *, quiescent: bool, loads: int
) -> ShoalResult:
    dram = shm_dir("shoal-small-dram-")
    cfg = shoal.Config(
        shared=os.path.join(root, "shared"),
        dram=dram,
        local=os.path.join(root, "local"),
        job="small",
        keep_last=2,
    )
    stalls, handles = [], []
    try:
        with shoal.Checkpointer(cfg) as ckpt:
            for step in range(saves):
                mutate(state)
                t0 = time.perf_counter()
                h = ckpt.save(step, state)
                stalls.append(time.perf_counter() - t0)
                handles.append(h)
                if quiescent:
                    h.wait(shoal.Boundary.RESTARTABLE, timeout=3600)
            t0 = time.perf_counter()
            ckpt.wait()
            drained = time.perf_counter() - t0
            b4 = [h.times[shoal.Boundary.RESTARTABLE] for h in handles]
            result = ShoalResult(stalls, b4, drained)
            if loads:
                result.load_same = timed_loads(lambda sd: ckpt.load(sd, saves - 1), state, loads)
                result.load_same_from = _tiers(ckpt.last_load)
        if loads:
            fresh_dram = shm_dir("shoal-small-dram2-")
            fresh = shoal.Config(
                shared=cfg.shared,
                dram=fresh_dram,
                local=os.path.join(root, "local-fresh"),
                job="small",
                keep_last=2,
            )
            try:
                with shoal.Checkpointer(fresh) as ckpt2:
                    result.load_fresh = timed_loads(lambda sd: ckpt2.load(sd, saves - 1), state, loads)
                    result.load_fresh_from = _tiers(ckpt2.last_load)
            finally:
                shutil.rmtree(fresh_dram, ignore_errors=True)
    finally:
        shutil.rmtree(dram, ignore_errors=True)
    return result


@dataclass
class ShoalResult:
    stall: Series
    b4: Series
    drain_after_last: float
    load_same: Series = field(default_factory=list)
    load_same_from: str = ""
    load_fresh: Series = field(default_factory=list)
    load_fresh_from: str = ""


def _tiers(report: LoadReport | None) -> str:
    if report is None:
        return "?"
    return ", ".join(f"{t} {n / 2**20:.1f} MiB" for t, n in sorted(report.bytes_by_tier.items()) if n)


def async_run(state: dict[str, torch.Tensor], root: str, saves: int, kind: str) -> tuple[Series, Series]:
    stager = make_stager(kind)
    stalls, done = [], []
    try:
        for step in range(saves):
            mutate(state)
            path = os.path.join(root, f"async-{kind}-{step}")
            stall, total = timed_async_save(state, path, stager)
            stalls.append(stall)
            done.append(total)
            shutil.rmtree(path)
    finally:
        if stager is not None:
            stager.close()
    return stalls, done


def dcp_run(state: dict[str, torch.Tensor], root: str, saves: int) -> tuple[Series, str]:
    out, path = [], ""
    for step in range(saves):
        mutate(state)
        if path:
            shutil.rmtree(path)
        path = os.path.join(root, f"dcp-{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
            out.append(time.perf_counter() - t0)
    return out, path  # the last checkpoint stays for dcp.load


def torch_save_run(state: dict[str, torch.Tensor], root: str, saves: int) -> tuple[Series, str]:
    out = []
    path = os.path.join(root, "state.pt")
    for _ in range(saves):
        mutate(state)
        t0 = time.perf_counter()
        torch.save(state, path)
        out.append(time.perf_counter() - t0)
    return out, path


_STAGES = [  # (module[:class], attribute, label); indentation in the label = nesting
    ("shoal.checkpointer:Checkpointer", "save", "Checkpointer.save"),
    (
        "torch.distributed.checkpoint.state_dict_saver",
        "_stateful_to_state_dict",
        "  torch: _stateful_to_state_dict (a logged wrapper per key; gone around while nobody reads it)",
    ),
    (
        "torch.distributed.checkpoint.default_planner:DefaultSavePlanner",
        "set_up_planner",
        "  torch: set_up_planner (flatten)",
    ),
    ("shoal.dcp:SavePlanner", "create_local_plan", "  create_local_plan (reused while the layout is)"),
    (
        "torch.distributed.checkpoint.default_planner:DefaultSavePlanner",
        "create_local_plan",
        "    torch: create_local_plan (a WriteItem per item)",
    ),
    ("shoal.dcp:SavePlanner", "create_global_plan", "  create_global_plan (torch's, with shoal's dedup)"),
    ("shoal.dcp:SavePlanner", "_dedup_save_plans", "    shoal: SavePlanner._dedup_save_plans"),
    ("shoal.dcp:StorageWriter", "write_data", "  shoal: StorageWriter.write_data"),
    ("shoal.engine.runtime:Runtime.stage|shoal.checkpointer:Checkpointer._stage", "", "    stage"),
    ("shoal.engine.runtime.stage_into|shoal.checkpointer.stage_into", "", "      stage_into (the copies)"),
    (
        "shoal.engine.runtime:Runtime.attach_metadata|shoal.checkpointer:Checkpointer._finish",
        "",
        "  shoal: attach_metadata (DCP's finish)",
    ),
    (
        "shoal.records.metacache:MetadataEncoder",
        "encode",
        "    MetadataEncoder.encode (DCP Metadata to a JSON document, once per layout)",
    ),
    ("shoal.records.staged:StagedIndex", "write", "StagedIndex.write (JSON; every call, either thread)"),
    ("shoal.engine.group_save:GroupSave", "run", "GroupSave.run"),
    ("shoal.engine.group_save:GroupSave", "_report", "  _report (hash, digests, staged index again)"),
    ("shoal.engine.group_save:GroupSave", "_write_staged_index", "    _write_staged_index"),
    ("shoal.engine.group_save:GroupSave", "_agree_on_plan", "  _agree_on_plan"),
    ("shoal.engine.group_save:GroupSave", "_drain", "  _drain (the pack to shared)"),
    ("shoal.engine.group_save:GroupSave", "_commit", "  _commit (manifest, commit record, LATEST)"),
    ("shoal.engine.group_save", "build_manifest", "    build_manifest"),
    ("shoal.format.manifest:Manifest", "encode", "    Manifest.encode"),
    ("shoal.engine.pipeline:Pipeline", "_retain", "Pipeline._retain (retention after the commit)"),
    ("shoal.records.packlist:StepSummaries", "prime", "  StepSummaries.prime (the step just committed)"),
    ("shoal.records.packlist:StepSummaries", "list", "  StepSummaries.list (each step's packs, kept)"),
    ("shoal.records.store", "read_manifest", "read_manifest (every call, either thread)"),
    ("shoal.checkpointer:Checkpointer", "load", "Checkpointer.load"),
    (
        "shoal.engine.runtime:Runtime.begin_restore|shoal.checkpointer:Checkpointer._begin_restore",
        "",
        "  begin_restore",
    ),
    ("shoal.engine.restore", "shared_inventory", "    shared_inventory"),
    ("shoal.engine.restore", "host_inventory", "    host_inventory"),
    ("shoal.engine.restore", "candidates_and_sources", "    candidates_and_sources"),
    ("shoal.dcp", "decode_metadata", "  decode_metadata"),
    (
        "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner",
        "create_local_plan",
        "  torch: create_local_plan (load)",
    ),
    ("shoal.dcp:StorageReader", "read_data", "  shoal: StorageReader.read_data"),
    ("shoal.engine.restore:Restore", "fetch", "    Restore.fetch"),
    ("shoal.engine.restore:Restore", "_read", "      Restore._read"),
]


def _find_stage(where: str, attr: str) -> tuple[Any, str, Any, bool] | None:
    """(owner, attribute, function, owned) of the first of ``where``'s ``|``-separated places that exists.

    A place is ``module:Class`` or ``module`` with ``attr``, or (``attr`` empty) ``module:Class.name``
    or ``module.name``.
    """
    for place in where.split("|"):
        if attr:
            modname, _, cls, name = *place.partition(":"), attr
        elif ":" in place:
            modname, _, rest = place.partition(":")
            cls, _, name = rest.rpartition(".")
        else:
            modname, _, name = place.rpartition(".")
            cls = ""
        try:
            mod = importlib.import_module(modname)
            owner = getattr(mod, cls) if cls else mod
        except (ImportError, AttributeError):
            continue
        fn = getattr(owner, name, None)
        if fn is not None:
            return owner, name, fn, name in vars(owner)
    return None


def stages_run(state: dict[str, torch.Tensor], root: str, saves: int, *, flush: bool, load: bool) -> None:
    """Time shoal's stages (see the module doc); prints one table per phase."""
    gc_seconds = [0.0]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - started[0]

    # phase -> label -> [wall seconds, gc seconds, calls]
    rec: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0.0, 0.0, 0])
    )
    phase = ["setup"]
    undo = []
    for where, attr, label in _STAGES:
        found = _find_stage(where, attr)
        if found is None:
            print(f"(stage {where} {attr} not found: skipped)")
            continue
        owner, attr, fn, own = found

        def timed(*a, _fn=fn, _label=label, **k):  # type: ignore[no-untyped-def]
            t0, g0 = time.perf_counter(), gc_seconds[0]
            try:
                return _fn(*a, **k)
            finally:
                bg = threading.current_thread().name.startswith("shoal-pipeline")
                r = rec["background" if bg else phase[0]][_label]
                r[0] += time.perf_counter() - t0
                r[1] += gc_seconds[0] - g0
                r[2] += 1

        # wraps: DCP inspects some planner methods' signatures (set_up_planner's storage_meta)
        setattr(owner, attr, functools.wraps(fn)(timed))
        undo.append((owner, attr, fn if own else None))
    gc.callbacks.append(on_gc)
    dram, dram2 = shm_dir("shoal-stages-dram-"), shm_dir("shoal-stages-dram2-")
    cfg = shoal.Config(
        shared=os.path.join(root, "shared"),
        dram=dram,
        local=os.path.join(root, "local"),
        job="stages",
        keep_last=2,
    )
    try:
        with shoal.Checkpointer(cfg) as ckpt:
            for step in range(saves):
                mutate(state)
                phase[0] = "save" if step else "first save"
                ckpt.save(step, state)
                phase[0] = "between saves"
                if flush:
                    ckpt.wait()
            ckpt.wait()
            if load:
                phase[0] = "load, same process"
                ckpt.load(zeroed(state), saves - 1)
        if load:
            fresh = shoal.Config(
                shared=cfg.shared, dram=dram2, local=os.path.join(root, "local2"), job="stages", keep_last=2
            )
            with shoal.Checkpointer(fresh) as ckpt2:
                phase[0] = "load, fresh Checkpointer"
                ckpt2.load(zeroed(state), saves - 1)
    finally:
        gc.callbacks.remove(on_gc)
        for owner, attr, fn in reversed(undo):
            if fn is None:
                delattr(owner, attr)  # it was inherited
            else:
                setattr(owner, attr, fn)
        shutil.rmtree(dram, ignore_errors=True)
        shutil.rmtree(dram2, ignore_errors=True)
    order = [label for _, _, label in _STAGES]
    how = "each save after the previous checkpoint finished" if flush else "back to back"
    for name, n in (
        ("save", saves - 1),
        ("background", saves),
        ("load, same process", 1),
        ("load, fresh Checkpointer", 1),
    ):
        got = rec.get(name)
        if not got or n < 1:
            continue
        print(f"\n{name} ({how}; seconds per checkpoint, mean of {n}):\n")
        print("| stage | seconds | of which GC | calls |")
        print("|---|---:|---:|---:|")
        for label in sorted(got, key=order.index):
            w, g, c = got[label]
            print(f"| {label.replace('  ', '&nbsp;&nbsp;')} | {w / n:.3f} | {g / n:.3f} | {c / n:g} |")


def gil_probe(count: int, nbytes: int) -> None:
    """Copy ``count`` small tensors into one mapped buffer, alone and while another thread runs Python.

    ``per item``: a ``torch.frombuffer`` + ``view`` + ``copy_`` per tensor (what the stager does): each
    of those torch calls releases the GIL and must get it back from the busy thread, which keeps it
    for up to ``sys.getswitchinterval()`` (5 ms). ``fused``: one ``frombuffer`` of the whole region,
    one ``unflatten_dense_tensors`` for every destination view, one ``_foreach_copy_``.
    """
    import mmap

    numel = max(1, nbytes // 4)
    srcs = [torch.randn(numel) for _ in range(count)]
    region = mmap.mmap(-1, count * numel * 4)
    buf = memoryview(region)

    def per_item() -> None:
        with torch.no_grad():
            for i, t in enumerate(srcs):
                dst = torch.frombuffer(buf, dtype=torch.uint8, count=numel * 4, offset=i * numel * 4)
                dst.view(t.dtype).view(t.shape).copy_(t.detach())

    def fused() -> None:
        flat = torch.frombuffer(buf, dtype=torch.float32, count=count * numel)
        with torch.no_grad():
            torch._foreach_copy_(list(torch._C._nn.unflatten_dense_tensors(flat, srcs)), srcs)

    stop = threading.Event()

    def busy() -> None:  # Python bytecode, like building a dict per item in the pipeline
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    print(f"{count} float32 tensors of {nbytes} B; switch interval {sys.getswitchinterval() * 1e3:.0f} ms\n")
    print("| staging | alone s | beside a busy Python thread s | slowdown |")
    print("|---|---:|---:|---:|")
    for name, fn in (("per item (as stage_into)", per_item), ("fused (foreach_copy_)", fused)):
        fn()
        t0 = time.perf_counter()
        fn()
        alone = time.perf_counter() - t0
        stop.clear()
        th = threading.Thread(target=busy)
        th.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        fn()
        contended = time.perf_counter() - t0
        stop.set()
        th.join()
        print(f"| {name} | {alone:.3f} | {contended:.3f} | {contended / alone:.0f}x |")


def fmt(xs: Series) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="subset of: shoal shoal-quiescent async async-stager async-stager-thread dcp torch",
    )
    parser.add_argument(
        "--root", default=None, help="directory for the on-disk outputs (default: a temp dir)"
    )
    parser.add_argument("--stages", action="store_true", help="time shoal's stages instead (see above)")
    parser.add_argument(
        "--gc-off", action="store_true", help="disable Python's automatic garbage collector for the whole run"
    )
    parser.add_argument(
        "--gil-probe",
        action="store_true",
        help="only: stage --count tensors per item (as shoal does) and fused, alone and beside a busy thread",
    )
    args = parser.parse_args()
    if args.gc_off:
        gc.disable()
    if args.gil_probe:
        gil_probe(args.count, args.bytes)
        return
    if args.stages:
        state = make_state(args.count, args.bytes)
        print(f"state: {args.count} float32 tensors of {args.bytes} B; load average {os.getloadavg()[0]:.2f}")
        for flush in (True, False):
            root = tempfile.mkdtemp(prefix="shoal-stages-")
            try:
                stages_run(state, root, args.saves, flush=flush, load=flush)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        return
    only = set(args.only) if args.only else None

    def want(name: str) -> bool:
        return only is None or name in only

    state = make_state(args.count, args.bytes)
    root = args.root or tempfile.mkdtemp(prefix="shoal-small-")
    os.makedirs(root, exist_ok=True)
    load1 = os.getloadavg()[0]
    save_rows: list[tuple[str, Series, Series | None]] = []
    load_rows: list[tuple[str, Series, str]] = []
    try:
        if want("shoal"):
            r = shoal_run(state, os.path.join(root, "shoal"), args.saves, quiescent=False, loads=args.loads)
            save_rows.append(("shoal save(), back to back", r.stall, r.b4))
            if args.loads:
                load_rows.append(("shoal load, same process", r.load_same, r.load_same_from))
                load_rows.append(("shoal load, fresh Checkpointer", r.load_fresh, r.load_fresh_from))
        if want("shoal-quiescent"):
            r = shoal_run(state, os.path.join(root, "shoal-q"), args.saves, quiescent=True, loads=0)
            save_rows.append(("shoal save(), each after the previous B4", r.stall, r.b4))
        for kind, label in (
            ("default", "dcp.async_save default"),
            ("stager", "dcp.async_save + reused DefaultStager"),
            ("stager-thread", "dcp.async_save + reused DefaultStager, thread staging"),
        ):
            if want("async" if kind == "default" else f"async-{kind}"):
                st, dn = async_run(state, root, args.saves, kind)
                save_rows.append((label, st, dn))
        if want("dcp"):
            st, path = dcp_run(state, root, args.saves)
            save_rows.append(("dcp.save + FileSystemWriter (whole write)", st, None))
            if args.loads:

                def reader(sd: dict[str, torch.Tensor]) -> None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)

                load_rows.append(
                    ("dcp.load + FileSystemReader", timed_loads(reader, state, args.loads), "disk")
                )
        if want("torch"):
            st, path = torch_save_run(state, root, args.saves)
            save_rows.append(("torch.save, one file (whole write, no fsync)", st, None))
            if args.loads:

                def tload(sd: dict[str, torch.Tensor]) -> None:
                    sd.update(torch.load(path, weights_only=True))

                load_rows.append(("torch.load (one file)", timed_loads(tload, state, args.loads), "disk"))
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    load2 = os.getloadavg()[0]

    med = statistics.median
    ref = next((s for n, s, _ in save_rows if n == "dcp.async_save + reused DefaultStager"), None)
    dcp_save = next((s for n, s, _ in save_rows if n.startswith("dcp.save")), None)
    print(
        f"state: {args.count} float32 tensors of {args.bytes} B "
        f"({args.count * args.bytes / 2**20:.1f} MiB), {args.saves} consecutive saves; "
        f"torch {torch.__version__}; load average {load1:.2f} before, {load2:.2f} after\n"
    )
    print(
        "| save | stall median s | first | last | max | B4 / completion median s | "
        "stall / async_save stall (reused stager) | dcp.save / stall |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, xs, ys in save_rows:
        r1 = f"{med(xs) / med(ref):.2f}" if ref else ""
        r2 = f"{med(dcp_save) / med(xs):.1f}" if dcp_save else ""
        comp = f"{med(ys):.3f}" if ys else ""
        print(
            f"| {name} | {med(xs):.3f} | {xs[0]:.3f} | {xs[-1]:.3f} | {max(xs):.3f} | {comp} | {r1} | {r2} |"
        )
    print("\nper save (seconds), in order:\n")
    print("| save | " + " | ".join(str(i + 1) for i in range(args.saves)) + " |")
    print("|---|" + "---:|" * args.saves)
    for name, xs, ys in save_rows:
        print(f"| {name}: stall | " + " | ".join(f"{x:.2f}" for x in xs) + " |")
        if ys:
            what = "B4" if name.startswith("shoal") else "complete"
            print(f"| {name}: {what} | " + " | ".join(f"{x:.2f}" for x in ys) + " |")
    if load_rows:
        dref = next((s for n, s, _ in load_rows if n.startswith("dcp.load")), None)
        print(f"\n| load (median of {args.loads}) | seconds | this / dcp.load | read from | raw |")
        print("|---|---:|---:|---|---|")
        for name, s, origin in load_rows:
            ratio = f"{med(s) / med(dref):.2f}" if dref else ""
            print(f"| {name} | {med(s):.3f} | {ratio} | {origin} | {fmt(s)} |")


if __name__ == "__main__":
    main()
