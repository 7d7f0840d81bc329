"""The planner against published training runs (``ops-transformer plan --published``).

``data/published_runs.json`` holds runs that use only tensor and data parallelism, each with its
source, the layout it ran, and what the source measured (step throughput, MFU, memory). For every
row this module builds the model, cluster and layout the planner needs, evaluates exactly that
layout (:func:`~.search.evaluate_layout`) and compares.

Constants are fitted on the rows marked ``fit`` only (:func:`fit`: the matmul efficiency of each
GPU and of each GPU × stack, the memory-bound passes, the attention core's relative efficiency)
and the errors that
count are those of the ``holdout`` rows: a prediction, not a fit. :mod:`.efficiency` holds the
fitted values; a test re-runs :func:`fit` and checks they have not drifted.

Measured step time, by what the source reports:

* ``tflops_per_gpu`` (Narayanan et al. 2021): ``step = F / (N · X)`` with their FLOP count of a
  step with full recomputation, ``F = 96·B·s·l·h²·(1 + s/6h + V/16lh)`` (their eq. 3);
* ``tokens_per_s`` (all GPUs) or ``tokens_per_s_per_gpu``: ``step = B·s / throughput``.
"""

from __future__ import annotations

import json
import math
import statistics
from functools import lru_cache
from pathlib import Path

from . import efficiency as E
from .search import Options, evaluate_layout, execution, params_per_gpu, peak_flops, search
from .specs import MODEL_PRESETS, ClusterSpec, ModelSpec
from .timing import Execution, combine, step_parts

DATA = Path(__file__).with_name("data") / "published_runs.json"
GiB = 1 << 30


@lru_cache(maxsize=1)
def load() -> dict:
    return json.loads(DATA.read_text())


def run_model(row: dict) -> ModelSpec:
    data = load()["models"]
    name = row["model"]
    base = ModelSpec.from_dict(data[name]) if name in data else MODEL_PRESETS[name]
    return base.with_(seq=row["seq"], global_batch=row["global_batch"],
                      micro_batch=row["layout"]["micro_batch"])


def run_cluster(row: dict) -> ClusterSpec:
    return ClusterSpec.make(row["gpu"], row["gpus"], inter=row["inter"],
                            nics_per_node=row["nics_per_node"])


def run_options(row: dict) -> Options:
    lay = row["layout"]
    return Options(dp=lay["dp"], tp=lay["tp"], ep=1, attention="heads",
                   sequence_parallel=lay["sequence_parallel"], recompute=lay["recompute"],
                   zero_stage=lay["zero"], micro_batch=lay["micro_batch"],
                   pp=lay.get("pp", 1), cp=lay.get("cp", 1),
                   schedule=lay.get("schedule", "1f1b"),
                   virtual_stages=lay.get("virtual_stages", 1),
                   cp_strategy=lay.get("cp_strategy", "ring"))


def uses_pp_or_cp(row: dict) -> bool:
    return row["layout"].get("pp", 1) > 1 or row["layout"].get("cp", 1) > 1


def measured_step_s(row: dict, model: ModelSpec) -> float:
    m, tokens = row["measured"], model.global_batch * model.seq
    if "tflops_per_gpu" in m:
        l, h, s, v = model.layers, model.hidden, model.seq, model.vocab
        flops = 96 * model.global_batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return flops / (row["gpus"] * m["tflops_per_gpu"] * 1e12)
    if "model_tflops_per_gpu" in m:  # model FLOPs (no recomputation), the planner's count
        return model.flops_per_token() * tokens / (row["gpus"] * m["model_tflops_per_gpu"] * 1e12)
    if "tokens_per_s" in m:
        return tokens / m["tokens_per_s"]
    return tokens / (m["tokens_per_s_per_gpu"] * row["gpus"])


def _family(gpu: str, precision: str = "default") -> str:
    """Cards that share a compute die share a fitted efficiency (one per matmul precision)."""
    die = "a100" if gpu.startswith("a100") else gpu
    return die if precision == "default" else f"{die}/{precision}"


def _precision(row: dict) -> str:
    return row.get("matmul_precision", "default")


def run_execution(row: dict, *, by_stack: bool = False) -> Execution:
    """The row's kernels with the built-in constants (per GPU, or per GPU × stack)."""
    return execution(run_cluster(row), attention_kernel=row["attention_kernel"],
                     loss_kernel=row["loss_kernel"], stack=row["stack"] if by_stack else None,
                     matmul_precision=_precision(row))[0]


def _parts(row: dict) -> dict:
    model, cluster, o = run_model(row), run_cluster(row), run_options(row)
    return step_parts(model, cluster, o, run_execution(row), peak_flops(model, cluster),
                      params_per_gpu(model, o))


