"""Context parallelism on this machine: activation memory per rank at cp 1/2/4 for one sequence
(measured, against the planner's figure), and the step time of ``ring`` and ``ulysses`` against
``allgather_kv``.

Model: the reference GPT ``preset("llama-tiny", n_layers=2, max_seq_len=SEQ)`` (RoPE, GQA with 2 KV
heads, head_dim 16), one sequence of ``--seq`` tokens, fp32, gloo, one intra-op thread per rank.

* **Memory**: :func:`ops_transformer.memory.measure.activation_memory` (the storages autograd keeps
  for backward, parameters excluded) of one forward at cp 1 (one process), 2 and 4 (that many
  ranks, ``ring``; ``allgather_kv`` at cp 2 and 4 too, ``ulysses`` at cp 2). The planner's
  figure per layer is the measured cp-1 layer ×
  :func:`~ops_transformer.planner.context_parallel.activation_factor` plus, for ``allgather_kv``,
  the gathered K/V it keeps (:func:`~ops_transformer.planner.context_parallel.saved_kv_elements`).
* **Step time** at cp 2: forward, backward, SGD step, the strategies interleaved round by round;
  rank 0's medians and the paired ratios ring / allgather_kv and ulysses / allgather_kv (median
  [min-max] over rounds); beside it the cost model's exposed-communication figures
  (``choose_strategy`` on the built-in profile).

    python benchmarks/bench_context_parallel.py --seq 1024 --rounds 5 --steps 3 --json out.json

The GPU figures (NCCL, where the ring's overlap can hide its transfers) are left to the GPU check.
"""

from __future__ import annotations

import argparse
import time

import torch

from ops_transformer import GPT, init_parallel, launch, parallelize
from ops_transformer.memory.measure import activation_memory
from ops_transformer.models import preset
from ops_transformer.planner import CPU_GLOO
from ops_transformer.planner import context_parallel as cpcost

from _common import add_timing_args, check_count_args, finish, format_paired, interleave
from _common import median_ms, paired_ratio, time_steps

STRATEGIES = ("ring", "allgather_kv", "ulysses")


def _model(seq: int, cp: int, strategy: str):
    torch.set_num_threads(1)
    ctx = init_parallel(cp=cp)
    torch.manual_seed(0)
    model = parallelize(GPT(preset("llama-tiny", n_layers=2, max_seq_len=seq)), ctx,
                        context_parallel=strategy)
    batch = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    return ctx, model, batch[:, :-1], batch[:, 1:]


def _memory(seq: int, cp: int, strategy: str) -> dict:
    _, model, x, y = _model(seq, cp, strategy)
    measured = activation_memory(model, x, y)
    return {"total": measured["total_bytes"], "per_layer": measured["per_layer"]}


def _times(seq: int, rounds: int, warmup: int, steps: int) -> dict:
    models = {s: _model(seq, 2, s) for s in STRATEGIES}

    def block(strategy):
        _, model, x, y = models[strategy]
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time_steps(step, warmup, steps)

    return interleave(STRATEGIES, rounds, block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024, help="tokens of the one sequence")
    add_timing_args(parser, rounds=5, steps=3, steps_help="timed steps per block", warmup=1)
    args = parser.parse_args()
    check_count_args(parser, args)
    t0 = time.perf_counter()
    cfg = preset("llama-tiny")
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    rows, per_layer_cp1 = [], None
    for cp, strategy in ((1, "ring"), (2, "ring"), (2, "allgather_kv"), (2, "ulysses"),
                         (4, "ring"), (4, "allgather_kv")):  # ulysses: cp ≤ the 2 KV heads
        measured = launch(_memory, cp, args.seq, cp, strategy)[0]
        layer = measured["per_layer"][0]
        per_layer_cp1 = per_layer_cp1 or layer
        planned = per_layer_cp1 * cpcost.activation_factor(cp) + 4 * cpcost.saved_kv_elements(
            strategy, batch=1, seq=args.seq, kv_dim=kv_dim, cp=cp)
        rows.append({"cp": cp, "strategy": strategy, "total_bytes": measured["total"],
                     "layer_bytes": layer, "planner_layer_bytes": planned,
                     "measured_over_planned": layer / planned})
    print(f"activation memory per rank, one sequence of {args.seq} tokens (layer 0 of 2):")
    print(f"{'cp':>3} {'strategy':>13} {'total KiB':>10} {'layer KiB':>10} {'planner KiB':>12} "
          f"{'measured/planner':>17}")
    for r in rows:
        print(f"{r['cp']:>3} {r['strategy']:>13} {r['total_bytes'] / 1024:>10.0f} "
              f"{r['layer_bytes'] / 1024:>10.0f} {r['planner_layer_bytes'] / 1024:>12.0f} "
              f"{r['measured_over_planned']:>17.2f}")

    per_rank = launch(_times, 2, args.seq, args.rounds, args.warmup, args.steps)
    times = per_rank[0]
    ratio = paired_ratio(times, "ring", "allgather_kv")
    ulysses = paired_ratio(times, "ulysses", "allgather_kv")
    choice, reason = cpcost.choose_strategy(
        batch=1, seq=args.seq, kv_dim=kv_dim, q_dim=cfg.d_model, cp=2, alpha_s=CPU_GLOO.alpha_s,
        bandwidth=CPU_GLOO.bandwidth, matmul_flops=CPU_GLOO.matmul_flops)
    print(f"\nstep time at cp 2 (rank 0, median of {args.rounds} rounds × {args.steps} steps):")
    for s in STRATEGIES:
        print(f"  {s:>13}: {median_ms(times[s]):.1f} ms")
    print(f"  ring / allgather_kv: {format_paired(ratio)}")
    print(f"  ulysses / allgather_kv: {format_paired(ulysses)}")
    print(f"  cost model (built-in profile): auto = {choice}; {reason}")
    finish(t0, args.json, {"seq": args.seq, "memory": rows,
                           "step_ms": {s: median_ms(times[s]) for s in STRATEGIES},
                           "ring_over_allgather_kv": ratio, "ulysses_over_allgather_kv": ulysses,
                           "auto": choice, "reason": reason},
           measured_load=False)


if __name__ == "__main__":
    main()
