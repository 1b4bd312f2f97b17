"""The fabric path between hosts (shoal.kv.peers): announced blocks fetched from a peer host,
verified on arrival; a damaged copy, a damaged transfer, a dead or silent peer are misses, never
hits and never hangs."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.format.chunking import digest as blake3_hex
from shoal.kv import KVConfig, KVStore
from shoal.kv.blockfile import encode_header
from shoal.kv.lower import SharedBlocks
from shoal.kv.peers import PEER, PeerClient, PeerDirectory, PeerEndpoint, PeerServer

from .kv_workers import BLOCK, flip_byte, keys, payload

TOKEN = "job-secret"


def _store(root: Path, host: str, local: bool = False) -> KVStore:
    return KVStore(
        KVConfig(
            dram_root=str(root / host / "dram"),
            dram_bytes=64 << 20,
            local_root=str(root / host / "local") if local else None,
        )
    )


def _wait(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[dict]:
    """Host a (the reader) and host b (the holder), each a store, a server and a client."""
    sa, sb = _store(tmp_path, "a"), _store(tmp_path, "b", local=True)
    da, db = PeerDirectory(), PeerDirectory()
    srv_a = PeerServer([sa], host="a", token=TOKEN, directory=da)
    srv_b = PeerServer([sb], host="b", token=TOKEN, directory=db)
    eps = [srv_a.endpoint, srv_b.endpoint]
    ca = PeerClient("a", eps, da, token=TOKEN, timeout_s=2.0)
    cb = PeerClient("b", eps, db, token=TOKEN)
    yield {"sa": sa, "sb": sb, "da": da, "ca": ca, "cb": cb, "srv_b": srv_b, "root": tmp_path}
    for x in (ca, cb, srv_a, srv_b, sa, sb):
        x.close()


def test_an_announced_block_is_fetched_from_the_peer_bit_exact_and_left_unused_there(two_hosts) -> None:
    h = two_hosts
    ks = keys(6)
    h["sb"].put_batch(ks, [payload(i) for i in range(6)])
    h["cb"].announce("have", [k.digest for k in ks[:5]])
    _wait(lambda: len(h["da"]) == 5)
    assert h["ca"].holder(ks[0]) == "b" and h["ca"].holder(ks[5]) is None
    bufs = [bytearray(BLOCK) for _ in ks]
    res = h["ca"].get_batch_into(ks, bufs)
    assert [(r.status, r.tier) for r in res[:5]] == [("hit", PEER)] * 5
    assert (res[5].status, res[5].reason) == ("miss", "absent")  # never announced: not asked
    assert all(bufs[i] == payload(i) for i in range(5))
    assert h["ca"].stats.requests == 1 and h["ca"].stats.bytes == 5 * BLOCK
    # a read for a peer is not a use: nothing of b's moved, a's pool got nothing by itself
    assert h["sa"].contains(ks[0]) is None
    h["cb"].announce("gone", [ks[0].digest])
    _wait(lambda: h["ca"].holder(ks[0]) is None)


def test_a_fetch_of_many_groups_is_read_ahead_and_arrives_whole_in_order(two_hosts) -> None:
    """More blocks than the server reads at once (8): the groups are read while earlier ones are
    sent, through two reused buffer sets; every block arrives bit-exact in its own buffer, hits
    and misses where they belong. The server sends the digest its store verified the bytes
    against (it does not hash them again)."""
    h = two_hosts
    n = 37
    ks = keys(n)
    h["sb"].put_batch(ks, [payload(i) for i in range(n)])
    absent = {5, 17, 30}
    for i in absent:
        h["sb"].remove([ks[i]])
    h["cb"].announce("have", [k.digest for k in ks])
    _wait(lambda: len(h["da"]) == n)
    for _ in range(2):  # the second fetch reuses the connection and its buffer sets
        bufs = [bytearray(BLOCK) for _ in ks]
        res = h["ca"].get_batch_into(ks, bufs)
        assert [r.status for r in res] == ["miss" if i in absent else "hit" for i in range(n)]
        assert all(bufs[i] == payload(i) for i in range(n) if i not in absent)
    _wait(lambda: h["srv_b"].served_blocks == 2 * (n - len(absent)))  # counted after each send
    got = h["sb"].get_batch_into(ks[:1], [bytearray(BLOCK)], for_peer=True)[0]
    assert got.payload_digest == blake3_hex(payload(0))


def test_a_corrupt_copy_on_the_peer_is_a_miss_and_the_next_source_is_tried(two_hosts) -> None:
    h = two_hosts
    ks = keys(2)
    h["sb"].put_batch(ks, [payload(0), payload(1)])
    h["cb"].announce("have", [k.digest for k in ks])
    _wait(lambda: len(h["da"]) == 2)
    flip_byte(Path(h["root"]) / "b" / "dram" / "blocks" / ks[0].digest, 96 + 7)
    bufs = [bytearray(BLOCK), bytearray(BLOCK)]
    res = h["ca"].get_batch_into(ks, bufs)
    assert (res[0].status, res[0].reason) == ("miss", "corrupt")
    assert (res[1].status, res[1].tier) == ("hit", PEER) and bufs[1] == payload(1)
    assert h["ca"].stats.corrupt == 1


def test_a_wrong_token_gets_nothing(two_hosts) -> None:
    h = two_hosts
    ks = keys(1)
    h["sb"].put_batch(ks, [payload(0)])
    d = PeerDirectory()
    d.add("b", [ks[0].digest])
    intruder = PeerClient("x", [h["srv_b"].endpoint], d, token="not-the-job", timeout_s=1.0)
    try:
        r = intruder.get_batch_into(ks, [bytearray(BLOCK)])[0]
        assert r.status == "miss"
    finally:
        intruder.close()


def _frame(header: dict) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">I", len(head)) + head


def _fake_peer(behaviour: str, port_out, data: bytes) -> None:
    """A peer that answers the first request badly: 'damaged' (bytes that do not match their
    digest), 'half' (half the bytes, then it waits to be killed), 'silent' (never answers)."""
    from shoal.format.chunking import digest

    srv = socket.create_server(("127.0.0.1", 0))
    port_out.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.recv(65536)  # hello and the request (small frames, sent together or close to it)
    if behaviour == "damaged":
        bad = bytearray(data)
        bad[100] ^= 0xFF
        conn.sendall(_frame({"s": "hit", "n": len(data), "b3": digest(data)}) + bytes(bad))
    elif behaviour == "half":
        conn.sendall(_frame({"s": "hit", "n": len(data), "b3": digest(data)}) + data[: len(data) // 2])
    time.sleep(60)


def _client_of_fake(behaviour: str, data: bytes, timeout_s: float = 2.0):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_fake_peer, args=(behaviour, q, data), daemon=True)
    proc.start()
    port = q.get(timeout=10)
    d = PeerDirectory()
    client = PeerClient("a", [PeerEndpoint("b", "127.0.0.1", port)], d, token=TOKEN, timeout_s=timeout_s)
    return proc, client, d


def test_bytes_damaged_in_transit_are_a_corrupt_miss_never_a_hit() -> None:
    ks = keys(1)
    proc, client, d = _client_of_fake("damaged", payload(0))
    try:
        d.add("b", [ks[0].digest])
        buf = bytearray(BLOCK)
        r = client.get_batch_into(ks, [buf])[0]
        assert (r.status, r.reason) == ("miss", "corrupt")
    finally:
        client.close()
        proc.kill()


def test_a_peer_killed_mid_fetch_costs_a_miss_not_a_hang_and_is_then_skipped() -> None:
    ks = keys(2)
    proc, client, d = _client_of_fake("half", payload(0), timeout_s=30.0)
    try:
        d.add("b", [k.digest for k in ks])
        out: list = []
        t = threading.Thread(
            target=lambda: out.append(client.get_batch_into(ks, [bytearray(BLOCK) for _ in ks]))
        )
        began = time.monotonic()
        t.start()
        time.sleep(0.5)  # the peer has sent half of the first block and stops
        os.kill(proc.pid, signal.SIGKILL)
        t.join(10)
        assert not t.is_alive(), "the fetch hung on a dead peer"
        assert time.monotonic() - began < 5  # not the 30 s timeout: the kernel closed its socket
        assert [r.status for r in out[0]] == ["miss", "miss"]
        assert client.stats.failed == 2
        assert client.holder(ks[0]) is None  # skipped for its backoff: no second wait on it
    finally:
        client.close()
        proc.kill()


def test_a_silent_peer_costs_at_most_the_deadline() -> None:
    ks = keys(1)
    proc, client, d = _client_of_fake("silent", payload(0), timeout_s=30.0)
    try:
        d.add("b", [ks[0].digest])
        began = time.monotonic()
        r = client.get_batch_into(ks, [bytearray(BLOCK)], deadline=time.monotonic() + 0.5)[0]
        took = time.monotonic() - began
        assert (r.status, r.reason) == ("miss", "deadline")
        assert took < 2.0
    finally:
        client.close()
        proc.kill()


def test_peered_store_reads_host_then_peer_then_shared_and_a_bad_peer_copy_falls_to_shared(
    tmp_path: Path,
) -> None:
    from shoal.kv.peers import PeeredStore

    shared = str(tmp_path / "shared")
    sa = KVStore(KVConfig(dram_root=str(tmp_path / "a"), dram_bytes=64 << 20, shared_url=shared))
    sb = _store(tmp_path, "b")
    da = PeerDirectory()
    srv_b = PeerServer([sb], host="b", token=TOKEN)
    ca = PeerClient("a", [srv_b.endpoint], da, token=TOKEN)
    peered = PeeredStore(sa, ca)
    try:
        ks = keys(4)
        sa.put_batch(ks[:1], [payload(0)])  # on this host
        sb.put_batch(ks[1:3], [payload(1), payload(2)])  # on the peer
        da.add("b", [ks[1].digest, ks[2].digest])
        tier = SharedBlocks(shared)  # another host wrote blocks 2 and 3 there
        for i in (2, 3):
            d, data = ks[i].digest, payload(i)
            tier.write(d, encode_header(d, data), memoryview(data))
        da.add("@shared", [ks[3].digest])
        flip_byte(tmp_path / "b" / "dram" / "blocks" / ks[2].digest, 96 + 3)  # b's copy of 2 is bad
        assert peered.lookup_prefix(ks) == 4
        bufs = [bytearray(BLOCK) for _ in ks]
        res = peered.get_batch_into(ks, bufs)
        assert [(r.status, r.tier) for r in res] == [
            ("hit", "dram"), ("hit", PEER), ("hit", "shared"), ("hit", "shared"),
        ]  # fmt: skip
        assert all(bufs[i] == payload(i) for i in range(4))
        assert ca.stats.corrupt == 1
    finally:
        peered.close()
        ca.close()
        srv_b.close()
        sa.close()
        sb.close()
