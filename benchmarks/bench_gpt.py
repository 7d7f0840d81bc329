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
import itertools
import os
import platform
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ops_transformer
from ops_transformer import GPT, CommLedger, ParallelContext, Plan, parallelize
from ops_transformer.models import preset

from _common import add_timing_args, finish
from _common import (OtherLoad, check_counts, format_paired, interleave, median_ms,
                     paired_ratio, source_version, time_steps)

METHODS = ("ours", "ours-proj", "dtensor", "plain", "tp1")
RANK0_ONLY = ("plain", "tp1")
RATIOS = (("ours", "dtensor"), ("ours-proj", "dtensor"), ("ours", "plain"), ("tp1", "plain"),
          ("ours", "ours-proj"))
TP = 2
SEED = 1234
LR = 1e-5  # small, so the model stays near its initialisation over all timed steps
N_BATCHES = 8  # a pool of random batches, cycled


@dataclass(frozen=True)
class Size:
    """A GPT preset, the batch (``batch`` sequences of ``seq`` tokens), and the default numbers of
    timed and untimed (warm-up) steps per block."""

    name: str
    preset: str
    batch: int
    seq: int
    steps: int
    warmup: int


SIZES = {
    "small": Size("small", "tiny", batch=8, seq=64, steps=30, warmup=3),  # 2 layers, d 64
    "medium": Size("medium", "small", batch=8, seq=128, steps=3, warmup=1),  # 4 layers, d 256
}


def dense_gpt(cfg) -> GPT:
    """The dense reference model, from the same seed on every rank and for every method."""
    torch.manual_seed(SEED)
    return GPT(cfg)


def applied_plan(model: nn.Module) -> Plan:
    """The plan ``parallelize`` applied."""
    return model.parallel_plan


def projections_plan(full: Plan) -> Plan:
    """``full`` without the embedding and LM-head rules: the projections DTensor gets."""
    rules = {k: v for k, v in full.rules.items() if k not in ("tok_emb", "lm_head")}
    return Plan(rules=rules, attention=full.attention, reason="projections only (as DTensor)",
                vocab="replicated")


def dtensor_gpt(cfg, tp_mesh) -> nn.Module:
    """The dense GPT with DTensor TP on each block's projections (as torchtitan applies it)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    model = dense_gpt(cfg)
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.w_in": ColwiseParallel(), "mlp.w_out": RowwiseParallel(),
        })
    return model


def build_models(cfg, ctx) -> dict[str, nn.Module]:
    """Every method's model of one size (``plain`` and ``tp1`` on rank 0 only)."""
    ours = parallelize(dense_gpt(cfg), ctx)
    models = {"ours": ours,
              "ours-proj": parallelize(dense_gpt(cfg), ctx,
                                       plan=projections_plan(applied_plan(ours))),
              "dtensor": dtensor_gpt(cfg, ctx.mesh["tp"])}
    if ctx.rank == 0:
        models["plain"] = dense_gpt(cfg)
        models["tp1"] = parallelize(dense_gpt(cfg), ParallelContext.single())
    return models


