"""A run's checkpoints as one self-contained HTML page (``shoal report``; ``docs/observability.md``).

Everything comes from the event records of every host (:mod:`shoal.obs.runlogs`); the page
needs no network to be viewed: inline CSS, charts as inline SVG drawn here (:mod:`shoal.obs.svg`),
no script. Each chart is an ``<svg data-chart="<name>">`` with a ``<title>``; the numbers of each
checkpoint are also in tables whose rows carry ``data-step`` and whose cells ``data-field``.

The coordinator's (rank 0's) records describe each checkpoint: its save call and boundary times
(as ``shoal exposure`` reads them: :func:`shoal.records.exposure_log.run_log`), its path and the
policy's reason (``path``), the model's prediction and what followed (``path_observed``), the
plan's bytes (``planned``). Bytes written and partner-copy traffic add up every host's
``write`` and ``replicate`` records.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from shoal.boundary import Boundary
from shoal.errors import ShoalError
from shoal.obs.kvlog import KV_STATS
from shoal.obs.runlogs import RunRecords, StepFilter, write_output
from shoal.obs.svg import PALETTE, Chart, Unit, byte_unit, second_unit, stacked
from shoal.records.events import CheckpointRecord, Event, WriterRecord
from shoal.records.exposure_log import COORDINATOR, LoggedCheckpoint, RunLog, run_log

__all__ = ["CHARTS", "KV_CHARTS", "CheckpointRow", "ReportData", "collect", "render", "write_report"]

CHARTS = ("boundaries", "exposure", "b2_prediction", "bytes_per_tier", "dedup", "link_use")
"""The ``data-chart`` names of the charts of a run's checkpoints, in page order."""
KV_CHARTS = ("kv_hits",)
"""The chart of a run whose logs hold ``kv_stats`` records (:mod:`shoal.obs.kvlog`), after those."""

BOUNDARIES = tuple(b.name for b in Boundary)
LABELS = {b.name: f"B{int(b)} {b.name}" for b in Boundary}
SAVE_CALL_SLACK_S = 1.0
"""How long before rank 0's save call another rank's records of the same save may start (ranks
call ``save`` at about the same moment; saves of one step again, after a load, come later)."""
CLASS_LABELS = {
    "process": "process crash (needs B1)",
    "host": "host lost (needs B2)",
    "cluster": "every host lost (needs B4)",
}


@dataclass
class CheckpointRow:
    """One checkpoint as the report shows it."""

    step: int
    saved: float
    """The save call, seconds since the run's start (the coordinator's clock)."""
    boundaries: dict[str, float]
    """Seconds from the save call to each boundary reached (the coordinator's checkpoint record)."""
    path: str | None
    failed_at: str | None
    staged_bytes: int = 0
    """Bytes staged, every rank's ``checkpoint`` record added up."""
    written: dict[str, int] = field(default_factory=dict)
    """Bytes written per kind: ``shared packs``, ``shared commit files``, ``<tier> partner copies``."""
    reason: str | None = None
    predictions: Mapping[str, Any] | None = None
    observed_b2: float | None = None
    predicted: Mapping[str, Any] | None = None
    """The chosen path's prediction (``path_observed``), or None under a rule."""
    logical_bytes: int | None = None
    unique_bytes: int | None = None
    new_bytes: int | None = None
    reused_bytes: int | None = None
    dedup_bytes: int | None = None
    links: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    """Per host: bytes sent and received over the fabric for partner copies, and the seconds
    from its first rank's start to its last rank's end (``replicate`` records)."""


@dataclass
class ReportData:
    """What the page shows, gathered from the records."""

    run: RunRecords
    log: RunLog | None
    """The coordinator's run (None for a run without checkpoints: a KV store's log alone)."""
    rows: list[CheckpointRow]
    loads: list[Event]
    kv: list[Event]
    """``kv_stats`` records (:mod:`shoal.obs.kvlog`), oldest first."""
    notes: list[str]


