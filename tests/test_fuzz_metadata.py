"""Fuzzed metadata: a load is bit-exact or a ShoalError, never a crash, never silently wrong values.

One real checkpoint is saved once; each example copies its shared directory, mutates ONE
file (the manifest's JSON or bytes, a pack index, a pack, ``COMMIT`` or ``LATEST``), and
loads it with a fresh ``Checkpointer`` whose host tiers are empty, so the load consults only
the shared tier. A manifest mutation is often *resealed* (its ``COMMIT`` and ``LATEST`` are
rewritten with the new digest), as a buggy or hostile writer would leave it: that is what
reaches the manifest's own checks, the cross-check against the DCP metadata and the reader.

Each example must end in a load equal to what was saved, bit for bit, or a
``shoal.ShoalError``; ``Checkpointer.latest``, ``resolve_manifest`` and ``shoal verify`` on
the mutated job must not crash either. The outcomes are counted and printed (``-s``).
``SHOAL_FUZZ_EXAMPLES`` sets the number of examples (200 by default)::

    SHOAL_FUZZ_EXAMPLES=2000 .venv/bin/pytest -p no:cacheprovider -q -s tests/test_fuzz_metadata.py
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shoal
from shoal.cli.main import main as shoal_cli
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import Pointer
from shoal.records.store import read_manifest, read_pointer, resolve_manifest
from shoal.testing.checkpoints import SMALL_CHUNK, assert_state_equal
from shoal.tiers import open_tier

settings.register_profile(
    "shoal-fuzz",
    max_examples=int(os.environ.get("SHOAL_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

JOB = "fuzz"
STEP = 1


def _state() -> dict[str, Any]:
    """A few dtypes, a multi-chunk tensor and non-tensor items; every chunk a different length."""
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(130, 130, generator=g),  # 67600 bytes: two chunks of 64 KiB
        "ids": torch.randint(-(2**40), 2**40, (50,), dtype=torch.int64, generator=g),
        "h": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "step": 12,
        "meta": ("run-42" * 60, [1, 2, 3], {"lr": 3e-4}),
    }


def _target() -> dict[str, Any]:
    return {
        k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else None
        for k, v in _state().items()
    }


@dataclass(frozen=True)
class Base:
    """The saved checkpoint: its shared root, job directory and files (relative to the job)."""

    shared: Path
    job: Path
    manifest: dict[str, Any]
    index: str
    pack: str


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Base]:
    root = tmp_path_factory.mktemp("fuzz-base")
    with _host_roots() as (dram, local):
        config = _config(root / "shared", dram, local)
        with shoal.Checkpointer(config) as ckpt:
            ckpt.save(STEP, _state()).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    job = root / "shared" / JOB
    packs = sorted(p.name for p in (job / layout.PACKS_DIR).iterdir())
    assert len(packs) == 2, packs  # one pack and its index
    manifest = json.loads((job / layout.manifest_path(STEP)).read_bytes())
    lengths = [loc[2] for loc in manifest["locations"].values()]
    assert len(set(lengths)) == len(lengths), "chunk lengths must differ, so no digest swap is valid"
    yield Base(
        root / "shared",
        job,
        manifest,
        f"{layout.PACKS_DIR}/{packs[0]}",  # <id>.idx sorts before <id>.pack
        f"{layout.PACKS_DIR}/{packs[1]}",
    )


@contextlib.contextmanager
def _host_roots() -> Iterator[tuple[str, str]]:
    """Fresh, empty DRAM and local roots, removed after."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    dram = tempfile.mkdtemp(prefix="shoal-fuzz-dram-", dir=shm)
    local = tempfile.mkdtemp(prefix="shoal-fuzz-local-")
    try:
        yield dram, local
    finally:
        shutil.rmtree(dram, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


def _config(shared: Path, dram: str, local: str) -> shoal.Config:
    return shoal.Config(
        shared=str(shared),
        dram=dram,
        local=local,
        job=JOB,
        host_id="h0",
        chunk_size=SMALL_CHUNK,
        keep_last=None,
    )


# --- JSON documents: paths, edits -----------------------------------------------------------------

Path_ = tuple[Any, ...]


def _paths(node: Any, prefix: Path_ = ()) -> list[Path_]:
    out: list[Path_] = []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        out.append((*prefix, key))
        out.extend(_paths(child, (*prefix, key)))
    return out


def _parent(doc: Any, path: Path_) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


def _nudge(value: Any, delta: int) -> Any:
    """A nearby value of the same type: an int moved by ``delta``, a string or list changed a little."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + delta
    if isinstance(value, float):
        return value * 2 + delta
    if isinstance(value, str):
        if not value:
            return "x"
        i = abs(delta) % len(value)
        c = "0" if value[i] != "0" else "1"
        return value[:i] + c + value[i + 1 :]
    if isinstance(value, list):
        if not value:
            return [delta]
        out = list(value)
        i = abs(delta) % len(out)
        out[i] = _nudge(out[i], delta)
        return out
    return value


@dataclass(frozen=True)
class JsonEdit:
    """One edit at ``path``: delete it, replace it, nudge it, rename a key, or swap with ``other``."""

    op: str
    path: Path_
    value: Any = None
    other: Path_ = ()

    def apply(self, doc: Any) -> None:
        parent, key = _parent(doc, self.path), self.path[-1]
        if self.op == "delete":
            del parent[key]
        elif self.op == "replace":
            parent[key] = copy.deepcopy(self.value)
        elif self.op == "nudge":
            parent[key] = _nudge(parent[key], int(self.value))
        elif self.op == "rename" and isinstance(parent, dict):
            parent[str(self.value)] = parent.pop(key)
        elif self.op == "swap":
            try:
                oparent, okey = _parent(doc, self.other), self.other[-1]
                parent[key], oparent[okey] = copy.deepcopy(oparent[okey]), copy.deepcopy(parent[key])
            except (KeyError, IndexError, TypeError):  # one path lies inside the other
                parent[key] = copy.deepcopy(_parent(doc, self.other)[self.other[-1]])


_DTYPES = [
    "float32",
    "int32",
    "float64",
    "bfloat16",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "bogus",
    "Tensor",
]
_DIGESTS = ["0" * 64, "f" * 64, "ab" * 31, "AB" * 32]
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(-(2**80), 2**80),
    st.sampled_from([2**63, 2**64, 10**12, 1 << 30, 67600, 65536]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(_DTYPES),
    st.sampled_from(_DIGESTS),
    st.sampled_from(["../x", "/etc/passwd", "a/b", "", "w", "ids", "meta", "shoal/2.0", "shoal-dcp/9"]),
    st.lists(st.integers(-1, 200), max_size=4),
    st.sampled_from(
        [[], {}, [[]], {"tuple": []}, {"size": [1]}, {"float": "nan"}, {"x": 1}, {"type": "bytes"}]
    ),
)


def _interesting(path: Path_) -> bool:
    return path[0] in ("dcp", "locations", "packs") or (
        path[0] == "items" and len(path) >= 3 and path[2] in ("dtype", "shape", "nbytes", "chunks", "kind")
    )


@st.composite
def json_edits(draw: st.DrawFn, doc: dict[str, Any]) -> JsonEdit:
    paths = _paths(doc)
    interesting = [p for p in paths if _interesting(p)] or paths
    path = draw(st.one_of(st.sampled_from(paths), st.sampled_from(interesting)))
    op = draw(st.sampled_from(["delete", "replace", "replace", "nudge", "nudge", "rename", "swap"]))
    if op == "swap":
        return JsonEdit(op, path, other=draw(st.sampled_from(paths)))
    if op == "nudge":
        return JsonEdit(op, path, draw(st.sampled_from([-1, 1, 2, 7, 4096, 2**40])))
    if op == "rename":
        return JsonEdit(op, path, draw(st.sampled_from(["w", "ids", "x", "w@0_0", "0" * 64, "f" * 64])))
    return JsonEdit(op, path, draw(_VALUES))


def semantic_edits(doc: dict[str, Any]) -> list[JsonEdit]:
    """Edits that keep the manifest well-formed but make it lie: other dtypes, shapes, kinds, keys."""
    edits: list[JsonEdit] = []
    keys = list(doc["items"])
    for key, rec in doc["items"].items():
        at = ("items", key)
        edits += [JsonEdit("replace", (*at, "dtype"), d) for d in _DTYPES[:8] if d != rec["dtype"]]
        edits += [JsonEdit("replace", (*at, "kind"), "bytes" if rec["kind"] == "tensor" else "tensor")]
        edits += [JsonEdit("nudge", (*at, "nbytes"), d) for d in (-1, 1)]
        if rec["shape"] is not None:
            shape = rec["shape"]
            others = [shape[::-1], [*shape, 1], shape[:-1], [0 for _ in shape], [n + 1 for n in shape]]
            edits += [JsonEdit("replace", (*at, "shape"), s) for s in others if s != shape]
    state = doc["dcp"]["state_dict_metadata"]
    for fqn, md in state.items():
        at = ("dcp", "state_dict_metadata", fqn)
        edits += [JsonEdit("swap", at, other=("dcp", "state_dict_metadata", o)) for o in state if o != fqn]
        if md["type"] != "tensor":
            continue
        edits += [JsonEdit("replace", (*at, "properties", "dtype"), d) for d in _DTYPES[:8]]
        edits += [JsonEdit("nudge", (*at, "size"), d) for d in (1, 2)]
        edits += [JsonEdit("nudge", (*at, "chunks", 0, f), d) for f in ("offsets", "sizes") for d in (-1, 1)]
        edits += [JsonEdit("replace", (*at, "chunks"), [])]
    for i, entry in enumerate(doc["dcp"]["storage_data"]):
        at = ("dcp", "storage_data", i)
        edits += [JsonEdit("replace", (*at, "value"), k) for k in keys if k != entry["value"]]
        edits += [JsonEdit("replace", (*at, "fqn"), k) for k in keys if k != entry["fqn"]]
        edits += [JsonEdit("nudge", (*at, "offset"), 1), JsonEdit("replace", (*at, "offset"), None)]
        edits += [JsonEdit("delete", at)]
    return edits


# --- byte edits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ByteEdit:
    """Flip a bit, truncate, append, replace with garbage, pad past the size limit, empty, delete."""

    op: str
    at: int = 0
    data: bytes = b""

    def apply(self, path: Path) -> None:
        if self.op == "delete":
            path.unlink()
            return
        raw = path.read_bytes()
        if self.op == "flip" and raw:
            i = self.at % len(raw)
            raw = raw[:i] + bytes([raw[i] ^ (1 << (self.at % 8))]) + raw[i + 1 :]
        elif self.op == "truncate":
            raw = raw[: self.at % max(len(raw), 1)]
        elif self.op == "append":
            raw += self.data
        elif self.op == "garbage":
            raw = self.data
        elif self.op == "oversize":  # valid JSON after whitespace, but larger than a pointer may be
            raw = b" " * (layout.MAX_POINTER_BYTES + 1) + raw
        path.write_bytes(raw)


byte_edits = st.builds(
    ByteEdit,
    op=st.sampled_from(["flip", "flip", "flip", "truncate", "append", "garbage", "oversize", "delete"]),
    at=st.integers(0, 1 << 20),
    data=st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"{}", b"[]", b"null", b'{"step": 1}', b"\xff\xfe", b"[" * 5000, b"1" * 5000]),
    ),
)


# --- cases --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    target: str
    """``manifest``, ``index``, ``pack``, ``COMMIT`` or ``LATEST``."""
    edit: JsonEdit | ByteEdit
    reseal: bool
    """After a manifest edit: rewrite COMMIT and LATEST with the edited manifest's digest."""
    step: int | None
    """What the load asks for (None: the newest restorable)."""


_POINTER_DOC = {"step": STEP, "manifest_blake3": "0" * 64}
_INDEX_DOC = {
    "format": "shoal-pack/1",
    "pack": "p",
    "size": 1,
    "blake3": "0" * 64,
    "chunks": [["0" * 64, 0, 1]],
}


@st.composite
def cases(draw: st.DrawFn, manifest: dict[str, Any]) -> Case:
    target = draw(
        st.sampled_from(["manifest"] * 6 + ["index", "pack", "COMMIT", "COMMIT", "LATEST", "LATEST"])
    )
    shape = {"manifest": manifest, "index": _INDEX_DOC, "COMMIT": _POINTER_DOC, "LATEST": _POINTER_DOC}
    edit: JsonEdit | ByteEdit
    if target == "manifest" and draw(st.booleans()):
        edit = draw(st.sampled_from(semantic_edits(manifest)))
    elif target != "pack" and draw(st.integers(0, 3)):
        edit = draw(json_edits(shape[target]))
    else:
        edit = draw(byte_edits)
    reseal = target == "manifest" and draw(st.integers(0, 4)) > 0
    return Case(target, edit, reseal, draw(st.sampled_from([None, None, STEP])))


def _mutate(base: Base, job: Path, case: Case) -> None:
    rel = {
        "manifest": layout.manifest_path(STEP),
        "index": base.index,
        "pack": base.pack,
        "COMMIT": layout.commit_path(STEP),
        "LATEST": layout.LATEST,
    }[case.target]
    path = job / rel
    if isinstance(case.edit, JsonEdit):
        doc = json.loads(path.read_bytes())
        with contextlib.suppress(KeyError, IndexError, TypeError):  # a path this document lacks: no change
            case.edit.apply(doc)
        path.write_bytes(json.dumps(doc).encode())  # NaN and Infinity literals included
    else:
        case.edit.apply(path)
    if case.reseal and path.exists():
        pointer = Pointer(STEP, digest(path.read_bytes())).encode()
        (job / layout.commit_path(STEP)).write_bytes(pointer)
        (job / layout.LATEST).write_bytes(pointer)


def _outcome(call: Callable[[], Any], *, detail: bool = False) -> str:
    """``ok`` or the ShoalError's class name; anything else propagates (and fails the example).

    With ``detail``, a FormatError also says which check refused (by the start of its message).
    """
    try:
        call()
    except shoal.ShoalError as e:
        name = type(e).__name__
        if detail and name == "FormatError":
            text = str(e)
            origin = next(
                (o for prefix, o in _ORIGINS if text.startswith(prefix) or prefix in text[:80]), "other"
            )
            return f"{name} ({origin})"
        return name
    return "ok"


_ORIGINS = [
    ("dcp metadata:", "DCP metadata codec"),
    (f"step {STEP} of job", "manifest vs DCP cross-check"),
    ("manifest ", "manifest schema"),
    ("the safe unpickler", "safe unpickler"),
    ("not a torch.save payload", "safe unpickler"),
    ("LATEST", "LATEST record"),
    ("COMMIT", "commit record"),
    ("commit record", "commit record"),
]


def _verify(job: Path) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = shoal_cli(["verify", str(job)])
    assert rc in (0, 1, 2), f"shoal verify exited {rc}: {err.getvalue()}"
    assert "internal error" not in err.getvalue(), f"shoal verify crashed: {err.getvalue()}"
    return f"verify={rc}"


def _run_case(base: Base, case: Case, counts: Counter[str]) -> None:
    expected = _state()
    with tempfile.TemporaryDirectory(prefix="shoal-fuzz-case-") as tmp, _host_roots() as (dram, local):
        shared = Path(tmp) / "shared"
        shutil.copytree(base.shared, shared)
        job = shared / JOB
        _mutate(base, job, case)
        tier = open_tier("shared", str(job))
        with shoal.Checkpointer(_config(shared, dram, local)) as ckpt:
            out = _target()

            def load() -> None:
                assert ckpt.load(out, step=case.step, heal=False) == STEP
                assert_state_equal(out, expected)  # loaded: it must be exactly what was saved

            result = _outcome(load, detail=True)
            counts[f"load {result.split(' (')[0]}"] += 1
            counts[f"latest {_outcome(ckpt.latest)}"] += 1
        counts[f"resolve_manifest {_outcome(lambda: resolve_manifest(tier, case.step))}"] += 1
        counts[f"read_pointer(COMMIT) {_outcome(lambda: read_pointer(tier, layout.commit_path(STEP)))}"] += 1
        counts[f"read_manifest {_outcome(lambda: read_manifest(tier, STEP))}"] += 1
        verdict = _verify(job)
        counts[verdict] += 1
        if verdict == "verify=0" and result != "ok":  # verify passed what the load refused
            counts[f"verify=0 but load {result}"] += 1
        target = f"{case.target} (resealed)" if case.reseal else case.target
        counts[f"{target} -> load {result}"] += 1


def test_fuzzed_metadata_loads_bit_exact_or_raises_a_shoal_error(base: Base) -> None:
    counts: Counter[str] = Counter()

    @settings(settings.get_profile("shoal-fuzz"))
    @given(case=cases(base.manifest))
    def run(case: Case) -> None:
        _run_case(base, case, counts)

    run()
    total = sum(v for k, v in counts.items() if k.startswith("load "))
    print(f"\nfuzzed metadata: {total} examples")
    for key, n in sorted(counts.items()):
        print(f"  {key:<72} {n:>6}")
    assert counts["load ok"] > 0, "no example loaded: the fuzz no longer reaches a good load"
    assert total - counts["load ok"] > 0, "no example failed: the mutations no longer reach the checks"


def test_the_unmutated_checkpoint_loads_and_verifies(base: Base) -> None:
    counts: Counter[str] = Counter()
    _run_case(base, Case("index", JsonEdit("nudge", ("missing",), 0), False, None), counts)
    assert counts["load ok"] == 1 and counts["verify=0"] == 1, counts


def test_oversized_pointer_and_manifest_are_refused_without_reading_them(
    base: Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(base.shared, tmp_path / "shared")
    job = tmp_path / "shared" / JOB
    tier = open_tier("shared", str(job))
    commit = job / layout.commit_path(STEP)
    commit.write_bytes(b" " * layout.MAX_POINTER_BYTES + commit.read_bytes())
    with pytest.raises(shoal.errors.FormatError, match=f"more than the {layout.MAX_POINTER_BYTES} bytes"):
        read_pointer(tier, layout.commit_path(STEP))
    size = (job / layout.manifest_path(STEP)).stat().st_size
    monkeypatch.setattr(layout, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(shoal.errors.FormatError, match=f"manifest .* is {size} bytes, more than"):
        read_manifest(tier, STEP)
    monkeypatch.setattr(layout, "MAX_MANIFEST_BYTES", size)
    assert read_manifest(tier, STEP).step == STEP
