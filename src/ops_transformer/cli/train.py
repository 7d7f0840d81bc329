"""``ops-transformer train``: the reference GPT, or a Hugging Face causal LM (``--model DIR``,
fine-tuned), with ``dp × ep × tp`` parallelism on local ranks or under ``torchrun``."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import signal
import sys
from pathlib import Path

import torch

from ..checkpoint.space import check_free
from ..training.checkpoints import check_resume
from ..comm.topology import detect_topology
from ..models.gpt import GPT
from ..launch.restart import check_elastic, launch_with_restarts
from ..launch import launch
from ..parallel.context import check_local_ranks
from ..launch.local import DEFAULT_LAUNCH_TIMEOUT
from ..launch.rank_process import set_rank_threads
from ..planner.local import local_cluster
from ..training.config import to_toml
from ..training.rebalance import LAYOUT_FIELDS, LORA_SETTINGS, layout_text, rebalance, resumed_settings
from ..training.loop import RESUMED_SETTINGS, TrainConfig, train_worker, validate
from ..training.optimizer import memory_summary
from ..utils.progress import format_duration, format_table
from ._common import (check_out_dir, launch_timeout, missing_dirs, print_json, remove_if_empty,
                      status, under_torchrun, world_size)
from ._calibrated import command_profile
from ._interrupt import Interrupted, Journal, report_interrupt, terminate_as_interrupt
from ._hf import check_causal_lm, check_model_dir
from ._config_file import with_config_file
from . import train_args
from .train_args import (ATTENTION, HELP, D, add_lora_arguments, add_model_argument,  # noqa: F401
                         add_parser, add_training_arguments, check_args, launch_size,
                         layout_from_plan, lora_settings, model_or_preset, pipeline_settings,
                         train_fields)

JOURNAL = contextvars.ContextVar("journal", default=None)  # train's, while it runs


def rebalanced(cfg: TrainConfig, ranks: int, stated=None) -> TrainConfig:
    """``cfg`` re-planned for a resume on ``ranks`` (:mod:`ops_transformer.rebalance`), what it
    changed said on stderr, and validated."""
    cluster = None
    if cfg.resume and cfg.ckpt_dir and cfg.rebalance == "auto":
        cluster = local_cluster(ranks, command_profile(None), topology=detect_topology())
    plan = rebalance(cfg, ranks, stated=stated, cluster=cluster)
    if plan.message():
        status(f"ops-transformer train: {plan.message()}")
    validate(plan.cfg, ranks, say=status)
    return plan.cfg


def run_training(cfg: TrainConfig, nproc: int | None,
                 timeout: float = DEFAULT_LAUNCH_TIMEOUT, worker=None,
                 args: tuple = (), stated=None, journal=None) -> dict | None:
    """Validate (the output directory included), then run ``worker(cfg, *args)`` (training by
    default) on ``nproc`` local ranks, on the ranks of this torchrun job, or in this one process
    (with the launcher's thread policy), with the calibrated profile if there is one (needed for
    ``--attention auto``) as its ``profile=``. A ``--resume`` is first re-planned for the ranks
    it has (:func:`rebalanced`; ``stated``: the layout flags given, see :func:`stated_layout`),
    again after an ``--elastic`` restart lost a node (the metrics then record ``rebalanced``).
    ``journal``: a :class:`~ops_transformer.cli._interrupt.Journal` that rank 0 reports its
    progress to (``train_worker``'s; default: the one ``train`` set in :data:`JOURNAL`)."""
    worker = worker or train_worker
    journal = journal or JOURNAL.get()
    if journal is not None and not _takes_journal(worker):
        journal = None
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if nproc is not None:
        check_local_ranks(nproc, "--nproc")
    if cfg.model:
        _check_model_dir(cfg.model)
    if cfg.elastic:
        if nproc is None:
            raise ValueError("--elastic drops a node of local ranks (--nproc); under torchrun "
                             "use torchrun --nnodes MIN:MAX, whose restarts train rebalances")
        check_elastic(nproc, cfg.ranks_per_node)
    planned = rebalanced(cfg, world_size() if nproc is None else nproc, stated)
    if check_resume(planned):
        status(f"ops-transformer train: no checkpoint in {planned.ckpt_dir}: starting from step 0")
    profile = command_profile("--attention auto" if planned.attention == "auto" else None)
    created = [missing_dirs(planned.out), missing_dirs(planned.ckpt_dir)]
    try:
        return _checked_run(planned, nproc, timeout, worker, args, profile,
                            lambda n: (rebalanced(cfg, n, stated), *args), journal)
    except BaseException:
        for dirs in created:  # a run that failed before writing leaves no empty directory
            remove_if_empty(dirs)
        raise


def _takes_journal(worker) -> bool:
    try:
        return "journal" in inspect.signature(worker).parameters
    except (TypeError, ValueError):
        return False


def _checked_run(cfg: TrainConfig, nproc: int | None, timeout: float, worker, args: tuple,
                 profile, resize=None, journal=None) -> dict | None:
    """``cfg`` (validated, re-planned) run; ``resize(n)``: its arguments on ``n`` ranks after an
    ``--elastic`` restart lost a node."""
    if cfg.out:
        check_out_dir(cfg.out)
    if cfg.ckpt_dir:
        check_out_dir(cfg.ckpt_dir, "--ckpt-dir")
        goes_on = cfg.on_save_error == "continue"
        try:
            check_free(cfg.ckpt_dir, checkpoint_bytes(cfg), "saving the first checkpoint of "
                       "this run", "; training anyway (--on-save-error continue)" if goes_on
                       else "; nothing was run", place=f"--ckpt-dir {cfg.ckpt_dir}")
        except ValueError as exc:
            if not goes_on:
                raise
            status(f"ops-transformer train: warning: {exc}")
    extra = {} if profile is None else {"profile": profile}  # none: the built-in profile
    if nproc is not None:
        with contextlib.nullcontext() if journal is None else journal.pipe() as channel:
            if channel is not None:  # rank 0 reports to this process through it
                worker = functools.partial(worker, journal=channel)
            return launch_with_restarts(worker, nproc, cfg, *args,
                                        max_restarts=cfg.max_restarts, launcher=launch,
                                        elastic=cfg.elastic, ranks_per_node=cfg.ranks_per_node,
                                        resize=resize, timeout=timeout, **extra)[0]
    if journal is not None:
        worker = functools.partial(worker, journal=journal)
    if cfg.max_restarts:
        raise ValueError("--max-restarts restarts local ranks (--nproc); under torchrun use "
                         "torchrun's own --max-restarts")
    if under_torchrun():
        return worker(cfg, *args, **extra)
    threads = torch.get_num_threads()
    set_rank_threads()
    try:
        return worker(cfg, *args, **extra)
    finally:
        torch.set_num_threads(threads)


def checkpoint_bytes(cfg: TrainConfig) -> int:
    """About the size of one checkpoint of ``cfg``: the weights and AdamW's two states (fp32 for
    the reference GPT; for ``--model DIR`` three times its weight files, in their dtype)."""
    if cfg.model:
        files = [p for p in Path(cfg.model).iterdir()
                 if p.suffix in (".safetensors", ".bin") and p.is_file()]
        return 3 * sum(p.stat().st_size for p in files) + (1 << 20)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg.model_config()).parameters())
    return 3 * 4 * params + (1 << 20)


