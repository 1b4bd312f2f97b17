"""Packs: chunk payloads back to back, with a JSON index that carries the pack's digest."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import FormatError
from shoal.format.chunking import digest
from shoal.format.pack import INDEX_FORMAT, PackEntry, PackIndex, decode_index

PACK_ID = "000000000003-node-0-r1-0a1b2c3d"


def _built() -> tuple[PackIndex, list[bytes]]:
    """An index over chunks laid back to back, as the pack writer makes one."""
    payloads = [b"alpha" * 10, b"", b"beta", b"gamma" * 3]
    entries, offset = [], 0
    for p in payloads:
        entries.append(PackEntry(digest(p), offset, len(p)))
        offset += len(p)
    return PackIndex(PACK_ID, offset, digest(b"".join(payloads)), tuple(entries)), payloads


def test_empty_pack_index() -> None:
    index = PackIndex(PACK_ID, 0, digest(b""), ())
    assert decode_index(index.encode(), "p.idx") == index


def test_index_round_trips() -> None:
    index = _built()[0]
    data = index.encode()
    doc = json.loads(data)
    assert doc["format"] == INDEX_FORMAT and doc["pack"] == PACK_ID
    assert doc["chunks"][0] == [index.entries[0].digest, 0, index.entries[0].length]
    back = decode_index(data, "packs/p.idx")
    assert back == index and isinstance(back.entries, tuple)


@pytest.mark.parametrize("cut", [0, 1, 10, -1, -2])
def test_truncated_index_is_format_error(cut: int) -> None:
    data = _built()[0].encode()
    with pytest.raises(FormatError, match="packs/p.idx"):
        decode_index(data[:cut], "packs/p.idx")


def _doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_built()[0].encode())
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
    good = _built()[0].encode().decode()
    doubled = good.replace('"size":', '"size":0,"size":', 1)
    with pytest.raises(FormatError, match="duplicate JSON object key 'size'"):
        decode_index(doubled.encode(), "x.idx")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_edit_of_an_index_decodes_or_is_a_format_error(data: st.DataObject) -> None:
    doc = json.loads(_built()[0].encode())
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
