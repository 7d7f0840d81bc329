"""A profile as text and pictures: the summary tables, the per-rank breakdown and a step's
timeline (``ops-transformer profile``)."""

from __future__ import annotations

from pathlib import Path

from ..utils.plot import write_stacked_bars_png, write_timeline_png
from .pipeline import pipeline_table
from ..utils.progress import format_table


def _ms(seconds) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _pct(part, whole) -> str:
    return f"{100 * part / whole:.0f}%" if whole else ""


def _gbps(bw) -> float | None:
    return None if bw is None else round(bw / 1e9, 3)


def rank_table(summary: dict) -> str:
    """One row per rank: step, compute (matmul / other), communication (exposed / overlapped),
    idle, ratio, utilisation."""
    rows = [{"rank": r["rank"], "step ms": _ms(r["step_time_s"]), "compute ms": _ms(r["compute_s"]),
             "matmul ms": _ms(r["matmul_s"]), "other ms": _ms(r["other_compute_s"]),
             "of it host ms": _ms(r["host_s"]),
             "comm ms": _ms(r["comm_s"]), "exposed ms": _ms(r["exposed_comm_s"]),
             "exposed": _pct(r["exposed_comm_s"], r["step_time_s"]),
             "overlapped ms": _ms(r["overlapped_comm_s"]), "idle ms": _ms(r["idle_s"]),
             "compute/comm": (round(r["compute_comm_ratio"], 2)
                              if r["compute_comm_ratio"] is not None else None),
             "utilisation": _pct(r["compute_s"], r["step_time_s"])}
            for r in summary["per_rank"]]
    return format_table(rows)


def collective_table(summary: dict) -> str:
    rows = [{"collective": kind, "calls/step": round(c["calls"], 2),
             "MB/step": round(c["bytes"] / 2**20, 4), "mean latency ms": _ms(c["mean_latency_s"]),
             "time ms/step": _ms(c["time_s"]), "bus GB/s": _gbps(c["bus_bandwidth_Bps"])}
            for kind, c in summary["collectives"].items()]
    return format_table(rows) if rows else "(no collectives)"


def cp_table(summary: dict) -> str | None:
    """The context-parallel collectives by ledger label (``None`` without cp)."""
    rows = [{"cp collective (label)": label, "kind": c["kind"], "calls/step": round(c["calls"], 2),
             "elements/step": int(c["elements"]), "MB/step": round(c["bytes"] / 2**20, 4)}
            for label, c in summary.get("cp_collectives", {}).items()]
    return format_table(rows) if rows else None


def operator_table(summary: dict, top: int = 8) -> str:
    rows = [{"operator": op["name"][:60], "calls/step": round(op["calls"], 1),
             "self ms/step": _ms(op["self_s"]), "total ms/step": _ms(op["total_s"])}
            for op in summary["top_operators"][:top]]
    return format_table(rows)


def critical_path_text(summary: dict, top: int = 6) -> str:
    cp = summary["critical_path"]
    shares = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in cp["by_type_s"].items())
    heavy = "; ".join(f"{h['name']} {100 * h['share']:.0f}%" for h in cp["heaviest"][:top])
    return (f"critical path: rank {cp['rank']}'s median step, {1e3 * cp['step_s']:.2f} ms "
            f"({len(cp['segments'])} segments: {shares})\n  heaviest on it: {heavy}")


def summary_text(summary: dict) -> str:
    return "\n\n".join([
        f"{summary['ranks']} rank(s), {summary['steps']} profiled steps after "
        f"{summary['warmup']} warm-up; median step {1e3 * summary['step_time_s']:.2f} ms",
        rank_table(summary), collective_table(summary),
        *[t for t in (cp_table(summary),) if t is not None], operator_table(summary),
        critical_path_text(summary)]
        + ([pipeline_table(summary["pipeline"])] if summary.get("pipeline") else []))


def write_breakdown_png(summary: dict, path) -> Path:
    """A bar per rank: compute (matmul, other operators, host Python), exposed and overlapped
    communication, idle."""
    ranks = summary["per_rank"]
    parts = {"matmul": [1e3 * r["matmul_s"] for r in ranks],
             "other ops": [1e3 * (r["other_compute_s"] - r["host_s"]) for r in ranks],
             "host (Python)": [1e3 * r["host_s"] for r in ranks],
             "exposed comm": [1e3 * r["exposed_comm_s"] for r in ranks],
             "idle": [1e3 * r["idle_s"] for r in ranks],
             "overlapped comm (beside compute)": [1e3 * r["overlapped_comm_s"] for r in ranks]}
    return write_stacked_bars_png(path, [f"rank {r['rank']}" for r in ranks], parts,
                                  title="Where a step's time goes", ylabel="ms per step (mean)")


def write_timeline_of_step_png(summary: dict, path) -> Path:
    """Each rank's median step: its step thread (operators, collectives, host gaps) and, under
    it, gloo's communication threads."""
    rows = []
    for t in summary["timelines"]:
        rows.append((f"rank {t['rank']}", [tuple(s) for s in t["segments"]]))
        if t["comm_threads"]:
            rows.append((f"rank {t['rank']} comm", [(a, d, "comm threads")
                                                    for a, d in t["comm_threads"]]))
    return write_timeline_png(path, rows, title="One step (each rank's median step)",
                              xlabel="ms from the start of the step")