def output_bytes(cfg: TrainConfig) -> int:
    """About what ``train`` writes to ``--out``: ``metrics.json`` (the losses) and ``loss.png``."""
    return (256 << 10) + 64 * cfg.steps


def _check_model_dir(path: str) -> None:
    root, config = check_model_dir(path, "train --model")
    check_causal_lm(root, config, "train --model")


def _add_prediction(metrics: dict, cfg: TrainConfig, nproc: int) -> None:
    """``train --plan``: the calibrated local model's step time for this run next to the
    measured one (``predicted_step_s``; ``None`` without a calibrated profile)."""
    from ..profiler.local_model import predict_step_s

    if cfg.model:  # the local model knows the reference GPT only
        return
    metrics["predicted_step_s"] = predict_step_s(cfg, nproc, command_profile(None),
                                                 attention=metrics["attention"],
                                                 vocab=metrics["vocab"])


SUMMARY_COLUMNS = 100  # the end-of-run summary fits a terminal; the long reasons are in metrics.json


def summary(metrics: dict) -> str:
    """The end-of-run table, at most :data:`SUMMARY_COLUMNS` wide: a value too long for it is cut
    (``…``; not a path the user gave), and what it would have said is in ``metrics.json`` (the overlap decisions under
    ``overlap_reason``, the attention choice under ``attention_reason``)."""
    rows = [
        *([{"": "model", "value": f"{metrics['model_class']} ({metrics['model_dir']})"}]
          if metrics.get("model_dir") else []),
        {"": "layout", "value": (f"pp={metrics['pp']} ({metrics['pp_schedule']}, "
                                 f"{metrics['microbatches']} micro-batches) × "
                                 if metrics.get("pp", 1) > 1 else "") + f"dp={metrics['dp']} × "
                                + (f"ep={metrics['ep']} × " if metrics.get("ep", 1) > 1 else "")
                                + (f"cp={metrics['cp']} × " if metrics.get("cp", 1) > 1 else "")
                                + f"tp={metrics['tp']}" + _accumulation(metrics)},
        {"": "attention", "value": metrics["attention"]},
        *([{"": "context parallel", "value": f"{metrics['cp_strategy']} "
                                             f"({metrics['cp_reason']})"}]
          if metrics.get("cp", 1) > 1 else []),
        {"": "precision", "value": _precision_line(metrics)},
        {"": "parameters", "value": f"{metrics['params']:,}"},
        *([{"": "trainable parameters", "value": _trainable_line(metrics)}]
          if metrics.get("trainable_params") is not None else []),
        {"": "loss first → last", "value": f"{metrics['loss_first']:.4f} → "
                                           f"{metrics['loss_last']:.4f}"},
        {"": "tokens/s (median step)", "value": f"{metrics['tokens_per_s'] or 0:,.0f}"},
        *([{"": "step ms measured / predicted", "value": _predicted_line(metrics)}]
          if "predicted_step_s" in metrics else []),
        {"": "communication / step",
         "value": f"{metrics['comm_bytes_per_step'] / 2**20:.3f} MiB"},
    ]
    if metrics["config"].get("overlap", "none") != "none":
        reason = metrics.get("overlap_reason") or ""
        head = reason.split(";")[0].strip()
        rows.append({"": f"overlap ({metrics['config']['overlap']})",
                     "value": head + (" (why: overlap_reason in metrics.json)"
                                      if head != reason.strip() else "")})
    memory = memory_summary(metrics["config"])
    if memory:
        rows.insert(2, {"": "memory", "value": memory})
    if "moe" in metrics:
        rows.append({"": "MoE aux loss / dropped (last)",
                     "value": f"{metrics['moe']['aux_loss'][-1]:.4f} / "
                              f"{metrics['moe']['dropped_fraction'][-1]:.1%} of token-slots"})
    if metrics["config"].get("ckpt_dir"):
        rows.append({"": "checkpoints", "value": metrics["config"]["ckpt_dir"]})
    if metrics.get("wall_s") is not None:
        rows.append({"": "wall time", "value": format_duration(metrics["wall_s"])})
    label = max(len(r[""]) for r in rows)
    room = SUMMARY_COLUMNS - label - 2
    for row in rows:  # (paths are the user's own: never cut)
        if len(row["value"]) > room and row[""] not in ("model", "checkpoints"):
            row["value"] = row["value"][:room - 1] + "…"
    return format_table(rows)


