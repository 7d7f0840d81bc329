"""``ops-transformer train``: the reference GPT, or a Hugging Face causal LM (``--model DIR``,
fine-tuned), with ``dp × ep × tp`` parallelism on local ranks or under ``torchrun``."""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import functools
import inspect
import json
import signal
import sys
import time
from pathlib import Path

import torch

from ..checkpoint.space import check_free
from ..training.checkpoints import check_resume
from ..comm.topology import detect_topology
from ..models.gpt import GPT, PRESETS
from ..launch.restart import check_elastic, launch_with_restarts
from ..launch import launch
from ..parallel.context import check_local_ranks
from ..launch.local import DEFAULT_LAUNCH_TIMEOUT
from ..launch.rank_process import set_rank_threads
from ..precision import PRECISIONS
from ..parallelize.gpt_plan import ATTENTION_CHOICES
from ..parallelize.pipeline_split import SCHEDULES
from ..planner.local import local_cluster
from ..planner.search import chosen_layout
from ..training.config import to_toml
from ..training.rebalance import LAYOUT_FIELDS, LORA_SETTINGS, layout_text, rebalance, resumed_settings
from ..training.schedule import LR_SCHEDULES
from ..training.loop import RESUMED_SETTINGS, TrainConfig, train_worker, validate
from ..memory.apply import ACTIVATION_CACHES
from ..training.optimizer import ZERO_STAGES, memory_from_plan, memory_summary
from ..memory.recompute import RECOMPUTE
from ..planner.context_parallel import CP_CHOICES
from ..parallelize.compile import COMPILE_BACKENDS
from ..planner.overlap import OVERLAP_MODES
from ..utils.progress import format_duration, format_table
from ._common import (add_launch_timeout, check_out_dir, launch_timeout, missing_dirs,
                      print_json, remove_if_empty, status, under_torchrun, world_size)
from ._calibrated import command_profile
from ._interrupt import Interrupted, Journal, report_interrupt, terminate_as_interrupt
from ._hf import check_causal_lm, check_model_dir
from .checkpoint import add_checkpoint_arguments, checkpoint_settings
from ._config_file import with_config_file

HELP = "train the reference GPT, or fine-tune a Hugging Face model, with tensor (and data) " \
       "parallelism"
ATTENTION = ATTENTION_CHOICES
D = TrainConfig()  # every default of train, defined once (the dataclass)
JOURNAL = contextvars.ContextVar("journal", default=None)  # train's, while it runs


def add_parser(p) -> None:
    p.add_argument("--config", metavar="FILE", help="a run's TOML file (sections [model] "
                   "[layout] [parallel] [optim] [data] [checkpoint] [run], docs/run_config.md; "
                   "a run's OUT/config.toml runs it again); flags given override its fields")
    p.add_argument("--print-config", action="store_true", help="print the resolved run as TOML "
                   "(the file, the flags over it) and exit without starting a rank")
    add_training_arguments(p)
    p.add_argument("--model", metavar="DIR", help="fine-tune this Hugging Face causal LM (a local "
                   "save_pretrained directory, safetensors weights) instead of a preset; each "
                   "rank loads only its shards (docs/finetuning.md)")
    p.add_argument("--lr-schedule", default=D.lr_schedule, choices=LR_SCHEDULES,
                   help="after --warmup: constant, or cosine decay towards 0 at the last step")
    p.add_argument("--warmup", dest="lr_warmup", type=int, default=D.warmup, metavar="STEPS",
                   help=f"linear learning-rate warmup over the first STEPS steps (default "
                        f"{D.warmup})")


def add_model_argument(p, command: str) -> None:
    """``--model DIR`` of a command that measures train's step (``profile``, ``diagnose``): a
    Hugging Face directory as ``train --model`` takes it; a preset's name still works (the alias
    it was)."""
    p.add_argument("--model", metavar="DIR", help=f"{command} this Hugging Face causal LM (a "
                   f"local save_pretrained directory, as train --model) instead of a preset; a "
                   f"preset's name is taken as --preset")


def model_or_preset(args) -> None:
    """``--model NAME`` that is no directory but a preset: ``--preset NAME`` (in ``args``)."""
    model = getattr(args, "model", None)
    if model and not Path(model).exists() and model in PRESETS and not args.preset:
        args.preset, args.model = model, None


