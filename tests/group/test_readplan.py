"""The restore planner (pure): which checkpoint survives, and who reads each chunk from where."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import CheckpointNotFound, ConfigError
from shoal.group.readplan import SHARED, Candidate, ChunkRead, ReadPlan, Source, choose_checkpoint, plan_reads
from shoal.tiers import TierCapabilities, register_tier, unregister_tier
from shoal.tiers.local import PosixTier
from shoal.tiers.roles import Role, kind_for

HOSTS4 = ["h0", "h0", "h1", "h1"]


def _shared_bytes(plan: ReadPlan) -> int:
    """Bytes read from the shared tier: reads whose reader's host holds no copy."""
    return sum(r.length for reads in plan.reads.values() for r in reads if r.sources[0].host is None)


def _host_bytes(plan: ReadPlan, rank_hosts: list[str]) -> dict[str, int]:
    """Bytes read per host, by its ranks, from its own tiers or from shared storage."""
    out: dict[str, int] = {}
    for reader, reads in plan.reads.items():
        out[rank_hosts[reader]] = out.get(rank_hosts[reader], 0) + sum(r.length for r in reads)
    return out


def _deliveries(plan: ReadPlan) -> dict[tuple[int, int], list[ChunkRead]]:
    """``(reader, consumer) -> chunks`` for every pair of different ranks: what crosses the fabric."""
    out: dict[tuple[int, int], list[ChunkRead]] = {}
    for reader in sorted(plan.reads):
        for r in plan.reads[reader]:
            for c in r.consumers:
                if c != reader:
                    out.setdefault((reader, c), []).append(r)
    return out


def _local(d: str, host: str, tier: str = "local") -> Source:
    return Source(tier, host, f"pack-{host}-{d}", 0, 10)


def _shared(d: str) -> Source:
    return Source(SHARED, None, f"pack-shared-{d}", 0, 10)


def test_the_newest_checkpoint_with_every_chunk_available_is_chosen():
    candidates = [
        Candidate(1, {"w": ["a", "b"]}, SHARED, committed=True),
        Candidate(2, {"w": ["a", "c"]}, "local:h1"),
        Candidate(3, {"w": ["a", "d"]}, "local:h1"),
    ]
    sources = {"a": [_shared("a")], "b": [_shared("b")], "c": [_local("c", "h1")]}
    choice = choose_checkpoint(candidates, sources, gone={"d": ["pack packs/x.pack is missing"]})
    assert (choice.step, choice.origin) == (2, "local:h1")
    ((skipped, why),) = choice.skipped
    assert skipped == 3 and "'w'" in why and "packs/x.pack is missing" in why


def test_an_explicit_step_is_loaded_or_the_error_names_what_is_missing():
    candidates = [
        Candidate(1, {"w": ["a"], "v": ["b"]}, SHARED),
        Candidate(1, {"w": ["a"], "v": ["b"]}, "dram:h0"),
    ]
    assert choose_checkpoint(candidates, {"a": [_shared("a")], "b": [_shared("b")]}, 1).origin == SHARED
    with pytest.raises(CheckpointNotFound, match="'v'"):
        choose_checkpoint(candidates, {"a": [_shared("a")]}, 1)
    with pytest.raises(CheckpointNotFound, match=r"steps found: \[1\]"):
        choose_checkpoint(candidates, {}, 7)
    with pytest.raises(CheckpointNotFound, match="no checkpoint found"):
        choose_checkpoint([], {})


def test_a_chunk_held_on_the_consumers_host_is_read_there():
    plan = plan_reads({2: ["a"]}, {"a": 10}, {"a": [_shared("a"), _local("a", "h1")]}, HOSTS4)
    ((reader, (read,)),) = plan.reads.items()
    assert reader == 2 and read.sources[0].host == "h1" and read.sources[-1].host is None
    assert _shared_bytes(plan) == 0 and _deliveries(plan) == {}


