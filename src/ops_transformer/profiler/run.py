"""``ops-transformer profile`` and ``diagnose``: the training step of ``train`` (same options),
profiled or diagnosed.

:func:`profile_worker` runs on every rank: it builds what ``train`` builds
(:func:`~ops_transformer.train.setup_training`), profiles ``warmup + steps`` training steps with
:func:`~.profile.profile_step` on batches prepared beforehand, and writes ``trace_rank<r>.json``
(each rank) and, on rank 0, ``profile.json``, ``breakdown.png`` and ``timeline.png``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..models.gpt import GPT
from ..training.loop import TrainConfig, join, setup_training
from ..planner.specs import ModelSpec
from .diagnose import STEP_CALLS, Diagnostic, diagnose, sort_diagnostics
from .dims import dimension_checks
from .pipeline import measured_balance, pipeline_summary, predicted_balance
from .profile import profile_step
from .report import write_breakdown_png, write_timeline_of_step_png


# train's options that write or read what only a training run has: (field, flag, off value)
TRAINING_ONLY = (("tensorboard", "--tensorboard", None), ("ckpt_dir", "--ckpt-dir", None),
                 ("resume", "--resume", False), ("save_every", "--save-every", 0),
                 ("max_restarts", "--max-restarts", 0))


def check_measuring_only(cfg: TrainConfig, command: str) -> None:
    """``profile`` and ``diagnose`` take train's options but only measure its step: a flag for the
    run's logs or checkpoints would be silently ignored, so it is an error."""
    given = [flag for name, flag, off in TRAINING_ONLY if getattr(cfg, name, off) != off]
    if given:
        raise ValueError(f"{command} measures train's step and writes no logs or checkpoints: "
                         f"drop {', '.join(given)}")


def output_files(out: Path, ranks: int) -> dict[str, Path]:
    files = {"profile": out / "profile.json", "breakdown": out / "breakdown.png",
             "timeline": out / "timeline.png"}
    files.update({f"trace_rank{r}": out / f"trace_rank{r}.json" for r in range(ranks)})
    return files


def profile_worker(cfg: TrainConfig, steps: int, warmup: int, profile=None) -> dict | None:
    """Run on every rank; the summary (with the files written) on rank 0, ``None`` elsewhere.
    ``profile``: the hardware profile, as :func:`~ops_transformer.train.train_worker` takes it."""
    with join(cfg, profile) as ctx:
        return _profile(setup_training(cfg, ctx), steps, warmup)


def _profile(state, steps: int, warmup: int) -> dict | None:
    cfg = state.cfg
    state.read_metrics = False  # train's step: no host read of its loss in the profiled steps
    batches = iter([state.batch(i) for i in range(warmup + steps)])
    if state.pipe is not None:  # the bubble per rank: each schedule timed
        state.pipe.measure = True
    prof = profile_step(lambda: state.step(*next(batches)), state.ctx, steps=steps,
                        warmup=warmup)
    piped = pipeline_summary(state.pipe, steps) if state.pipe is not None else None
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(out / f"trace_rank{state.ctx.rank}.json")
    if state.ctx.rank != 0:
        return None
    summary = prof.summary()
    plan = state.model.parallel_plan
    summary.update(config=asdict(cfg), attention=plan.attention, vocab=plan.vocab,
                   tp=state.ctx.tp_size, dp=state.ctx.dp_size,
                   tokens_per_s=cfg.batch * cfg.seq / summary["step_time_s"],
                   **({"pipeline": piped} if piped else {}))
    files = output_files(out, state.ctx.world_size)
    summary["files"] = {k: str(v) for k, v in files.items()}
    write_breakdown_png(summary, files["breakdown"])
    write_timeline_of_step_png(summary, files["timeline"])
    files["profile"].write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def diagnose_worker(cfg: TrainConfig, steps: bool = True, profile=None) -> list[dict] | None:
    """Run on every rank: diagnose the training step of ``cfg``; rank 0 returns the findings.
    The small-message threshold and α come from the profile the ranks agreed on."""
    with join(cfg, profile) as ctx:
        state = setup_training(cfg, ctx)
        state.read_metrics = False  # train's step: its numbers read once per logging interval
        batches = iter([state.batch(i) for i in range(STEP_CALLS)])
        step_fn = (lambda: state.step(*next(batches))) if steps else None
        if state.pipe is not None and steps:
            state.pipe.measure = True
        found = diagnose(state.model, ctx, step_fn)
        if state.pipe is not None:  # the stages' predicted and measured work (every rank)
            more = pipeline_predicted(cfg, state.model)
            if steps:
                more += measured_balance(pipeline_summary(state.pipe, 0)["per_rank"])
            found = sort_diagnostics(found + [Diagnostic(**d) for d in more])
        return [d.to_dict() for d in found] if ctx.rank == 0 else None


def dense_diagnostics(cfg: TrainConfig, tp: int) -> list[dict]:
    """The model-only diagnostics of ``cfg``'s GPT at ``tp`` (no rank started, meta tensors)."""
    import torch

    if cfg.model:  # a Hugging Face model: its own sizes, on a meta copy
        from ..training.finetune import meta_model

        model = meta_model(cfg.model)
    else:
        with torch.device("meta"):
            model = GPT(cfg.model_config())
    found = dimension_checks(model, tp) + pipeline_predicted(cfg, model)
    return [Diagnostic(**d).to_dict() for d in found]


def pipeline_predicted(cfg: TrainConfig, model) -> list[dict]:
    """``--pp``: ``pp_unbalanced`` from the stages' predicted work (the last one runs the head
    too); ``model``: the dense model or a meta copy (a Hugging Face one: its config)."""
    if cfg.pp == 1:
        return []
    spec = (ModelSpec.from_hf_config(model.config, seq=cfg.seq) if cfg.model else
            ModelSpec.from_gpt_config(cfg.model_config(), seq=cfg.seq))
    return predicted_balance(spec, cfg.pp, cfg.pp_schedule, cfg.pp_stages_per_rank)
