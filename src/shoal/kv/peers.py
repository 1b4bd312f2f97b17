"""The fabric path between hosts: a block another host holds is fetched from it, not from storage.

Each host that takes part runs :class:`PeerServer` (in any process of the host: every process sees
the host's pool and local tier) on its fabric address, and every process that reads keeps a
:class:`PeerClient`. There is no central service on the read path:

* **Who holds what** is learned from announcements. A host that keeps a block tells the other
  hosts (``have``), and tells them when it no longer does (``gone``) or when it wrote the block to
  the shared tier (``shared``). :meth:`PeerClient.announce` queues digests; a background thread
  sends them in batches every ``announce_interval_s``, off the request path. Each receiving
  server records them in its process's :class:`PeerDirectory`. The directory can be stale: a
  peer that no longer holds a block answers ``absent``, which costs one round trip and a miss.
* **A fetch** (:meth:`PeerClient.get_batch_into`) groups the keys by holder and sends one request
  per host, all hosts in parallel. The server reads the blocks from its host's stores with
  ``get_batch_into(..., for_peer=True)`` (the host's tiers only, verified there, the host's LRU
  order left alone) and streams one frame per key: a hit carries the bytes and their BLAKE3.
* **Every block is verified on arrival** against that digest. A mismatch is a ``corrupt`` miss,
  never a hit. A peer that fails, closes the connection, or does not answer before the deadline
  costs a miss for the keys still outstanding. It is then skipped for ``backoff_s``, so a dead
  host costs one timeout, not one per request.

Frames are a 4-byte big-endian header length, a JSON header, then ``n`` payload bytes where the
header says so. Every connection opens with ``{"op": "hello", "token": ...}``: the job's shared
secret, compared in constant time. The fabric is the job's private network, and the token keeps
other jobs on it out. Nothing received is unpickled.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoal.errors import ConfigError, ShoalError
from shoal.format.chunking import digest as blake3_hex
from shoal.kv._buffers import writable_view
from shoal.kv._results import DRAM, LOCAL, SHARED, GetResult, MissReason
from shoal.kv.keys import BlockKey

log = logging.getLogger(__name__)

__all__ = [
    "PEER",
    "SHARED_HOLDER",
    "PeerClient",
    "PeerDirectory",
    "PeerEndpoint",
    "PeerServer",
    "PeerStats",
    "PeeredStore",
]

PEER = "peer"
"""The tier of a block fetched from another host (``GetResult.tier``)."""
SHARED_HOLDER = "@shared"
"""The holder a ``shared`` announcement records: some host wrote the block to the shared tier."""
_HEADER = struct.Struct(">I")
_MAX_HEADER = 1 << 20
_GROUP = 8
"""Blocks a server reads before it sends them; the next group is read while one is sent."""


class PeerError(ShoalError):
    """A peer broke the protocol or the connection (internal: the fetch turns it into misses)."""


class BlockSource(Protocol):
    """A store a server reads for its peers (:class:`shoal.kv.KVStore` is one)."""

    def get_batch_into(
        self,
        keys: Sequence[BlockKey],
        buffers: Sequence[Any],
        *,
        deadline: float | None = None,
        for_peer: bool = False,
    ) -> list[GetResult]: ...

    def block_size(self, key: BlockKey) -> int | None: ...


@dataclass(frozen=True)
class PeerEndpoint:
    """Where one process of a host serves its peers."""

    host: str
    addr: str
    port: int


class PeerDirectory:
    """Which other hosts hold which blocks, as they announced it (thread-safe; never asks anyone)."""

    def __init__(self) -> None:
        self._holders: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def add(self, host: str, digests: Sequence[str]) -> None:
        with self._lock:
            for d in digests:
                self._holders.setdefault(d, set()).add(host)

    def drop(self, host: str, digests: Sequence[str]) -> None:
        with self._lock:
            for d in digests:
                holders = self._holders.get(d)
                if holders is not None:
                    holders.discard(host)
                    if not holders:
                        del self._holders[d]

    def holders(self, digest: str) -> frozenset[str]:
        """The hosts (and :data:`SHARED_HOLDER`) said to hold ``digest``."""
        with self._lock:
            return frozenset(self._holders.get(digest, ()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._holders)


def _send(sock: socket.socket, header: dict[str, Any], payload: Any = None) -> None:
    """One frame: its header and payload handed to the kernel together (one ``sendmsg``, not a
    small packet for the header and another call for the bytes), the rest as ``sendall`` would."""
    head = json.dumps(header, separators=(",", ":")).encode()
    frame = _HEADER.pack(len(head)) + head
    if payload is None:
        sock.sendall(frame)
        return
    body = memoryview(payload).cast("B")
    sent = sock.sendmsg([frame, body])
    if sent < len(frame):
        sock.sendall(frame[sent:])
        sent = len(frame)
    if sent - len(frame) < body.nbytes:
        sock.sendall(body[sent - len(frame) :])


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerError(f"the peer closed the connection after {got} of {view.nbytes} bytes")
        got += n


def _recv_header(sock: socket.socket) -> dict[str, Any]:
    raw = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(raw))
    (size,) = _HEADER.unpack(raw)
    if size > _MAX_HEADER:
        raise PeerError(f"a peer's frame header claims {size} bytes (at most {_MAX_HEADER})")
    head = bytearray(size)
    _recv_exact(sock, memoryview(head))
    try:
        header = json.loads(head)
    except ValueError as e:
        raise PeerError(f"a peer sent a frame header that is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise PeerError(f"a peer sent a frame header that is not an object: {header!r}")
    return header


_MAX_BLOCK = 1 << 30


def _key_of(item: Any) -> tuple[BlockKey, int | None]:
    """A requested key and the size of the asker's buffer (None: the server looks it up)."""
    if not (isinstance(item, list) and len(item) in (3, 4)):
        raise PeerError(f"a key must be [namespace, tp_rank, prefix hex, size], got {item!r}")
    ns, tp, prefix = item[:3]
    size = item[3] if len(item) == 4 else None
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= _MAX_BLOCK
    ):
        raise PeerError(f"a peer asked for block size {size!r} (1 .. {_MAX_BLOCK})")
    try:
        return BlockKey(ns, tp, bytes.fromhex(prefix)), size
    except (TypeError, ValueError, ShoalError) as e:
        raise PeerError(f"a peer sent a bad key {item!r}: {e}") from e


