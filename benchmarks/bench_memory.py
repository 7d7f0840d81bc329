"""Claim (f): what the memory techniques save and cost, as a markdown table for docs/claims.md.

Runs ``ops-transformer memory``'s measurement (:func:`ops_transformer.profiler.memory_tradeoff.memory_worker`)
``--runs`` times — each run builds every technique combination and times interleaved training steps
— and reports, per combination, the measured activation bytes (per layer and in total) and
optimizer-state bytes (the same in every run) with the share saved against the plain run, and the
step time relative to the plain run: the median over runs of each run's median ratio, with the
range.

    .venv/bin/python benchmarks/bench_memory.py                      # small, dp 2 × tp 2, 3 runs
    .venv/bin/python benchmarks/bench_memory.py --dropout 0.1 --runs 5 --steps 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ops_transformer import launch
from ops_transformer.profiler.memory_tradeoff import MemoryRun, check_run, memory_worker


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(runs: list[list[dict]]) -> str:
    first = runs[0]
    lines = ["| technique | activations / layer MiB (formula) | activations MiB | saved | "
             "optimizer state MiB | saved | step time × plain (median, range) |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for i, row in enumerate(first):
        ratios = [run[i]["step_ratio"] for run in runs]
        lines.append(
            f"| {row['name']} | {_mib(row['bytes_per_layer'])} "
            f"({_mib(row['formula_bytes_per_layer'])}) | {_mib(row['activation_bytes'])} | "
            f"{row['activation_saving']:.0%} | {_mib(row['optimizer_state_bytes'])} | "
            f"{row['optimizer_saving']:.0%} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}–{max(ratios):.2f}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dropout", type=float)
    p.add_argument("--steps", type=int, default=6, help="timed steps per technique and run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", help="also write every run's rows here")
    args = p.parse_args(argv)
    spec = MemoryRun(preset=args.preset, tp=args.tp, dp=args.dp, seq=args.seq, batch=args.batch,
                     steps=args.steps, dropout=args.dropout)
    check_run(spec)
    torch.set_num_threads(1)
    runs = []
    for i in range(args.runs):
        runs.append(launch(memory_worker, spec.tp * spec.dp, spec)[0])
        print(f"run {i + 1}/{args.runs}: plain step {runs[-1][0]['step_s'] * 1e3:.0f} ms",
              flush=True)
    for run in runs[1:]:  # memory is deterministic; only the times vary
        assert [r["activation_bytes"] for r in run] == [r["activation_bytes"] for r in runs[0]]
    cfg = spec.model_config()
    print(f"\n{spec.preset} ({cfg.n_layers} layers, h {cfg.d_model}, {cfg.n_heads} heads, "
          f"dropout {cfg.dropout}), dp {spec.dp} × tp {spec.tp}, {spec.batch // spec.dp} × "
          f"{spec.sequence} tokens per rank, fp32, AdamW; per rank; {args.runs} runs × "
          f"{args.steps} interleaved steps\n")
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
