"""The one pack listing and the step summaries retention keeps between passes (no decode when unchanged)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from shoal.engine.retention import run_retention
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import ChunkLocation, Manifest, PackRecord, Pointer
from shoal.records.catalog import ChunkCatalog, pack_problems
from shoal.records.packlist import StepSummaries, StepSummary, list_packs
from shoal.records.retention import pack_ids_on
from shoal.tiers import open_tier
from shoal.tiers.base import Tier

from .retention_helpers import bare_manifest, pack_id


def _shared(tmp_path: Path) -> Tier:
    return open_tier("shared", str(tmp_path / "shared" / "job"))


def _commit(tier: Tier, manifest: Manifest) -> str:
    """Write ``manifest``'s packs (10 bytes each), the manifest, its commit record and LATEST; its digest."""
    for pid in manifest.packs:
        tier.write(layout.pack_path(pid), b"x" * 10)
        tier.write(layout.index_path(pid), b"[]")
    data = manifest.encode()
    tier.write(layout.manifest_path(manifest.step), data)
    pointer = Pointer(manifest.step, digest(data)).encode()
    tier.write(layout.commit_path(manifest.step), pointer)
    tier.write(layout.LATEST, pointer)
    return digest(data)


def _rewrite_later(tier: Tier, tmp_path: Path, step: int, manifest: Manifest) -> None:
    """Replace step's manifest (and commit record) by ``manifest``, with a newer mtime."""
    _commit(tier, manifest)
    path = tmp_path / "shared" / "job" / layout.manifest_path(step)
    later = time.time() + 5
    os.utime(path, (later, later))


# --- the one pack listing ----------------------------------------------------------------------------