class PeerServer:
    """Serves this host's blocks to its peers, and records their announcements in ``directory``.

    ``sources`` are read in order, each with ``for_peer=True``. ``token`` is the job's shared
    secret. Binds ``addr:port`` (port 0: any free port; :attr:`port` says which). Threads: one
    to accept, one per connection, all daemons; :meth:`close` stops them."""

    def __init__(
        self,
        sources: Sequence[BlockSource],
        *,
        host: str,
        token: str,
        directory: PeerDirectory | None = None,
        addr: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if not token:
            raise ConfigError("PeerServer needs a non-empty token (the job's shared secret)")
        self.sources = list(sources)
        self.host = host
        self.directory = directory if directory is not None else PeerDirectory()
        self._token = token.encode()
        self.served_blocks = 0
        self.served_bytes = 0
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((addr, port), Handler)
        self.addr, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="shoal-kv-peer", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> PeerEndpoint:
        return PeerEndpoint(self.host, str(self.addr), int(self.port))

    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffers: list[dict[int, list[bytearray]]] = []
        try:
            hello = _recv_header(sock)
            if hello.get("op") != "hello" or not hmac.compare_digest(
                str(hello.get("token", "")).encode(), self._token
            ):
                log.warning("KV peer server on %s: refused a connection without the job's token", self.host)
                return
            while True:
                header = _recv_header(sock)
                op = header.get("op")
                if op == "get":
                    self._get(sock, [_key_of(k) for k in header.get("keys", [])], buffers)
                elif op in ("have", "gone", "shared"):
                    host, digests = str(header.get("host", "")), list(header.get("d", []))
                    if op == "gone":
                        self.directory.drop(host, digests)
                    else:
                        self.directory.add(SHARED_HOLDER if op == "shared" else host, digests)
                else:
                    raise PeerError(f"unknown op {op!r}")
        except (OSError, ShoalError) as e:
            if not isinstance(e, PeerError) or "closed the connection after 0 of" not in str(e):
                log.debug("KV peer server on %s: connection ended: %s", self.host, e)

    def _get(
        self,
        sock: socket.socket,
        asked: list[tuple[BlockKey, int | None]],
        buffers: list[dict[int, list[bytearray]]],
    ) -> None:
        """Answer one ``get``: read the keys :data:`_GROUP` at a time and stream their frames.

        With more than one group, a read-ahead thread reads the next group while this one is
        sent (two buffer sets, each reused once its frames are on the wire), so that the link is
        not idle while the disk is read and the disk not idle while the link drains."""
        groups = [asked[start : start + _GROUP] for start in range(0, len(asked), _GROUP)]
        while len(buffers) < 2:
            buffers.append({})
        if len(groups) <= 1:
            for group in groups:
                self._send_frames(sock, self._read_group(group, buffers[0]))
            return
        free = threading.Semaphore(2)
        ready: queue.Queue[tuple[int, list[tuple[dict[str, Any], Any]]] | BaseException] = queue.Queue()
        stop = threading.Event()

        def read_ahead() -> None:
            try:
                for n, group in enumerate(groups):
                    free.acquire()
                    if stop.is_set():
                        return
                    ready.put((n, self._read_group(group, buffers[n % 2])))
            except BaseException as e:  # noqa: BLE001 - raised by the sender below
                ready.put(e)

        reader = threading.Thread(target=read_ahead, name="shoal-kv-peer-read", daemon=True)
        reader.start()
        try:
            for _ in groups:
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                self._send_frames(sock, item[1])
                free.release()  # that buffer set is on the wire: the reader may fill it again
        finally:
            stop.set()
            free.release()
            free.release()
            reader.join()

    def _read_group(
        self, asked: list[tuple[BlockKey, int | None]], buffers: dict[int, list[bytearray]]
    ) -> list[tuple[dict[str, Any], Any]]:
        """One group's frames: each block read from the first source that holds it, verified there."""
        group = [k for k, _ in asked]
        wanted = [n for _, n in asked]
        frames: list[tuple[dict[str, Any], Any]] = [({"s": "miss", "why": "absent"}, None)] * len(group)
        todo = list(range(len(group)))
        used: dict[int, int] = {}
        for source in self.sources:
            if not todo:
                break
            sized = []
            for i in todo:
                size = wanted[i]
                if size is None:  # the asker did not say: the index knows
                    try:
                        size = source.block_size(group[i])
                    except (ShoalError, OSError):
                        size = None
                if size:
                    sized.append((i, size))
            if not sized:
                continue
            bufs = []
            for _, size in sized:
                pool = buffers.setdefault(size, [])
                k = used.get(size, 0)
                if k == len(pool):
                    pool.append(bytearray(size))
                used[size] = k + 1
                bufs.append(pool[k])
            results = source.get_batch_into([group[i] for i, _ in sized], bufs, for_peer=True)
            still = set(todo)
            for (i, _), res, buf in zip(sized, results, bufs, strict=True):
                if res.status == "hit":
                    view = memoryview(buf)[: res.nbytes]
                    # the digest the source verified the bytes against, or (a source that does not
                    # say) their own: the asker checks them against it on arrival
                    b3 = res.payload_digest or blake3_hex(view)
                    frames[i] = ({"s": "hit", "n": res.nbytes, "b3": b3}, view)
                    still.discard(i)
                elif res.reason == "corrupt":
                    frames[i] = ({"s": "miss", "why": "corrupt"}, None)
            todo = [i for i in todo if i in still]
        return frames

    def _send_frames(self, sock: socket.socket, frames: list[tuple[dict[str, Any], Any]]) -> None:
        for header, payload in frames:
            _send(sock, header, payload)
            if payload is not None:
                self.served_blocks += 1
                self.served_bytes += header["n"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@dataclass
class PeerStats:
    """One client's running totals. ``fetches``: (host, bytes, seconds, started) of every request
    that moved bytes (``started``: its ``time.monotonic()``, one clock for the machine's
    processes), for the links' use: bytes over the time the links were busy, against their rate."""

    requests: int = 0
    blocks: int = 0
    bytes: int = 0
    absent: int = 0
    corrupt: int = 0
    failed: int = 0
    """Keys lost to a peer that failed, closed the connection or missed the deadline."""
    announced: int = 0
    fetches: list[tuple[str, int, float, float]] = field(default_factory=list)


class _Conn:
    def __init__(self, endpoint: PeerEndpoint, token: str, timeout: float) -> None:
        self.sock = socket.create_connection((endpoint.addr, endpoint.port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self.sock, {"op": "hello", "token": token})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class PeerClient:
    """Fetches blocks from the hosts that announced them, and announces this host's.

    ``host``: this host; ``endpoints``: every serving process of every host (this host's are
    ignored); ``directory``: what this process learned (its :class:`PeerServer`'s). ``timeout_s``
    bounds a fetch that has no deadline of its own. Thread-safe."""

    def __init__(
        self,
        host: str,
        endpoints: Sequence[PeerEndpoint],
        directory: PeerDirectory,
        *,
        token: str,
        timeout_s: float = 2.0,
        backoff_s: float = 1.0,
        announce_interval_s: float = 0.02,
        pick: int = 0,
    ) -> None:
        self.host = host
        self.directory = directory
        self.token = token
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.announce_interval_s = announce_interval_s
        self._by_host: dict[str, list[PeerEndpoint]] = {}
        for ep in endpoints:
            if ep.host != host:
                self._by_host.setdefault(ep.host, []).append(ep)
        self._pick = pick
        self._idle: dict[PeerEndpoint, list[_Conn]] = {}
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max(1, len(self._by_host)), thread_name_prefix="shoal-kv-peer-get")
        self.stats = PeerStats()
        self._outbox: list[tuple[str, str]] = []
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._announcer = threading.Thread(target=self._announce_loop, name="shoal-kv-announce", daemon=True)
        self._announcer.start()

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(sorted(self._by_host))

    # -- who holds what ---------------------------------------------------------------------

    def holder(self, key: BlockKey) -> str | None:
        """A live peer host said to hold ``key``'s block, or None."""
        now = time.monotonic()
        hosts = sorted(
            h for h in self.directory.holders(key.digest)
            if h in self._by_host and self._down_until.get(h, 0.0) <= now
        )  # fmt: skip
        if not hosts:
            return None
        return hosts[int(key.digest[:8], 16) % len(hosts)]

    def in_shared(self, key: BlockKey) -> bool:
        """Whether some host announced writing ``key``'s block to the shared tier."""
        return SHARED_HOLDER in self.directory.holders(key.digest)

    def announce(self, kind: str, digests: Sequence[str]) -> None:
        """Tell the other hosts, in the background: ``have``, ``gone`` or ``shared``."""
        if kind not in ("have", "gone", "shared"):
            raise ConfigError(f"announce kind must be have, gone or shared, got {kind!r}")
        if not digests or not self._by_host:
            return
        with self._wake:
            self._outbox.extend((kind, d) for d in digests)
            self._wake.notify()

    def _announce_loop(self) -> None:
        conns: dict[PeerEndpoint, _Conn] = {}
        while True:
            with self._wake:
                while not self._outbox and not self._closed:
                    self._wake.wait()
                if self._closed and not self._outbox:
                    break
            time.sleep(self.announce_interval_s)  # gather a batch
            with self._wake:
                batch, self._outbox = self._outbox, []
            by_kind: dict[str, list[str]] = {}
            for kind, d in batch:
                by_kind.setdefault(kind, []).append(d)
            for eps in self._by_host.values():
                for ep in eps:
                    try:
                        conn = conns.get(ep) or _Conn(ep, self.token, self.timeout_s)
                        conns[ep] = conn
                        for kind, ds in by_kind.items():
                            _send(conn.sock, {"op": kind, "host": self.host, "d": ds})
                    except OSError as e:
                        log.debug("KV peer announce to %s:%s failed: %s", ep.addr, ep.port, e)
                        if ep in conns:
                            conns.pop(ep).close()
            self.stats.announced += len(batch)
        for c in conns.values():
            c.close()

    # -- fetch --------------------------------------------------------------------------------

    def get_batch_into(
        self, keys: Sequence[BlockKey], buffers: Sequence[Any], *, deadline: float | None = None
    ) -> list[GetResult]:
        """Fetch each key from a peer that announced it; one result per key (tier :data:`PEER` on
        a hit). Keys no live peer holds are ``absent`` misses; nothing raises for a peer's fault."""
        if len(keys) != len(buffers):
            raise ConfigError(f"get_batch_into got {len(keys)} keys but {len(buffers)} buffers")
        results: list[GetResult] = [GetResult(k, "miss", reason="absent") for k in keys]
        by_host: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            h = self.holder(key)
            if h is not None:
                by_host.setdefault(h, []).append(i)
        if not by_host:
            return results
        end = deadline if deadline is not None else time.monotonic() + self.timeout_s
        views = [
            writable_view(b, f"buffer {i} for block {k.digest}")
            for i, (k, b) in enumerate(zip(keys, buffers, strict=True))
        ]
        jobs = [
            self._pool.submit(self._fetch_from, h, [keys[i] for i in idx], [views[i] for i in idx], end)
            for h, idx in by_host.items()
        ]
        for idx, job in zip(by_host.values(), jobs, strict=True):
            for i, res in zip(idx, job.result(), strict=True):
                results[i] = res
        return results

    def _checkout(self, host: str) -> tuple[PeerEndpoint, _Conn]:
        eps = self._by_host[host]
        ep = eps[self._pick % len(eps)]
        with self._lock:
            idle = self._idle.get(ep)
            if idle:
                return ep, idle.pop()
        return ep, _Conn(ep, self.token, self.timeout_s)

    def _fetch_from(
        self, host: str, keys: list[BlockKey], views: list[memoryview], end: float
    ) -> list[GetResult]:
        out: list[GetResult] = []
        began = time.monotonic()
        moved = 0
        conn: _Conn | None = None
        try:
            ep, conn = self._checkout(host)
            conn.sock.settimeout(max(0.001, end - time.monotonic()))
            asked = [
                [k.namespace, k.tp_rank, k.prefix_hash.hex(), v.nbytes]
                for k, v in zip(keys, views, strict=True)
            ]
            _send(conn.sock, {"op": "get", "keys": asked})  # the sizes: the server need not look them up
            for key, view in zip(keys, views, strict=True):
                conn.sock.settimeout(max(0.001, end - time.monotonic()))
                header = _recv_header(conn.sock)
                if header.get("s") != "hit":
                    why: MissReason = "corrupt" if header.get("why") == "corrupt" else "absent"
                    self.stats.absent += why == "absent"
                    self.stats.corrupt += why == "corrupt"
                    out.append(GetResult(key, "miss", reason=why))
                    continue
                n = header.get("n")
                if not isinstance(n, int) or n < 0:
                    raise PeerError(f"peer {host} sent a bad length {n!r} for block {key.digest}")
                if n != view.nbytes:  # the stream cannot be resynchronised: drain it and stop
                    raise PeerError(
                        f"peer {host} has block {key.digest} as {n} bytes, the buffer is {view.nbytes}"
                    )
                _recv_exact(conn.sock, view)
                moved += n
                if blake3_hex(view) != header.get("b3"):
                    self.stats.corrupt += 1
                    log.warning(
                        "KV peer fetch: block %s from %s failed verification; not used", key.digest, host
                    )
                    out.append(GetResult(key, "miss", reason="corrupt"))
                    continue
                out.append(GetResult(key, "hit", tier=PEER, nbytes=n, payload_digest=header["b3"]))
        except (OSError, PeerError) as e:
            timed_out = isinstance(e, TimeoutError | socket.timeout)
            log.warning("KV peer fetch from %s: %s; %d keys become misses", host, e, len(keys) - len(out))
            self.stats.failed += len(keys) - len(out)
            self._down_until[host] = time.monotonic() + self.backoff_s
            if conn is not None:
                conn.close()
                conn = None
            reason: MissReason = "deadline" if timed_out else "absent"
            out += [GetResult(k, "miss", reason=reason) for k in keys[len(out) :]]
        finally:
            if conn is not None:
                with self._lock:
                    self._idle.setdefault(ep, []).append(conn)
        self.stats.requests += 1
        hits = sum(r.status == "hit" for r in out)
        self.stats.blocks += hits
        self.stats.bytes += moved
        if moved:
            self.stats.fetches.append((host, moved, time.monotonic() - began, began))
        return out

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._announcer.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for conns in self._idle.values():
                for c in conns:
                    c.close()
            self._idle.clear()


class PeeredStore:
    """A :class:`shoal.kv.KVStore` with the fabric path between its local and shared tiers.

    A key the host holds (DRAM, local disk) is read from the store; else one a live peer
    announced is fetched from that peer; else the store's shared tier is asked. The store's read
    and the peers' fetches run at the same time. A peer miss (absent, corrupt, dead peer) falls
    through to the shared tier, in the same call. It is a
    :class:`~shoal.kv.grouped.BlockSource`, so a :class:`~shoal.kv.grouped.GroupedReader` can
    spread its reads over an instance's ranks."""

    def __init__(self, store: Any, client: PeerClient) -> None:
        self.store = store
        self.client = client
        self._async = ThreadPoolExecutor(1, thread_name_prefix="shoal-kv-peered")

    def close(self) -> None:
        """Stop the thread of the peers' side (the store and the client are the caller's to close)."""
        self._async.shutdown(wait=False, cancel_futures=True)

    def where(self, key: BlockKey) -> str | None:
        """Where a read of ``key`` goes: the store's tier that holds it, :data:`PEER`, the shared
        tier when some host announced writing it there, or None."""
        tier = self.store.contains(key)
        if tier in (DRAM, LOCAL):
            return str(tier)
        if self.client.holder(key) is not None:
            return PEER
        if tier is not None:
            return str(tier)
        if self.client.in_shared(key) and getattr(self.store.config, "shared_url", None):
            return SHARED
        return None

    def contains(self, key: BlockKey) -> str | None:
        return self.where(key)

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, this host, its peers or the shared tier hold."""
        n = 0
        while n < len(keys) and self.where(keys[n]) is not None:
            n += 1
        return n

    def get_batch_into(
        self, keys: Sequence[BlockKey], buffers: Sequence[Any], *, deadline: float | None = None
    ) -> list[GetResult]:
        if len(keys) != len(buffers):
            raise ConfigError(f"get_batch_into got {len(keys)} keys but {len(buffers)} buffers")
        peer = [i for i, k in enumerate(keys) if self.where(k) == PEER]
        to_peers = set(peer)
        mine = [i for i in range(len(keys)) if i not in to_peers]
        job = None
        if peer:
            job = self._async.submit(
                self.client.get_batch_into,
                [keys[i] for i in peer],
                [buffers[i] for i in peer],
                deadline=deadline,
            )
        results: list[GetResult | None] = [None] * len(keys)
        if mine:
            got = self.store.get_batch_into(
                [keys[i] for i in mine], [buffers[i] for i in mine], deadline=deadline
            )
            for i, r in zip(mine, got, strict=True):
                results[i] = r
        if job is not None:
            retry = []
            for i, r in zip(peer, job.result(), strict=True):
                results[i] = r
                if r.status != "hit":
                    retry.append(i)
            if retry and getattr(self.store.config, "shared_url", None):
                got = self.store.get_batch_into(
                    [keys[i] for i in retry], [buffers[i] for i in retry], deadline=deadline
                )
                for i, r in zip(retry, got, strict=True):
                    if r.status == "hit":
                        results[i] = r
        return [r for r in results if r is not None]