def collect(run: RunRecords, steps: StepFilter | None = None) -> ReportData:
    """The report's data from ``run`` (only ``steps``' checkpoints when given).

    Raises :class:`~shoal.errors.ShoalError` when the coordinator's log is not among the logs
    (its records describe the checkpoints) or it called no save.
    """
    steps = steps or StepFilter()
    kv = sorted(run.of(KV_STATS), key=lambda e: run.wall(e, float(e.mono or 0.0)))
    if kv and not run.of("save_called"):  # a KV store's log: no checkpoints to describe
        return ReportData(run, None, [], [], kv, [])
    log = run_log(run.coordinator(COORDINATOR), rank=COORDINATOR, source=", ".join(run.sources))
    ordered: list[CheckpointRow] = []
    by_step: dict[int, list[tuple[float, CheckpointRow]]] = {}  # saves of one step, by save call
    for c in log.checkpoints:
        if c.step in steps:
            new = _row(c, log)
            ordered.append(new)
            by_step.setdefault(c.step, []).append((run.wall_at(c.where, c.saved), new))
    notes = list(log.notes)
    if not ordered:
        raise ShoalError(f"{', '.join(run.sources)}: no checkpoint of steps {steps.text!r} in these logs")

    def row_of(e: Event) -> CheckpointRow | None:
        """The save ``e`` belongs to: of the saves of its step (a step saved again after a load,
        to heal it), the last one called before it (within :data:`SAVE_CALL_SLACK_S`)."""
        saves = by_step.get(e.step) if e.step is not None else None
        if not saves or e.mono is None:
            return None
        at = run.wall(e, e.mono)
        before = [r for called, r in saves if called - SAVE_CALL_SLACK_S <= at]
        return before[-1] if before else saves[0][1]

    link_spans: dict[tuple[int, str], list[float]] = {}
    for e in run.events:
        row = row_of(e)
        if row is None:
            continue
        if isinstance(e, CheckpointRecord):
            row.staged_bytes += e.bytes
        elif isinstance(e, WriterRecord):
            key = _written_kind(e)
            row.written[key] = row.written.get(key, 0) + e.bytes
        elif e.event == "replicate":
            sent, got = int(e.get("sent_bytes") or 0), int(e.get("received_bytes") or 0)
            s0, s1 = e.get("start"), e.get("end")
            old = row.links.get(e.host, (0, 0, 0.0))
            row.links[e.host] = (old[0] + sent, old[1] + got, 0.0)
            if isinstance(s0, int | float) and isinstance(s1, int | float):
                span = link_spans.setdefault((id(row), e.host), [float("inf"), float("-inf")])
                span[0] = min(span[0], run.wall(e, s0))
                span[1] = max(span[1], run.wall(e, s1))
        elif e.rank == COORDINATOR:
            _coordinator_event(row, e)
    by_id = {id(r): r for r in ordered}
    for (row_id, link_host), (lo, hi) in link_spans.items():
        sent, got, _ = by_id[row_id].links[link_host]
        by_id[row_id].links[link_host] = (sent, got, max(0.0, hi - lo))
    loads = [e for e in run.of("loaded") if e.rank == COORDINATOR and steps.keeps(e)]
    return ReportData(run, log, sorted(ordered, key=lambda r: r.saved), loads, kv, notes)


def _row(c: LoggedCheckpoint, log: RunLog) -> CheckpointRow:
    return CheckpointRow(c.step, c.saved - log.start, dict(c.boundaries), c.durability_path, c.failed_at)


def _written_kind(e: WriterRecord) -> str:
    if e.what == "pack":
        return f"{e.tier} drain packs"
    if e.what == "replica":
        return f"{e.tier} partner copies"
    return f"{e.tier} commit files"


def _coordinator_event(row: CheckpointRow, e: Event) -> None:
    if e.event == "path":
        row.path = row.path or e.get("path")  # a checkpoint that never finished has no record of it
        row.reason = e.get("reason")
        row.predictions = e.get("predictions")
    elif e.event == "path_observed":
        b2 = e.get("b2")
        row.observed_b2 = float(b2) if isinstance(b2, int | float) else None
        row.predicted = e.get("predicted")
    elif e.event == "planned":
        for name in ("logical_bytes", "unique_bytes", "new_bytes", "reused_bytes", "dedup_bytes"):
            value = e.get(name)
            if isinstance(value, int):
                setattr(row, name, value)


