"""Small SVG charts drawn in Python for the HTML report: axes with ticks and labels, lines, bars, bands.

No scripts, no fonts or styles from elsewhere: each chart is one ``<svg>`` element with a
``<title>``, its axes titled with their units, and a legend; every mark carries a ``<title>``
(the browser shows it on hover) with its exact value. A chart with nothing to draw says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

__all__ = ["Chart", "Unit", "byte_unit", "nice_ticks", "second_unit"]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")

WIDTH, HEIGHT = 820, 320
LEFT, RIGHT, TOP, BOTTOM = 78, 24, 46, 58


@dataclass(frozen=True)
class Unit:
    """How the numbers of an axis are shown: divided by ``scale``, followed by ``name``."""

    name: str
    scale: float

    def text(self, value: float, digits: int = 3) -> str:
        return f"{value / self.scale:.{digits}g} {self.name}"


def second_unit(largest: float) -> Unit:
    """Milliseconds under a second, seconds under two minutes, else minutes."""
    if largest < 1.0:
        return Unit("ms", 1e-3)
    if largest < 120.0:
        return Unit("s", 1.0)
    return Unit("min", 60.0)


def byte_unit(largest: float) -> Unit:
    for name, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if largest >= scale:
            return Unit(name, float(scale))
    return Unit("bytes", 1.0)


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``high`` (about ``count`` of them)."""
    if not high > 0 or not math.isfinite(high):
        return [0.0, 1.0]
    raw = high / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    ticks = [0.0]
    while ticks[-1] < high * (1 - 1e-9):
        ticks.append(ticks[-1] + step)
    return ticks


def _fmt(value: float) -> str:
    return f"{value:.4g}"


