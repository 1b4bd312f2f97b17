"""Helpers for tests of checkpoints: configs on temporary roots, rich states, bit-exact comparison."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch

from shoal.config import Config
from shoal.format import layout
from shoal.tiers.base import Tier

SMALL_CHUNK = 64 << 10
"""Chunk size for tests: small enough that modest tensors span several chunks."""


def make_config(root: str | os.PathLike[str], dram_root: str | os.PathLike[str], **overrides: Any) -> Config:
    """A Config whose shared, local and DRAM roots are private to one test (host ``h0``, 64 KiB chunks)."""
    kwargs: dict[str, Any] = {
        "shared": os.path.join(root, "shared"),
        "local": os.path.join(root, "local"),
        "dram": str(dram_root),
        "job": "test",
        "host_id": "h0",
        "chunk_size": SMALL_CHUNK,
        "keep_last": None,
    }
    kwargs.update(overrides)
    return Config(**kwargs)


def float8_dtypes() -> list[torch.dtype]:
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def rich_state(seed: int = 0) -> dict[str, Any]:
    """A state dict with every dtype; 0-d, empty, non-contiguous and multi-chunk tensors; nesting; objects."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g)
    tensors: dict[str, torch.Tensor] = {
        "f32": base,
        "f64": base.double(),
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i8": torch.randint(-128, 127, (33,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (7, 5), dtype=torch.uint8, generator=g),
        "i16": torch.randint(-1000, 1000, (10,), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (10,), dtype=torch.int32, generator=g),
        "i64": torch.randint(-(2**62), 2**62, (10,), dtype=torch.int64, generator=g),
        "bool": torch.rand(17, generator=g) > 0.5,
        "c64": torch.randn(6, 2, dtype=torch.complex64, generator=g),
        "c128": torch.randn(3, dtype=torch.complex128, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "multi_chunk": torch.randn(3 * SMALL_CHUNK // 4 + 123, generator=g),
        "nan_payload": torch.tensor([float("nan"), float("-inf"), -0.0]),
    }
    for dt in float8_dtypes():
        tensors[str(dt).removeprefix("torch.")] = base[:4].clamp(-2, 2).to(dt)
    return {
        "model": tensors,
        "optim": {"state": {"0": {"exp_avg": base * 0.5, "step": torch.tensor(12)}}, "lr": 3e-4},
        "nested": {"deeper": {"list_obj": [1, 2, "three"], "t": torch.arange(5)}},
        "epoch": 4,
        "name": "run-42",
    }


def zeros_like_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The same structure with every tensor zeroed (fresh, contiguous) and every object replaced by None."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, Mapping):
            out[k] = zeros_like_state(v)
        else:
            out[k] = None
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so NaNs and -0.0 compare bitwise)."""
    c = t.detach().contiguous().cpu()
    return c.view(torch.uint8) if c.numel() and c.dim() else c.reshape(-1).view(torch.uint8)


def assert_state_equal(actual: Mapping[str, Any], expected: Mapping[str, Any], path: str = "") -> None:
    """Bit-exact comparison of two state dicts: dtype, shape and every byte of every tensor."""
    assert set(actual) == set(expected), f"{path or 'state'}: keys {sorted(actual)} != {sorted(expected)}"
    for k, e in expected.items():
        a, where = actual[k], f"{path}{k}"
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{where}: expected a tensor, got {type(a).__name__}"
            assert a.dtype == e.dtype and a.shape == e.shape, (
                f"{where}: {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
            )
            assert torch.equal(bits(a), bits(e)), f"{where}: bytes differ"
        elif isinstance(e, Mapping):
            assert_state_equal(a, e, where + ".")
        else:
            assert a == e, f"{where}: {a!r} != {e!r}"


def assert_identical(actual: Any, expected: Any, where: str = "", *, ordered: bool = True) -> None:
    """``actual`` is ``expected`` rebuilt: type by type (a tuple is no list, a bool no int) and bit
    by bit (tensors and numpy arrays: dtype, shape and bytes; floats: ``-0.0`` is not ``0.0``, nan
    is nan); dict keys compared as values too, and in order unless ``ordered=False``. The message
    names the place (``where``/key/index)."""
    import numpy as np

    assert type(actual) is type(expected), f"{where or 'value'}: {type(actual)} is not {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), (
            f"{where}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
        )
        if not torch.equal(bits(actual), bits(expected)):
            raise AssertionError(f"{where}: tensors differ")
    elif isinstance(expected, np.ndarray):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        assert actual.tobytes() == expected.tobytes(), f"{where}: arrays differ"
    elif isinstance(expected, dict):
        keys, want = list(actual), list(expected)
        assert (keys == want) if ordered else (set(keys) == set(want)), f"{where}: keys {keys} != {want}"
        for k in want:
            match = next(a for a in keys if a == k)
            assert_identical(match, k, f"{where} key {k!r}")
            assert_identical(actual[k], expected[k], f"{where}/{k}", ordered=ordered)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{where}: {len(actual)} items != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a, e, f"{where}/{i}", ordered=ordered)
    elif isinstance(expected, float):
        if math.isnan(expected):
            same = math.isnan(actual)
        else:
            same = struct.pack("<d", actual) == struct.pack("<d", expected)
        assert same, f"{where}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def pack_bytes_on(tier: Tier) -> int:
    """Total size of every pack file on ``tier`` (chunk payload written)."""
    return sum(tier.info(p).size for p in tier.list(layout.PACKS_DIR + "/") if p.endswith(".pack"))


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0x40) -> None:
    """Corrupt one byte of a file in place (a bit flip on disk or in memory)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
