"""A run's checkpoints and loads as a Chrome trace (``shoal timeline``; ``docs/observability.md``).

The trace event format (the JSON object form: ``traceEvents`` and ``displayTimeUnit``) is what
Perfetto (https://ui.perfetto.dev) and ``chrome://tracing`` open. One process per host, one
thread (track) per rank; where one rank's spans overlap without nesting (drain packs uploading at
once, a checkpoint still draining when the next is staged) the extra ones go on further tracks
of the rank (``rank 2 (2)``), so every track's spans nest. From the event records
(``docs/events.md``), all on the common clock of :mod:`shoal.obs.runlogs`:

* complete spans (``ph`` ``X``): each checkpoint on each rank (its save call to its
  ``checkpoint`` record), waiting for a DRAM slot and the copy into it (``staged``), hashing
  (``hashed``), the coordinator's path decision and plan (``planned``), the partner copy
  (``replicate``: sends and receives) and each replica pack received (``write`` ``replica``), each
  drain pack (``write`` ``pack``), the commit's files (``write`` ``manifest``/``commit``/
  ``latest``), and each load with its reads and its exchange (``loaded``);
* instants (``ph`` ``i``, on the rank's track): each boundary a rank's checkpoint reached, at its
  save call plus the boundary's seconds; the path chosen; failures;
* a counter per host (``ph`` ``C``): the bytes of drain packs and of partner copies being written
  on the host at each moment, from the writer records.

Times are microseconds since the run's first line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shoal.boundary import Boundary
from shoal.obs.runlogs import RunRecords, StepFilter, write_output
from shoal.records.events import CheckpointRecord, Event, WriterRecord

__all__ = ["LANE_TIDS", "Span", "build_trace", "spans_of", "write_trace"]

LANE_TIDS = 1000
"""A rank's tracks are threads ``rank * LANE_TIDS + lane`` (lane 0: the rank's first track)."""

SLOT_WAIT_SHOWN_S = 1e-3
"""A wait for a free DRAM slot is drawn from this long on (taking a free slot takes microseconds)."""
BOUNDARY_LABELS = {b.name: f"B{int(b)} {b.name}" for b in Boundary}
COMMIT_FILES = {"manifest": "commit: manifest", "commit": "commit: COMMIT record", "latest": "commit: LATEST"}


@dataclass(frozen=True)
class Span:
    """One interval on a rank's track, on the common clock (seconds since the epoch)."""

    name: str
    cat: str
    host: str
    rank: int
    step: int | None
    start: float
    end: float
    args: Mapping[str, Any] = field(default_factory=dict)
    where: str = ""
    """The record it comes from (``<file>:<line>``)."""


@dataclass(frozen=True)
class Instant:
    name: str
    cat: str
    host: str
    rank: int
    step: int | None
    at: float
    args: Mapping[str, Any] = field(default_factory=dict)


