"""Progress bars for long jobs (tqdm), and aligned plain-text tables.

:class:`Progress` is a thin layer over ``tqdm`` (the ``profiler`` extra) that renders::

    train:  37%|███▋      | 37/100 [00:12<00:21, 2.9it/s, loss=2.341 tok/s=10.2k comm=1.3MB/step]

On a terminal the bar is redrawn in place at most every 0.1 s; on another stream (CI logs,
files) at most every ``interval`` seconds (2 s by default), plus the final state, so a log of a long
job stays short. Without tqdm installed, the final state is printed as one plain line.
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

TTY_INTERVAL_S = 0.1
LOG_INTERVAL_S = 2.0


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
        if interval is not None and interval < 0:
            raise ValueError(f"interval must be >= 0 seconds, got {interval}")
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        tty = bool(isatty and isatty())
        self.interval = (TTY_INTERVAL_S if tty else LOG_INTERVAL_S) if interval is None \
            else interval
        self.n = 0
        self.postfix: dict[str, object] = {}
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc or None, file=self.stream,
                                 mininterval=self.interval, maxinterval=max(self.interval, 10.0),
                                 dynamic_ncols=tty, ncols=None if tty else 110, leave=True)
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, **postfix) -> None:
        """Advance by ``n`` units and record ``postfix``; drawn when due."""
        self.n += n
        if postfix:
            self.postfix.update(postfix)
            if self._bar is not None:
                self._bar.set_postfix_str(self.postfix_text(), refresh=False)
        if self._bar is not None:
            self._bar.update(n)

    def render(self) -> str:
        """The status line for the current state (what the bar shows)."""
        if self._bar is not None:
            return str(self._bar)
        return (f"{self.desc + ' ' if self.desc else ''}{self.n}/{self.total} "
                f"{self.postfix_text()}").rstrip()

    def postfix_text(self) -> str:
        return " ".join(f"{k}={format_number(v)}" for k, v in self.postfix.items())

    def write(self, message: str) -> None:
        """Print ``message`` on its own line without garbling the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            self.stream.write(message + "\n")

    def close(self) -> None:
        """Show the final state and end the line. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:  # no tqdm: one plain line
            self.stream.write(self.render() + "\n")
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
