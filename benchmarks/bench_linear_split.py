"""Row or column? Time a standalone square linear split both ways at tp=2, next to the cost model.

For each size ``n`` a dense ``nn.Linear(n, n)`` (fp32, with bias; same seed on every rank) is split
with ``parallel_linear(lin, ctx, split)`` for ``split`` in ``column`` and ``row``, input and output
replicated (the defaults). One step is a forward on ``x`` of shape ``(4, tokens/4, n)`` that
requires grad, a backward of a fixed output gradient, and dropping the gradients. Two more methods
time the same per-rank matmuls with no communication at all (plain autograd on the shards), to
tell compute from communication:

* ``column``         — ``y = all_gather(x W_rᵀ + b_r)``; backward all-reduces the input gradient;
* ``row``            — ``y = all_reduce(x_r W_rᵀ) + b`` on this rank's slice ``x_r`` of the input
  features; backward all-gathers the input gradient;
* ``column-compute`` — ``x W_rᵀ + b_r`` and its backward, no collective;
* ``row-compute``    — ``x_r W_rᵀ + b`` (``x_r`` sliced and made contiguous, as ``row`` does) and
  its backward, no collective.

The methods are interleaved round by round (the order rotates); every rank runs one intra-op thread;
reported times are rank 0's per-step medians. Before timing (untimed, once per size): the output and
input gradient of both splits against the dense linear, and the collectives of one step from the
``CommLedger`` against ``split_comm``.

The cost model (``choose_split``) compares only the communication of the two options under the α–β
model of a hardware profile: with replicated input and output, column moves ``(p−1)/p·(n_out +
2·n_in)`` elements per rank and row ``(p−1)/p·(2·n_out + n_in)``, so a square matrix is a tie on any
hardware (decided for column). Both splits divide the FLOPs by ``tp``; differences in how fast the
two shard shapes multiply are not modelled.

    python benchmarks/bench_linear_split.py --sizes 256,1024,4096 --rounds 8 --json out.json
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import ops_transformer
from ops_transformer import CommLedger, parallel_linear
from ops_transformer.comm.ledger import wire_elements
from ops_transformer.parallelize.linear_split import choose_split, split_comm
from ops_transformer.planner import A100_NVLINK, CPU_GLOO

from _common import add_timing_args, backward_step, check_count_args, finish
from _common import (OtherLoad, format_paired, interleave, job_meta, method_stats,
                     paired_ratio, rel_err, time_steps)

TP = 2
METHODS = ("column", "row", "column-compute", "row-compute")
BASELINE = "column"
SEED = 1234
BATCH = 4  # the tokens are (BATCH, tokens / BATCH) rows
DEFAULT_SIZES = "256,512,1024,2048,4096"
DEFAULT_STEPS = {256: 40, 512: 20, 1024: 10, 2048: 5, 4096: 3}  # timed steps per block
PROFILES = {"here": CPU_GLOO, "A100": A100_NVLINK}
LAYOUT = ("replicated", "replicated")  # input, output


class ShardCompute(nn.Module):
    """The per-rank matmul of one split with no communication: ``column`` multiplies the whole
    input by its rows of ``W``; ``row`` its slice of the input features by its columns of ``W``
    and adds the whole bias (as ``RowParallelLinear`` does after its all-reduce)."""

    def __init__(self, dense: nn.Linear, split: str, rank: int):
        super().__init__()
        n_out, n_in = dense.weight.shape
        self.split = split
        w = dense.weight.detach()
        if split == "column":
            rows = slice(rank * n_out // TP, (rank + 1) * n_out // TP)
            self.weight = nn.Parameter(w[rows].clone())
            self.bias = nn.Parameter(dense.bias.detach()[rows].clone())
        else:
            self.cols = slice(rank * n_in // TP, (rank + 1) * n_in // TP)
            self.weight = nn.Parameter(w[:, self.cols].clone())
            self.bias = nn.Parameter(dense.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split == "column":
            return F.linear(x, self.weight, self.bias)  # (b, t, n_out/p)
        return F.linear(x[..., self.cols].contiguous(), self.weight) + self.bias  # (b, t, n_out)


def build(n: int, ctx) -> tuple[nn.Linear, dict[str, nn.Module]]:
    """The dense linear and every method's module, all from the same dense weights."""
    torch.manual_seed(SEED)
    dense = nn.Linear(n, n)
    modules = {split: parallel_linear(dense, ctx, split) for split in ("column", "row")}
    for split in ("column", "row"):
        modules[f"{split}-compute"] = ShardCompute(dense, split, ctx.tp_rank)
    return dense, modules