def add_training_arguments(p) -> None:
    """The options of a training run, shared by ``train``, ``profile``, ``diagnose``."""
    p.add_argument("--nproc", type=int, help="launch this many local ranks (gloo on a CPU "
                   "machine; NCCL, one rank per GPU, where GPUs are visible); without it, run "
                   "under torchrun (or as one process)")
    p.add_argument("--tp", type=int, help=f"tensor-parallel degree (default {D.tp})")
    p.add_argument("--dp", type=int, help="data-parallel degree (default: processes / (tp·ep))")
    p.add_argument("--ep", type=int, help="expert-parallel degree for MoE models (moe-tiny, "
                   "moe-small, or a --model such as Mixtral): n_experts/ep experts per rank "
                   f"(default {D.ep})")
    p.add_argument("--cp", type=int, help="context-parallel degree: each sequence split over cp "
                   "ranks, head-tail balanced (--seq divisible by 2·cp; reference GPT presets and "
                   "--model Llama / Mistral / Qwen2; "
                   f"default {D.cp})")
    p.add_argument("--cp-strategy", choices=CP_CHOICES, help="how attention spans the split "
                   "sequence: ring (K/V blocks passed rank to rank, overlapped), allgather_kv "
                   "(one all-gather of K/V) or auto (the cost model chooses; default "
                   f"{D.cp_strategy})")
    p.add_argument("--pack", choices=("docs", "naive"), help="train --model: how documents share "
                   "a packed row — docs: attention and positions inside each document, no target "
                   "across a boundary; naive: one stream (attention crosses documents) "
                   f"(default {D.pack})")
    p.add_argument("--pp", type=int, default=D.pp, help="pipeline stages, the outermost axis: "
                   "the preset's layers split into equal runs (torch.distributed.pipelining; "
                   f"docs/pipeline.md; default {D.pp})")
    p.add_argument("--pp-schedule", default=D.pp_schedule, choices=sorted(SCHEDULES),
                   help=f"pipeline schedule (default {D.pp_schedule})")
    p.add_argument("--microbatches", type=int, default=D.microbatches, metavar="M",
                   help="pipeline micro-batches per step and data-parallel rank "
                        f"(default {D.microbatches})")
    p.add_argument("--stages-per-rank", type=int, metavar="V", help="pipeline stages on each "
                   "rank (interleaved, looped_bfs, zero_bubble, zbv; default 2 for those, else 1)")
    p.add_argument("--preset", help=f"model preset: {', '.join(PRESETS)} (default {D.preset})")
    p.add_argument("--data", help="a text file, a directory of text files or (with --model) a "
                   ".jsonl file of {\"text\": ...} lines (default: the Python standard library's "
                   "sources on this machine)")
    p.add_argument("--steps", type=int, default=D.steps)
    p.add_argument("--batch", type=int, default=D.batch, help="global batch in sequences")
    p.add_argument("--grad-accum", type=int, metavar="N", help="gradient accumulation: each "
                   "rank runs its rows of --batch in N micro-batches of batch / (N·dp·ep) and "
                   f"reduces the gradients once per step (default {D.grad_accum}; a --resume on "
                   "another number of ranks sets it, see --rebalance)")
    p.add_argument("--seq", type=int, default=D.seq, help="sequence length in tokens (bytes for "
                   "the presets)")
    p.add_argument("--lr", type=float, default=D.lr, help=f"peak learning rate (default {D.lr})")
    p.add_argument("--seed", type=int, default=D.seed)
    p.add_argument("--attention", choices=ATTENTION,
                   help=f"attention strategy (default {D.attention})")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node (default: torchrun's "
                   "LOCAL_WORLD_SIZE, else all on one node); e.g. 2 with --nproc 4 simulates 2 "
                   "nodes x 2 ranks")
    p.add_argument("--ranks-per-island", type=int, help="consecutive ranks of a node behind one "
                   "PCIe switch or socket (default: detected on a GPU node, else one island); "
                   "e.g. 2 with --nproc 4 declares 2 PCIe islands x 2 ranks")
    p.add_argument("--plan", help="a plan from 'ops-transformer plan --out FILE' (its best "
                   "layout) or a candidate from it: sets --tp, --dp, --attention and the plan's "
                   "sequence parallelism, recompute and ZeRO stage")
    p.add_argument("--sequence-parallel", nargs="?", const=True, default=None,
                   metavar="regather", help="keep each rank's slice of the sequence between "
                   "tensor-parallel regions (needs --tp 2+, heads attention); 'regather' keeps "
                   "only that slice of each region's input too and all-gathers it again in "
                   "backward (less memory, one more all-gather per region)")
    p.add_argument("--recompute", choices=RECOMPUTE, help="recompute activations in backward: "
                   f"the attention core or every layer (default {D.recompute})")
    p.add_argument("--activation-cache", default=D.activation_cache, choices=ACTIVATION_CACHES,
                   help="keep the layers' saved activations as int8 (one scale per 128 values)")
    p.add_argument("--overlap", default=D.overlap, choices=OVERLAP_MODES,
                   help="split each tensor-parallel region's collectives (and the experts' "
                   "all-to-alls) into chunks pipelined with their matmuls: always (chunked), "
                   f"where the cost model says it pays (auto), or never (default {D.overlap})")
    p.add_argument("--chunks", type=int, default=D.chunks,
                   help=f"the chunks of --overlap (at most, for auto; default {D.chunks})")
    p.add_argument("--compile", action="store_true", help="compile each Transformer block "
                   "with torch.compile(fullgraph=True) (needs --overlap none or auto, which then "
                   "runs as none; the first steps pay the compile time)")
    p.add_argument("--compile-backend", default=D.compile_backend, choices=COMPILE_BACKENDS,
                   help=f"the torch.compile backend of --compile (default {D.compile_backend}; "
                   "aot_eager compiles fast and runs eager kernels)")
    p.add_argument("--dropout", type=float, metavar="P", help="the preset's dropout probability "
                   "(one-device masks at any dp × tp; default: the preset's own)")
    p.add_argument("--moe-statistics", default=D.moe_statistics, choices=("local", "global"),
                   help="MoE capacity and load-balancing loss over each rank's micro-batch "
                   "(local, Megatron's default) or the global batch (global: one small all-gather "
                   f"per MoE layer; equals one process) (default {D.moe_statistics})")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES,
                   help="ZeRO stage over the data-parallel ranks: 1 shards the optimizer state, 2 "
                   "also the gradients, 3 also the parameters (FSDP2) "
                   f"(default {D.zero}: off)")
    p.add_argument("--out", help="output directory (default runs/train-<timestamp>)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-every", type=int, default=D.log_every, metavar="N",
                   help=f"read the loss and metrics from the device once per N steps (default "
                   f"{D.log_every}: no host synchronisation in the steps between; every step's "
                   f"loss is still reported)")
    p.add_argument("--precision", default=D.precision, choices=PRECISIONS,
                   help="compute dtype: fp32, or bf16 / fp16 autocast over fp32 master weights "
                   f"(fp16 with a dynamic loss scaler), or fp8 (the blocks' matmuls in fp8 with "
                   f"tensorwise dynamic scales agreed over tp); default {D.precision}")
    p.add_argument("--fp8-backward", default=D.fp8_backward, choices=("e5m2", "fp32"),
                   help="--precision fp8: the backward's matmuls with the gradients cast to e5m2 "
                   "(torchao's recipe) or in fp32 from the dequantised operands (straight-through) "
                   f"(default {D.fp8_backward})")
    p.add_argument("--clip-grad", type=float, metavar="NORM",
                   help="clip the gradients to this total norm (the dense model's)")
    add_lora_arguments(p)
    add_checkpoint_arguments(p)
    add_launch_timeout(p)
    p.add_argument("--tensorboard", metavar="DIR", help="log loss, tokens/s, communication (and "
                   "the loss scale, with one) as TensorBoard scalars in DIR")


