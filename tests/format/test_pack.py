"""Packs: chunk payloads back to back, with a JSON index that carries the pack's digest."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import FormatError, InvalidName
from shoal.format.chunking import digest
from shoal.format.pack import INDEX_FORMAT, PackBuilder, PackEntry, PackIndex, decode_index

PACK_ID = "000000000003-node-0-r1-0a1b2c3d"


def _built() -> tuple[PackBuilder, list[bytes]]:
    payloads = [b"alpha" * 10, b"", b"beta", b"gamma" * 3]
    builder = PackBuilder(PACK_ID)
    for p in payloads:
        builder.add(digest(p), memoryview(p))
    return builder, payloads


def test_builder_lays_chunks_back_to_back() -> None:
    builder, payloads = _built()
    assert len(builder) == len(payloads)
    assert builder.size == sum(len(p) for p in payloads)
    written = b"".join(bytes(v) for v in builder.buffers())
    assert written == b"".join(payloads)
    index = builder.index()
    assert index.pack_id == PACK_ID and index.size == len(written)
    assert index.blake3 == digest(written)
    offset = 0
    for entry, payload in zip(index.entries, payloads, strict=True):
        assert entry == PackEntry(digest(payload), offset, len(payload))
        assert written[entry.offset : entry.offset + entry.length] == payload
        offset += len(payload)


def test_builder_skips_a_digest_it_already_holds() -> None:
    builder = PackBuilder(PACK_ID)
    first = builder.add(digest(b"same"), memoryview(b"same"))
    assert first == PackEntry(digest(b"same"), 0, 4)
    assert builder.add(digest(b"same"), memoryview(bytearray(b"same"))) is None
    assert len(builder) == 1 and builder.size == 4


def test_builder_does_not_copy_payloads() -> None:
    data = bytearray(b"mutable")
    builder = PackBuilder(PACK_ID)
    builder.add(digest(bytes(data)), memoryview(data))
    data[0:1] = b"M"
    assert bytes(next(builder.buffers())) == b"Mutable"


def test_empty_pack_index() -> None:
    index = PackBuilder(PACK_ID).index()
    assert index.size == 0 and index.entries == () and index.blake3 == digest(b"")
    assert decode_index(index.encode(), "p.idx") == index


@pytest.mark.parametrize("pack_id", ["../x", "", "a/b", ".p"])
def test_builder_refuses_unsafe_pack_ids(pack_id: str) -> None:
    with pytest.raises(InvalidName):
        PackBuilder(pack_id)


def test_index_round_trips() -> None:
    index = _built()[0].index()
    data = index.encode()
    doc = json.loads(data)
    assert doc["format"] == INDEX_FORMAT and doc["pack"] == PACK_ID
    assert doc["chunks"][0] == [index.entries[0].digest, 0, index.entries[0].length]
    back = decode_index(data, "packs/p.idx")
    assert back == index and isinstance(back.entries, tuple)


@pytest.mark.parametrize("cut", [0, 1, 10, -1, -2])
def test_truncated_index_is_format_error(cut: int) -> None:
    data = _built()[0].index().encode()
    with pytest.raises(FormatError, match="packs/p.idx"):
        decode_index(data[:cut], "packs/p.idx")


def _doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_built()[0].index().encode())
    return doc


def _edit(path: tuple[Any, ...], value: object) -> dict[str, Any]:
    doc = _doc()
    target: Any = doc
    for p in path[:-1]:
        target = target[p]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "expected a JSON object"),
        (_edit(("format",), "shoal-pack/2"), "format is 'shoal-pack/2'"),
        (_edit(("format",), _DELETE), "format is None"),
        (_edit(("pack",), "../x"), "pack id"),
        (_edit(("pack",), _DELETE), "pack id"),
        (_edit(("blake3",), "xyz"), "pack digest"),
        (_edit(("size",), -1), "size"),
        (_edit(("size",), True), "size"),
        (_edit(("size",), 1.5), "size"),
        (_edit(("size",), _DELETE), "size"),
        (_edit(("chunks",), {}), "'chunks' must be a list"),
        (_edit(("chunks", 0), [digest(b"a"), 0]), r"chunks\[0\]: expected \[digest, offset, length\]"),
        (_edit(("chunks", 1, 0), "A" * 64), r"chunks\[1\]: .*digest"),
        (_edit(("chunks", 2, 1), -3), r"chunks\[2\]\.offset"),
        (_edit(("chunks", 2, 2), "4"), r"chunks\[2\]\.length"),
        (_edit(("chunks", 3, 2), 10**6), r"chunks\[3\]: .*past the pack's size"),
    ],
)
def test_malformed_index_is_format_error(doc: object, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        decode_index(json.dumps(doc).encode(), "packs/p.idx")


@pytest.mark.parametrize("data", [b"\xff\xfe\xfa", b"[" * 100_000, b'{"size": 1' + b"0" * 5000 + b"}"])
def test_garbage_index_bytes_are_format_error(data: bytes) -> None:
    with pytest.raises(FormatError, match="not valid JSON"):
        decode_index(data, "packs/p.idx")


def test_pack_index_is_a_frozen_value() -> None:
    index = PackIndex("p", 0, digest(b""), ())
    with pytest.raises(AttributeError):
        index.size = 3  # type: ignore[misc]


def test_duplicate_keys_in_an_index_are_refused() -> None:
    good = _built()[0].index().encode().decode()
    doubled = good.replace('"size":', '"size":0,"size":', 1)
    with pytest.raises(FormatError, match="duplicate JSON object key 'size'"):
        decode_index(doubled.encode(), "x.idx")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_edit_of_an_index_decodes_or_is_a_format_error(data: st.DataObject) -> None:
    doc = json.loads(_built()[0].index().encode())
    field = data.draw(st.sampled_from([*doc, "chunks-row", "chunks-cell"]))
    value = data.draw(
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats()
        | st.text(max_size=70)
        | st.lists(st.integers(-2, 2**64), max_size=4)
        | st.just([[digest(b""), 0, 0]])
    )
    if field == "chunks-row":
        doc["chunks"][data.draw(st.integers(0, len(doc["chunks"]) - 1))] = value
    elif field == "chunks-cell":
        row = doc["chunks"][data.draw(st.integers(0, len(doc["chunks"]) - 1))]
        row[data.draw(st.integers(0, 2))] = value
    elif data.draw(st.booleans()):
        del doc[field]
    else:
        doc[field] = value
    try:
        index = decode_index(json.dumps(doc).encode(), "x.idx")
    except FormatError as e:
        assert "x.idx" in str(e)
    else:
        assert all(e.offset + e.length <= index.size for e in index.entries)
