"""``train``'s flags, generated from the run's sections (:mod:`ops_transformer.training.config`):
each section field with a flag is one ``add_argument`` — its name (``flag_of``), its type (the
field's annotation), its choices (the field's ``choices``) and its default (the field's) come from
the field; only the help text and how argparse reads an odd value (``--resume [strict]``,
``--lora-targets a,b``) are written here, in :data:`FLAGS`. A field without an entry, or an entry
without a field, stops the parser being built: a field cannot exist without its flag.

``unset``: the flag's argparse default is ``None`` (the field's default applies later, and a
``--resume``, a ``--plan`` or a ``--config`` file can tell that the flag was not given)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ..models.config import PRESETS
from ..training.config import (PARALLEL_FIELDS, SECTION_ORDER, SECTIONS, RunConfig, flag_of,
                               train_field)
from ..schema.parallel_options import CHOICES as PARALLEL_CHOICES


def _targets(text: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise argparse.ArgumentTypeError("expected comma-separated module names or patterns")
    return targets


def _flag(help: str, **argparse_kwargs) -> dict:
    return {"help": help, **argparse_kwargs}


# section → field (the ParallelOptions name in ``parallel``) → its help and argparse extras;
# ``{default}`` in a help text is the field's default
FLAGS: dict[str, dict[str, dict]] = {
    "model": {
        "preset": _flag(f"model preset: {', '.join(PRESETS)} (default {{default}})", unset=True),
        "dir": _flag("fine-tune this Hugging Face causal LM (a local save_pretrained directory, "
                     "safetensors weights) instead of a preset; each rank loads only its shards "
                     "(docs/finetuning.md)", metavar="DIR"),
        "dropout": _flag("the dropout probability: the preset's, or every dropout of the "
                         "--model checkpoint (one-device masks at any dp × tp; default: the "
                         "model's own)", metavar="P"),
        "lora_rank": _flag("train LoRA adapters of rank R on the attention and FFN linears (or "
                           "--lora-targets), every other weight frozen", metavar="R"),
        "lora_alpha": _flag("the adapters' alpha: their output is scaled by A/R (default: R)",
                            metavar="A"),
        "lora_targets": _flag("module names or fnmatch patterns of the linears to adapt, e.g. "
                              "'*.q_proj,*.v_proj'", type=_targets, metavar="P1,P2,..."),
        "lora_dropout": _flag("dropout on the adapters' input (default {default:g})",
                              metavar="P"),
    },
    "layout": {
        "tp": _flag("tensor-parallel degree (default {default})", unset=True),
        "dp": _flag("data-parallel degree (default: processes / (tp·ep))"),
        "ep": _flag("expert-parallel degree for MoE models (moe-tiny, moe-small, or a --model "
                    "such as Mixtral): n_experts/ep experts per rank (default {default})",
                    unset=True),
        "cp": _flag("context-parallel degree: each sequence split over cp ranks, head-tail "
                    "balanced (--seq divisible by 2·cp; reference GPT presets and --model "
                    "Llama / Mistral / Qwen2; default {default})", unset=True),
        "pp": _flag("pipeline stages, the outermost axis: the preset's layers split into equal "
                    "runs (torch.distributed.pipelining; docs/pipeline.md; default {default})"),
        "ranks_per_node": _flag("ranks per node (default: torchrun's LOCAL_WORLD_SIZE, else all "
                                "on one node); e.g. 2 with --nproc 4 simulates 2 nodes x 2 "
                                "ranks"),
        "ranks_per_island": _flag("consecutive ranks of a node behind one PCIe switch or socket "
                                  "(default: detected on a GPU node, else one island); e.g. 2 "
                                  "with --nproc 4 declares 2 PCIe islands x 2 ranks"),
        "pp_schedule": _flag("pipeline schedule (default {default})", sort_choices=True),
        "microbatches": _flag("pipeline micro-batches per step and data-parallel rank (default "
                              "{default})", metavar="M"),
        "stages_per_rank": _flag("pipeline stages on each rank (interleaved, looped_bfs, "
                                 "zero_bubble, zbv; default 2 for those, else 1)", metavar="V"),
    },
    "parallel": {
        "attention": _flag("attention strategy (default {default})", unset=True),
        "sequence_parallel": _flag(
            "keep each rank's slice of the sequence between tensor-parallel regions (needs --tp "
            "2+, heads attention); 'regather' keeps only that slice of each region's input too "
            "and all-gathers it again in backward (less memory, one more all-gather per region)",
            nargs="?", const=True, unset=True, metavar="regather", choices=None, type=None),
        "recompute": _flag("recompute activations in backward: the attention core or every "
                           "layer (default {default})", unset=True),
        "activation_cache": _flag("keep the layers' saved activations as int8 (one scale per "
                                  "128 values)"),
        "overlap": _flag("split each tensor-parallel region's collectives (and the experts' "
                         "all-to-alls) into chunks pipelined with their matmuls: always "
                         "(chunked), where the cost model says it pays (auto), or never (default "
                         "{default})"),
        "chunks": _flag("the chunks of --overlap (at most, for auto; default {default})"),
        "moe_statistics": _flag("MoE capacity and load-balancing loss over each rank's "
                                "micro-batch (local, Megatron's default) or the global batch "
                                "(global: one small all-gather per MoE layer; equals one "
                                "process) (default {default})"),
        "context_parallel": _flag("how attention spans the split sequence: ring (K/V blocks "
                                  "passed rank to rank, overlapped), allgather_kv (one "
                                  "all-gather of K/V), ulysses (all-to-alls over heads; cp must "
                                  "divide the KV heads) or auto (the cost model chooses between "
                                  "ring and allgather_kv; default {default})", unset=True),
        "compile": _flag("compile each Transformer block with torch.compile(fullgraph=True) "
                         "(needs --overlap none or auto, which then runs as none; the first "
                         "steps pay the compile time)"),
        "compile_backend": _flag("the torch.compile backend of --compile (default {default}; "
                                 "aot_eager compiles fast and runs eager kernels)"),
        "fp8_backward": _flag("--precision fp8: the backward's matmuls with the gradients cast "
                              "to e5m2 (torchao's recipe) or in fp32 from the dequantised "
                              "operands (straight-through) (default {default})"),
    },
    "optim": {
        "lr": _flag("peak learning rate (default {default})"),
        "schedule": _flag("after --warmup: constant, or cosine decay towards 0 at the last "
                          "step"),
        "warmup": _flag("linear learning-rate warmup over the first STEPS steps (default "
                        "{default})", dest="lr_warmup", metavar="STEPS"),
        "clip": _flag("clip the gradients to this total norm (the dense model's)",
                      metavar="NORM"),
        "precision": _flag("compute dtype: fp32, or bf16 / fp16 autocast over fp32 master "
                           "weights (fp16 with a dynamic loss scaler), or fp8 (the blocks' "
                           "matmuls in fp8 with tensorwise dynamic scales agreed over tp); "
                           "default {default}"),
        "zero": _flag("ZeRO stage over the data-parallel ranks: 1 shards the optimizer state, 2 "
                      "also the gradients, 3 also the parameters (FSDP2) (default {default}: "
                      "off)", unset=True),
    },
    "data": {
        "path": _flag("a text file, a directory of text files or (with --model) a .jsonl file "
                      "of {{\"text\": ...}} lines (default: the Python standard library's "
                      "sources on this machine)"),
        "pack": _flag("train --model: how documents share a packed row — docs: attention and "
                      "positions inside each document, no target across a boundary; naive: one "
                      "stream (attention crosses documents) (default {default})", unset=True),
    },
    "checkpoint": {
        "dir": _flag("write sharded checkpoints here (docs/checkpoints.md)"),
        "save_every": _flag("checkpoint every N steps (default {default}: only after the last "
                            "step)"),
        "keep_checkpoints": _flag("newest checkpoints kept (default {default})"),
        "resume": _flag("continue from the latest checkpoint in --ckpt-dir if there is one (the "
                        "same command starts and restarts a job); a damaged latest one is "
                        "skipped with a warning for the newest that verifies, unless '--resume "
                        "strict'", nargs="?", const=True, choices=(True, "strict"),
                        metavar="strict", type=None),
        "on_save_error": _flag("when a checkpoint cannot be saved (a full disk): stop the run "
                               "(default), or warn and go on training (the next save tries "
                               "again)"),
        "rebalance": _flag("--resume on another number of ranks: 'auto' re-plans the layout (tp "
                           "and ep kept when they fit) and the gradient accumulation so that the "
                           "global batch, the micro-batch and the sample order stay the run's; "
                           "'off' runs the layout given (default {default})"),
        "max_restarts": _flag("with --nproc: restart all ranks after a failure this many times "
                              "(torchrun: use its own --max-restarts)"),
        "elastic": _flag("with --nproc, --ranks-per-node and --max-restarts: a restart drops the "
                         "node whose ranks died and continues on the others, rebalanced "
                         "(torchrun: --nnodes MIN:MAX)"),
    },
    "run": {
        "steps": _flag("training steps (default {default})"),
        "batch": _flag("global batch in sequences (default {default})"),
        "grad_accum": _flag("gradient accumulation: each rank runs its rows of --batch in N "
                            "micro-batches of batch / (N·dp·ep) and reduces the gradients once "
                            "per step (default {default}; a --resume on another number of ranks "
                            "sets it, see --rebalance)", unset=True, metavar="N"),
        "seq": _flag("sequence length in tokens (bytes for the presets; default {default})"),
        "seed": _flag("the seed of the weights, the data order and dropout (default "
                      "{default})"),
        "out": _flag("output directory (default runs/train-<timestamp>)"),
        "progress": _flag("no progress bar"),
        "log_every": _flag("read the loss and metrics from the device once per N steps (default "
                           "{default}: no host synchronisation in the steps between; every "
                           "step's loss is still reported)", metavar="N"),
        "tensorboard": _flag("log loss, tokens/s, communication (and the loss scale, with one) "
                             "as TensorBoard scalars in DIR", metavar="DIR"),
    },
}


def field_flags() -> list[tuple[str, str, str, object, object, tuple | None]]:
    """Every section field that has a flag, in section order: ``(section, field, flag, default,
    type hint, choices)`` (``parallel``: the ``ParallelOptions`` fields a run sets)."""
    out, defaults = [], RunConfig()
    for section in SECTION_ORDER:
        if section == "parallel":
            for name, train in PARALLEL_FIELDS.items():
                default = getattr(defaults.parallel, name)
                out.append((section, name, "--" + train.replace("_", "-"), default,
                            type(default), PARALLEL_CHOICES.get(name)))
            continue
        kind = SECTIONS[section]
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            if flag_of(f).startswith("--"):
                out.append((section, f.name, flag_of(f), getattr(getattr(defaults, section),
                                                                  f.name),
                            hints[f.name], f.metadata.get("choices")))
    return out


def _argparse_type(hint) -> type | None:
    """``int`` / ``float`` for a field of that type (or that type or ``None``), else none."""
    kinds = set(typing.get_args(hint)) - {type(None)} or {hint}
    for kind in (int, float):
        if kinds == {kind}:
            return kind
    return None


def add_field_arguments(p, *, skip: tuple[str, ...] = (), only=None) -> None:
    """One flag per section field (but the flags in ``skip``; ``only``: just the flags of those
    ``(section, field)`` pairs), as :data:`FLAGS` describes it."""
    listed = {(s, n) for s, names in FLAGS.items() for n in names}
    found = {(s, n) for s, n, *_ in field_flags()}
    if listed != found:  # a field cannot exist without its flag, nor an entry without its field
        raise RuntimeError(f"train's flags and the run's sections differ: fields without a flag "
                           f"{sorted(found - listed)}, flags without a field "
                           f"{sorted(listed - found)}")
    for section, name, flag, default, hint, choices in field_flags():
        if flag in skip or (only is not None and (section, name) not in only):
            continue
        spec = dict(FLAGS[section][name])
        text = spec.pop("help").format(default=default)
        unset, sort = spec.pop("unset", False), spec.pop("sort_choices", False)
        if hint is bool and "nargs" not in spec:  # --compile, --elastic; --no-progress (the flag
            p.add_argument(flag, action="store_true", help=text, **spec)  # turns progress off)
            continue
        kwargs = {"type": _argparse_type(hint), "default": None if unset else default,
                  "choices": sorted(choices) if sort and choices else choices}
        kwargs.update(spec)
        p.add_argument(flag, help=text, **{k: v for k, v in kwargs.items()
                                           if v is not None or k == "default"})


def train_field_of(section: str, name: str) -> str:
    """The ``TrainConfig`` field of section field ``name`` (``parallel``: its ``PARALLEL_FIELDS``
    entry)."""
    if section == "parallel":
        return PARALLEL_FIELDS[name]
    return train_field(next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name))