def test_a_chunk_held_only_on_another_host_is_read_there_and_sent():
    plan = plan_reads({0: ["a"], 1: ["a"]}, {"a": 10}, {"a": [_local("a", "h1")]}, HOSTS4)
    ((reader, _),) = plan.reads.items()
    assert reader in (2, 3)
    assert sorted(_deliveries(plan)) == [(reader, 0), (reader, 1)]


def test_a_hosts_sources_are_ordered_by_their_tiers_read_preference():
    slab = Source("dram", "h0", "r0-slot-0", 0, 10, slab=True)
    srcs = [_shared("a"), _local("a", "h0"), _local("a", "h0", "dram"), slab]
    (read,) = plan_reads({0: ["a"]}, {"a": 10}, {"a": srcs}, HOSTS4).reads_at(0)
    assert [(s.tier, s.slab) for s in read.sources] == [
        ("dram", True),  # a slab before a pack of the same kind
        ("dram", False),
        ("local", False),
        (SHARED, False),
    ]


class _Nvme(PosixTier):
    """A registered host-local kind read between DRAM and node-local disk."""

    kind = "nvme"
    capabilities = TierCapabilities(persistent=True, host_local=True, atomic_rename=True, read_preference=0)


class _Tape(PosixTier):
    kind = "tape"
    capabilities = TierCapabilities(persistent=True, host_local=True, atomic_rename=True, read_preference=5)


@pytest.fixture
def nvme_and_tape():
    register_tier("nvme", _Nvme)
    register_tier("tape", _Tape)
    yield
    unregister_tier("nvme")
    unregister_tier("tape")


@pytest.mark.usefixtures("nvme_and_tape")
def test_a_registered_kind_is_ordered_by_its_capabilities_not_its_name():
    srcs = [_local("a", "h0", "tape"), _local("a", "h0"), _local("a", "h0", "nvme"), _shared("a")]
    (read,) = plan_reads({0: ["a"]}, {"a": 10}, {"a": srcs}, HOSTS4).reads_at(0)
    assert [s.tier for s in read.sources] == ["nvme", "local", "tape", SHARED]


def test_a_source_of_a_kind_no_tier_implements_fails_clearly():
    srcs = [_local("a", "h0"), _local("a", "h0", "floppy")]
    with pytest.raises(ConfigError, match="unknown tier kind 'floppy'"):
        plan_reads({0: ["a"]}, {"a": 10}, {"a": srcs}, HOSTS4)


def test_shared_is_the_kind_of_the_shared_role():
    assert SHARED == kind_for(Role.SHARED) == "shared"


def test_a_rank_never_reads_another_hosts_tiers():
    with pytest.raises(CheckpointNotFound, match="no source this job can reach"):
        plan_reads({0: ["a"]}, {"a": 10}, {"a": [_local("a", "gone-host")]}, HOSTS4)


@settings(max_examples=60, deadline=None)
@given(n_chunks=st.integers(1, 60), ranks=st.integers(1, 8), hosts=st.integers(1, 4))
def test_shared_reads_are_each_chunk_once_and_balanced_across_hosts(n_chunks, ranks, hosts):
    rank_hosts = [f"h{r % hosts}" for r in range(ranks)]
    digests = [f"d{i}" for i in range(n_chunks)]
    needs = {r: digests for r in range(ranks)}  # N replicas loading one model
    plan = plan_reads(needs, dict.fromkeys(digests, 10), {d: [_shared(d)] for d in digests}, rank_hosts)
    read = [r.digest for reads in plan.reads.values() for r in reads]
    assert sorted(read) == sorted(digests)  # each chunk once in the job
    assert _shared_bytes(plan) == 10 * n_chunks
    used = set(rank_hosts)
    host_bytes = _host_bytes(plan, rank_hosts)
    loads = [host_bytes.get(h, 0) for h in used]
    assert max(loads) - min(loads) <= 10  # within one chunk
    got: dict[int, set[str]] = {r: {c.digest for c in plan.reads_at(r)} for r in range(ranks)}
    for (reader, consumer), chunks in _deliveries(plan).items():
        assert reader != consumer
        got[consumer] |= {c.digest for c in chunks}
    assert all(got[r] == set(digests) for r in range(ranks))  # every rank gets every chunk it needs
