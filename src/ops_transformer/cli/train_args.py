"""``ops-transformer train``'s command line, torch-free: its flags (shared by ``profile`` and
``diagnose``), the ``TrainConfig`` fields they give (:func:`train_fields`), and the checks of them
that need no rank (:func:`check_args`: the run's sections and :func:`~ops_transformer.training.
preflight.preflight`) — so ``train --help`` and an argument error import no torch. The run itself
is :mod:`ops_transformer.cli.train`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

from ..models.config import PRESETS
from ..schema.choices import (ACTIVATION_CACHES, ATTENTION_CHOICES, COMPILE_BACKENDS, CP_CHOICES,
                              OVERLAP_MODES, PRECISIONS, RECOMPUTE, ZERO_STAGES)
from ..schema.choices import PIPELINE_SCHEDULES as SCHEDULES
from ..training.config import (PACKS, REBALANCE, SECTION_ORDER, RunConfig, from_train_fields,
                               section_flags, section_summary)
from ..training.preflight import preflight
from ..training.schedule import LR_SCHEDULES
from ._common import add_launch_timeout, status, under_torchrun, world_size
from ._config_file import with_config_file

HELP = "train the reference GPT, or fine-tune a Hugging Face model, with tensor (and data) " \
       "parallelism"
ATTENTION = ATTENTION_CHOICES
# every default of train, defined once: the run's sections (TrainConfig's fields, flat)
D = SimpleNamespace(**RunConfig().train_fields())


def check_args(args, add_parser=None) -> None:
    """What the command line (and ``--config``) asks for, checked before anything heavy is
    imported: the run's sections, then :func:`~ops_transformer.training.preflight.preflight` on
    the processes it launches. A value the sections refuse is left to ``validate`` (whose
    messages say more about that option), as is a ``--resume`` (its layout may be re-planned
    from the checkpoint), a ``--plan`` and ``--print-config`` (which checks nothing)."""
    if getattr(args, "plan", None) or getattr(args, "print_config", False):
        return
    fields = train_fields(args, getattr(args, "command", "train"))
    if getattr(args, "config", None):
        fields, _ = with_config_file(args, fields, add_parser or globals()["add_parser"])
    if fields.get("resume") or fields.get("elastic"):
        return
    try:
        run = from_train_fields(fields)
    except (ValueError, TypeError):
        return
    preflight(run, launch_size(args, run.layout) or world_size())


class SectionGroups:
    """``add_argument`` into the argument group named after the run's section whose field the flag
    sets (``--tp`` under ``layout``, ``--lr`` under ``optim``), and a flag no field has (``--nproc``,
    ``--plan``, ``--json``, …) under "launch and output": what groups ``train --help`` by
    section."""

    def __init__(self, parser):
        self.parser = parser
        self.flags = section_flags()
        self.groups = {name: parser.add_argument_group(name, f"[{name}] " + section_summary(name))
                       for name in SECTION_ORDER}
        self.other = parser.add_argument_group("launch and output", "how the run is started and "
                                               "what it prints (no field of the run's file)")

    def add_argument(self, *names, **kwargs):
        section = self.flags.get(names[0])
        return (self.groups[section] if section else self.other).add_argument(*names, **kwargs)


def add_parser(p) -> None:
    p = SectionGroups(p)
    add_config_argument(p)
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


def add_config_argument(p, command: str = "train", note: str = "") -> None:
    """``--config FILE``: a run's TOML file under the command line (flags > file > defaults)."""
    p.add_argument("--config", metavar="FILE", help=f"a run's TOML file (sections [model] "
                   f"[layout] [parallel] [optim] [data] [checkpoint] [run], docs/run_config.md; "
                   f"a run's OUT/config.toml {'runs it again' if command == 'train' else 'too'})"
                   f"{note}; flags given override its fields")


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
    p.add_argument("--pack", choices=PACKS, help="train --model: how documents share "
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
    p.add_argument("--precision", default=D.precision, choices=PRECISIONS,
                   help="compute dtype: fp32, or bf16 / fp16 autocast over fp32 master weights "
                   f"(fp16 with a dynamic loss scaler), or fp8 (the blocks' matmuls in fp8 with "
                   f"tensorwise dynamic scales agreed over tp); default {D.precision}")
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
    from ..planner.search import chosen_layout  # a plan's file: the planner (torch) reads it
    from ..training.optimizer import memory_from_plan

    try:
        layout = chosen_layout(data)
    except ValueError as exc:
        raise ValueError(f"--plan {path!r} has no layout ({exc})") from None
    cp = {"cp": layout["cp"], "cp_strategy": layout["cp_strategy"]} if layout["cp"] > 1 else {}
    return {"tp": layout["tp"], "dp": layout["dp"], "ep": layout["ep"],
            "attention": layout["attention"], **memory_from_plan(layout, path), **cp}


def _note_micro_batch(args, layout: dict) -> None:
    """The plan's micro-batch is a property of its global batch; ``train`` runs each rank's rows
    of ``--batch`` in one step (no gradient accumulation): say so when they differ."""
    from ..planner.search import chosen_layout

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


def train_fields(args, out_prefix: str) -> dict:
    """The ``TrainConfig`` fields of the command line (absent flags: the defaults; ``--plan``:
    its layout), torch-free: :func:`~ops_transformer.cli.train.config_from_args` builds the
    ``TrainConfig``."""
    out = args.out or f"runs/{out_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    given = {"tp": args.tp, "dp": args.dp, "ep": getattr(args, "ep", None),
             "attention": args.attention,
             "sequence_parallel": getattr(args, "sequence_parallel", None),
             "recompute": getattr(args, "recompute", None), "zero": getattr(args, "zero", None)}
    layout = {k: getattr(D, k) if v is None else v for k, v in given.items()}  # absent: defaults
    if getattr(args, "plan", None):
        layout = layout_from_plan(args.plan)
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
    return dict(preset=args.preset or D.preset, steps=args.steps, batch=args.batch,
                       seq=args.seq, lr=args.lr, seed=args.seed, data=args.data, out=out,
                       model=model, lr_schedule=getattr(args, "lr_schedule", D.lr_schedule),
                       warmup=getattr(args, "lr_warmup", D.warmup),
                       grad_accum=D.grad_accum if accum is None else accum,
                       progress=not args.no_progress, **layout,
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
                       **checkpoint_settings(args), **lora_settings(args),
                       **pipeline_settings(args))