def make_batches(size: Size, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``N_BATCHES`` pairs of (tokens, next tokens), each ``(batch, seq)``; equal on all ranks."""
    gen = torch.Generator().manual_seed(size.batch * 1000 + size.seq)
    pool = []
    for _ in range(N_BATCHES):
        seq = torch.randint(0, vocab, (size.batch, size.seq + 1), generator=gen)
        pool.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return pool


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    """Forward with targets, backward, AdamW step, zero_grad; returns the (detached) loss."""
    _, loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def check_losses(models, opts, batches) -> dict[str, list[float]]:
    """Untimed: the losses of the first two steps of every method (same batches, same weights)."""
    return {m: [float(train_step(models[m], opts[m], *batches[i])) for i in range(2)]
            for m in models}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives that reach the dispatcher — DTensor's functional collectives and
    ``torch.distributed``'s c10d ops — with the elements of their input, by op name.

    ``CommDebugMode`` would do for DTensor, but its module tracker fails on the GPT's forward in
    torch 2.13 (``IndexError`` in ``_fw_set_module_hook``); this is the part of it we need. Like
    it, a DTensor op is passed on (``NotImplemented``) so that its desugared collectives are seen.
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        namespace = getattr(func, "namespace", "")
        name = func._opname if hasattr(func, "_opname") else str(func)
        if namespace in ("_c10d_functional", "c10d") and not name.startswith(
                ("wait", "barrier", "monitored_barrier", "_wrap")):
            tensors = [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]
            entry = self.counts.setdefault(name, {"calls": 0, "elements": 0})
            entry["calls"] += 1
            entry["elements"] += sum(t.numel() for t in tensors)
        return func(*args, **(kwargs or {}))


def count_collectives(models, opts, batch) -> dict[str, dict]:
    """One step's collectives as the process group sees them (:class:`CollectiveCounter`) for the
    tp=2 methods, and for ours also our ``CommLedger`` (by kind and by label)."""
    out = {}
    for m in ("ours", "ours-proj", "dtensor"):
        with CommLedger() as ledger, CollectiveCounter() as counter:
            train_step(models[m], opts[m], *batch)
        out[m] = {"dispatched": counter.counts}
        if m != "dtensor":
            out[m]["ledger"] = ledger.summary()
            out[m]["labels"] = dict(Counter(f"{r.kind}:{r.label}" for r in ledger.records))
    return out


def bench_size(size: Size, ctx, rounds: int, steps: int | None, warmup: int | None) -> dict:
    """Check, count and time one size on this rank (``None``: the size's default)."""
    cfg = preset(size.preset)
    models = build_models(cfg, ctx)
    opts = {m: torch.optim.AdamW(model.parameters(), lr=LR) for m, model in models.items()}
    batches = make_batches(size, cfg.vocab_size)
    losses = check_losses(models, opts, batches)
    same_tp1 = repr(models["tp1"]) == repr(models["plain"]) if "tp1" in models else None
    plan = applied_plan(models["ours"])
    attention = f"{plan.attention} ({plan.reason})" if plan.reason else plan.attention
    comms = count_collectives(models, opts, batches[2])
    cycles = {m: itertools.cycle(batches) for m in models}  # per method: ranks stay in step
    steps = steps or size.steps
    warmup = size.warmup if warmup is None else warmup

    def block(method: str) -> list[float]:
        model, opt, cycle = models[method], opts[method], cycles[method]
        return time_steps(lambda: train_step(model, opt, *next(cycle)), warmup, steps)

    times = interleave(METHODS, rounds, block, rank0_only=RANK0_ONLY)
    last = {m: float(train_step(models[m], opts[m], *batches[0])) for m in models}
    return {"size": asdict(size), "config": cfg.to_dict(), "steps": steps, "warmup": warmup,
            "tp1_same_as_plain": same_tp1, "attention": attention, "losses": losses,
            "last_losses": last, "comms": comms, "times": times,
            "params": {m: sum(p.numel() for p in models[m].parameters()) for m in models}}


def rank_main(sizes: list[Size], rounds: int, steps: int | None, warmup: int | None) -> dict:
    """What each rank runs under ``ops_transformer.launch``."""
    ctx = ops_transformer.init_parallel(tp=TP)
    results = [bench_size(size, ctx, rounds, steps, warmup) for size in sizes]
    return {"rank": ctx.rank, "backend": ctx.backend, "threads": torch.get_num_threads(),
            "results": results}


def _key(num: str, den: str) -> str:
    return f"{num}/{den}"


def summarise(per_rank: list[dict]) -> list[dict]:
    """One row per size: rank 0's median step time per method (all steps of all rounds pooled),
    the spread of its per-round medians, rank 1's medians, and the ratios (pooled and paired)."""
    rows = []
    for i, res0 in enumerate(per_rank[0]["results"]):
        times = res0["times"]
        plain = res0["losses"]["plain"]
        row = {k: res0[k] for k in ("size", "config", "steps", "warmup", "tp1_same_as_plain",
                                    "attention", "comms", "params", "last_losses")}
        row["loss_rel_diff"] = {m: [abs(a - b) / abs(b) for a, b in zip(loss, plain)]
                                for m, loss in res0["losses"].items() if m != "plain"}
        row["plain_losses"] = plain
        row["ms"], row["round_ms"], row["rank1_ms"] = {}, {}, {}
        for m in METHODS:
            row["ms"][m] = median_ms(times[m])
            per_round = [median_ms([block]) for block in times[m]]
            row["round_ms"][m] = [min(per_round), max(per_round)]
            if m not in RANK0_ONLY:
                row["rank1_ms"][m] = median_ms(per_rank[1]["results"][i]["times"][m])
        row["ratios"] = {_key(n, d): row["ms"][n] / row["ms"][d] for n, d in RATIOS}
        row["paired"] = {_key(n, d): paired_ratio(times, n, d) for n, d in RATIOS}
        rows.append(row)
    return rows


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
