"""``ops-transformer bench``: our TP against PyTorch DTensor TP and the plain model, one GPT (or
``--model DIR``: Hugging Face Llama-family) training step, interleaved
(:mod:`ops_transformer.profiler.bench`, imported when the command runs: ``bench --help`` imports
no torch)."""

from __future__ import annotations

from dataclasses import replace

from ..launch import launch
from ..models.config import preset
from ..utils.progress import format_table
from ._common import add_launch_timeout, launch_timeout, print_json, refuse_torchrun, status

HELP = ("time one GPT training step: ours (tp=2) vs PyTorch DTensor TP vs the plain model, "
        "interleaved; medians and ratios")
DEFAULT_PRESET = "tiny"


def add_parser(p) -> None:
    p.add_argument("--preset", help=f"a GELU GPT preset (default {DEFAULT_PRESET})")
    p.add_argument("--model", metavar="DIR", help="bench this Hugging Face causal LM (a local "
                   "save_pretrained directory, as train --model; Llama, Mistral or Qwen2) "
                   "instead of a preset")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per method per round "
                   "(default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per block (default 2)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    add_launch_timeout(p, default=3600.0)


def check(args):
    """The :class:`~ops_transformer.profiler.bench.Size` the arguments ask for, or a
    ``ValueError`` naming the flag."""
    from ..profiler.bench import Size

    for name, least in (("batch", 1), ("seq", 1), ("rounds", 1), ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name} must be at least {least}, got {getattr(args, name)}")
    model = getattr(args, "model", None)
    if model and args.preset:
        raise ValueError(f"--model {model!r} and --preset {args.preset!r} both name the model: "
                         f"give one")
    if model:
        check_hf_model(model, args.seq)
        name = model.rstrip("/").rsplit("/", 1)[-1]
        return Size(name, DEFAULT_PRESET, batch=args.batch, seq=args.seq, steps=args.steps,
                    warmup=args.warmup, model=model)
    args.preset = args.preset or DEFAULT_PRESET
    cfg = preset(args.preset)
    if cfg.mlp != "gelu":
        raise ValueError(f"--preset {args.preset!r} uses {cfg.mlp}: DTensor's ColwiseParallel "
                         f"would split its fused gate/up weight by rows; choose a GELU preset")
    if args.seq > cfg.max_seq_len:
        raise ValueError(f"--seq ({args.seq}) exceeds the preset's max_seq_len "
                         f"({cfg.max_seq_len})")
    return Size(args.preset, args.preset, batch=args.batch, seq=args.seq, steps=args.steps,
                warmup=args.warmup)


def check_hf_model(path: str, seq: int) -> None:
    """``bench --model``: a loadable causal LM of a family whose projections DTensor's plan
    splits (:data:`~ops_transformer.profiler.bench.HF_FAMILIES`), whose heads and FFN divide by
    tp, and whose positions cover ``--seq``."""
    from ..profiler.bench import HF_FAMILIES, TP
    from ._hf import check_causal_lm, check_model_dir

    root, config = check_model_dir(path, "bench --model")
    check_causal_lm(root, config, "bench --model")
    if config.model_type not in HF_FAMILIES:
        raise ValueError(f"--model {path!r} is a {config.model_type} model; bench compares with "
                         f"DTensor's plan for {', '.join(HF_FAMILIES)} (q/k/v/o_proj, "
                         f"gate/up/down_proj)")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        size = getattr(config, name, None) or config.num_attention_heads
        if size % TP:
            raise ValueError(f"--model {path!r}: {name} ({size}) is not divisible by tp ({TP}), "
                             f"which DTensor's ColwiseParallel splits")
    limit = getattr(config, "max_position_embeddings", None)
    if limit and seq > limit:
        raise ValueError(f"--seq ({seq}) exceeds the model's max_position_embeddings ({limit})")


def predictions(size, profile) -> dict[str, float]:
    """The calibrated local model's step time (ms) of ``ours`` (tp 2 on 2 ranks) and of ``tp1``
    and ``plain`` (one process while the other waits); ``{}`` without a calibrated profile, or
    for ``--model`` (the local model knows the reference GPT only)."""
    from ..profiler.bench import TP
    from ..profiler.local_model import predict_step_s
    from ..training.loop import TrainConfig

    if size.model is not None:
        return {}

    cfg = TrainConfig(preset=size.preset, batch=size.batch, seq=size.seq, steps=size.steps)
    ours = predict_step_s(replace(cfg, tp=TP), TP, profile)
    if ours is None:
        return {}
    one = predict_step_s(cfg, 1, profile, attention="heads", vocab="replicated")
    return {"ours": 1e3 * ours, "tp1": 1e3 * one, "plain": 1e3 * one}


def table(row: dict) -> str:
    from ..profiler.bench import METHODS, RATIOS, _key

    predicted = row.get("predicted_ms", {})
    times = format_table([{"method": m, "rank 0 median ms": round(row["ms"][m], 3),
                           "per-round ms (min-max)": f"{row['round_ms'][m][0]:.2f}-"
                                                     f"{row['round_ms'][m][1]:.2f}",
                           **({"predicted ms": round(predicted[m], 2) if m in predicted else None}
                              if predicted else {})}
                          for m in METHODS])
    ratios = format_table([{"ratio": _key(n, d), "pooled": round(row["ratios"][_key(n, d)], 3),
                            "paired median [min-max]": "{median:.2f} [{min:.2f}-{max:.2f}]".format(
                                **row["paired"][_key(n, d)])} for n, d in RATIOS])
    diffs = ", ".join(f"{m} {max(d):.1e}" for m, d in row["loss_rel_diff"].items())
    return f"{times}\n\n{ratios}\n\nloss vs plain (2 steps, relative): {diffs}"


def run(args) -> int:
    from ..profiler.bench import METHODS, TP, rank_main, summarise
    from ._calibrated import command_profile

    refuse_torchrun("bench", "launches its own local ranks")
    size = check(args)
    timeout = launch_timeout(args)
    status(f"bench: {size.model or size.preset}, batch {args.batch} × seq {args.seq}, tp={TP} on "
           f"{TP} local ranks, {args.rounds} rounds × {len(METHODS)} methods × ({args.warmup} + "
           f"{args.steps}) steps ...")
    per_rank = launch(rank_main, TP, [size], args.rounds, args.steps, args.warmup,
                      timeout=timeout)
    row = summarise(per_rank)[0]
    row["predicted_ms"] = predictions(size, command_profile(None))  # calibrated model, if any
    if args.json:
        print_json({"row": row, "methods": METHODS})
        return 0
    print(table(row))
    if not row["predicted_ms"] and size.model is None:
        print("\n(no predicted times: run `ops-transformer calibrate` for the local model)")
    return 0
