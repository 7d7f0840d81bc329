"""``ops-transformer check``: does the model split over ``tp`` ranks compute what the unsplit model
computes — and if not, which module is the first that does not (SPEC F12, ``docs/parity.md``).

The dense reference runs on rank 0 alone; the parallel model on ``tp × dp × ep × cp`` local ranks
(or the ranks of a ``torchrun`` job; with ``--cp`` each sequence is split over cp ranks and the
recorded tensors are gathered back to the dense order to compare). Exit status: 0 when every
module, gradient and loss is within the precision's tolerance, 1 on a mismatch (a plan that
raises when it runs included), 2 on a user error.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..memory.recompute import RECOMPUTE
from ..models.gpt import GPT, PRESETS, preset
from ..loading import from_pretrained
from ..parallel import init_parallel, launch
from ..parallelize import parallelize
from ..parallelize.plan import Plan
from ..parity import check_parity
from ..parity.report import ParityReport
from ..planner.context_parallel import CP_CHOICES, check_sequence
from ..precision import PRECISIONS
from ._common import (add_launch_timeout, launch_timeout, print_json, status, under_torchrun,
                      world_size)
from ._calibrated import command_profile

HELP = ("check that a model split over tp ranks computes what the unsplit model does; name the "
        "first module that does not")
ZOO_PREFIX = "hf:"  # --preset hf:<model_type>: the zoo's tiny random model (testing/zoo.py)
ATTENTION = ("auto", "heads", "heads_allgather", "kv_split", "naive")
CHECK_OPTIONS = ("steps", "lr", "precision", "tolerance")  # check_parity's own; others: the plan's


def add_parser(p) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory "
                        "(save_pretrained)")
    source.add_argument("--preset", metavar="NAME", help=f"a reference GPT preset "
                        f"({', '.join(PRESETS)}) or {ZOO_PREFIX}MODEL_TYPE, the model zoo's tiny "
                        f"random model of a Hugging Face family (e.g. {ZOO_PREFIX}llama)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree: each sequence "
                   "split over cp ranks, head-tail balanced, and gathered back to the dense "
                   "order to compare (--seq divisible by 2·cp; default 1)")
    p.add_argument("--cp-strategy", choices=CP_CHOICES, default="auto",
                   help="with --cp: ring, allgather_kv or auto (the cost model; default auto)")
    p.add_argument("--sequence-parallel", nargs="?", const=True, default=False,
                   metavar="regather", help="keep each rank's share of the tokens between "
                   "tensor-parallel regions; 'regather' keeps only that share of each region's "
                   "input too, all-gathered again in backward")
    p.add_argument("--recompute", default="none", choices=RECOMPUTE,
                   help="recompute activations in backward (default none)")
    p.add_argument("--precision", default="fp32", choices=[p for p in PRECISIONS if p != "fp8"],
                   help="fp32, or bf16 / fp16 autocast over fp32 weights; sets the tolerance "
                   "(default fp32)")
    p.add_argument("--tp-plan", metavar="FILE.json", help="the plan to check: for a Hugging Face "
                   "model a tp_plan ({pattern: Hugging Face style}, merged over the family's), for "
                   "the reference GPT (or with a 'rules' key) a plan of ours ({pattern: style})")
    p.add_argument("--attention", choices=ATTENTION, default="auto",
                   help="attention strategy of the reference GPT (default auto)")
    p.add_argument("--vocab", choices=("auto", "parallel", "replicated"), default="auto",
                   help="split the embedding and LM head over the vocabulary or not (default "
                   "auto: by predicted time)")
    p.add_argument("--steps", type=int, default=0, help="also take K optimizer steps (SGD) and "
                   "show their losses side by side (default 0)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of --steps "
                   "(default 0.1)")
    p.add_argument("--batch", type=int, default=4, help="global batch in sequences (default 4; "
                   "divisible by dp × ep)")
    p.add_argument("--seq", type=int, default=16, help="sequence length in tokens (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    p.add_argument("--tolerance", type=float, help="relative output tolerance (default: the "
                   "precision's; gradients and loss scale with it)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document")
    add_launch_timeout(p)


@dataclass(frozen=True)
class CheckJob:
    """What every rank needs: the model source, the layout and the options of ``check_parity``."""

    model: str | None
    preset: str | None
    tp: int
    dp: int
    ep: int
    batch: int
    seq: int
    seed: int
    options: dict = field(default_factory=dict)
    cp: int = 1


def _positive(args, *names) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")


def _read_plan(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--tp-plan {path!r} is not a readable JSON file: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--tp-plan {path!r} must hold a JSON object mapping module patterns "
                         f"to styles")
    return data


def _plan_options(args) -> dict:
    """``plan=`` / ``tp_plan=`` and the other keyword arguments of ``parallelize``."""
    options = {"sequence_parallel": args.sequence_parallel, "recompute": args.recompute,
               "vocab": args.vocab}
    if args.preset and not args.preset.startswith(ZOO_PREFIX):
        options["attention"] = args.attention
    elif args.attention != "auto":
        raise ValueError("--attention applies to the reference GPT presets; Hugging Face models "
                         "use head-parallel attention")
    if args.tp_plan:
        data = _read_plan(args.tp_plan)
        hf = args.model or args.preset.startswith(ZOO_PREFIX)
        if hf and "rules" not in data:
            options["tp_plan"] = data
        else:
            Plan.from_dict(data)  # a style we lack is a user error here, before any rank starts
            options["plan"] = data
    return options


def _check_source(args) -> None:
    if args.model:
        from ._hf import check_model_dir

        check_model_dir(args.model, "check")
    elif args.preset.startswith(ZOO_PREFIX):
        _check_zoo_family(args.preset[len(ZOO_PREFIX):])
    else:
        cfg = preset(args.preset)
        if args.seq > cfg.max_seq_len:
            raise ValueError(f"--seq ({args.seq}) exceeds preset {args.preset!r}'s max_seq_len "
                             f"({cfg.max_seq_len})")


def _check_zoo_family(family: str) -> None:
    """A family the zoo can build: a text model class and a plan (its own, or Hugging Face's)."""
    from ._hf import import_transformers

    transformers = import_transformers("check")
    transformers.logging.set_verbosity_error()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..parallelize.hf_plans import has_family_plan
    from ..testing.zoo import not_applicable, prepare

    why = None
    if family not in CONFIG_MAPPING:
        why = "not a model type of the installed transformers"
    else:
        config = CONFIG_MAPPING[family]()
        if not (has_family_plan(family) or getattr(config, "base_model_tp_plan", None)):
            why = "no tensor-parallel plan: neither ours nor a base_model_tp_plan"
        else:
            why = not_applicable(family, config)
    if why:
        raise ValueError(f"--preset {ZOO_PREFIX}{family}: the zoo has no tiny model of "
                         f"{family!r} ({why}; docs/huggingface.md lists its families)")
    prepare(family)  # the family's code imported once, before the ranks fork


def job_from_args(args) -> CheckJob:
    _positive(args, "tp", "dp", "ep", "cp", "batch", "seq")
    if args.steps < 0:
        raise ValueError(f"--steps must be 0 or more, got {args.steps}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.batch % (args.dp * args.ep):
        raise ValueError(f"--batch ({args.batch}) must be divisible by dp × ep "
                         f"({args.dp * args.ep}): each data rank runs its own rows")
    if args.sequence_parallel not in (False, True, "regather"):
        raise ValueError(f"--sequence-parallel takes no value or 'regather', got "
                         f"{args.sequence_parallel!r}")
    if args.sequence_parallel and args.seq % args.tp:
        raise ValueError(f"--sequence-parallel splits the sequence over tp: --seq ({args.seq}) "
                         f"must be divisible by --tp ({args.tp})")
    if args.cp > 1:
        check_sequence(args.seq, args.cp)  # one line naming --seq and cp, before any rank starts
    _check_source(args)
    options = {**_plan_options(args), "steps": args.steps, "lr": args.lr,
               "precision": args.precision, "tolerance": args.tolerance}
    if args.cp > 1:
        options["context_parallel"] = args.cp_strategy
    return CheckJob(args.model, args.preset, args.tp, args.dp, args.ep, args.batch, args.seq,
                    args.seed, options, cp=args.cp)


def _source(job: CheckJob, ctx) -> tuple:
    """``(build_model, inputs, check_parity's keyword arguments)`` on this rank: the same dense
    model and tokens everywhere; a model directory's parallel side through ``from_pretrained``
    (each rank reads its own shards), the others through ``parallelize``."""
    tokens = torch.Generator().manual_seed(job.seed + 1)
    device = ctx.device
    if job.model:
        import transformers

        config = transformers.AutoConfig.from_pretrained(job.model)
        auto = "AutoModelForCausalLM" if _is_causal(config) else "AutoModel"
        cls = getattr(transformers, auto)._model_mapping[type(config)]
        parallel = {"overlap": "none",  # the plan's own styles, as check_parity's default
                    **{k: v for k, v in job.options.items() if k not in CHECK_OPTIONS}}

        def build():
            return cls.from_pretrained(job.model, dtype=torch.float32).to(device)

        def build_parallel():
            if job.cp > 1:  # from_pretrained splits weights, not sequences: parallelize does
                return parallelize(build(), ctx, **parallel)
            return from_pretrained(job.model, ctx, auto_class=auto, dtype=torch.float32,
                                   **parallel)

        options = {k: v for k, v in job.options.items() if k in CHECK_OPTIONS}
        return build, _hf_inputs(cls, config, job, tokens), \
            {**options, "build_parallel": build_parallel}
    if job.preset.startswith(ZOO_PREFIX):
        from ..testing.zoo import build as zoo_build, prepare

        family = job.preset[len(ZOO_PREFIX):]
        cls, config = prepare(family)
        return (lambda: zoo_build(family).to(device)), _hf_inputs(cls, config, job, tokens), \
            job.options
    cfg = preset(job.preset)

    def build_gpt():
        torch.manual_seed(job.seed)
        return GPT(cfg).to(device)

    ids = torch.randint(0, cfg.vocab_size, (job.batch, job.seq + 1), generator=tokens)
    return build_gpt, (ids[:, :-1], ids[:, 1:]), job.options


def _is_causal(config) -> bool:
    from ._hf import CAUSAL_SUFFIXES

    return any(a.endswith(CAUSAL_SUFFIXES) for a in (getattr(config, "architectures", None)
                                                     or []))


def _hf_inputs(cls, config, job: CheckJob, tokens) -> dict:
    """Token ids (and ``labels``: the model's own causal-LM loss) for a Hugging Face model."""
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(3 if vocab > 3 else 0, vocab, (job.batch, job.seq), generator=tokens)
    params = inspect.signature(cls.forward).parameters
    inputs = {"input_ids": ids}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    if "use_cache" in params or takes_any:  # no key/value cache: a training forward
        inputs["use_cache"] = False
    causal = _is_causal(config) if job.model else True  # the zoo's class: causal LM or base
    if causal and "labels" in params:
        inputs["labels"] = ids
    return inputs


def check_worker(job: CheckJob, profile=None) -> dict:
    """On every rank: the report, as a dict (the same on every rank)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with init_parallel(tp=job.tp, dp=job.dp, ep=job.ep, cp=job.cp, profile=profile) as ctx:
        build, inputs, options = _source(job, ctx)
        report = check_parity(build, ctx, inputs, progress=status, **options)
        return report.to_dict()


def _finite(value):
    """Strict JSON: an infinite or NaN difference (a NaN the dense model does not have) becomes
    the string ``"inf"`` / ``"nan"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def run(args) -> int:
    job = job_from_args(args)
    size = job.tp * job.dp * job.ep * job.cp
    profile = command_profile(None)
    cp = f" cp={job.cp}" if job.cp > 1 else ""
    status(f"check: the dense model on rank 0, then tp={job.tp} dp={job.dp} ep={job.ep}{cp} on "
           f"{size} rank{'s' if size > 1 else ''}")
    if under_torchrun():
        if world_size() != size:
            raise ValueError(f"tp × dp × ep × cp ({size}) must equal the torchrun world size "
                             f"({world_size()})")
        data = check_worker(job, profile)  # every rank exits alike; only rank 0 prints
    else:
        data = launch(check_worker, size, job, profile=profile,
                      timeout=launch_timeout(args))[0]
    report = ParityReport.from_dict(data)
    if args.json:
        print_json(_finite(report.to_dict()))
    else:
        print(report.table())
    return 0 if report.ok else 1
