"""Block keys of the KV-cache store: (namespace, tensor-parallel rank, chained prefix hash).

A serving engine cuts a request's token sequence into fixed-size blocks and names each block by
the *whole prefix* up to and including it: :func:`chain_keys` hashes block ``i`` together with
the hash of block ``i - 1``, so two requests share a key exactly when they share every block up
to it. The namespace carries what makes the same tokens give different KV bytes (the model and
its KV layout: dtype, layers, heads, head dim, block size; :func:`namespace_for`), and the rank
which shard of the heads the bytes are.

:attr:`BlockKey.digest` (64 hex characters) names the block's file on every tier and is what the
block file's header records (:mod:`shoal.kv.blockfile`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import blake3

from shoal.errors import ConfigError, InvalidName

MAX_NAMESPACE = 256
HASH_BYTES = 32
_ROOT = b"shoal-kv-root"
_KEY_DOMAIN = b"shoal-kv-key\x00"
_U64 = struct.Struct("<Q")


def _lp(data: bytes) -> bytes:
    """``data`` length-prefixed (8 bytes, little-endian), so concatenations never collide."""
    return _U64.pack(len(data)) + data


def encode_block_id(block_id: int | bytes | str) -> bytes:
    """The unambiguous encoding of one block id: a type tag, then the length-prefixed value.

    ``7``, ``"7"`` and ``b"7"`` encode differently; ``bool`` is refused (it is an ``int`` by
    accident far more often than on purpose).
    """
    if isinstance(block_id, bool):
        raise ConfigError(f"block id {block_id!r} is a bool; pass an int, bytes or str")
    if isinstance(block_id, int):
        return b"i" + _lp(str(block_id).encode("ascii"))
    if isinstance(block_id, bytes | bytearray | memoryview):
        return b"b" + _lp(bytes(block_id))
    if isinstance(block_id, str):
        return b"s" + _lp(block_id.encode("utf-8"))
    raise ConfigError(f"block id {block_id!r} is a {type(block_id).__name__}; pass an int, bytes or str")


@dataclass(frozen=True, slots=True)
class BlockKey:
    """The key of one KV block; equal keys name equal bytes (the store deduplicates on them).

    Built by :func:`chain_keys` (normally) or directly; the fields are validated here, and
    :attr:`digest` is computed once.
    """

    namespace: str
    tp_rank: int
    prefix_hash: bytes
    digest: str = field(init=False, repr=False, compare=False)
    """64 hex characters: BLAKE3 over the length-prefixed fields; the block's file name."""

    def __post_init__(self) -> None:
        ns = self.namespace
        if not isinstance(ns, str) or not ns or len(ns) > MAX_NAMESPACE or not ns.isprintable():
            raise InvalidName(
                f"BlockKey.namespace must be a non-empty printable string of at most {MAX_NAMESPACE} "
                f"characters (e.g. namespace_for(model, kv_layout)), got {ns!r}"
            )
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or self.tp_rank < 0:
            raise ConfigError(f"BlockKey.tp_rank must be an int >= 0, got {self.tp_rank!r}")
        ph = self.prefix_hash
        if not isinstance(ph, bytes) or len(ph) != HASH_BYTES:
            got = f"{len(ph)} bytes" if isinstance(ph, bytes) else type(ph).__name__
            raise ConfigError(
                f"BlockKey.prefix_hash must be exactly {HASH_BYTES} bytes (a BLAKE3 digest), got {got}"
            )
        h = blake3.blake3(_KEY_DOMAIN)
        h.update(_lp(ns.encode("utf-8")))
        h.update(_lp(_U64.pack(self.tp_rank)))
        h.update(_lp(ph))
        object.__setattr__(self, "digest", h.hexdigest())

    def __repr__(self) -> str:
        return f"BlockKey({self.namespace!r}, {self.tp_rank}, {self.prefix_hash.hex()[:16]}...)"


def chain_hashes(block_ids: Sequence[int | bytes | str]) -> list[bytes]:
    """The prefix-chained hashes: ``h0 = H(root || enc(id0))``, ``h_i = H(h_{i-1} || enc(id_i))``."""
    out: list[bytes] = []
    prev = _ROOT
    for block_id in block_ids:
        prev = blake3.blake3(prev + encode_block_id(block_id)).digest()
        out.append(prev)
    return out


def chain_keys(namespace: str, tp_rank: int, block_ids: Sequence[int | bytes | str]) -> list[BlockKey]:
    """One key per block of a sequence, each naming the whole prefix up to it (module docstring)."""
    return [BlockKey(namespace, tp_rank, h) for h in chain_hashes(block_ids)]


def namespace_for(model: str, kv_layout: str) -> str:
    """``"<model>/<kv_layout>"``, e.g. ``namespace_for("qwen2.5-14b", "bf16-L48-H8-D128-B512")``."""
    for what, value in (("model", model), ("kv_layout", kv_layout)):
        if not isinstance(value, str) or not value or "/" in value or not value.isprintable():
            raise InvalidName(
                f"namespace_for: {what} must be a non-empty printable string without '/', got {value!r}"
            )
    return f"{model}/{kv_layout}"