def _trainable_line(metrics: dict) -> str:
    """``"12,288 (9.9% of 124,544; LoRA rank 8 on 8 modules)"``."""
    n, total, lora = metrics["trainable_params"], metrics["params"], metrics.get("lora")
    text = f"{n:,}" + (f" ({n / total:.2%} of {total:,}" if total else " (")
    if lora:
        text += f"; LoRA rank {lora['rank']} on {lora['modules']} modules"
    return text + ")"


def _accumulation(metrics: dict) -> str:
    """``", accumulation 2 × micro-batch 2"`` with gradient accumulation; what a rebalanced
    resume changed."""
    text = (f", accumulation {metrics['grad_accum']} × micro-batch {metrics['micro_batch']}"
            if metrics.get("grad_accum", 1) > 1 else "")
    moved = metrics.get("rebalanced")
    if moved:
        old = moved["from"]
        text += (f" (rebalanced from {layout_text(old['dp'], old['ep'], old['tp'])}, "
                 f"accumulation {old['grad_accum']})")
    return text


def _predicted_line(metrics: dict) -> str:
    measured, predicted = metrics["median_step_s"], metrics["predicted_step_s"]
    if predicted is None:
        return f"{1e3 * (measured or 0):.2f} / - (run `ops-transformer calibrate`)"
    return (f"{1e3 * (measured or 0):.2f} / {1e3 * predicted:.2f} (calibrated local model, "
            f"{predicted / measured - 1:+.0%})" if measured else f"- / {1e3 * predicted:.2f}")


def _precision_line(metrics: dict) -> str:
    line = metrics.get("precision", "fp32")
    if "loss_scale" in metrics:
        line += f" (loss scale {metrics['loss_scale']:g}, {metrics['skipped_steps']} skipped steps)"
    if metrics.get("clip_grad"):
        line += f", gradients clipped to norm {metrics['clip_grad']:g}"
    return line


