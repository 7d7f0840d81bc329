"""``ops-transformer sweep``: every combination of the listed training options, side by side."""

from __future__ import annotations

import functools
import json
import statistics
import time
from dataclasses import fields
from pathlib import Path

from ..launch import launch
from ..profiler.sweep import AXES, parse_values, run_sweep, split_axes
from ..training.loop import TrainConfig
from ..utils.plot import write_bar_pairs_png
from ..utils.progress import Progress, format_table
from ._common import (add_launch_timeout, check_out_dir, launch_timeout, print_json,
                      refuse_torchrun)
from ._calibrated import command_profile
from ._hf import check_model_dir
from ._config_file import given_dests
from ..training.config import load_toml

HELP = ("run several training configurations (comma-separated values per option, every "
        "combination) and compare step time, tokens/s, activation memory, communication and the "
        "planner's prediction")


def add_parser(p) -> None:
    p.add_argument("--config", metavar="FILE", help="a run's TOML file (docs/run_config.md; a "
                   "run's OUT/config.toml too) as every configuration's base: the swept values, "
                   "--lr, --data and --model given override its fields; its [run] steps are not "
                   "sweep's --steps")
    for flag in AXES:
        p.add_argument(f"--{flag}", metavar="V1,V2", help=f"values of --{flag} to sweep")
    p.add_argument("--nproc", type=int, help="local ranks for every configuration (default: the "
                   "largest --tp; dp fills the rest)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--data", help="training text (as train)")
    p.add_argument("--model", metavar="DIR", help="sweep fine-tuning this Hugging Face causal LM "
                   "(a local save_pretrained directory, as train --model) instead of --preset")
    p.add_argument("--out", help="output directory for sweep.json and sweep.png (default "
                   "runs/sweep-<timestamp>)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_launch_timeout(p)


def _axes(args) -> dict[str, list]:
    axes = {}
    for flag in AXES:
        text = getattr(args, flag.replace("-", "_"))
        if text is not None:
            axes[flag.replace("-", "_")] = parse_values(flag, text)
    return axes


def _mb(n) -> float | None:
    return None if n is None else round(n / 2**20, 3)


def table(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        row = {"config": r["config"], "status": r["status"]}
        if r["status"] == "ok":
            pred = r["predicted_step_s"]
            row.update({"dp": r["dp_used"], "attention": r["attention_used"],
                        "step ms": round(1e3 * r["step_s"], 2),
                        "tokens/s": round(r["tokens_per_s"]),
                        "activations MB": _mb(r["activation_bytes"]) if r["activation_bytes"]
                        is not None else "n/a",
                        "comm MB/step": _mb(r["comm_bytes_per_step"]),
                        "wire MB/step": _mb(r["comm_wire_bytes_per_step"]),
                        "predicted ms": None if pred is None else round(1e3 * pred, 2),
                        "pred/meas": None if pred is None else round(pred / r["step_s"], 2)})
        else:
            row["why"] = r["error"][:120]
        rows.append(row)
    columns = [c for c in dict.fromkeys(k for row in rows for k in row) if c != "why"]
    return format_table(rows, columns + ["why"] * any("why" in row for row in rows))


def chart(result: dict, path: Path) -> Path:
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    return write_bar_pairs_png(
        path, [r["config"] for r in ok],
        {"measured": [1e3 * r["step_s"] for r in ok],
         "predicted": [None if r["predicted_step_s"] is None
                                  else 1e3 * r["predicted_step_s"] for r in ok]},
        title=f"{result['model'] or result['preset']}, batch {result['batch']} × seq {result['seq']} on "
              f"{result['nproc']} rank(s): median step time", ylabel="ms per step")


def base_fields(args) -> dict:
    """What every configuration starts from: ``--config``'s run (its ``TrainConfig`` fields) under
    the ``--lr``, ``--data`` and ``--model`` given (flags > file > defaults); without a file, those
    three flags."""
    flags = {"lr": args.lr, "data": args.data, "model": args.model}
    if not getattr(args, "config", None):
        return flags
    run, _ = load_toml(args.config)
    given = given_dests(args, add_parser)
    if given is None:  # no argv: the flags that differ from the defaults
        given = {k for k, v in flags.items() if v != getattr(TrainConfig, k)}
    fields = run.train_fields() | {k: v for k, v in flags.items() if k in given}
    if "preset" in given and "model" not in given:  # a swept --preset replaces the file's model
        fields["model"] = None
    return {k: v for k, v in fields.items() if k not in ("steps", "out", "progress",
                                                         "sample_tokens")}


def run(args) -> int:
    refuse_torchrun("sweep", "launches its own local ranks for each configuration")
    timeout = launch_timeout(args)
    for name, least in (("steps", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name} must be at least {least}, got {getattr(args, name)}")
    axes = _axes(args)
    have = {f.name for f in fields(TrainConfig)}
    fixed = {k: axes.pop(k)[0] for k in list(axes) if len(axes[k]) == 1 and k in have}
    start = base_fields(args)
    model = start["model"]
    if model:
        if "preset" in axes or "preset" in fixed:
            raise ValueError(f"--model {model!r} and --preset both name the model: give one")
        check_model_dir(model, "sweep --model")
    base = TrainConfig(**(start | fixed | {"steps": args.steps, "out": None, "progress": False,
                                           "sample_tokens": 0}))
    nproc = args.nproc or max([base.tp] + axes.get("tp", []))
    out = check_out_dir(args.out or f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    count = 1
    for values in split_axes(axes)[0].values():
        count *= len(values)
    bar = Progress(count, desc="sweep", enabled=not args.no_progress)
    auto = "auto" in axes.get("attention", [base.attention])
    profile = command_profile("--attention auto" if auto else None)
    result = run_sweep(base, axes, nproc, args.warmup,
                       launch=functools.partial(launch, timeout=timeout),
                       progress=lambda row: bar.update(config=row["config"]), profile=profile)
    bar.close()
    result["fixed"] = fixed
    (out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    if any(r["status"] == "ok" for r in result["rows"]):
        chart(result, out / "sweep.png")
    if args.json:
        print_json(result)
        return 0
    print(table(result))
    ok = [r for r in result["rows"] if r["status"] == "ok" and r["predicted_step_s"]]
    if ok:
        errors = sorted(abs(r["predicted_step_s"] / r["step_s"] - 1) for r in ok)
        print(f"\npredicted by the {result['prediction_model']}: median |error| "
              f"{statistics.median(errors):.0%} over {len(ok)} configuration(s)")
    for name, values in result["unavailable"].items():
        shown = ",".join("on" if v is True else "off" if v is False else str(v) for v in values)
        print(f"\n--{name.replace('_', '-')} {shown}: unavailable in this "
              f"build (TrainConfig has no '{name}'); not swept")
    print(f"\nwrote {out / 'sweep.json'}" + (f" and {out / 'sweep.png'}"
                                             if (out / 'sweep.png').exists() else ""))
    return 0
