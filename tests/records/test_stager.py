"""The stager's fused copy: every item's bytes in the slab exactly as a copy of each item on its own."""

from __future__ import annotations

import pytest
import torch

from shoal.errors import UnsupportedValue
from shoal.records import stager
from shoal.records.stager import Slot, StageEntry, stage_into


class _Slab:
    def __init__(self, nbytes: int) -> None:
        self._buf = bytearray(nbytes)
        self.capacity = nbytes

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._buf)

    def ensure(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            self._buf.extend(bytes(nbytes - self.capacity))
            self.capacity = nbytes


class _Dram:
    def open_slab(self, name: str, nbytes: int, *, exclusive: bool = False) -> _Slab:
        return _Slab(nbytes)


def _expected(entries: list[StageEntry]) -> bytes:
    """The slab as the per-item path lays it out: each tensor's C-order bytes at its offset."""
    offsets, total = stager.layout(entries)
    out = bytearray(total)
    for e, off in zip(entries, offsets, strict=True):
        p = e.payload
        if isinstance(p, torch.Tensor):
            raw = p.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
            data = raw.numpy().tobytes()
        else:
            data = bytes(memoryview(p).cast("B"))
        out[off : off + len(data)] = data
    return bytes(out)


def _state() -> list[StageEntry]:
    g = torch.Generator().manual_seed(5)
    nan = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float32)
    nan.view(torch.int32)[0] = 0x7FC00123  # a NaN with a payload: bit-exact, not just equal
    base = torch.randn(6, 10, generator=g)
    complex_ = torch.randn(4, dtype=torch.complex64, generator=g)
    values = {
        "a": torch.randn(256, generator=g),
        "b": torch.randn(3, 5, generator=g),  # 60 bytes: followed by an alignment gap
        "nan": nan,
        "transposed": base.t(),  # not contiguous
        "strided": base[::2, 1::3],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),
        "bool": torch.tensor([True, False, True]),
        "f64": torch.randn(5, dtype=torch.float64, generator=g),
        "c64": complex_,
        "conj": complex_.conj(),  # a lazy conjugate: copied on its own, resolved
        "neg": torch.randn(3, generator=g).to(torch.complex64).conj().imag,  # a negative view
        "grad": torch.randn(9, generator=g, requires_grad=True),
        "i64": torch.arange(12).reshape(3, 4),
    }
    entries = [StageEntry(k, v) for k, v in values.items()]
    entries.insert(3, StageEntry("bytes", b"\x01\x02\x03"))
    entries.append(StageEntry("tail", bytearray(b"xyz" * 30)))
    return entries


def test_the_fused_copy_lays_out_every_item_as_the_per_item_copy() -> None:
    entries = _state()
    slot = Slot(0, "s")
    staged = stage_into(slot, _Dram(), entries, rank=0)
    assert slot.slab is not None
    _, total = stager.layout(entries)
    assert bytes(slot.slab.buffer[:total]) == _expected(entries)
    for item, e in zip(staged, entries, strict=True):
        if isinstance(e.payload, torch.Tensor):
            if item.nbytes:
                back = torch.frombuffer(bytearray(slot.view(item)), dtype=e.payload.dtype)
                want = e.payload.detach().resolve_conj().resolve_neg().reshape(-1)
                assert torch.equal(back.view(torch.uint8), want.contiguous().view(torch.uint8))
            assert item.shape == tuple(e.payload.shape) and item.dtype == stager.dtype_name(e.payload.dtype)


def test_the_runs_are_split_by_dtype_and_fused_within(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[list[str]] = []
    single: list[str] = []
    real_run, real_one = stager._copy_run, stager._copy_tensor

    def record_run(buffer: memoryview, start: int, run: list[tuple[int, int, torch.Tensor]]) -> None:
        runs.append([str(t.dtype) for _, _, t in run])
        real_run(buffer, start, run)

    def record_one(buffer: memoryview, offset: int, tensor: torch.Tensor) -> None:
        single.append(str(tensor.dtype))
        real_one(buffer, offset, tensor)

    monkeypatch.setattr(stager, "_copy_run", record_run)
    monkeypatch.setattr(stager, "_copy_tensor", record_one)
    f, h = torch.ones(4), torch.ones(4, dtype=torch.float16)
    entries = [StageEntry(k, v) for k, v in [("a", f), ("b", f * 2), ("c", h), ("d", h), ("e", f)]]
    entries.append(StageEntry("z", torch.ones(2, dtype=torch.complex64).conj()))
    slot = Slot(0, "s")
    stage_into(slot, _Dram(), entries, rank=0)
    assert runs == [["torch.float32"] * 2, ["torch.float16"] * 2, ["torch.float32"]]
    assert single == ["torch.complex64"]
    assert slot.slab is not None
    _, total = stager.layout(entries)
    assert bytes(slot.slab.buffer[:total]) == _expected(entries)


def test_a_sparse_tensor_is_refused_before_any_copy() -> None:
    entries = [StageEntry("a", torch.ones(3)), StageEntry("s", torch.eye(3).to_sparse())]
    slot = Slot(0, "s")
    with pytest.raises(UnsupportedValue, match="'s'"):
        stage_into(slot, _Dram(), entries, rank=0)