def make_inputs(n: int, tokens: int, rank: int, out_width: dict[str, int]):
    """``x`` (requires grad) and, per method, the gradient of its output (this rank's slice for
    ``column-compute``); equal on all ranks where the method's output is replicated."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(BATCH, tokens // BATCH, n, generator=gen).requires_grad_()
    grad_full = torch.randn(BATCH, tokens // BATCH, n, generator=gen)
    grads = {}
    for m, width in out_width.items():
        grads[m] = grad_full if width == n else grad_full[..., rank * width:(rank + 1) * width]
    return x, {m: g.contiguous() for m, g in grads.items()}


def check(dense, modules, x, grad_out) -> dict[str, dict[str, float]]:
    """Max relative error of the output and input gradient of both splits against dense."""
    ref_y = dense(x)
    ref_y.backward(grad_out)
    ref = {"output": ref_y.detach().clone(), "input_grad": x.grad.clone()}
    x.grad = None
    dense.zero_grad(set_to_none=True)
    errors = {}
    for split in ("column", "row"):
        y = modules[split](x)
        y.backward(grad_out)
        errors[split] = {"output": rel_err(y.detach(), ref["output"]),
                         "input_grad": rel_err(x.grad, ref["input_grad"])}
        x.grad = None
        for p in modules[split].parameters():
            p.grad = None
    return errors


def count(modules, x, grads) -> dict[str, dict]:
    """The collectives of one step of each split: forward and backward ledgers."""
    out = {}
    for split in ("column", "row"):
        with CommLedger() as fwd:
            y = modules[split](x)
        with CommLedger() as bwd:
            y.backward(grads[split])
        for p in modules[split].parameters():
            p.grad = None
        x.grad = None
        out[split] = {"fwd": fwd.summary(), "bwd": bwd.summary(),
                      "wire_bytes": fwd.wire_bytes() + bwd.wire_bytes()}
    return out


def bench_size(n: int, tokens: int, ctx, rounds: int, steps: int, warmup: int) -> dict:
    """Check, count and time one size on this rank."""
    dense, modules = build(n, ctx)
    widths = {"column": n, "row": n, "column-compute": n // TP, "row-compute": n}
    x, grads = make_inputs(n, tokens, ctx.tp_rank, widths)
    errors = check(dense, modules, x, grads["column"])
    comms = count(modules, x, grads)
    times = interleave(METHODS, rounds, lambda m: time_steps(
        lambda: backward_step(modules[m], x, grads[m]), warmup, steps))
    return {"n": n, "tokens": tokens, "steps": steps, "errors": errors, "comms": comms,
            "times": times}


def rank_main(sizes: list[int], tokens: int, rounds: int, steps: int | None,
              warmup: int) -> dict:
    """What each rank runs under ``ops_transformer.launch``."""
    ctx = ops_transformer.init_parallel(tp=TP)
    results = [bench_size(n, tokens, ctx, rounds, steps or DEFAULT_STEPS.get(n, 2), warmup)
               for n in sizes]
    return {"rank": ctx.rank, "backend": ctx.backend, "threads": torch.get_num_threads(),
            "results": results}


def model_prediction(n: int, tokens: int) -> dict:
    """``choose_split`` on each profile (its choice and predicted communication ms per split),
    ``split_comm`` of each split, and the wire bytes per rank that it implies."""
    out = {}
    for name, profile in PROFILES.items():
        split, times = choose_split(tokens, n, n, TP, *LAYOUT, profile)
        out[name] = {"choice": split, "ms": {k: 1e3 * v for k, v in times.items()}}
    out["comm"] = {s: split_comm(s, tokens, n, n, *LAYOUT) for s in ("column", "row")}
    out["wire_bytes"] = {s: 4 * sum(wire_elements(k, c["elements"], TP)
                                    for d in out["comm"][s].values() for k, c in d.items())
                         for s in ("column", "row")}
    return out


def summarise(per_rank: list[dict]) -> list[dict]:
    rows = []
    for i, res0 in enumerate(per_rank[0]["results"]):
        n, tokens = res0["n"], res0["tokens"]
        stats = method_stats([rk["results"][i]["times"] for rk in per_rank], METHODS, BASELINE)
        model = model_prediction(n, tokens)
        exact = {}
        for s in ("column", "row"):
            measured = {d: {k: {"calls": v["calls"], "elements": v["elements"]}
                            for k, v in res0["comms"][s][d].items()} for d in ("fwd", "bwd")}
            exact[s] = measured == model["comm"][s]
        rows.append({"n": n, "tokens": tokens, "steps": res0["steps"], "errors": res0["errors"],
                     "comms": res0["comms"], "ledger_matches_split_comm": exact,
                     "model": model, "stats": stats,
                     "row_over_column": stats["ratio"]["row"],
                     "row_over_column_paired": stats["paired"]["row"],
                     "row_over_column_compute": (stats["ms"]["row-compute"]
                                                 / stats["ms"]["column-compute"]),
                     "row_over_column_compute_paired": paired_ratio(
                         res0["times"], "row-compute", "column-compute")})
    return rows


def print_report(rows: list[dict], meta: dict) -> None:
    print(f"ops_transformer {meta['ops_transformer']}, torch {meta['torch']}, {meta['backend']}, "
          f"tp={TP} on {TP} local ranks, {meta['threads_per_rank']} intra-op thread per rank, "
          f"{meta['cpus']} CPUs; fp32 nn.Linear(n, n) with bias, {rows[0]['tokens']} tokens, "
          f"input and output replicated; rounds={meta['rounds']} warmup={meta['warmup']}; "
          f"times are rank 0's per-step (fwd+bwd) medians")
    print("\nchecks (untimed): max rel err vs dense (output, input grad); one step's collectives")
    for r in rows:
        for s in ("column", "row"):
            e, c = r["errors"][s], r["comms"][s]
            calls = " | ".join(", ".join(f"{k} x{v['calls']} ({v['elements']})"
                                         for k, v in c[d].items()) or "-" for d in ("fwd", "bwd"))
            print(f"  n={r['n']:5d} {s:7s} {e['output']:.1e} {e['input_grad']:.1e}   fwd | bwd: "
                  f"{calls}; {c['wire_bytes'] / 2**20:.2f} MiB on the wire; equals split_comm: "
                  f"{'yes' if r['ledger_matches_split_comm'][s] else 'NO'}")
    head = (f"{'n':>5s}{'steps':>6s}{'column ms':>11s}{'row ms':>9s}{'row/col':>8s}"
            f"{'paired [min-max]':>19s}{'col-comp':>10s}{'row-comp':>10s}{'row/col':>8s}"
            f"{'paired [min-max]':>19s}")
    print("\nmeasured (rank 0): both splits, then the same shard matmuls without communication\n"
          + head + "\n" + "-" * len(head))
    for r in rows:
        ms = r["stats"]["ms"]
        print(f"{r['n']:5d}{r['steps']:6d}{ms['column']:11.2f}{ms['row']:9.2f}"
              f"{r['row_over_column']:8.2f}{format_paired(r['row_over_column_paired']):>19s}"
              f"{ms['column-compute']:10.2f}{ms['row-compute']:10.2f}"
              f"{r['row_over_column_compute']:8.2f}"
              f"{format_paired(r['row_over_column_compute_paired']):>19s}")
    head = (f"{'n':>5s}{'wire MiB col/row':>18s}   "
            + "   ".join(f"{name}: col ms, row ms -> choice" for name in PROFILES))
    print("\ncost model (choose_split: communication only, compute not modelled)\n" + head
          + "\n" + "-" * len(head))
    for r in rows:
        m = r["model"]
        wire = f"{m['wire_bytes']['column'] / 2**20:.2f}/{m['wire_bytes']['row'] / 2**20:.2f}"
        preds = "   ".join(f"{name}: {m[name]['ms']['column']:.4g}, {m[name]['ms']['row']:.4g}"
                           f" -> {m[name]['choice']}" for name in PROFILES)
        print(f"{r['n']:5d}{wire:>18s}   {preds}")
    print("\nper-round medians, ms (min-max); rank 1 pooled medians:")
    for r in rows:
        st = r["stats"]
        spread = "  ".join(f"{m} {st['round_ms'][m][0]:.2f}-{st['round_ms'][m][1]:.2f}"
                           for m in METHODS)
        rank1 = "  ".join(f"{m} {v[0]:.2f}" for m, v in st["other_ranks_ms"].items())
        print(f"  n={r['n']:5d} {spread}\n  {'':7s} rank 1: {rank1}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated n (default {DEFAULT_SIZES})")
    p.add_argument("--tokens", type=int, default=512, help="rows per step (default 512)")
    add_timing_args(p, rounds=8, steps=None, warmup=1,
                    steps_help="timed steps per method per round (default: "
                    + ", ".join(f"{v} at {k}" for k, v in DEFAULT_STEPS.items()) + ")")
    args = p.parse_args(argv)
    try:
        args.size_list = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    bad = [n for n in args.size_list if n < TP or n % TP]
    if bad:
        p.error(f"every size must be a positive multiple of tp ({TP}), got {bad}")
    if args.tokens < BATCH or args.tokens % BATCH:
        p.error(f"--tokens must be a positive multiple of {BATCH}, got {args.tokens}")
    check_count_args(p, args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t0, other = time.perf_counter(), OtherLoad()
    per_rank = ops_transformer.launch(rank_main, TP, args.size_list, args.tokens, args.rounds,
                                      args.steps, args.warmup, timeout=1800)
    other_cores = other.cores()
    meta = job_meta(per_rank[0], args, sizes=args.size_list, tokens=args.tokens,
                    other_load_cores=other_cores, reported="rank 0 per-step median")
    rows = summarise(per_rank)
    print_report(rows, meta)
    finish(t0, args.json, {"meta": meta, "rows": rows, "raw": per_rank}, other_cores)


if __name__ == "__main__":
    main()
