"""Time one GPT training step: ours vs PyTorch DTensor TP at tp=2, vs plain PyTorch, and tp=1.

One step of the reference GPT (``ops_transformer.models.GPT``) in fp32 is: forward with targets →
loss, ``loss.backward()``, ``AdamW.step()``, ``zero_grad(set_to_none=True)``. Five methods run in
the same 2-rank job, interleaved round by round (the order rotates each round):

* ``ours``      — ``parallelize(GPT(cfg), ctx)`` at tp=2, the full plan: vocab-parallel embedding,
  LM head and loss, head-parallel attention, column→row MLP;
* ``ours-proj`` — ``parallelize`` with the plan ``ours`` got (``gpt_plan(cfg, 2)``) less its
  ``tok_emb`` and ``lm_head`` rules: the projections ``dtensor`` splits, embedding and head
  replicated (like for like);
* ``dtensor``   — ``parallelize_module(block, ctx.mesh["tp"], plan)`` per block: ColwiseParallel on
  ``attn.wq/wk/wv`` and ``mlp.w_in``, RowwiseParallel on ``attn.wo`` and ``mlp.w_out``; embedding
  and LM head replicated;
* ``plain``     — the dense GPT in one process (rank 0), while rank 1 waits at a barrier;
* ``tp1``       — ``parallelize(GPT(cfg), ParallelContext.single())`` on rank 0: the cost of the
  library at tp=1, against ``plain``.

Only GELU presets are used: plain ``ColwiseParallel`` splits SwiGLU's fused ``w_in = [gate; up]`` by
rows, so rank 0 would get the whole gate and rank 1 the whole up projection (ours splits each
sub-block). Every rank runs one intra-op thread (``launch`` sets it), so ``plain`` and ``tp1`` use
one core and the tp=2 methods two. Reported times are rank 0's per-step wall times; rank 1's
pooled medians are printed beside them.

Every model is built from the same seed, so all start from the same dense weights. Before timing,
each size is checked once (untimed): the loss of the first step and of the second step (after one
AdamW update) of every method against ``plain``'s, and the collectives of one step as the process
group sees them (all tp=2 methods) and as our ``CommLedger`` records them (ours).

    python benchmarks/bench_gpt.py --sizes small,medium --rounds 12 --json out.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

import ops_transformer
from ops_transformer.profiler.bench import (LR, METHODS, RATIOS, SIZES, TP, _key, rank_main,
                                            summarise)

from _common import add_timing_args, finish
from _common import OtherLoad, check_counts, format_paired, source_version

def print_checks(rows: list[dict]) -> None:
    """Per size: the losses against plain's, and one step's collectives."""
    for row in rows:
        s, c = row["size"], row["config"]
        print(f"\n[{s['name']}] preset {s['preset']}: {c['n_layers']} layers, d={c['d_model']}, "
              f"{c['n_heads']} heads, d_ff={c['d_ff']}, vocab {c['vocab_size']}, {c['mlp']}; "
              f"batch {s['batch']} x seq {s['seq']}; {row['warmup']} untimed + {row['steps']} "
              f"timed steps per block")
        print(f"  ours: attention={row['attention']}")
        print(f"  tp1 module tree identical to plain's: {row['tp1_same_as_plain']}")
        print(f"  plain loss: step 1 {row['plain_losses'][0]:.6f}, step 2 "
              f"{row['plain_losses'][1]:.6f}")
        for m, diff in row["loss_rel_diff"].items():
            print(f"  rel diff vs plain  {m:9s} step 1 {diff[0]:.1e}  step 2 (after one AdamW "
                  f"update) {diff[1]:.1e}")
        for m in ("ours", "ours-proj", "dtensor"):
            comms = row["comms"][m]
            seen = ", ".join(f"{k} x{v['calls']} ({v['elements']} elements)"
                             for k, v in comms["dispatched"].items())
            print(f"  collectives per step  {m:9s} {seen}  [dispatched]")
            if "ledger" in comms:
                summary = ", ".join(f"{k} x{v['calls']} ({v['elements']} elements, "
                                    f"{v['bytes']} B)" for k, v in comms["ledger"].items())
                labels = ", ".join(f"{k} x{v}" for k, v in comms["labels"].items())
                print(f"  {'':21s} {'':9s} {summary}  [CommLedger]\n"
                      f"  {'':21s} {'':9s} by label: {labels}")


def print_table(rows: list[dict]) -> None:
    """Median step times per method, then pooled and paired ratios (median [min-max])."""
    head = f"{'size':8s}" + "".join(f"{m + ' ms':>13s}" for m in METHODS)
    print("\nrank 0 median step time\n" + head + "\n" + "-" * len(head))
    for row in rows:
        print(f"{row['size']['name']:8s}" + "".join(f"{row['ms'][m]:13.3f}" for m in METHODS))
    keys = [_key(n, d) for n, d in RATIOS]
    head = f"{'size':8s}" + "".join(f"{k:>20s}" for k in keys)
    print("\nratios of medians (pooled), then paired by round: median [min-max]\n" + head + "\n"
          + "-" * len(head))
    for row in rows:
        print(f"{row['size']['name']:8s}" + "".join(f"{row['ratios'][k]:20.2f}" for k in keys))
        print(f"{'  paired':8s}" + "".join(f"{format_paired(row['paired'][k]):>20s}"
                                           for k in keys))
    print("\nper-round medians, ms (min-max); rank 1 pooled medians:")
    for row in rows:
        spread = "  ".join(f"{m} {row['round_ms'][m][0]:.2f}-{row['round_ms'][m][1]:.2f}"
                           for m in METHODS)
        rank1 = "  ".join(f"{m} {v:.3f}" for m, v in row["rank1_ms"].items())
        print(f"  {row['size']['name']:8s} {spread}\n  {'':8s} rank 1: {rank1}")


def print_report(rows: list[dict], meta: dict) -> None:
    """The setup line, the checks, then the timing tables."""
    print(f"ops_transformer {meta['ops_transformer']}, torch {meta['torch']}, {meta['backend']}, "
          f"tp={TP} on {TP} local ranks, {meta['threads_per_rank']} intra-op thread per rank "
          f"(plain, tp1: 1 process, 1 thread), {meta['cpus']} CPUs; rounds={meta['rounds']}; "
          f"AdamW lr={LR}; times are rank 0's per-step medians")
    print_checks(rows)
    print_table(rows)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; sizes, counts and the JSON path are validated here."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium",
                   help=f"comma-separated, from {', '.join(SIZES)} (default: small,medium)")
    add_timing_args(p, rounds=12, steps=None, warmup=None,
                    steps_help="timed steps per method per round (default: "
                    + ", ".join(f"{s.steps} {s.name}" for s in SIZES.values()) + ")",
                    warmup_help="untimed steps before each block (default: "
                    + ", ".join(f"{s.warmup} {s.name}" for s in SIZES.values()) + ")")
    args = p.parse_args(argv)
    check_counts(p, args, SIZES)
    return args


def main(argv=None) -> None:
    """Run all sizes in one 2-rank job, print the report, optionally write it as JSON."""
    args = parse_args(argv)
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    t0, other = time.perf_counter(), OtherLoad()
    per_rank = ops_transformer.launch(rank_main, TP, sizes, args.rounds, args.steps, args.warmup,
                                      timeout=900)
    other_cores = other.cores()
    meta = {"torch": torch.__version__, "ops_transformer": source_version(),
            "backend": per_rank[0]["backend"], "cpus": os.cpu_count(),
            "threads_per_rank": per_rank[0]["threads"], "python": platform.python_version(),
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "lr": LR,
            "other_load_cores": other_cores, "reported": "rank 0 per-step median"}
    rows = summarise(per_rank)
    print_report(rows, meta)
    finish(t0, args.json, {"meta": meta, "rows": rows, "raw": per_rank}, other_cores)


if __name__ == "__main__":
    main()
