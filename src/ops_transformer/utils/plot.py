"""Pictures as PNG files, drawn with matplotlib (the ``profiler`` extra; headless ``Agg`` backend).

- :func:`write_line_plot_png`: series against their index (the training loss);
- :func:`write_stacked_bars_png`: one stacked bar per label (the profile's per-rank breakdown);
- :func:`write_timeline_png`: one row of coloured segments per label (one step per rank);
- :func:`write_bar_pairs_png`: measured and predicted values side by side per label (a sweep),
  one row per label.

Non-finite values (a diverged loss) are left out of a line, which breaks there.
"""

from __future__ import annotations

import math
from pathlib import Path

# One colour per part of a step, shared by every profiler picture.
COLOURS = {"matmul": "#1f77b4", "compute": "#6baed6", "other ops": "#6baed6",
           "host (Python)": "#9ecae1", "exposed comm": "#d62728",
           "overlapped comm": "#ff9896", "overlapped comm (beside compute)": "#ff9896",
           "comm": "#d62728", "idle": "#e0e0e0",
           "host": "#9ecae1", "mixed": "#9edae5", "comm threads": "#ff9896"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("pictures need matplotlib: pip install 'ops-transformer[profiler]' "
                         "(make install does)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def write_line_plot_png(path: str | Path, series: dict[str, list[float]], *, title: str = "",
                        xlabel: str = "step", ylabel: str = "loss", width: int = 640,
                        height: int = 400) -> Path:
    """Write a chart of ``series`` (name → y values at x = 0, 1, …) to ``path``; return the path.
    A series with no finite value is still listed in the legend (no line)."""
    if not series:
        raise ValueError("series is empty: pass at least one name -> list of values")
    if width < 160 or height < 120:
        raise ValueError(f"width x height must be at least 160 x 120, got {width} x {height}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(width / 100, height / 100), dpi=100)
    for name, values in series.items():
        ys = [float(v) if math.isfinite(float(v)) else math.nan for v in values]
        ax.plot(range(len(ys)), ys, label=name, marker="." if len(ys) < 3 else None)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.set_dpi(100)
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_stacked_bars_png(path, labels: list[str], parts: dict[str, list[float]], *,
                           title: str = "", ylabel: str = "") -> Path:
    """One bar per label, stacked from ``parts`` (name → one value per label, bottom first)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 1.2 * len(labels) + 4), 4))
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=name, color=COLOURS.get(name))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title=title, ylabel=ylabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def write_timeline_png(path, rows: list[tuple[str, list[tuple[float, float, str]]]], *,
                       title: str = "", xlabel: str = "ms") -> Path:
    """One horizontal row per ``(label, segments)``; a segment is ``(start, length, type)``
    coloured by type (:data:`COLOURS`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.6))
    seen = set()
    for y, (_, segments) in enumerate(rows):
        for start, dur, kind in segments:
            ax.broken_barh([(start, dur)], (y - 0.35, 0.7), color=COLOURS.get(kind, "#7f7f7f"),
                           label=None if kind in seen else kind)
            seen.add(kind)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set(title=title, xlabel=xlabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def write_bar_pairs_png(path, labels: list[str], series: dict[str, list[float | None]], *,
                        title: str = "", ylabel: str = "", log: bool | None = None) -> Path:
    """Grouped horizontal bars: for each label (one row, top to bottom) one bar per series
    (``None`` leaves a gap); ``ylabel`` names the value axis. The value axis is logarithmic when
    ``log``, by default when the values span more than a factor of 20."""
    plt = _pyplot()
    longest = max((len(label) for label in labels), default=10)
    fig, ax = plt.subplots(figsize=(6 + 0.065 * longest, 0.32 * len(labels) * max(len(series), 1)
                                    / 2 + 1.8))
    height = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        ys = [i + (k - (len(series) - 1) / 2) * height for i in range(len(labels))]
        ax.barh([y for y, v in zip(ys, values) if v is not None],
                [v for v in values if v is not None], height, label=name)
    values = [v for vs in series.values() for v in vs if v is not None and v > 0]
    if log or (log is None and values and max(values) > 20 * min(values)):
        ax.set_xscale("log")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, pad=22)
    ax.set_xlabel(ylabel)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(series), frameon=False)
    return _save(fig, path)
