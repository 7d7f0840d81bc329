"""Time one column→row MLP training step at tp=2: ours vs PyTorch DTensor TP vs plain PyTorch.

The MLP is ``Linear(h, 4h) → GELU → Linear(4h, h)`` in fp32 on an input of shape ``(b, s, h)``; one
step is a forward, a backward of a fixed output gradient, and dropping the gradients. Three methods
run in the same job, interleaved round by round (the order rotates each round):

* ``ours``    — ``ColumnParallelLinear.from_dense`` + ``RowParallelLinear.from_dense``, tp=2;
* ``dtensor`` — ``parallelize_module(mlp, tp_mesh, {"fc1": ColwiseParallel(), "fc2":
  RowwiseParallel()})`` on the same two ranks and the same dense weights;
* ``plain``   — the dense MLP in one process (rank 0), while rank 1 waits at a barrier.

Every rank runs one intra-op thread (``ops_transformer.launch`` sets ``torch.set_num_threads(1)``),
so ``plain`` is one core and ``ours`` / ``dtensor`` are two cores over gloo. Reported times are
rank 0's per-step wall times (its collectives wait for rank 1, so a step ends on rank 0 only once
both ranks have contributed); rank 1's pooled medians are printed beside them and kept in the
JSON output with every per-step time.

Before timing, each size is checked once (untimed): the output and input gradient of ``ours`` and
``dtensor`` against the dense MLP, and the collectives of one step (our ``CommLedger``; DTensor's
``CommDebugMode``).

    python benchmarks/bench_mlp.py --sizes small,medium --rounds 15 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

import ops_transformer
from ops_transformer import ColumnParallelLinear, CommLedger, RowParallelLinear

from _common import add_timing_args, backward_step, finish
from _common import (check_counts, format_paired, interleave, median_ms, paired_ratio, rel_err,
                     source_version, time_steps)

METHODS = ("ours", "dtensor", "plain")
TP = 2


@dataclass(frozen=True)
class Size:
    """One problem size: batch ``b``, sequence ``s``, hidden ``h`` (the FFN is ``4h`` wide), and
    the default number of timed steps per block (more for short steps, to smooth gloo's jitter)."""

    name: str
    b: int
    s: int
    h: int
    steps: int


SIZES = {
    "small": Size("small", b=4, s=32, h=64, steps=60),  # tiny: per-step overhead dominates
    "medium": Size("medium", b=4, s=128, h=512, steps=15),  # matmuls dominate
}


class MLP(nn.Module):
    """The dense reference: ``fc2(gelu(fc1(x)))``, written as plain single-device PyTorch."""

    def __init__(self, h: int):
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def build_models(size: Size, ctx) -> dict[str, nn.Module]:
    """The three models of one size, from the same dense weights (seeded: equal on all ranks)."""
    torch.manual_seed(1234)
    dense = MLP(size.h)
    ours = MLP(size.h)
    ours.fc1 = ColumnParallelLinear.from_dense(dense.fc1, ctx)
    ours.fc2 = RowParallelLinear.from_dense(dense.fc2, ctx)  # input_is_parallel=True

    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    dtensor = parallelize_module(copy.deepcopy(dense), ctx.mesh["tp"],
                                 {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return {"ours": ours, "dtensor": dtensor, "plain": dense}


def make_inputs(size: Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ``x`` (b, s, h) requiring grad, as inside a network, and a fixed output gradient."""
    gen = torch.Generator().manual_seed(size.b * 1000 + size.h)
    x = torch.randn(size.b, size.s, size.h, generator=gen).requires_grad_()
    grad_out = torch.randn(size.b, size.s, size.h, generator=gen)
    return x, grad_out


def time_block(model, x, grad_out, warmup: int, steps: int) -> list[float]:
    """Per-step wall times (s) of ``steps`` steps after ``warmup`` untimed ones."""
    return time_steps(lambda: backward_step(model, x, grad_out), warmup, steps)


def check_correctness(models, x, grad_out) -> dict[str, dict[str, float]]:
    """Max relative error of the output and input gradient of ``ours``/``dtensor`` vs dense."""
    ref = {}
    errors = {}
    for name in ("plain", "ours", "dtensor"):
        y = models[name](x)
        y.backward(grad_out)
        out = {"output": y.detach().clone(), "input_grad": x.grad.clone()}
        for p in models[name].parameters():
            p.grad = None
        x.grad = None
        if name == "plain":
            ref = out
        else:
            errors[name] = {k: rel_err(out[k], ref[k]) for k in out}
    return errors


def count_collectives(models, x, grad_out) -> dict[str, object]:
    """The collectives of one step: ours from the ledger, DTensor's from ``CommDebugMode``."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommLedger() as ledger:
        backward_step(models["ours"], x, grad_out)
    with CommDebugMode() as mode:
        backward_step(models["dtensor"], x, grad_out)
    dtensor_counts = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    return {"ours": ledger.summary(), "dtensor": dtensor_counts}


def run_rounds(models, x, grad_out, rounds: int, steps: int, warmup: int) -> dict[str, list]:
    """Interleave the methods round by round, rotating their order; per-step times by method.

    ``plain`` runs on rank 0 only; the other rank waits at the barrier that ends the block.
    """
    return interleave(METHODS, rounds,
                      lambda method: time_block(models[method], x, grad_out, warmup, steps),
                      rank0_only=("plain",))


def bench_size(size: Size, ctx, rounds: int, steps: int | None, warmup: int) -> dict:
    """Check, count and time one size on this rank (``steps=None``: the size's default)."""
    models = build_models(size, ctx)
    x, grad_out = make_inputs(size)
    errors = check_correctness(models, x, grad_out)
    comms = count_collectives(models, x, grad_out)
    steps = steps or size.steps
    times = run_rounds(models, x, grad_out, rounds, steps, warmup)
    return {"size": asdict(size), "steps": steps, "errors": errors, "comms": comms,
            "times": times}


def rank_main(sizes: list[Size], rounds: int, steps: int | None, warmup: int) -> dict:
    """What each rank runs under ``ops_transformer.launch``."""
    ctx = ops_transformer.init_parallel(tp=TP)
    results = [bench_size(size, ctx, rounds, steps, warmup) for size in sizes]
    return {"rank": ctx.rank, "backend": ctx.backend, "threads": torch.get_num_threads(),
            "results": results}


def summarise(per_rank: list[dict]) -> list[dict]:
    """One row per size: rank 0's median step time per method (all steps of all rounds pooled),
    the spread of its per-round medians, and the ratios (pooled and paired by round)."""
    rows = []
    for i, res0 in enumerate(per_rank[0]["results"]):
        times = res0["times"]
        row = {"size": res0["size"], "steps": res0["steps"], "errors": res0["errors"],
               "comms": res0["comms"]}
        for m in METHODS:
            row[f"{m}_ms"] = median_ms(times[m])
            rounds = [median_ms([block]) for block in times[m]]
            row[f"{m}_round_ms"] = [min(rounds), max(rounds)]
            for rk in per_rank[1:]:
                row[f"{m}_rank{rk['rank']}_ms"] = median_ms(rk["results"][i]["times"][m])
        row["ours_over_dtensor"] = row["ours_ms"] / row["dtensor_ms"]
        row["ours_over_plain"] = row["ours_ms"] / row["plain_ms"]
        row["ours_over_dtensor_paired"] = paired_ratio(times, "ours", "dtensor")
        row["ours_over_plain_paired"] = paired_ratio(times, "ours", "plain")
        rows.append(row)
    return rows


def print_checks(rows: list[dict]) -> None:
    """Per size: the error of ``ours``/``dtensor`` against dense, and one step's collectives."""
    for row in rows:
        s = row["size"]
        print(f"\n[{s['name']}] b={s['b']} s={s['s']} h={s['h']} (ffn {4 * s['h']}), "
              f"{row['steps']} timed steps per block")
        for name, err in row["errors"].items():
            print(f"  max rel err vs dense  {name:8s} output {err['output']:.2e}  "
                  f"input grad {err['input_grad']:.2e}")
        ours = ", ".join(f"{k} x{v['calls']} ({v['elements']} elements, {v['bytes']} B)"
                         for k, v in row["comms"]["ours"].items())
        theirs = ", ".join(f"{k} x{v}" for k, v in row["comms"]["dtensor"].items())
        print(f"  collectives per step  ours    {ours}  [CommLedger]")
        print(f"                        dtensor {theirs}  [CommDebugMode]")


def print_table(rows: list[dict]) -> None:
    """Median step times, pooled ratios, and per-round paired ratios (median [min-max])."""
    head = (f"{'size':8s} {'ours ms':>9s} {'dtensor ms':>11s} {'plain ms':>9s} "
            f"{'ours/dtensor':>13s} {'ours/plain':>11s}   paired by round: "
            f"ours/dtensor, ours/plain (median [min-max])")
    print("\n" + head + "\n" + "-" * len(head))
    for row in rows:
        paired = "  ".join(format_paired(r) for r in (row["ours_over_dtensor_paired"],
                                                      row["ours_over_plain_paired"]))
        print(f"{row['size']['name']:8s} {row['ours_ms']:9.3f} {row['dtensor_ms']:11.3f} "
              f"{row['plain_ms']:9.3f} {row['ours_over_dtensor']:13.2f} "
              f"{row['ours_over_plain']:11.2f}   {paired}")
    print("\nper-round medians, ms (min-max):")
    for row in rows:
        spread = "  ".join(f"{m} {row[f'{m}_round_ms'][0]:.2f}-{row[f'{m}_round_ms'][1]:.2f}"
                           for m in METHODS)
        rank1 = "  ".join(f"{m} {row[f'{m}_rank1_ms']:.3f}" for m in ("ours", "dtensor"))
        print(f"  {row['size']['name']:8s} {spread}   (rank 1 pooled medians: {rank1})")


def print_report(rows: list[dict], meta: dict) -> None:
    """The setup line, the correctness checks, then the timing tables."""
    print(f"ops_transformer {meta['ops_transformer']}, torch {meta['torch']}, {meta['backend']}, "
          f"tp={TP} on {TP} local ranks, "
          f"{meta['threads_per_rank']} intra-op thread per rank (plain: 1 process, 1 thread), "
          f"{meta['cpus']} CPUs; rounds={meta['rounds']} warmup={meta['warmup']}; "
          f"times are rank 0's per-step medians")
    print_checks(rows)
    print_table(rows)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; sizes, counts and the JSON path are validated here."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium",
                   help=f"comma-separated, from {', '.join(SIZES)} (default: small,medium)")
    add_timing_args(p, rounds=15, steps=None, warmup=3,
                    steps_help="timed steps per method per round (default: 60 small, 15 medium)")
    args = p.parse_args(argv)
    check_counts(p, args, SIZES)
    return args


def main(argv=None) -> None:
    """Run all sizes in one 2-rank job, print the report, optionally write it as JSON."""
    args = parse_args(argv)
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    t0 = time.perf_counter()
    per_rank = ops_transformer.launch(rank_main, TP, sizes, args.rounds, args.steps, args.warmup,
                                      timeout=900)
    meta = {"torch": torch.__version__, "ops_transformer": source_version(),
            "backend": per_rank[0]["backend"], "cpus": os.cpu_count(),
            "threads_per_rank": per_rank[0]["threads"], "python": platform.python_version(),
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "reported": "rank 0 per-step median"}
    rows = summarise(per_rank)
    print_report(rows, meta)
    finish(t0, args.json, {"meta": meta, "rows": rows, "raw": per_rank}, measured_load=False)


if __name__ == "__main__":
    main()
