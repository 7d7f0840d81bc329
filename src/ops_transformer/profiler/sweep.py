"""``ops-transformer sweep``: training configurations side by side (SPEC F12).

An axis is a :class:`~ops_transformer.train.TrainConfig` field with a list of values
(``--tp 1,2 --attention heads,heads_allgather --sequence-parallel off,on``). The sweep runs every
combination on the same number of local ranks (``--nproc``, default the largest ``tp``; ``dp``
fills the rest), one job after the other, and reports for each: the median step time, tokens/s,
the activation memory of one forward (``ops_transformer.activation_memory``, where this build has
it), the communication bytes per step (ledger) and the planner's predicted step time for this
machine (``plan --gpu local``). A combination that :func:`~ops_transformer.train.validate`
rejects, or that fails while it runs, is reported in its row and the sweep goes on.

An axis whose field this build's ``TrainConfig`` lacks (a feature not built yet) is not swept: it
is listed under ``unavailable`` with its values, never faked.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import fields, replace

from ..comm.topology import detect_topology
from ..memory.measure import activation_memory
from ..planner.local import local_cluster, local_time_model
from ..planner.search import Options, evaluate_layout, execution
from ..planner.specs import ModelSpec
from ..training.loop import TrainConfig, join, setup_training, validate
from .local_model import predict_step_s

# flag -> how its values parse; the TrainConfig field is the flag with "_" for "-".
AXES = {"tp": int, "dp": int, "attention": str, "sequence-parallel": "sp", "recompute": str,
        "activation-cache": str, "zero": int, "precision": str, "ep": int, "preset": str,
        "batch": int, "seq": int, "layers": int, "overlap": str, "chunks": int}
TRUE, FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def parse_values(flag: str, text: str) -> list:
    kind = AXES[flag]
    values = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if kind == "sp":  # on / off, or "regather" (sequence parallelism that re-gathers)
            if item.lower() not in TRUE + FALSE + ("regather",):
                raise ValueError(f"--{flag} takes on/off values (or regather), got {item!r}")
            values.append("regather" if item.lower() == "regather" else item.lower() in TRUE)
        elif kind is int:
            try:
                values.append(int(item))
            except ValueError:
                raise ValueError(f"--{flag} takes integers, got {item!r}") from None
        else:
            values.append(item)
    if not values:
        raise ValueError(f"--{flag} needs at least one value, got {text!r}")
    return values


def split_axes(axes: dict[str, list]) -> tuple[dict[str, list], dict[str, list]]:
    """``(available, unavailable)``: by field name, whether this build's TrainConfig has it."""
    have = {f.name for f in fields(TrainConfig)}
    available = {k: v for k, v in axes.items() if k in have}
    return available, {k: v for k, v in axes.items() if k not in have}


def combinations(base: TrainConfig, axes: dict[str, list]) -> list[TrainConfig]:
    names = list(axes)
    return [replace(base, **dict(zip(names, values)))
            for values in itertools.product(*(axes[n] for n in names))]


def label(cfg: TrainConfig, axes: dict[str, list]) -> str:
    def show(v):
        return "on" if v is True else "off" if v is False else str(v)

    return " ".join(f"{k}={show(getattr(cfg, k))}" for k in axes)


def sweep_worker(cfg: TrainConfig, warmup: int, profile=None) -> dict | None:
    """One configuration on every rank: ``warmup`` + ``cfg.steps`` training steps, timed
    (``profile``: as :func:`~ops_transformer.train.train_worker` takes it)."""
    with join(cfg, profile) as ctx:
        return _timed(setup_training(cfg, ctx), warmup)


