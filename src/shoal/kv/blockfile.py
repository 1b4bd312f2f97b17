"""The on-tier block format: a small fixed header, then the block's bytes.

Every tier (the DRAM pool, the local disk, shared storage) holds one file per block, named by
the key's digest, laid out as::

    offset  size  field
    0       8     magic b"SHOALKV\\x00"
    8       2     version (1), little-endian
    10      2     header size (96)
    12      4     flags (0)
    16      32    key digest (raw BLAKE3 of the BlockKey, shoal.kv.keys)
    48      8     payload length in bytes
    56      32    payload BLAKE3-256 digest
    88      8     first 8 bytes of the BLAKE3 of bytes 0..88 (the header's own check)
    96      ...   payload

:func:`parse_header` refuses a bad magic, version, size or header check; :func:`check_block`
also compares the key and the file's length; :func:`verify_payload` hashes the payload. A file
is served only after all three pass, so a torn write (short file), a flipped byte anywhere or a
file renamed to another key's name is a :class:`~shoal.errors.ChecksumMismatch` (payload) or
:class:`~shoal.errors.FormatError` (header), never bytes handed out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3

from shoal.errors import ChecksumMismatch, FormatError
from shoal.format.chunking import digest, expect_digest

MAGIC = b"SHOALKV\x00"
VERSION = 1
HEADER_SIZE = 96
_HEAD = struct.Struct("<8sHHI32sQ32s")
assert _HEAD.size == 88
_CHECK_BYTES = 8


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The parsed header of one block file."""

    key_digest: str
    """The 64-hex key digest recorded in the file."""
    length: int
    """Payload bytes that follow the header."""
    payload_digest: str
    """Hex BLAKE3-256 of the payload."""

    @property
    def file_size(self) -> int:
        """Header plus payload: what the file must hold exactly."""
        return HEADER_SIZE + self.length


def encode_header(key_digest: str, payload: memoryview | bytes, payload_digest: str | None = None) -> bytes:
    """The 96-byte header for ``payload`` stored under ``key_digest`` (hashes it unless given)."""
    hexdigest = payload_digest if payload_digest is not None else digest(payload)
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        0,
        bytes.fromhex(key_digest),
        memoryview(payload).nbytes,
        bytes.fromhex(hexdigest),
    )
    return head + blake3.blake3(head).digest()[:_CHECK_BYTES]


def encode_block(key_digest: str, payload: memoryview | bytes) -> bytes:
    """Header and payload as one ``bytes`` (tests and small blocks; the tiers write the two parts)."""
    return encode_header(key_digest, payload) + bytes(payload)


def parse_header(raw: bytes | bytearray | memoryview, where: str) -> BlockHeader:
    """Parse the first :data:`HEADER_SIZE` bytes of a block file; :class:`FormatError` naming ``where``."""
    head = bytes(raw[:HEADER_SIZE])
    if len(head) < HEADER_SIZE:
        raise FormatError(
            f"block file {where} is {len(head)} bytes, shorter than its {HEADER_SIZE}-byte header"
        )
    magic, version, size, _flags, key, length, payload_digest = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise FormatError(f"block file {where} does not start with the shoal KV magic (got {magic!r})")
    if version != VERSION or size != HEADER_SIZE:
        raise FormatError(
            f"block file {where} has format version {version} with a {size}-byte header; this shoal reads "
            f"version {VERSION} ({HEADER_SIZE} bytes): a newer shoal wrote it, or it is corrupt"
        )
    if blake3.blake3(head[: _HEAD.size]).digest()[:_CHECK_BYTES] != head[_HEAD.size :]:
        raise FormatError(f"block file {where}: its header check does not match (a corrupt header)")
    return BlockHeader(key_digest=key.hex(), length=length, payload_digest=payload_digest.hex())


def check_block(header: BlockHeader, key_digest: str, file_size: int | None, where: str) -> None:
    """Refuse a header for another key, or a file whose size is not header plus payload (torn)."""
    if header.key_digest != key_digest:
        raise FormatError(f"block file {where} holds block {header.key_digest}, not {key_digest}")
    if file_size is not None and file_size != header.file_size:
        raise FormatError(
            f"block file {where} is {file_size} bytes but its header says {header.file_size} "
            f"({HEADER_SIZE} + {header.length}): a torn or truncated write"
        )


def verify_payload(header: BlockHeader, payload: memoryview | bytes | bytearray, where: str) -> None:
    """Raise :class:`ChecksumMismatch` unless ``payload`` is the header's length and BLAKE3."""
    n = memoryview(payload).nbytes
    if n != header.length:
        raise ChecksumMismatch(f"block file {where}: payload is {n} bytes, the header says {header.length}")
    expect_digest(digest(payload), header.payload_digest, f"block file {where}", said_by="its header")


def decode_block(raw: bytes | bytearray | memoryview, key_digest: str, where: str) -> memoryview:
    """Parse and verify a whole block file read into memory; return a view of its payload."""
    return decode_block_verified(raw, key_digest, where)[0]


def decode_block_verified(
    raw: bytes | bytearray | memoryview, key_digest: str, where: str
) -> tuple[memoryview, str]:
    """:func:`decode_block`, with the BLAKE3 (hex) the payload was verified against."""
    view = memoryview(raw)
    header = parse_header(view, where)
    check_block(header, key_digest, view.nbytes, where)
    payload = view[HEADER_SIZE:]
    verify_payload(header, payload, where)
    return payload, header.payload_digest
