"""The demo plot's texts stay on the canvas: the layout is computed, no pixels are drawn.

Once, the subtitle (rule, load, under-use, convergence) was wider than the axes it is centred
on and ran off the image's left edge.
"""

from __future__ import annotations

import random

import pytest
from matplotlib.text import Text

from geolimit.demo.fleet import region_names
from geolimit.demo.plot import PlotData, build_figure
from geolimit.sim.oracle import Request


def _data(regions: int, title: str, footer: str) -> PlotData:
    names = region_names(regions)
    rng = random.Random(7)
    requests = [Request(i * 10_000, rng.choice(names), 1, rng.random() < 0.4) for i in range(2000)]
    return PlotData(
        names=names, requests=requests, limit=1000, window=10.0, start_us=0, end_us=20_000_000,
        title=title, partition=(6.7, 13.3), cut=names[-1], views=[(1.0, names[0], 500)], footer=footer,
    )


# The longest texts the demo writes (geolimit/demo/run.py, Demo._plot_data), and longer.
TITLE = ("geolimit demo: 8 regions, 1250 ms latency, partition policy 'closed' - "
         "over-admission max 100.0%, mean 12.34%")
FOOTER = ("rule 1000/10s (1s buckets, approximate), 3x the limit offered (Poisson); under-use 100.0%; "
          "views already agreed at the heal (nothing was admitted while cut off)")


@pytest.mark.parametrize(("regions", "title", "footer"), [
    (3, TITLE, FOOTER),
    (8, TITLE, FOOTER),
    (3, TITLE + " " + TITLE, FOOTER + "; " + FOOTER),  # whatever comes next
])
def test_every_text_of_the_plot_is_inside_the_image(regions: int, title: str, footer: str) -> None:
    figure = build_figure(_data(regions, title, footer))
    figure.draw_without_rendering()  # constrained layout and text wrapping, no rasterizing
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    canvas = figure.bbox
    texts = [t for t in figure.findobj(Text) if t.get_visible() and t.get_text()]
    assert {title, footer} <= {t.get_text() for t in texts}
    for text in texts:
        box = text.get_window_extent(renderer)
        inside = canvas.x0 <= box.x0 and box.x1 <= canvas.x1 and canvas.y0 <= box.y0 and box.y1 <= canvas.y1
        assert inside, f"{text.get_text()!r} at {box} is not within the {canvas} image"
