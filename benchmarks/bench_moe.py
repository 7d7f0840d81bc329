"""Time one training step of the ``moe-small`` MoE GPT on 2 ranks: experts spread over ep=2 vs all
experts on every rank, TP-split (ep=1, tp=2); and the model in one process.

One step is the loss of a global batch of ``--batch`` sequences of ``--seq`` tokens, backward, an
AdamW step and ``zero_grad``. Methods run in the same job, interleaved round by round:

* ``ep2``    — ``init_parallel(ep=2)``: each rank holds 4 of the 8 experts of every MoE layer and
  reads half the batch; tokens reach their experts by all-to-alls; attention, embedding and
  router are replicated and their gradients averaged over the two ranks (one bucketed all-reduce);
* ``tp2``    — ``init_parallel(tp=2)``: every rank holds every expert, each column→row split over
  TP (and attention head-parallel); both ranks read the whole batch;
* ``single`` — the unsharded model in one process (rank 0) on the whole batch; rank 1 waits.

Tokens per second per rank = ``batch·seq / step time / ranks`` (1 rank for ``single``). Every rank
runs one intra-op thread. Before timing, each method's first loss is checked against the unsharded
model's on the same rows (for ``ep2``: the mean of the two micro-batch losses, each computed with
its own capacity, as the single-device MoE fed the same micro-batches), and the collectives of one
step are counted with the ``CommLedger``.

    python benchmarks/bench_moe.py --batch 8 --seq 128 --rounds 6 --json out.json
"""

from __future__ import annotations

import argparse
import time

import torch

import ops_transformer
from ops_transformer import GPT, CommLedger, parallelize
from ops_transformer.models import preset

from _common import (OtherLoad, add_timing_args, check_count_args, finish, format_paired,
                     interleave, job_meta, method_stats, time_steps)

METHODS = ("tp2", "ep2", "single")  # the baseline first
RANKS = 2
SEED, LR = 0, 1e-3


def _model(ctx, seq):
    torch.manual_seed(SEED)  # the same dense weights for every method
    model = GPT(preset("moe-small", max_seq_len=max(256, seq)))
    return parallelize(model, ctx) if ctx is not None else model


def _batch(batch, seq):
    return torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(1))


def rank_main(batch: int, seq: int, rounds: int, steps: int, warmup: int) -> dict:
    contexts = {"ep2": ops_transformer.init_parallel(ep=RANKS),
                "tp2": ops_transformer.init_parallel(tp=RANKS)}
    rank = contexts["ep2"].rank
    data = _batch(batch, seq)
    rows = {"ep2": data.chunk(RANKS)[contexts["ep2"].ep_rank], "tp2": data, "single": data}
    models = {m: _model(contexts.get(m), seq) for m in METHODS if m != "single" or rank == 0}
    opts = {m: torch.optim.AdamW(model.parameters(), lr=LR) for m, model in models.items()}
    checks = _check(models, rows, contexts, data)

    def block(method):
        model, opt, x = models[method], opts[method], rows[method]

        def step():
            model(x[:, :-1], x[:, 1:])[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return time_steps(step, warmup, steps)

    times = interleave(METHODS, rounds, block, rank0_only=("single",))
    return {"rank": rank, "backend": contexts["ep2"].backend, "threads": torch.get_num_threads(),
            "times": times, "checks": checks}


def _check(models, rows, contexts, data) -> dict:
    """First losses against the unsharded model (untimed), and one step's collectives."""
    from ops_transformer.comm import collectives as C

    out = {}
    for method in ("ep2", "tp2"):
        x = rows[method]
        with CommLedger() as ledger:
            loss = models[method](x[:, :-1], x[:, 1:])[1]
            loss.backward()
        models[method].zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        if method == "ep2":  # the mean over the two micro-batches
            C.all_reduce(loss, contexts["ep2"].ep_group, label="bench_check")
            loss /= RANKS
        out[method] = {"loss": float(loss), "comm": ledger.summary()}
    if "single" in models:
        reference = _model(None, data.shape[1] - 1)
        with torch.no_grad():
            whole = reference(data[:, :-1], data[:, 1:])[1]
            halves = [reference(x[:, :-1], x[:, 1:])[1] for x in data.chunk(RANKS)]
        out["reference"] = {"tp2": float(whole), "ep2": float(sum(halves) / RANKS)}
    return out


def print_report(per_rank, meta, batch, seq) -> dict:
    stats = method_stats([r["times"] for r in per_rank], METHODS, "tp2", rank0_only=("single",))
    checks = per_rank[0]["checks"]
    print(f"moe-small (8 experts, top-2, capacity 1.25), batch {batch} × seq {seq}, AdamW; "
          f"{RANKS} local ranks, {meta['threads_per_rank']} thread each, {meta['backend']}; "
          f"rounds={meta['rounds']}; times are rank 0's per-step medians")
    for method in ("ep2", "tp2"):
        ref = checks["reference"][method]
        err = abs(checks[method]["loss"] - ref) / abs(ref)
        comm = ", ".join(f"{k} {v['calls']}× {v['bytes'] / 2**20:.2f} MB"
                         for k, v in sorted(checks[method]["comm"].items()))
        print(f"  check {method}: first loss {checks[method]['loss']:.6f} vs unsharded "
              f"{ref:.6f} (rel. err {err:.1e}); collectives of one step (rank 0): {comm}")
    print(f"\n{'method':<8} {'ms/step':>9} {'tokens/s/rank':>14} {'vs tp2 (paired)':>22}")
    for m in METHODS:
        ranks = 1 if m == "single" else RANKS
        tok = batch * seq / (stats["ms"][m] / 1e3) / ranks
        print(f"{m:<8} {stats['ms'][m]:>9.1f} {tok:>14,.0f} {format_paired(stats['paired'][m]):>22}")
    return stats


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    add_timing_args(p, rounds=6, steps=5, steps_help="timed steps per block (default 5)",
                    warmup=1)
    args = p.parse_args(argv)
    check_count_args(p, args)
    if args.batch % RANKS or args.batch < RANKS:
        p.error(f"--batch must be a positive multiple of {RANKS}, got {args.batch}")
    if not 1 <= args.seq <= 1024:
        p.error(f"--seq must be in 1..1024, got {args.seq}")
    t0, other = time.perf_counter(), OtherLoad()
    per_rank = ops_transformer.launch(rank_main, RANKS, args.batch, args.seq, args.rounds,
                                      args.steps, args.warmup, timeout=1800)
    other_cores = other.cores()
    meta = job_meta(per_rank[0], args, batch=args.batch, seq=args.seq, lr=LR,
                    other_load_cores=other_cores)
    stats = print_report(per_rank, meta, args.batch, args.seq)
    finish(t0, args.json, {"meta": meta, "stats": stats, "checks": per_rank[0]["checks"],
                           "raw": [r["times"] for r in per_rank]}, other_cores)


if __name__ == "__main__":
    main()
