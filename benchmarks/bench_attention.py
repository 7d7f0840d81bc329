"""Time one GPT training step per attention strategy at tp=2, next to the cost model's prediction.

For each point ``(s, h, heads)`` the reference GPT (GELU family: ``preset("tiny", d_model=h,
n_heads=heads, d_ff=4h, max_seq_len=s)``, 2 layers, vocabulary 256) is built from one seed and
parallelised with ``parallelize(GPT(cfg), ctx, attention=strategy)`` for every strategy of
:data:`ops_transformer.planner.ATTENTION_STRATEGIES` (``heads``, ``heads_allgather``, ``kv_split``,
``naive``); the embedding and LM head follow the plan's own ``vocab="auto"`` choice (printed). One
step is: forward with targets on a batch of 4 sequences, ``loss.backward()``, ``SGD.step()``,
``zero_grad(set_to_none=True)``. The strategies are interleaved round by round (the order rotates
each round); every rank runs one intra-op thread. Reported times are rank 0's per-step wall times
(rank 1's pooled medians are printed beside them). A strategy that cannot run at a point (``heads``
with fewer heads than ranks) is listed with the reason; that point's ratios are then to the first
strategy that can.

Untimed, once per point:

* the loss of every strategy's first step against ``heads``' (same weights, same batch);
* the communication of one step from the ``CommLedger``, forward and backward separately: the whole
  step against ``LAYERS × layer_cost(...) + vocab_cost(plan.vocab, ...)``, and per layer (the ledger
  of this 2-layer model minus that of a 1-layer model) against ``layer_cost(...)`` — calls and
  elements must match exactly; wire bytes are what ring algorithms send per rank
  (``wire_elements``);
* the cost model's predicted step time on ``CPU_GLOO``: α–β communication + FLOPs at the profile's
  rate for the layers, embedding, head and loss. Norms, softmax, the optimizer and Python are not
  modelled, so compare its ratios between strategies rather than its absolute times.

    python benchmarks/bench_attention.py --points 64x64x4,512x64x2 --rounds 8 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import asdict, dataclass

import torch

import ops_transformer
from ops_transformer import GPT, CommLedger, parallelize
from ops_transformer.comm.ledger import wire_elements
from ops_transformer.models import preset
from ops_transformer.planner import (ATTENTION_STRATEGIES, CPU_GLOO, attention_problem,
                                     layer_cost, vocab_cost)

from _common import add_timing_args, check_count_args, finish
from _common import (OtherLoad, format_paired, interleave, job_meta, method_stats,
                     time_steps)

TP = 2
BATCH = 4
LAYERS = 2
SEED = 1234
LR = 1e-3
N_BATCHES = 4  # a pool of random batches, cycled
BASELINE = "heads"  # ratios are to it; to the first possible strategy where it is not
PROFILE = CPU_GLOO
DEFAULT_POINTS = "64x64x4,256x128x4,64x256x8,512x64x2,64x64x1"  # the last: heads < tp


@dataclass(frozen=True)
class Point:
    """Sequence length ``s``, hidden size ``h`` and number of heads (MHA; FFN ``4h``)."""

    s: int
    h: int
    heads: int

    @property
    def name(self) -> str:
        return f"s{self.s}-h{self.h}-a{self.heads}"

    def config(self, n_layers: int = LAYERS):
        return preset("tiny", d_model=self.h, n_heads=self.heads, d_ff=4 * self.h,
                      max_seq_len=self.s, n_layers=n_layers)


def parse_points(text: str) -> list[Point]:
    """``"64x64x4,512x64x2"`` → points (``s x h x heads``)."""
    points = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"a point is SxHxHEADS with positive integers, got {item!r}")
        points.append(Point(*map(int, parts)))
    return points


def baseline(methods: list[str]) -> str:
    """The denominator of a point's ratios: ``heads``, or the first possible strategy."""
    return BASELINE if BASELINE in methods else methods[0]


def dense_gpt(cfg) -> GPT:
    """The dense reference, from the same seed on every rank and for every strategy."""
    torch.manual_seed(SEED)
    return GPT(cfg)


