"""The Mooncake-style facade: Mooncake Store's method names and return conventions."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shoal.kv import KVConfig, KVStore
from shoal.kv.mooncake import BUFFER_TOO_SMALL, INVALID_PARAMS, NOT_FOUND, MooncakeStore

from .kv_workers import PHYS


@pytest.fixture
def mc(shm_path: Path) -> Iterator[MooncakeStore]:
    facade = MooncakeStore(KVStore(KVConfig(str(shm_path / "pool"), 64 * PHYS)), namespace="llm/bf16")
    yield facade
    facade.close()


def test_put_get_is_exist_remove(mc: MooncakeStore) -> None:
    assert mc.is_exist("hello") == 0
    assert mc.get("hello") == b""  # a miss is empty bytes, as Mooncake answers
    assert mc.put("hello", b"Hello, shoal!") == 0
    assert mc.put("hello", b"Hello, shoal!") == 0  # again: already there is success
    assert mc.is_exist("hello") == 1 and mc.batch_is_exist(["hello", "nope"]) == [1, 0]
    assert mc.get("hello") == b"Hello, shoal!"
    assert mc.remove("hello") == 0
    assert mc.remove("hello") == NOT_FOUND
    assert mc.get("hello") == b""


def test_batch_put_from_and_batch_get_into_with_numpy_buffers(mc: MooncakeStore) -> None:
    values = [np.random.default_rng(i).integers(0, 255, 5000, dtype=np.uint8) for i in range(3)]
    assert mc.batch_put_from(["a", "b", "c"], values, [v.nbytes for v in values]) == [0, 0, 0]
    outs = [np.zeros(8192, dtype=np.uint8) for _ in range(4)]  # larger than the values, as Mooncake allows
    codes = mc.batch_get_into(["a", "b", "c", "missing"], outs, [8192] * 4)
    assert codes == [5000, 5000, 5000, NOT_FOUND]
    assert all(np.array_equal(outs[i][:5000], values[i]) for i in range(3))


def test_a_buffer_smaller_than_the_value_is_refused(mc: MooncakeStore) -> None:
    mc.put("big", b"x" * 1000)
    small = bytearray(100)
    assert mc.get_into("big", small, 100) == BUFFER_TOO_SMALL
    assert small == bytearray(100)


def test_raw_addresses_like_mooncakes_registered_buffers(mc: MooncakeStore) -> None:
    src = (ctypes.c_ubyte * 64)(*range(64))
    assert mc.put_from("raw", ctypes.addressof(src), 64) == 0
    dst = (ctypes.c_ubyte * 64)()
    assert mc.get_into("raw", ctypes.addressof(dst), 64) == 64
    assert bytes(dst) == bytes(range(64))


def test_bad_parameters_are_negative_codes(mc: MooncakeStore) -> None:
    assert mc.batch_put_from(["a", "b"], [b"x"], [1]) == [INVALID_PARAMS, INVALID_PARAMS]
    assert mc.batch_put_from(["a"], [b"xy"], [5]) == [INVALID_PARAMS]  # size past the buffer
    assert mc.batch_get_into(["a"], [b"read-only"], [9]) == [INVALID_PARAMS]


def test_string_keys_are_scoped_by_namespace_and_rank(shm_path: Path) -> None:
    store = KVStore(KVConfig(str(shm_path / "pool"), 64 * PHYS))
    rank0, rank1 = MooncakeStore(store, "llm/bf16", 0), MooncakeStore(store, "llm/bf16", 1)
    rank0.put("k", b"rank zero")
    assert rank1.is_exist("k") == 0 and rank0.get("k") == b"rank zero"
    assert rank0.key("k") == MooncakeStore(store, "llm/bf16", 0).key("k")
    store.close()
