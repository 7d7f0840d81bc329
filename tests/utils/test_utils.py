"""Utilities: the matplotlib pictures, the progress bar (tqdm) and plain-text tables."""

from __future__ import annotations

import io
import math

import pytest

from ops_transformer.utils.plot import (write_bar_pairs_png, write_line_plot_png,
                                        write_stacked_bars_png, write_timeline_png)
from ops_transformer.utils.progress import (Progress, format_duration, format_number,
                                            format_table)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# --------------------------------------------------------------------------------------- PNG


def _png(path) -> tuple[int, int, set]:
    """Width, height and the set of RGB colours of a PNG file."""
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = mpimg.imread(path)
    h, w = pixels.shape[:2]
    import numpy as np

    # the distinct pixels first (one numpy call instead of a Python loop over 256 000 pixels)
    flat = np.unique(pixels.reshape(-1, pixels.shape[2])[:, :3], axis=0)
    colours = {tuple(int(round(255 * c)) for c in px) for px in flat}
    return w, h, colours


def test_line_plot_is_a_png_of_the_requested_size_with_each_series(tmp_path):
    series = {"tp=1": [5 - math.log1p(i) for i in range(50)],
              "tp=2": [5.1 - math.log1p(i) for i in range(50)]}
    path = write_line_plot_png(tmp_path / "loss.png", series, title="loss", width=320, height=200)
    assert path == tmp_path / "loss.png"
    w, h, colours = _png(path)
    assert (w, h) == (320, 200)
    assert (31, 119, 180) in colours and (255, 127, 14) in colours  # matplotlib's first two


@pytest.mark.parametrize("values", [[3.0], [2.0] * 10, [1.0, math.nan, 2.0, math.inf, -math.inf],
                                    [math.nan, 1.0, math.nan], [math.nan, math.inf]])
def test_line_plot_edge_cases(tmp_path, values):
    w, h, _ = _png(write_line_plot_png(tmp_path / "p.png", {"s": values}))
    assert (w, h) == (640, 400)


def test_line_plot_errors(tmp_path):
    with pytest.raises(ValueError, match="series is empty"):
        write_line_plot_png(tmp_path / "p.png", {})
    with pytest.raises(ValueError, match="at least 160 x 120, got 100 x 400"):
        write_line_plot_png(tmp_path / "p.png", {"a": [1.0]}, width=100)


def test_profile_pictures(tmp_path):
    bars = write_stacked_bars_png(tmp_path / "b.png", ["rank 0", "rank 1"],
                                  {"matmul": [1.0, 2.0], "exposed comm": [0.5, 0.2]})
    line = write_timeline_png(tmp_path / "t.png", [("rank 0", [(0.0, 1.0, "matmul"),
                                                               (1.0, 0.5, "comm")])])
    pairs = write_bar_pairs_png(tmp_path / "s.png", ["a", "b"], {"measured": [1.0, None],
                                                                 "predicted": [0.8, 0.9]})
    for path in (bars, line, pairs):
        assert _png(path)[2] > {(31, 119, 180)}  # drawn, in colour


# ------------------------------------------------------------------------------------ Progress


def test_format_number_and_duration():
    assert format_number(2.34159) == "2.342"
    assert format_number(10234.0) == "10.23k"
    assert format_number(1_500_000) == "1.5M"
    assert format_number(37) == "37"
    assert format_number(math.nan) == "nan"
    assert format_number("1.3MB/step") == "1.3MB/step"
    assert format_duration(12) == "0:12" and format_duration(3725) == "1:02:05"


def test_progress_non_tty_draws_rarely_and_ends_with_the_final_state():
    out = io.StringIO()
    with Progress(100, desc="train", stream=out) as bar:
        for _ in range(100):
            bar.update(loss=2.3412345, **{"tok/s": 10234.0, "comm": "1.3MB/step"})
    text = out.getvalue()
    assert text.count("\r") <= 3 and text.endswith("\n")  # first, (maybe one more), last
    final = text.rstrip("\n").split("\r")[-1]
    assert final.startswith("train: 100%") and "100/100" in final
    assert "loss=2.341 tok/s=10.23k comm=1.3MB/step" in final


def test_progress_interval_zero_draws_every_update_and_write_keeps_lines():
    out = io.StringIO()
    bar = Progress(4, stream=out, interval=0)
    bar.write("hello")
    bar.update(2, loss=1.0)
    assert "2/4" in out.getvalue() and "loss=1" in out.getvalue()
    bar.update()
    bar.update()
    bar.close()
    bar.close()
    assert "hello\n" in out.getvalue() and "4/4" in out.getvalue()


def test_progress_disabled_writes_nothing():
    out = io.StringIO()
    with Progress(5, stream=out, enabled=False) as bar:
        bar.update(5, loss=1.0)
        bar.write("x")
    assert out.getvalue() == ""


def test_progress_errors():
    with pytest.raises(ValueError, match="total must be a non-negative integer, got -1"):
        Progress(-1)


# -------------------------------------------------------------------------------------- Table


def test_format_table_alignment():
    rows = [{"tp": 1, "loss": 2.34567, "name": "dense"}, {"tp": 16, "loss": 10.5, "name": "x"},
            {"tp": 4, "name": "no-loss"}]
    assert format_table(rows).splitlines() == [
        "tp   loss  name",
        "--  -----  -------",
        " 1  2.346  dense",
        "16   10.5  x",
        " 4         no-loss",
    ]
    assert format_table(rows, ["name", "tp"]).splitlines()[0] == "name     tp"
    assert format_table([]) == ""