# -- the page ------------------------------------------------------------------------------------

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 1100px; color: #222; line-height: 1.4; padding: 0 16px; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em; }
p.lead, p.note { color: #555; max-width: 62em; } p.note { font-size: 0.9em; }
svg { display: block; margin: 8px 0; background: #fcfcfc; border: 1px solid #e4e4e4; max-width: 100%;
      height: auto; }
svg text { font-size: 12px; fill: #333; } svg .chart-title { font-size: 14px; font-weight: 600; }
svg .axis-title { font-size: 12px; fill: #444; } svg .no-data { font-size: 15px; fill: #999; }
svg .grid { stroke: #e8e8e8; } svg .axis { stroke: #888; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: right; vertical-align: top; }
th { background: #f3f3f3; } td.text { text-align: left; max-width: 38em; }
dl.summary { display: grid; grid-template-columns: max-content auto; gap: 2px 14px; }
dl.summary dt { font-weight: 600; } dl.summary dd { margin: 0; }
"""


def _bytes_text(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.1f}"


def _cell(field_name: str, text: str, value: Any = None, *, cls: str = "") -> str:
    attr = "" if value is None else f' data-value="{escape(str(value))}"'
    klass = f' class="{cls}"' if cls else ""
    return f'<td data-field="{field_name}"{attr}{klass}>{escape(text)}</td>'


def render(data: ReportData) -> str:
    """The page: a summary, then each chart with a sentence on how to read it, then the tables."""
    run, rows = data.run, data.rows
    title = f"shoal checkpoints: {len(rows)} checkpoint(s) on {len(run.hosts())} host(s)"
    started = dt.datetime.fromtimestamp(run.origin, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        '<p class="lead">Each checkpoint is saved in four steps. <b>B1 STAGED</b>: copied into host '
        "memory (training waits only for this). <b>B2 REPLICATED</b>: a copy is on another host too. "
        "<b>B3 PERSISTED</b>: on shared storage. <b>B4 RESTARTABLE</b>: committed there, so a new "
        "job can restart from it. Times are seconds from the moment the save was called.</p>",
        _summary(data, started),
    ]
    if data.log is not None:
        parts += _checkpoint_sections(data)
    else:
        parts.append('<p class="note" data-checkpoints="none">No checkpoints in this run: its logs '
                     "hold only KV store records.</p>")  # fmt: skip
    parts += _kv_section(data)
    parts.append("</body></html>")
    return "\n".join(parts)


def _checkpoint_sections(data: ReportData) -> list[str]:
    """The charts and tables of the run's checkpoints."""
    rows = data.rows
    parts: list[str] = []
    parts += _section("Time to each boundary", _boundaries_chart(rows),
                      "One column per checkpoint, in the order they were saved. Lower is better; "
                      "B1 is the time training was paused.")  # fmt: skip
    parts += _section("Rollback exposure", _exposure_chart(data),
                      "How much training a failure at that moment would throw away, for each kind "
                      "of failure. It grows by one second per second and drops when a newer "
                      "checkpoint reaches the boundary that protects against that failure.")  # fmt: skip
    parts += _section("Predicted and observed time to B2", _prediction_chart(rows),
                      "Where shoal's model chose the path, it predicted the time to B2: the bar "
                      "marks the predicted median and the shaded band reaches up to the predicted "
                      "90th percentile. The dot is what happened.")  # fmt: skip
    parts += _section("Bytes written per tier", _bytes_chart(rows),
                      "Bytes each checkpoint wrote: drain packs and commit files on shared storage, "
                      "partner copies on the hosts' own tiers.")  # fmt: skip
    parts += _section("Deduplication", _dedup_chart(rows),
                      "Of the bytes staged, what had to be written to shared storage (new) and what "
                      "deduplication spared: chunks identical to others in the same checkpoint, and "
                      "chunks shared storage already held from earlier checkpoints.")  # fmt: skip
    parts += _section("Partner-copy link use", _link_chart(rows),
                      "Bytes per second each host sent to its partner hosts while copying a "
                      "checkpoint (only checkpoints on the partner path copy).")  # fmt: skip
    parts.append("<h2>Checkpoints</h2>")
    parts.append(_checkpoint_table(rows))
    parts.append("<h2>The path chosen per checkpoint, and why</h2>")
    parts.append(_path_table(rows))
    parts.append("<h2>Partner copies per host</h2>")
    parts.append(_link_table(rows))
    parts.append("<h2>Loads</h2>")
    parts.append(_load_table(data))
    return parts


def _kv_section(data: ReportData) -> list[str]:
    """The KV store's hit ratio per tier over time, and its counters at the end, from ``kv_stats``."""
    parts = ["<h2>KV cache store</h2>"]
    if not data.kv:
        parts.append('<p class="note" data-kv="none">No KV records in this run. A KV store writes them '
                     "when a shoal.obs.kvlog.KVRecorder follows it (docs/observability.md).</p>")  # fmt: skip
        return parts
    parts += _section("KV hit ratio per tier", _kv_chart(data),
                      "Of the blocks asked for from each tier between two records, the share it held. "
                      "A lookup goes down the tiers (DRAM, then local disk, then shared storage) and "
                      "stops at the first that holds the block.")  # fmt: skip
    last = data.kv[-1].get("tiers") or {}
    rows = "".join(
        f'<tr data-tier="{escape(name)}"><td>{escape(name)}</td>'
        + _cell("hits", str(t.get("hits", 0)), t.get("hits", 0))
        + _cell("misses", str(t.get("misses", 0)), t.get("misses", 0))
        + _cell("bytes_read", _bytes_text(t.get("bytes_read")), t.get("bytes_read"))
        + _cell("bytes_written", _bytes_text(t.get("bytes_written")), t.get("bytes_written"))
        + "</tr>"
        for name, t in last.items()
    )
    parts.append(
        "<table><thead><tr><th>tier</th><th>hits</th><th>misses</th><th>bytes read</th>"
        f"<th>bytes written</th></tr></thead><tbody>{rows}</tbody></table>"
        f'<p class="note">The counters of the last of {len(data.kv)} KV records '
        f"({int(data.kv[-1].get('corrupt') or 0)} corrupt blocks found).</p>"
    )
    return parts


def _kv_chart(data: ReportData) -> Chart:
    run, records = data.run, data.kv
    times = [run.wall(e, float(e.mono or 0.0)) for e in records]
    start = times[0]
    duration = max(times[-1] - start, 1e-9)
    chart = Chart("kv_hits", "KV hit ratio per tier over time", f"time since the first record "
                  f"({second_unit(duration).name})", "blocks found in the tier (%)", Unit("%", 1.0),
                  100.0, 0.0, duration, x_unit=second_unit(duration))  # fmt: skip
    tiers = list((records[-1].get("tiers") or {}).keys())
    drawn = False
    for k, tier in enumerate(tiers):
        points: list[tuple[float, float]] = []
        tips: list[str] = []
        for (a, _), (b, tb) in itertools.pairwise(zip(records, times, strict=True)):
            before, after = (a.get("tiers") or {}).get(tier, {}), (b.get("tiers") or {}).get(tier, {})
            hits = int(after.get("hits", 0)) - int(before.get("hits", 0))
            misses = int(after.get("misses", 0)) - int(before.get("misses", 0))
            if hits + misses > 0:
                points.append((tb - start, 100.0 * hits / (hits + misses)))
                tips.append(
                    f"{tier}: {hits} of {hits + misses} blocks ({100.0 * hits / (hits + misses):.1f}%)"
                )
        if points:
            chart.line(points, PALETTE[k % len(PALETTE)], tier, tips=tips)
            drawn = True
    if not drawn:
        chart.empty = "no block was asked for between two KV records"
    return chart


def _section(heading: str, chart: Chart, how: str) -> list[str]:
    return [f"<h2>{escape(heading)}</h2>", f'<p class="note">{escape(how)}</p>', chart.svg()]


def _summary(data: ReportData, started: str) -> str:
    run = data.run
    hosts = ", ".join(f"{h} (ranks {', '.join(map(str, run.ranks_of(h)))})" for h in run.hosts())
    offsets = "; ".join(
        f"{o.host}: {o.offset:.6f} s (lines within {o.spread * 1e3:.3g} ms)" for o in run.offsets
    )
    items = [
        ("Started", started),
        ("Hosts", hosts),
        ("Event logs", ", ".join(run.sources)),
        ("Clock offsets", f"wall = monotonic + offset, the median of t - mono per log: {offsets}"),
    ]
    notes = [*run.notes, *data.notes]
    if notes:
        items.append(("Notes", " | ".join(notes)))
    body = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in items)
    return f'<dl class="summary">{body}</dl>'


def _steps(rows: Sequence[CheckpointRow]) -> list[str]:
    return [str(r.step) for r in rows]


def _boundaries_chart(rows: Sequence[CheckpointRow]) -> Chart:
    high = max((s for r in rows for s in r.boundaries.values()), default=0.0)
    unit = second_unit(high)
    chart = Chart("boundaries", "Time from the save call to each boundary, per checkpoint",
                  "checkpoint (step number), in the order saved", "time since the save call", unit,
                  high, categories=_steps(rows))  # fmt: skip
    if high <= 0:
        chart.empty = "no checkpoint reached a boundary"
        return chart
    for k, name in enumerate(BOUNDARIES):
        points = [(i, r.boundaries[name]) for i, r in enumerate(rows) if name in r.boundaries]
        tips = [f"step {rows[i].step}: {LABELS[name]} after {unit.text(v, 4)}" for i, v in points]
        chart.line(points, PALETTE[k], LABELS[name], tips=tips)
    return chart


def _exposure_chart(data: ReportData) -> Chart:
    assert data.log is not None  # only a run with checkpoints draws it
    timeline = data.log.timeline()
    start = timeline.start
    high = max((v for c in timeline.classes.values() for _, v in c.points), default=0.0)
    duration = timeline.end - start
    chart = Chart("exposure", "Rollback exposure per failure class over the run",
                  f"time since the run started ({second_unit(duration).name})",
                  "training a failure would lose", second_unit(high), high, 0.0, duration,
                  x_unit=second_unit(duration))  # fmt: skip
    if high <= 0 or duration <= 0:
        chart.empty = "the run has no duration"
        return chart
    for k, (name, c) in enumerate(timeline.classes.items()):
        points = [(t - start, v) for t, v in c.points]
        chart.line(points, PALETTE[k], CLASS_LABELS.get(name, name), dots=False)
    return chart


def _prediction_chart(rows: Sequence[CheckpointRow]) -> Chart:
    with_b2 = [r for r in rows if r.observed_b2 is not None]
    values = [r.observed_b2 or 0.0 for r in with_b2]
    for r in with_b2:
        if r.predicted:
            values += [float(r.predicted.get("seconds", 0.0)), float(r.predicted.get("typical", 0.0))]
    high = max(values, default=0.0)
    unit = second_unit(high)
    chart = Chart("b2_prediction", "Predicted and observed time to B2 (REPLICATED), per checkpoint",
                  "checkpoint (step number)", "time from the save call to B2", unit, high,
                  categories=[str(r.step) for r in with_b2])  # fmt: skip
    if not with_b2:
        chart.empty = "no checkpoint of these records reached B2 with its times observed"
        return chart
    predicted = 0
    for i, r in enumerate(with_b2):
        p = r.predicted
        if p:
            predicted += 1
            q = round(float(p.get("q", 0.9)) * 100)
            lo, hi = float(p.get("typical", 0.0)), float(p.get("seconds", 0.0))
            chart.band(
                i,
                lo,
                hi,
                PALETTE[0],
                f"step {r.step} ({r.path}): predicted median {unit.text(lo, 4)}, p{q} {unit.text(hi, 4)}",
            )
            chart.tick(i, lo, PALETTE[0], f"step {r.step}: predicted median {unit.text(lo, 4)}")
        assert r.observed_b2 is not None
        chart.dot(
            i, r.observed_b2, PALETTE[3], f"step {r.step} ({r.path}): observed {unit.text(r.observed_b2, 4)}"
        )
    chart.legend("predicted median to p90 (the chosen path)", PALETTE[0])
    chart.legend("observed", PALETTE[3])
    if not predicted:
        chart.legend("(no model predictions: rules chose the paths)", "#bbb")
    return chart


def _bytes_chart(rows: Sequence[CheckpointRow]) -> Chart:
    kinds = sorted({k for r in rows for k in r.written})
    totals = [sum(r.written.values()) for r in rows]
    high = float(max(totals, default=0))
    unit = byte_unit(high)
    chart = Chart("bytes_per_tier", "Bytes written per checkpoint, by tier and kind",
                  "checkpoint (step number)", "bytes written", unit, high,
                  categories=_steps(rows))  # fmt: skip
    if high <= 0:
        chart.empty = "no write records for these checkpoints"
        return chart
    stacked(chart, [[float(r.written.get(k, 0)) for k in kinds] for r in rows], kinds,
            lambda i, k, v: f"step {rows[i].step}: {kinds[k]} {int(v):,} bytes ({unit.text(v)})")  # fmt: skip
    return chart


def _dedup_parts(r: CheckpointRow) -> tuple[float, float, float] | None:
    """New bytes, duplicates within the checkpoint, bytes already on shared storage (planned)."""
    if r.logical_bytes is None or r.unique_bytes is None or r.reused_bytes is None:
        return None
    new = r.unique_bytes - r.reused_bytes
    return float(new), float(r.logical_bytes - r.unique_bytes), float(r.reused_bytes)


def _dedup_chart(rows: Sequence[CheckpointRow]) -> Chart:
    parts = [_dedup_parts(r) for r in rows]
    high = max((sum(p) for p in parts if p), default=0.0)
    unit = byte_unit(high)
    title = "What each checkpoint had to write to shared storage, and what deduplication spared"
    chart = Chart("dedup", title,
                  "checkpoint (step number)", "bytes staged", unit, high,
                  categories=_steps(rows))  # fmt: skip
    if high <= 0:
        chart.empty = "no plan records with byte counts (planned events) for these checkpoints"
        return chart
    series = [
        "new: written to shared storage",
        "identical within the checkpoint",
        "already on shared storage",
    ]

    def tip(i: int, k: int, v: float) -> str:
        total = sum(parts[i] or (0.0,))
        return f"step {rows[i].step}: {series[k]} {int(v):,} bytes ({v / total:.0%})"

    stacked(chart, [list(p) if p else [0.0, 0.0, 0.0] for p in parts], series, tip)
    return chart


def _link_chart(rows: Sequence[CheckpointRow]) -> Chart:
    hosts = sorted({h for r in rows for h in r.links})
    rates = [
        [r.links[h][0] / r.links[h][2] if h in r.links and r.links[h][2] > 0 else 0.0 for h in hosts]
        for r in rows
    ]
    high = max((v for row in rates for v in row), default=0.0)
    unit = byte_unit(high)
    rate_unit = Unit(f"{unit.name}/s", unit.scale)
    chart = Chart("link_use", "Partner-copy traffic: bytes per second each host sent, per checkpoint",
                  "checkpoint (step number)", "sent per second while copying", rate_unit, high,
                  categories=_steps(rows))  # fmt: skip
    if high <= 0:
        chart.empty = "no partner copies in these checkpoints (replicate records)"
        return chart
    for k, h in enumerate(hosts):
        chart.legend(f"host {h}", PALETTE[k % len(PALETTE)])
        for i, r in enumerate(rows):
            if rates[i][k] > 0:
                sent, got, seconds = r.links[h]
                chart.bar(i, 0.0, rates[i][k], PALETTE[k % len(PALETTE)],
                          f"step {r.step}, host {h}: sent {sent:,} bytes, received {got:,} bytes in "
                          f"{seconds * 1000:.1f} ms ({rate_unit.text(rates[i][k])})",
                          part=k, parts=len(hosts))  # fmt: skip
    return chart


def _checkpoint_table(rows: Sequence[CheckpointRow]) -> str:
    kinds = sorted({k for r in rows for k in r.written})
    head = ["step", "saved at (s since start)", "path", *(f"{LABELS[b]} (ms)" for b in BOUNDARIES),
            "failed before", "bytes staged (all ranks)", *(f"bytes: {k}" for k in kinds),
            "bytes deduplicated", "deduplicated share"]  # fmt: skip
    out = [
        '<table data-table="checkpoints"><thead><tr>',
        *(f"<th>{escape(h)}</th>" for h in head),
        "</tr></thead><tbody>",
    ]
    for r in rows:
        share = None if r.dedup_bytes is None or not r.logical_bytes else r.dedup_bytes / r.logical_bytes
        cells = [
            _cell("step", str(r.step), r.step),
            _cell("saved", f"{r.saved:.3f}", r.saved),
            _cell("path", r.path or "", cls="text"),
            *(_cell(b, _ms(r.boundaries.get(b)), r.boundaries.get(b)) for b in BOUNDARIES),
            _cell("failed_at", r.failed_at or "", cls="text"),
            _cell("staged_bytes", _bytes_text(r.staged_bytes), r.staged_bytes),
            *(_cell(f"written:{k}", _bytes_text(r.written.get(k, 0)), r.written.get(k, 0)) for k in kinds),
            _cell("dedup_bytes", _bytes_text(r.dedup_bytes), r.dedup_bytes),
            _cell("dedup_share", "" if share is None else f"{share:.1%}", share),
        ]
        out.append(f'<tr data-step="{r.step}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _prediction_text(predictions: Mapping[str, Any] | None, path: str) -> tuple[str, Any]:
    p = (predictions or {}).get(path)
    if not isinstance(p, Mapping):
        return "", None
    return (
        f"{float(p.get('seconds', 0.0)) * 1000:.1f} (median {float(p.get('typical', 0.0)) * 1000:.1f})",
        p.get("seconds"),
    )


def _path_table(rows: Sequence[CheckpointRow]) -> str:
    paths = sorted({p for r in rows for p in (r.predictions or {})} | {"direct", "partner"})
    head = ["step", "path chosen", "why (the policy's words)",
            *(f"predicted p90 to B2 by {p} (ms)" for p in paths), "observed B2 (ms)"]  # fmt: skip
    out = [
        '<table data-table="paths"><thead><tr>',
        *(f"<th>{escape(h)}</th>" for h in head),
        "</tr></thead><tbody>",
    ]
    for r in rows:
        cells = [_cell("step", str(r.step), r.step), _cell("path", r.path or "", cls="text"),
                 _cell("reason", r.reason or "", cls="text")]  # fmt: skip
        for p in paths:
            text, value = _prediction_text(r.predictions, p)
            cells.append(_cell(f"predicted:{p}", text, value))
        cells.append(_cell("observed_b2", _ms(r.observed_b2), r.observed_b2))
        out.append(f'<tr data-step="{r.step}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _link_table(rows: Sequence[CheckpointRow]) -> str:
    if not any(r.links for r in rows):
        return '<p class="note">No partner copies in these checkpoints.</p>'
    head = ["step", "host", "bytes sent", "bytes received", "copy time (ms)", "sent per second"]
    out = [
        '<table data-table="links"><thead><tr>',
        *(f"<th>{escape(h)}</th>" for h in head),
        "</tr></thead><tbody>",
    ]
    for r in rows:
        for h, (sent, got, seconds) in sorted(r.links.items()):
            rate = sent / seconds if seconds > 0 else None
            unit = byte_unit(rate or 0.0)
            cells = [_cell("step", str(r.step), r.step), _cell("host", h, cls="text"),
                     _cell("sent_bytes", _bytes_text(sent), sent),
                     _cell("received_bytes", _bytes_text(got), got),
                     _cell("seconds", _ms(seconds), seconds),
                     _cell("rate", "" if rate is None else f"{unit.text(rate)}/s", rate)]  # fmt: skip
            out.append(f'<tr data-step="{r.step}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _load_table(data: ReportData) -> str:
    if not data.loads:
        return '<p class="note">No loads in these records.</p>'
    head = ["step loaded", "restored from", "time (ms)", "bytes read per tier", "bytes over the fabric",
            "chunks repaired"]  # fmt: skip
    out = [
        '<table data-table="loads"><thead><tr>',
        *(f"<th>{escape(h)}</th>" for h in head),
        "</tr></thead><tbody>",
    ]
    for e in data.loads:
        tiers = e.get("bytes_by_tier") or {}
        text = (
            ", ".join(f"{k}: {int(v):,}" for k, v in sorted(tiers.items())) if isinstance(tiers, dict) else ""
        )
        seconds = e.get("seconds")
        cells = [_cell("step", str(e.step), e.step), _cell("origin", str(e.get("origin") or ""), cls="text"),
                 _cell("seconds", _ms(seconds if isinstance(seconds, int | float) else None), seconds),
                 _cell("bytes_by_tier", text, cls="text"),
                 _cell("fabric_bytes", _bytes_text(e.get("fabric_bytes")), e.get("fabric_bytes")),
                 _cell("repaired", str(e.get("repaired", "")), e.get("repaired"))]  # fmt: skip
        out.append(f'<tr data-step="{e.step}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def write_report(html: str, path: str) -> None:
    """Write the page to ``path`` (through a temporary file renamed into place)."""
    write_output(path, html, "the report")
