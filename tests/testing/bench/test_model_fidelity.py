"""The fidelity sweep's pure helpers (shoal.testing.bench.model_fidelity): pack sizes and record selection.

The sweep itself runs on the emulated cluster (``benchmarks/model_fidelity.py``), not here.
"""

from __future__ import annotations

import pytest

from shoal.records.events import Event, WriterRecord
from shoal.records.packwriter import drain_parts
from shoal.testing.bench.model_fidelity import CHUNK, pack_bytes_for, pack_records


@pytest.mark.parametrize(("share", "streams"), [(4 << 20, 1), (4 << 20, 4), (2 << 20, 2), (1 << 20, 8)])
def test_a_share_goes_out_as_exactly_streams_packs(share: int, streams: int) -> None:
    lengths = [CHUNK] * (share // CHUNK)
    parts = drain_parts(lengths, pack_bytes=pack_bytes_for(share, streams))
    assert len(parts) == streams
    assert {sum(lengths[lo:hi]) for lo, hi in parts} == {share // streams}


def test_a_share_too_small_for_its_streams_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot make"):
        pack_bytes_for(CHUNK, 2)


def _write(rank: int, step: int, what: str = "pack", tier: str = "shared") -> WriterRecord:
    fields = {"tier": tier, "what": what, "path": "p", "bytes": 100, "start": 1.0, "end": 2.5}
    return WriterRecord(
        1, "write", step, "h0", rank, 0.0, 0.0, fields, "log:1",
        tier, what, "p", 100, 1.0, 2.5, 1.5, 4, 2, "direct",
    )  # fmt: skip


def test_only_this_ranks_drain_packs_of_the_timed_steps_come_back() -> None:
    events = [
        _write(0, 1),
        _write(1, 1),  # another rank's
        _write(0, 0),  # the warm-up
        _write(0, 2, what="manifest"),
        _write(0, 2, tier="local"),
        Event(1, "checkpoint", 2, "h0", 0, 0.0, 0.0, {}, "log:2"),
        _write(0, 2),
    ]
    got = pack_records(events, 0, range(1, 3))
    assert [r["step"] for r in got] == [1, 2]
    assert got[0] == {
        "step": 1, "rank": 0, "host": "h0", "bytes": 100, "start": 1.0, "end": 2.5,
        "concurrency": 4, "host_concurrency": 2,
    }  # fmt: skip
