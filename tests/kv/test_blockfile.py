"""The block file format: round trip, and every kind of damage detected before bytes are used."""

from __future__ import annotations

import os

import pytest

from shoal.errors import ChecksumMismatch, FormatError
from shoal.kv.blockfile import HEADER_SIZE, decode_block, encode_block, encode_header, parse_header
from shoal.kv.keys import chain_keys

KEY = chain_keys("m/l", 0, [1])[0]
OTHER = chain_keys("m/l", 0, [2])[0]
PAYLOAD = os.urandom(10_000)


def test_round_trip_gives_the_payload_back_bit_exact() -> None:
    raw = encode_block(KEY.digest, PAYLOAD)
    assert len(raw) == HEADER_SIZE + len(PAYLOAD)
    assert bytes(decode_block(raw, KEY.digest, "test")) == PAYLOAD
    header = parse_header(raw, "test")
    assert (header.key_digest, header.length) == (KEY.digest, len(PAYLOAD))


def test_an_empty_payload_round_trips() -> None:
    assert bytes(decode_block(encode_block(KEY.digest, b""), KEY.digest, "t")) == b""


@pytest.mark.parametrize("offset", [HEADER_SIZE, HEADER_SIZE + 5000, HEADER_SIZE + len(PAYLOAD) - 1])
def test_a_flipped_payload_byte_is_a_checksum_mismatch(offset: int) -> None:
    raw = bytearray(encode_block(KEY.digest, PAYLOAD))
    raw[offset] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="BLAKE3"):
        decode_block(raw, KEY.digest, "t")


@pytest.mark.parametrize(
    "cut", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, HEADER_SIZE + len(PAYLOAD) - 1]
)
def test_a_truncated_file_is_refused(cut: int) -> None:
    raw = encode_block(KEY.digest, PAYLOAD)[:cut]
    with pytest.raises(FormatError):
        decode_block(raw, KEY.digest, "t")


def test_a_file_with_extra_bytes_is_refused() -> None:
    with pytest.raises(FormatError, match="torn"):
        decode_block(encode_block(KEY.digest, PAYLOAD) + b"x", KEY.digest, "t")


@pytest.mark.parametrize("offset", range(0, HEADER_SIZE, 7))
def test_any_flipped_header_byte_is_refused(offset: int) -> None:
    raw = bytearray(encode_block(KEY.digest, PAYLOAD))
    raw[offset] ^= 0x80
    with pytest.raises((FormatError, ChecksumMismatch)):
        decode_block(raw, KEY.digest, "t")


def test_a_block_filed_under_another_key_is_refused() -> None:
    with pytest.raises(FormatError, match=OTHER.digest):
        decode_block(encode_block(OTHER.digest, PAYLOAD), KEY.digest, "t")


def test_a_header_made_for_other_bytes_is_a_checksum_mismatch() -> None:
    other = bytearray(PAYLOAD)
    other[0] ^= 1
    raw = encode_header(KEY.digest, bytes(other)) + PAYLOAD
    with pytest.raises(ChecksumMismatch):
        decode_block(raw, KEY.digest, "t")