@dataclass
class Chart:
    """One chart: a title, the x and y axes' titles, marks added by the draw methods."""

    name: str
    title: str
    x_title: str
    y_title: str
    y_unit: Unit = field(default_factory=lambda: Unit("", 1.0))
    y_high: float = 1.0
    x_low: float = 0.0
    x_high: float = 1.0
    categories: Sequence[str] = ()
    """Labels of a categorical x axis (one slot each); empty: a numeric x axis from x_low to x_high."""
    x_unit: Unit = field(default_factory=lambda: Unit("", 1.0))
    _marks: list[str] = field(default_factory=list)
    _legend: list[tuple[str, str, str]] = field(default_factory=list)
    empty: str | None = None
    """Why there is nothing to draw (the chart then says so instead)."""

    # -- coordinates ------------------------------------------------------------------------
    @property
    def _yticks(self) -> list[float]:
        return nice_ticks(self.y_high / self.y_unit.scale)

    @property
    def _ytop(self) -> float:
        return self._yticks[-1] * self.y_unit.scale

    def y(self, value: float) -> float:
        plot = HEIGHT - TOP - BOTTOM
        return HEIGHT - BOTTOM - plot * (value / self._ytop if self._ytop > 0 else 0.0)

    def x(self, value: float) -> float:
        plot = WIDTH - LEFT - RIGHT
        if self.categories:
            return LEFT + plot * (value + 0.5) / len(self.categories)
        span = self.x_high - self.x_low
        return LEFT + plot * ((value - self.x_low) / span if span > 0 else 0.5)

    @property
    def slot(self) -> float:
        """The width of one category on the x axis, in pixels."""
        return (WIDTH - LEFT - RIGHT) / max(1, len(self.categories))

    # -- marks ------------------------------------------------------------------------------
    def legend(self, label: str, color: str, shape: str = "rect") -> None:
        self._legend.append((label, color, shape))

    def line(self, points: Sequence[tuple[float, float]], color: str, label: str, *, dots: bool = True,
             dash: str = "", tips: Sequence[str] | None = None) -> None:  # fmt: skip
        if not points:
            return
        path = " ".join(f"{self.x(a):.2f},{self.y(b):.2f}" for a, b in points)
        style = f' stroke-dasharray="{dash}"' if dash else ""
        self._marks.append(
            f'<polyline class="series" data-series="{escape(label)}" points="{path}" fill="none" '
            f'stroke="{color}" stroke-width="2"{style}/>'
        )
        if dots:
            for i, (a, b) in enumerate(points):
                tip = tips[i] if tips else f"{label}: {self.y_unit.text(b, 4)}"
                self._marks.append(
                    f'<circle cx="{self.x(a):.2f}" cy="{self.y(b):.2f}" r="3.5" fill="{color}">'
                    f"<title>{escape(tip)}</title></circle>"
                )
        self.legend(label, color, "line")

    def bar(self, slot: float, low: float, high: float, color: str, tip: str, *, part: int = 0,
            parts: int = 1) -> None:  # fmt: skip
        """A bar in category ``slot`` from ``low`` to ``high`` (``part`` of ``parts`` side by side)."""
        width = self.slot * 0.7 / parts
        left = self.x(slot) - self.slot * 0.35 + part * width
        top, bottom = self.y(high), self.y(low)
        self._marks.append(
            f'<rect class="bar" x="{left:.2f}" y="{top:.2f}" width="{max(1.0, width - 1):.2f}" '
            f'height="{max(0.5, bottom - top):.2f}" fill="{color}"><title>{escape(tip)}</title></rect>'
        )

    def band(self, slot: float, low: float, high: float, color: str, tip: str) -> None:
        """A shaded interval in category ``slot``."""
        left = self.x(slot) - self.slot * 0.3
        top, bottom = self.y(high), self.y(low)
        self._marks.append(
            f'<rect class="band" x="{left:.2f}" y="{top:.2f}" width="{self.slot * 0.6:.2f}" '
            f'height="{max(1.0, bottom - top):.2f}" fill="{color}" fill-opacity="0.25" stroke="{color}" '
            f'stroke-opacity="0.6"><title>{escape(tip)}</title></rect>'
        )

    def tick(self, slot: float, value: float, color: str, tip: str) -> None:
        """A short horizontal mark in category ``slot`` at ``value`` (a median)."""
        x, y = self.x(slot), self.y(value)
        half = self.slot * 0.3
        self._marks.append(
            f'<line class="tick-mark" x1="{x - half:.2f}" x2="{x + half:.2f}" y1="{y:.2f}" y2="{y:.2f}" '
            f'stroke="{color}" stroke-width="2.5"><title>{escape(tip)}</title></line>'
        )

    def dot(self, slot: float, value: float, color: str, tip: str) -> None:
        self._marks.append(
            f'<circle class="dot" cx="{self.x(slot):.2f}" cy="{self.y(value):.2f}" r="5" fill="{color}" '
            f'stroke="white"><title>{escape(tip)}</title></circle>'
        )

    # -- the whole --------------------------------------------------------------------------
    def svg(self) -> str:
        out = [
            f'<svg data-chart="{escape(self.name)}" role="img" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}">',
            f"<title>{escape(self.title)}</title>",
            f'<text class="chart-title" x="{LEFT}" y="20">{escape(self.title)}</text>',
        ]
        if self.empty is not None:
            out.append(
                f'<text class="no-data" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                f"no data: {escape(self.empty)}</text>"
            )
            out.append("</svg>")
            return "\n".join(out)
        out.extend(self._axes())
        out.extend(self._marks)
        out.extend(self._legend_marks())
        out.append("</svg>")
        return "\n".join(out)

    def _axes(self) -> list[str]:
        out = []
        x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP
        for t in self._yticks:
            y = self.y(t * self.y_unit.scale)
            out.append(f'<line class="grid" x1="{x0}" x2="{x1}" y1="{y:.2f}" y2="{y:.2f}"/>')
            out.append(f'<text class="tick" x="{x0 - 6}" y="{y + 4:.2f}" text-anchor="end">{_fmt(t)}</text>')
        out.append(f'<line class="axis" x1="{x0}" x2="{x1}" y1="{y0}" y2="{y0}"/>')
        out.append(f'<line class="axis" x1="{x0}" x2="{x0}" y1="{y0}" y2="{y1}"/>')
        if self.categories:
            every = max(1, math.ceil(len(self.categories) / 24))
            for i, label in enumerate(self.categories):
                if i % every == 0:
                    out.append(
                        f'<text class="tick" x="{self.x(i):.2f}" y="{y0 + 16}" text-anchor="middle">'
                        f"{escape(label)}</text>"
                    )
        else:
            for t in nice_ticks((self.x_high - self.x_low) / self.x_unit.scale, 8):
                value = self.x_low + t * self.x_unit.scale
                if value > self.x_high * (1 + 1e-9) + 1e-12:
                    break
                x = self.x(value)
                out.append(
                    f'<text class="tick" x="{x:.2f}" y="{y0 + 16}" text-anchor="middle">{_fmt(t)}</text>'
                )
        unit = f" ({self.y_unit.name})" if self.y_unit.name else ""
        out.append(
            f'<text class="axis-title" x="{(x0 + x1) / 2}" y="{HEIGHT - 14}" text-anchor="middle">'
            f"{escape(self.x_title)}</text>"
        )
        out.append(
            f'<text class="axis-title" transform="translate(16,{(y0 + y1) / 2}) rotate(-90)" '
            f'text-anchor="middle">{escape(self.y_title + unit)}</text>'
        )
        return out

    def _legend_marks(self) -> list[str]:
        out, x = [], float(LEFT)
        seen: set[str] = set()
        for label, color, shape in self._legend:
            if label in seen:
                continue
            seen.add(label)
            if shape == "line":
                out.append(
                    f'<line x1="{x}" x2="{x + 16}" y1="34" y2="34" stroke="{color}" stroke-width="3"/>'
                )
            else:
                out.append(f'<rect x="{x}" y="28" width="14" height="12" fill="{color}" fill-opacity="0.8"/>')
            out.append(f'<text class="legend" x="{x + 20}" y="38">{escape(label)}</text>')
            x += 28 + 6.6 * len(label)
        return out


def stacked(
    chart: Chart,
    values: Sequence[Sequence[float]],
    series: Sequence[str],
    tip: Callable[[int, int, float], str],
) -> None:
    """Stacked bars: ``values[slot][k]`` of series ``k`` in each category slot."""
    for k, name in enumerate(series):
        chart.legend(name, PALETTE[k % len(PALETTE)])
    for i, row in enumerate(values):
        base = 0.0
        for k, v in enumerate(row):
            if v > 0:
                chart.bar(i, base, base + v, PALETTE[k % len(PALETTE)], tip(i, k, v))
                base += v
