"""The calibrated local step-time model: fitted by ``ops-transformer calibrate`` (and
``plan --validate``) on a few small training runs, used by every local prediction — ``sweep``,
``bench``, ``train --plan`` — so that they are the measured machine's, not the built-in CPU
figures (which price bf16 like fp32 and know no per-operator overhead).

The fit (:func:`fit_local_model`): matmuls of 64 … 1024 in each dtype give the FLOP/s by size;
per precision (fp32, bf16, fp16), ``tiny`` on one rank with 1 and 2 layers the per-layer and fixed
overheads beyond the FLOPs; two runs on two ranks (``tiny`` with 1 layer at tp 2, with 2 layers at
dp 2, fp32) the slowdown of ranks sharing the machine and the effective time per collective call
``α_step``. Each run is the median of three (a shared machine has bursts of load). The formula is :class:`~ops_transformer.planner.local.LocalTimeModel`.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..launch.local import launch
from ..parallelize.gpt_plan import gpt_plan
from ..planner.layout import CostOptions, Layout
from ..planner.local import PRECISIONS, LocalTimeModel, local_time_model, step_flops_per_rank
from ..training.loop import TrainConfig, train_worker

FIT_STEPS, QUICK_FIT_STEPS = 20, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _cfg(tp: int, layers: int, precision: str, steps: int) -> TrainConfig:
    return TrainConfig(preset="tiny", tp=tp, steps=steps, batch=8, seq=64, attention="heads",
                       sample_tokens=0, progress=False, layers=layers, precision=precision)


def _plan(cfg: TrainConfig, tp: int):
    return gpt_plan(cfg.model_config(), tp, cfg.attention, batch=cfg.batch, seq=cfg.seq)


MATMUL_SIZES = (64, 128, 256, 512, 1024)


def _matmul_rates(repeats: int = 9) -> dict[str, dict[int, float]]:
    """FLOP/s of ``n × n`` products per dtype and size, one thread (as a rank): the fastest of
    ``repeats`` (the machine is shared; the overheads fitted next carry its load). On a CPU with
    AMX, bf16 is several times fp32 at 512 and several times slower at 64."""
    torch.set_num_threads(1)
    rates: dict[str, dict[int, float]] = {}
    for name, dtype in DTYPES.items():
        rates[name] = {}
        for n in MATMUL_SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            a @ b
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
            rates[name][n] = 2 * n ** 3 / best
    return rates


FIT_LAYERS, QUICK_FIT_LAYERS = (1, 2, 4), (1, 2)
TWO_RANK_RUNS = ((2, 1), (1, 2))  # (tp, layers) at fp32: tp 2 (TP collectives), dp 2 (gradients)


def fit_runs(quick: bool = False) -> int:
    """How many runs :func:`fit_local_model` makes (for a progress bar)."""
    layers, rounds = (QUICK_FIT_LAYERS, 1) if quick else (FIT_LAYERS, 3)
    return 1 + rounds * (len(PRECISIONS) * len(layers) + len(TWO_RANK_RUNS))


def _median_step(cfg: TrainConfig, nprocs: int, timeout: float) -> float:
    return launch(train_worker, nprocs, cfg, timeout=timeout)[0]["median_step_s"]


def fit_local_model(bandwidth: float, *, quick: bool = False, timeout: float = 900.0,
                    tick=lambda: None) -> LocalTimeModel:
    """Fit the constants of :class:`LocalTimeModel` on this machine (module docstring); the
    profile's all-reduce ``bandwidth`` is taken as measured; ``tick()`` after each of the
    :func:`fit_runs` runs. The runs are interleaved round by round, each configuration's time the
    median over the rounds: a burst of load then costs one sample of several configurations
    instead of every sample of one."""
    steps, layer_counts, rounds = ((QUICK_FIT_STEPS, QUICK_FIT_LAYERS, 1) if quick else
                                   (FIT_STEPS, FIT_LAYERS, 3))
    rates = launch(_matmul_rates, 1, timeout=timeout)[0]
    tick()
    one = {(p, n): _cfg(1, n, p, steps) for p in PRECISIONS for n in layer_counts}
    two = {(tp, n): _cfg(tp, n, "fp32", steps) for tp, n in TWO_RANK_RUNS}
    times: dict = {key: [] for key in [*one, *two]}
    for _ in range(rounds):
        for key, cfg in [*one.items(), *two.items()]:
            times[key].append(_median_step(cfg, 1 if key in one else 2, timeout))
            tick()
    measured = {key: statistics.median(t) for key, t in times.items()}
    bare = LocalTimeModel(rates, {}, {}, 0.0, bandwidth, cores())
    per_layer, fixed = {}, {}
    for precision in PRECISIONS:  # t − FLOPs/rate = layers · per_layer + fixed, least squares
        points = []
        for n in layer_counts:
            cfg = one[(precision, n)]
            plan, m = _plan(cfg, 1), cfg.model_config()
            flops = step_flops_per_rank(m, 1, cfg.batch, cfg.seq, plan.attention, plan.vocab)
            points.append((n, measured[(precision, n)]
                           - flops / bare.matmul_rate(precision, m, 1)))
        per_layer[precision], fixed[precision] = _line(points)
    model = LocalTimeModel(rates, per_layer, fixed, 0.0, bandwidth, cores())
    rows = []  # t = sharing · alone + calls · α + volume, from the two two-rank runs
    for (tp, n), cfg in two.items():
        plan = _plan(cfg, tp)
        parts = model.step_time(cfg.model_config(), Layout(tp=tp, dp=2 // tp),
                                CostOptions(attention=plan.attention, vocab=plan.vocab),
                                nproc=2, batch=cfg.batch, seq=cfg.seq)
        rows.append((parts["alone_s"], parts["calls"], measured[(tp, n)] - parts["volume_s"]))
    sharing, alpha = _solve_two(rows)
    return LocalTimeModel(rates, per_layer, fixed, alpha, bandwidth, cores(), sharing)


def _line(points) -> tuple[float, float]:
    """``(slope, intercept)`` of the least-squares line through ``(x, y)`` points, both ≥ 0 (a
    negative intercept: the line through the origin; a negative slope: a constant)."""
    n = len(points)
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    intercept = (sy - slope * sx) / n
    if slope < 0:
        return 0.0, max(sy / n, 0.0)
    if intercept < 0:
        return max(sxy / sxx, 0.0), 0.0
    return slope, intercept


def _solve_two(rows) -> tuple[float, float]:
    """``(sharing, α)`` from ``[(alone, calls, t), (alone, calls, t)]`` with
    ``t = sharing·alone + calls·α``; ``sharing ≥ 1`` and ``α ≥ 0`` (refitted with the bound)."""
    (a1, c1, t1), (a2, c2, t2) = rows
    det = a1 * c2 - a2 * c1
    sharing, alpha = ((t1 * c2 - t2 * c1) / det, (a1 * t2 - a2 * t1) / det) if det else (1.0, 0.0)
    if sharing < 1.0 or alpha < 0.0:
        sharing = max(1.0, sharing)
        alpha = max(0.0, sum(t - sharing * a for a, _, t in rows) / max(c1 + c2, 1))
    return sharing, alpha


def predict_step_s(cfg: TrainConfig, nproc: int, profile, *, attention: str | None = None,
                   vocab: str | None = None, partial_elements: int = 0) -> float | None:
    """The calibrated local model's step time for ``cfg`` on ``nproc`` local ranks, or ``None``
    when ``profile`` has no fitted local model (run ``ops-transformer calibrate``). ``attention``
    and ``vocab``: what the run used (default: the plan ``cfg`` gets)."""
    model = local_time_model(profile)
    if model is None:
        return None
    dp = nproc // (cfg.tp * cfg.ep)
    if attention is None or vocab is None:
        plan = gpt_plan(cfg.model_config(), cfg.tp,
                        "heads" if cfg.sequence_parallel and cfg.attention == "auto"
                        else cfg.attention, batch=cfg.batch // (dp * cfg.ep), seq=cfg.seq,
                        profile=profile)
        attention, vocab = attention or plan.attention, vocab or plan.vocab
    options = CostOptions(attention=attention, vocab=vocab,
                          sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute)
    return model.step_time(cfg.model_config(), Layout(tp=cfg.tp, dp=dp, ep=cfg.ep), options,
                           nproc=nproc, batch=cfg.batch, seq=cfg.seq, precision=cfg.precision,
                           zero=cfg.zero, partial_elements=partial_elements)["step_s"]
