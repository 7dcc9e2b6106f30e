"""The demo's PNG: admissions per region against the limit, the partition shaded.

Top panel: what each region admitted in the trailing window (stacked), the exact
global count (the oracle's sliding window: everything admitted in the last ``W``
seconds), the limit, and each region's own view of the global count. Bottom
panel: admissions per second, stacked by region, against the sustainable rate
``limit / W``.

matplotlib is an optional dependency (the ``demo`` extra); it is imported only
here, through the Agg backend, without touching pyplot's global state.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from geolimit.errors import ConfigError
from geolimit.sim.oracle import Request

if TYPE_CHECKING:  # matplotlib is optional: imported only when a plot is drawn
    from matplotlib.figure import Figure

__all__ = ["INSTALL_HINT", "PlotData", "build_figure", "require_matplotlib", "write_plot"]

INSTALL_HINT = "pip install 'geolimit[demo]'"
_STEP = 0.1  # seconds between points of the sliding-window curves


def require_matplotlib() -> None:
    """Raise :class:`ConfigError` saying how to install matplotlib if it cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the demo's plot needs matplotlib, which cannot be imported ({exc}); "
            f"install it with: {INSTALL_HINT}   (or pass --plot '' to run without a plot)"
        ) from None


@dataclass
class PlotData:
    names: Sequence[str]
    requests: Sequence[Request]
    limit: int
    window: float  # seconds
    start_us: int
    end_us: int
    title: str
    partition: tuple[float, float] | None = None  # seconds since start
    cut: str | None = None
    views: Sequence[tuple[float, str, int]] = field(default_factory=tuple)  # (seconds, region, global view)
    footer: str = ""


def _admitted_times(data: PlotData) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in data.names}
    for r in data.requests:
        if r.allowed:
            out.setdefault(r.region, []).append((r.time_us - data.start_us) / 1e6)
    for times in out.values():
        times.sort()
    return out


def _sliding(times: list[float], grid: list[float], window: float) -> list[int]:
    """Admissions in ``(t - window, t]`` for every ``t`` of the grid."""
    return [bisect.bisect_right(times, t) - bisect.bisect_right(times, t - window) for t in grid]


def write_plot(path: str, data: PlotData) -> None:
    build_figure(data).savefig(path, format="png")


def build_figure(data: PlotData) -> Figure:
    """The figure :func:`write_plot` saves (on an Agg canvas; nothing drawn yet)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    duration = (data.end_us - data.start_us) / 1e6
    steps = max(1, int(duration / _STEP))
    grid = [i * _STEP for i in range(steps + 1)]
    admitted = _admitted_times(data)
    colors = [f"C{i % 10}" for i in range(len(data.names))]

    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    fig.suptitle(data.title, fontsize=12, wrap=True)  # wrap: within the figure, however long

    stacks = [_sliding(admitted[name], grid, data.window) for name in data.names]
    top.stackplot(grid, *stacks, labels=[f"{n} admitted" for n in data.names], colors=colors, alpha=0.55)
    truth = [sum(column) for column in zip(*stacks, strict=True)]
    top.plot(grid, truth, color="black", linewidth=1.6, label=f"true global count (oracle, trailing {data.window:g} s)")
    top.axhline(data.limit, color="red", linestyle="--", linewidth=1.4, label=f"limit {data.limit} per {data.window:g} s")
    for name, color in zip(data.names, colors, strict=True):
        points = [(t, v) for t, region, v in data.views if region == name]
        if points:
            top.plot(*zip(*points, strict=True), color=color, linestyle=":", linewidth=1.3, label=f"{name}'s view")
    top.set_ylabel(f"admitted in the trailing {data.window:g} s")
    top.set_ylim(0, max([data.limit * 1.3, *truth, *(v for _, _, v in data.views)]) * 1.05)

    seconds = max(1, int(duration + 0.999))
    left = list(range(seconds))
    base = [0] * seconds
    for name, color in zip(data.names, colors, strict=True):
        counts = [0] * seconds
        for t in admitted[name]:
            counts[min(seconds - 1, max(0, int(t)))] += 1
        bottom.bar(left, counts, width=1.0, bottom=base, align="edge", color=color, alpha=0.75, label=name)
        base = [b + c for b, c in zip(base, counts, strict=True)]
    bottom.axhline(data.limit / data.window, color="red", linestyle="--", linewidth=1.4,
                   label=f"sustainable rate {data.limit / data.window:g}/s")
    bottom.set_ylabel("admitted per second")
    bottom.set_xlabel("seconds since the traffic started")
    bottom.set_xlim(0, duration)

    for ax in (top, bottom):
        if data.partition is not None:
            ax.axvspan(*data.partition, color="grey", alpha=0.18, label=f"{data.cut} partitioned")
        ax.grid(True, alpha=0.3)
    for ax in (top, bottom):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if data.footer:
        top.set_title(data.footer, fontsize=9, color="dimgray", wrap=True)
    return fig