def pipeline_settings(args) -> dict:
    """``--pp``, ``--pp-schedule``, ``--microbatches``, ``--stages-per-rank``."""
    return {"pp": getattr(args, "pp", D.pp), "pp_schedule": getattr(args, "pp_schedule",
                                                                      D.pp_schedule),
            "microbatches": getattr(args, "microbatches", D.microbatches),
            "stages_per_rank": getattr(args, "stages_per_rank", D.stages_per_rank)}


def add_checkpoint_arguments(p) -> None:
    """The checkpoint flags of ``train``."""
    p.add_argument("--ckpt-dir", help="write sharded checkpoints here (docs/checkpoints.md)")
    defaults = D
    p.add_argument("--save-every", type=int, default=defaults.save_every, help="checkpoint every "
                   f"N steps (default {defaults.save_every}: only after the last step)")
    p.add_argument("--resume", nargs="?", const=True, default=False, choices=(True, "strict"),
                   metavar="strict", help="continue from the latest checkpoint in --ckpt-dir if "
                   "there is one (the same command starts and restarts a job); a damaged latest "
                   "one is skipped with a warning for the newest that verifies, unless "
                   "'--resume strict'")
    p.add_argument("--max-restarts", type=int, default=defaults.max_restarts,
                   help="with --nproc: restart all ranks after a failure this many times "
                   "(torchrun: use its own --max-restarts)")
    p.add_argument("--keep-checkpoints", type=int, default=defaults.keep_checkpoints,
                   help=f"newest checkpoints kept (default {defaults.keep_checkpoints})")
    p.add_argument("--on-save-error", choices=("stop", "continue"), default=defaults.on_save_error,
                   help="when a checkpoint cannot be saved (a full disk): stop the run (default), "
                   "or warn and go on training (the next save tries again)")
    p.add_argument("--rebalance", choices=REBALANCE, default=defaults.rebalance,
                   help="--resume on another number of ranks: 'auto' re-plans the layout (tp "
                   "and ep kept when they fit) and the gradient accumulation so that the global "
                   "batch, the micro-batch and the sample order stay the run's; 'off' runs the "
                   f"layout given (default {defaults.rebalance})")
    p.add_argument("--elastic", action="store_true", help="with --nproc, --ranks-per-node and "
                   "--max-restarts: a restart drops the node whose ranks died and continues on "
                   "the others, rebalanced (torchrun: --nnodes MIN:MAX)")


def checkpoint_settings(args) -> dict:
    """The ``TrainConfig`` fields of the checkpoint flags (absent flags: the defaults)."""
    names = ("ckpt_dir", "save_every", "resume", "max_restarts", "keep_checkpoints",
             "on_save_error", "rebalance", "elastic")
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def launch_size(args, cfg) -> int | None:
    """``--nproc``; without it and outside torchrun, the ranks of a fixed layout (a plan, or
    degrees above 1), launched locally."""
    size = cfg.tp * cfg.ep * (cfg.dp or 1)
    if args.nproc is None and not under_torchrun() and (args.plan or size > 1):
        return size
    return args.nproc
