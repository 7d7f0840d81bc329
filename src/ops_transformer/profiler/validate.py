"""``ops-transformer plan --validate``: the cost model's predictions against runs on this machine.

Each configuration trains the reference GPT for a few steps on local ranks and compares, per step
and per rank, the predicted communication (calls and elements from :mod:`.strategies`, for the plan
the configuration gets: must be equal) and step time. The time model of a CPU rank is::

    step = c · (FLOPs / matmul FLOP/s + layers × overhead_per_layer + overhead_fixed)
           + calls × α_step + wire bytes / β

with ``c = max(1, ranks / cores)`` (ranks share the cores). The constants are calibrated first on
runs that are not validated: ``tiny`` at tp 1 with 1 and 2 layers (the framework overheads beyond
the FLOPs), then ``tiny`` with 1 layer at tp 2 (the effective time per collective call ``α_step``,
which on a loaded machine includes the wait for the slower rank); β is the profile's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..parallel.launch import launch
from ..train import TrainConfig, train_worker
from ..utils.progress import Progress, format_table
from ..planner.cost import comm_time
from ..planner.hardware import CPU_GLOO, HardwareProfile
from ..planner.strategies import layer_cost, model_comm_per_step
from ..parallelize.gpt_plan import gpt_plan

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


def step_flops_per_rank(cfg: TrainConfig, tp: int, batch: int, plan) -> float:
    """Training FLOPs of one step on one rank: the layers (:func:`layer_cost`) and the LM head
    (split over ``tp`` only with a vocab-parallel plan)."""
    m = cfg.model_config()
    layer = layer_cost(plan.attention, batch, cfg.seq, m.d_model, m.n_heads, m.n_kv_heads,
                       m.d_ff, tp, bias=m.bias, swiglu=m.mlp == "swiglu")
    head = 3 * 2 * batch * cfg.seq * m.d_model * m.vocab_size
    return m.n_layers * layer.flops + head / (tp if plan.vocab == "parallel" else 1)


def _measure(cfg: TrainConfig, nprocs: int) -> dict:
    return launch(train_worker, nprocs, cfg)[0]


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _plan(cfg: TrainConfig, tp: int):
    return gpt_plan(cfg.model_config(), tp, cfg.attention, batch=cfg.batch, seq=cfg.seq)


@dataclass(frozen=True)
class TimeModel:
    profile: HardwareProfile
    per_layer_s: float = 0.0
    fixed_s: float = 0.0
    alpha_step_s: float = 0.0

    def parts(self, cfg: TrainConfig, tp: int, nprocs: int) -> dict:
        plan = _plan(cfg, tp)
        m = cfg.model_config()
        comm = model_comm_per_step(m, tp, plan.attention, cfg.batch, cfg.seq, plan.vocab)
        shared = max(1.0, nprocs / _cores())
        compute = (step_flops_per_rank(cfg, tp, cfg.batch, plan) / self.profile.matmul_flops
                   + m.n_layers * self.per_layer_s + self.fixed_s)
        return {"compute_s": shared * compute, "calls": comm.calls,
                "volume_s": comm_time(comm, tp, lambda kind, p: (0.0, self.profile.bandwidth)),
                "comm": comm}

    def predict(self, cfg: TrainConfig, tp: int, nprocs: int) -> float:
        """Compute plus the one collective-time formula with the fitted per-call α."""
        p = self.parts(cfg, tp, nprocs)
        alpha_beta = lambda kind, group: (self.alpha_step_s, self.profile.bandwidth)  # noqa: E731
        return p["compute_s"] + comm_time(p["comm"], tp, alpha_beta)


def calibrate(profile: HardwareProfile) -> TimeModel:
    """Fit the overheads (tp 1, 1 and 2 layers) and the per-call time (tp 2, 1 layer)."""
    rest = []
    for layers in (1, 2):
        cfg = _cfg("tiny", 1, "heads", 8, 64, layers=layers)
        measured = _measure(cfg, 1)["median_step_s"]
        rest.append(measured - step_flops_per_rank(cfg, 1, cfg.batch, _plan(cfg, 1))
                    / profile.matmul_flops)
    per_layer = max(rest[1] - rest[0], 0.0)
    model = TimeModel(profile, per_layer, max(rest[0] - per_layer, 0.0))
    cfg = _cfg("tiny", 2, "heads", 8, 64, layers=1)
    parts = model.parts(cfg, 2, 2)
    measured = _measure(cfg, 2)["median_step_s"]
    alpha = max(measured - parts["compute_s"] - parts["volume_s"], 0.0) / max(parts["calls"], 1)
    return TimeModel(profile, per_layer, model.fixed_s, alpha)


def _cfg(preset, tp, attention, batch, seq, layers=None) -> TrainConfig:
    return TrainConfig(preset=preset, tp=tp, steps=STEPS, batch=batch, seq=seq,
                       attention=attention, sample_tokens=0, progress=False, layers=layers)


def run_validation(profile: HardwareProfile = CPU_GLOO, json_output: bool = False) -> int:
    bar = Progress(len(RUNS) + 4, desc="validate")
    model = calibrate(profile)
    bar.update(4)
    rows = []
    for preset, nprocs, tp, attention, batch, seq in RUNS:
        cfg = _cfg(preset, tp, attention, batch, seq)
        parts = model.parts(cfg, tp, nprocs)
        predicted = model.predict(cfg, tp, nprocs)
        measured = _measure(cfg, nprocs)
        got = {k: {"calls": v["calls"], "elements": v["elements"]}
               for k, v in measured["comm_per_step"].items()}
        rows.append({"config": f"{preset} ranks={nprocs} tp={tp} {attention} b={batch} s={seq}",
                     "predicted ms": round(predicted * 1e3, 2),
                     "measured ms": round(measured["median_step_s"] * 1e3, 2),
                     "time error": f"{predicted / measured['median_step_s'] - 1:+.0%}",
                     "comm bytes predicted": 4 * sum(c["elements"] for c in parts["comm"].values()),
                     "comm bytes measured": measured["comm_bytes_per_step"],
                     "comm equal": "yes" if got == parts["comm"] else "NO"})
        bar.update()
    bar.close()
    errors = sorted(abs(float(r["time error"].rstrip("%"))) for r in rows)
    summary = {"profile": profile.name, "overhead_per_layer_s": model.per_layer_s,
               "overhead_fixed_s": model.fixed_s, "alpha_step_s": model.alpha_step_s,
               "cores": _cores(), "runs": rows,
               "median_abs_time_error_pct": errors[len(errors) // 2],
               "comm_all_equal": all(r["comm equal"] == "yes" for r in rows)}
    if json_output:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(rows))
        print(f"\nmedian |time error| {summary['median_abs_time_error_pct']:.0f}%; communication "
              f"{'equal in every run' if summary['comm_all_equal'] else 'DIFFERS'}; calibrated: "
              f"{model.per_layer_s * 1e3:.2f} ms/layer + {model.fixed_s * 1e3:.2f} ms/step "
              f"overhead, {model.alpha_step_s * 1e3:.2f} ms per collective call "
              f"({profile.name}, {_cores()} cores)")
    return 0 if summary["comm_all_equal"] else 1
