"""``ops-transformer plan --validate``: the cost model's predictions against runs on this machine.

Each configuration trains the reference GPT for a few steps on local ranks and compares, per step
and per rank, the predicted communication (calls and elements from :mod:`.strategies`, for the plan
the configuration gets: must be equal) and step time. The time model of a CPU rank is the local
model that ``sweep``, ``bench`` and ``train --plan`` use
(:class:`~ops_transformer.planner.local.LocalTimeModel`)::

    step = c · (FLOPs / matmul FLOP/s + layers × overhead_per_layer + overhead_fixed)
           + calls × α_step + wire bytes / β

with ``c = max(1, ranks / cores)`` (ranks share the cores). Its constants are the profile's
(``calibrate`` fits them, :mod:`.local_model`), else fitted first, on runs that are not validated:
``tiny`` at tp 1 with 1 and 2 layers (the framework overheads beyond the FLOPs), then ``tiny``
with 1 layer at tp 2 (the effective time per collective call ``α_step``, which on a loaded machine
includes the wait for the slower rank); β is the profile's.
"""

from __future__ import annotations

import json

from ..launch.local import launch
from ..planner.hardware import CPU_GLOO, HardwareProfile
from ..planner.local import LocalTimeModel, local_time_model
from ..planner.layout import CostOptions, Layout
from ..planner.strategies import model_comm_per_step
from ..training.loop import TrainConfig, train_worker
from ..utils.progress import Progress, format_table
from ..parallelize.gpt_plan import gpt_plan
from .local_model import fit_local_model

RUNS = (  # preset, ranks, tp, attention, batch, seq
    ("tiny", 2, 2, "heads", 8, 64),
    ("tiny", 2, 2, "heads_allgather", 8, 64),
    ("tiny", 2, 2, "kv_split", 8, 64),
    ("tiny", 2, 2, "naive", 8, 64),
    ("small", 2, 2, "heads", 4, 128),
    ("llama-tiny", 2, 2, "heads", 8, 64),
    ("tiny", 4, 4, "heads", 8, 64),
)
STEPS = 20


def _measure(cfg: TrainConfig, nprocs: int) -> dict:
    return launch(train_worker, nprocs, cfg)[0]


def _plan(cfg: TrainConfig, tp: int):
    return gpt_plan(cfg.model_config(), tp, cfg.attention, batch=cfg.batch, seq=cfg.seq)


def _cfg(preset, tp, attention, batch, seq, layers=None) -> TrainConfig:
    return TrainConfig(preset=preset, tp=tp, steps=STEPS, batch=batch, seq=seq,
                       attention=attention, sample_tokens=0, progress=False, layers=layers)


def local_model(profile: HardwareProfile) -> tuple[LocalTimeModel, str]:
    """The profile's calibrated local model (``calibrate`` fitted it), else one fitted now;
    and which it is."""
    model = local_time_model(profile)
    if model is not None:
        return model, "calibrated (from the profile)"
    return fit_local_model(profile.bandwidth), "fitted now (the profile has none)"


def run_validation(profile: HardwareProfile = CPU_GLOO, json_output: bool = False) -> int:
    bar = Progress(len(RUNS) + 1, desc="validate")
    model, source = local_model(profile)
    bar.update()
    rows = []
    for preset, nprocs, tp, attention, batch, seq in RUNS:
        cfg = _cfg(preset, tp, attention, batch, seq)
        plan = _plan(cfg, tp)
        m = cfg.model_config()
        layout, options = Layout(tp=tp), CostOptions(attention=plan.attention, vocab=plan.vocab)
        comm = model_comm_per_step(m, layout, options, batch=cfg.batch, seq=cfg.seq)
        predicted = model.step_time(m, layout, options, nproc=nprocs, batch=batch,
                                    seq=seq)["step_s"]
        measured = _measure(cfg, nprocs)
        got = {k: {"calls": v["calls"], "elements": v["elements"]}
               for k, v in measured["comm_per_step"].items()}
        rows.append({"config": f"{preset} ranks={nprocs} tp={tp} {attention} b={batch} s={seq}",
                     "predicted ms": round(predicted * 1e3, 2),
                     "measured ms": round(measured["median_step_s"] * 1e3, 2),
                     "time error": f"{predicted / measured['median_step_s'] - 1:+.0%}",
                     "comm bytes predicted": 4 * sum(c["elements"] for c in comm.values()),
                     "comm bytes measured": measured["comm_bytes_per_step"],
                     "comm equal": "yes" if got == comm else "NO"})
        bar.update()
    bar.close()
    errors = sorted(abs(float(r["time error"].rstrip("%"))) for r in rows)
    summary = {"profile": profile.name, "local_model": model.to_dict(), "local_model_source":
               source, "cores": model.cores, "runs": rows,
               "median_abs_time_error_pct": errors[len(errors) // 2],
               "comm_all_equal": all(r["comm equal"] == "yes" for r in rows)}
    if json_output:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(rows))
        print(f"\nmedian |time error| {summary['median_abs_time_error_pct']:.0f}%; communication "
              f"{'equal in every run' if summary['comm_all_equal'] else 'DIFFERS'}; local model "
              f"{source}: {model.per_layer_s['fp32'] * 1e3:.2f} ms/layer + "
              f"{model.fixed_s['fp32'] * 1e3:.2f} ms/step overhead (fp32), "
              f"{model.alpha_step_s * 1e3:.2f} ms per collective call ({profile.name}, "
              f"{model.cores} cores)")
    return 0 if summary["comm_all_equal"] else 1
