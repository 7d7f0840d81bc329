"""A minimal progress bar for long jobs, and aligned plain-text tables.

:class:`Progress` renders one line such as::

    train  37/100 [=======>            ]  37% loss=2.341 tok/s=10.2k comm=1.3MB/step  eta 0:12

On a terminal the line is redrawn in place with ``\\r`` (at most every 0.1 s, plus the last). When
the stream is not a terminal (CI logs, files) a plain line is printed at most every ``interval``
seconds (2 s by default) plus the final state, so a log of a long job stays short.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

TTY_INTERVAL_S = 0.1
LOG_INTERVAL_S = 2.0
BAR_WIDTH = 20


def format_number(value) -> str:
    """Compact text for a number: 4 significant digits; k/M/G suffixes from 10^4 upwards.

    ``2.34159 → "2.342"``, ``10234.0 → "10.23k"``, ``1.5e6 → "1.5M"``, ``37 → "37"``.
    Anything that is not a number is returned as ``str(value)``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return str(float(value))
    for threshold, scale, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / scale:.4g}{suffix}"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def format_duration(seconds: float) -> str:
    """``m:ss`` below an hour, ``h:mm:ss`` above."""
    s = max(int(seconds), 0)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Progress:
    """Progress of ``total`` units of work, written to ``stream`` (``sys.stderr`` when ``None``).

    ``update(n, **postfix)`` advances by ``n`` and merges ``postfix`` (name → value) into the
    statistics shown after the bar; names that are not identifiers go through a dict:
    ``update(loss=l, **{"tok/s": r})``. ``close()`` (or leaving a ``with`` block) prints the final
    state. With ``enabled=False`` nothing is written, so callers need not branch on the rank.
    """

    def __init__(self, total: int, *, desc: str = "", enabled: bool = True,
                 stream: TextIO | None = None, interval: float | None = None):
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a non-negative integer, got {total!r}")
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        default = TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S
        self.interval = default if interval is None else interval
        if self.interval < 0:
            raise ValueError(f"interval must be >= 0 seconds, got {self.interval}")
        self.n = 0
        self.postfix: dict[str, object] = {}
        self._start = time.monotonic()
        self._last_draw = -math.inf
        self._drawn_n: int | None = None  # the count shown by the last line written
        self._line_len = 0
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, **postfix) -> None:
        """Advance by ``n`` units and record ``postfix``; draw if due."""
        self.n += n
        self.postfix.update(postfix)
        now = time.monotonic()
        if now - self._last_draw >= self.interval or self.n >= self.total:
            self._draw(now)

    def write(self, message: str) -> None:
        """Print ``message`` on its own line without garbling the bar."""
        if not self.enabled:
            return
        if self.tty and self._line_len:
            self.stream.write("\r" + " " * self._line_len + "\r")
            self._line_len = 0
            self._drawn_n = None
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Show the final state (if not shown yet) and end the line. Safe to call twice."""
        if self._closed:
            return
        if self._drawn_n != self.n or self.tty and not self._line_len:
            self._draw(time.monotonic())
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True

    def render(self, now: float | None = None) -> str:
        """The status line for the current state."""
        elapsed = (time.monotonic() if now is None else now) - self._start
        frac = min(self.n / self.total, 1.0) if self.total else 1.0
        filled = int(BAR_WIDTH * frac)
        bar = "=" * filled
        if filled < BAR_WIDTH:
            bar += ">" + " " * (BAR_WIDTH - filled - 1)
        width = len(str(self.total))
        parts = [f"{self.desc}  " if self.desc else "",
                 f"{self.n:>{width}}/{self.total} [{bar}] {int(100 * frac):3d}%"]
        parts += [f" {k}={format_number(v)}" for k, v in self.postfix.items()]
        if self.n >= self.total:
            parts.append(f"  in {format_duration(elapsed)}")
        elif self.n > 0:
            parts.append(f"  eta {format_duration(elapsed * (self.total - self.n) / self.n)}")
        return "".join(parts)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn_n = self.n
        if not self.enabled:
            return
        line = self.render(now)
        if self.tty:  # redraw in place; pad to erase the tail of a longer previous line
            self.stream.write("\r" + line + " " * max(self._line_len - len(line), 0))
            self._line_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return format_number(value)
    return str(value)


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """An aligned plain-text table: header, a ``---`` separator, one line per row.

    ``columns`` defaults to every key in order of first appearance. A column whose present values
    are all numbers is right-aligned (floats to 4 significant digits, ints exactly); others are
    left-aligned. Missing values are blank.
    """
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    if not columns:
        return ""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    right = [all(_is_number(row[c]) for row in rows if row.get(c) is not None) for c in columns]
    widths = [max([len(c)] + [len(r[j]) for r in cells]) for j, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if r else v.ljust(w)
                         for v, w, r in zip(values, widths, right)).rstrip()

    return "\n".join([line(list(columns)), line(["-" * w for w in widths])]
                     + [line(r) for r in cells])
