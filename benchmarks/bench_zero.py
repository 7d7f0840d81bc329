"""ZeRO by stage, measured per rank (docs/memory.md): our ZeRO-2 against FSDP2 at
``reshard_after_forward=False``, and stages 0–3 against the planner's memory prediction.

The reference GPT (default ``small``, fp32, AdamW) at ``--dp`` × ``--tp`` local gloo ranks (default
2 × 2), global batch ``--batch`` × ``--seq`` tokens.

``compare`` (issue 24, item 3): on every rank two copies of the same model — ``zero2``:
``zero_optimizer(stage=2)`` (our reduce-scatter of gradient buckets, all-gather of the updated
chunks), ``fsdp2``: ``shard_parameters(reshard_after_forward=False)`` + ``torch.optim.AdamW`` (FSDP2
all-gathers each unit before its forward and keeps it until its backward is done) — trained on the
same batches, steps interleaved round by round (order rotated). Reported: rank 0's median step time
and the ratio paired by round, each method's bytes per rank (below) and its collectives per step on
the data-parallel group (from the ``CommLedger``), and that the two losses agree.

``memory`` (item 5): for each stage 0 (plain AdamW), 1, 2 (``zero_optimizer``) and 3
(``shard_parameters``), per rank:

* ``params``, ``grads``, ``optimizer``: the bytes of the storages this rank holds (each once) —
  parameters and optimizer state after a step, gradients after backward (ZeRO-2: the reduced
  chunks); ZeRO-3 adds the parameters and gradients FSDP2 gathers while a unit runs, which are part
  of ``peak`` below;
* ``activations``: what one forward keeps for backward (``activation_memory``, saved tensors);
* ``peak``: the most bytes held at once during a training step: the bytes live at its start
  (parameters, optimizer state) plus the peak of the allocations and frees the step makes, read
  from ``torch.profiler``'s memory events (``profile_memory=True``; every allocation of the CPU
  allocator, FSDP2's storage resizes included);

next to the planner's ``memory_breakdown`` for the same layout (``planner.search.memory``: fp32,
fused attention kernel).

    .venv/bin/python benchmarks/bench_zero.py                       # both parts, small, dp 2 × tp 2
    .venv/bin/python benchmarks/bench_zero.py --part compare --rounds 7 --steps 4 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import ops_transformer as ot
from ops_transformer.comm.ledger import CommLedger
from ops_transformer.training.data import get_batch, load_corpus, slice_for_rank
from ops_transformer.models.gpt import preset
from ops_transformer.parallel.sharding import local_tensor
from ops_transformer.planner.search import Options, memory as planned_memory
from ops_transformer.planner.specs import ModelSpec

from _common import OtherLoad, finish, source_version

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _build(cfg, ctx, stage: int, reshard_after_forward: bool = True):
    torch.manual_seed(0)
    model = ot.parallelize(ot.GPT(cfg), ctx, attention="heads", vocab="parallel")
    if stage in (1, 2):
        return model, ot.zero_optimizer(model, ctx, torch.optim.AdamW, stage=stage, **ADAMW)
    if stage == 3:
        ot.shard_parameters(model, ctx, reshard_after_forward=reshard_after_forward)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _batch(data, step, args, ctx):
    x, y = get_batch(data, step, batch=args.batch, seq=args.seq, seed=0)
    return slice_for_rank(x, y, ctx.dp_rank, ctx.dp_size)


def _step(model, opt, x, y) -> float:
    loss = model(x, y)[1]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = local_tensor(t).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _grads(model, opt) -> list:
    grads = [p.grad for p in model.parameters()]
    return grads + [b.grad_shard for b in getattr(opt, "buckets", ())]  # ZeRO-2's chunks


def _state_bytes(model, opt) -> dict:
    state = [v for s in opt.state.values() for v in s.values()]
    return {"params": _storage_bytes(model.parameters()), "optimizer": _storage_bytes(state)}


def _peak_of_step(model, opt, x, y) -> int:
    """The most bytes the step held above what was live at its start (profiler memory events of
    every thread, in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, opt, x, y)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _measure(model, opt, data, args, ctx, step: int) -> dict:
    """The bytes of one rank (module docstring), after ``step`` warm-up steps."""
    x, y = _batch(data, step, args, ctx)
    model(x, y)[1].backward()
    grads = _storage_bytes(_grads(model, opt))
    opt.step()
    opt.zero_grad(set_to_none=True)
    start = _state_bytes(model, opt)
    peak = _peak_of_step(model, opt, *_batch(data, step + 1, args, ctx))
    acts = ot.activation_memory(model, x, y)["total_bytes"]
    return {**start, "grads": grads, "activations": acts, "peak": sum(start.values()) + peak}


def _dp_ledger(ledger, ctx) -> dict:
    dp_ranks = tuple(r for r in range(ctx.world_size) if r % ctx.tp_size == ctx.tp_rank)
    out = {}
    for r in ledger.records:
        if r.group_ranks == dp_ranks:
            e = out.setdefault(f"{r.kind} ({r.label})", {"calls": 0, "bytes": 0})
            e["calls"] += 1
            e["bytes"] += r.bytes
    return out


