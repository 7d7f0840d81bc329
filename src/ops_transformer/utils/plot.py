"""Line charts as PNG files, in pure Python (no matplotlib).

The chart is drawn into an RGB byte buffer (``3·width·height`` bytes, row-major, white
background): a plot frame, "nice" tick values (1, 2 or 5 × 10^k) with labels in a built-in 5x7
bitmap font, one colour per series from :data:`PALETTE`, and a legend. :func:`encode_png` then
writes the buffer as a PNG (RFC 2083): the 8-byte signature, then ``IHDR`` (8-bit RGB),
one zlib-compressed ``IDAT`` whose rows each start with filter byte 0, and ``IEND``; every chunk is
``length · type · data · CRC-32(type + data)``.

Series are plotted against their index (``x = 0, 1, …``). Non-finite values (NaN, ±inf, e.g. a
diverged loss) are skipped and break the line; an isolated point is drawn as a dot.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# One colour per series, cycled (the first colours of matplotlib's "tab10").
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
_BLACK, _GREY, _WHITE = (0, 0, 0), (225, 225, 225), (255, 255, 255)

# 5x7 glyphs: seven rows of five bits, most significant bit leftmost. Lower case renders as upper.
_FONT_HEX = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F", "3": "1F02040201110E",
    "4": "02060A121F0202", "5": "1F101E0101110E", "6": "0608101E11110E", "7": "1F010204080808",
    "8": "0E11110E11110E", "9": "0E11110F01020C", "A": "0E11111F111111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F", "F": "1F10101E101010",
    "G": "0E11101711110F", "H": "1111111F111111", "I": "0E04040404040E", "J": "0702020202120C",
    "K": "11121418141211", "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D", "R": "1E11111E141211",
    "S": "0F10100E01011E", "T": "1F040404040404", "U": "1111111111110E", "V": "11111111110A04",
    "W": "1111111515150A", "X": "11110A040A1111", "Y": "1111110A040404", "Z": "1F01020408101F",
    ".": "00000000000C0C", "-": "0000001F000000", "=": "00001F001F0000", "+": "0004041F040400",
    ":": "000C0C000C0C00", "/": "00010204081000", "_": "0000000000001F", "(": "02040808080402",
    ")": "08040202020408", ",": "000000000C0408", "?": "0E110102040004", " ": "00000000000000",
}
_FONT = {ch: [int(bits[2 * r: 2 * r + 2], 16) for r in range(7)] for ch, bits in _FONT_HEX.items()}


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (3 * width * height))

    def set(self, x: int, y: int, rgb) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i: i + 3] = bytes(rgb)

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb) -> None:
        """Fill the inclusive rectangle ``[x0, x1] × [y0, y1]``."""
        for y in range(y0, y1 + 1):
            for x in range(x0, x1 + 1):
                self.set(x, y, rgb)

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb, thick: int = 1) -> None:
        """Bresenham's line, each point drawn as a ``thick × thick`` square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x0, y0, x0 + thick - 1, y0 + thick - 1, rgb)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, rgb=_BLACK, scale: int = 1) -> None:
        """Draw ``s`` with its top-left corner at ``(x, y)``; each glyph is 6·scale wide."""
        for k, ch in enumerate(s.upper()):
            rows = _FONT.get(ch, _FONT["?"])
            for r, bits in enumerate(rows):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        px, py = x + (6 * k + c) * scale, y + r * scale
                        self.rect(px, py, px + scale - 1, py + scale - 1, rgb)


def text_width(s: str, scale: int = 1) -> int:
    return 6 * scale * len(s)


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Tick values covering ``[lo, hi]`` at a step of 1, 2 or 5 × 10^k (Heckbert, Graphics Gems
    1990, "Nice numbers for graph labels")."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    ticks = [(first + i) * step for i in range(int((hi - first * step) / step + 1e-9) + 1)]
    return [round(t, 12) for t in ticks]


def _label(v: float) -> str:
    return str(int(v)) if v == int(v) and abs(v) < 1e9 else f"{v:.4g}"


