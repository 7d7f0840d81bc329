"""``ops-transformer plan --validate``: the cost model's predictions against runs on this machine.

Each configuration trains the reference GPT for a few steps on local ranks and compares, per step
and per rank, the predicted communication (elements and bytes, from :mod:`.strategies`: must be
equal) and step time. The time model for a CPU rank is::

    step = FLOPs per rank / matmul FLOP/s  +  Σ collectives (α + wire bytes / β)
           + layers × overhead_per_layer + overhead_fixed

The two overheads (framework dispatch of the many small ops, optimizer, loss) are calibrated first
on one rank from the ``tiny`` preset with 1 and 2 layers — runs that are not among the validated
ones.
"""

from __future__ import annotations

import json

from ..parallel.launch import launch
from ..train import TrainConfig, expected_comm_per_step, train_worker
from ..utils.progress import Progress, format_table
from .hardware import CPU_GLOO, HardwareProfile
from .strategies import layer_cost

RUNS = (  # preset, ranks, tp, attention, batch, seq
    ("tiny", 2, 2, "heads", 8, 64),
    ("tiny", 2, 2, "heads_allgather", 8, 64),
    ("tiny", 2, 2, "kv_split", 8, 64),
    ("tiny", 2, 2, "naive", 8, 64),
    ("small", 2, 2, "heads", 4, 128),
    ("llama-tiny", 2, 2, "heads", 8, 64),
    ("tiny", 4, 4, "heads", 8, 64),
)
STEPS = 12


def step_flops_per_rank(cfg: TrainConfig, tp: int, batch: int) -> float:
    """Training FLOPs of one step on one rank: the layers (:func:`layer_cost`) and the LM head."""
    m = cfg.model_config()
    layer = layer_cost(cfg.attention, batch, cfg.seq, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff,
                       tp, bias=m.bias, swiglu=m.mlp == "swiglu")
    head = 3 * 2 * batch * cfg.seq * m.d_model * m.vocab_size / tp
    return m.n_layers * layer.flops + head


def _measure(cfg: TrainConfig, nprocs: int) -> dict:
    return launch(train_worker, nprocs, cfg)[0]


def calibrate_overheads(profile: HardwareProfile) -> tuple[float, float]:
    """``(per_layer_s, fixed_s)`` from one-rank runs of ``tiny`` with 1 and 2 layers: what the
    measured step time has beyond the FLOPs at the profile's matmul rate."""
    rest = []
    for layers in (1, 2):
        cfg = TrainConfig(preset="tiny", steps=STEPS, batch=8, seq=64, attention="heads",
                          sample_tokens=0, progress=False, layers=layers)
        measured = _measure(cfg, 1)["median_step_s"]
        rest.append(measured - step_flops_per_rank(cfg, 1, cfg.batch) / profile.matmul_flops)
    per_layer = max(rest[1] - rest[0], 0.0)
    return per_layer, max(rest[0] - per_layer, 0.0)


def predict(cfg: TrainConfig, tp: int, profile: HardwareProfile,
            overheads: tuple[float, float]) -> dict:
    m = cfg.model_config()
    comm = expected_comm_per_step(m, tp, cfg.attention, cfg.batch, cfg.seq)
    flops = step_flops_per_rank(cfg, tp, cfg.batch)
    seconds = (flops / profile.matmul_flops + profile.comm_time(comm, tp, 4)
               + m.n_layers * overheads[0] + overheads[1])
    return {"step_s": seconds, "comm": comm,
            "comm_bytes": 4 * sum(c["elements"] for c in comm.values())}


def run_validation(profile: HardwareProfile = CPU_GLOO, json_output: bool = False) -> int:
    bar = Progress(len(RUNS) + 2, desc="validate")
    overheads = calibrate_overheads(profile)
    bar.update(2)
    rows = []
    for preset, nprocs, tp, attention, batch, seq in RUNS:
        cfg = TrainConfig(preset=preset, tp=tp, steps=STEPS, batch=batch, seq=seq,
                          attention=attention, sample_tokens=0, progress=False)
        predicted = predict(cfg, tp, profile, overheads)
        measured = _measure(cfg, nprocs)
        got = {k: {"calls": v["calls"], "elements": v["elements"]}
               for k, v in measured["comm_per_step"].items()}
        rows.append({"config": f"{preset} tp={tp} {attention} b={batch} s={seq}",
                     "predicted ms": round(predicted["step_s"] * 1e3, 2),
                     "measured ms": round(measured["median_step_s"] * 1e3, 2),
                     "time error": f"{predicted['step_s'] / measured['median_step_s'] - 1:+.0%}",
                     "comm bytes predicted": predicted["comm_bytes"],
                     "comm bytes measured": measured["comm_bytes_per_step"],
                     "comm equal": "yes" if got == predicted["comm"] else "NO"})
        bar.update()
    bar.close()
    errors = sorted(abs(float(r["time error"].rstrip("%"))) for r in rows)
    summary = {"profile": profile.name, "overhead_per_layer_s": overheads[0],
               "overhead_fixed_s": overheads[1], "runs": rows,
               "median_abs_time_error_pct": errors[len(errors) // 2],
               "comm_all_equal": all(r["comm equal"] == "yes" for r in rows)}
    if json_output:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(rows))
        print(f"\nmedian |time error| {summary['median_abs_time_error_pct']:.0f}%; communication "
              f"{'equal in every run' if summary['comm_all_equal'] else 'DIFFERS'}; overheads "
              f"{overheads[0] * 1e3:.2f} ms/layer + {overheads[1] * 1e3:.2f} ms/step "
              f"({profile.name})")
    return 0 if summary["comm_all_equal"] else 1
