"""Utilities: the pure-Python PNG line plot, the progress bar and plain-text tables."""

from __future__ import annotations

import io
import math
import struct
import zlib

import pytest

from ops_transformer.utils.plot import (PALETTE, PNG_SIGNATURE, encode_png, nice_ticks,
                                        write_line_plot_png)
from ops_transformer.utils.progress import (Progress, format_duration, format_number,
                                            format_table)

# ---------------------------------------------------------------------------------------- PNG


def _read_png(data: bytes) -> tuple[int, int, bytes]:
    """Parse an 8-bit RGB PNG written by ``encode_png``: check every CRC, return the pixels."""
    assert data[:8] == PNG_SIGNATURE
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos: pos + 4])
        kind, body = data[pos + 4: pos + 8], data[pos + 8: pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length: pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == height * (1 + 3 * width)
    stride = 1 + 3 * width
    assert all(raw[y * stride] == 0 for y in range(height))  # filter type "None" on every row
    pixels = b"".join(raw[y * stride + 1: (y + 1) * stride] for y in range(height))
    return width, height, pixels


def _has_colour(pixels: bytes, rgb) -> int:
    return sum(1 for i in range(0, len(pixels), 3) if tuple(pixels[i: i + 3]) == tuple(rgb))


def test_encode_png_roundtrip():
    pixels = bytes(range(256)) * 3 * 2  # 32 x 16 pixels, 3 bytes each
    w, h, back = _read_png(encode_png(pixels, 32, 16))
    assert (w, h, back) == (32, 16, pixels)
    with pytest.raises(ValueError, match="pixels has 5 bytes, expected 3\\*width\\*height = 12"):
        encode_png(b"\0" * 5, 2, 2)


def test_line_plot_is_a_valid_png_with_each_series_colour(tmp_path):
    series = {"tp=1": [5 - math.log1p(i) for i in range(50)],
              "tp=2": [5.1 - math.log1p(i) for i in range(50)]}
    path = write_line_plot_png(tmp_path / "loss.png", series, title="loss", width=320, height=200)
    assert path == tmp_path / "loss.png"
    w, h, pixels = _read_png(path.read_bytes())
    assert (w, h) == (320, 200)
    assert _has_colour(pixels, PALETTE[0]) > 50 and _has_colour(pixels, PALETTE[1]) > 50
    assert _has_colour(pixels, PALETTE[2]) == 0
    assert _has_colour(pixels, (0, 0, 0)) > 100  # frame, ticks and labels


@pytest.mark.parametrize("values", [[3.0], [2.0] * 10, [1.0, math.nan, 2.0, math.inf, -math.inf],
                                    [math.nan, 1.0, math.nan]])
def test_line_plot_edge_cases(tmp_path, values):
    path = write_line_plot_png(tmp_path / "p.png", {"s": values})
    w, h, pixels = _read_png(path.read_bytes())
    assert (w, h) == (640, 400)
    assert _has_colour(pixels, PALETTE[0]) > 14  # the legend swatch plus the points or line


def test_line_plot_without_finite_values_still_writes(tmp_path):
    path = write_line_plot_png(tmp_path / "p.png", {"diverged": [math.nan, math.inf]})
    _read_png(path.read_bytes())


def test_line_plot_errors(tmp_path):
    with pytest.raises(ValueError, match="series is empty"):
        write_line_plot_png(tmp_path / "p.png", {})
    with pytest.raises(ValueError, match="at least 160 x 120, got 100 x 400"):
        write_line_plot_png(tmp_path / "p.png", {"a": [1.0]}, width=100)


def test_nice_ticks():
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(2.33, 2.71) == [2.4, 2.5, 2.6, 2.7]
    assert nice_ticks(-0.3, 0.7) == [-0.2, 0.0, 0.2, 0.4, 0.6]
    assert nice_ticks(1.0, 1.0) == [1.0]


# ------------------------------------------------------------------------------------ Progress


def test_format_number_and_duration():
    assert format_number(2.34159) == "2.342"
    assert format_number(10234.0) == "10.23k"
    assert format_number(1_500_000) == "1.5M"
    assert format_number(37) == "37"
    assert format_number(math.nan) == "nan"
    assert format_number("1.3MB/step") == "1.3MB/step"
    assert format_duration(12) == "0:12" and format_duration(3725) == "1:02:05"


def test_progress_non_tty_prints_first_and_last_line_only():
    out = io.StringIO()
    with Progress(100, desc="train", stream=out) as bar:
        for _ in range(100):
            bar.update(loss=2.3412345, **{"tok/s": 10234.0, "comm": "1.3MB/step"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("train    1/100 [>")
    assert lines[1].startswith("train  100/100 [====================] 100% loss=2.341 "
                               "tok/s=10.23k comm=1.3MB/step  in 0:0")


def test_progress_interval_zero_prints_every_update_and_eta():
    out = io.StringIO()
    bar = Progress(4, stream=out, interval=0)
    bar.update(2, loss=1.0)
    assert out.getvalue() == "2/4 [==========>         ]  50% loss=1  eta 0:00\n"
    bar.update()
    bar.update()
    bar.close()
    bar.close()
    assert len(out.getvalue().splitlines()) == 3


def test_progress_close_prints_unfinished_state():
    out = io.StringIO()
    with Progress(10, stream=out) as bar:
        for _ in range(3):
            bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith(" 3/10 [======>")


def test_progress_tty_redraws_in_place():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with Progress(3, desc="eval", stream=out, interval=0) as bar:
        bar.write("hello")
        for _ in range(3):
            bar.update()
    text = out.getvalue()
    assert text.startswith("hello\n\reval  1/3 [") and text.endswith("in 0:00 \n")  # padded over the longer "eta" line
    assert text.count("\r") == 3 and text.count("\n") == 2


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