def add_lora_arguments(p) -> None:
    """``--lora-rank`` and the options of LoRA fine-tuning (docs/finetuning.md)."""
    p.add_argument("--lora-rank", type=int, metavar="R", help="train LoRA adapters of rank R on "
                   "the attention and FFN linears (or --lora-targets), every other weight frozen")
    p.add_argument("--lora-alpha", type=float, metavar="A",
                   help="the adapters' alpha: their output is scaled by A/R (default: R)")
    p.add_argument("--lora-targets", type=_targets, metavar="P1,P2,...", help="module names or "
                   "fnmatch patterns of the linears to adapt, e.g. '*.q_proj,*.v_proj'")
    p.add_argument("--lora-dropout", type=float, default=D.lora_dropout, metavar="P",
                   help=f"dropout on the adapters' input (default {D.lora_dropout:g})")


def _targets(text: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise argparse.ArgumentTypeError("expected comma-separated module names or patterns")
    return targets


def lora_settings(args) -> dict:
    """The ``TrainConfig`` fields of the ``--lora-*`` flags (absent flags: the defaults)."""
    return {name: getattr(args, name) for name in ("lora_rank", "lora_alpha", "lora_targets",
                                                   "lora_dropout") if hasattr(args, name)}


def layout_from_plan(path: str) -> dict:
    """``{"tp", "dp", "ep", "attention", "sequence_parallel", "recompute", "zero"}`` from a planner
    result (its ``best``) or one candidate."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--plan {path!r} is not a readable JSON plan: {exc}") from None
    try:
        layout = chosen_layout(data)
    except ValueError as exc:
        raise ValueError(f"--plan {path!r} has no layout ({exc})") from None
    cp = {"cp": layout["cp"], "cp_strategy": layout["cp_strategy"]} if layout["cp"] > 1 else {}
    pp = ({k: layout[k] for k in ("pp", "pp_schedule", "stages_per_rank", "micro_batch")}
          if layout["pp"] > 1 else {})
    return {"tp": layout["tp"], "dp": layout["dp"], "ep": layout["ep"],
            "attention": layout["attention"], **memory_from_plan(layout, path), **cp, **pp}


def planned_pipeline(args, layout: dict) -> dict:
    """A pipelined plan's ``pp``, schedule, stages per rank and micro-batches (``--batch``'s rows
    per data-parallel rank in micro-batches of the plan's size), taken out of ``layout``; ``{}``
    for a plan without pp. A different ``--pp`` or ``--microbatches`` is a conflict."""
    if "pp" not in layout:
        return {}
    planned = {k: layout.pop(k) for k in ("pp", "pp_schedule", "stages_per_rank", "micro_batch")}
    rows, size = args.batch // max(layout["dp"], 1), planned.pop("micro_batch") or 1
    if args.batch % max(layout["dp"], 1) or rows % size:
        raise ValueError(f"--plan {args.plan!r} runs pipeline micro-batches of {size} "
                         f"sequence(s) on each of its dp ({layout['dp']}) rank(s): --batch "
                         f"{args.batch} must be a multiple of {size * layout['dp']}")
    planned["microbatches"] = rows // size
    for flag, key, default in (("--pp", "pp", D.pp), ("--microbatches", "microbatches",
                                                      D.microbatches)):
        given = getattr(args, key, default)
        if given not in (default, planned[key]):
            raise ValueError(f"--plan {args.plan!r} sets {flag} {planned[key]}, but also {flag} "
                             f"{given} was given: drop the flag or the plan")
    return planned


def _note_micro_batch(args, layout: dict) -> None:
    """The plan's micro-batch is a property of its global batch; ``train`` runs each rank's rows
    of ``--batch`` in one step (no gradient accumulation): say so when they differ."""
    try:
        data = json.loads(Path(args.plan).read_text())
        chosen_layout(data)
        planned = (data.get("best") or data).get("micro_batch")
    except (OSError, ValueError, AttributeError):
        return
    readers = (layout["dp"] or 1) * layout.get("ep", 1)
    if planned and planned * readers != args.batch:
        status(f"ops-transformer train: note: --plan plans micro-batches of {planned} "
               f"sequence(s) per rank; train runs the {args.batch / readers:g} rows of --batch "
               f"{args.batch} each rank reads in one step (--batch {planned * readers} runs the "
               f"plan's micro-batch)")


def config_from_args(args, out_prefix: str) -> TrainConfig:
    out = args.out or f"runs/{out_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    given = {"tp": args.tp, "dp": args.dp, "ep": getattr(args, "ep", None),
             "attention": args.attention,
             "sequence_parallel": getattr(args, "sequence_parallel", None),
             "recompute": getattr(args, "recompute", None), "zero": getattr(args, "zero", None)}
    layout = {k: getattr(D, k) if v is None else v for k, v in given.items()}  # absent: defaults
    piped = {}  # a pipelined plan's pp, schedule and micro-batches
    if getattr(args, "plan", None):
        layout = layout_from_plan(args.plan)
        piped = planned_pipeline(args, layout)
        if not piped:
            _note_micro_batch(args, layout)
        conflicts = [f"--{k.replace('_', '-')} {v} (the plan has {layout[k]})"
                     for k, v in given.items() if v is not None and v != layout[k]]
        planned_cp = layout.pop("cp", None)  # cp and its strategy: from the plan, below
        if planned_cp and getattr(args, "cp", None) not in (None, 1, planned_cp):
            conflicts.append(f"--cp {args.cp} (the plan has {planned_cp})")
        if planned_cp:
            args.cp, args.cp_strategy = planned_cp, layout.pop("cp_strategy")
        if conflicts:
            raise ValueError(f"--plan {args.plan!r} sets --tp, --dp, --ep, --attention, "
                             f"--sequence-parallel, --recompute and --zero, but also "
                             f"{', '.join(conflicts)}: drop the flag or the plan")
    model = getattr(args, "model", None)
    if model and args.preset:
        raise ValueError(f"--model {model!r} and --preset {args.preset!r} both name the model: "
                         f"--model fine-tunes a checkpoint, --preset builds a reference GPT; "
                         f"give one")
    accum = getattr(args, "grad_accum", None)
    return TrainConfig(preset=args.preset or D.preset, steps=args.steps, batch=args.batch,
                       seq=args.seq, lr=args.lr, seed=args.seed, data=args.data, out=out,
                       model=model, lr_schedule=getattr(args, "lr_schedule", D.lr_schedule),
                       warmup=getattr(args, "lr_warmup", D.warmup),
                       grad_accum=D.grad_accum if accum is None else accum,
                       progress=not args.no_progress, **layout,
                       log_every=getattr(args, "log_every", D.log_every),
                       precision=args.precision, clip_grad=args.clip_grad,
                       tensorboard=getattr(args, "tensorboard", None),
                       ranks_per_node=getattr(args, "ranks_per_node", None),
                       ranks_per_island=getattr(args, "ranks_per_island", None),
                       activation_cache=getattr(args, "activation_cache", D.activation_cache),
                       overlap=getattr(args, "overlap", D.overlap),
                       chunks=getattr(args, "chunks", D.chunks),
                       dropout=getattr(args, "dropout", D.dropout),
                       moe_statistics=getattr(args, "moe_statistics", D.moe_statistics),
                       cp=getattr(args, "cp", None) or D.cp,
                       cp_strategy=getattr(args, "cp_strategy", None) or D.cp_strategy,
                       pack=getattr(args, "pack", None) or D.pack,
                       compile=getattr(args, "compile", D.compile),
                       compile_backend=getattr(args, "compile_backend", D.compile_backend),
                       fp8_backward=getattr(args, "fp8_backward", D.fp8_backward),
                       **checkpoint_settings(args), **lora_settings(args),
                       **{**pipeline_settings(args), **piped})


def pipeline_settings(args) -> dict:
    """``--pp``, ``--pp-schedule``, ``--microbatches``, ``--stages-per-rank``."""
    return {"pp": getattr(args, "pp", D.pp), "pp_schedule": getattr(args, "pp_schedule",
                                                                      D.pp_schedule),
            "microbatches": getattr(args, "microbatches", D.microbatches),
            "stages_per_rank": getattr(args, "stages_per_rank", D.stages_per_rank)}


def stated_layout(args) -> set[str]:
    """The layout flags the command line gave (``--plan`` gives the degrees): a ``--resume`` on
    another size prefers them to the checkpoint's (:func:`~ops_transformer.rebalance.rebalance`)."""
    stated = {k for k in LAYOUT_FIELDS if getattr(args, k, None) is not None}
    return stated | ({"tp", "dp", "ep"} if getattr(args, "plan", None) else set())


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


def launch_size(args, cfg: TrainConfig) -> int | None:
    """``--nproc``; without it and outside torchrun, the ranks of a fixed layout (a plan, or
    degrees above 1), launched locally."""
    size = cfg.tp * cfg.ep * (cfg.dp or 1)
    if args.nproc is None and not under_torchrun() and (args.plan or size > 1):
        return size
    return args.nproc


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


def run(args) -> int:
    cfg, in_file = config_from_args(args, "train"), set()
    if getattr(args, "config", None):
        cfg, in_file = with_config_file(args, cfg, add_parser)
    if getattr(args, "print_config", False):
        print(to_toml(cfg.run_config()), end="")
        return 0
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
