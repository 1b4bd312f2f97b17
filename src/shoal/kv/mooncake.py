"""``MooncakeStore``: the KV store behind the method names a Mooncake Store user knows.

=====================================  ==========================================================
Mooncake (``MooncakeDistributedStore``)  shoal (``KVStore``)
=====================================  ==========================================================
``put(key, value) -> int``             ``put_batch([k], [value])``; 0, or a negative code
``get(key) -> bytes``                  ``block_size`` + ``get_batch_into``; ``b""`` on a miss
``put_from(key, ptr, size)``           ``put_batch`` from a buffer (or a raw address)
``get_into(key, ptr, size)``           ``get_batch_into``; bytes read, or a negative code
``batch_put_from(keys, bufs, sizes)``  ``put_batch``; one code per key
``batch_get_into(keys, bufs, sizes)``  ``get_batch_into``; bytes read or a negative code per key
``is_exist(key) -> int``               ``contains``; 1 or 0
``batch_is_exist(keys)``               ``contains`` per key
``remove(key) -> int``                 ``remove([k])``; 0, or :data:`NOT_FOUND`
=====================================  ==========================================================

String keys map to ``BlockKey(namespace, tp_rank, blake3(key))`` with the facade's namespace and
rank, so the same string names the same block in every process of the host. Buffers are
anything with the buffer protocol, or (as in Mooncake) an integer address of ``size`` bytes that
the caller keeps alive; a buffer may be larger than the block (Mooncake's ``size >= object
size``), the bytes read are returned. A key's value is immutable, as KV blocks are: a second
``put`` of a key that is stored is a success that changes nothing (``remove`` it first to
replace it), where Mooncake would overwrite. Codes are shoal's: :data:`NOT_FOUND` (a miss, including a
deadline expiry), :data:`INVALID_PARAMS`, :data:`BUFFER_TOO_SMALL`, :data:`INTERNAL_ERROR`.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from typing import Any

import blake3

from shoal.errors import ConfigError
from shoal.kv._buffers import block_view, writable_view
from shoal.kv.keys import BlockKey
from shoal.kv.store import BlockSizeError, GetResult, KVStore

log = logging.getLogger(__name__)

OK = 0
INTERNAL_ERROR = -1
BUFFER_TOO_SMALL = -10
INVALID_PARAMS = -600
NOT_FOUND = -704


def _view(buffer: Any, size: int | None, *, writable: bool, what: str) -> memoryview:
    """A byte view of ``size`` bytes of ``buffer`` (an object, or an integer address)."""
    if isinstance(buffer, int) and not isinstance(buffer, bool):
        if size is None or size < 0 or buffer == 0:
            raise ConfigError(f"{what}: a raw address needs a non-negative size, got {size!r} at {buffer:#x}")
        return memoryview((ctypes.c_char * size).from_address(buffer)).cast("B")
    view = writable_view(buffer, what) if writable else block_view(buffer, what)
    if size is not None:
        if size < 0 or size > view.nbytes:
            raise ConfigError(f"{what}: size {size} does not fit its {view.nbytes}-byte buffer")
        view = view[:size]
    return view


class MooncakeStore:
    """Mooncake Store's method names over a :class:`~shoal.kv.store.KVStore` (module docstring).

    ``deadline_s``: every read gives up after this many seconds (a miss), None waits for the tiers.
    """

    def __init__(
        self,
        store: KVStore,
        namespace: str = "mooncake",
        tp_rank: int = 0,
        *,
        deadline_s: float | None = None,
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.tp_rank = tp_rank
        self.deadline_s = deadline_s
        self.key("probe")  # validates namespace and rank now

    def key(self, key: str) -> BlockKey:
        """The block key a string key names."""
        if not isinstance(key, str) or not key:
            raise ConfigError(f"a Mooncake key must be a non-empty string, got {key!r}")
        return BlockKey(self.namespace, self.tp_rank, blake3.blake3(key.encode("utf-8")).digest())

    def _deadline(self) -> float | None:
        return None if self.deadline_s is None else time.monotonic() + self.deadline_s

    # -- puts -------------------------------------------------------------------------------

    def put(self, key: str, value: Any) -> int:
        """Store ``value`` (bytes or any buffer) under ``key``; 0, or a negative code."""
        return self.batch_put_from([key], [value], None)[0]

    def put_from(self, key: str, buffer: Any, size: int) -> int:
        """Store ``size`` bytes of ``buffer`` (an object or an address) under ``key``."""
        return self.batch_put_from([key], [buffer], [size])[0]

    def batch_put_from(
        self, keys: Sequence[str], buffers: Sequence[Any], sizes: Sequence[int] | None
    ) -> list[int]:
        """Store each buffer's first ``sizes[i]`` bytes under ``keys[i]``; a code per key (0: stored
        now or already there)."""
        if len(keys) != len(buffers) or (sizes is not None and len(sizes) != len(keys)):
            return [INVALID_PARAMS] * len(keys)
        codes = [OK] * len(keys)
        todo: list[int] = []
        block_keys, views = [], []
        for i, (name, buf) in enumerate(zip(keys, buffers, strict=True)):
            try:
                block_key = self.key(name)
                view = _view(buf, sizes[i] if sizes is not None else None, writable=False, what=name)
            except ConfigError as e:
                log.warning("MooncakeStore: put of %r refused: %s", name, e)
                codes[i] = INVALID_PARAMS
                continue
            block_keys.append(block_key)
            views.append(view)
            todo.append(i)
        for i, result in zip(todo, self.store.put_batch(block_keys, views), strict=True):
            if result.error is not None:
                codes[i] = INTERNAL_ERROR
        return codes

    # -- gets -------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value stored under ``key``, or ``b""`` on a miss (as Mooncake answers)."""
        block_key = self.key(key)
        size = self.store.block_size(block_key)
        if size is None:
            return b""
        out = bytearray(size)
        result = self.store.get_batch_into([block_key], [out], deadline=self._deadline())[0]
        return bytes(out) if result.hit else b""

    def get_into(self, key: str, buffer: Any, size: int) -> int:
        """Read ``key``'s value into ``buffer`` (at most ``size`` bytes); bytes read or a negative code."""
        return self.batch_get_into([key], [buffer], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any], sizes: Sequence[int]) -> list[int]:
        """Read each key's value into its buffer (``sizes[i]`` >= the value's size); per key the bytes
        read, or :data:`NOT_FOUND`, :data:`BUFFER_TOO_SMALL`, :data:`INVALID_PARAMS`,
        :data:`INTERNAL_ERROR`."""
        if len(keys) != len(buffers) or len(sizes) != len(keys):
            return [INVALID_PARAMS] * len(keys)
        codes = [INVALID_PARAMS] * len(keys)
        views: dict[int, memoryview] = {}
        block_keys: dict[int, BlockKey] = {}
        for i, (name, buf, size) in enumerate(zip(keys, buffers, sizes, strict=True)):
            try:
                block_keys[i] = self.key(name)
                views[i] = _view(buf, size, writable=True, what=name)
            except ConfigError as e:
                log.warning("MooncakeStore: get of %r refused: %s", name, e)
                block_keys.pop(i, None)
        deadline = self._deadline()
        retry: dict[int, memoryview] = {}
        for i, result in self._get(block_keys, views, deadline).items():
            error = result.error
            if isinstance(error, BlockSizeError) and error.block_bytes is not None:
                if error.block_bytes > views[i].nbytes:
                    codes[i] = BUFFER_TOO_SMALL
                else:  # a larger buffer than the block, as Mooncake allows: read into its front
                    retry[i] = views[i][: error.block_bytes]
                continue
            codes[i] = _code(result)
        for i, result in self._get(block_keys, retry, deadline).items():
            codes[i] = _code(result)
        return codes

    def _get(
        self, block_keys: dict[int, BlockKey], views: dict[int, memoryview], deadline: float | None
    ) -> dict[int, GetResult]:
        order = list(views)
        if not order:
            return {}
        found = self.store.get_batch_into(
            [block_keys[i] for i in order], [views[i] for i in order], deadline=deadline
        )
        return dict(zip(order, found, strict=True))

    # -- membership -------------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 if some tier holds ``key``'s value, else 0."""
        return 1 if self.store.contains(self.key(key)) is not None else 0

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [self.is_exist(k) for k in keys]

    def remove(self, key: str) -> int:
        """Remove ``key``'s value from every tier; 0, or :data:`NOT_FOUND` if none held it."""
        return OK if self.store.remove([self.key(key)]) else NOT_FOUND

    def close(self) -> None:
        """Close the underlying store."""
        self.store.close()


def _code(result: GetResult) -> int:
    if result.hit:
        return result.nbytes
    if result.status == "miss":
        return NOT_FOUND
    return INTERNAL_ERROR