def test_list_packs_tells_packs_from_indexes_and_skips_subdirectories(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    tier.write(layout.pack_path(pack_id(1)), b"p")
    tier.write(layout.index_path(pack_id(1)), b"[]")
    tier.write(layout.pack_path(pack_id(2)), b"p")  # no index
    tier.write(layout.index_path(pack_id(3)), b"[]")  # an orphan index
    tier.write(f"{layout.PACKS_DIR}/sub/{pack_id(4)}.pack", b"p")
    tier.write(f"{layout.PACKS_DIR}/notes.txt", b"n")
    listing = list_packs(tier)
    assert listing.packs == {pack_id(1), pack_id(2)}
    assert listing.indexes == {pack_id(1), pack_id(3)}
    assert pack_ids_on(tier) == [pack_id(1), pack_id(2), pack_id(3)]
    records = {p: PackRecord(1, "0" * 64) for p in (pack_id(1), pack_id(2), pack_id(3))}
    problems = pack_problems(tier, records)
    assert set(problems) == {pack_id(2), pack_id(3)}
    assert "index" in problems[pack_id(2)] and "missing" in problems[pack_id(3)]


# --- step summaries ------------------------------------------------------------------------------


def test_an_unchanged_manifest_is_decoded_once(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    for step in (1, 2, 3):
        _commit(tier, bare_manifest(step, [pack_id(step)]))
    summaries = StepSummaries()
    first = summaries.list(tier)
    assert summaries.decoded == 3
    again = summaries.list(tier)
    assert summaries.decoded == 3
    assert first == again
    assert [(s.step, s.committed, s.summary and s.summary.packs) for s in again] == [
        (s, True, frozenset({pack_id(s)})) for s in (1, 2, 3)
    ]


def test_a_changed_manifest_is_decoded_again(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    _commit(tier, bare_manifest(1, [pack_id(1)]))
    summaries = StepSummaries()
    summaries.list(tier)
    # Another writer's manifest for the same step, referencing another pack (same length of id).
    _rewrite_later(tier, tmp_path, 1, bare_manifest(1, [pack_id(1, 7)], writer="b" * 16))
    (state,) = summaries.list(tier)
    assert summaries.decoded == 2
    assert state.summary == StepSummary(1, "b" * 16, frozenset({pack_id(1, 7)}))


def test_a_manifest_no_longer_matching_its_commit_record_is_damaged_not_cached(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    _commit(tier, bare_manifest(1, [pack_id(1)]))
    summaries = StepSummaries()
    summaries.list(tier)
    data = bare_manifest(1, [pack_id(1, 9)]).encode()
    tier.write(layout.manifest_path(1), data)  # the commit record still names the old digest
    for _ in range(2):
        (state,) = summaries.list(tier)
        assert state.summary is None and state.problem is not None and "digest" in state.problem
    assert summaries.decoded == 1  # the damaged manifest was read each time, never kept


def test_a_new_commit_record_over_the_same_manifest_is_looked_at_again(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    _commit(tier, bare_manifest(1, [pack_id(1)]))
    summaries = StepSummaries()
    summaries.list(tier)
    tier.write(layout.commit_path(1), Pointer(1, "0" * 64).encode())
    (state,) = summaries.list(tier)
    assert state.summary is None and state.problem is not None


def test_steps_gone_from_the_tier_are_forgotten(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    for step in (1, 2):
        _commit(tier, bare_manifest(step, [pack_id(step)]))
    summaries = StepSummaries()
    summaries.list(tier)
    tier.delete(layout.commit_path(1))
    tier.delete(layout.manifest_path(1))
    assert [s.step for s in summaries.list(tier)] == [2]
    _commit(tier, bare_manifest(1, [pack_id(1)]))  # back again: decoded again, not taken from memory
    summaries.list(tier)
    assert summaries.decoded == 3


def test_prime_records_what_this_process_wrote_when_the_bytes_match(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    m = bare_manifest(1, [pack_id(1)])
    d = _commit(tier, m)
    summaries = StepSummaries()
    assert summaries.prime(tier, StepSummary.of(m), d)
    (state,) = summaries.list(tier)
    assert summaries.decoded == 0
    assert state.summary == StepSummary(1, None, frozenset({pack_id(1)}))


@pytest.mark.parametrize("what", ["given digest", "commit record"])
def test_prime_refuses_bytes_that_are_not_the_ones_written(tmp_path: Path, what: str) -> None:
    tier = _shared(tmp_path)
    m = bare_manifest(1, [pack_id(1)])
    d = _commit(tier, m)
    if what == "given digest":
        written = "f" * 64  # the writer wrote other bytes than the tier holds
    else:
        written = d
        tier.write(layout.commit_path(1), Pointer(1, "0" * 64).encode())
    summaries = StepSummaries()
    assert not summaries.prime(tier, StepSummary.of(m), written)
    summaries.list(tier)
    assert summaries.decoded == (1 if what == "given digest" else 0)  # a bad commit: damaged, not decoded


def test_prime_refuses_a_step_that_is_not_there(tmp_path: Path) -> None:
    assert not StepSummaries().prime(_shared(tmp_path), StepSummary(4, None, frozenset()))


def test_summary_holds_the_packs_of_every_chunk_location_too() -> None:
    m = bare_manifest(3, [pack_id(3)])
    m = dataclasses.replace(m, locations={"d" * 64: ChunkLocation(pack_id(2), 0, 1)})
    assert StepSummary.of(m).packs == {pack_id(2), pack_id(3)}


def test_catalog_remembers_the_newest_steps_added() -> None:
    cat = ChunkCatalog()
    for step in range(1, 12):
        cat.add_manifest(bare_manifest(step, [pack_id(step)]), manifest_digest=f"{step:064x}")
    assert sorted(cat.recent) == list(range(4, 12))
    assert cat.recent[11] == (StepSummary(11, None, frozenset({pack_id(11)})), f"{11:064x}")


def test_run_retention_from_kept_summaries_deletes_what_decoding_would(tmp_path: Path) -> None:
    plain, cached = _shared(tmp_path / "a"), _shared(tmp_path / "b")
    summaries = StepSummaries()
    dropped: dict[str, list[tuple[str, ...]]] = {"plain": [], "cached": []}
    for step in range(1, 8):
        reuse = [pack_id(step - 2)] if step > 2 and step % 2 else []  # some steps reuse an older pack
        m = bare_manifest(step, [pack_id(step), *reuse])
        _commit(plain, m)
        d = _commit(cached, m)
        summaries.prime(cached, StepSummary.of(m), d)
        dropped["plain"].append(run_retention(plain, 2, step)[1])
        dropped["cached"].append(run_retention(cached, 2, step, summaries=summaries)[1])
    assert dropped["plain"] == dropped["cached"]
    assert pack_ids_on(plain) == pack_ids_on(cached)
    assert summaries.decoded == 0
