"""``ops-transformer train``'s command line, torch-free: its flags (shared by ``profile`` and
``diagnose``), the ``TrainConfig`` fields they give (:func:`train_fields`), and the checks of them
that need no rank (:func:`check_args`: the run's sections and :func:`~ops_transformer.training.
preflight.preflight`) — so ``train --help`` and an argument error import no torch. The run itself
is :mod:`ops_transformer.cli.train`."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

from ..models.config import PRESETS
from ..schema.choices import ATTENTION_CHOICES
from ..training.config import (SECTION_ORDER, SECTIONS, RunConfig, from_train_fields,
                               section_flags, section_summary)
from ..training.preflight import preflight
from ._common import add_launch_timeout, status, under_torchrun, world_size
from ._config_file import with_config_file
from .train_flags import _targets, add_field_arguments  # noqa: F401 (its name here too)

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
    p.add_argument("--dry-run", action="store_true", help="build what the run builds on each "
                   "rank (the model, its plan and options, the optimizer) on the meta device, "
                   "print it (--json: all of it) and exit: no data, no step, nothing written")
    add_training_arguments(p, skip=())


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


def add_training_arguments(p, skip: tuple[str, ...] = ("--model", "--lr-schedule",
                                                        "--warmup")) -> None:
    """The options of a training run, shared by ``train``, ``profile``, ``diagnose``: one flag
    per field of the run's sections (:mod:`ops_transformer.cli.train_flags`; ``skip``: those a
    command adds its own way — ``profile``'s ``--model`` and ``--warmup`` are its own), and the
    launcher's and the output's."""
    p.add_argument("--nproc", type=int, help="launch this many local ranks (gloo on a CPU "
                   "machine; NCCL, one rank per GPU, where GPUs are visible); without it, run "
                   "under torchrun (or as one process)")
    add_field_arguments(p, skip=skip)
    p.add_argument("--plan", help="a plan from 'ops-transformer plan --out FILE' (its best "
                   "layout) or a candidate from it: sets --tp, --dp, --attention and the plan's "
                   "sequence parallelism, recompute and ZeRO stage")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    add_launch_timeout(p)


def add_lora_arguments(p) -> None:
    """``--lora-rank`` and the options of LoRA fine-tuning (docs/finetuning.md)."""
    add_field_arguments(p, only={("model", n) for n in ("lora_rank", "lora_alpha",
                                                        "lora_targets", "lora_dropout")})


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
                fp8_backward=getattr(args, "fp8_backward", D.fp8_backward),
                log_every=getattr(args, "log_every", D.log_every),
                       **checkpoint_settings(args), **lora_settings(args),
                       **{**pipeline_settings(args), **piped})


def pipeline_settings(args) -> dict:
    """``--pp``, ``--pp-schedule``, ``--microbatches``, ``--stages-per-rank``."""
    return {"pp": getattr(args, "pp", D.pp), "pp_schedule": getattr(args, "pp_schedule",
                                                                      D.pp_schedule),
            "microbatches": getattr(args, "microbatches", D.microbatches),
            "stages_per_rank": getattr(args, "stages_per_rank", D.stages_per_rank)}


def add_checkpoint_arguments(p) -> None:
    """The checkpoint flags of ``train`` (the ``checkpoint`` section's)."""
    add_field_arguments(p, only={("checkpoint", f.name)
                                 for f in dataclasses.fields(SECTIONS["checkpoint"])})


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