def _num(e: Event, key: str) -> float | None:
    value = e.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def spans_of(run: RunRecords, steps: StepFilter | None = None) -> tuple[list[Span], list[Instant]]:
    """Every span and instant the trace draws, from ``run``'s records (only ``steps``' when given)."""
    steps = steps or StepFilter()
    spans: list[Span] = []
    instants: list[Instant] = []
    called: dict[tuple[str, int, int], tuple[float, Event]] = {}  # (host, rank, step) -> save call

    def span(e: Event, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        w0, w1 = run.wall(e, start), run.wall(e, end)
        spans.append(Span(name, cat, e.host, e.rank, e.step, w0, max(w0, w1), args, e.where))

    for e in run.events:
        if e.mono is None or not steps.keeps(e):
            continue
        kind, mono = e.event, float(e.mono)
        if kind == "save_called" and e.step is not None:
            at = _num(e, "called")
            called[(e.host, e.rank, e.step)] = (mono if at is None else at, e)
        elif kind == "staged":
            start, end = _num(e, "start"), _num(e, "end")
            wait = _num(e, "wait_seconds") or 0.0
            if start is None or end is None:  # a log from before the fields: the save call to the line
                save = called.get((e.host, e.rank, e.step or -1))
                start, end = (mono if save is None else save[0]) + wait, mono
            if wait >= SLOT_WAIT_SHOWN_S:
                span(e, "wait for a DRAM slot", "stage", start - wait, start, seconds=wait)
            span(e, "stage (copy into DRAM)", "stage", start, end, bytes=e.get("bytes"))
        elif kind == "hashed":
            seconds = _num(e, "seconds") or 0.0
            start, end = _num(e, "start"), _num(e, "end")
            if start is None or end is None:
                start, end = mono - seconds, mono
            span(e, "hash chunks", "hash", start, end, bytes=e.get("bytes"))
        elif kind == "planned":
            start, end = _num(e, "start"), _num(e, "end")
            if start is None or end is None:
                start, end = mono - (_num(e, "seconds") or 0.0), mono
            args = {k: e.get(k) for k in ("new_bytes", "reused_bytes", "replicated_bytes", "dedup_bytes")}
            span(e, "path decision and plan", "plan", start, end, **args)
        elif kind == "replicate":
            start, end = _num(e, "start"), _num(e, "end")
            if start is not None and end is not None:
                span(e, "partner copy", "replicate", start, end, sent_bytes=e.get("sent_bytes"),
                     received_bytes=e.get("received_bytes"))  # fmt: skip
        elif isinstance(e, WriterRecord):
            name, cat = _write_name(e)
            span(e, name, cat, e.start, e.end, bytes=e.bytes, tier=e.tier, path=e.path,
                 concurrency=e.concurrency, seconds=e.seconds)  # fmt: skip
        elif isinstance(e, CheckpointRecord) and e.step is not None:
            save = called.get((e.host, e.rank, e.step))
            if save is None:
                continue
            at = save[0]
            span(save[1], f"checkpoint {e.step}", "checkpoint", at, e.end, durability_path=e.durability_path,
                 reached=e.reached, failed_at=e.failed_at, bytes=e.bytes)  # fmt: skip
            for name, seconds in e.boundaries.items():
                label = BOUNDARY_LABELS.get(name, name)
                instants.append(Instant(label, "boundary", e.host, e.rank, e.step,
                                        run.wall(e, at + float(seconds)),
                                        {"step": e.step, "seconds": seconds}))  # fmt: skip
        elif kind == "loaded":
            _load_spans(run, e, mono, span)
        elif kind == "path":
            instants.append(Instant(f"path: {e.get('path')}", "plan", e.host, e.rank, e.step,
                                    run.wall(e, mono), {"reason": e.get("reason")}))  # fmt: skip
        elif kind == "failed":
            instants.append(Instant(f"failed before {e.get('boundary')}", "failure", e.host, e.rank, e.step,
                                    run.wall(e, mono), {"error": e.get("error")}))  # fmt: skip
    return spans, instants


def _write_name(e: WriterRecord) -> tuple[str, str]:
    if e.what == "pack":
        return "drain pack", "drain"
    if e.what == "replica":
        return "receive partner copy", "replicate"
    return COMMIT_FILES.get(e.what, f"write {e.what}"), "commit"


def _load_spans(run: RunRecords, e: Event, mono: float, span: Any) -> None:
    start, end = _num(e, "start"), _num(e, "end")
    if start is None or end is None:  # before the fields: the line is written as the load returns
        start, end = mono - (_num(e, "seconds") or 0.0), mono
    span(e, f"load step {e.step}", "restore", start, end, origin=e.get("origin"),
         bytes_by_tier=e.get("bytes_by_tier"), fabric_bytes=e.get("fabric_bytes"))  # fmt: skip
    r0, r1, x1 = _num(e, "read_start"), _num(e, "read_end"), _num(e, "exchange_end")
    if r0 is not None and r1 is not None:
        span(e, "restore reads", "restore", r0, r1, bytes=e.get("rank_bytes"))
        if x1 is not None:
            span(e, "restore exchange", "restore", r1, x1)


def _us(wall: float, origin: float) -> float:
    return round((wall - origin) * 1e6, 3)


def _lanes(spans: list[Span], origin: float) -> dict[int, int]:
    """Per span (by index), the lane of its rank where it nests in what is already there.

    Spans in start order, the longer first at one start; a lane is a stack of open spans'
    ends. A span goes where it ends no later than the innermost open span (after those that
    ended before it began are closed), trying its own checkpoint's lane first.
    """
    order = sorted(
        range(len(spans)),
        key=lambda i: (
            _us(spans[i].start, origin),
            -(_us(spans[i].end, origin) - _us(spans[i].start, origin)),
        ),
    )
    stacks: dict[int, list[list[float]]] = {}
    home: dict[tuple[int, int | None], int] = {}  # (rank, step) -> the lane of its checkpoint span
    lanes: dict[int, int] = {}
    for i in order:
        s = spans[i]
        a, b = _us(s.start, origin), _us(s.end, origin)
        stack = stacks.setdefault(s.rank, [])
        first = home.get((s.rank, s.step), 0)
        for lane in [first, *(k for k in range(len(stack) + 1) if k != first)]:
            while len(stack) <= lane:
                stack.append([])
            ends = stack[lane]
            while ends and ends[-1] <= a:
                ends.pop()
            if not ends or ends[-1] >= b:
                ends.append(b)
                lanes[i] = lane
                if s.cat == "checkpoint":
                    home[(s.rank, s.step)] = lane
                break
    return lanes


def build_trace(run: RunRecords, steps: StepFilter | None = None) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of ``run``: see the module docstring."""
    spans, instants = spans_of(run, steps)
    origin = run.origin
    hosts = run.hosts()
    pid = {h: i + 1 for i, h in enumerate(hosts)}
    lanes = _lanes(spans, origin)
    events: list[dict[str, Any]] = []
    used: dict[tuple[str, int], set[int]] = {(h, r): {0} for h in hosts for r in run.ranks_of(h)}
    for i, s in enumerate(spans):
        lane = lanes[i]
        used.setdefault((s.host, s.rank), {0}).add(lane)
        a, b = _us(s.start, origin), _us(s.end, origin)
        events.append({"name": s.name, "cat": s.cat, "ph": "X", "ts": a, "dur": round(b - a, 3),
                       "pid": pid[s.host], "tid": s.rank * LANE_TIDS + lane,
                       "args": {"step": s.step, **s.args}})  # fmt: skip
    for m in instants:
        events.append({"name": m.name, "cat": m.cat, "ph": "i", "s": "t", "ts": _us(m.at, origin),
                       "pid": pid[m.host], "tid": m.rank * LANE_TIDS,
                       "args": {"step": m.step, **m.args}})  # fmt: skip
    events.extend(_counters(run, spans, pid, origin))
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e.get("dur", 0.0)))
    meta: list[dict[str, Any]] = []
    for h in hosts:
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid[h], "tid": 0,
                     "args": {"name": f"host {h}"}})  # fmt: skip
        meta.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid[h], "tid": 0,
                     "args": {"sort_index": pid[h]}})  # fmt: skip
    for (h, r), lanes_used in sorted(used.items(), key=lambda kv: (pid[kv[0][0]], kv[0][1])):
        for lane in sorted(lanes_used):
            name = f"rank {r}" if lane == 0 else f"rank {r} ({lane + 1})"
            tid = r * LANE_TIDS + lane
            meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid[h], "tid": tid,
                         "args": {"name": name}})  # fmt: skip
            meta.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid[h], "tid": tid,
                         "args": {"sort_index": tid}})  # fmt: skip
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "shoal timeline",
            "origin_wall_clock": origin,
            "steps": steps.text if steps and steps.text else "all",
            "clock_offsets": [
                {
                    "log": o.source,
                    "host": o.host,
                    "from": o.first,
                    "lines": o.lines,
                    "offset_s": o.offset,
                    "spread_s": o.spread,
                }  # fmt: skip
                for o in run.offsets
            ],
        },
    }


def _counters(
    run: RunRecords, spans: list[Span], pid: Mapping[str, int], origin: float
) -> list[dict[str, Any]]:
    """Per host: the bytes being written at each moment, drain packs and partner copies apart."""
    series = {"drain": "drain packs", "replicate": "partner copies"}
    changes: dict[str, list[tuple[float, str, int]]] = {}
    for s in spans:
        if s.name in ("drain pack", "receive partner copy"):
            n = int(s.args.get("bytes") or 0)
            changes.setdefault(s.host, []).extend(
                [(_us(s.start, origin), series[s.cat], n), (_us(s.end, origin), series[s.cat], -n)]
            )
    out = []
    for host, points in changes.items():
        points.sort(key=lambda p: (p[0], p[2]))  # at one instant the ends first: never a false peak
        level = {name: 0 for name in series.values()}
        for ts, name, delta in points:
            level[name] += delta
            out.append({"name": "bytes in flight", "ph": "C", "ts": ts, "pid": pid[host], "tid": 0,
                        "args": dict(level)})  # fmt: skip
    return out


def write_trace(trace: Mapping[str, Any], path: str) -> None:
    """Write ``trace`` as JSON to ``path`` (through a temporary file renamed into place)."""
    write_output(path, json.dumps(trace, separators=(",", ":")), "the trace")
