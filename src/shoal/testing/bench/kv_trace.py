"""Conversation traces for the KV-cache replay (``benchmarks/kv_replay.py``): pure, no I/O but the load.

A trace is JSON lines in the Mooncake format (``benchmarks/data/mooncake/``): ``timestamp`` (ms
from the start), ``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per
512-token block of the prompt (``len(hash_ids) == ceil(input_length / 512)``); equal ids at the
same place after equal ids name a reusable block. Who calls what:

* :func:`load_trace` reads and validates a file (a :class:`TraceError` names the line and the
  field), :func:`window` keeps the first minutes.
* :func:`prefix_chains` turns each request's ``hash_ids`` into chained block identities: the
  ``i``-th identity names the whole prefix up to block ``i`` (as
  :func:`shoal.kv.keys.chain_keys` does with hashes), so a block is reusable only as part of a
  prefix.
* :func:`simulate_lru` is the exact LRU simulation of a DRAM pool of ``capacity`` blocks over the
  same operations the serving simulator (:mod:`shoal.testing.bench.kv_serving`) does on shoal's store:
  per request, the longest stored prefix is fetched (its DRAM hits touched as one batch), blocks
  found below DRAM are promoted, then the request's new blocks are put as one batch. It
  reproduces the store's rules (within a batch touched or stored at one instant, the prefix's
  tail is evicted before its head; a put is not a touch; a put batch never evicts a block it
  lists, new or present), so that a replay through :class:`shoal.kv.KVStore` with room for
  exactly ``capacity`` blocks gives the same DRAM hits. The benchmark checks its measured DRAM
  hit ratio against it.
* :func:`account` is the per-request bookkeeping: which blocks were fetched (and from which tier),
  which were recomputed, and the cached and uncached tokens.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.errors import FormatError

__all__ = [
    "BLOCK_TOKENS",
    "LruResult",
    "RequestAccount",
    "TraceError",
    "TraceRequest",
    "account",
    "load_trace",
    "prefix_chains",
    "simulate_lru",
    "trace_summary",
    "window",
]

BLOCK_TOKENS = 512
"""Tokens per block in the Mooncake traces."""

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(FormatError):
    """A trace file is malformed; the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (``line`` is its 1-based line in the file)."""

    line: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return len(self.hash_ids)


def _int_field(obj: dict[str, object], name: str, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {name!r} must be an integer >= 0, got {value!r}")
    return value


def _parse_line(text: str, where: str, line: int, block_tokens: int) -> TraceRequest:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise TraceError(f"{where}: not JSON ({e}); each line must be one JSON object") from e
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in _FIELDS if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {missing}; a request needs {list(_FIELDS)}")
    ts = _int_field(obj, "timestamp", where)
    n_in = _int_field(obj, "input_length", where)
    n_out = _int_field(obj, "output_length", where)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got {str(ids)[:80]}")
    if n_in < 1:
        raise TraceError(f"{where}: 'input_length' must be >= 1 token, got {n_in}")
    want = math.ceil(n_in / block_tokens)
    if len(ids) != want:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {n_in}; a trace of {block_tokens}-token "
            f"blocks has ceil({n_in} / {block_tokens}) = {want}"
        )
    return TraceRequest(line, ts, n_in, n_out, tuple(ids))


def load_trace(path: str, *, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Every request of the trace at ``path``, validated (see the module docstring).

    Blank lines are skipped; timestamps must not decrease. Raises :class:`TraceError` naming
    ``path:line`` and the field for the first bad line, and for an empty trace."""
    out: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                req = _parse_line(text, f"trace {path}:{line}", line, block_tokens)
                if out and req.timestamp_ms < out[-1].timestamp_ms:
                    raise TraceError(
                        f"trace {path}:{line}: timestamp {req.timestamp_ms} ms is before line "
                        f"{out[-1].line}'s {out[-1].timestamp_ms} ms; requests must be in arrival order"
                    )
                out.append(req)
    except OSError as e:
        raise TraceError(f"trace {path}: cannot be read: {e}") from e
    except UnicodeDecodeError as e:
        raise TraceError(f"trace {path}: not UTF-8 text: {e}") from e
    if not out:
        raise TraceError(f"trace {path}: no requests (the file is empty)")
    return out


def window(requests: Sequence[TraceRequest], minutes: float) -> list[TraceRequest]:
    """The requests that arrive in the first ``minutes`` after the trace's first one."""
    if not minutes > 0:
        raise TraceError(f"the trace window must be > 0 minutes, got {minutes!r}")
    if not requests:
        return []
    start = requests[0].timestamp_ms
    end = start + minutes * 60_000.0
    return [r for r in requests if r.timestamp_ms < end]