def make_batches(point: Point, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``N_BATCHES`` pairs (tokens, next tokens) of shape ``(BATCH, s)``; equal on all ranks."""
    gen = torch.Generator().manual_seed(point.s * 1000 + point.h)
    pool = []
    for _ in range(N_BATCHES):
        seq = torch.randint(0, vocab, (BATCH, point.s + 1), generator=gen)
        pool.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return pool


def train_step(model, opt, idx, targets) -> torch.Tensor:
    """Forward with targets, backward, SGD step, zero_grad; returns the (detached) loss."""
    _, loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def ledger_step(model, opt, idx, targets) -> tuple[float, dict, dict, float]:
    """One step with the forward and the rest (backward + SGD) recorded by separate ledgers:
    ``(loss, forward summary, backward summary, wire bytes of the step)``."""
    with CommLedger() as fwd:
        _, loss = model(idx, targets)
    with CommLedger() as bwd:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach()), fwd.summary(), bwd.summary(), fwd.wire_bytes() + bwd.wire_bytes()


def _calls_elements(summary: dict) -> dict:
    return {k: {"calls": v["calls"], "elements": v["elements"]} for k, v in summary.items()}


def _minus(a: dict, b: dict) -> dict:
    """Per-kind calls and elements of ledger summary ``a`` less those of ``b`` (kinds with no
    calls left dropped)."""
    out = {}
    for kind, v in a.items():
        w = b.get(kind, {"calls": 0, "elements": 0})
        if v["calls"] - w["calls"]:
            out[kind] = {"calls": v["calls"] - w["calls"],
                         "elements": v["elements"] - w["elements"]}
    return out


def _wire_bytes(comm: dict, bytes_per_element: int = 4) -> float:
    return sum(wire_elements(k, c["elements"], TP) * bytes_per_element for k, c in comm.items())


def predicted(point: Point, strategy: str, vocab: str) -> dict:
    """The cost model of one layer (``layer_cost``) and of the step: ``LAYERS`` layers plus the
    embedding, LM head and loss in the plan's ``vocab`` mode (``vocab_cost``); the step's time on
    ``PROFILE`` (α–β communication + FLOPs at the profile's rate; norms, softmax, the optimizer and
    Python are not modelled)."""
    cfg = point.config()
    layer = layer_cost(strategy, BATCH, point.s, point.h, point.heads, cfg.n_kv_heads, cfg.d_ff,
                       TP, bias=cfg.bias)
    step = vocab_cost(vocab, BATCH, point.s, point.h, cfg.vocab_size, TP)
    for _ in range(LAYERS):
        step = step + layer
    comm_s, compute_s = PROFILE.comm_time(step.total(), TP), PROFILE.compute_time(step.flops)
    return {"fwd": layer.fwd, "bwd": layer.bwd, "layer_wire_bytes": _wire_bytes(layer.total()),
            "step_fwd": step.fwd, "step_bwd": step.bwd,
            "step_wire_bytes": _wire_bytes(step.total()),
            "step_comm_ms": 1e3 * comm_s, "step_compute_ms": 1e3 * compute_s,
            "step_ms": 1e3 * (comm_s + compute_s)}


def measure_comms(point: Point, strategy: str, ctx, model, opt, batch) -> dict:
    """The ledger of one step of the timed model, and per layer: it minus a 1-layer model's."""
    loss, fwd2, bwd2, wire2 = ledger_step(model, opt, *batch)
    one = parallelize(dense_gpt(point.config(n_layers=1)), ctx, attention=strategy)
    _, fwd1, bwd1, wire1 = ledger_step(one, torch.optim.SGD(one.parameters(), lr=LR), *batch)
    plan = model.parallel_plan
    return {"first_loss": loss, "vocab": getattr(plan, "vocab", "parallel"), "reason": plan.reason,
            "step": {"fwd": fwd2, "bwd": bwd2}, "step_wire_bytes": wire2,
            "layer": {"fwd": _minus(fwd2, fwd1), "bwd": _minus(bwd2, bwd1)},
            "layer_wire_bytes": wire2 - wire1, "outside_wire_bytes": 2 * wire1 - wire2}


def bench_point(point: Point, ctx, rounds: int, steps: int, warmup: int) -> dict:
    """Check, count and time every possible strategy at one point on this rank."""
    cfg = point.config()
    problems = {m: attention_problem(cfg, TP, m, point.s) for m in ATTENTION_STRATEGIES}
    methods = [m for m in ATTENTION_STRATEGIES if problems[m] is None]
    models = {m: parallelize(dense_gpt(cfg), ctx, attention=m) for m in methods}
    opts = {m: torch.optim.SGD(models[m].parameters(), lr=LR) for m in methods}
    batches = make_batches(point, cfg.vocab_size)
    comms = {m: measure_comms(point, m, ctx, models[m], opts[m], batches[0]) for m in methods}
    cycles = {m: itertools.cycle(batches) for m in methods}

    def block(method: str) -> list[float]:
        model, opt, cycle = models[method], opts[method], cycles[method]
        return time_steps(lambda: train_step(model, opt, *next(cycle)), warmup, steps)

    times = interleave(methods, rounds, block)
    return {"point": asdict(point), "name": point.name, "config": cfg.to_dict(),
            "methods": methods, "problems": {m: p for m, p in problems.items() if p},
            "comms": comms, "times": times}


def rank_main(points: list[Point], rounds: int, steps: int, warmup: int) -> dict:
    """What each rank runs under ``ops_transformer.launch``."""
    ctx = ops_transformer.init_parallel(tp=TP)
    return {"rank": ctx.rank, "backend": ctx.backend, "threads": torch.get_num_threads(),
            "results": [bench_point(p, ctx, rounds, steps, warmup) for p in points]}


def summarise(per_rank: list[dict]) -> list[dict]:
    """One row per point: timing stats (rank 0), ledger vs model, losses against the baseline."""
    rows = []
    for i, res0 in enumerate(per_rank[0]["results"]):
        point, methods = Point(**res0["point"]), res0["methods"]
        base = baseline(methods)
        stats = method_stats([rk["results"][i]["times"] for rk in per_rank], methods, base)
        base_loss = res0["comms"][base]["first_loss"]
        model = {m: predicted(point, m, res0["comms"][m]["vocab"]) for m in methods}
        per_method = {}
        for m in methods:
            c, p = res0["comms"][m], model[m]
            per_method[m] = {
                "first_loss": c["first_loss"],
                "loss_rel_diff": abs(c["first_loss"] - base_loss) / abs(base_loss),
                "layer_ledger": c["layer"], "layer_model": {"fwd": p["fwd"], "bwd": p["bwd"]},
                "vocab": c["vocab"], "plan_reason": c["reason"],
                "layer_exact": (_calls_elements(c["layer"]["fwd"]) == p["fwd"]
                                and _calls_elements(c["layer"]["bwd"]) == p["bwd"]),
                "step_exact": (_calls_elements(c["step"]["fwd"]) == p["step_fwd"]
                               and _calls_elements(c["step"]["bwd"]) == p["step_bwd"]),
                "layer_wire_bytes": c["layer_wire_bytes"],
                "layer_wire_bytes_model": p["layer_wire_bytes"],
                "step_wire_bytes": c["step_wire_bytes"],
                "step_wire_bytes_model": p["step_wire_bytes"],
                "outside_wire_bytes": c["outside_wire_bytes"],
                "model_step_ms": p["step_ms"], "model_step_comm_ms": p["step_comm_ms"],
                "model_step_compute_ms": p["step_compute_ms"],
                "model_ratio": p["step_ms"] / model[base]["step_ms"],
            }
        rows.append({"point": res0["point"], "name": res0["name"], "config": res0["config"],
                     "methods": methods, "baseline": base, "problems": res0["problems"],
                     "stats": stats, "per_method": per_method})
    return rows


def _kb(x: float) -> str:
    return f"{x / 1024:.1f}"


def print_row(row: dict) -> None:
    """The checks and the tables of one point."""
    p, c, st, pm = row["point"], row["config"], row["stats"], row["per_method"]
    print(f"\n[{row['name']}] s={p['s']} h={p['h']} heads={p['heads']} (head_dim "
          f"{p['h'] // p['heads']}), d_ff={c['d_ff']}, {c['n_layers']} layers, batch {BATCH}, "
          f"vocab {c['vocab_size']}")
    vocab = {(q["vocab"], q["plan_reason"].split("; ")[-1]) for q in pm.values()}
    for mode, why in sorted(vocab):
        print(f"  embedding / LM head: vocab {mode} (the plan's choice: {why})")
    for m, why in row["problems"].items():
        print(f"  {m}: not possible ({why})")
    if row["baseline"] != BASELINE:
        print(f"  ratios are to {row['baseline']} ({BASELINE} is not possible); loss rel diff too")
    b = row["baseline"][:5]
    head = (f"  {'strategy':16s}{'step ms':>9s}{'/' + b:>8s}{'paired [min-max]':>19s}"
            f"{'model ms':>10s}{'model/' + b:>12s}{'loss rel diff':>15s}")
    print(head + "\n  " + "-" * (len(head) - 2))
    for m in row["methods"]:
        q = pm[m]
        print(f"  {m:16s}{st['ms'][m]:9.2f}{st['ratio'][m]:8.2f}"
              f"{format_paired(st['paired'][m]):>19s}{q['model_step_ms']:10.2f}"
              f"{q['model_ratio']:12.2f}{q['loss_rel_diff']:15.1e}")
    head = (f"  {'strategy':16s}{'step KB':>9s}{'model KB':>10s}{'exact':>7s}{'layer KB':>10s}"
            f"{'model KB':>10s}{'exact':>7s}{'/' + b:>8s}   per layer fwd | bwd (ledger)")
    print("\n  wire bytes per rank (ring algorithms): CommLedger vs the model, per step and per "
          "layer\n" + head + "\n  " + "-" * (len(head) - 2))
    base = pm[row["baseline"]]["layer_wire_bytes"]
    for m in row["methods"]:
        q = pm[m]
        calls = " | ".join(", ".join(f"{k} x{v['calls']} ({v['elements']})"
                                     for k, v in q["layer_ledger"][d].items())
                           for d in ("fwd", "bwd"))
        print(f"  {m:16s}{_kb(q['step_wire_bytes']):>9s}{_kb(q['step_wire_bytes_model']):>10s}"
              f"{'yes' if q['step_exact'] else 'NO':>7s}{_kb(q['layer_wire_bytes']):>10s}"
              f"{_kb(q['layer_wire_bytes_model']):>10s}{'yes' if q['layer_exact'] else 'NO':>7s}"
              f"{q['layer_wire_bytes'] / base:8.2f}   {calls}")
    spread = "  ".join(f"{m} {st['round_ms'][m][0]:.1f}-{st['round_ms'][m][1]:.1f}"
                       for m in row["methods"])
    rank1 = "  ".join(f"{m} {v[0]:.2f}" for m, v in st["other_ranks_ms"].items())
    print(f"  per-round medians, ms (min-max): {spread}\n  rank 1 pooled medians, ms: {rank1}")


def print_report(rows: list[dict], meta: dict) -> None:
    print(f"ops_transformer {meta['ops_transformer']}, torch {meta['torch']}, {meta['backend']}, "
          f"tp={TP} on {TP} local ranks, {meta['threads_per_rank']} intra-op thread per rank, "
          f"{meta['cpus']} CPUs; rounds={meta['rounds']} steps={meta['steps']} "
          f"warmup={meta['warmup']}; SGD lr={LR}; times are rank 0's per-step medians; model: "
          f"{LAYERS} x layer_cost + vocab_cost on {PROFILE.name}")
    for row in rows:
        print_row(row)


def _config_problem(point: Point) -> str | None:
    """Why ``point`` cannot be benchmarked at ``TP``: an invalid config, an FFN that does not
    split, or no possible strategy."""
    try:
        cfg = point.config()
    except ValueError as exc:
        return str(exc)
    if cfg.d_ff % TP:
        return f"d_ff ({cfg.d_ff}) is not divisible by tp ({TP})"
    problems = [attention_problem(cfg, TP, m, point.s) for m in ATTENTION_STRATEGIES]
    if all(problems):
        return "no attention strategy is possible: " + "; ".join(problems)
    return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default=DEFAULT_POINTS,
                   help=f"comma-separated SxHxHEADS (default {DEFAULT_POINTS})")
    add_timing_args(p, rounds=12, steps=8, warmup=1,
                    steps_help="timed steps per strategy per round (default 8)")
    args = p.parse_args(argv)
    try:
        args.point_list = parse_points(args.points)
    except ValueError as exc:
        p.error(str(exc))
    for point in args.point_list:
        cfg_problem = _config_problem(point)
        if cfg_problem:
            p.error(f"point {point.name}: {cfg_problem}")
    check_count_args(p, args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t0, other = time.perf_counter(), OtherLoad()
    per_rank = ops_transformer.launch(rank_main, TP, args.point_list, args.rounds, args.steps,
                                      args.warmup, timeout=1800)
    other_cores = other.cores()
    meta = job_meta(per_rank[0], args, points=args.points, batch=BATCH, layers=LAYERS, lr=LR,
                    profile=PROFILE.name, other_load_cores=other_cores,
                    reported="rank 0 per-step median")
    rows = summarise(per_rank)
    print_report(rows, meta)
    finish(t0, args.json, {"meta": meta, "rows": rows, "raw": per_rank}, other_cores)


if __name__ == "__main__":
    main()