def _timed(state, warmup: int) -> dict | None:
    cfg = state.cfg
    times, ledger, report = [], None, None
    for i in range(warmup + cfg.steps):
        x, y = state.batch(i)
        start = time.perf_counter()
        report, ledger = state.step(x, y)
        times.append(time.perf_counter() - start)
    activation = None  # (not measured for a Hugging Face model: its forward takes other inputs)
    if not cfg.model:
        x, y = state.batch(0)
        with state.policy.autocast(state.ctx.device):  # the activations the step keeps
            activation = activation_memory(state.model, x, y)["total_bytes"]
    if state.ctx.rank != 0:
        return None
    step = statistics.median(times[warmup:])
    plan = state.model.parallel_plan
    return {"step_s": step, "tokens_per_s": cfg.batch * cfg.seq / step,
            "activation_bytes": activation, "comm_bytes_per_step": ledger.total_bytes,
            "comm_wire_bytes_per_step": ledger.wire_bytes(),
            "loss": report.metrics["loss"], "attention_used": plan.attention,
            "vocab_used": plan.vocab, "dp_used": state.ctx.dp_size}


def predicted_step_s(cfg: TrainConfig, nproc: int, attention: str, dp: int,
                     profile=None, vocab: str | None = None) -> float | None:
    """The predicted step time of this run on ``nproc`` local ranks: the calibrated local model
    when ``profile`` has one (:mod:`.local_model`, what ``calibrate`` fits), else the planner's
    (``plan --gpu local`` on the built-in CPU figures: no per-operator overhead, bf16 priced like
    fp32; it can be far below the measurement)."""
    calibrated = predict_step_s(cfg, nproc, profile, attention=attention, vocab=vocab)
    if calibrated is not None:
        return calibrated
    run = dict(seq=cfg.seq, global_batch=cfg.batch, micro_batch=cfg.batch // dp,
               dtype=getattr(cfg, "precision", "fp32"))
    model = (ModelSpec.load(cfg.model, **run) if getattr(cfg, "model", None) else
             ModelSpec.from_gpt_config(cfg.model_config(), **run))
    cluster = local_cluster(nproc, profile, topology=detect_topology())
    layout = Options(dp=dp, tp=cfg.tp, ep=getattr(cfg, "ep", 1), attention=attention,
                     sequence_parallel=getattr(cfg, "sequence_parallel", False),
                     recompute=getattr(cfg, "recompute", "none"),
                     zero_stage=getattr(cfg, "zero", 0), micro_batch=cfg.batch // dp)
    try:
        return evaluate_layout(model, cluster, layout, execution(cluster)[0])["step_time_s"]
    except ValueError:
        return None


def run_one(cfg: TrainConfig, nproc: int, warmup: int, launch, profile=None) -> dict:
    """One row: ``status`` ``ok``, ``invalid`` (rejected before starting) or ``failed``."""
    try:
        dp, _ = validate(cfg, nproc)
    except ValueError as exc:
        return {"status": "invalid", "error": str(exc)}
    try:
        got = launch(sweep_worker, nproc, cfg, warmup,
                     **({} if profile is None else {"profile": profile}))[0]
    except Exception as exc:  # noqa: BLE001 - a failing configuration is a row, not the end
        return {"status": "failed", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    got["predicted_step_s"] = predicted_step_s(cfg, nproc, got["attention_used"], dp, profile,
                                               got.get("vocab_used"))
    return {"status": "ok", **got}


def run_sweep(base: TrainConfig, axes: dict[str, list], nproc: int, warmup: int, *, launch,
              progress=None, profile=None) -> dict:
    """Every combination of ``axes`` over ``base`` (module docstring); ``progress`` is called
    with each finished row; ``profile``: the calibrated hardware profile (``None``: built-in)."""
    available, unavailable = split_axes(axes)
    rows = []
    for cfg in combinations(base, available):
        row = {"config": label(cfg, available), **{k: getattr(cfg, k) for k in available},
               **run_one(cfg, nproc, warmup, launch, profile)}
        rows.append(row)
        if progress is not None:
            progress(row)
    model = ("calibrated local model" if local_time_model(profile) is not None else
             "built-in CPU figures (run `ops-transformer calibrate` for the calibrated model)")
    return {"axes": available, "unavailable": unavailable, "nproc": nproc,
            "prediction_model": model,
            "steps": base.steps, "warmup": warmup, "preset": None if base.model else base.preset,
            "model": base.model, "batch": base.batch,
            "seq": base.seq, "rows": rows}
