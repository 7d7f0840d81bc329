"""The pipeline bubble measured against the planner's formula (docs/pipeline.md).

The reference GPT (``--layers`` layers of ``--d-model``, fp32) at pp 2 on 2 local gloo ranks, one
thread each, for each schedule and micro-batch count: the time of ``Pipeline.step`` against the
dense forward + backward of the same batch, timed on both ranks at once just before it in each of
``--steps`` rounds (after a warm-up round), so under the same load. With the work split evenly over
``p`` stages and no communication cost, a step would take ``T_dense / p``; the measured bubble is
``T_pp / (T_dense / p) − 1`` (the median of the per-round ratios, each
round's slower rank), next to ``planner/pipeline.py: bubble_fraction``. The measured figure also
holds the boundary transfers and the schedule's own overhead, and on a shared 2-core machine
the two ranks compete for the cores with whatever else runs.

    .venv/bin/python benchmarks/bench_pipeline.py
    .venv/bin/python benchmarks/bench_pipeline.py --micro 2 4 8 --steps 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import ops_transformer as ot
from ops_transformer.comm import collectives as C
from ops_transformer.models.gpt import GPTConfig
from ops_transformer.planner.pipeline import bubble_fraction


def _cfg(args) -> GPTConfig:
    return GPTConfig(vocab_size=256, n_layers=args.layers, d_model=args.d_model,
                     n_heads=8, d_ff=4 * args.d_model, max_seq_len=args.seq)


def _batch(args):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (args.batch, args.seq), generator=g),
            torch.randint(0, 256, (args.batch, args.seq), generator=g))


def _rounds(args, schedule: str, v: int, m: int) -> list[tuple[float, float]]:
    """On each of the 2 ranks, per round: the dense forward + backward of the whole batch (both
    ranks at once, so under the same load as the pipeline), then one pipelined step; returns
    ``(dense_s, pp_s)`` per round after a warm-up round."""
    torch.set_num_threads(1)
    ctx = ot.init_parallel(pp=2)
    torch.manual_seed(0)
    dense = ot.GPT(_cfg(args))
    torch.manual_seed(0)
    model = ot.GPT(_cfg(args))
    pipe = ot.pipeline(model, ctx, schedule, microbatches=m, stages_per_rank=v)
    idx, y = _batch(args)
    rounds = []
    for _ in range(args.steps + 1):
        dense.zero_grad()
        C.barrier(ctx.world_group)  # both ranks start together
        start = time.perf_counter()
        dense(idx, y)[1].backward()
        dense_s = time.perf_counter() - start
        model.zero_grad()
        C.barrier(ctx.world_group)
        start = time.perf_counter()
        pipe.step(idx, y)
        rounds.append((dense_s, time.perf_counter() - start))
    return rounds[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for schedule in args.schedules:
        v = 2 if schedule == "interleaved" else 1
        for m in args.micro:
            per_rank = ot.launch(_rounds, 2, args, schedule, v, m)
            paired = [max(r[i][1] for r in per_rank) / (max(r[i][0] for r in per_rank) / 2) - 1
                      for i in range(args.steps)]  # each round: the slower rank's times
            dense = statistics.median(max(r[i][0] for r in per_rank) for i in range(args.steps))
            piped = statistics.median(max(r[i][1] for r in per_rank) for i in range(args.steps))
            measured = statistics.median(paired)
            formula = bubble_fraction(schedule, 2, m, v)
            rows.append({"schedule": schedule, "v": v, "microbatches": m, "dense_s": dense,
                         "pp2_s": piped, "bubble_measured": measured, "bubble_formula": formula})
            print(f"{schedule:12s} v={v} m={m}: dense {dense * 1e3:7.1f} ms, pp 2 "
                  f"{piped * 1e3:7.1f} ms, bubble measured {measured:5.2f}, formula "
                  f"{formula:5.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
