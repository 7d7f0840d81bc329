"""``ops-transformer plan``: which layout to run, how fast and in how much memory — before any GPU
hour is spent. ``--validate`` checks the model against runs on this machine."""

from __future__ import annotations

import json
from pathlib import Path

from ..planner.search import search
from ..planner.specs import ClusterSpec, ModelSpec
from ..utils.progress import format_table
from ._profile import command_profile

HELP = "predict step time and memory of every dp × tp × ep layout and pick the best"


def add_parser(p) -> None:
    p.add_argument("--model", help="a preset (gpt3-175b, llama3-70b, ...), a Hugging Face "
                   "config directory, or a GPTConfig JSON file")
    p.add_argument("--gpu", default="a100-80gb", help="GPU type from the catalogue, or 'local' "
                   "for this machine's CPU ranks")
    p.add_argument("--gpus", type=int, default=8, help="number of GPUs (default 8)")
    p.add_argument("--gpus-per-node", type=int, help="default: the GPU type's usual node")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--batch", type=int, help="global batch in sequences (default: the model's)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: the model's")
    p.add_argument("--top", type=int, default=10, help="candidates to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--out", help="also write the result as JSON (its 'best' is a plan that "
                   "'train --plan' and parallelize accept)")
    p.add_argument("--validate", action="store_true", help="run reference-GPT configurations on "
                   "local ranks and compare predicted with measured step time and communication")


def _cluster(args) -> ClusterSpec:
    if args.gpu == "local":
        from ..planner.local import local_cluster

        return local_cluster(args.gpus, command_profile("--gpu local"))
    return ClusterSpec.make(args.gpu, args.gpus, args.gpus_per_node)


def _model(args) -> ModelSpec:
    if not args.model:
        raise ValueError("--model is required (a preset, a Hugging Face config directory or a "
                         "GPTConfig JSON file)")
    spec = ModelSpec.load(args.model)
    changes = {k: v for k, v in (("seq", args.seq), ("global_batch", args.batch),
                                 ("dtype", args.dtype)) if v is not None}
    return spec.with_(**changes) if changes else spec


def table(result: dict) -> str:
    rows = [{"dp": c["dp"], "tp": c["tp"], "ep": c["ep"], "attention": c["attention"],
             "SP": "yes" if c["sequence_parallel"] else "", "recompute": c["recompute"],
             "ZeRO": c["zero_stage"], "mb": c["micro_batch"],
             "GB/GPU": round(c["memory_per_gpu_bytes"] / 1e9, 1), "fits": "yes" if c["fits"]
             else "NO", "s/step": round(c["step_time_s"], 4), "MFU": f"{c['mfu']:.0%}"}
            for c in result["candidates"]]
    return format_table(rows)


def run(args) -> int:
    if args.validate:
        from ..planner.local import local_profile
        from ..planner.validate import run_validation

        return run_validation(local_profile(command_profile("--validate")), json_output=args.json)
    result = search(_model(args), _cluster(args), top=args.top)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m, c = result["model"], result["cluster"]
    print(f"{m['name']}: {m['layers']} layers, hidden {m['hidden']}, seq {m['seq']}, global "
          f"batch {m['global_batch']}, {m['dtype']} on {c['count']} × {c['gpu']['name']} "
          f"({c['gpus_per_node']} per node)\n")
    print(table(result))
    print(f"\n{'best' if result['best'] else 'no plan fits'}: {result['advice']}")
    return 0