def _golden(f, lo: float, hi: float, iterations: int = 60) -> float:
    """The minimum of a unimodal ``f`` on ``[lo, hi]`` (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _log_error(rows, parts, eff, passes, ratio) -> float:
    return sum(math.log(combine(p, eff, passes, ratio)["step_time_s"] / r["_measured_s"]) ** 2
               for r, p in zip(rows, parts))


def fit() -> dict:
    """Constants fitted on the ``fit`` rows: ``{"by_gpu": {card: efficiency}, "by_stack":
    {(card, stack): efficiency}, "memory_passes", "attention_ratio"}``.

    The memory-bound passes and the attention ratio are shared by all rows; for given values of
    both, each GPU family's efficiency minimises the squared log error of its rows
    (golden-section search), and the two shared constants minimise the total (coordinate
    golden-section search, from 4 passes and ratio 0.6). Per-stack efficiencies are then fitted
    with the shared constants fixed."""
    rows = [dict(r, _measured_s=measured_step_s(r, run_model(r)))
            for r in load()["runs"] if r["split"] == "fit"]
    parts = [_parts(r) for r in rows]

    def best_eff(idx, passes, ratio):
        sub_r, sub_p = [rows[i] for i in idx], [parts[i] for i in idx]
        e = _golden(lambda e: _log_error(sub_r, sub_p, e, passes, ratio), 0.05, 1.0)
        return e, _log_error(sub_r, sub_p, e, passes, ratio)

    families: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        families.setdefault(_family(r["gpu"], _precision(r)), []).append(i)

    def total(passes, ratio):
        return sum(best_eff(idx, passes, ratio)[1] for idx in families.values())

    passes, ratio = 4.0, 0.6
    for _ in range(4):
        passes = _golden(lambda c: total(c, ratio), 0.0, 20.0, iterations=30)
        ratio = _golden(lambda a: total(passes, a), 0.1, 2.0, iterations=30)
    effs = {fam: best_eff(idx, passes, ratio)[0] for fam, idx in families.items()}
    cards = sorted({r["gpu"] for r in rows if _precision(r) == "default"})
    float8 = sorted({r["gpu"] for r in rows if _precision(r) == "float8"})
    by_stack = {}
    for fam, stack in sorted({(_family(r["gpu"]), r["stack"]) for r in rows
                              if _precision(r) == "default"}):
        idx = [i for i, r in enumerate(rows) if (_family(r["gpu"], _precision(r)), r["stack"])
               == (fam, stack)]
        e = round(best_eff(idx, passes, ratio)[0], 3)
        by_stack.update({(c, stack): e for c in cards if _family(c) == fam})
    return {"by_gpu": {c: round(effs[_family(c)], 3) for c in cards}, "by_stack": by_stack,
            "float8_by_gpu": {c: round(effs[_family(c, "float8")], 3) for c in float8},
            "memory_passes": round(passes, 2), "attention_ratio": round(ratio, 3),
            "rows": [r["id"] for r in rows]}


def predict(row: dict, *, by_stack: bool = False) -> dict:
    """The planner's prediction for ``row`` with the built-in constants (per GPU, or per GPU ×
    stack with ``by_stack``) next to what the source measured."""
    model, cluster, o = run_model(row), run_cluster(row), run_options(row)
    got = evaluate_layout(model, cluster, o, run_execution(row, by_stack=by_stack))
    measured = measured_step_s(row, model)
    out = {"id": row["id"], "split": row["split"], "stack": row["stack"], "gpu": row["gpu"],
           "gpus": row["gpus"], "model": row["model"], "seq": row["seq"],
           "layout": row["layout"], "measured_step_s": measured,
           "predicted_step_s": got["step_time_s"],
           "step_error": got["step_time_s"] / measured - 1, "fits": got["fits"],
           "predicted_memory_gib": got["memory_per_gpu_bytes"] / GiB,
           "measured_mfu": row["measured"].get("mfu"), "predicted_mfu": got["mfu"],
           "source": row["source"], "url": row["url"]}
    out.update(pp=o.pp, cp=o.cp, uses_pp_or_cp=uses_pp_or_cp(row),
               time_breakdown=got["time_breakdown"])
    if "memory_gib" in row["measured"]:
        out["measured_memory_gib"] = row["measured"]["memory_gib"]
        if "memory_not_modelled" in row:  # shown, not compared: what the planner leaves out
            out["memory_not_modelled"] = row["memory_not_modelled"]
        else:
            out["memory_error"] = out["predicted_memory_gib"] / row["measured"]["memory_gib"] - 1
    return out


def report(*, by_stack: bool = False) -> dict:
    """Every row's prediction and the summary: median |step error| on the hold-out and fit rows,
    how many rows are predicted not to fit, the worst memory error."""
    rows = [predict(r, by_stack=by_stack) for r in load()["runs"]]

    def median_abs(split):
        return statistics.median(abs(r["step_error"]) for r in rows if r["split"] == split)

    memory = [abs(r["memory_error"]) for r in rows if "memory_error" in r]
    return {"rows": rows, "median_abs_step_error_holdout": median_abs("holdout"),
            "holdout_rows": [r["id"] for r in rows if r["split"] == "holdout"],
            "fit_rows": [r["id"] for r in rows if r["split"] == "fit"],
            "median_abs_step_error_fit": median_abs("fit"),
            "mean_abs_step_error_holdout": statistics.fmean(
                abs(r["step_error"]) for r in rows if r["split"] == "holdout"),
            "not_fitting": [r["id"] for r in rows if not r["fits"]],
            "max_abs_memory_error": max(memory) if memory else None,
            "constants": {"by_gpu": E.FITTED_BY_GPU, "float8_by_gpu": E.FITTED_FLOAT8_BY_GPU,
                          "by_stack": {f"{g}/{s}": v for (g, s), v in E.FITTED_BY_STACK.items()},
                          "memory_passes": E.MEMORY_PASSES,
                          "attention_ratio": E.ATTENTION_RATIO},
            "by_stack": by_stack}


CHOICE_KEYS = ("dp", "tp", "pp", "cp", "schedule", "virtual_stages", "cp_strategy",
               "sequence_parallel", "recompute", "zero_stage", "micro_batch")


def planner_choice(row: dict) -> dict | None:
    """The layout the planner would choose for ``row``'s model, batch and sequence on the same
    cards (the 4-D search, :func:`~.search.search` with ``runnable_only=False``, under the row's
    kernels), with its predicted step time; ``None`` when nothing fits."""
    best = search(run_model(row), run_cluster(row), top=1, run=run_execution(row),
                  runnable_only=False)["best"]
    if best is None:
        return None
    return {**{k: best[k] for k in CHOICE_KEYS}, "predicted_step_s": best["step_time_s"],
            "fits": best["fits"], "memory_per_gpu_gib": best["memory_per_gpu_bytes"] / GiB,
            "train_problem": best["train_problem"]}


def _choice_text(c: dict) -> str:
    lay = {"tp": c["tp"], "dp": c["dp"], "pp": c["pp"], "cp": c["cp"],
           "schedule": c["schedule"], "virtual_stages": c["virtual_stages"],
           "cp_strategy": c["cp_strategy"], "zero": c["zero_stage"], "recompute": c["recompute"],
           "sequence_parallel": c["sequence_parallel"], "micro_batch": c["micro_batch"]}
    return _layout_text(lay)


def _layout_text(lay: dict) -> str:
    sp = " SP" if lay["sequence_parallel"] else ""
    pp, cp = lay.get("pp", 1), lay.get("cp", 1)
    pipe = ""
    if pp > 1:
        v = lay.get("virtual_stages", 1)
        pipe = f"×pp{pp} {lay.get('schedule', '1f1b')}" + (f" v{v}" if v > 1 else "")
    ctx = f"×cp{cp} {lay.get('cp_strategy', 'ring')}" if cp > 1 else ""
    return (f"tp{lay['tp']}×dp{lay['dp']}{pipe}{ctx} ZeRO-{lay['zero']} {lay['recompute']}{sp} "
            f"mb{lay['micro_batch']}")


def markdown(rep: dict) -> str:
    """The report as the table of docs/planner.md."""
    head = ("| run | split | source | GPUs | layout | measured s/step (MFU) | predicted s/step "
            "(MFU) | error | memory measured / predicted |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rep["rows"]:
        mfu = f" ({r['measured_mfu']:.0%})" if r["measured_mfu"] is not None else ""
        mem = (f"{r['measured_memory_gib']:.1f} / {r['predicted_memory_gib']:.1f} GiB "
               f"({r['memory_error']:+.0%})" if "memory_error" in r
               else f"{r['measured_memory_gib']:.1f} / {r['predicted_memory_gib']:.1f} GiB "
               f"(not compared: see notes)" if "measured_memory_gib" in r
               else f"— / {r['predicted_memory_gib']:.1f} GiB")
        lines.append(f"| {r['id']} | {r['split']} | [{r['source']}]({r['url']}) | "
                     f"{r['gpus']}× {r['gpu']} | {_layout_text(r['layout'])} | "
                     f"{r['measured_step_s']:.3g}{mfu} | {r['predicted_step_s']:.3g} "
                     f"({r['predicted_mfu']:.0%}) | {r['step_error']:+.1%} | {mem} |")
    return "\n".join(lines)


def summary_lines(rep: dict) -> list[str]:
    fits = "every run is predicted to fit" if not rep["not_fitting"] else \
        f"predicted NOT to fit: {', '.join(rep['not_fitting'])}"
    memory = rep["max_abs_memory_error"]
    return [f"median |step-time error|: hold-out {rep['median_abs_step_error_holdout']:.1%} "
            f"({sum(r['split'] == 'holdout' for r in rep['rows'])} rows), fit "
            f"{rep['median_abs_step_error_fit']:.1%} "
            f"({sum(r['split'] == 'fit' for r in rep['rows'])} rows); mean |error| hold-out "
            f"{rep['mean_abs_step_error_holdout']:.1%}",
            fits + (f"; largest |memory error| {memory:.1%} (rows that report memory)"
                    if memory is not None else ""),
            "efficiencies " + ("per GPU × stack" if rep["by_stack"] else "per GPU")
            + f"; constants: {json.dumps(rep['constants'])}"]


def validate_published(*, by_stack: bool = False) -> dict:
    """:func:`report` plus, for every row that uses pipeline or context parallelism, the
    layout the planner would choose on the same cards (:func:`planner_choice`) — what
    ``plan --validate-published`` prints."""
    rep = report(by_stack=by_stack)
    rows = {r["id"]: r for r in load()["runs"]}
    for r in rep["rows"]:
        if r["uses_pp_or_cp"]:
            r["planner_choice"] = planner_choice(rows[r["id"]])
    return rep


def validation_lines(rep: dict) -> list[str]:
    """Per row predicted against measured, the PP/CP rows' chosen layouts, the split summary."""
    lines = [f"{'run':64s} {'split':7s} {'measured s':>10s} {'predicted s':>11s} {'error':>7s}"]
    for r in rep["rows"]:
        lines.append(f"{r['id']:64s} {r['split']:7s} {r['measured_step_s']:10.4g} "
                     f"{r['predicted_step_s']:11.4g} {r['step_error']:+7.1%}"
                     + ("" if r["fits"] else "  PREDICTED NOT TO FIT"))
    lines += ["", "runs with pipeline or context parallelism: the published layout and the one the "
              "planner would choose on the same cards (searching dp × pp × cp × tp)"]
    for r in rep["rows"]:
        if not r.get("uses_pp_or_cp"):
            continue
        c = r.get("planner_choice")
        chosen = (f"{_choice_text(c)}: {c['predicted_step_s']:.4g} s" if c
                  else "nothing fits")
        lines.append(f"  {r['id']}: published {_layout_text(r['layout'])} measured "
                     f"{r['measured_step_s']:.4g} s (predicted {r['predicted_step_s']:.4g} s); "
                     f"planner {chosen}")
    held = rep["holdout_rows"]
    lines += ["", f"held-out median |step-time error|: {rep['median_abs_step_error_holdout']:.1%} "
              f"over the {len(held)} 'holdout' rows (constants fitted on the "
              f"{len(rep['fit_rows'])} 'fit' rows only); fit rows "
              f"{rep['median_abs_step_error_fit']:.1%}", *summary_lines(rep)[1:]]
    return lines