def _padded_range(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if lo == hi:  # a flat series or a single point: centre it in a band of ±5% (or ±1)
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def encode_png(pixels: bytes | bytearray, width: int, height: int) -> bytes:
    """PNG bytes of an 8-bit RGB image given as ``3·width·height`` row-major bytes."""
    if len(pixels) != 3 * width * height:
        raise ValueError(f"pixels has {len(pixels)} bytes, expected 3*width*height = "
                         f"{3 * width * height} for width {width}, height {height}")

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(pixels[y * stride: (y + 1) * stride]) for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b""))


def write_line_plot_png(path: str | Path, series: dict[str, list[float]], *, title: str = "",
                        xlabel: str = "step", ylabel: str = "loss", width: int = 640,
                        height: int = 400) -> Path:
    """Write a chart of ``series`` (name → y values at x = 0, 1, …) to ``path``; return the path.

    A chart whose series hold no finite value is still written: frame and labels, no lines.
    """
    if not series:
        raise ValueError("series is empty: pass at least one name -> list of values")
    if width < 160 or height < 120:
        raise ValueError(f"width x height must be at least 160 x 120, got {width} x {height}")
    points = {name: [(i, float(v)) for i, v in enumerate(vals) if math.isfinite(float(v))]
              for name, vals in series.items()}
    ys = [v for pts in points.values() for _, v in pts]
    y_lo, y_hi = _padded_range(ys) if ys else (0.0, 1.0)
    x_hi = max((len(v) - 1 for v in series.values()), default=0) or 1
    y_ticks = nice_ticks(y_lo, y_hi)
    left = 14 + max(text_width(_label(t)) for t in y_ticks)
    top, right, bottom = 28, width - 12, height - 32  # the plot area's frame
    canvas = _Canvas(width, height)

    def px(x: float) -> int:
        return left + round((right - left) * x / x_hi)

    def py(y: float) -> int:
        return bottom - round((bottom - top) * (y - y_lo) / (y_hi - y_lo))

    for t in y_ticks:  # horizontal grid lines with labels on the left
        canvas.line(left + 1, py(t), right - 1, py(t), _GREY)
        canvas.line(left - 4, py(t), left, py(t), _BLACK)
        canvas.text(left - 6 - text_width(_label(t)), py(t) - 3, _label(t))
    for t in nice_ticks(0, x_hi, target=6):
        if t == int(t):
            canvas.line(px(t), bottom, px(t), bottom + 4, _BLACK)
            canvas.text(px(t) - text_width(_label(t)) // 2, bottom + 7, _label(t))
    for x0, y0, x1, y1 in ((left, top, right, top), (left, bottom, right, bottom),
                           (left, top, left, bottom), (right, top, right, bottom)):
        canvas.line(x0, y0, x1, y1, _BLACK)
    canvas.text((width - text_width(title, 2)) // 2, 4, title, scale=2)
    canvas.text((left + right - text_width(xlabel)) // 2, height - 12, xlabel)
    canvas.text(4, top - 9, ylabel)

    for k, (name, pts) in enumerate(points.items()):
        rgb = PALETTE[k % len(PALETTE)]
        for j, (i, v) in enumerate(pts):
            joined_prev = j > 0 and pts[j - 1][0] == i - 1
            joined_next = j + 1 < len(pts) and pts[j + 1][0] == i + 1
            if joined_prev:
                canvas.line(px(pts[j - 1][0]), py(pts[j - 1][1]), px(i), py(v), rgb, thick=2)
            elif not joined_next:  # isolated point: a dot
                canvas.rect(px(i) - 2, py(v) - 2, px(i) + 2, py(v) + 2, rgb)
    for k, name in enumerate(points):
        rgb = PALETTE[k % len(PALETTE)]
        ly = top + 6 + 12 * k  # legend entry, top-right inside the frame
        lx = right - 8 - text_width(name) - 20
        canvas.rect(lx - 3, ly - 2, right - 5, ly + 9, _WHITE)
        canvas.rect(lx, ly + 2, lx + 13, ly + 4, rgb)
        canvas.text(lx + 18, ly, name)

    path = Path(path)
    path.write_bytes(encode_png(canvas.pixels, width, height))
    return path
