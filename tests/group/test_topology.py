"""Topology: hosts in rank order, failure domains, partner schemes, partner ranks."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.group.topology import Topology, build_topology


def _hosts(n: int, per_host: int = 1) -> list[str]:
    return [f"h{r // per_host}" for r in range(n * per_host)]


def test_ring_partners_the_next_host() -> None:
    topo = build_topology(_hosts(4, 2))
    assert topo.hosts == ("h0", "h1", "h2", "h3")
    assert dict(topo.partners) == {"h0": "h1", "h1": "h2", "h2": "h3", "h3": "h0"}
    assert topo.world_size == 8
    assert dict(topo.domains) == {h: h for h in topo.hosts}


def test_partner_ranks_are_every_ranks_partner_rank() -> None:
    topo = build_topology(_hosts(3, 2) + ["h3"])
    assert topo.partner_ranks == tuple(topo.partner_rank(r) for r in range(topo.world_size))
    assert build_topology(_hosts(2), replicate=False).partner_ranks == ()


def test_jump_partners_the_host_half_way_round() -> None:
    assert dict(build_topology(_hosts(4), scheme="jump").partners) == {
        "h0": "h2",
        "h1": "h3",
        "h2": "h0",
        "h3": "h1",
    }
    assert dict(build_topology(_hosts(5), scheme="jump").partners) == {
        "h0": "h2",
        "h1": "h3",
        "h2": "h4",
        "h3": "h0",
        "h4": "h1",
    }
    assert dict(build_topology(_hosts(2), scheme="jump").partners) == {"h0": "h1", "h1": "h0"}


def test_ring_skips_hosts_of_the_same_failure_domain() -> None:
    domains = {"h0": "rack-a", "h1": "rack-a", "h2": "rack-b", "h3": "rack-b"}
    topo = build_topology(_hosts(4), domains=domains)
    assert dict(topo.partners) == {"h0": "h2", "h1": "h2", "h2": "h0", "h3": "h0"}
    assert topo.domains["h3"] == "rack-b"


@st.composite
def jobs(draw: st.DrawFn) -> tuple[list[str], dict[str, str]]:
    n_hosts = draw(st.integers(2, 9))
    per_host = [draw(st.integers(1, 3)) for _ in range(n_hosts)]
    rank_hosts = [f"h{h}" for h, n in enumerate(per_host) for _ in range(n)]
    rank_hosts = draw(st.permutations(rank_hosts))
    hosts = list(dict.fromkeys(rank_hosts))
    labels = draw(st.lists(st.sampled_from("abc"), min_size=n_hosts, max_size=n_hosts))
    if len(set(labels)) == 1:
        labels[-1] = "z"
    return list(rank_hosts), dict(zip(hosts, labels, strict=True))


@settings(max_examples=200, deadline=None)
@given(jobs(), st.sampled_from(["ring", "jump"]))
def test_partner_is_the_first_host_of_another_domain_in_scheme_order(
    job: tuple[list[str], dict[str, str]], scheme: str
) -> None:
    rank_hosts, domains = job
    topo = build_topology(rank_hosts, scheme=scheme, domains=domains)
    hosts, n = topo.hosts, len(topo.hosts)
    assert list(hosts) == list(dict.fromkeys(rank_hosts))
    for i, host in enumerate(hosts):
        partner = topo.partner(host)
        assert partner != host and domains[partner] != domains[host], "same domain never partners"
        start = i + 1 if scheme == "ring" else i + n // 2
        order = [hosts[(start + k) % n] for k in range(n)]
        assert partner == next(h for h in order if h != host and domains[h] != domains[host])
    for rank in range(topo.world_size):
        # The partner rank lives on the partner host, at the local index modulo its size.
        mine, theirs = topo.ranks_on(topo.host_of(rank)), topo.ranks_on(topo.partner(topo.host_of(rank)))
        assert mine[topo.local_index(rank)] == rank
        assert topo.partner_rank(rank) == theirs[topo.local_index(rank) % len(theirs)]
        assert topo.host_of(topo.partner_rank(rank)) == topo.partner(topo.host_of(rank))


def test_partner_ranks_spread_over_every_rank_of_the_partner_host() -> None:
    topo = build_topology(_hosts(2, 4))
    assert [topo.partner_rank(r) for r in range(4)] == [4, 5, 6, 7]
    assert [topo.partner_rank(r) for r in range(4, 8)] == [0, 1, 2, 3]
    uneven = build_topology(["a"] * 4 + ["b"] * 2)
    assert [uneven.partner_rank(r) for r in range(4)] == [4, 5, 4, 5]
    assert [uneven.partner_rank(r) for r in (4, 5)] == [0, 1]


def test_ranks_of_one_host_need_not_be_contiguous() -> None:
    topo = build_topology(["a", "b", "a", "b", "c", "a"])
    assert topo.hosts == ("a", "b", "c")
    assert topo.ranks_on("a") == (0, 2, 5) and topo.ranks_on("b") == (1, 3)
    assert topo.leader("b") == 1 and topo.leader("c") == 4
    assert [topo.local_index(r) for r in range(6)] == [0, 0, 1, 1, 0, 2]
    assert topo.partner_rank(2) == 3 and topo.partner_rank(5) == 1
    assert topo.partner_rank(4) == 0  # c -> a


def test_one_host_replicates_nothing_or_refuses() -> None:
    topo = build_topology(["h0", "h0"], replicate=False)
    assert dict(topo.partners) == {} and topo.hosts == ("h0",)
    with pytest.raises(ConfigError, match="no partner"):
        topo.partner_rank(0)
    with pytest.raises(ConfigError, match=r"at least two hosts.*'h0'.*path='direct'"):
        build_topology(["h0", "h0"])


def test_topology_errors_name_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="empty"):
        build_topology([])
    with pytest.raises(ConfigError, match="unknown partner scheme 'star'"):
        build_topology(_hosts(2), scheme="star")
    with pytest.raises(ConfigError, match=r"failure domain for hosts \['h1'\]"):
        build_topology(_hosts(2), domains={"h0": "a"})
    with pytest.raises(ConfigError, match="'h0'.*failure domain 'rack'"):
        build_topology(_hosts(3), domains={"h0": "rack", "h1": "rack", "h2": "rack"})
    with pytest.raises(ConfigError, match="non-empty strings"):
        build_topology(["h0", ""])
    topo = build_topology(_hosts(2))
    with pytest.raises(ConfigError, match="rank 2 is outside"):
        topo.host_of(2)
    with pytest.raises(ConfigError, match="no rank runs on host 'zz'"):
        topo.ranks_on("zz")


def test_direct_construction_is_checked() -> None:
    with pytest.raises(ConfigError, match="lowest rank"):
        Topology(("a", "b"), ("b", "a"), {}, {"a": "a", "b": "b"})
    with pytest.raises(ConfigError, match="both are in failure domain 'x'"):
        Topology(("a", "b"), ("a", "b"), {"a": "b", "b": "a"}, {"a": "x", "b": "x"})
    with pytest.raises(ConfigError, match="every host a partner"):
        Topology(("a", "b"), ("a", "b"), {"a": "b"}, {"a": "a", "b": "b"})


def test_topology_is_immutable_and_pickles() -> None:
    topo = build_topology(["a", "b", "a", "b"], scheme="jump", domains={"a": "r1", "b": "r2"})
    again = pickle.loads(pickle.dumps(topo))
    assert again == topo and again.partner_rank(2) == topo.partner_rank(2) == 3
    with pytest.raises(TypeError):
        topo.partners["a"] = "a"  # type: ignore[index]