def prefix_chains(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """Per request, one small integer per block naming its whole prefix (equal = same prefix)."""
    nodes: dict[tuple[int, int], int] = {}
    chains: list[list[int]] = []
    for req in requests:
        parent, chain = -1, []
        for h in req.hash_ids:
            node = nodes.setdefault((parent, h), len(nodes))
            chain.append(node)
            parent = node
        chains.append(chain)
    return chains


@dataclass(frozen=True)
class LruResult:
    """What :func:`simulate_lru` found: per request the prefix length and its DRAM hits."""

    capacity: int
    prefix: list[int]
    """Per request: the blocks of its longest stored prefix (fetched, from any tier)."""
    dram_hits: list[int]
    """Per request: how many of those were in DRAM."""
    blocks: int
    """Blocks asked for, over all requests."""

    @property
    def dram_hit_ratio(self) -> float:
        return sum(self.dram_hits) / self.blocks if self.blocks else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return sum(self.prefix) / self.blocks if self.blocks else 0.0


@dataclass
class _Lru:
    """The pool's order: LRU first."""

    capacity: int
    order: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def touch(self, blocks: Sequence[int]) -> None:
        """One batch (a prefix, head first) touched at one instant: to the MRU end, its tail
        least recent (evicted first)."""
        for b in reversed(blocks):
            self.order.move_to_end(b)

    def put(self, blocks: Sequence[int]) -> None:
        """One put batch, in order. A present block is left as it is (a put is not a touch); a new
        one evicts the LRU block, but never one this batch lists (stored by it, or present: the
        store reports a present block as stored and keeps it): when only those are left, the rest
        of the batch does not fit (the store sends it to the next tier, or fails it)."""
        keep = set(blocks)
        new: list[int] = []
        for block in blocks:
            if block in self.order:
                continue
            if len(self.order) >= self.capacity:
                victim = next((b for b in self.order if b not in keep), None)
                if victim is None:
                    continue
                del self.order[victim]
            self.order[block] = None
            new.append(block)
        for block in reversed(new):  # stored at one instant: the batch's tail is evicted first
            self.order.move_to_end(block)


def simulate_lru(chains: Sequence[Sequence[int]], capacity: int, *, backed: bool) -> LruResult:
    """Replay ``chains`` (from :func:`prefix_chains`) through an LRU pool of ``capacity`` blocks.

    ``backed``: a lower tier keeps every block ever stored (shoal with a local or shared tier;
    the prefix is then the longest one ever stored, and its blocks not in DRAM are promoted);
    otherwise the pool is the only tier (the prefix is what DRAM holds)."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
    lru = _Lru(capacity)
    stored: set[int] = set()
    prefixes: list[int] = []
    hits: list[int] = []
    for chain in chains:
        have = stored if backed else lru.order
        k = 0
        while k < len(chain) and chain[k] in have:
            k += 1
        in_dram = [b for b in chain[:k] if b in lru.order]
        lru.touch(in_dram)
        for b in chain[:k]:
            if b not in lru.order:
                lru.put([b])  # promoted from the lower tier, one block at a time
        lru.put(chain[k:])
        stored.update(chain)
        prefixes.append(k)
        hits.append(len(in_dram))
    return LruResult(capacity, prefixes, hits, sum(len(c) for c in chains))


@dataclass(frozen=True)
class RequestAccount:
    """One request's blocks: fetched (per tier) or recomputed; and the tokens that cost."""

    blocks: int
    fetched: dict[str, int]
    recomputed: int
    cached_tokens: int
    uncached_tokens: int


def account(
    request: TraceRequest, tiers: Sequence[str | None], *, block_tokens: int = BLOCK_TOKENS
) -> RequestAccount:
    """The bookkeeping of one request whose prefix blocks came from ``tiers`` (one per block fetched,
    in order; a None ends the usable prefix: that block and every one after it is recomputed).

    Every block is either fetched or recomputed, never both; the cached tokens are the prefix's
    (the last block may be partial), the uncached ones are what the prefill computes."""
    if len(tiers) > request.blocks:
        raise ValueError(f"request at line {request.line}: {len(tiers)} tiers for {request.blocks} blocks")
    fetched: dict[str, int] = {}
    k = 0
    for tier in tiers:
        if tier is None:
            break
        fetched[tier] = fetched.get(tier, 0) + 1
        k += 1
    cached = min(k * block_tokens, request.input_length)
    return RequestAccount(request.blocks, fetched, request.blocks - k, cached, request.input_length - cached)


def trace_summary(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Requests, blocks, distinct prefixes, tokens and the span of a trace (for the report)."""
    chains = prefix_chains(requests)
    blocks = sum(len(c) for c in chains)
    distinct = len({b for c in chains for b in c})
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0 if requests else 0.0
    return {
        "requests": len(requests),
        "blocks": blocks,
        "distinct_blocks": distinct,
        "reusable_ratio": (blocks - distinct) / blocks if blocks else 0.0,
        "input_tokens": sum(r.input_length for r in requests),
        "span_s": span,
    }
