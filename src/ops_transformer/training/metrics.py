"""What a training run reports: the metrics of :func:`~.loop.train_worker` (the losses, the step
time, the collectives the ledger counted and those the cost model expects, the model's size, MoE
and context-parallel statistics) and the files written into ``--out`` (``metrics.json``,
``config.toml``, ``loss.png``). Nothing here runs a step; :mod:`.loop` calls it (``cfg``: its
:class:`~.loop.TrainConfig`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

from . import finetune
from .config import from_train_fields, to_toml
from .data import decode, encode
from .optimizer import partial_numel
from .schedule import lr_at
from ..layers.overlap_policy import overlap_decisions, overlap_summary
from ..models.gpt import GPT, GPTConfig
from ..models.moe import moe_stat_tensors
from ..parallelize.moe_plan import n_experts_of
from ..planner.layout import CostOptions, Layout
from ..planner.strategies import model_comm_per_step
from ..utils.plot import write_line_plot_png


def micro_batch(cfg, dp_ep: int) -> int:
    """Sequences per forward on one rank: ``batch / (grad_accum · dp · ep)``."""
    return cfg.batch // (cfg.grad_accum * dp_ep)


def expected_comm_per_step(model_cfg: GPTConfig, tp: int, attention: str, batch: int,
                           seq: int, vocab: str = "parallel",
                           **memory) -> dict[str, dict[str, int]]:
    """The tensor-parallel collectives the cost model predicts for one training step on one rank
    (:func:`ops_transformer.planner.strategies.model_comm_per_step`, checked against the ledger by
    the tests) at a micro-batch of ``batch``; ``memory``: its ``sequence_parallel``,
    ``recompute``, ``overlap``, ``chunks``, ``ep``, ``partial_elements``, ``profile`` and
    ``grad_accum``."""
    layout = Layout(tp=tp, ep=memory.pop("ep", 1))
    options = CostOptions(attention=attention, vocab=vocab, **{
        k: memory.pop(k) for k in ("sequence_parallel", "recompute", "overlap", "chunks")
        if k in memory})
    return model_comm_per_step(model_cfg, layout, options, batch=batch, seq=seq, **memory)


def trainable_params(model) -> int:
    """The parameters that train, counted in the dense model (a sharded one at its full shape,
    ``shard_spec``): with LoRA, the adapters (and what was unfrozen); ``_metrics`` falls back
    to ``params`` without it (all train)."""
    total = 0
    for p in dict.fromkeys(model.parameters()):
        if p.requires_grad:
            spec = getattr(p, "shard_spec", None)
            total += math.prod(spec.full_shape) if spec is not None else p.numel()
    return total


def _n_experts(model) -> int:
    return model.cfg.n_experts if isinstance(model, GPT) else n_experts_of(model)


def _moe_metrics(model, cfg) -> dict:
    """This rank's load-balancing loss (summed over the MoE layers, before the coefficient) and
    dropped / routed token-slots, to be averaged over the ranks with the loss (the reference
    MoE; a Hugging Face router keeps its own statistics)."""
    if cfg.model or not model.cfg.n_experts:
        return {}
    stats = moe_stat_tensors(model)  # on the device: read with the loss, once per interval
    if stats is None:
        return {"moe_aux_loss": 0.0, "moe_dropped": 0.0, "moe_slots": 0.0}
    return {"moe_aux_loss": stats["aux_loss"], "moe_dropped": stats["dropped"],
            "moe_slots": float(stats["slots"])}


def _moe_report(averaged: dict) -> dict:
    """The step's load-balancing loss (mean over the ``dp × ep`` micro-batches) and the fraction of
    all ranks' token-slots that the capacity dropped."""
    slots = averaged["moe_slots"]
    return {"aux_loss": averaged["moe_aux_loss"],
            "dropped_fraction": averaged["moe_dropped"] / slots if slots else 0.0}


def cp_metrics(ctx, model) -> dict:
    """``{"cp"}``, and with ``cp > 1`` the strategy ``parallelize`` chose and why."""
    choice = getattr(getattr(model, "parallel_state", None), "context_parallel", None)
    if choice is None:
        return {"cp": getattr(ctx, "cp_size", 1)}
    return {"cp": choice.cp, "cp_strategy": choice.strategy, "cp_reason": choice.reason}


def data_position(cfg) -> dict:
    """What the batch of a step depends on besides the step (:func:`get_batch`)."""
    return {"seed": cfg.seed, "batch": cfg.batch, "seq": cfg.seq, "data": cfg.data,
            **({"model": cfg.model} if cfg.model else {})}


def _precision_stats(report, scaler) -> dict:
    """Progress-line fields: the gradient norm when clipping; the loss scale and the number of
    skipped steps with fp16's loss scaler."""
    stats = {} if report.grad_norm is None else {"gnorm": report.grad_norm}
    if scaler is not None:
        stats.update(scale=scaler.scale_value, skipped=scaler.skipped_steps)
    return stats


def _sample(model, cfg, device) -> str:
    model.eval()
    prompt = torch.tensor([encode(cfg.sample_prompt)], dtype=torch.long, device=device)
    generator = torch.Generator(device).manual_seed(cfg.seed)  # same tokens on every rank
    out = model.generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=20, generator=generator)
    model.train()
    return decode(out[0].tolist())


