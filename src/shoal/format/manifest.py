"""The manifest: the self-describing JSON record of one checkpoint on one tier.

It names every item, the digests of the item's chunks, where each chunk lies on
this tier (pack, offset, length), the packs it needs, the DCP metadata (encoded
field by field by :mod:`shoal.format.dcp_codec`), and counters. The reader
validates schema, sizes and names and refuses newer major formats. Every integer it
accepts fits an int64 (:data:`MAX_INT`: what a file offset, a tensor dimension or a
``time_t`` can hold) and ``created`` is a real date, so nothing read back can overflow later.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import FormatError, UnsupportedFormat
from shoal.format.chunking import HASH_NAME, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from shoal.format.layout import check_step
from shoal.format.names import check_digest, check_identifier, check_item_key
from shoal.format.strict_json import load_json

FORMAT_NAME = "shoal"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
FORMAT = f"{FORMAT_NAME}/{FORMAT_MAJOR}"
_FORMAT_RE = re.compile(r"shoal/(\d{1,9})(?:\.(\d{1,9}))?")  # bounded: int() refuses 4301 digits
ITEM_KINDS = ("tensor", "bytes")
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_INT = 2**63 - 1
"""The largest integer a manifest may hold (sizes, offsets, lengths, counts, ranks, dimensions)."""
MAX_CREATED = 2**33
"""``created`` is seconds since the epoch in ``[0, MAX_CREATED)``: 1970 up to the year 2242."""


def _shown(value: Any) -> str:
    """``value`` for an error message, kept short: a huge int by its size, a long repr by its head."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class ItemRecord:
    """One item: a tensor (or tensor shard) stored as raw C-order bytes, or opaque bytes."""

    key: str
    rank: int
    kind: str
    nbytes: int
    chunks: tuple[str, ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ChunkLocation:
    pack: str
    offset: int
    length: int


@dataclass(frozen=True)
class PackRecord:
    size: int
    blake3: str


@dataclass(frozen=True)
class WorldInfo:
    size: int = 1
    hosts: tuple[str, ...] = ()
    ranks_per_node: int = 1


@dataclass(frozen=True)
class Stats:
    """Counters for ``shoal ls``: bytes the state holds, unique bytes, bytes this step wrote."""

    logical_bytes: int = 0
    unique_bytes: int = 0
    written_bytes: int = 0

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per byte written (inf when nothing new was written)."""
        if self.written_bytes == 0:
            return math.inf if self.logical_bytes else 1.0
        return self.logical_bytes / self.written_bytes


@dataclass(frozen=True)
class Manifest:
    job: str
    step: int
    created: float
    chunk_size: int
    items: Mapping[str, ItemRecord]
    locations: Mapping[str, ChunkLocation]
    packs: Mapping[str, PackRecord]
    world: WorldInfo = field(default_factory=WorldInfo)
    dcp: Mapping[str, Any] | None = None
    stats: Stats = field(default_factory=Stats)
    shoal_version: str = "0"
    hash: str = HASH_NAME
    partial: bool = False
    """A host tier's copy: every item, but locations only for the chunks this tier holds."""
    run: str | None = None
    """The id of the run that wrote it (``<shared>/<job>/RUN``; docs/design.md section 11)."""
    writer: str | None = None
    """The id of the writer that committed it (``<shared>/<job>/WRITER``)."""
    path: str | None = None
    """The durability path the checkpoint took: ``"partner"`` or ``"direct"``."""

    def encode(self) -> bytes:
        """JSON bytes of this manifest (format ``shoal/1``)."""
        doc: dict[str, Any] = {
            "format": f"{FORMAT}.{FORMAT_MINOR}",
            "job": self.job,
            "step": self.step,
            "created": self.created,
            "chunk_size": self.chunk_size,
            "hash": self.hash,
            "shoal_version": self.shoal_version,
            "world": {
                "size": self.world.size,
                "hosts": list(self.world.hosts),
                "ranks_per_node": self.world.ranks_per_node,
            },
            "stats": {
                "logical_bytes": self.stats.logical_bytes,
                "unique_bytes": self.stats.unique_bytes,
                "written_bytes": self.stats.written_bytes,
            },
            "items": {
                k: {
                    "rank": r.rank,
                    "kind": r.kind,
                    "dtype": r.dtype,
                    "shape": None if r.shape is None else list(r.shape),
                    "nbytes": r.nbytes,
                    "chunks": list(r.chunks),
                }
                for k, r in self.items.items()
            },
            "packs": {p: {"size": r.size, "blake3": r.blake3} for p, r in self.packs.items()},
            "locations": {d: [loc.pack, loc.offset, loc.length] for d, loc in self.locations.items()},
            "dcp": self.dcp,
        }
        if self.partial:
            doc["partial"] = True
        if self.run is not None:
            doc["run"] = self.run
        if self.writer is not None:
            doc["writer"] = self.writer
        if self.path is not None:
            doc["path"] = self.path
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    def chunk_spans(self, key: str) -> list[tuple[str, int, int]]:
        """``(digest, offset in item, length)`` for each chunk of item ``key``."""
        rec = self.items[key]
        return [
            (d, off, min(self.chunk_size, rec.nbytes - off))
            for d, off in ((d, i * self.chunk_size) for i, d in enumerate(rec.chunks))
        ]


class _Reader:
    """Field accessors that name the manifest and the field in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field_path: str, msg: str) -> FormatError:
        return FormatError(f"manifest {self.where}: {field_path}: {msg}")

    def get(self, obj: Mapping[str, Any], key: str, path: str) -> Any:
        if key not in obj:
            raise self.fail(f"{path}{key}", "missing")
        return obj[key]

    def integer(self, value: Any, path: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            bound = "2**63-1" if maximum == MAX_INT else str(maximum)
            raise self.fail(path, f"expected an int in [{minimum}, {bound}], got {_shown(value)}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {_shown(value)}")
        return value

    def digest(self, value: Any, path: str) -> str:
        try:
            return check_digest(value)
        except ValueError:
            raise self.fail(
                path, f"expected a BLAKE3-256 digest (64 lowercase hex characters), got {_shown(value)}"
            ) from None

    def created(self, value: Any, path: str) -> float:
        """Seconds since the epoch: a number in ``[0, MAX_CREATED)`` (an int of any size compares exactly)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(path, f"expected a number of seconds since the epoch, got {_shown(value)}")
        if not 0 <= value < MAX_CREATED:  # also refuses NaN and the infinities
            raise self.fail(
                path, f"{_shown(value)} is not a time between 1970 and 2242 (seconds in [0, 2**33))"
            )
        return float(value)

    def obj(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected an object, got {type(value).__name__}")
        return value

    def array(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list, got {type(value).__name__}")
        return value

    def checked(self, check: Any, value: Any, path: str, *args: Any) -> Any:
        try:
            return check(value, *args)
        except ValueError as e:
            raise self.fail(path, str(e)) from e


def check_format(fmt: Any, where: str) -> tuple[int, int]:
    """Parse a ``shoal/M.m`` format string; refuse a newer major version."""
    m = _FORMAT_RE.fullmatch(fmt) if isinstance(fmt, str) else None
    if m is None:
        raise FormatError(f"manifest {where}: format is {_shown(fmt)}, expected 'shoal/<major>.<minor>'")
    major, minor = int(m.group(1)), int(m.group(2) or 0)
    if major > FORMAT_MAJOR:
        raise UnsupportedFormat(
            f"manifest {where} is format {fmt}, newer than this shoal reads ({FORMAT}.x); upgrade shoal"
        )
    if major < 1:
        raise FormatError(f"manifest {where}: unknown format {fmt!r}")
    return major, minor


def decode_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; ``where`` (tier url and path) appears in every error."""
    r = _Reader(where)
    doc = r.obj(load_json(data, f"manifest {where}"), "top level")
    check_format(doc.get("format"), where)
    job = r.checked(check_identifier, r.get(doc, "job", ""), "job", "job")
    step = r.checked(check_step, r.get(doc, "step", ""), "step")
    created = r.created(r.get(doc, "created", ""), "created")
    chunk_size = r.integer(r.get(doc, "chunk_size", ""), "chunk_size", minimum=1)
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise r.fail("chunk_size", f"{chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
    hash_name = r.get(doc, "hash", "")
    if hash_name != HASH_NAME:
        raise r.fail("hash", f"{_shown(hash_name)} is not supported (only {HASH_NAME!r})")
    packs = _packs(r, r.obj(r.get(doc, "packs", ""), "packs"))
    locations = _locations(r, r.obj(r.get(doc, "locations", ""), "locations"), packs, chunk_size)
    w = r.obj(doc.get("world", {}), "world")
    world = _world(r, w)
    partial = doc.get("partial", False)
    if not isinstance(partial, bool):
        raise r.fail("partial", f"expected true or false, got {_shown(partial)}")
    layout = _Layout(chunk_size, locations, world.size if "size" in w else None, partial)
    items = {key: _item(r, key, rec, layout) for key, rec in r.obj(r.get(doc, "items", ""), "items").items()}
    s = r.obj(doc.get("stats", {}), "stats")
    stats = Stats(
        *(r.integer(s.get(k, 0), f"stats.{k}") for k in ("logical_bytes", "unique_bytes", "written_bytes"))
    )
    dcp = doc.get("dcp")
    run, writer, path = doc.get("run"), doc.get("writer"), doc.get("path")
    if path is not None and path not in ("partner", "direct"):
        raise r.fail("path", f"expected 'partner' or 'direct', got {str(path)[:40]!r}")
    return Manifest(
        job=job,
        step=step,
        created=created,
        chunk_size=chunk_size,
        items=items,
        locations=locations,
        packs=packs,
        world=world,
        dcp=None if dcp is None else r.obj(dcp, "dcp"),
        stats=stats,
        shoal_version=r.string(doc.get("shoal_version", "0"), "shoal_version"),
        partial=partial,
        run=None if run is None else r.string(run, "run"),
        writer=None if writer is None else r.string(writer, "writer"),
        path=path,
    )


@dataclass(frozen=True)
class _Layout:
    """What an item's record is checked against."""

    chunk_size: int
    locations: Mapping[str, ChunkLocation]
    world_size: int | None
    """``world.size`` when the manifest states it (absent: the default, not a fact to check ranks by)."""
    partial: bool


def _packs(r: _Reader, doc: Mapping[str, Any]) -> dict[str, PackRecord]:
    packs: dict[str, PackRecord] = {}
    for pid, prec in doc.items():
        r.checked(check_identifier, pid, f"packs[{pid!r}]", "pack id")
        prec = r.obj(prec, f"packs[{pid!r}]")
        size = r.integer(r.get(prec, "size", f"packs[{pid!r}]."), f"packs[{pid!r}].size")
        pdig = r.digest(r.get(prec, "blake3", f"packs[{pid!r}]."), f"packs[{pid!r}].blake3")
        packs[pid] = PackRecord(size, pdig)
    return packs


def _locations(
    r: _Reader, doc: Mapping[str, Any], packs: Mapping[str, PackRecord], chunk_size: int
) -> dict[str, ChunkLocation]:
    locations: dict[str, ChunkLocation] = {}
    for dig, loc in doc.items():
        at = f"locations[{dig[:16]!r}...]"
        r.digest(dig, at)
        loc = r.array(loc, at)
        if len(loc) != 3:
            raise r.fail(at, f"expected [pack, offset, length], got {_shown(loc)}")
        pid = r.string(loc[0], f"{at}.pack")
        if pid not in packs:
            raise r.fail(f"{at}.pack", f"pack {_shown(pid)} is not listed in 'packs'")
        off, length = r.integer(loc[1], f"{at}.offset"), r.integer(loc[2], f"{at}.length")
        if length > chunk_size:
            raise r.fail(f"{at}.length", f"{length} bytes is more than the chunk size {chunk_size}")
        if off + length > packs[pid].size:
            raise r.fail(at, f"bytes {off}..{off + length} lie past pack {pid!r}'s size {packs[pid].size}")
        locations[dig] = ChunkLocation(pid, off, length)
    return locations


def _world(r: _Reader, w: Mapping[str, Any]) -> WorldInfo:
    hosts = tuple(
        r.string(h, f"world.hosts[{i}]") for i, h in enumerate(r.array(w.get("hosts", []), "world.hosts"))
    )
    return WorldInfo(
        r.integer(w.get("size", 1), "world.size", minimum=1),
        hosts,
        r.integer(w.get("ranks_per_node", 1), "world.ranks_per_node", minimum=1),
    )


def _item(r: _Reader, key: str, rec: Any, layout: _Layout) -> ItemRecord:
    at = f"items[{key!r}]"
    r.checked(check_item_key, key, at)
    rec = r.obj(rec, at)
    kind = r.get(rec, "kind", f"{at}.")
    if kind not in ITEM_KINDS:
        raise r.fail(f"{at}.kind", f"expected one of {ITEM_KINDS}, got {_shown(kind)}")
    nbytes = r.integer(r.get(rec, "nbytes", f"{at}."), f"{at}.nbytes")
    rank = r.integer(r.get(rec, "rank", f"{at}."), f"{at}.rank")
    if layout.world_size is not None and rank >= layout.world_size:
        raise r.fail(f"{at}.rank", f"rank {rank} is not below world.size {layout.world_size}")
    dtype = rec.get("dtype")
    shape_raw = rec.get("shape")
    shape: tuple[int, ...] | None = None
    if (kind == "tensor" or dtype is not None) and (
        not isinstance(dtype, str) or not _DTYPE_RE.fullmatch(dtype)
    ):
        raise r.fail(f"{at}.dtype", f"expected a dtype name, got {_shown(dtype)}")
    if kind == "tensor" or shape_raw is not None:
        shape = tuple(
            r.integer(s, f"{at}.shape[{i}]") for i, s in enumerate(r.array(shape_raw, f"{at}.shape"))
        )
    chunks = r.array(r.get(rec, "chunks", f"{at}."), f"{at}.chunks")
    _check_chunks(r, at, nbytes, chunks, layout)
    return ItemRecord(key, rank, kind, nbytes, tuple(chunks), dtype, shape)


def _check_chunks(r: _Reader, at: str, nbytes: int, chunks: list[Any], layout: _Layout) -> None:
    chunk_size, locations = layout.chunk_size, layout.locations
    expected = -(-nbytes // chunk_size)
    if len(chunks) != expected:
        raise r.fail(f"{at}.chunks", f"{len(chunks)} chunks for {nbytes} bytes; expected {expected}")
    for i, d in enumerate(chunks):
        r.digest(d, f"{at}.chunks[{i}]")
        if d not in locations:
            if layout.partial:
                continue
            raise r.fail(f"{at}.chunks[{i}]", f"chunk {d} has no entry in 'locations'")
        want = min(chunk_size, nbytes - i * chunk_size)
        if locations[d].length != want:
            raise r.fail(
                f"{at}.chunks[{i}]",
                f"chunk {d} is {locations[d].length} bytes in its pack; expected {want}",
            )


@dataclass(frozen=True)
class Pointer:
    """``LATEST`` and ``steps/<step>/COMMIT``: a step and the digest of its manifest."""

    step: int
    manifest_blake3: str

    def encode(self) -> bytes:
        return json.dumps({"step": self.step, "manifest_blake3": self.manifest_blake3}).encode()


def decode_pointer(data: bytes, where: str) -> Pointer:
    """Parse ``LATEST`` or a ``COMMIT`` record: a step in range and a digest, each key given once."""
    doc = load_json(data, where)
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: expected a JSON object")
    try:
        step = check_step(doc.get("step"))
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from e
    value = doc.get("manifest_blake3")
    try:
        manifest_blake3 = check_digest(value)
    except ValueError:
        raise FormatError(
            f"{where}: manifest_blake3 {_shown(value)} is not a 64-character lowercase hex BLAKE3-256 digest"
        ) from None
    return Pointer(step, manifest_blake3)