def print_validation(*, by_stack: bool = False, json_output: bool = False) -> int:
    """``ops-transformer plan --validate-published [--stack S] [--json]``."""
    rep = validate_published(by_stack=by_stack)
    print(json.dumps(rep, indent=2) if json_output else "\n".join(validation_lines(rep)))
    return 0


def print_report(*, refit: bool = False, by_stack: bool = False,
                 json_output: bool = False) -> int:
    """``ops-transformer plan --published [--fit] [--stack S] [--json]``."""
    if refit:
        found = fit()
        out = {**found, "by_stack": {f"{g}/{s}": v for (g, s), v in found["by_stack"].items()}}
        print(json.dumps(out, indent=2) if json_output else
              "constants fitted on the 'fit' rows (planner/efficiency.py holds the built-in "
              "ones):\n" + json.dumps(out, indent=2))
        return 0
    rep = report(by_stack=by_stack)
    if json_output:
        print(json.dumps(rep, indent=2))
        return 0
    print(markdown(rep))
    print()
    print("\n".join(summary_lines(rep)))
    return 0


__all__ = ["fit", "load", "markdown", "measured_step_s", "planner_choice", "predict",
           "print_report", "print_validation", "report", "run_cluster", "run_execution",
           "run_model", "run_options", "validate_published"]
