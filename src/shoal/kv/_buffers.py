"""Byte views of the buffers the store is given: bytes-likes, numpy arrays, CPU torch tensors."""

from __future__ import annotations

from typing import Any

from shoal.errors import ConfigError
from shoal.tiers.base import as_byte_view


def _torch_bytes(obj: Any, what: str) -> Any:
    """A CPU torch tensor as a flat uint8 numpy array sharing its memory (any dtype, bf16 too)."""
    import torch  # the caller has a tensor, so torch is imported already

    t = obj.detach()
    if t.device.type != "cpu":
        raise ConfigError(f"{what} is a torch tensor on {t.device}; the KV store takes CPU (host) memory")
    if not t.is_contiguous():
        raise ConfigError(f"{what} is a non-contiguous torch tensor; pass tensor.contiguous()")
    return t.reshape(-1).view(torch.uint8).numpy()


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _plain(view: memoryview, obj: Any, what: str) -> memoryview:
    """Refuse a buffer of Python objects: its bytes are pointers, and copying into them is unsafe."""
    if "O" in view.format:
        raise ConfigError(
            f"{what} ({type(obj).__name__}) holds Python objects (format {view.format!r}); the KV store "
            "takes buffers of plain bytes or numbers"
        )
    return view


def block_view(obj: Any, what: str) -> memoryview:
    """A flat byte view of a block to store (copied only if not contiguous)."""
    if _is_torch(obj):
        obj = _torch_bytes(obj, what)
    try:
        view = obj if isinstance(obj, memoryview) else memoryview(obj)
    except TypeError as e:
        raise ConfigError(f"{what} ({type(obj).__name__}) does not expose the buffer protocol: {e}") from e
    return as_byte_view(_plain(view, obj, what))


def writable_view(obj: Any, what: str) -> memoryview:
    """A flat, writable byte view of a buffer to read a block into (never a copy)."""
    if _is_torch(obj):
        obj = _torch_bytes(obj, what)
    try:
        view = obj if isinstance(obj, memoryview) else memoryview(obj)
    except TypeError as e:
        raise ConfigError(f"{what} ({type(obj).__name__}) does not expose the buffer protocol: {e}") from e
    _plain(view, obj, what)
    if view.readonly:
        raise ConfigError(f"{what} ({type(obj).__name__}) is read-only; pass a bytearray, array or tensor")
    if not view.c_contiguous:
        raise ConfigError(f"{what} is not C-contiguous; pass a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