def _compare_job(cfg, args) -> dict:
    ctx = ot.init_parallel(tp=args.tp, dp=args.dp)
    torch.set_num_threads(1)
    data = load_corpus(None)
    methods = {"zero2": _build(cfg, ctx, 2), "fsdp2": _build(cfg, ctx, 3, False)}
    times = {m: [] for m in methods}
    losses = {m: [] for m in methods}
    ledgers = {}
    step = 0
    for name, (model, opt) in methods.items():  # one-off costs (FSDP2's lazy init), ledger
        with CommLedger() as ledger:
            losses[name].append(_step(model, opt, *_batch(data, 0, args, ctx)))
        ledgers[name] = _dp_ledger(ledger, ctx)
    for r in range(args.rounds):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in order:
            model, opt = methods[name]
            block = []
            for i in range(args.steps):
                x, y = _batch(data, 1 + r * args.steps + i, args, ctx)
                torch.distributed.barrier()
                t0 = time.perf_counter()
                losses[name].append(_step(model, opt, x, y))
                block.append(time.perf_counter() - t0)
            times[name].append(statistics.median(block))
        step = 1 + (r + 1) * args.steps
    memory = {name: _measure(model, opt, data, args, ctx, step)
              for name, (model, opt) in methods.items()}
    return {"times": times, "losses": losses, "ledger": ledgers, "memory": memory}


def _memory_job(cfg, args) -> dict:
    ctx = ot.init_parallel(tp=args.tp, dp=args.dp)
    data = load_corpus(None)
    out = {}
    for stage in (0, 1, 2, 3):
        model, opt = _build(cfg, ctx, stage)
        for step in range(2):  # AdamW's state exists; FSDP2 initialised
            _step(model, opt, *_batch(data, step, args, ctx))
        out[stage] = _measure(model, opt, data, args, ctx, 2)
        del model, opt
    return out


def _planned(cfg, args, stage: int) -> dict:
    spec = ModelSpec.from_gpt_config(cfg, seq=args.seq, global_batch=args.batch,
                                     micro_batch=args.batch // args.dp, dtype="fp32")
    o = Options(dp=args.dp, tp=args.tp, ep=1, attention="heads", sequence_parallel=False,
                recompute="none", zero_stage=stage, micro_batch=args.batch // args.dp)
    return planned_memory(spec, o, 4, "fused", "fused")


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.2f}"


def _print_compare(result: dict) -> None:
    t = result["times"]
    ratios = [a / b for a, b in zip(t["fsdp2"], t["zero2"])]
    print(f"\nZeRO-2 (ours) vs FSDP2 reshard_after_forward=False — rank 0, median of per-round "
          f"medians")
    for name in t:
        print(f"  {name:<6} {1e3 * statistics.median(t[name]):8.1f} ms/step "
              f"[{1e3 * min(t[name]):.1f}-{1e3 * max(t[name]):.1f}]")
    print(f"  fsdp2 / zero2 (paired by round): median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}]")
    gap = max(abs(a - b) / abs(b) for a, b in zip(result["losses"]["fsdp2"],
                                                   result["losses"]["zero2"]))
    print(f"  losses agree to {gap:.1e} (relative) over {len(result['losses']['zero2'])} steps")
    print(f"  {'MiB per rank':<14}" + "".join(f"{k:>12}" for k in result["memory"]["zero2"]))
    for name, mem in result["memory"].items():
        print(f"  {name:<14}" + "".join(f"{_mib(v):>12}" for v in mem.values()))
    for name, ledger in result["ledger"].items():
        print(f"  {name} per step on the dp group: " + ", ".join(
            f"{k} {v['calls']}× {v['bytes'] / 2 ** 20:.2f} MiB" for k, v in ledger.items()))


def _print_memory(measured: dict, cfg, args) -> dict:
    print(f"\nmemory per rank at dp {args.dp} × tp {args.tp} (MiB): measured / planned")
    parts = ("params", "grads", "optimizer", "activations")
    print(f"  {'stage':<6}" + "".join(f"{p:>20}" for p in (*parts, "sum", "peak")))
    table = {}
    for stage, mem in measured.items():
        plan = _planned(cfg, args, stage)
        row = {p: (mem[p], plan[p]) for p in parts}
        row["sum"] = (sum(mem[p] for p in parts), sum(plan.values()))
        row["peak"] = (mem["peak"], sum(plan.values()))
        table[stage] = row
        print(f"  {stage:<6}" + "".join(f"{_mib(a):>10} / {_mib(b):<7}" for a, b in row.values()))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method and round")
    parser.add_argument("--part", choices=("compare", "memory", "both"), default="both")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if min(args.tp, args.dp, args.rounds, args.steps) < 1 or args.dp < 2:
        parser.error("--tp, --rounds and --steps must be at least 1, --dp at least 2")
    if args.batch % args.dp:
        parser.error(f"--batch ({args.batch}) must be divisible by --dp ({args.dp})")
    cfg = preset(args.preset, max_seq_len=max(args.seq, preset(args.preset).max_seq_len))
    t0, load = time.perf_counter(), OtherLoad()
    nprocs = args.dp * args.tp
    print(f"{args.preset}: {sum(p.numel() for p in ot.GPT(cfg).parameters()) / 1e6:.2f} M "
          f"parameters, fp32, AdamW; dp {args.dp} × tp {args.tp}, batch {args.batch} × "
          f"{args.seq}; ops_transformer {source_version()}, torch {torch.__version__}")
    payload = {"preset": args.preset, "dp": args.dp, "tp": args.tp, "batch": args.batch,
               "seq": args.seq}
    if args.part in ("compare", "both"):
        payload["compare"] = ot.launch(_compare_job, nprocs, cfg, args, timeout=3600)[0]
        _print_compare(payload["compare"])
    if args.part in ("memory", "both"):
        measured = ot.launch(_memory_job, nprocs, cfg, args, timeout=3600)[0]
        payload["memory"] = {str(k): v for k, v in _print_memory(measured, cfg, args).items()}
    finish(t0, args.json, payload, load.cores())


if __name__ == "__main__":
    main()
