"""The manifest codec: exact round trips and strict validation of everything read back."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from shoal.errors import FormatError, ShoalError, UnsupportedFormat
from shoal.format.chunking import MIN_CHUNK_SIZE, digest
from shoal.format.manifest import (
    FORMAT,
    ChunkLocation,
    ItemRecord,
    Manifest,
    PackRecord,
    Pointer,
    Stats,
    WorldInfo,
    check_format,
    decode_manifest,
    decode_pointer,
)

CS = MIN_CHUNK_SIZE
P1 = "000000000005-node-0-r0-00000001"
P2 = "000000000004-node-1-r1-00000002"
WHERE = "file:///shared/run/steps/000000000005/manifest.json"


def _manifest() -> Manifest:
    """Item ``w`` spans two packs (2.5 chunks); ``blob`` is one short bytes chunk; ``e`` is empty."""
    a, b, c, d = (digest(bytes([i]) * 8) for i in range(4))
    locations = {
        a: ChunkLocation(P1, 0, CS),
        b: ChunkLocation(P1, CS, CS),
        c: ChunkLocation(P2, 100, CS // 2),
        d: ChunkLocation(P2, 0, 100),
    }
    items = {
        "model.w": ItemRecord(
            "model.w", 0, "tensor", 2 * CS + CS // 2, (a, b, c), "bfloat16", (3, CS // 2 + 683)
        ),
        "blob": ItemRecord("blob", 1, "bytes", 100, (d,)),
        "model.e": ItemRecord("model.e", 1, "tensor", 0, (), "float32", (0, 5)),
        "model.dup": ItemRecord("model.dup", 1, "tensor", 2 * CS, (a, a), "int8", (2 * CS,)),
    }
    packs = {P1: PackRecord(2 * CS, digest(b"p1")), P2: PackRecord(100 + CS // 2, digest(b"p2"))}
    return Manifest(
        job="run-42",
        step=5,
        created=1700000000.25,
        chunk_size=CS,
        items=items,
        locations=locations,
        packs=packs,
        world=WorldInfo(2, ("node-0", "node-1"), 1),
        dcp={"codec": "shoal-dcp/1", "planner_data": None},
        stats=Stats(10 * CS, 3 * CS, CS),
        shoal_version="0.1.0",
    )


def test_manifest_round_trips_exactly() -> None:
    m = _manifest()
    data = m.encode()
    back = decode_manifest(data, WHERE)
    assert back == m
    assert back.items["model.w"].shape == (3, CS // 2 + 683) and isinstance(
        back.items["model.w"].chunks, tuple
    )
    assert back.items["blob"].dtype is None and back.items["blob"].shape is None
    assert json.loads(data)["format"] == f"{FORMAT}.0"
    assert decode_manifest(back.encode(), WHERE).encode() == data


def test_chunk_spans_of_an_item() -> None:
    m = _manifest()
    w = m.items["model.w"].chunks
    assert m.chunk_spans("model.w") == [(w[0], 0, CS), (w[1], CS, CS), (w[2], 2 * CS, CS // 2)]
    assert m.chunk_spans("model.e") == []


def test_stats_dedup_ratio() -> None:
    assert Stats(100, 50, 25).dedup_ratio == 4.0
    assert Stats(100, 50, 0).dedup_ratio == math.inf
    assert Stats(0, 0, 0).dedup_ratio == 1.0


def test_optional_sections_default_when_absent() -> None:
    doc = json.loads(_manifest().encode())
    for key in ("world", "stats", "dcp", "shoal_version"):
        del doc[key]
    back = decode_manifest(json.dumps(doc).encode(), WHERE)
    assert back.world == WorldInfo() and back.stats == Stats() and back.dcp is None
    assert back.shoal_version == "0"


@pytest.mark.parametrize("fmt", ["shoal/1", "shoal/1.0", "shoal/1.9"])
def test_same_major_formats_are_read(fmt: str) -> None:
    doc = json.loads(_manifest().encode())
    doc["format"] = fmt
    assert decode_manifest(json.dumps(doc).encode(), WHERE) == _manifest()


@pytest.mark.parametrize("fmt", ["shoal/2.0", "shoal/2", "shoal/17.3"])
def test_newer_major_format_is_unsupported_and_says_upgrade(fmt: str) -> None:
    doc = json.loads(_manifest().encode())
    doc["format"] = fmt
    doc["items"] = "whatever a future shoal writes"
    with pytest.raises(UnsupportedFormat, match="upgrade") as info:
        decode_manifest(json.dumps(doc).encode(), WHERE)
    assert WHERE in str(info.value) and fmt in str(info.value)


@pytest.mark.parametrize("fmt", [None, 1, "shoal/0.9", "shoal", "shoal/x", "other/1.0", "shoal/1.0.0"])
def test_unknown_format_is_format_error(fmt: object) -> None:
    with pytest.raises(FormatError) as info:
        check_format(fmt, WHERE)
    assert not isinstance(info.value, UnsupportedFormat)


@pytest.mark.parametrize("cut", [0, 1, 50, -1, -10])
def test_truncated_json_is_format_error(cut: int) -> None:
    data = _manifest().encode()
    with pytest.raises(FormatError, match="not valid JSON") as info:
        decode_manifest(data[:cut], WHERE)
    assert WHERE in str(info.value)


@pytest.mark.parametrize("data", [b"\xff\xfe\x00\x01", b"[" * 100_000, b'{"step": 1' + b"0" * 5000 + b"}"])
def test_garbage_bytes_are_format_error(data: bytes) -> None:
    with pytest.raises(FormatError, match="not valid JSON"):
        decode_manifest(data, WHERE)


def _w_chunk(i: int) -> str:
    return str(_manifest().items["model.w"].chunks[i])


def _del(*path: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        target: Any = doc
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]

    return edit


def _set(*path: Any, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        target: Any = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value

    return edit


def _rename_item(new: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["items"][new] = doc["items"].pop("blob")

    return edit


W = ("items", "model.w")

INVALID: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("empty object", lambda d: d.clear(), "format is None"),
    ("missing format", _del("format"), "format is None"),
    ("missing job", _del("job"), "job: missing"),
    ("bad job", _set("job", value="../x"), "job"),
    ("missing step", _del("step"), "step: missing"),
    ("negative step", _set("step", value=-1), "step"),
    ("bool step", _set("step", value=True), "step"),
    ("missing created", _del("created"), "created: missing"),
    ("string created", _set("created", value="now"), "created"),
    ("missing chunk_size", _del("chunk_size"), "chunk_size: missing"),
    ("tiny chunk_size", _set("chunk_size", value=1024), "chunk_size: 1024 is outside"),
    ("missing hash", _del("hash"), "hash: missing"),
    ("other hash", _set("hash", value="sha256"), "hash: 'sha256' is not supported"),
    ("missing packs", _del("packs"), "packs: missing"),
    ("packs list", _set("packs", value=[]), "packs: expected an object"),
    ("bad pack id", _set("packs", "../evil", value={"size": 1, "blake3": digest(b"")}), "pack id"),
    ("pack size negative", _set("packs", P1, "size", value=-1), "size"),
    ("pack digest", _set("packs", P1, "blake3", value="zz"), "blake3"),
    ("pack missing size", _del("packs", P1, "size"), "size: missing"),
    ("missing locations", _del("locations"), "locations: missing"),
    (
        "location unknown pack",
        _set("locations", digest(b"\x00" * 8), 0, value="nope"),
        "not listed in 'packs'",
    ),
    ("location past pack", _set("locations", digest(b"\x00" * 8), 1, value=CS + 1), "lie past pack"),
    ("location shape", _set("locations", digest(b"\x00" * 8), value=[P1, 0]), "expected \\[pack, offset"),
    ("location bad digest", _set("locations", "zz", value=[P1, 0, 1]), "locations"),
    ("missing items", _del("items"), "items: missing"),
    ("dotdot key", _rename_item("a/../b"), "'\\.\\.'"),
    ("dotdot only key", _rename_item(".."), "'\\.\\.'"),
    ("absolute key", _rename_item("/etc/passwd"), "absolute"),
    ("NUL key", _rename_item("a\x00b"), "NUL"),
    ("empty key", _rename_item(""), "empty"),
    ("long key", _rename_item("k" * 5000), "limit"),
    ("missing kind", _del(*W, "kind"), "kind: missing"),
    ("bad kind", _set(*W, "kind", value="sparse"), "kind"),
    ("missing nbytes", _del(*W, "nbytes"), "nbytes: missing"),
    ("missing rank", _del(*W, "rank"), "rank: missing"),
    ("missing chunks", _del(*W, "chunks"), "chunks: missing"),
    ("too few chunks", _set(*W, "chunks", value=[_w_chunk(0), _w_chunk(1)]), "2 chunks for .* expected 3"),
    ("too many chunks", _set(*W, "nbytes", value=2 * CS), "3 chunks for .* expected 2"),
    ("chunk not located", _set(*W, "chunks", 0, value=digest(b"nowhere")), "has no entry in 'locations'"),
    ("chunk wrong length", _set(*W, "nbytes", value=2 * CS + 7), "expected 7"),
    ("chunk bad digest", _set(*W, "chunks", 0, value=1), r"chunks\[0\]"),
    ("tensor no dtype", _set(*W, "dtype", value=None), "dtype"),
    ("tensor bad dtype", _set(*W, "dtype", value="Float 32"), "dtype"),
    ("tensor no shape", _set(*W, "shape", value=None), "shape"),
    ("negative shape", _set(*W, "shape", 0, value=-3), r"shape\[0\]"),
    ("bytes bad dtype", _set("items", "blob", "dtype", value=5), "dtype"),
    ("world size 0", _set("world", "size", value=0), "world.size"),
    ("world hosts", _set("world", "hosts", value=[1]), r"world.hosts\[0\]"),
    ("stats negative", _set("stats", "unique_bytes", value=-1), "stats.unique_bytes"),
    ("dcp list", _set("dcp", value=[]), "dcp"),
    ("version int", _set("shoal_version", value=1), "shoal_version"),
    # every integer fits an int64, ``created`` is a real date (each was an OverflowError later)
    ("created past time_t", _set("created", value=10**30), "created: 10+ is not a time between 1970"),
    ("created before 1970", _set("created", value=-1e300), r"created: -1e\+300 is not a time"),
    ("created negative", _set("created", value=-1), "created: -1 is not a time"),
    ("created in 2242", _set("created", value=2**33), f"created: {2**33} is not a time"),
    ("created past any float", _set("created", value=10**400), "created: an int of 1329 bits"),
    ("pack size past int64", _set("packs", P1, "size", value=2**63), rf"packs\['{P1}'\].size: .*2\*\*63-1"),
    ("pack size past any float", _set("packs", P1, "size", value=10**400), "size: .*an int of 1329 bits"),
    ("location offset past int64", _set("locations", digest(b"\x00" * 8), 1, value=2**63), r"\.offset: "),
    ("location length past int64", _set("locations", digest(b"\x00" * 8), 2, value=2**63), r"\.length: "),
    (
        "location longer than a chunk",
        _set("locations", digest(b"\x03" * 8), value=[P1, 0, CS + 1]),
        rf"\.length: {CS + 1} bytes is more than the chunk size {CS}",
    ),
    ("nbytes past int64", _set(*W, "nbytes", value=2**63), r"'model.w'\]\.nbytes: "),
    ("nbytes past any float", _set(*W, "nbytes", value=10**400), "nbytes: .*an int of 1329 bits"),
    ("rank past int64", _set(*W, "rank", value=2**63), r"'model.w'\]\.rank: "),
    (
        "rank past world size",
        _set("items", "blob", "rank", value=2),
        r"'blob'\]\.rank: rank 2 is not below world",
    ),
    ("shape past int64", _set(*W, "shape", 1, value=2**63), r"'model.w'\]\.shape\[1\]: "),
    ("world size past int64", _set("world", "size", value=2**63), "world.size: "),
    ("ranks_per_node past int64", _set("world", "ranks_per_node", value=2**63), "world.ranks_per_node: "),
    (
        "stats past any float",
        _set("stats", "logical_bytes", value=10**400),
        "stats.logical_bytes: .*1329 bits",
    ),
    ("stats past int64", _set("stats", "written_bytes", value=2**63), "stats.written_bytes: "),
    # nbytes is what the chunks hold: len(chunks) == ceil(nbytes / chunk_size); none iff nbytes == 0
    ("empty item with a chunk", _set("items", "model.e", "chunks", value=[_w_chunk(0)]), "1 chunks for 0"),
    ("bytes item with no chunks", _set("items", "blob", "chunks", value=[]), "0 chunks for 100 bytes"),
    # a chunk digest is 64 lowercase hex characters
    ("chunk digest upper case", _set(*W, "chunks", 0, value=_w_chunk(0).upper()), r"chunks\[0\]: expected"),
    ("chunk digest short", _set(*W, "chunks", 1, value=_w_chunk(1)[:63]), r"chunks\[1\]: expected a BLAKE3"),
    ("chunk digest huge", _set(*W, "chunks", 2, value="a" * 10**6), r"chunks\[2\]: .*'aaa+\.\.\.$"),
]


@pytest.mark.parametrize(("edit", "message"), [v[1:] for v in INVALID], ids=[v[0] for v in INVALID])
def test_invalid_manifest_is_format_error_naming_the_field(
    edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    doc = json.loads(_manifest().encode())
    broken = copy.deepcopy(doc)
    edit(broken)
    with pytest.raises(FormatError, match=message) as info:
        decode_manifest(json.dumps(broken).encode(), WHERE)
    assert not isinstance(info.value, UnsupportedFormat)
    assert str(info.value).startswith(f"manifest {WHERE}")


def test_non_object_top_level_is_format_error() -> None:
    with pytest.raises(FormatError, match="top level"):
        decode_manifest(b"[]", WHERE)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_created_is_refused(literal: str) -> None:
    text = _manifest().encode().decode().replace('"created":1700000000.25', f'"created":{literal}')
    with pytest.raises(FormatError, match="created"):
        decode_manifest(text.encode(), WHERE)


def test_encode_refuses_non_finite_created() -> None:
    m = _manifest()
    bad = Manifest(m.job, m.step, math.nan, m.chunk_size, m.items, m.locations, m.packs)
    with pytest.raises(ValueError):
        bad.encode()


def test_errors_are_shoal_value_errors() -> None:
    with pytest.raises(ShoalError):
        decode_manifest(b"{", WHERE)
    with pytest.raises(ValueError):
        decode_manifest(b"{", WHERE)


def test_pointer_round_trips() -> None:
    p = Pointer(12, digest(b"manifest"))
    assert decode_pointer(p.encode(), "LATEST") == p


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b'{"step": 1}',
        b'{"step": -1, "manifest_blake3": "' + digest(b"").encode() + b'"}',
        b'{"step": "1", "manifest_blake3": "' + digest(b"").encode() + b'"}',
        b'{"step": 1, "manifest_blake3": "abc"}',
    ],
)
def test_bad_pointer_is_format_error(data: bytes) -> None:
    with pytest.raises(FormatError, match="LATEST"):
        decode_pointer(data, "LATEST")


def test_duplicate_json_keys_are_refused() -> None:
    text = _manifest().encode().decode()
    doubled = text.replace('"job":"run-42"', '"job":"run-42","job":"other"')
    assert doubled != text
    with pytest.raises(FormatError, match="duplicate JSON object key 'job'"):
        decode_manifest(doubled.encode(), WHERE)


def test_the_largest_values_a_manifest_may_hold_are_read() -> None:
    doc = json.loads(_manifest().encode())
    doc["created"] = 2**33 - 1  # an int: read as a float
    doc["stats"] = {"logical_bytes": 2**63 - 1, "unique_bytes": 0, "written_bytes": 0}
    doc["world"]["size"] = 2**63 - 1
    doc["packs"][P2]["size"] = 2**63 - 1
    doc["locations"][_manifest().items["blob"].chunks[0]] = [P2, 2**63 - 101, 100]
    doc["items"]["model.e"]["shape"] = [0, 2**63 - 1]
    back = decode_manifest(json.dumps(doc).encode(), WHERE)
    assert back.created == 2.0**33 - 1 and isinstance(back.created, float)
    assert back.stats.logical_bytes == 2**63 - 1 and back.stats.dedup_ratio == math.inf
    assert back.locations[back.items["blob"].chunks[0]] == ChunkLocation(P2, 2**63 - 101, 100)
    assert back.items["model.e"].shape == (0, 2**63 - 1)
    doc["created"] = 0
    assert decode_manifest(json.dumps(doc).encode(), WHERE).created == 0.0


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("created",), 10**4000),
        (("stats", "unique_bytes"), -(10**4000)),
        (("packs", P1, "size"), 10**4000),
        (("items", "model.w", "shape", 0), 10**4000),
        (("items", "model.w", "chunks", 0), "f" * 10**6),
        (("items", "model.w", "dtype"), "x" * 10**6),
        (("shoal_version",), [0] * 10**5),
        (("format",), "shoal/" + "9" * 10**5),
    ],
    ids=["created", "stats", "pack size", "shape", "chunk digest", "dtype", "version", "format"],
)
def test_a_huge_value_is_named_in_a_short_message(path: tuple[str | int, ...], value: object) -> None:
    edit = _set(*path, value=value)
    doc = json.loads(_manifest().encode())
    edit(doc)
    with pytest.raises(FormatError) as info:
        decode_manifest(json.dumps(doc).encode(), WHERE)
    message = str(info.value)
    assert len(message) < 300, message
    assert str(path[-1]) in message or path == ("format",)


def test_rank_is_checked_against_world_size_only_where_the_manifest_gives_one() -> None:
    doc = json.loads(_manifest().encode())
    doc["items"]["blob"]["rank"] = 7
    del doc["world"]["size"]
    assert decode_manifest(json.dumps(doc).encode(), WHERE).items["blob"].rank == 7
    doc["world"]["size"] = 8
    assert decode_manifest(json.dumps(doc).encode(), WHERE).world.size == 8
    doc["world"]["size"] = 7
    with pytest.raises(FormatError, match=r"items\['blob'\]\.rank: rank 7 is not below world.size 7"):
        decode_manifest(json.dumps(doc).encode(), WHERE)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"step": ' + str(10**400).encode() + b', "manifest_blake3": "00"}', "an int of 1329 bits"),
        (b'{"step": 1, "manifest_blake3": "' + b"a" * 10**6 + b'"}', "manifest_blake3 'aaa+\\.\\.\\. is not"),
        (
            b'{"step": 1, "step": 2, "manifest_blake3": "' + digest(b"").encode() + b'"}',
            "duplicate .* 'step'",
        ),
    ],
    ids=["huge step", "huge digest", "duplicate key"],
)
def test_bad_pointer_is_named_in_a_short_message(data: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=message) as info:
        decode_pointer(data, "LATEST")
    assert str(info.value).startswith("LATEST: ") and len(str(info.value)) < 300