def config_from_args(args, out_prefix: str, add_parser=None) -> TrainConfig:
    """The :class:`~ops_transformer.training.loop.TrainConfig` of the command line
    (:func:`~ops_transformer.cli.train_args.train_fields`), over ``--config``'s file where one is
    given (``add_parser``: what builds the command's training flags, to tell those given; default
    train's)."""
    fields = train_fields(args, out_prefix)
    if getattr(args, "config", None):
        fields, _ = with_config_file(args, fields, add_parser or train_args.add_parser)
    return TrainConfig(**fields)


def stated_layout(args) -> set[str]:
    """The layout flags the command line gave (``--plan`` gives the degrees): a ``--resume`` on
    another size prefers them to the checkpoint's (:func:`~ops_transformer.rebalance.rebalance`)."""
    stated = {k for k in LAYOUT_FIELDS if getattr(args, k, None) is not None}
    return stated | ({"tp", "dp", "ep"} if getattr(args, "plan", None) else set())


def given_settings(args) -> set[str]:
    """The :data:`~ops_transformer.rebalance.RESUMED_SETTINGS` and LoRA fields the command line
    set (its own words, ``args.argv``; without them: the values that are not the defaults)."""
    names = (*RESUMED_SETTINGS, *LORA_SETTINGS)
    flags = {n: "--" + n.replace("_", "-") for n in names}
    argv = getattr(args, "argv", None)
    if argv is None:
        cfg = config_from_args(args, "train")
        return {n for n in names if getattr(cfg, n) != getattr(D, n)}
    words = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    exact = set(flags.values())
    return {n for n, f in flags.items()
            if f in words or any(f.startswith(w) and w not in exact and len(w) > 3
                                 for w in words)}


def _dry_run(args, cfg: TrainConfig) -> int:
    """``train --dry-run``: what each rank would build, on ``meta`` (:mod:`ops_transformer.training.meta_run`);
    the table, or with ``--json`` the whole report; nothing written."""
    from ..training.meta_run import dry_run, table

    report = dry_run(cfg, nproc=launch_size(args, cfg))
    if args.json:
        print_json(report)
    else:
        print(table(report))
    return 0


def run(args) -> int:
    fields, in_file = train_fields(args, "train"), set()
    if getattr(args, "config", None):
        fields, in_file = with_config_file(args, fields, add_parser)
    cfg = TrainConfig(**fields)
    if getattr(args, "print_config", False):
        print(to_toml(cfg.run_config()), end="")
        return 0
    if getattr(args, "dry_run", False):
        return _dry_run(args, cfg)
    cfg, kept = resumed_settings(cfg, given_settings(args) | in_file)
    if kept:
        status(f"ops-transformer train: {kept}")
    check_free(cfg.out, output_bytes(cfg), "writing metrics.json and loss.png",
               "; nothing was run", place=f"--out {cfg.out}")
    nproc = launch_size(args, cfg)
    stated = stated_layout(args) | (in_file & set(LAYOUT_FIELDS))
    resumed = {"stated": stated} if cfg.resume and cfg.rebalance == "auto" else {}
    journal = Journal()
    try:
        with terminate_as_interrupt():
            token = JOURNAL.set(journal)
            try:
                metrics = run_training(cfg, nproc, launch_timeout(args), **resumed)
            finally:
                JOURNAL.reset(token)
    except (KeyboardInterrupt, Interrupted) as exc:
        if under_torchrun():  # torchrun's agent stops every rank: no report from one of them
            raise
        signum = getattr(exc, "signum", signal.SIGINT)
        return report_interrupt(cfg, signum, journal, getattr(args, "argv", ["train"]),
                                nproc or 1, cfg.progress)
    if metrics is None:  # not rank 0 of a torchrun job
        return 0
    if getattr(args, "plan", None):
        _add_prediction(metrics, cfg, nproc or world_size())
    if args.json:
        print_json(metrics)
    else:
        print(summary(metrics))
        if metrics["sample"] is not None:  # its start; the whole of it is in metrics.json
            sample = f"sample: {metrics['sample']!r}"
            print("\n" + (sample if len(sample) <= SUMMARY_COLUMNS
                          else sample[:SUMMARY_COLUMNS - 1] + "…"))
    lost = metrics.get("outputs_not_written")
    if lost:  # the run is done; its results are what was printed
        print(f"ops-transformer train: error: metrics.json and loss.png could not be written to "
              f"{lost}; the metrics are printed above" + ("" if args.json else
                                                          " (--json prints all of them)"),
              file=sys.stderr)
        return 1
    if not args.json:
        print(f"\nwrote metrics.json and loss.png in {cfg.out}")
    return 0
