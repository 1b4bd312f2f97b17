"""Fixed-size chunking and BLAKE3-256 digests."""

from __future__ import annotations

import os

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.errors import ChecksumMismatch, ShoalError
from shoal.format.chunking import (
    DEFAULT_CHUNK_SIZE,
    HASH_NAME,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    Hasher,
    chunk_spans,
    digest,
    expect_digest,
    verify,
)

EMPTY_BLAKE3 = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def test_constants_are_consistent() -> None:
    assert HASH_NAME == "blake3-256"
    assert MIN_CHUNK_SIZE <= DEFAULT_CHUNK_SIZE == 4 << 20 <= MAX_CHUNK_SIZE


@pytest.mark.parametrize(
    ("nbytes", "chunk_size", "spans"),
    [
        (0, 4, []),
        (1, 4, [(0, 1)]),
        (3, 4, [(0, 3)]),
        (4, 4, [(0, 4)]),
        (5, 4, [(0, 4), (4, 1)]),
        (8, 4, [(0, 4), (4, 4)]),
        (10, 4, [(0, 4), (4, 4), (8, 2)]),
        (7, 1, [(i, 1) for i in range(7)]),
        (5, 100, [(0, 5)]),
    ],
)
def test_chunk_spans_edges(nbytes: int, chunk_size: int, spans: list[tuple[int, int]]) -> None:
    assert chunk_spans(nbytes, chunk_size) == spans


@pytest.mark.parametrize(("nbytes", "chunk_size"), [(10, 0), (10, -4), (-1, 4)])
def test_chunk_spans_rejects_bad_arguments(nbytes: int, chunk_size: int) -> None:
    with pytest.raises(ValueError):
        chunk_spans(nbytes, chunk_size)


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 38))
def test_chunk_spans_tile_the_item(nbytes: int, chunk_size: int) -> None:
    if nbytes // chunk_size > 10_000:
        nbytes = chunk_size * 10_000 + nbytes % chunk_size
    spans = chunk_spans(nbytes, chunk_size)
    assert len(spans) == -(-nbytes // chunk_size)
    pos = 0
    for i, (off, length) in enumerate(spans):
        assert off == pos == i * chunk_size
        assert 0 < length <= chunk_size
        assert length == chunk_size or i == len(spans) - 1
        pos += length
    assert pos == nbytes


def test_digest_of_empty_input_is_the_blake3_test_vector() -> None:
    assert digest(b"") == EMPTY_BLAKE3


def test_digest_is_lowercase_hex_and_accepts_any_bytes_like() -> None:
    data = os.urandom(1000)
    d = digest(data)
    assert len(d) == 64 and d == d.lower() and int(d, 16) >= 0
    assert d == blake3.blake3(data).hexdigest()
    assert digest(bytearray(data)) == d == digest(memoryview(data))
    assert digest(memoryview(b"xx" + data)[2:]) == d
    assert digest(data[:-1]) != d


def test_verify_passes_on_match_and_names_the_source_on_mismatch() -> None:
    data = b"chunk payload"
    verify(data, digest(data), what="pack p1 @0")
    flipped = bytes([data[0] ^ 1]) + data[1:]
    with pytest.raises(ChecksumMismatch, match="pack p1 @0") as info:
        verify(flipped, digest(data), what="pack p1 @0")
    assert isinstance(info.value, ShoalError) and isinstance(info.value, ValueError)
    assert digest(data) in str(info.value) and digest(flipped) in str(info.value)


def test_verify_builds_the_description_only_on_a_mismatch_and_names_who_gave_the_digest() -> None:
    data = b"chunk payload"
    calls: list[int] = []

    def what() -> str:
        calls.append(1)
        return "item 'w' chunk 3 read from pack /s/packs/p.pack at offset 64"

    verify(memoryview(data), digest(data), what)
    assert calls == []  # a match never formats the message
    with pytest.raises(ChecksumMismatch) as info:
        verify(data[:-1], digest(data), what)
    assert calls == [1]
    text = str(info.value)
    assert text.startswith("item 'w' chunk 3 read from pack /s/packs/p.pack at offset 64: BLAKE3 digest is ")
    assert text.endswith(f"expected {digest(data)}") and digest(data[:-1]) in text
    with pytest.raises(ChecksumMismatch, match=f"but its commit record says {digest(data)}$"):
        verify(b"other", digest(data), "manifest m.json", said_by="its commit record")


def test_expect_digest_compares_digests_already_computed() -> None:
    expect_digest(digest(b"x"), digest(b"x"), "pack p")
    with pytest.raises(ChecksumMismatch, match=r"^pack p: BLAKE3 digest is [0-9a-f]{64}, expected "):
        expect_digest(digest(b"x"), digest(b"y"), "pack p")


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000, 5000])
def test_threaded_hasher_equals_serial(chunk_size: int) -> None:
    buf = memoryview(os.urandom(4099))
    serial = [digest(buf[o : o + n]) for o, n in chunk_spans(buf.nbytes, chunk_size)]
    one, many = Hasher(threads=1), Hasher(threads=4)
    try:
        assert one.threads == 1 and many.threads == 4
        assert one.hash_item(buf, chunk_size) == serial
        assert many.hash_item(buf, chunk_size) == serial
        spans = [(5, 3), (0, 0), (100, 50), (5, 3)]
        expected = [digest(buf[o : o + n]) for o, n in spans]
        assert many.hash_spans(buf, spans) == expected == one.hash_spans(buf, spans)
    finally:
        one.close()
        many.close()


def test_hasher_default_threads_and_close_is_idempotent() -> None:
    h = Hasher()
    assert 1 <= h.threads <= 4
    h.close()
    h.close()
    # A closed hasher still works, inline.
    assert h.hash_item(memoryview(b"abcdef"), 4) == [digest(b"abcd"), digest(b"ef")]


def test_hash_item_of_empty_buffer_has_no_chunks() -> None:
    h = Hasher(threads=2)
    try:
        assert h.hash_item(memoryview(b""), 4) == []
    finally:
        h.close()