def _metrics(cfg, ctx, model, losses, step_times, ledger, sample, extra=None) -> dict:
    warm = step_times[min(2, len(step_times) - 1):]  # the first steps pay one-off costs
    median_step = sorted(warm)[len(warm) // 2] if warm else None
    comm = ledger.summary()
    tp_ranks = tuple(range(ctx.rank, ctx.rank + ctx.tp_size))  # rank 0's TP group
    metrics = {
        "preset": cfg.preset, "tp": ctx.tp_size, "dp": ctx.dp_size, "ep": ctx.ep_size,
        **cp_metrics(ctx, model), "pp": ctx.pp_size,
        **({"pp_schedule": cfg.pp_schedule, "microbatches": cfg.microbatches,
            "stages_per_rank": cfg.pp_stages_per_rank} if ctx.pp_size > 1 else {}),
        "steps": cfg.steps, "grad_accum": cfg.grad_accum,
        "micro_batch": micro_batch(cfg, ctx.dp_ep_size),
        "batch": cfg.batch, "seq": cfg.seq, "lr": cfg.lr, "seed": cfg.seed,
        "attention": model.parallel_plan.attention, "vocab": model.parallel_plan.vocab,
        "attention_reason": model.parallel_plan.reason,
        "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
        "median_step_s": median_step,
        "tokens_per_s": cfg.batch * cfg.seq / median_step if median_step else None,
        "comm_per_step": comm,
        "comm_bytes_per_step": sum(v["bytes"] for v in comm.values()),
        "tp_comm_per_step": ledger.by_group().get(tp_ranks, {}),
        "overlap": overlap_decisions(model), "overlap_reason": overlap_summary(model),
        "ranks_per_node": ctx.ranks_per_node,
        "ranks_per_island": ctx.ranks_per_island,
        "comm_by_level": ledger.by_level(),  # what ran inside a node and across nodes
        "sample": sample, "config": asdict(cfg), **_model_metrics(cfg, ctx, model),
        "lr_last": lr_at(cfg.steps - 1, lr=cfg.lr, steps=cfg.steps, schedule=cfg.lr_schedule,
                         warmup=cfg.warmup),
        "plan": model.parallel_plan.to_dict(), **(extra or {}),
    }
    if metrics.get("trainable_params", 0) is None:
        metrics["trainable_params"] = metrics["params"]
    if cfg.out:
        try:
            write_outputs(Path(cfg.out), metrics)
        except OSError as exc:  # e.g. a full disk: the metrics still go back to the caller
            metrics["outputs_not_written"] = f"{cfg.out}: {exc.strerror or exc}"
    return metrics


def _model_metrics(cfg, ctx, model) -> dict:
    """The model's part of the metrics: its size and configuration, and for the reference GPT
    the tensor-parallel collectives the cost model expects per step."""
    if cfg.model:  # a Hugging Face model: its own config; this rank's parameter bytes
        return {"preset": None, "model_dir": cfg.model, "expected_tp_comm_per_step": None,
                **finetune.describe(model),
                "param_bytes_per_rank": finetune.local_param_bytes(model)}
    return {"expected_tp_comm_per_step": None if cfg.lora_rank or ctx.pp_size > 1 else
            expected_comm_per_step(
                model.cfg, ctx.tp_size, model.parallel_plan.attention,
                micro_batch(cfg, ctx.dp_ep_size), cfg.seq, model.parallel_plan.vocab,
                sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
                partial_elements=partial_numel(model, ctx.tp_group), overlap=cfg.overlap_mode,
                chunks=cfg.chunks, profile=ctx.profile, ep=ctx.ep_size,
                grad_accum=cfg.grad_accum),
            "params": _dense_param_count(model.cfg), "model": model.cfg.to_dict()}


def _dense_param_count(model_cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(model_cfg).parameters())


def write_outputs(out: Path, metrics: dict) -> None:
    """``metrics.json``, ``config.toml`` (the run's resolved configuration) and ``loss.png`` in
    ``out``; an ``OSError`` (a full disk) leaves no
    truncated ``metrics.json``."""
    out.mkdir(parents=True, exist_ok=True)
    partial = out / ".metrics.json.tmp"
    try:
        partial.write_text(json.dumps(metrics, indent=2) + "\n")
        partial.replace(out / "metrics.json")
    finally:
        partial.unlink(missing_ok=True)
    if "config" in metrics:  # the resolved run: `train --config OUT/config.toml` runs it again
        (out / "config.toml").write_text(to_toml(from_train_fields(metrics["config"])))
    write_line_plot_png(out / "loss.png", loss_series(metrics),
                        title=f"{metrics['preset'] or Path(metrics['model_dir']).name} "
                              f"training loss")


def loss_series(metrics: dict) -> dict[str, list[float]]:
    """The loss plot's lines, named by the layout each ran on: one, or after a resume that was
    rebalanced onto another layout the steps before it (the checkpoint's layout) and after."""
    losses, moved = metrics["losses"], metrics.get("rebalanced")
    now = f"tp={metrics['tp']} dp={metrics['dp']}" + (
        f" ep={metrics['ep']}" if metrics.get("ep", 1) > 1 else "")
    first = metrics.get("resumed_from") or 0
    if not moved or not 0 < first < len(losses):
        return {now: losses}
    old = moved["from"]
    before = f"tp={old['tp']} dp={old['dp']}" + (f" ep={old['ep']}" if old.get("ep", 1) > 1
                                                  else "")
    return {f"steps 0-{first - 1}: {before}": losses[:first],
            f"steps {first}-{len(losses) - 1}: {now} (rebalanced)":
                [math.nan] * first + losses[first:]}
