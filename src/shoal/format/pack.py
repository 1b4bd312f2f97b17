"""Packs: many chunk payloads back to back in one file, with a JSON index.

The index (``packs/<id>.idx``) lists ``[digest, offset, length]`` for every chunk
and the BLAKE3 digest of the whole pack, so a pack can be verified and
garbage-collected without any manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shoal.errors import FormatError
from shoal.format.names import check_digest, check_identifier
from shoal.format.strict_json import load_json

INDEX_FORMAT = "shoal-pack/1"


@dataclass(frozen=True)
class PackEntry:
    digest: str
    offset: int
    length: int


@dataclass(frozen=True)
class PackIndex:
    pack_id: str
    size: int
    blake3: str
    entries: tuple[PackEntry, ...]

    def encode(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT,
            "pack": self.pack_id,
            "size": self.size,
            "blake3": self.blake3,
            "chunks": [[e.digest, e.offset, e.length] for e in self.entries],
        }
        return json.dumps(doc, separators=(",", ":")).encode()


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FormatError(f"{where}: expected a non-negative int, got {value!r}")
    return value


def decode_index(data: bytes, where: str) -> PackIndex:
    """Parse and validate a pack index; ``where`` names the file in errors.

    Read it with ``tier.read_small(path, layout.MAX_INDEX_BYTES, "pack index")``: an index is
    never trusted to be small.
    """
    doc = load_json(data, f"pack index {where}")
    if not isinstance(doc, dict):
        raise FormatError(f"pack index {where}: expected a JSON object, got {type(doc).__name__}")
    fmt = doc.get("format")
    if fmt != INDEX_FORMAT:
        raise FormatError(f"pack index {where}: format is {fmt!r}, this shoal reads {INDEX_FORMAT!r}")
    try:
        pack_id = check_identifier(doc.get("pack"), "pack id")
        pack_digest = check_digest(doc.get("blake3"), "pack digest")
    except ValueError as e:
        raise FormatError(f"pack index {where}: {e}") from e
    size = _int(doc.get("size"), f"pack index {where}: size")
    chunks = doc.get("chunks")
    if not isinstance(chunks, list):
        raise FormatError(f"pack index {where}: 'chunks' must be a list")
    entries = []
    for i, row in enumerate(chunks):
        at = f"pack index {where}: chunks[{i}]"
        if not isinstance(row, list) or len(row) != 3:
            raise FormatError(f"{at}: expected [digest, offset, length], got {row!r}")
        try:
            d = check_digest(row[0], "digest")
        except ValueError as e:
            raise FormatError(f"{at}: {e}") from e
        off, length = _int(row[1], f"{at}.offset"), _int(row[2], f"{at}.length")
        if off + length > size:
            raise FormatError(f"{at}: bytes {off}..{off + length} lie past the pack's size {size}")
        entries.append(PackEntry(d, off, length))
    return PackIndex(pack_id, size, pack_digest, tuple(entries))
